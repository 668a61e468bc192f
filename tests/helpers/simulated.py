"""The whole tuner on the SIMULATED cluster (benchmarks/simcluster): no process, milliseconds a tuning."""
import io
import json
from pathlib import Path

from rich.console import Console

from benchmarks.simcluster.backend import SimulatedBackend
from benchmarks.simcluster.model import Simulator
from benchmarks.simcluster.scenarios import SCENARIOS
from benchmarks.simulated_cluster import USER_CONFIG
from zerotune.autotuner import Autotuner, TuneOptions
from zerotune.run.resources import select_resources


def tune_simulated(tmp_path: Path, index: int, fast: bool, stages, overrides: dict | None = None, **options):
    """Tune scenario ``index`` of the SIMULATED cluster, with ``overrides`` over the user config and ``options``
    (:class:`~zerotune.autotuner.TuneOptions` fields) over the harness's; (ledger rows, stage decisions, answer)."""
    sc = SCENARIOS[index]
    sim = Simulator(sc.model, sc.cluster, seed=sc.seed, end_profile_step=5)
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("".join(f"sim-node-{i} slots={sc.cluster.gpus_per_node}\n" for i in range(sc.cluster.num_nodes)))
    cfg = json.loads(json.dumps(USER_CONFIG))
    cfg["zero_optimization"]["stage"] = list(stages) if isinstance(stages, tuple) else stages
    cfg["autotuning"]["fast"] = fast
    for key, value in (overrides or {}).items():
        cfg[key] = {**cfg[key], **value} if isinstance(value, dict) else value
    (tmp_path / "ds.json").write_text(json.dumps(cfg))
    backend = SimulatedBackend(sim)
    tuner = Autotuner("simulated_train.py", ["--deepspeed_config", str(tmp_path / "ds.json")],
                      select_resources(hostfile),
                      TuneOptions(device_memory_bytes=sc.cluster.device.memory_bytes, results_dir=str(tmp_path / "r"),
                                  cpu=False, hostfile=str(hostfile), **options),
                      console=Console(file=io.StringIO()), backend=backend)
    best = tuner.tune()

    def row(entry):
        c = entry.ds_config
        zero = {k: v for k, v in c["zero_optimization"].items() if k != "stage"}
        head = (c["zero_optimization"]["stage"], c["train_micro_batch_size_per_gpu"],
                c.get("gradient_accumulation_steps"), entry.status)
        if entry.profile:
            return ("profile",) + head
        return head + ((zero,) if zero else ())

    decisions = [(r.key, getattr(r.decision, "value", r.decision), getattr(r.trace.stop, "value", r.trace.stop) or "")
                 for r in tuner.stage_results]
    answer = (best.stage, best.mbs, best.gas, best.ds_config["zero_optimization"])
    return [row(e) for e in backend.ledger], decisions, answer
