"""Memory fidelity: the memory model's bytes per rank against real runs on 2 CPU ranks.

For each model shape the benchmark runs zerotune's own profile run (ZeRO-3, small buckets,
DeepSpeed's ``model_info.json`` and the probe's ``activations.json``: activations saved per sample, the
largest module, the persistent parameters), calibrates the memory model from it as ``tune`` does, then runs a
grid (ZeRO stages 0-3 x mbs x fp32/bf16) of short real trainings through zerotune's local backend
(the real ``deepspeed`` launcher, ``DS_ACCELERATOR=cpu``, the step probe in every rank) and prints
predicted vs measured bytes per rank with the median and worst absolute relative error.

Two measured figures per run, per rank, the largest over the ranks:
- ``VmData``: the process's private writable memory, sampled every 5 ms by this script (a 0.1 s sampler missed
  the backward pass's peak, which lasts tens of milliseconds). It is what
  the per-rank budget limits on CPU (``RLIMIT_DATA``) and what an allocator has handed out, which
  is what a GPU's ``max_memory_allocated`` counts: a buffer allocated but never written counts
  (DeepSpeed's 2 GB fp32 reduce bucket does). This is the figure the error is computed on.
- the probe's peak (``exp.json``'s ``peak_memory_bytes``, the step probe's ``peak_bytes``), what ``tune``
  records and corrects the model from ("online"): since 2026-11-25 the rank's own ``VmData`` sampled
  every 5 ms (saved as ``probe_peak_bytes``); before, the resident high-water mark ``ru_maxrss``
  (``rss_peak_bytes`` in the files of that date), which leaves out allocated pages never written (most
  of a large reduce bucket) and includes shared library text; shown, not scored.

How to read the CPU figure: VmData is what the C allocator has taken from the kernel and not given
back. glibc keeps freed heap chunks for reuse, so a process that allocates and frees a lot holds more
than its live tensors: ZeRO-3 gathers and releases every parameter each step, and on gpt-wide fp32 its
peak is ~200 MiB above the live bytes (ZeRO-0's barely moves). A GPU's ``max_memory_allocated``
counts live tensors only. ``--malloc-mmap-threshold 65536`` runs the ranks with glibc's
``MALLOC_MMAP_THRESHOLD_``: every allocation above 64 KiB gets its own mapping, unmapped when freed,
so VmData follows the live tensors (plus the process's own memory); the memory model is meant to
match that run, and the default run is what ``RLIMIT_DATA`` (the CPU backend's budget) limits.

Raw measurements go to ``benchmarks/results/memory_fidelity.json`` (``memory_fidelity_mmap.json`` with
the mmap threshold); ``--report`` recomputes the predictions from that file with the current memory
model without running anything. Run from the repository root::

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.memory_fidelity            # ~10 min here
    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.memory_fidelity --malloc-mmap-threshold 65536
    .venv/bin/python -m benchmarks.memory_fidelity --report [--malloc-mmap-threshold 65536]  # table only
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.launch import LaunchSpec, Node, Reservation
from zerotune.core.units import format_bytes
from zerotune.inputs.configs import PROFILE_BUCKET_SIZE
from zerotune.model.memory import MemoryModel
from zerotune.model.online import OnlineMemory
from zerotune.model.profile import ModelInfo
from zerotune.run.backends.local import LocalBackend
from zerotune.run.processes import data_bytes

ROOT = Path(__file__).resolve().parent.parent

RESULTS = ROOT / "benchmarks" / "results" / "memory_fidelity.json"
MMAP_RESULTS = RESULTS.with_name("memory_fidelity_mmap.json")
SCRIPT = ROOT / "examples" / "train_gpt.py"
RANKS = 2
BUCKET = 50_000_000  # reduce/allgather bucket elements (200 MB fp32): buffers matter without dwarfing the rest

MODELS = {  # name -> train_gpt.py arguments
    "gpt-small": [],  # the bundled example: d_model 256, 4 layers, vocab 4096, seq 128
    "gpt-wide": ["--d-model", "512", "--n-layer", "2", "--vocab", "8192", "--seq-len", "64", "--n-head", "8"],
}
STAGES = (0, 1, 2, 3)
MBS = (1, 8)
PRECISIONS = ("fp32", "bf16")


def ds_config(stage: int, mbs: int, precision: str) -> dict:
    cfg = {"train_micro_batch_size_per_gpu": mbs, "gradient_accumulation_steps": 1,
           "train_batch_size": mbs * RANKS,
           "optimizer": {"type": "AdamW", "params": {"lr": 3e-4, "weight_decay": 0.01}},
           "zero_optimization": {"stage": stage, "reduce_bucket_size": BUCKET, "allgather_bucket_size": BUCKET}}
    if stage == 3:
        cfg["zero_optimization"]["stage3_prefetch_bucket_size"] = BUCKET
    if precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    return cfg


def profile_config(precision: str) -> dict:
    """The profile run's config as zerotune builds it (ConfigBuilder.profile): ZeRO-3, mbs 1, small buckets."""
    cfg = ds_config(3, 1, precision)
    cfg["zero_optimization"].update(reduce_bucket_size=PROFILE_BUCKET_SIZE, stage3_prefetch_bucket_size=PROFILE_BUCKET_SIZE,
                                    stage3_max_live_parameters=PROFILE_BUCKET_SIZE)
    cfg["autotuning"] = {"model_info": {"profile": True}}
    return cfg


