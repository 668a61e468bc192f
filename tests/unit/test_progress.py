"""Tests for zerotune.report.progress: the plain log lines, the counts, the live status line on a terminal."""
from __future__ import annotations

import re
import time
from io import StringIO
from pathlib import Path

import pytest
from rich.console import Console

from zerotune.core.experiment import Experiment, ExperimentKind, Status
from zerotune.core.objective import Objective
from zerotune.report.progress import Progress
from zerotune.run.backends.base import Backend
from zerotune.run.resources import SlotPool, select_resources
from zerotune.run.scheduler import Scheduler


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def exp(name: str, status: Status | None = None, metric: float | None = None, wall_s: float | None = None,
        error: str = "", space: str = "z1", memory_bytes: int | None = None,
        peak: int | None = None) -> Experiment:
    kind = ExperimentKind.PROFILE if space == "profile" else ExperimentKind.MBS
    return Experiment(name, {"train_micro_batch_size_per_gpu": 1}, space=space, kind=kind, status=status, metric=metric,
                      wall_s=wall_s, error=error, memory_bytes=memory_bytes, peak_memory_bytes=peak)


def plain(objective=Objective.named("throughput")):
    out = StringIO()
    console = Console(file=out, force_terminal=False, width=200)
    clock = Clock()
    progress = Progress(console, objective, clock=clock)
    progress.start()
    return progress, clock, out


def test_plain_lines_are_the_log_format_and_counts_follow_events():
    progress, clock, out = plain()
    a = exp("z1_mbs2_gas1", memory_bytes=3 * 2**30)
    b = exp("z1_mbs4_gas1")
    progress.update(exp("profile", Status.OK, None, 12.34, space="profile"), "cached")
    progress.update(a, "queued")
    progress.update(b, "queued")
    assert (progress.done, progress.running, progress.queued) == (1, 0, 2)
    clock.now += 1.25
    progress.update(a, "start")
    progress.update(b, "start")
    assert (progress.done, progress.running, progress.queued) == (1, 2, 0)
    clock.now += 30.0
    a.status, a.metric, a.wall_s, a.peak_memory_bytes = Status.OK, 612.43, 29.96, 2**30
    a.metric_rel_half_width, a.ended = 0.0183, "precise"
    progress.update(a, "end")
    clock.now += 0.5
    b.status, b.wall_s, b.error = Status.OOM, 3.0, "[rank0]: DefaultCPUAllocator: can't allocate memory [/dev/shm]"
    progress.update(b, "end")
    progress.stop()

    assert out.getvalue().splitlines() == [
        "[   0.0s] cached profile: ok throughput=- (12.3 s)",
        "[   1.2s] start z1_mbs2_gas1, estimate 3.00 GiB/rank",  # 1.25 -> "1.2" (round half even)
        "[   1.2s] start z1_mbs4_gas1",
        "[  31.2s] done z1_mbs2_gas1: ok throughput=612.4 ±1.8% (30.0 s, peak 1.00 GiB, ended: precise)",
        # the error's brackets are printed as they are, not read as rich markup
        "[  31.8s] done z1_mbs4_gas1: oom throughput=- (3.0 s) "
        "[rank0]: DefaultCPUAllocator: can't allocate memory [/dev/shm]",
    ]
    assert (progress.done, progress.ok, progress.running, progress.queued) == (3, 2, 0, 0)
    assert progress.best is a  # the profile's OK is never "the best"
    assert progress.status_text() == ("done 3 (2 ok) · running 0 · queued 0 · best z1_mbs2_gas1 "
                                      "throughput=612.4 samples/s · 31.8 s")


def test_best_follows_the_objective_direction():
    progress, clock, out = plain(Objective.named("latency"))
    for name, metric in (("a", 0.5), ("b", 0.25), ("c", 0.75)):
        progress.update(exp(name, Status.OK, metric, 1.0), "cached")
    progress.update(exp("d", Status.FAILED, None, 1.0, error="exit code 1: boom"), "cached")
    assert progress.best.name == "b"
    assert progress.status_text() == "done 4 (3 ok) · running 0 · queued 0 · best b latency=0.25 s/step · 0.0 s"
    assert out.getvalue().splitlines()[-1] == "[   0.0s] cached d: failed latency=- (1.0 s) exit code 1: boom"


def test_unknown_event_is_refused():
    progress, _, _ = plain()
    with pytest.raises(ValueError, match="unknown progress event 'finish'"):
        progress.update(exp("a"), "finish")


def test_no_live_display_when_not_a_terminal():
    progress, _, out = plain()
    assert progress._live is None
    progress.update(exp("a"), "queued")
    assert out.getvalue() == ""  # queued prints nothing; there is no status line off a terminal


def test_terminal_shows_a_live_status_line_with_counts_and_best():
    out = StringIO()
    console = Console(file=out, force_terminal=True, width=200, color_system=None)
    clock = Clock()
    progress = Progress(console, Objective(), clock=clock, refresh_per_second=20)
    progress.start()
    try:
        assert progress._live is not None
        for name in ("a", "b", "c"):
            progress.update(exp(name), "queued")
        progress.update(exp("a"), "start")
        clock.now += 7.0
        progress.update(exp("z0_mbs8_gas1", Status.OK, 123.456, 5.0), "cached")
        text = out.getvalue()
    finally:
        progress.stop()
    assert "done 1 (1 ok) · running 1 · queued 2 · best z0_mbs8_gas1 throughput=123.5 samples/s · 7.0 s" in text
    # the log lines are printed above the live line as well
    assert "[   0.0s] start a" in text and "[   7.0s] cached z0_mbs8_gas1: ok throughput=123.5 (5.0 s)" in text
    assert progress._live is None
    progress.stop()  # twice is harmless


class _Instant(Backend):
    def run(self, exp, reservation, exp_dir):
        time.sleep(0.05)
        exp.status, exp.metric, exp.wall_s = Status.OK, float(exp.mbs), 0.05
        return exp


def test_scheduler_events_drive_the_counts(tmp_path: Path):
    """Fed by a real Scheduler (3 experiments, 1 slot, one finished on disk): queued -> start -> end."""
    events: list[tuple[str, str, tuple[int, int, int]]] = []
    progress, clock, out = plain()

    def on_update(e, event):
        progress.update(e, event)
        events.append((event, e.name, (progress.done, progress.running, progress.queued)))

    pool = SlotPool(select_resources(local_slots=1))
    exps = [Experiment(f"m{m}", {"train_micro_batch_size_per_gpu": m}) for m in (1, 2, 3)]
    Scheduler(_Instant(), pool, tmp_path).run(exps[:1])
    fresh = [Experiment(e.name, e.ds_config) for e in exps]
    Scheduler(_Instant(), pool, tmp_path, on_update=on_update).run(fresh)
    assert events == [
        ("cached", "m1", (1, 0, 0)),
        ("queued", "m2", (1, 0, 1)),
        ("queued", "m3", (1, 0, 2)),
        ("start", "m2", (1, 1, 1)),
        ("end", "m2", (2, 0, 1)),
        ("start", "m3", (2, 1, 0)),
        ("end", "m3", (3, 0, 0)),
    ]
    assert progress.best.name == "m3"
    assert [re.sub(r"^\[ *[\d.]+s\] ", "", ln) for ln in out.getvalue().splitlines()] == [
        "cached m1: ok throughput=1 (0.1 s)",
        "start m2",
        "done m2: ok throughput=2 (0.1 s)",
        "start m3",
        "done m3: ok throughput=3 (0.1 s)",
    ]
