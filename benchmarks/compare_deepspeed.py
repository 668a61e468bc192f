"""zerotune vs DeepSpeed's own autotuner (``deepspeed --autotuning tune``) on the same training script.

Both tuners get the same problem: the same script and script arguments, the same ranks (``--ranks``
CPU ranks with ``DS_ACCELERATOR=cpu``, or the CUDA devices where present), the same ``autotuning``
section (ZeRO stages, metric, profile steps, mbs bounds, ``num_tuning_micro_batch_sizes``,
``tuner_num_trials``, ``tuner_early_stopping``, ``fast``) and a fresh results dir each. For each
tuner it records the tuning wall time, the experiments launched, the chosen config and the metric
the tuner reported; then it re-measures both chosen configs end to end with the same plain training
loop (the workload's script with ``--report-throughput``: wall-clock samples/s over at least ``--steps``
steps and ``--min-samples`` samples after a warm-up, median of ``--repeats`` runs, the two tuners'
runs interleaved), because a tuner's own metric can flatter it.

Workloads (``--workload``): ``gpt``, ``examples/train_gpt.py`` (5.3M parameters); ``hf``,
``benchmarks/train_hf_loop.py``, transformers' GPT-2 built from a config (4 layers of 256, vocabulary 8192,
sequences of 128; nothing downloaded) in a plain DeepSpeed loop. ``--tunings N`` runs each mode's pair of tunings
N times, each in fresh directories, who goes first alternating, each pair's answers re-measured; it prints per
tuning the wall ratio and the answer ratio (zerotune / DeepSpeed, re-measured medians) and, over the N, each
tuner's most and fewest launches, against issue 41's targets: every tuning's wall at most ``--wall-target``
(0.6) of DeepSpeed's and its answer at least 0.97 of DeepSpeed's, zerotune's most launches at most 1.3x its
fewest. ``--dry-run`` prints the commands and the plan and launches nothing.

Output: one table (also written next to ``--out`` as ``.txt``, by default
``benchmarks/results/compare_deepspeed.txt``) with the ratios zerotune / DeepSpeed, and the raw figures as JSON
(``--out``): per mode (``runs.true``, ``runs.false``) ``tunings``, one block per tuning (each tuner's row,
``ratios``), and ``over_tunings`` (launches, ratios, ``targets_met``), with the machine's load average before
and after each phase and sampled during it (the cores may be shared: the figures are only as quiet as the
machine was).

Memory budget. On CPU DeepSpeed's autotuner takes ``get_accelerator().total_memory()`` as each
rank's device memory, which on the CPU accelerator is ``psutil.virtual_memory().total``: the
machine's whole memory, for every rank. zerotune is given the same figure per rank
(``--device-memory``), so both tuners face the same problem. zerotune enforces its budget with
``RLIMIT_DATA`` on each rank (at this size it binds nothing); DeepSpeed enforces nothing. On CUDA
both read the device's memory and no budget is passed.

How DeepSpeed's autotuner is made to run here (the harness's workarounds, none of which changes
what DeepSpeed tunes or measures):

- ``tabulate`` must be installed (DeepSpeed's ``autotuning`` extra); the harness checks for it.
- ``deepspeed`` must be on ``PATH``: its scheduler launches each experiment as the bare command
  ``deepspeed``. The harness puts this Python's ``bin`` first.
- ``pdsh``: after each experiment DeepSpeed's scheduler runs ``pdsh -w HOSTS pkill -f EXP_NAME``
  (``autotuning/scheduler.py:clean_up``), even on one node. Without pdsh that raises
  FileNotFoundError in the experiment's thread (the result is still read; the log gets a
  traceback); with a real pdsh it would ssh to the hosts and kill every process whose command line
  matches the experiment's name, other users' included. The experiment's launcher has already
  exited and reaped its ranks by then, so the harness puts a no-op ``pdsh`` first on the tuner's
  ``PATH`` (it only logs its arguments to ``pdsh_calls.log``) and cleans up itself: the tuner runs in
  its own session and its process group is killed when it ends or times out.
- No hostfile: DeepSpeed then launches locally without ssh (with a hostfile, even one naming only
  localhost, its launcher first checks passwordless ssh to the first host).
- No per-experiment timeout exists in DeepSpeed's autotuner: ``--tuner-timeout`` bounds each
  tuner's whole run (the same for both; zerotune also gets ``--exp-timeout`` per experiment). A
  tuner that runs past it is killed; the harness then reports the best experiment it had finished
  and marks the row.
- Its experiments' master ports are ``--master_port + exp_id``: the harness passes a free base port.
- DeepSpeed JIT-builds two C++ ops on CPU (``fused_adam``, ``deepspeed_shm_comm``) into
  ``TORCH_EXTENSIONS_DIR``. The harness uses a private one (``--ext-dir``) and builds both before
  any timed phase (a short plain training run), so neither tuner pays for a build and no other
  user's build or stale lock in the shared cache stalls an experiment.

Run from the repository root (about 17 minutes on 2 shared CPU cores with the defaults, after a
one-time JIT build of a few minutes; about 40 for 3 HF tunings in fast mode)::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.compare_deepspeed --fast both
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.compare_deepspeed --workload hf --fast true --tunings 3 \
        --out benchmarks/results/compare_deepspeed_hf.json
"""
from __future__ import annotations