class VmDataSampler(threading.Thread):
    """Largest ``VmData`` of the ranks (processes running ``config_path``), sampled every ``period_s``.

    The peak lasts a few tens of milliseconds (the backward pass holds the activations, the gradients
    and the reduction's flat copy at once; measured: a gpt-small ZeRO-0 rank peaks at 457 MiB for
    about 20 ms and sits at 415-435 MiB otherwise), and ``RLIMIT_DATA`` refuses the allocation at that
    instant: a 100 ms sampler read that rank's peak as 427 MiB. The ranks are found by their command
    line every ``find_s``, and only their ``/proc/<pid>/status`` is read in between."""

    def __init__(self, marker: str, period_s: float = 0.005, find_s: float = 0.25):
        super().__init__(daemon=True)
        self.marker, self.period_s, self.find_s = marker, period_s, find_s
        self.peak, self.stop = {}, threading.Event()

    def run(self) -> None:
        found = 0.0
        while not self.stop.is_set():
            if time.monotonic() - found >= self.find_s:
                for p in psutil.process_iter(["pid", "cmdline"]):
                    cmd = p.info.get("cmdline") or []
                    if any(self.marker in a for a in cmd) and any(a.endswith(SCRIPT.name) for a in cmd[1:4]):
                        self.peak.setdefault(p.pid, 0)
                found = time.monotonic()
            for pid in self.peak:
                self.peak[pid] = max(self.peak[pid], data_bytes(pid))
            self.stop.wait(self.period_s)


def probe_peak(run: dict) -> int | None:
    """The probe's peak of a saved run: ``probe_peak_bytes`` (VmData sampled in the rank, since 2026-11-25),
    or ``rss_peak_bytes`` (the resident high-water mark the probe recorded before)."""
    return run.get("probe_peak_bytes", run.get("rss_peak_bytes"))


def run_one(backend: LocalBackend, exp: Experiment, workdir: Path) -> dict:
    exp_dir = workdir / exp.name
    sampler = VmDataSampler(str(exp_dir))
    sampler.start()
    start = time.monotonic()
    try:
        backend.run(exp, Reservation((Node("localhost", tuple(range(RANKS))),)), exp_dir)
    finally:
        sampler.stop.set()
        sampler.join()
    return {"name": exp.name, "status": exp.status.value if exp.status else None, "error": exp.error[-300:],
            "vmdata_peak_bytes": max(sampler.peak.values(), default=None), "probe_peak_bytes": exp.peak_memory_bytes,
            "metrics": exp.metrics if exp.kind is ExperimentKind.PROFILE else {}, "wall_s": round(time.monotonic() - start, 1)}


