"""The re-measure and the report of ``benchmarks/gpu_savers.sh`` (issue 30, models that do not fit): zerotune and
DeepSpeed's autotuner on a GPT-2 of 1.31B parameters under a 24 GiB device budget, side by side.

Per tuner: its answer's ZeRO stage, offload (``offload_optimizer`` / ``offload_param`` devices), activation
checkpointing (whether the answer's command passes the Trainer's ``--gradient_checkpointing`` on, and zerotune's
``gradient_checkpointing`` key), mbs and gas; the samples/s the tuner reported and the samples/s re-measured end
to end; the tuning wall time, launches and OOM launches (:func:`benchmarks.gpu_compare.tuner_report`, whose
per-experiment table follows). A tuner stopped by its time limit answers with the best experiment it finished.

The re-measure (``measure``) is a plain run of the answer's command (``cmd_optimal.txt``, else the answer
experiment's ``cmd.txt``): the same script and flags (mbs, gas, ``--gradient_checkpointing``), the answer's config
without its ``autotuning`` section, ``--max_steps STEPS``, under the same budget
(``benchmarks/gpu_savers_train.py``'s cap) and with its step clock: samples/s over the steps after the first 2.

Run: ``python3 -m benchmarks.gpu_savers measure --tool zt|ds --root DIR --out JSON --limit S --steps N
--budget-bytes B --port P`` and ``python3 -m benchmarks.gpu_savers report --zt DIR --zt-wall S --zt-rc RC
--zt-t0 T --ds DIR --ds-wall S --ds-rc RC --ds-t0 T [--json PATH]`` (each DIR holds ``results/`` and ``exps/``,
and ``remeasure.json`` once measured).
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.compare_deepspeed import chosen, ds_results, read_json, zt_results
from benchmarks.gpu_compare import OOM_MARKERS, GiB, render, tuner_report
from benchmarks.gpu_savers_train import BUDGET_ENV, CLOCK_ENV, WARMUP_ENV
from zerotune.deepspeed.args import flag_value

WRAPPER = Path(__file__).resolve().with_name("gpu_savers_train.py")
TOOLS = {"zt": "zerotune", "ds": "deepspeed"}
_TRUE = ("", "yes", "true", "t", "y", "1")  # transformers' string_to_bool; "" is the bare flag


def answer(tool: str, root: Path) -> dict[str, Any]:
    """The tuner's answer in ``root``: its config, reported samples/s, experiment, whether the tuner wrote it, and
    the command it runs with (``cmd_optimal.txt``, else the experiment's ``cmd.txt``; None when there is none)."""
    results = root / "results"
    if tool == "zt":
        exps, exp_dir = zt_results(root)["experiments"], root / "exps"
    else:
        exps, exp_dir = ds_results(results, "throughput")["experiments"], results
    cfg, metric, name, by_tuner = chosen(results, exps)
    cmd_file = results / "cmd_optimal.txt" if by_tuner else exp_dir / str(name) / "cmd.txt"
    command = cmd_file.read_text().strip() if cfg is not None and cmd_file.is_file() else None
    return {"config": cfg, "samples_per_s": metric, "experiment": name, "by_tuner": by_tuner, "command": command}


def script_args(command: str) -> list[str]:
    """The arguments after the training script (``gpu_savers_train.py``) in a launcher command line."""
    words = shlex.split(command)
    at = next((i for i, w in enumerate(words) if w.endswith(WRAPPER.name)), None)
    if at is None:
        raise ValueError(f"no {WRAPPER.name} in the command: {command[:200]}")
    return words[at + 1:]


def measure_args(args: list[str], config_path: str, steps: int, output_dir: str) -> list[str]:
    """``args`` with the launcher's ``--local_rank`` and the tuner's ``--deepspeed`` value dropped, then this run's
    config, ``--max_steps`` and ``--output_dir`` (the parser takes a flag's last occurrence)."""
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        if a in ("--deepspeed", "--local_rank"):
            skip = i + 1 < len(args) and not args[i + 1].startswith("--")
            continue
        if a.startswith(("--deepspeed=", "--local_rank=")):
            continue
        out.append(a)
    return out + ["--deepspeed", config_path, "--max_steps", str(steps), "--output_dir", output_dir]


def checkpointing(args: list[str] | None) -> bool | None:
    """Whether these script arguments turn the Trainer's ``--gradient_checkpointing`` on (None: no command)."""
    if args is None:
        return None
    value = flag_value(args, "--gradient_checkpointing")
    return value is not None and value.lower() in _TRUE


def offload(cfg: dict | None) -> str:
    """``opt``, ``param``, ``opt+param`` (each with its device when not cpu) or ``none``."""
    zero = (cfg or {}).get("zero_optimization") or {}
    parts = []
    for key, short in (("offload_optimizer", "opt"), ("offload_param", "param")):
        device = (zero.get(key) or {}).get("device", "none")
        if device != "none":
            parts.append(short if device == "cpu" else f"{short}:{device}")
    return "+".join(parts) or "none"


def measure(tool: str, root: Path, limit_s: float, steps: int, budget_bytes: int, port: int) -> dict[str, Any]:
    """Run the answer's command for ``steps`` optimizer steps (killed at ``limit_s``); its clock and exit."""
    ans = answer(tool, root)
    out: dict[str, Any] = {"tool": TOOLS[tool], "experiment": ans["experiment"], "command": None, "rc": None,
                           "wall_s": None, "timed_out": False, "oom": False, "clock": None, "skipped": None}
    if ans["config"] is None or ans["command"] is None:
        out["skipped"] = "no answer" if ans["config"] is None else "no command for the answer"
        return out
    work = root / "remeasure"
    work.mkdir(parents=True, exist_ok=True)
    config = {k: v for k, v in ans["config"].items() if k != "autotuning"}
    (work / "ds_config.json").write_text(json.dumps(config, indent=1) + "\n")
    args = measure_args(script_args(ans["command"]), str(work / "ds_config.json"), steps, str(work / "hf"))
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--num_gpus", "1", "--master_port", str(port),
           str(WRAPPER), *args]
    clock = work / "clock.jsonl"
    clock.unlink(missing_ok=True)
    env = dict(os.environ, **{BUDGET_ENV: str(budget_bytes), CLOCK_ENV: str(clock), WARMUP_ENV: "2"})
    out["command"] = shlex.join(cmd)
    t0 = time.monotonic()
    with open(work / "run.log", "w") as log:
        proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            out["rc"] = proc.wait(timeout=limit_s)
        except subprocess.TimeoutExpired:
            out["timed_out"] = True
        finally:
            _kill_group(proc)
    out["wall_s"] = round(time.monotonic() - t0, 1)
    text = (work / "run.log").read_text(errors="replace")[-300_000:].lower()
    out["oom"] = any(m in text for m in OOM_MARKERS)
    lines = clock.read_text().splitlines() if clock.is_file() else []
    out["clock"] = json.loads(lines[-1]) if lines else None
    return out


