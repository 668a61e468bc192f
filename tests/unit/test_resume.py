"""Tests for zerotune.run.resume and the scheduler's resume: a rerun reuses a result only for the
same experiment (config, script, arguments, layout, budget, measurement) and only an OK or OOM.

No DeepSpeed launch: a scripted backend sets each experiment's outcome and records what it ran.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path

from zerotune.core.experiment import Experiment, Status
from zerotune.inputs.job import Job, TuneOptions
from zerotune.run.backends.base import Backend
from zerotune.run.resources import select_resources
from zerotune.run.resume import resume_context, resume_key
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool

GiB = 2**30
SCRIPT_V1 = "print('model v1')\n"
USER_CONFIG = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0}}


class Scripted(Backend):
    """Launches nothing and writes nothing: sets the outcome given for each name (OK by default,
    with the mbs as its metric) and records the names it ran, in order."""

    def __init__(self, outcomes: dict[str, Status] | None = None):
        self.outcomes = outcomes or {}
        self.ran: list[str] = []

    def run(self, exp, reservation, exp_dir):
        self.ran.append(exp.name)
        exp.status = self.outcomes.get(exp.name, Status.OK)
        exp.metric = float(exp.mbs) if exp.status is Status.OK else None
        return exp


def make_job(tmp_path: Path, *script_args: str, budget: int = 2 * GiB, config_dir: str = "") -> Job:
    config = tmp_path / config_dir / "ds.json"
    config.parent.mkdir(parents=True, exist_ok=True)
    config.write_text(json.dumps(USER_CONFIG))
    return Job.build(str(tmp_path / "train.py"), [*script_args, "--deepspeed_config", str(config)],
                     select_resources(local_slots=1),
                     TuneOptions(device_memory_bytes=budget, results_dir=str(tmp_path / "results"), cpu=True))


def tune(job: Job, outcomes: dict[str, Status] | None = None, names: str = "abcd") -> tuple[list[str], list]:
    """Run experiments ``names`` (mbs 1, 2, ...) through a scheduler built as the Autotuner builds
    it; (the names launched, [(name, status, metric)] returned)."""
    backend = Scripted(outcomes)
    scheduler = Scheduler(backend, SlotPool(select_resources(local_slots=1)), job.exps_dir,
                          context=resume_context(job))
    done = scheduler.run([Experiment(n, {"train_micro_batch_size_per_gpu": mbs}) for mbs, n in enumerate(names, 1)])
    assert scheduler.launched == len(backend.ran)
    return backend.ran, [(e.name, e.status, e.metric) for e in done]


def script(tmp_path: Path, text: str = SCRIPT_V1) -> Path:
    path = tmp_path / "train.py"
    path.write_text(text)
    return path


def record(job: Job, name: str) -> dict:
    return json.loads((job.exps_dir / name / "exp.json").read_text())


ALL_OK = [("a", Status.OK, 1.0), ("b", Status.OK, 2.0), ("c", Status.OK, 3.0), ("d", Status.OK, 4.0)]


# --- what the key covers --------------------------------------------------------------------


def test_context_has_the_script_its_arguments_without_the_config_path_the_layout_budget_and_measurement(tmp_path):
    path = script(tmp_path)
    job = make_job(tmp_path, "--steps", "6")
    assert resume_context(job) == {
        "script": str(path.resolve()),
        "script_sha256": hashlib.sha256(SCRIPT_V1.encode()).hexdigest(),
        "script_args": ["--steps", "6", "--deepspeed_config", "<ds_config>"],
        "num_nodes": 1, "slots_per_node": 1, "mp_size": 1, "cpu": True, "device_memory_bytes": 2 * GiB,
        "start_profile_step": 3, "end_profile_step": 5, "objective": "throughput", "precision": 0.02,
        "arg_mappings": {},
    }


def test_config_files_at_different_paths_with_the_same_content_give_the_same_key(tmp_path):
    script(tmp_path)
    here, there = make_job(tmp_path, config_dir="here"), make_job(tmp_path, config_dir="there")
    assert here.config_path != there.config_path
    assert resume_context(here) == resume_context(there)
    assert resume_key(USER_CONFIG, resume_context(here)) == resume_key(USER_CONFIG, resume_context(there))
    # the --flag=PATH form keeps its flag
    joined = Job.build(str(tmp_path / "train.py"), [f"--deepspeed={here.config_path}"],
                       select_resources(local_slots=1), TuneOptions(device_memory_bytes=2 * GiB, cpu=True))
    assert resume_context(joined)["script_args"] == ["--deepspeed=<ds_config>"]


def test_key_follows_the_config_content_not_its_spelling_and_the_context():
    context = {"script": "/x/train.py", "device_memory_bytes": 2 * GiB}
    key = resume_key({"zero_optimization": {"stage": 1}}, context)
    assert len(key) == 64 and set(key) <= set("0123456789abcdef")
    # reduce_bucket_size 5e8 is DeepSpeed's default: the same config
    assert resume_key({"zero_optimization": {"stage": 1, "reduce_bucket_size": 5e8}}, dict(reversed(context.items()))) \
        == key
    assert resume_key({"zero_optimization": {"stage": 2}}, context) != key
    assert resume_key({"zero_optimization": {"stage": 1}}, {**context, "device_memory_bytes": 4 * GiB}) != key
    assert resume_key({"zero_optimization": {"stage": 1}}, {}) != key


# --- what a rerun reuses --------------------------------------------------------------------


def test_a_rerun_with_the_same_inputs_launches_nothing(tmp_path):
    script(tmp_path)
    job = make_job(tmp_path)
    assert tune(job) == (["a", "b", "c", "d"], ALL_OK)
    assert tune(make_job(tmp_path)) == ([], ALL_OK)
    rec = record(job, "a")
    assert rec["resume_context"] == resume_context(job)
    assert rec["resume_key"] == resume_key({"train_micro_batch_size_per_gpu": 1}, resume_context(job))
    assert len(rec["config_digest"]) == 12  # kept for a person reading it


def test_a_changed_script_content_reruns_and_records_why(tmp_path):
    script(tmp_path)
    tune(make_job(tmp_path))
    script(tmp_path, "print('model v2')\n")
    job = make_job(tmp_path)
    (job.exps_dir / "a" / "stdout.log").write_text("from the v1 run")
    assert tune(job) == (["a", "b", "c", "d"], ALL_OK)
    assert not (job.exps_dir / "a" / "stdout.log").exists()  # the stale attempt's dir was removed
    assert record(job, "a")["resume_context"]["script_sha256"] == hashlib.sha256(b"print('model v2')\n").hexdigest()
    assert tune(job)[0] == []


def test_a_changed_script_argument_reruns(tmp_path):
    script(tmp_path)
    tune(make_job(tmp_path, "--data", "wiki"))
    assert tune(make_job(tmp_path, "--data", "books"))[0] == ["a", "b", "c", "d"]
    assert tune(make_job(tmp_path, "--data", "books"))[0] == []


def test_a_changed_arg_mapping_reruns(tmp_path):
    script(tmp_path)
    tune(make_job(tmp_path, "--bs", "1"))
    mapped = {**USER_CONFIG, "autotuning": {**USER_CONFIG.get("autotuning", {}),
                                            "arg_mappings": {"train_micro_batch_size_per_gpu": "--bs"}}}
    (tmp_path / "ds.json").write_text(json.dumps(mapped))
    job = Job.build(str(tmp_path / "train.py"), ["--bs", "1", "--deepspeed_config", str(tmp_path / "ds.json")],
                    select_resources(local_slots=1),
                    TuneOptions(device_memory_bytes=2 * GiB, results_dir=str(tmp_path / "results"), cpu=True))
    assert resume_context(job)["arg_mappings"] == {"train_micro_batch_size_per_gpu": "--bs"}
    ran, _ = tune(job)
    assert ran == list("abcd")  # each run now gets --bs <its mbs>: not the same experiments


def test_a_changed_unrelated_file_beside_the_script_does_not_rerun(tmp_path):
    script(tmp_path)
    (tmp_path / "notes.txt").write_text("one")
    tune(make_job(tmp_path))
    (tmp_path / "notes.txt").write_text("two")
    (tmp_path / "helper.py").write_text("X = 1\n")
    assert tune(make_job(tmp_path)) == ([], ALL_OK)


def test_an_oom_is_reused_under_the_same_budget_and_rerun_under_a_larger_one(tmp_path):
    script(tmp_path)
    oom = {"c": Status.OOM, "d": Status.OOM}
    expected = [("a", Status.OK, 1.0), ("b", Status.OK, 2.0), ("c", Status.OOM, None), ("d", Status.OOM, None)]
    assert tune(make_job(tmp_path, budget=2 * GiB), oom) == (["a", "b", "c", "d"], expected)
    assert tune(make_job(tmp_path, budget=2 * GiB)) == ([], expected)
    assert tune(make_job(tmp_path, budget=4 * GiB)) == (["a", "b", "c", "d"], ALL_OK)


def test_failed_timeout_and_interrupted_are_rerun_an_ok_is_not(tmp_path):
    script(tmp_path)
    job = make_job(tmp_path)
    first = {"b": Status.FAILED, "c": Status.TIMEOUT, "d": Status.INTERRUPTED}
    assert tune(job, first) == (["a", "b", "c", "d"], [("a", Status.OK, 1.0), ("b", Status.FAILED, None),
                                                       ("c", Status.TIMEOUT, None), ("d", Status.INTERRUPTED, None)])
    assert tune(job) == (["b", "c", "d"], ALL_OK)
    assert tune(job) == ([], ALL_OK)


def test_a_record_without_a_resume_key_is_rerun(tmp_path):
    """A record of an older zerotune (config digest only) cannot tell which script it measured."""
    script(tmp_path)
    job = make_job(tmp_path)
    tune(job, names="a")
    path = job.exps_dir / "a" / "exp.json"
    old = json.loads(path.read_text())
    del old["resume_key"], old["resume_context"]
    path.write_text(json.dumps(old))
    assert tune(job, names="a") == (["a"], [("a", Status.OK, 1.0)])
