"""DeepSpeed's own autotuner (``deepspeed.autotuning.Autotuner``) run against the SIMULATED cluster.

DeepSpeed's code runs unchanged, in-process, as ``deepspeed --autotuning tune`` runs it
(``launcher/runner.py: run_autotuning``: ``Autotuner(args, active_resources)``, ``tune()``),
with exactly these substitutions, all undone afterwards:

1. ``deepspeed.autotuning.scheduler.run_experiment`` (the function ``ResourceManager.run_job``
   starts in a thread for each experiment) is replaced by :func:`_simulated_run_experiment`:
   it writes what the real one writes before launching (the result dir, ``ds_config.json``,
   ``exp.json``, ``cmd.txt``), then, instead of ``subprocess.Popen(["deepspeed", ...])`` and
   the pdsh ``pkill`` clean-up, writes what the launched engine would have written:
   ``stdout.log``, ``stderr.log`` (a CUDA OOM traceback when the config does not fit) and
   ``metrics.json`` at the config's ``autotuning.metric_path`` (``engine._autotuning_exit``) or,
   for the profile run (``autotuning.model_info.profile``), ``model_info.json`` at
   ``autotuning.model_info_path`` (``engine.forward``). Everything after that is DeepSpeed's
   own: ``ResourceManager.experiment_check`` greps ``stderr.log`` for "error"
   (``search_error``), ``parse_results`` reads the metric, the autotuner records a failed run as
   metric 0 (``update_records(..., 0, 1)``), skips re-running an experiment whose result dir
   exists, and so on.
2. ``get_accelerator().total_memory`` (what ``Autotuner.get_gpu_memory_info`` reads) returns
   the scenario's simulated device memory.
3. ``deepspeed.autotuning.scheduler.TIMEOUT`` (the 5 s poll of ``experiment_check``) is 0 and its
   ``tqdm`` progress bar is silenced; DeepSpeed's logger is set to ERROR. These change no
   decision, only wall time and output.

The model profile comes from DeepSpeed's own profile run (``model_info_profile_run``, ZeRO-3 at
mbs 1), answered by the simulator with the same ``num_params`` and ``activation_mem_per_gpu`` that
zerotune's profile run gets. Each launch is recorded in a ledger (name, config, status,
SIMULATED duration, GPUs), as :class:`~benchmarks.simcluster.backend.SimulatedBackend` does.
"""
from __future__ import annotations

import argparse
import base64
import contextlib
import copy
import json
import logging
import os
import threading
from pathlib import Path
from typing import Any

from benchmarks.simcluster.backend import LedgerEntry, oom_stderr
from benchmarks.simcluster.model import Simulator


class _QuietBar:
    """Stands in for ``tqdm`` in DeepSpeed's scheduler (same calls, no output)."""

    def __init__(self, *args, **kwargs):
        pass

    def update(self, n=1):
        pass

    def close(self):
        pass