import argparse
import copy
import json
import math
import os
import shlex
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import psutil
from rich.console import Console
from rich.table import Table

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent
WORKLOADS = {"gpt": (ROOT / "examples" / "train_gpt.py", ""),
             "hf": (ROOT / "benchmarks" / "train_hf_loop.py",
                    "--n-layer 4 --n-embd 256 --n-head 4 --seq-len 128 --vocab 8192")}
"""``--workload`` -> (the script, its arguments): both write their wall-clock throughput with ``--report-throughput``."""
PDSH_SHIM = """#!/bin/sh
# compare_deepspeed.py: a no-op pdsh for DeepSpeed's autotuner on one node. Its scheduler runs
# `pdsh -w HOSTS pkill -f EXP_NAME` after each experiment, whose launcher has already exited; a
# real pdsh would ssh to the hosts and kill by name. This one only records the call.
echo "$(date +%s) pdsh $*" >> "${ZT_COMPARE_PDSH_LOG:-/dev/null}"
exit 0
"""


def load() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


class LoadSampler:
    """Samples the 1-minute load average every few seconds while a phase runs (mean, max)."""

    def __init__(self, every_s: float = 5.0):
        self.every_s, self.samples = every_s, []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while True:
            self.samples.append(os.getloadavg()[0])
            if self._stop.wait(self.every_s):
                return

    def __enter__(self) -> "LoadSampler":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def summary(self) -> dict:
        return {"load1_mean": round(statistics.fmean(self.samples), 2) if self.samples else None,
                "load1_max": round(max(self.samples), 2) if self.samples else None, "samples": len(self.samples)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int) -> int:
    """A base port whose next ``n`` ports are free now (DeepSpeed uses base + exp_id)."""
    for _ in range(50):
        base = free_port()
        if base + n >= 65535:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    return 29500


def cuda_devices() -> int:
    try:
        import torch
        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except Exception:
        return 0


def ds_device_memory(env: dict[str, str]) -> int:
    """The per-device memory DeepSpeed's autotuner assumes (its ``get_gpu_memory_info``)."""
    out = subprocess.run([sys.executable, "-c", "from deepspeed.accelerator import get_accelerator as g; "
                          "print(g().total_memory())"], env=env, capture_output=True, text=True, check=True)
    return int(out.stdout.strip().splitlines()[-1])


