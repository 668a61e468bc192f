"""The step probe in real ranks: DeepSpeed on 2 CPU ranks (DS_ACCELERATOR=cpu), a tiny model, few steps;
and the probe's import hook on a stand-in engine, in a subprocess."""
import json
import socket
import subprocess
import sys

import pytest

from tests.helpers.tiny import SCRIPT, TINY
from zerotune.core.experiment import Experiment, Status
from zerotune.core.launch import LaunchSpec
from zerotune.core.measure import measure
from zerotune.core.objective import OBJECTIVES
from zerotune.core.stopping import StopRule
from zerotune.probe import PROBE_DIR_ENV, PROBE_PATH, clean_exits, read_exits, read_streams
from zerotune.report.notes import run_length_note
from zerotune.run.backends.local import LocalBackend
from zerotune.run.resources import SlotPool, select_resources
from zerotune.run.scheduler import Scheduler

pytestmark = [pytest.mark.e2e, pytest.mark.usefixtures("one_thread_per_rank")]  # 2 ranks on 2 cores
# mbs 1 on 2 ranks, 4 samples per optimizer step: 2 gradient accumulation steps
Z1_GAS2 = {"train_micro_batch_size_per_gpu": 1, "train_batch_size": 4, "zero_optimization": {"stage": 1},
           "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
SEQ_LEN = int(TINY[TINY.index("--seq-len") + 1])  # tokens per sample of the tiny script's batches


def test_every_rank_writes_its_steps_and_the_metric_is_measured_from_them(tmp_path):
    cfg = tmp_path / "ds.json"
    cfg.write_text(json.dumps(Z1_GAS2))  # the script's own config, replaced by the experiment's
    args = (*TINY, "--steps", "8", "--deepspeed_config", str(cfg))
    spec = LaunchSpec(SCRIPT, args, cpu=True, device_memory_bytes=3 * 2**30, start_profile_step=2,
                      end_profile_step=5, timeout_s=300)
    scheduler = Scheduler(LocalBackend(spec), SlotPool(select_resources(local_slots=2)), tmp_path / "exps")
    (done,) = scheduler.run([Experiment("z1_mbs1_gas2", Z1_GAS2, num_slots=2)])

    exp_dir = tmp_path / "exps" / done.name
    assert done.status == Status.OK, (done.error, (exp_dir / "stderr.log").read_text()[-2000:])
    streams = read_streams(exp_dir)
    assert sorted(streams) == [0, 1]
    for rank, lines in streams.items():
        # DeepSpeed exits inside the step after end_profile_step (global step 6): that step is recorded.
        assert [ln.step for ln in lines] == [1, 2, 3, 4, 5, 6]
        assert {(ln.rank, ln.micro_steps, ln.train_batch_size) for ln in lines} == {(rank, 2, 4)}
        # what each micro batch held: the script's token ids, [mbs, --seq-len]
        assert {(ln.batch_samples, ln.seq_len) for ln in lines} == {(1, SEQ_LEN)}
        assert {ln.tokens for ln in lines} == {2 * SEQ_LEN}  # two micro batches of one sample each
        assert all(ln.step_s > 0 and ln.peak_bytes > 50 * 2**20 for ln in lines)
        # On CPU peak_bytes is the sampled VmData, what the budget (RLIMIT_DATA) limits: it counts ZeRO-1's
        # fp32 reduce bucket (reduce_bucket_size 5e8 by default: 2,000,000,000 bytes, almost none of it written
        # for this model), which the resident high-water mark beside it leaves out.
        assert all(ln.peak_bytes >= ln.rss_peak_bytes + 1_500_000_000 for ln in lines), \
            [(ln.peak_bytes, ln.rss_peak_bytes) for ln in lines]
    for lines in streams.values():  # ZeRO-1 without overlap_comm: the boundary's reduction and optimizer step
        assert all(0 < ln.boundary_s < ln.step_s for ln in lines[1:]), lines
    measured = measure(streams, OBJECTIVES["throughput"])
    assert (done.metric, done.metric_source) == (measured.value, "probe")
    assert done.boundary_share == measured.boundary_share and 0 < measured.boundary_share < 1
    assert done.metric_rel_half_width == measured.rel_half_width and measured.steady_steps >= 2
    assert done.peak_memory_bytes == max(measured.peak_bytes.values())
    assert done.max_seq_len_seen == SEQ_LEN
    # both ranks' tokens per step (4 samples of SEQ_LEN) over the same mean step as the metric's
    assert done.tokens_per_s == measured.tokens_per_s == pytest.approx(measured.value * SEQ_LEN, rel=1e-12)
    record = json.loads((exp_dir / "exp.json").read_text())
    assert (record["metric"], record["metric_source"], record["max_seq_len_seen"]) == (done.metric, "probe", SEQ_LEN)
    deepspeed = json.loads((exp_dir / "metrics.json").read_text())
    assert done.metrics == deepspeed  # DeepSpeed's own metric, for comparison
    print(f"\nprobe: {measured.value:.2f} samples/s ±{measured.rel_half_width:.1%} over {measured.steady_steps} "
          f"steady steps (warm-up {measured.warmup_steps}, mean step {measured.mean_step_s * 1e3:.2f} ms); "
          f"DeepSpeed metrics.json: {deepspeed['throughput']:.2f} samples/s "
          f"(latency {deepspeed['latency'] / 1e3:.2f} ms)")
    cmd = (exp_dir / "cmd.txt").read_text()
    assert f"PYTHONPATH={PROBE_PATH}" in cmd and f"{PROBE_DIR_ENV}={exp_dir.resolve()} " in cmd


FAKE_ENGINE = '''
import time


class DeepSpeedEngine:
    global_rank = 3

    def __init__(self, gas, fail=False):
        self.gas, self.micro, self.fail = gas, 0, fail

    def forward(self, x):
        return x

    def backward(self, loss):
        self.allreduce_gradients()  # as DeepSpeed's backward does, every micro-step

    def allreduce_gradients(self):
        time.sleep(0.03)  # as ZeRO-2/3's reduction epilogue, every micro-step: timed at the boundary only

    def is_gradient_accumulation_boundary(self):
        return (self.micro + 1) % self.gas == 0

    def train_batch_size(self):
        if self.fail:
            raise RuntimeError("no batch size")
        return 8

    def step(self):
        if self.is_gradient_accumulation_boundary():
            time.sleep(0.05)  # the optimizer step
            self.allreduce_gradients()  # as DeepSpeed's step() may: timed with the step, not twice
        self.micro += 1
        if self.micro == 6:
            exit()  # as DeepSpeed's autotuning exit, inside the step
'''

SCRIPT_ON_FAKE = '''
import sys
print("deepspeed imported at start-up:", "deepspeed" in sys.modules)
print("zerotune imported at start-up:", "zerotune" in sys.modules)
from deepspeed.runtime.engine import DeepSpeedEngine
engine = DeepSpeedEngine(gas=2, fail=sys.argv[1] == "fail")
for _ in range(10):
    engine.backward(engine.forward(1))
    engine.step()
'''


def test_the_probe_hooks_the_engine_records_the_exit_step_chains_and_never_breaks_training(tmp_path):
    fake, user, out = tmp_path / "fake", tmp_path / "user", tmp_path / "out"
    for d in (fake / "deepspeed" / "runtime", user, out):
        d.mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("")
    (fake / "deepspeed" / "runtime" / "__init__.py").write_text("")
    (fake / "deepspeed" / "runtime" / "engine.py").write_text(FAKE_ENGINE)
    (user / "sitecustomize.py").write_text(f"open({str(tmp_path / 'chained')!r}, 'a').write('x')\n")
    (tmp_path / "train.py").write_text(SCRIPT_ON_FAKE)

    def run(probe_dir, *args):
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(map(str, (PROBE_PATH, fake, user)))}
        if probe_dir:
            env[PROBE_DIR_ENV] = str(probe_dir)
        return subprocess.run([sys.executable, str(tmp_path / "train.py"), *args], env=env, capture_output=True,
                              text=True, timeout=60)

    proc = run(out, "ok")
    assert proc.returncode == 0 and "deepspeed imported at start-up: False" in proc.stdout, proc.stderr
    assert "zerotune imported at start-up: False" in proc.stdout  # the ranks may run another environment
    lines = [json.loads(ln) for ln in (out / "probe.rank3.jsonl").read_text().splitlines()]
    assert [(ln["rank"], ln["step"], ln["micro_steps"], ln["train_batch_size"]) for ln in lines] == [
        (3, 1, 2, 8), (3, 2, 2, 8), (3, 3, 2, 8)]  # step 3 ended in exit()
    assert all(ln["batch_samples"] is None and ln["seq_len"] is None for ln in lines)  # no torch: no tensors
    assert all(ln["step_s"] > 0 and ln["peak_bytes"] > 0 for ln in lines)
    assert [b["t"] - a["t"] for a, b in zip(lines, lines[1:])] == [ln["step_s"] for ln in lines[1:]]
    # once per optimizer step: the boundary backward's allreduce_gradients (0.03 s) and the boundary step()
    # (0.05 s and its own allreduce_gradients, 0.03 s), not the other micro-step's allreduce_gradients (0.03 s)
    assert all(0.11 <= ln["boundary_s"] < 0.14 for ln in lines), [ln["boundary_s"] for ln in lines]
    assert all(ln["step_s"] >= ln["boundary_s"] + 0.03 for ln in lines[1:])
    assert (tmp_path / "chained").read_text() == "x"  # the user's sitecustomize ran too

    (tmp_path / "failing").mkdir()
    failing = run(tmp_path / "failing", "fail")  # train_batch_size() raises: reported once, training goes on
    assert failing.returncode == 0 and failing.stderr.count("zerotune probe:") == 1, failing.stderr
    assert "RuntimeError: no batch size" in failing.stderr

    off = run(None, "ok")  # no PYTHON_ZEROTUNE_PROBE_DIR: nothing recorded, the user's sitecustomize still runs
    assert off.returncode == 0 and (tmp_path / "chained").read_text() == "xxx"
    assert sorted(p.name for p in out.iterdir()) == ["exit.rank3.json", "probe.rank3.jsonl"]