@contextlib.contextmanager
def _patched(sim: Simulator, ledger: list[LedgerEntry]):
    from deepspeed.accelerator import get_accelerator
    from deepspeed.autotuning import scheduler
    from deepspeed.utils import logger as ds_logger

    lock = threading.Lock()

    def _simulated_run_experiment(exp: dict, reservations, user_script, user_args):
        # The part of scheduler.run_experiment before the launch, unchanged in what it writes.
        include = "@".join(f"{r.node.host}:{','.join(map(str, sorted(r.slots)))}" for r in reservations)
        exp["launcher_args"] = ["--hostfile", f"{exp['hostfile']}", "--include", include,
                                "--master_port", str(exp["master_port"])]
        exp_dir = exp["result_dir"]
        os.makedirs(exp_dir, exist_ok=True)
        exp["ds_config_path"] = os.path.join(exp_dir, "ds_config.json")
        ds_config = copy.deepcopy(exp["ds_config"])
        exp["ds_config_base64"] = base64.urlsafe_b64encode(json.dumps(ds_config).encode()).decode()
        with open(exp["ds_config_path"], "w") as f:
            json.dump(ds_config, f)
        with open(os.path.join(exp_dir, "exp.json"), "w") as f:
            json.dump(exp, f)
        cmd = ["deepspeed"] + exp["launcher_args"] + [user_script] + list(user_args)
        with open(os.path.join(exp_dir, "cmd.txt"), "w") as f:
            f.write("# SIMULATED: not launched\n" + " ".join(cmd) + "\n")

        # What the launched engine would have done (SIMULATED).
        at = ds_config.get("autotuning") or {}
        profile = bool((at.get("model_info") or {}).get("profile"))
        outcome = sim.run(ds_config, profile=profile)
        memory_bytes = sim.cluster.device.memory_bytes
        with open(os.path.join(exp_dir, "stderr.log"), "w") as f:
            f.write("" if outcome.ok else oom_stderr(outcome, memory_bytes))
        with open(os.path.join(exp_dir, "stdout.log"), "w") as f:
            f.write(f"[SIMULATED] {outcome.status} after {outcome.duration_s:.1f} s\n")
        if outcome.ok and profile:
            path = at.get("model_info_path") or os.path.join(os.getcwd(), "autotuning_model_info.json")
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w") as f:
                json.dump(sim.model_info(), f)
        elif outcome.ok and at.get("metric_path"):
            with open(at["metric_path"], "w") as f:
                json.dump(sim.metrics(outcome), f)
        num_gpus = sum(len(r.slots) for r in reservations)
        with lock:
            ledger.append(LedgerEntry(exp["name"], ds_config, outcome.status, outcome.duration_s, num_gpus, profile))

    accelerator = get_accelerator()
    saved = (scheduler.run_experiment, scheduler.TIMEOUT, scheduler.tqdm, ds_logger.level)
    scheduler.run_experiment = _simulated_run_experiment
    scheduler.TIMEOUT = 0
    scheduler.tqdm = _QuietBar
    accelerator.total_memory = lambda device_index=None: sim.cluster.device.memory_bytes
    ds_logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        scheduler.run_experiment, scheduler.TIMEOUT, scheduler.tqdm = saved[:3]
        ds_logger.setLevel(saved[3])
        del accelerator.total_memory


def run_deepspeed_autotuner(sim: Simulator, user_config: dict[str, Any], workdir: Path,
                            hosts: list[str], gpus_per_node: int) -> tuple[dict | None, float | None, list[LedgerEntry]]:
    """Run DeepSpeed's autotuner (``tune()``, then ``write_optimal_config()``) on the simulator.

    Args:
        user_config: the user's ds_config (its ``autotuning`` section included; ``results_dir``
            and ``exps_dir`` are set under ``workdir``).
        hosts: host names, each with ``gpus_per_node`` slots (the launcher's ``active_resources``).

    Returns:
        (the ds_config DeepSpeed chose or None, the metric DeepSpeed recorded for it, the ledger).
    """
    from deepspeed.autotuning.autotuner import Autotuner
    from deepspeed.autotuning.constants import GLOBAL_TUNING_SPACE

    workdir = Path(workdir)
    cfg = copy.deepcopy(user_config)
    cfg.setdefault("autotuning", {}).update(results_dir=str(workdir / "ds_results"), exps_dir=str(workdir / "ds_exps"))
    config_path = workdir / "ds_config.json"
    config_path.write_text(json.dumps(cfg))
    hostfile = workdir / "hostfile"
    hostfile.write_text("".join(f"{h} slots={gpus_per_node}\n" for h in hosts))
    # The launcher's arguments (deepspeed/launcher/runner.py parse_args) that the autotuner reads.
    args = argparse.Namespace(user_script="simulated_train.py", user_args=["--deepspeed_config", str(config_path)],
                              hostfile=str(hostfile), num_nodes=-1, num_gpus=-1, master_port=29500,
                              autotuning="tune")
    active_resources = {h: list(range(gpus_per_node)) for h in hosts}
    ledger: list[LedgerEntry] = []
    with _patched(sim, ledger):
        tuner = Autotuner(args, active_resources)
        tuner.tune()
        records = tuner.get_best_space_records()
        tuner.write_optimal_config()
    best = records.get(GLOBAL_TUNING_SPACE)
    if not best or not best[0]:
        return None, None, ledger
    exp, metric_val, _ = best
    # what DeepSpeed wrote as the answer is the recorded best experiment's config
    written = json.loads((workdir / "ds_results" / "ds_config_optimal.json").read_text())
    assert written == {k: v for k, v in exp["ds_config"].items() if k != "autotuning"}
    return exp["ds_config"], metric_val, ledger
