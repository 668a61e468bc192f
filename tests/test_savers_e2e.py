"""End to end, real DeepSpeed on 2 CPU ranks: the memory savers (zerotune.strategy.savers) tried, chosen and
passed to the script, and an offloaded config run (on CPU ranks the host is the rank: the run, not the saving)."""
import json
from pathlib import Path

import pytest

from zerotune.core.experiment import Experiment, Status
from zerotune.deepspeed.validate import validate
from zerotune.run.backends.base import LaunchSpec
from zerotune.run.backends.local import LocalBackend
from zerotune.run.resources import SlotPool, select_resources
from zerotune.run.scheduler import Scheduler

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[1]
GPT = str(ROOT / "examples" / "train_gpt.py")
TINY = ["--vocab", "512", "--seq-len", "32", "--d-model", "64", "--n-layer", "2", "--n-head", "2"]


@pytest.fixture(autouse=True)
def one_thread_per_rank(monkeypatch):
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # 2 ranks on 2 cores


@pytest.mark.parametrize("stage, offload", [(2, {"offload_optimizer": {"device": "cpu"}}),
                                            (3, {"offload_optimizer": {"device": "cpu"},
                                                 "offload_param": {"device": "cpu"}})])
def test_an_offloaded_config_zerotune_validates_runs_on_cpu_ranks(tmp_path, stage, offload):
    # torch's AdamW on the host partition ("torch_adam"): no CPU-Adam build, as zerotune's GPU checks run it
    ds_config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1, "train_batch_size": 4,
                 "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}},
                 "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000_000, **offload}}
    validate(ds_config, 2)
    (tmp_path / "ds.json").write_text(json.dumps(ds_config))
    spec = LaunchSpec(script=GPT, script_args=tuple(TINY + ["--steps", "5", "--deepspeed_config", str(tmp_path / "ds.json")]),
                      cpu=True, device_memory_bytes=3 * 2**30, start_profile_step=2, end_profile_step=3, timeout_s=300)
    pool = SlotPool(select_resources(local_slots=2))
    exp = Experiment(f"z{stage}_offloaded", ds_config, num_slots=2)
    (done,) = Scheduler(LocalBackend(spec), pool, tmp_path / "exps").run([exp])
    logs = "".join((tmp_path / "exps" / exp.name / f).read_text() for f in ("stdout.log", "stderr.log"))
    assert done.status == Status.OK, (done.error, logs[-3000:])
    assert done.metric > 0 and pool.free_slots == 2
    # the engine's own optimizer offloaded (the probe's record of what the engine runs with, not of the config)
    engine = json.loads((tmp_path / "exps" / exp.name / "engine_config.json").read_text())
    assert (engine["offload_optimizer"], engine["offload_param"]) == (True, stage == 3)
