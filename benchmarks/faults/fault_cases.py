"""The fault matrix's first round of cases, which tests/hostile/test_faults.py and benchmarks/fault_matrix.py both run:
hostile inputs (:data:`HOSTILE_INPUTS`), rank faults (:data:`RANK_FAULTS`) and a stale extension lock
(:func:`stale_lock_is_named_then_removed`)."""
from __future__ import annotations

import contextlib
import json
import logging
import os
import sys
from pathlib import Path
from typing import Iterator

from benchmarks.faults.standins import BASE_CONFIG, LAUNCHER, RANK
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec
from zerotune.core.user_files import MAX_FILE_BYTES
from zerotune.deepspeed import extensions
from zerotune.run.backends.local import LocalBackend
from zerotune.run.resources import select_resources
from zerotune.run.scheduler import Scheduler
from zerotune.run.slots import SlotPool

# (id, CLI args before the script ("{tmp}" is the test's directory), config changes, script, message)
HOSTILE_INPUTS = [
    ("device-memory-1e400", ["--num_gpus", "1", "--device-memory", "1e400"], {}, None,
     r"--device-memory = '1e400': too large"),
    ("device-memory-1KiB", ["--num_gpus", "1", "--device-memory", "1KiB"], {}, None,
     r"--device-memory 1\.00 KiB: too small to start a CPU rank"),
    ("device-memory-words", ["--num_gpus", "1", "--device-memory", "lots"], {}, None,
     r"--device-memory = 'lots': expected a size"),
    ("include-letter", ["--include", "localhost:a", "--device-memory", "2GiB"], {}, None,
     r"--include 'localhost:a': slot 'a' on host 'localhost' is not a device id"),
    ("include-empty-slot", ["--include", "localhost:0,,1", "--device-memory", "2GiB"], {}, None,
     r"--include 'localhost:0,,1': slot '' on host 'localhost' is not a device id"),
    ("include-negative", ["--include", "localhost:-1", "--device-memory", "2GiB"], {}, None,
     r"--include 'localhost:-1': device ids are non-negative"),
    ("num-gpus-above-cores", ["--num_gpus", str(len(os.sched_getaffinity(0)) + 1), "--device-memory", "2GiB"], {},
     None, rf"--num_gpus {len(os.sched_getaffinity(0)) + 1}: on CPU each slot is one rank process"),
    ("num-gpus-zero", ["--num_gpus", "0", "--device-memory", "2GiB"], {}, None, r"--num_gpus N is required"),
    ("timeout-negative", ["--num_gpus", "1", "--device-memory", "2GiB", "--timeout", "-5"], {}, None,
     r"--timeout -5: expected seconds from 1 to 10,000,000 \(about 115 days\)"),
    ("results-dir-is-a-file", ["--num_gpus", "1", "--device-memory", "2GiB", "--results-dir", "{tmp}/afile"], {},
     None, r"--results-dir '.*afile': .*afile is a file, not a directory"),
    ("results-dir-under-a-file", ["--num_gpus", "1", "--device-memory", "2GiB", "--results-dir",
                                  "{tmp}/afile/sub"], {}, None, r"afile is a file, not a directory"),
    ("results-dir-symlink-loop", ["--num_gpus", "1", "--device-memory", "2GiB", "--results-dir", "{tmp}/loop"], {},
     None, r"--results-dir '.*loop': it never resolves to a directory \(Symlink loop from .*\): a symlink loop"),
    ("results-dir-dangling-symlink", ["--num_gpus", "1", "--device-memory", "2GiB", "--results-dir", "{tmp}/dangling"],
     {}, None, r"--results-dir '.*dangling': a symlink to '.*gone', which is not there"),
    # /proc/self is read-only even for root (os.access honours it), so the case holds whoever runs the suite
    ("results-dir-unwritable", ["--num_gpus", "1", "--device-memory", "2GiB", "--results-dir",
                                "/proc/self/zerotune-results"], {}, None,
     r"--results-dir '/proc/self/zerotune-results': /proc/self is not writable"),
    ("missing-script", ["--num_gpus", "1", "--device-memory", "2GiB"], {}, "{tmp}/nope.py",
     r"training script '.*nope\.py' does not exist"),
    ("fast-yes", ["--num_gpus", "1", "--device-memory", "2GiB"], {"autotuning": {"fast": "yes"}}, None,
     r"'autotuning\.fast' = 'yes': Input should be a valid boolean"),
    ("profile-step-string", ["--num_gpus", "1", "--device-memory", "2GiB"],
     {"autotuning": {"start_profile_step": "8"}}, None, r"'autotuning\.start_profile_step' = '8'"),
    ("unknown-autotuning-key", ["--num_gpus", "1", "--device-memory", "2GiB"], {"autotuning": {"fastest": True}},
     None, r"unknown key 'autotuning\.fastest'"),
    ("unresolved-variable", ["--num_gpus", "1", "--device-memory", "2GiB"],
     {"zero_optimization": {"stage": 1, "reduce_bucket_size": "$BUCKET"}}, None,
     r"'zero_optimization\.reduce_bucket_size' holds the placeholder \$BUCKET, which no variable gives"),
    ("gas-list-above-max-batch", ["--num_gpus", "1", "--device-memory", "2GiB"],
     {"gradient_accumulation_steps": [1, 8], "autotuning": {"max_train_batch_size": 4}}, None,
     r"'gradient_accumulation_steps' candidate 8 gives train_batch_size 8 .* above "
     r"'autotuning\.max_train_batch_size' = 4"),
    ("fixed-batch-above-max", ["--num_gpus", "1", "--device-memory", "2GiB"],
     {"train_batch_size": 16, "autotuning": {"max_train_batch_size": 4}}, None,
     r"'train_batch_size' = 16 is outside 'autotuning\.max_train_batch_size' = 4"),
    ("max-batch-leaves-no-mbs", ["--num_gpus", "2", "--device-memory", "2GiB"],
     {"autotuning": {"max_train_batch_size": 1}}, None, r"the autotuning bounds leave no micro batch size"),
    ("reduce-bucket-zero", ["--num_gpus", "1", "--device-memory", "2GiB"],
     {"zero_optimization": {"stage": [0, 1], "reduce_bucket_size": 0}}, None,
     r"ds\.json: zero_optimization\.reduce_bucket_size = 0: expected a positive integer"),
    ("stage-7", ["--num_gpus", "1", "--device-memory", "2GiB"], {"zero_optimization": {"stage": 7}}, None,
     r"'zero_optimization\.stage' = 7"),
    ("config-not-json", ["--num_gpus", "1", "--device-memory", "2GiB"], "{not json", None, r"ds\.json:1:2: invalid JSON"),
    ("hostfile-missing", ["--hostfile", "{tmp}/nohosts", "--device-memory", "2GiB"], {}, None,
     r"hostfile .*nohosts does not exist"),
    # bad input by class (issue 39): files bounded in size and depth, special files, empty and unholdable values
    ("config-nested-5000-deep", ["--num_gpus", "1", "--device-memory", "2GiB"],
     '{"a": ' + "[" * 5000 + "]" * 5000 + "}", None, r"ds\.json: JSON nested deeper than the 64 levels zerotune reads"),
    ("config-dev-zero", ["--num_gpus", "1", "--device-memory", "2GiB"], Path("/dev/zero"), None,
     r"ds\.json: a character device, not a regular file"),
    ("config-over-4MiB", ["--num_gpus", "1", "--device-memory", "2GiB"], " " * (MAX_FILE_BYTES + 1), None,
     r"ds\.json: 4194305 bytes, more than the 4\.00 MiB zerotune reads"),
    ("config-optimizer-number", ["--num_gpus", "1", "--device-memory", "2GiB"], {"optimizer": 1}, None,
     r"ds\.json: 'optimizer' = 1: expected an object such as"),
    ("config-results-dir-empty", ["--num_gpus", "1", "--device-memory", "2GiB"], {"autotuning": {"results_dir": ""}},
     None, r"'autotuning\.results_dir' = '': String should have at least 1 character"),
    ("hostfile-dev-zero", ["--hostfile", "/dev/zero", "--device-memory", "2GiB"], {}, None,
     r"hostfile /dev/zero: a character device, not a regular file"),
    ("results-dir-empty", ["--num_gpus", "1", "--device-memory", "2GiB", "--results-dir", ""], {}, None,
     r"argument --results-dir: '': expected a value, not the empty string"),
    ("num-gpus-20-digits", ["--num_gpus", "99999999999999999999", "--device-memory", "2GiB"], {}, None,
     r"argument --num_gpus/--num_accelerators: '99999999999999999999': expected a whole number from -1 to 1048576"),
    ("timeout-inf", ["--num_gpus", "1", "--device-memory", "2GiB", "--timeout", "inf"], {}, None,
     r"--timeout inf: expected seconds from 1 to 10,000,000 \(about 115 days\)"),
    ("train-samples-1e400", ["--num_gpus", "1", "--device-memory", "2GiB", "--train-samples", "1e400"], {}, None,
     r"argument --train-samples: '1e400': expected a positive whole number"),
    ("var-nested-100-deep", ["--num_gpus", "1", "--device-memory", "2GiB", "--var", "X=" + "[" * 100 + "]" * 100],
     {}, None, r"--var 'X=\[+\.\.\.': VALUE is JSON nested deeper than the 64 levels zerotune reads"),
]
"""(name, zerotune's arguments, the ds_config (an object merged into :data:`BASE_CONFIG`, the file's text, or a
special file the config's path links to), the script (None: the stand-in rank), a regex of the message)."""