def run_grid(models: list[str], steps: int, workdir: Path, mmap_threshold: int | None = None) -> dict:
    out = {"date": datetime.date.today().isoformat(), "ranks": RANKS, "bucket": BUCKET, "models": {}}
    env = {"OMP_NUM_THREADS": "1"}
    if mmap_threshold is not None:
        out["malloc_mmap_threshold"] = env["MALLOC_MMAP_THRESHOLD_"] = str(mmap_threshold)
    for model in models:
        spec = LaunchSpec(script=str(SCRIPT), script_args=("--steps", str(steps), *MODELS[model],
                                                             "--deepspeed_config", "ds_config.json"),
                          cpu=True, device_memory_bytes=None, timeout_s=300, start_profile_step=2, end_profile_step=4,
                          extra_env=env, warm=False)  # cold: the sampler finds the ranks by their command line
        backend = LocalBackend(spec)
        runs, profiles = [], {}
        for precision in PRECISIONS:  # one tuning job per precision: its own profile run, as tune does
            prof = profiles[precision] = run_one(backend, Experiment(f"{model}_{precision}_profile",
                                                                     profile_config(precision), 1, RANKS,
                                                                     ExperimentKind.PROFILE), workdir)
            print(f"{model} {precision} profile: {prof['status']} {prof['metrics']} VmData "
                  f"{format_bytes(prof['vmdata_peak_bytes'] or 0)} ({prof['wall_s']} s)", flush=True)
            for stage in STAGES:
                for mbs in MBS:
                    name = f"{model}_z{stage}_{precision}_mbs{mbs}"
                    r = run_one(backend, Experiment(name, ds_config(stage, mbs, precision), 1, RANKS), workdir)
                    r.update(stage=stage, mbs=mbs, precision=precision)
                    runs.append(r)
                    print(f"  {name}: {r['status']} VmData {format_bytes(r['vmdata_peak_bytes'] or 0)} probe "
                          f"{format_bytes(probe_peak(r) or 0)} ({r['wall_s']} s)", flush=True)
        out["models"][model] = {"args": MODELS[model], "profiles": profiles, "runs": runs}
    return out


def memory_model(model: dict, precision: str) -> MemoryModel:
    """The memory model ``tune`` would build from this model's profile run at ``precision``."""
    prof = model["profiles"][precision]
    info = ModelInfo.from_metrics(prof["metrics"], prof["vmdata_peak_bytes"])
    base = MemoryModel(info.num_params, info.activation_mem_per_gpu, RANKS,
                       trainable_params=info.trainable_num_params, largest_layer_params=info.largest_layer_params,
                       persistent_params=info.persistent_params)
    return base.calibrated(profile_config(precision), info.peak_memory_bytes, mbs=1,
                           after_backward=info.peak_after_backward)


