"""The report of ``benchmarks/gpu_compare.sh``: zerotune and DeepSpeed's autotuner on one GPU, side by side.

Per tuner: launches (experiments started: the profile counts; the results dirs are fresh, so nothing is reused
from disk, and a config the memory model pruned has no experiment dir), OOM launches, OOM launches after the first
launch of the same ZeRO stage (the memory model, or DeepSpeed's estimate, had seen that stage run and still sent a
config that did not fit), the tuner's wall time, when the answer's experiment ended (seconds from the tuner's
start), the answer (stage, mbs, gas) and its reported samples/s. A tuner stopped by its time limit answers with the
best experiment it finished (``compare_deepspeed.chosen``). For zerotune, per experiment: the memory model's
estimate at launch (``memory_bytes`` in ``exp.json``) against the device peak the step probe measured (the largest
``device_peak_bytes`` of ``probe.rank*.jsonl``) and the relative error ``estimate / peak - 1``, and the first
experiment of each stage (the estimate before any run of that stage corrected it).

Run: ``python3 -m benchmarks.gpu_compare config TEMPLATE OUT RESULTS_DIR EXPS_DIR`` (a ds_config for one tuner)
and ``python3 -m benchmarks.gpu_compare report --zt DIR --zt-wall S --zt-rc RC --ds DIR --ds-wall S --ds-rc RC
[--json PATH]`` (each DIR holds ``results/`` and ``exps/``; DeepSpeed's experiments are in its ``results/``).
"""
from __future__ import annotations

import argparse
import glob
import json
import sys
from pathlib import Path
from typing import Any

from benchmarks.compare_deepspeed import chosen, describe, ds_results, read_json, short, zt_results

GiB = 2**30
OOM_MARKERS = ("out of memory", "outofmemoryerror")


def write_config(template: str, out: str, results_dir: str, exps_dir: str) -> None:
    cfg = json.loads(Path(template).read_text())
    cfg["autotuning"].update(results_dir=results_dir, exps_dir=exps_dir)
    Path(out).write_text(json.dumps(cfg, indent=1) + "\n")


def _started(d: Path) -> float:
    """When an experiment was launched: its cmd.txt is written then (both tuners), else its oldest file."""
    files = [d / "cmd.txt"] if (d / "cmd.txt").exists() else list(d.iterdir())
    return min((f.stat().st_mtime for f in files), default=0.0)


def _ended(d: Path) -> float:
    return max((f.stat().st_mtime for f in d.iterdir()), default=0.0)


def _stage(cfg: dict) -> int | None:
    stage = (cfg.get("zero_optimization") or {}).get("stage")
    return stage if isinstance(stage, int) else None


def _device_peak(d: Path) -> int | None:
    peaks = []
    for f in glob.glob(str(d / "probe.rank*.jsonl")):
        for line in open(f, errors="replace"):
            try:
                peaks.append(json.loads(line).get("device_peak_bytes"))
            except ValueError:
                continue
    peaks = [p for p in peaks if p]
    return max(peaks) if peaks else None


def _oom(d: Path, status: str | None) -> bool:
    if status is not None:
        return status == "oom"
    text = ""
    for name in ("stderr.log", "stdout.log"):
        if (d / name).exists():
            text += (d / name).read_text(errors="replace")[-200_000:].lower()
    return any(m in text for m in OOM_MARKERS)


def tuner_report(which: str, root: Path, wall_s: float, rc: int | None, t0: float) -> dict[str, Any]:
    """The figures of one tuner's run in ``root`` (results/ and exps/), started at epoch ``t0``."""
    results = root / "results"
    if which == "zerotune":
        exps = _zt(root)
        dirs = {e["name"]: root / "exps" / e["name"] for e in exps}
    else:
        exps = ds_results(results, "throughput")["experiments"]
        dirs = {e["name"]: results / e["name"] for e in exps}
    for e in exps:
        d = dirs[e["name"]]
        e["started_s"] = round(_started(d) - t0, 1)
        e["ended_s"] = round(_ended(d) - t0, 1)
        e["oom"] = _oom(d, e.get("status"))
        e["stage"] = _stage(e["ds_config"])
        e["profile"] = e["name"].startswith("profile")
    exps.sort(key=lambda e: e["started_s"])
    seen: set[int] = set()
    oom_after_first = 0
    for e in exps:
        if e["profile"]:
            continue
        if e["oom"] and e["stage"] in seen:
            oom_after_first += 1
        seen.add(e["stage"])
    cfg, metric, exp_name, by_tuner = chosen(results, exps)
    answer_end = next((e["ended_s"] for e in exps if e["name"] == exp_name), None)
    if which == "zerotune" and cfg is not None:  # the answer's last run
        runs = [e["ended_s"] for e in exps if e["ds_config"] == cfg]
        answer_end = max(runs) if runs else answer_end
    out = {"tuner": which, "exit_code": rc, "wall_s": wall_s, "timed_out": rc in (124, 137),
           "launches": len(exps), "oom_launches": sum(e["oom"] for e in exps), "oom_after_stage_first": oom_after_first,
           "answer": short(describe(cfg)), "answer_config": describe(cfg), "answer_samples_per_s": metric,
           "answer_experiment": exp_name, "answer_ended_s": answer_end,
           "chosen_by": "tuner" if by_tuner else "harness (best finished experiment)",
           "experiments": [{k: e.get(k) for k in ("name", "stage", "started_s", "ended_s", "ok", "oom", "metric",
                                                  "memory_bytes", "device_peak_bytes", "rel_error", "status")}
                           for e in exps]}
    return out