def run_group(cmd: list[str], cwd: Path, env: dict[str, str], log_prefix: Path, timeout_s: float,
              interrupt: int = signal.SIGTERM) -> tuple[int | None, float, bool]:
    """Run ``cmd`` in its own session; kill its process group after ``timeout_s``.

    Returns (exit code or None when killed, wall seconds, timed out).
    """
    start = time.monotonic()
    shm_before = set(shm_buffers())
    with open(f"{log_prefix}.stdout.log", "wb") as out, open(f"{log_prefix}.stderr.log", "wb") as err:
        proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=out, stderr=err, stdin=subprocess.DEVNULL,
                                start_new_session=True)
        timed_out = False
        try:
            proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            timed_out = True
        except KeyboardInterrupt:
            _stop(proc, signal.SIGINT)
            raise
        finally:
            if proc.poll() is None:
                _stop(proc, interrupt)
            try:  # stragglers of this group (the tuner's experiments), by the group's id only
                os.killpg(proc.pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass
            for path in set(shm_buffers()) - shm_before:  # what this group's DeepSpeed runs left in /dev/shm
                path.unlink(missing_ok=True)
    return (None if timed_out else proc.returncode), time.monotonic() - start, timed_out


def shm_buffers() -> list[Path]:
    """The shared-memory files of DeepSpeed's CPU communication on this machine (69 MB per rank and master
    port, never unlinked by DeepSpeed; zerotune removes its own experiments', DeepSpeed's autotuner and a
    plain training run do not). The benchmark runs one group at a time, so the files a group adds are its own:
    a whole run here left 3.9 GB in RAM-backed /dev/shm before this cleanup (2026-11-25)."""
    return list(Path("/dev/shm").glob(f"deepspeed_allreduce_buffer_{os.getuid()}_*"))


def _stop(proc: subprocess.Popen, first: int) -> None:
    try:
        os.killpg(proc.pid, first)
        proc.wait(timeout=60)
    except (ProcessLookupError, PermissionError):
        pass
    except subprocess.TimeoutExpired:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def read_json(path: Path) -> Any:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def describe(cfg: dict | None) -> dict | None:
    """The chosen config's key facts: stage, mbs, gas, train batch size and the ZeRO knobs."""
    if not cfg:
        return None
    zero = dict(cfg.get("zero_optimization") or {})
    stage = zero.pop("stage", 0)
    return {"stage": stage, "mbs": cfg.get("train_micro_batch_size_per_gpu"),
            "gas": cfg.get("gradient_accumulation_steps", 1), "train_batch_size": cfg.get("train_batch_size"),
            "knobs": zero}


def short(desc: dict | None) -> str:
    if not desc:
        return "-"
    text = f"z{desc['stage']} mbs {desc['mbs']} gas {desc['gas']}"
    knobs = {k: v for k, v in desc["knobs"].items() if not isinstance(v, dict)}
    abbrev = {"reduce_bucket_size": "rbs", "allgather_bucket_size": "agbs", "overlap_comm": "oc",
              "reduce_scatter": "rs", "contiguous_gradients": "cg", "allgather_partitions": "agp",
              "stage3_prefetch_bucket_size": "pf", "stage3_param_persistence_threshold": "ppt",
              "stage3_max_live_parameters": "mlp", "stage3_max_reuse_distance": "mrd"}
    parts = []
    for k, v in sorted(knobs.items()):
        if isinstance(v, bool):
            v = "T" if v else "F"
        elif isinstance(v, (int, float)) and abs(v) >= 1e4:
            v = f"{v:.0e}".replace("e+0", "e")
        parts.append(f"{abbrev.get(k, k)}={v}")
    return text + (" " + " ".join(parts) if parts else "")


# -- the two tuners ----------------------------------------------------------------------------


def ds_results(results_dir: Path, metric: str) -> dict:
    """Experiments DeepSpeed's autotuner launched (one result dir each, with its cmd.txt)."""
    exps = []
    for d in sorted(results_dir.iterdir()) if results_dir.is_dir() else []:
        if not (d / "cmd.txt").exists():
            continue
        cfg = read_json(d / "ds_config.json") or {}
        metrics = read_json(d / "metrics.json")
        profile = d.name == "profile_model_info"
        ok = (d / "model_info.json").exists() if profile else bool(metrics and metric in metrics)
        exps.append({"name": d.name, "ok": ok, "metric": metrics.get(metric) if metrics else None,
                     "ds_config": {k: v for k, v in cfg.items() if k != "autotuning"},
                     "mtime": (d / "stdout.log").stat().st_mtime if (d / "stdout.log").exists() else None})
    return {"experiments": exps}


def zt_results(results_dir: Path) -> dict:
    exps = []
    for f in sorted((results_dir / "exps").glob("*/exp.json")):
        e = read_json(f) or {}
        exps.append({"name": e.get("name"), "ok": e.get("status") == "ok", "status": e.get("status"),
                     "metric": e.get("metric"), "ds_config": e.get("ds_config") or {},
                     "wall_s": e.get("wall_s"), "error": e.get("error") or None,
                     "metric_rel_half_width": e.get("metric_rel_half_width"), "metric_source": e.get("metric_source"),
                     "ended": e.get("ended"), "replica_of": e.get("replica_of")})
    return {"experiments": exps}


def chosen(results_dir: Path, exps: list[dict]) -> tuple[dict | None, float | None, str | None, bool]:
    """The tuner's optimal config, its reported metric, its experiment, and whether the tuner wrote
    it (False: the harness took the best finished experiment of a tuner that did not finish)."""
    cfg = read_json(results_dir / "ds_config_optimal.json")
    if cfg is not None:  # the reported metric: the mean over the config's runs (zerotune re-measures finalists)
        runs = [e for e in exps if e["ds_config"] == cfg and e["metric"] is not None]
        if runs:
            return cfg, sum(e["metric"] for e in runs) / len(runs), runs[0]["name"], True
        return cfg, None, None, True
    scored = [e for e in exps if e["ok"] and e["metric"] is not None and not e["name"].startswith("profile")]
    if not scored:
        return None, None, None, False
    best = max(scored, key=lambda e: e["metric"])
    return best["ds_config"], best["metric"], best["name"], False


def autotuning_section(args, fast: bool, results_dir: Path, exps_dir: Path) -> dict:
    return {"enabled": True, "fast": fast, "metric": "throughput",
            "start_profile_step": args.start_profile_step, "end_profile_step": args.end_profile_step,
            "min_train_micro_batch_size_per_gpu": 1,
            "max_train_micro_batch_size_per_gpu": args.max_mbs,
            "num_tuning_micro_batch_sizes": args.num_tuning_mbs,
            "tuner_type": "gridsearch", "tuner_num_trials": args.trials, "tuner_early_stopping": args.early_stopping,
            "results_dir": str(results_dir), "exps_dir": str(exps_dir)}


def tuner_command(which: str, args, ctx: dict, fast: bool, d: Path) -> tuple[list[str], dict[str, str], int]:
    """``which`` tuner's command in its directory ``d`` (its config written there), its environment and the signal
    that interrupts it: (command, env, signal)."""
    results_dir, exps_dir = d / "results", d / "exps"
    cfg = copy.deepcopy(ctx["base_config"])
    cfg["autotuning"] = autotuning_section(args, fast, results_dir, exps_dir)
    cfg_path = d / "ds_config.json"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    script_args = ctx["script_args"] + ["--steps", str(args.tune_script_steps), "--deepspeed_config", str(cfg_path)]
    env = dict(ctx["env"])
    if which == "deepspeed":
        shim = d / "shim"
        shim.mkdir(exist_ok=True)
        (shim / "pdsh").write_text(PDSH_SHIM)
        (shim / "pdsh").chmod(0o755)
        env["PATH"] = f"{shim}{os.pathsep}{env['PATH']}"
        env["ZT_COMPARE_PDSH_LOG"] = str(d / "pdsh_calls.log")
        cmd = [str(BIN / "deepspeed"), "--autotuning", "tune", "--num_gpus", str(ctx["ranks"]),
               "--master_port", str(free_port_range(200)), ctx["script"]] + script_args
        return cmd, env, signal.SIGTERM
    cmd = [str(BIN / "zerotune"), "tune", "--num_gpus", str(ctx["ranks"]), "--results-dir", str(results_dir),
           "--timeout", str(args.exp_timeout)]
    if ctx["budget"] is not None:
        cmd += ["--device-memory", str(ctx["budget"])]
    return cmd + [ctx["script"]] + script_args, env, signal.SIGINT  # SIGINT: zerotune stops its experiments' sessions


def run_tuner(which: str, args, ctx: dict, fast: bool, workdir: Path, console: Console) -> dict:
    d = workdir / which
    d.mkdir(parents=True)
    results_dir = d / "results"
    cmd, env, interrupt = tuner_command(which, args, ctx, fast, d)
    console.print(f"[bold]{which}[/] fast={str(fast).lower()}: {shlex.join(cmd)}")
    before = load()
    with LoadSampler() as sampler:
        rc, wall, timed_out = run_group(cmd, d, env, d / "tuner", args.tuner_timeout, interrupt)
    after = load()
    res = ds_results(results_dir, "throughput") if which == "deepspeed" else zt_results(results_dir)
    exps = res["experiments"]
    cfg_opt, metric, exp_name, written = chosen(results_dir, exps)
    out = {"command": shlex.join(cmd), "cwd": str(d), "exit_code": rc, "timed_out": timed_out,
           "tuning_wall_s": round(wall, 1), "experiments_launched": len(exps),
           # launches: experiments started (the profile counts; a fresh results dir, so nothing is reused from
           # disk, and configs a memory model pruned have no experiment dir)
           "launches": len(exps),
           "experiments_ok": sum(e["ok"] for e in exps), "chosen_config": cfg_opt, "chosen": describe(cfg_opt),
           "chosen_experiment": exp_name, "chosen_by": "tuner" if written else "harness (best finished experiment)",
           "reported_metric": metric, "load_before": before, "load_after": after, "load_during": sampler.summary(),
           "experiments": [{k: v for k, v in e.items() if k != "ds_config"} | {"config": short(describe(e["ds_config"]))}
                           for e in exps]}
    summary = results_dir / "summary.txt"
    if summary.exists():
        out["summary_txt"] = summary.read_text()
    console.print(f"  -> {wall:.0f} s, {len(exps)} experiments ({out['experiments_ok']} ok), chosen "
                  f"{short(out['chosen'])}, reported {metric if metric is None else round(metric, 2)} samples/s"
                  f"{' [TIMED OUT]' if timed_out else ''}; load {before} -> {after}, during {sampler.summary()}")
    return out


# -- the plain re-measurement -------------------------------------------------------------------


def measure(cfg: dict, args, ctx: dict, path: Path, label: str, console: Console) -> dict:
    cfg = {k: v for k, v in cfg.items() if k != "autotuning"}
    path.mkdir(parents=True, exist_ok=True)
    cfg_path = path / "ds_config.json"
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    report = path / "throughput.json"
    report.unlink(missing_ok=True)
    cmd = measure_command(cfg, args, ctx, cfg_path, report)
    before = load()
    with LoadSampler(every_s=2.0) as sampler:
        rc, wall, timed_out = run_group(cmd, path, ctx["env"], path / "run", args.measure_timeout)
    after = load()
    # the script writes its report after its last step; a launch that exits non-zero after that (torch's
    # teardown abort on this machine, 'terminate called without an active exception', exit -6) still measured
    data = read_json(report) if rc is not None and (rc == 0 or report.exists()) else None
    value = data.get("samples_per_s") if data else None
    console.print(f"  measure {label}: {value if value is None else round(value, 2)} samples/s "
                  f"({wall:.0f} s, load {before} -> {after}, during {sampler.summary()})"
                  + (f"; exit code {rc} after the report was written" if data and rc else ""))
    return {"samples_per_s": value, "exit_code": rc, "timed_out": timed_out, "wall_s": round(wall, 1),
            "load_before": before, "load_after": after, "load_during": sampler.summary(), "report": data,
            "command": shlex.join(cmd)}


def measure_command(cfg: dict, args, ctx: dict, cfg_path: Path, report: Path) -> list[str]:
    """The plain training run of ``cfg`` (written at ``cfg_path``) that writes its wall-clock throughput to ``report``:
    the same work for every config, at least --steps steps and --min-samples samples timed, after at least
    --warmup-steps steps and a tenth of those samples (a small batch's steps are short and noisy)."""
    tbs = cfg.get("train_batch_size") or (cfg.get("train_micro_batch_size_per_gpu", 1)
                                          * cfg.get("gradient_accumulation_steps", 1) * ctx["ranks"])
    steps = max(args.steps, math.ceil(args.min_samples / tbs))
    warmup = max(args.warmup_steps, math.ceil(args.min_samples / 10 / tbs))
    return [str(BIN / "deepspeed"), "--include", ctx["include"], "--master_port", str(free_port()), ctx["script"]] \
        + ctx["script_args"] + ["--steps", str(warmup + steps), "--warmup-steps", str(warmup),
                                "--report-throughput", str(report), "--deepspeed_config", str(cfg_path)]


def remeasure(rows: dict, args, ctx: dict, workdir: Path, console: Console) -> None:
    """``--repeats`` runs of each tuner's chosen config, interleaved (zt, ds, zt, ds...)."""
    for r in range(args.repeats):
        for which in ("zerotune", "deepspeed"):
            row = rows[which]
            if not row.get("chosen_config"):
                continue
            m = measure(row["chosen_config"], args, ctx, workdir / "measure" / which / f"run{r}", f"{which} #{r + 1}",
                        console)
            row.setdefault("remeasure_runs", []).append(m)
    for which in ("zerotune", "deepspeed"):
        row = rows[which]
        values = [m["samples_per_s"] for m in row.get("remeasure_runs", []) if m["samples_per_s"] is not None]
        row["remeasured_samples_per_s"] = [round(v, 3) for v in values]
        row["remeasured_median"] = statistics.median(values) if values else None
        loads = [m["load_during"]["load1_mean"] for m in row.get("remeasure_runs", []) if m["load_during"]["samples"]]
        row["remeasure_load1_mean"] = round(statistics.fmean(loads), 2) if loads else None


def ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def ratios(rows: dict) -> dict:
    z, d = rows["zerotune"], rows["deepspeed"]
    return {"tuning_wall_s": ratio(z["tuning_wall_s"], d["tuning_wall_s"]),
            "launches": ratio(z["experiments_launched"], d["experiments_launched"]),
            "experiments_launched": ratio(z["experiments_launched"], d["experiments_launched"]),
            "reported_metric": ratio(z["reported_metric"], d["reported_metric"]),
            "remeasured_median": ratio(z.get("remeasured_median"), d.get("remeasured_median"))}


# -- whole tunings, repeated ----------------------------------------------------------------------

ANSWER_TARGET = 0.97
"""Issue 41: every tuning's answer, re-measured end to end, at least this fraction of DeepSpeed's."""
LAUNCH_SPREAD_TARGET = 1.3
"""Issue 41: over the tunings, zerotune's most launches at most this multiple of its fewest."""
IDEAL = {"launches": None, "why": "n/a: the simulated benchmark's ideal (D28) needs every config's noise-free "
         "throughput, unknown for real runs"}


def run_mode(args, ctx: dict, fast: bool, index: int, workdir: Path, mode: dict, save, console: Console) -> None:
    """``--tunings`` tunings of both tuners in mode ``fast`` (the ``index``-th mode run), each in fresh directories,
    who goes first alternating; each pair's answers re-measured end to end. Fills ``mode``: ``tunings``, one block per
    tuning (``order``, each tuner's row, ``ratios``), and ``over_tunings`` (:func:`over_tunings`)."""
    key = str(fast).lower()
    mode["tunings"] = tunings = []
    for t in range(args.tunings):
        order = ("zerotune", "deepspeed") if (index + t) % 2 == 0 else ("deepspeed", "zerotune")
        block: dict[str, Any] = {"order": list(order)}
        tunings.append(block)
        d = workdir / f"fast_{key}" / f"tuning{t + 1}"
        for which in order:
            block[which] = run_tuner(which, args, ctx, fast, d, console)
            save()
        remeasure(block, args, ctx, d, console)
        block["ratios"], block["ideal"] = ratios(block), IDEAL
        z, ds, r = block["zerotune"], block["deepspeed"], block["ratios"]
        console.print(f"fast={key} tuning {t + 1} of {args.tunings}: wall zerotune {z['tuning_wall_s']} s, DeepSpeed "
                      f"{ds['tuning_wall_s']} s, ratio {fmt(r['tuning_wall_s'], 2)} (target <= {args.wall_target:g}); "
                      f"answer end to end zerotune {fmt(z.get('remeasured_median'), 2)}, DeepSpeed "
                      f"{fmt(ds.get('remeasured_median'), 2)} samples/s, ratio {fmt(r['remeasured_median'], 2)} (target "
                      f">= {ANSWER_TARGET:g}); launches zerotune {z['launches']}, DeepSpeed {ds['launches']}")
        save()
    mode["over_tunings"] = over = over_tunings(tunings, args.wall_target)
    console.print(f"fast={key} over {len(tunings)} tuning(s): launches zerotune {over['zerotune']['fewest']}-"
                  f"{over['zerotune']['most']} (most / fewest {fmt(over['zerotune']['most_over_fewest'], 2)}, target <= "
                  f"{LAUNCH_SPREAD_TARGET:g}), DeepSpeed {over['deepspeed']['fewest']}-{over['deepspeed']['most']}; "
                  f"targets met: {over['targets_met']}")


def over_tunings(blocks: list[dict], wall_target: float) -> dict:
    """Over the tunings of one mode: each tuner's launches (most, fewest, most / fewest), the per-tuning wall and
    answer ratios, and which of issue 41's targets every tuning met (a ratio that could not be read misses)."""
    out: dict[str, Any] = {"tunings": len(blocks)}
    for which in ("zerotune", "deepspeed"):
        launches = [b[which]["launches"] for b in blocks]
        out[which] = {"launches": launches, "most": max(launches), "fewest": min(launches),
                      "most_over_fewest": ratio(max(launches), min(launches))}
    walls = [b["ratios"]["tuning_wall_s"] for b in blocks]
    answers = [b["ratios"]["remeasured_median"] for b in blocks]
    spread = out["zerotune"]["most_over_fewest"]
    out.update(wall_ratios=walls, answer_ratios=answers, targets={
        "wall_ratio_at_most": wall_target, "answer_ratio_at_least": ANSWER_TARGET,
        "zerotune_launches_most_over_fewest_at_most": LAUNCH_SPREAD_TARGET})
    out["targets_met"] = {"every_wall": all(w is not None and w <= wall_target for w in walls),
                          "every_answer": all(a is not None and a >= ANSWER_TARGET for a in answers),
                          "launch_spread": spread is not None and spread <= LAUNCH_SPREAD_TARGET}
    return out


def print_plan(args, ctx: dict, fasts: list[bool], workdir: Path, console: Console) -> None:
    """``--dry-run``: the commands of the first tuning of each mode and of a re-measure run, and what the whole run
    would launch; nothing is launched (the commands' config files are written under ``workdir``)."""
    for fast in fasts:
        for which in ("zerotune", "deepspeed"):
            d = workdir / f"fast_{str(fast).lower()}" / "tuning1" / which
            d.mkdir(parents=True, exist_ok=True)
            console.print(f"[bold]{which}[/] fast={str(fast).lower()}: {shlex.join(tuner_command(which, args, ctx, fast, d)[0])}")
    sample = dict(ctx["base_config"], train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=1)
    console.print(f"re-measure (a chosen config, {args.repeats} run(s) each, interleaved): "
                  f"{shlex.join(measure_command(sample, args, ctx, workdir / 'ds_config.json', workdir / 'tp.json'))}")
    console.print(f"plan: {len(fasts)} mode(s) x {args.tunings} tuning(s) x 2 tuners, then {2 * args.repeats} re-measure "
                  f"run(s) per tuning; targets: every wall ratio <= {args.wall_target:g}, every answer ratio >= "
                  f"{ANSWER_TARGET:g}, zerotune's most launches <= {LAUNCH_SPREAD_TARGET:g}x its fewest")


# -- output --------------------------------------------------------------------------------------


def fmt(x, nd=1):
    return "-" if x is None else f"{x:.{nd}f}"


def render(result: dict) -> Table:
    meta = result["meta"]
    t = Table(title=f"zerotune vs DeepSpeed autotuner: {meta['script_name']} on {meta['ranks']} "
                    f"{meta['device']} ranks, mbs <= {meta['autotuning_common']['max_train_micro_batch_size_per_gpu']}, "
                    f"budget {meta['budget_human']} per rank; re-measured: >= {meta['steps']} steps and >= "
                    f"{meta['min_samples']} samples after warm-up, median of {meta['repeats']}", title_justify="left")
    for col in ("fast", "tuner", "tuning wall s", "launches (ok)", "chosen config", "tuner metric samples/s",
                "re-measured median samples/s", "re-measured runs", "load 1m tuning mean (max)",
                "load 1m re-measure mean"):
        t.add_column(col)
    for fast, mode in result["runs"].items():
        for i, block in enumerate(mode.get("tunings", [])):
            label = fast if len(mode["tunings"]) == 1 else f"{fast} #{i + 1}"
            render_tuning(t, label, block)
        over = mode.get("over_tunings")
        if over and over["tunings"] > 1:
            z, d = over["zerotune"], over["deepspeed"]
            t.add_row(fast, f"[bold]over {over['tunings']} tunings[/]",
                      f"ratio max {fmt(max((w for w in over['wall_ratios'] if w is not None), default=None), 2)}",
                      f"{z['fewest']}-{z['most']} / {d['fewest']}-{d['most']}",
                      f"zt {fmt(z['most_over_fewest'], 2)}x", "", f"ratio min {fmt(min((a for a in over['answer_ratios'] if a is not None), default=None), 2)}",
                      "", "", "", end_section=True)
    t.caption = ("launches = experiments started, each tuner's profile run included; ideal n/a: the lower bound of "
                 "the simulated benchmark (profile + one run per ZeRO stage that can win + gas, D28) needs every "
                 "config's noise-free throughput, which real runs do not give; tuner metric = what each tuner reports for its "
                 "answer (DeepSpeed: its engine's autotuning throughput, train_batch_size / mean fwd+bwd+step time; "
                 "zerotune: its step probe's wall-clock throughput on the slowest rank, mean over the answer's runs); "
                 "re-measured = "
                 "wall-clock samples/s of a plain training run of the chosen config. Ratios: wall time and "
                 "experiments below 1 and throughput above 1 favour zerotune. Over N tunings: the largest wall ratio, "
                 "each tuner's fewest-most launches (zerotune / DeepSpeed), zerotune's most / fewest (zt), the "
                 "smallest answer ratio. Shared cores: timings are noisy, see the load averages.")
    t.caption_justify = "left"
    return t


def render_tuning(t: Table, label: str, block: dict) -> None:
    """One tuning's rows: each tuner's, then its ratios (zerotune / DeepSpeed)."""
    for which in block["order"]:
        row = block[which]
        flag = " (timed out)" if row["timed_out"] else ""
        t.add_row(label, which + flag, fmt(row["tuning_wall_s"], 0),
                  f"{row['experiments_launched']} ({row['experiments_ok']})", short(row["chosen"]),
                  fmt(row["reported_metric"], 2), fmt(row.get("remeasured_median"), 2),
                  ", ".join(f"{v:.2f}" for v in row.get("remeasured_samples_per_s", [])) or "-",
                  f"{fmt(row['load_during']['load1_mean'])} ({fmt(row['load_during']['load1_max'])})",
                  fmt(row.get("remeasure_load1_mean")))
    r = block["ratios"]
    t.add_row(label, "ideal", "n/a", "n/a", "", "", "", "", "", "")
    t.add_row(label, "[bold]zerotune / DeepSpeed[/]", fmt(r["tuning_wall_s"], 2), fmt(r["experiments_launched"], 2),
              "", fmt(r["reported_metric"], 2), fmt(r["remeasured_median"], 2), "", "", "", end_section=True)


def table_text(table: Table) -> str:
    console = Console(width=200, record=True, file=open(os.devnull, "w"), color_system=None)
    console.print(table)
    return console.export_text()


def human(n: int | None) -> str:
    return "device memory" if n is None else f"{n / 2**30:.2f} GiB"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--fast", choices=("true", "false", "both"), default="both")
    ap.add_argument("--workload", choices=tuple(WORKLOADS), default="gpt",
                    help="the script tuned and re-measured, with its arguments: gpt = examples/train_gpt.py; hf = "
                         "benchmarks/train_hf_loop.py, a Hugging Face GPT-2 built from a config (nothing downloaded)")
    ap.add_argument("--tunings", type=int, default=1, help="whole tunings of both tuners per mode, each fresh")
    ap.add_argument("--repeats", type=int, default=3, help="re-measure runs per chosen config (median)")
    ap.add_argument("--wall-target", type=float, default=0.6,
                    help="the wall ratio (zerotune / DeepSpeed) every tuning must stay under (issue 41: 0.6)")
    ap.add_argument("--dry-run", action="store_true", help="print the commands and the plan; launch nothing")
    ap.add_argument("--steps", type=int, default=15, help="timed training steps of a re-measure run (at least)")
    ap.add_argument("--min-samples", type=int, default=1000,
                    help="timed samples of a re-measure run (at least; more steps for a small train batch)")
    ap.add_argument("--warmup-steps", type=int, default=3,
                    help="untimed steps before them (at least; and at least a tenth of --min-samples)")
    ap.add_argument("--keep-dirs", action="store_true", help="keep the tuners' results dirs and logs")
    ap.add_argument("--work-dir", default=None, help="where the results dirs go (default: a new temp dir)")
    ap.add_argument("--ranks", type=int, default=None, help="ranks (default: 2 on CPU, all CUDA devices)")
    ap.add_argument("--cpu", action="store_true", help="CPU ranks even where CUDA is present")
    ap.add_argument("--script", default=None, help="the training script (default: the workload's)")
    ap.add_argument("--script-args", default=None,
                    help="extra arguments for the script (one string; default: the workload's)")
    ap.add_argument("--config", default=str(ROOT / "examples" / "ds_config.json"),
                    help="base ds_config; its autotuning section is replaced by the settings below")
    ap.add_argument("--max-mbs", type=int, default=32, help="max_train_micro_batch_size_per_gpu (both tuners)")
    ap.add_argument("--num-tuning-mbs", type=int, default=2, help="num_tuning_micro_batch_sizes (both tuners)")
    ap.add_argument("--trials", type=int, default=6, help="tuner_num_trials (both tuners)")
    ap.add_argument("--early-stopping", type=int, default=3, help="tuner_early_stopping (both tuners)")
    ap.add_argument("--start-profile-step", type=int, default=4)
    ap.add_argument("--end-profile-step", type=int, default=10)
    ap.add_argument("--tune-script-steps", type=int, default=40,
                    help="--steps given to the script while tuning (the engine stops after end_profile_step)")
    ap.add_argument("--tuner-timeout", type=float, default=1800, help="seconds for one tuner's whole run")
    ap.add_argument("--exp-timeout", type=float, default=600, help="zerotune's per-experiment timeout")
    ap.add_argument("--measure-timeout", type=float, default=600, help="seconds for one re-measure run")
    ap.add_argument("--ext-dir", default=str(Path(tempfile.gettempdir()) / "zerotune-compare-torch-ext"),
                    help="TORCH_EXTENSIONS_DIR for every run (built once before timing)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compare_deepspeed.json"))
    args = ap.parse_args()
    if args.tunings < 1 or args.repeats < 1:
        ap.error("--tunings and --repeats must be at least 1")
    args.script = args.script or str(WORKLOADS[args.workload][0])
    args.script_args = WORKLOADS[args.workload][1] if args.script_args is None else args.script_args

    console = Console(stderr=True, soft_wrap=True)
    started, t0 = time.strftime("%Y-%m-%dT%H:%M:%S"), time.monotonic()
    try:
        import tabulate  # noqa: F401  DeepSpeed's autotuner asserts it (deepspeed[autotuning])
    except ImportError:
        console.print("[red]DeepSpeed's autotuner needs tabulate: pip install 'deepspeed[autotuning]' (or tabulate)[/]")
        return 2

    ndev = 0 if args.cpu else cuda_devices()
    cpu = ndev == 0
    ranks = args.ranks or (2 if cpu else ndev)
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"  # DeepSpeed's scheduler runs a bare `deepspeed`
    env["TORCH_EXTENSIONS_DIR"] = args.ext_dir
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // ranks)))
    if cpu:
        env["DS_ACCELERATOR"] = "cpu"
        env["LOCAL_SIZE"] = str(ranks)  # the launcher counts CPU "devices" from LOCAL_SIZE
    budget = ds_device_memory(env) if cpu else None
    base = json.loads(Path(args.config).read_text())
    base.pop("autotuning", None)
    fasts = {"true": [True], "false": [False], "both": [True, False]}[args.fast]

    workdir = Path(args.work_dir or tempfile.mkdtemp(prefix="zerotune-compare-"))
    workdir.mkdir(parents=True, exist_ok=True)
    ctx = {"env": env, "ranks": ranks, "budget": budget, "base_config": base, "script": str(Path(args.script).resolve()),
           "script_args": shlex.split(args.script_args), "include": "localhost:" + ",".join(map(str, range(ranks)))}
    common = autotuning_section(args, True, Path("RESULTS"), Path("EXPS"))
    for k in ("fast", "results_dir", "exps_dir"):
        common.pop(k)
    import deepspeed
    import torch
    result: dict[str, Any] = {"meta": {
        "started": started, "device": "CPU" if cpu else "CUDA", "ranks": ranks,
        "cpu_count": os.cpu_count(), "memory_total_bytes": psutil.virtual_memory().total,
        "memory_available_bytes_at_start": psutil.virtual_memory().available,
        "budget_bytes_per_rank": budget, "budget_human": human(budget),
        "budget_source": ("DeepSpeed's get_accelerator().total_memory() on the CPU accelerator = "
                          "psutil.virtual_memory().total, per rank; zerotune gets it as --device-memory "
                          "(enforced by RLIMIT_DATA); DeepSpeed enforces nothing") if cpu else
                         "both tuners read the CUDA device's memory",
        "versions": {"python": sys.version.split()[0], "torch": torch.__version__, "deepspeed": deepspeed.__version__},
        "env": {k: env.get(k) for k in ("OMP_NUM_THREADS", "DS_ACCELERATOR", "LOCAL_SIZE", "TORCH_EXTENSIONS_DIR")},
        "script_name": Path(args.script).name, "script": ctx["script"], "script_args": ctx["script_args"],
        "base_config": base, "autotuning_common": common, "tune_script_steps": args.tune_script_steps,
        "steps": args.steps, "min_samples": args.min_samples, "warmup_steps": args.warmup_steps,
        "repeats": args.repeats, "workload": args.workload, "tunings": args.tunings,
        "tuner_timeout_s": args.tuner_timeout, "zerotune_exp_timeout_s": args.exp_timeout,
        "workarounds": [
            "tabulate installed (deepspeed[autotuning] extra)",
            "venv bin first on PATH: DeepSpeed's scheduler launches a bare `deepspeed`",
            "no-op `pdsh` first on DeepSpeed's PATH: its clean_up runs `pdsh -w HOSTS pkill -f EXP_NAME`",
            "no hostfile: DeepSpeed launches locally without ssh",
            "whole-tuner timeout (DeepSpeed has no per-experiment timeout); tuner in its own session, "
            "its process group killed at the end",
            "free base --master_port for DeepSpeed's experiments (base + exp_id)",
            "private TORCH_EXTENSIONS_DIR, JIT ops built before any timed phase"]},
        "runs": {}}
    out_path = Path(args.out)
    out_path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        result["meta"]["total_wall_s"] = round(time.monotonic() - t0, 1)
        out_path.write_text(json.dumps(result, indent=2) + "\n")

    console.print(f"work dir {workdir}; {ranks} {'CPU' if cpu else 'CUDA'} ranks; budget {human(budget)} per rank; "
                  f"OMP_NUM_THREADS={env['OMP_NUM_THREADS']}; load {load()}")
    if args.dry_run:  # nothing launched, nothing written to --out
        print_plan(args, ctx, fasts, workdir, console)
        if not args.keep_dirs:
            shutil.rmtree(workdir, ignore_errors=True)
        return 0
    ok = True
    try:
        # Build DeepSpeed's JIT ops once, before any timed phase (ZeRO 1: fused_adam and shm comm).
        warm_cfg = dict(base, zero_optimization={"stage": 1}, train_micro_batch_size_per_gpu=1,
                        gradient_accumulation_steps=1, train_batch_size=ranks)
        before = load()
        w = measure(warm_cfg, argparse.Namespace(**{**vars(args), "steps": 1, "warmup_steps": 1, "min_samples": 1}), ctx,
                    workdir / "warmup", "JIT-build warm-up", console)
        result["meta"]["warmup"] = {"wall_s": w["wall_s"], "ok": w["samples_per_s"] is not None,
                                    "load_before": before, "load_after": load()}
        if w["samples_per_s"] is None:
            console.print(f"[red]the warm-up run failed; see {workdir / 'warmup'}[/]")
            ok = False
            return 1
        for i, fast in enumerate(fasts):
            result["runs"][str(fast).lower()] = mode = {}
            run_mode(args, ctx, fast, i, workdir, mode, save, console)
            save()
        table = render(result)
        text = table_text(table)
        result["table"] = text
        save()
        out_path.with_suffix(".txt").write_text(text)
        Console(width=200).print(table)
        console.print(f"raw figures: {out_path}; total {time.monotonic() - t0:.0f} s")
        ok = all(b[w]["chosen_config"] for mode in result["runs"].values() for b in mode["tunings"]
                 for w in ("zerotune", "deepspeed"))
        return 0 if ok else 1
    except BaseException:
        ok = False
        raise
    finally:
        save()
        if args.keep_dirs or not ok:
            console.print(f"results dirs kept under {workdir}")
        else:
            shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