def report(data: dict) -> tuple[list[str], dict[str, list[float]]]:
    """The table: per run the profile-calibrated prediction, the online one (the model fitted to the runs
    before it in the grid, fed the probe's peaks as ``tune`` feeds them), the measured VmData and
    the probe's peak (:func:`probe_peak`); errors on VmData."""
    allocator = (f", ranks under MALLOC_MMAP_THRESHOLD_={data['malloc_mmap_threshold']}"
                 if data.get("malloc_mmap_threshold") else ", glibc's default allocator")
    lines = [f"memory fidelity, {data['date']}, {data['ranks']} CPU ranks, reduce/allgather bucket {data['bucket']:,} "
             f"elements{allocator}",
             "profile = calibrated on the profile run only; online = zerotune.model.online's fit "
             "from the runs above it (as tune applies them, from the probe's peaks); errors against VmData", "",
             f"{'config':<18} {'profile':>10} {'online':>10} {'VmData':>10} {'probe':>10} {'err profile':>11} "
             f"{'err online':>10}"]
    errors: dict[str, list[float]] = {"profile": [], "online": []}
    for (name, model), precision in ((m, p) for m in data["models"].items() for p in PRECISIONS):
        mm = memory_model(model, precision)
        metrics = model["profiles"][precision]["metrics"]
        lines.append(f"{name} {precision}: {mm.num_params:,} params, activations "
                     f"{format_bytes(mm.activation_bytes_per_sample)}/sample (DeepSpeed's first-forward RSS change "
                     f"{format_bytes(metrics.get('activation_mem_per_gpu', 0))}), calibrated overhead "
                     f"{format_bytes(mm.overhead_bytes)}")
        online = OnlineMemory(mm)
        for r in (r for r in model["runs"] if r["precision"] == precision):
            cfg = ds_config(r["stage"], r["mbs"], r["precision"])
            if r["status"] != Status.OK.value or not r["vmdata_peak_bytes"]:
                lines.append(f"  {r['name'][len(name) + 1:]:<16} {r['status']}: {r['error'][-80:]}")
                continue
            predicted, corrected_now = mm.bytes_per_device(cfg, r["mbs"]), online.bytes_per_device(cfg)
            measured = r["vmdata_peak_bytes"]
            e_prof, e_online = predicted / measured - 1, corrected_now / measured - 1
            errors["profile"].append(abs(e_prof))
            errors["online"].append(abs(e_online))
            lines.append(f"  {r['name'][len(name) + 1:]:<16} {format_bytes(predicted):>10} {format_bytes(corrected_now):>10} "
                         f"{format_bytes(measured):>10} {format_bytes(probe_peak(r) or 0):>10} {e_prof:>+11.1%} "
                         f"{e_online:>+10.1%}")
            exp = Experiment(r["name"], cfg, 1, RANKS, status=Status.OK, peak_memory_bytes=probe_peak(r))
            online, _ = online.observed(exp, 2**62)
        lines += [f"  after the grid: {line}" for line in online.describe()]
    lines.append("")
    for kind, errs in errors.items():
        if errs:
            lines.append(f"{kind:>7}: {len(errs)} runs, median |error| {statistics.median(errs):.1%}, worst {max(errs):.1%}")
    lines.append("(target: median <= 5%, worst <= 10%)")
    if data.get("malloc_mmap_threshold"):
        lines.append("reading it: every allocation above the threshold was unmapped when freed, so VmData follows the "
                     "live tensors plus the process's own memory, as a GPU's max_memory_allocated would")
    else:
        lines.append("reading it: VmData includes the freed heap glibc keeps for reuse, most in ZeRO-3 (it gathers and "
                     "frees every parameter each step); --malloc-mmap-threshold 65536 measures without it")
    return lines, errors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--report", action="store_true", help="print the table from the saved results, run nothing")
    parser.add_argument("--models", default=",".join(MODELS), help=f"comma-separated, of {list(MODELS)}")
    parser.add_argument("--steps", type=int, default=5, help="optimizer steps per run")
    parser.add_argument("--out", type=Path, default=None, help=f"results file ({RESULTS.name})")
    parser.add_argument("--malloc-mmap-threshold", type=int, default=None, metavar="BYTES",
                        help="run the ranks with glibc's MALLOC_MMAP_THRESHOLD_=BYTES (e.g. 65536): every larger "
                             "allocation gets its own mapping, returned when freed, so VmData follows the live "
                             f"tensors as a GPU's max_memory_allocated does (saved as {MMAP_RESULTS.name})")
    args = parser.parse_args()
    if args.out is None:
        args.out = MMAP_RESULTS if args.malloc_mmap_threshold is not None else RESULTS
    if not args.report:
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        with tempfile.TemporaryDirectory(prefix="zt_memfid_") as tmp:
            data = run_grid(args.models.split(","), args.steps, Path(tmp), args.malloc_mmap_threshold)
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=1) + "\n")
    data = json.loads(args.out.read_text())
    lines, _ = report(data)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