def _kill_group(proc: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            continue


def savers_row(tool: str, root: Path, tuner: dict[str, Any]) -> dict[str, Any]:
    """One tuner's line: its answer's savers and batch, reported and re-measured samples/s, wall, launches, OOMs."""
    ans = answer(tool, root)
    cfg = ans["config"]
    try:
        args = script_args(ans["command"]) if ans["command"] else None
    except ValueError:
        args = None
    measured = read_json(root / "remeasure.json") or {}
    clock = measured.get("clock") or {}
    return {"tuner": TOOLS[tool], "stage": None if cfg is None else (cfg.get("zero_optimization") or {}).get("stage"),
            "offload": None if cfg is None else offload(cfg), "checkpointing": checkpointing(args),
            "checkpointing_key": None if cfg is None else cfg.get("gradient_checkpointing"),
            "mbs": None if cfg is None else cfg.get("train_micro_batch_size_per_gpu"),
            "gas": None if cfg is None else cfg.get("gradient_accumulation_steps"),
            "reported_samples_per_s": ans["samples_per_s"], "remeasured_samples_per_s": clock.get("samples_per_s"),
            "remeasured_peak_reserved_bytes": clock.get("max_reserved_bytes"),
            "remeasure": measured, "wall_s": tuner["wall_s"], "timed_out": tuner["timed_out"],
            "launches": tuner["launches"], "oom_launches": tuner["oom_launches"],
            "chosen_by": tuner["chosen_by"] if cfg is not None else "none"}


def _fmt(x: Any, nd: int = 1) -> str:
    if x is None:
        return "-"
    if isinstance(x, bool):
        return "on" if x else "off"
    return f"{x:.{nd}f}" if isinstance(x, float) else str(x)


def render_savers(rows: list[dict[str, Any]]) -> str:
    lines = [f"{'tuner':<10} {'stage':>5} {'offload':<10} {'ckpt':<5} {'mbs':>4} {'gas':>3} {'reported':>9} "
             f"{'re-measured':>11} {'peak GiB':>8} {'wall s':>7} {'launches':>8} {'OOM':>4}  answer by"]
    for r in rows:
        m = r["remeasure"]
        again = _fmt(r["remeasured_samples_per_s"]) if r["remeasured_samples_per_s"] is not None else (
            m.get("skipped") or ("OOM" if m.get("oom") else "timed out" if m.get("timed_out") else
                                 f"rc {m['rc']}" if m.get("rc") else "-"))[:11]
        peak = r["remeasured_peak_reserved_bytes"]
        ckpt = _fmt(r["checkpointing"]) + ("*" if r["checkpointing_key"] and not r["checkpointing"] else "")
        lines.append(f"{r['tuner']:<10} {_fmt(r['stage']):>5} {_fmt(r['offload']):<10} {ckpt:<5} {_fmt(r['mbs']):>4} "
                     f"{_fmt(r['gas']):>3} {_fmt(r['reported_samples_per_s'], 2):>9} {again:>11} "
                     f"{'-' if not peak else f'{peak / GiB:.2f}':>8} {r['wall_s']:>7.0f} {r['launches']:>8} "
                     f"{r['oom_launches']:>4}  {r['chosen_by']}" + ("  [TIMED OUT]" if r["timed_out"] else ""))
    lines.append("ckpt: the answer's command passes --gradient_checkpointing on (*: only the config's key says so); "
                 "re-measured: a plain run's samples/s\nunder the same cap; peak GiB: its allocator's reserved peak")
    return "\n".join(lines)


def _failed_report(name: str, wall: float, rc: int | None, e: Exception) -> dict[str, Any]:
    return {"tuner": name, "exit_code": rc, "wall_s": wall, "timed_out": False, "launches": 0, "oom_launches": 0,
            "oom_after_stage_first": 0, "answer": f"report failed: {type(e).__name__}: {e}"[:120],
            "answer_config": None, "answer_samples_per_s": None, "answer_experiment": None, "answer_ended_s": None,
            "chosen_by": "-", "experiments": []}


def report(args: argparse.Namespace) -> str:
    tuners, rows = [], []
    for tool, name in TOOLS.items():
        root, wall, rc = Path(getattr(args, tool)), getattr(args, f"{tool}_wall"), getattr(args, f"{tool}_rc")
        try:  # one tuner's broken results must not hide the other's
            tuners.append(tuner_report(name, root, wall, rc, getattr(args, f"{tool}_t0")))
            rows.append(savers_row(tool, root, tuners[-1]))
        except Exception as e:  # noqa: BLE001
            tuners.append(_failed_report(name, wall, rc, e))
            rows.append({**{k: None for k in ("stage", "offload", "checkpointing", "checkpointing_key", "mbs", "gas",
                                              "reported_samples_per_s", "remeasured_samples_per_s",
                                              "remeasured_peak_reserved_bytes")},
                         "tuner": name, "remeasure": {}, "wall_s": wall, "timed_out": False, "launches": 0,
                         "oom_launches": 0, "chosen_by": tuners[-1]["answer"]})
    if args.json:
        Path(args.json).write_text(json.dumps({"savers": rows, "tuners": tuners}, indent=1, default=str) + "\n")
    return render_savers(rows) + "\n\n" + render(tuners)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure")
    m.add_argument("--tool", choices=sorted(TOOLS), required=True)
    m.add_argument("--root", required=True)
    m.add_argument("--out", required=True)
    m.add_argument("--limit", type=float, required=True, help="seconds before the run is killed")
    m.add_argument("--steps", type=int, default=7)
    m.add_argument("--budget-bytes", type=int, required=True)
    m.add_argument("--port", type=int, default=29800)
    r = sub.add_parser("report")
    for tool in TOOLS:
        r.add_argument(f"--{tool}", required=True)
        r.add_argument(f"--{tool}-wall", type=float, required=True)
        r.add_argument(f"--{tool}-rc", type=int, default=None)
        r.add_argument(f"--{tool}-t0", type=float, required=True, help="the tuner's start, epoch seconds")
    r.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.cmd == "measure":
        out = measure(args.tool, Path(args.root), args.limit, args.steps, args.budget_bytes, args.port)
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        clock, state = out["clock"] or {}, out["skipped"] or f"rc {out['rc']}"
        print(f"re-measure {out['tool']}: {state}{', timed out' if out['timed_out'] else ''}"
              f"{', OOM' if out['oom'] else ''}, samples/s {clock.get('samples_per_s', '-')}, wall {out['wall_s']} s")
        return 0
    print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