def hostile_argv(tmp: Path, args: list[str], config, script: str | None) -> list[str]:
    (tmp / "afile").write_text("a file, not a directory\n")
    for link, target in (("loop", "loop2"), ("loop2", "loop"), ("dangling", "gone")):
        if not (tmp / link).is_symlink():
            (tmp / link).symlink_to(tmp / target)
    (tmp / "rank.py").write_text(RANK)
    cfg = tmp / "ds.json"
    cfg.unlink(missing_ok=True)
    if isinstance(config, Path):  # a special file, such as /dev/zero
        cfg.symlink_to(config)
    elif isinstance(config, str):
        cfg.write_text(config)
    else:
        merged = json.loads(json.dumps(BASE_CONFIG))
        for key, value in config.items():
            merged[key] = {**merged[key], **value} if isinstance(value, dict) and key in merged else value
        cfg.write_text(json.dumps(merged))
    args = [a.replace("{tmp}", str(tmp)) for a in args]
    if "--results-dir" not in args:
        args += ["--results-dir", str(tmp / "results")]
    return ["tune", *args, (script or "{tmp}/rank.py").replace("{tmp}", str(tmp)), "--deepspeed_config", str(cfg)]


# (fault, the experiment it hits (a name substring), its status, its error, extra CLI args, extra env)
RANK_FAULTS = [
    ("sigkill_rank", "z0_gas1_tmbspg1", "failed", r"exit code (-9|137|1)", [], {}),
    ("crash_at_step", "z0_gas1_tmbspg1", "failed", r"RuntimeError: stand-in crash at step 2", [], {}),
    ("oom", "z0_gas1_tmbspg1", "oom", r"DefaultCPUAllocator: can't allocate memory", [], {}),
    ("hang", "z0_gas1_tmbspg1", "timeout", r"no output for 2 s: killed as hung", ["--hang-timeout", "2"], {}),
    ("ignore_term", "z0_gas1_tmbspg1", "timeout", r"no output for 2 s: killed as hung", ["--hang-timeout", "2"], {}),
    ("garbage_metrics", "z0_gas1_tmbspg1", "failed", r"metrics\.json is invalid: cannot be read", [], {}),
    ("truncated_metrics", "z0_gas1_tmbspg1", "failed", r"metrics\.json is invalid: not JSON", [], {}),
    ("garbage_probe", "z0_gas1_tmbspg1", "ok", r"^$", [], {}),
    # the third launch (profile, z0 mbs 2, z0 mbs 1) finds its master port taken
    ("port_taken", "z0_gas1_tmbspg1", "failed", r"EADDRINUSE", [], {"STANDIN_TAKE_PORT": "3"}),
]