# Registers libc's abort() as a C-level exit handler: it runs in exit(), after Python's finalization (its atexit
# hooks included), as a C++ destructor's std::terminate does ("terminate called without an active exception").
ABORT_AT_C_EXIT = """
import ctypes
libc = ctypes.CDLL(None)
libc.__cxa_atexit(ctypes.cast(libc.abort, ctypes.c_void_p), None, None)
"""

SCRIPT_ENDING = '''
import sys
from deepspeed.runtime.engine import DeepSpeedEngine
if sys.argv[1] == "exit_before":
    sys.exit(0)  # before any step: no record
engine = DeepSpeedEngine(gas=1)
for _ in range(3):
    engine.backward(engine.forward(1))
    engine.step()
if sys.argv[1] == "raise":
    raise RuntimeError("saving the checkpoint failed")
if sys.argv[1] == "exit_3":
    sys.exit(3)
if sys.argv[1] == "abort":
''' + "\n".join("    " + line for line in ABORT_AT_C_EXIT.strip().splitlines()) + "\n"


def test_each_rank_records_how_its_script_ended_and_a_teardown_abort_comes_after_a_clean_record(tmp_path):
    fake = tmp_path / "fake"
    (fake / "deepspeed" / "runtime").mkdir(parents=True)
    (fake / "deepspeed" / "__init__.py").write_text("")
    (fake / "deepspeed" / "runtime" / "__init__.py").write_text("")
    (fake / "deepspeed" / "runtime" / "engine.py").write_text(FAKE_ENGINE)
    (tmp_path / "train.py").write_text(SCRIPT_ENDING)
    ended = {}
    for how in ("end", "raise", "exit_3", "abort", "exit_before"):
        out = tmp_path / how
        out.mkdir()
        env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": f"{PROBE_PATH}:{fake}", PROBE_DIR_ENV: str(out)}
        proc = subprocess.run([sys.executable, str(tmp_path / "train.py"), how], env=env, capture_output=True,
                              text=True, timeout=60)
        ended[how] = (proc.returncode, read_exits(out))
        assert "zerotune probe:" not in proc.stderr, proc.stderr
    # no MASTER_ADDR: the address this machine reaches 127.0.0.1 from
    clean = {"rank": 3, "steps": 3, "uncaught": None, "exit_status": None, "host": socket.gethostname(),
             "address": "127.0.0.1"}
    assert ended == {"end": (0, {3: clean}),
                     "raise": (1, {3: {**clean, "uncaught": "RuntimeError: saving the checkpoint failed"}}),
                     "exit_3": (3, {3: {**clean, "exit_status": 3}}),
                     "abort": (-6, {3: clean}),  # SIGABRT after the record
                     "exit_before": (0, {})}