def _zt(root: Path) -> list[dict]:
    exps = zt_results(root)["experiments"]  # root/exps/*/exp.json
    for e in exps:
        d = root / "exps" / e["name"]
        raw = read_json(d / "exp.json") or {}
        e["memory_bytes"] = raw.get("memory_bytes")
        e["device_peak_bytes"] = _device_peak(d)
        e["rel_error"] = (e["memory_bytes"] / e["device_peak_bytes"] - 1
                          if e["memory_bytes"] and e["device_peak_bytes"] else None)
    return exps


def gib(n: int | None) -> str:
    return "-" if not n else f"{n / GiB:.2f}"


def render(reports: list[dict[str, Any]]) -> str:
    lines = [f"{'tuner':<10} {'launches':>8} {'OOM':>4} {'OOM after stage 1st':>19} {'wall s':>7} "
             f"{'answer at s':>11}  {'answer':<18} {'samples/s':>9}  chosen by"]
    for r in reports:
        sps = "-" if r["answer_samples_per_s"] is None else f"{r['answer_samples_per_s']:.1f}"
        lines.append(f"{r['tuner']:<10} {r['launches']:>8} {r['oom_launches']:>4} {r['oom_after_stage_first']:>19} "
                     f"{r['wall_s']:>7.0f} {r['answer_ended_s'] if r['answer_ended_s'] is not None else '-':>11}  "
                     f"{r['answer']:<18} {sps:>9}  {r['chosen_by']}" + ("  [TIMED OUT]" if r["timed_out"] else ""))
    z, d = reports[0], reports[1]
    if d["launches"] and d["wall_s"]:
        lines.append(f"zerotune / DeepSpeed: launches {z['launches'] / d['launches']:.2f}, wall "
                     f"{z['wall_s'] / d['wall_s']:.2f}" + (f", samples/s {z['answer_samples_per_s'] / d['answer_samples_per_s']:.2f}"
                                                             if z["answer_samples_per_s"] and d["answer_samples_per_s"] else ""))
    for r in reports:
        lines.append(f"\n{r['tuner']} experiments (s from the tuner's start; estimate = memory model at launch, "
                     f"peak = probe's device peak, GiB)" if r["tuner"] == "zerotune" else f"\n{r['tuner']} experiments")
        first: dict[int, dict] = {}
        for e in r["experiments"]:
            state = "OOM" if e["oom"] else (e.get("status") or ("ok" if e["ok"] else "failed"))
            metric = "-" if e["metric"] is None else f"{e['metric']:.1f}"
            row = f"  {e['name'][:44]:<44} {e['started_s']:>6}-{e['ended_s']:<6} {state:<8} {metric:>8}"
            if r["tuner"] == "zerotune":
                err = "-" if e["rel_error"] is None else f"{e['rel_error']:+.1%}"
                row += f"  est {gib(e['memory_bytes']):>6} peak {gib(e['device_peak_bytes']):>6} err {err:>7}"
                if not e["name"].startswith("profile") and e["stage"] is not None and e["stage"] not in first:
                    first[e["stage"]] = e
            lines.append(row)
        if first:
            lines.append("  first estimate per stage: " + "; ".join(
                f"z{s} {gib(e['memory_bytes'])} vs {gib(e['device_peak_bytes'])}"
                + ("" if e["rel_error"] is None else f" ({e['rel_error']:+.1%})") + (" OOM" if e["oom"] else "")
                for s, e in sorted(first.items())))
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("config")
    c.add_argument("template")
    c.add_argument("out")
    c.add_argument("results_dir")
    c.add_argument("exps_dir")
    r = sub.add_parser("report")
    for which in ("zt", "ds"):
        r.add_argument(f"--{which}", required=True)
        r.add_argument(f"--{which}-wall", type=float, required=True)
        r.add_argument(f"--{which}-rc", type=int, default=None)
        r.add_argument(f"--{which}-t0", type=float, required=True, help="the tuner's start, epoch seconds")
    r.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.cmd == "config":
        write_config(args.template, args.out, args.results_dir, args.exps_dir)
        return 0
    reports = []
    for which, name in (("zt", "zerotune"), ("ds", "deepspeed")):
        try:
            reports.append(tuner_report(name, Path(getattr(args, which)), getattr(args, f"{which}_wall"),
                                        getattr(args, f"{which}_rc"), getattr(args, f"{which}_t0")))
        except Exception as e:  # one tuner's broken results must not hide the other's
            reports.append({"tuner": name, "exit_code": getattr(args, f"{which}_rc"), "wall_s": getattr(args, f"{which}_wall"),
                            "timed_out": False, "launches": 0, "oom_launches": 0, "oom_after_stage_first": 0,
                            "answer": f"report failed: {type(e).__name__}: {e}"[:120], "answer_config": None,
                            "answer_samples_per_s": None, "answer_experiment": None, "answer_ended_s": None,
                            "chosen_by": "-", "experiments": []})
    print(render(reports))
    if args.json:
        Path(args.json).write_text(json.dumps(reports, indent=1, default=str) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