LOCK_WAITER = r'''
import json, os, sys, time
args = sys.argv[1:]
config_path = args[args.index("--deepspeed_config") + 1]
config = json.load(open(config_path))
op = os.path.join(os.environ["TORCH_EXTENSIONS_DIR"], "fused_adam")
os.makedirs(op, exist_ok=True)
lock = os.path.join(op, "lock")
if config["stand_in"] == "dies_holding_the_lock":  # torch's FileBaton: O_CREAT | O_EXCL, then the build
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    print("building", flush=True)
    time.sleep(10**6)
while os.path.exists(lock):  # FileBaton.wait(): poll, forever, silently
    time.sleep(0.1)
print("loaded", flush=True)
with open(config["autotuning"]["metric_path"], "w") as f:
    json.dump({"throughput": 10.0}, f)
'''


class LogLines(logging.Handler):
    """The messages one zerotune logger gives while attached (the fault matrix runs the case below outside
    pytest)."""

    def __init__(self, name: str):
        super().__init__(logging.INFO)
        self.logger, self.lines = logging.getLogger(name), []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())

    def __enter__(self) -> list[str]:
        self.level = self.logger.level
        self.logger.setLevel(logging.INFO)
        self.logger.addHandler(self)
        return self.lines

    def __exit__(self, *exc) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self.level)