def test_clean_exits_needs_every_rank_of_the_world_to_have_ended_its_script_cleanly(tmp_path):
    def write(rank, **fields):
        record = {"rank": rank, "steps": 5, "uncaught": None, "exit_status": None, **fields}
        (tmp_path / f"exit.rank{rank}.json").write_text(json.dumps(record))

    write(0)
    assert not clean_exits(tmp_path, 2)  # rank 1 never finished its interpreter
    write(1, exit_status=0)
    assert clean_exits(tmp_path, 2)
    assert not clean_exits(tmp_path, 3) and not clean_exits(tmp_path, 0)
    write(1, exit_status="bad data path")  # sys.exit("...") exits 1
    assert not clean_exits(tmp_path, 2)
    write(1, uncaught="RuntimeError: boom")
    assert not clean_exits(tmp_path, 2)
    (tmp_path / "exit.rank1.json").write_text('{"rank": 1, "ste')  # cut short: no record
    assert not clean_exits(tmp_path, 2)


class _NeverEnds(StopRule):
    """A stop rule that never ends a run: the script's own end does, past the cap."""

    def check(self, *args, **kwargs):
        return None


def test_a_rank_aborting_in_teardown_after_its_script_ended_past_the_cap_is_measured_not_failed(tmp_path):
    """The teardown abort seen on gloo-backed CPU ranks ("terminate called without an active exception",
    exit -6), reproduced: every rank's interpreter ends cleanly, then abort() runs as a C exit handler."""
    cfg = tmp_path / "ds.json"
    config = {"train_micro_batch_size_per_gpu": 1, "zero_optimization": {"stage": 0},
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}}
    cfg.write_text(json.dumps(config))
    script = tmp_path / "train_then_abort.py"
    script.write_text(ABORT_AT_C_EXIT + f"import runpy, sys\nsys.argv[0] = {SCRIPT!r}\n"
                      f"runpy.run_path({SCRIPT!r}, run_name='__main__')\n")
    args = (*TINY, "--steps", "6", "--deepspeed_config", str(cfg))
    # end_profile_step 3: the cap is the probe's step 4; the extended exit (step 15) is never reached: the
    # script ends at step 6 on its own
    # cold: the abort is a C exit handler, which a warm rank (it ends with os._exit after Python's own exit
    # handlers) never runs
    spec = LaunchSpec(str(script), args, cpu=True, device_memory_bytes=3 * 2**30, start_profile_step=2,
                      end_profile_step=3, timeout_s=300, stop_rule=_NeverEnds(OBJECTIVES["throughput"]), warm=False)
    scheduler = Scheduler(LocalBackend(spec), SlotPool(select_resources(local_slots=2)), tmp_path / "exps")
    (done,) = scheduler.run([Experiment("z0_mbs1_gas1", config, num_slots=2)])

    exp_dir = tmp_path / "exps" / done.name
    assert done.exit_code not in (0, None), done.exit_code  # the launch failed...
    assert (done.status, done.ended) == (Status.OK, "script_end"), (done.error, (exp_dir / "stderr.log").read_text()[-2000:])
    assert done.error == (f"exit code {done.exit_code} after every rank's script ended cleanly (a crash in the "
                          f"interpreter's teardown): the steps measured count")
    assert {r: e["steps"] for r, e in read_exits(exp_dir).items()} == {0: 6, 1: 6}
    # the summary's run-length line from the real run, at half its half-width as the precision: 3x its steady steps more
    line = run_length_note([done], done, done.metric_rel_half_width / 2, "--steps", raised=False)
    assert line.startswith(f"run length: 1 of 1 run(s) ended at the script's own last step before the precision "
                           f"(±{done.metric_rel_half_width / 2:.1%}); the answer, {done.name}, was known to "
                           f"±{done.metric_rel_half_width:.1%} over {done.steady_steps} steady steps, and about "
                           f"{3 * done.steady_steps} more"), line
    streams = read_streams(exp_dir)
    assert (done.metric, done.metric_source) == (measure(streams, OBJECTIVES["throughput"]).value, "probe")