@contextlib.contextmanager
def lock_waiter_scheduler(tmp_path: Path, timeout_s: float, slots: int) -> Iterator[tuple[Scheduler, Path]]:
    """(a scheduler on ``slots`` local slots whose launches run the stand-in :data:`LOCK_WAITER` under the
    stand-in launcher in place of DeepSpeed's node launcher, each killed after ``timeout_s``; its experiments'
    extension cache), the launcher restored on leaving."""
    (tmp_path / "waiter.py").write_text(LOCK_WAITER)
    (tmp_path / "launcher.py").write_text(LAUNCHER)
    (tmp_path / "c.json").write_text("{}")
    spec = LaunchSpec(str(tmp_path / "waiter.py"), ("--deepspeed_config", str(tmp_path / "c.json")), cpu=True,
                      timeout_s=timeout_s)
    scheduler = Scheduler(LocalBackend(spec), SlotPool(select_resources(local_slots=slots)), tmp_path / "exps")
    import zerotune.deepspeed.launcher as launcher
    original = launcher.node_launcher
    launcher.node_launcher = lambda: [sys.executable, str(tmp_path / "launcher.py")]
    try:
        yield scheduler, extensions.extensions_dir(tmp_path / "exps")
    finally:
        launcher.node_launcher = original


def stale_lock_is_named_then_removed(tmp_path: Path) -> None:
    """A lock left by a killed build in the experiments' extension cache is named, then removed, and the next
    experiment runs (asserts; a test of tests/hostile/test_faults.py and a case of benchmarks/fault_matrix.py)."""
    with lock_waiter_scheduler(tmp_path, 2.0, 2) as (scheduler, ext):
        # 'holder' takes the lock and is killed at its timeout, mid-"build"; 'waiter' runs beside it,
        # waits on the lock and times out too: its error names the lock
        holder = Experiment("holder", {"stand_in": "dies_holding_the_lock"})
        waiter = Experiment("waiter", {"stand_in": "waits"})
        scheduler.run([holder])  # leaves the lock (killed at its timeout)
        assert (ext / "fused_adam" / "lock").exists()
        # the next batch: nothing runs, so the lock is stale: removed, said (the scheduler's log), and the run loads
        with LogLines("zerotune.run.scheduler") as lines:
            (after,) = scheduler.run([waiter])
    assert holder.status is Status.TIMEOUT
    assert lines == [f"removed {ext / 'fused_adam' / 'lock'}: a torch extension lock left by a killed process"]
    assert after.status is Status.OK and after.metric == 10.0
