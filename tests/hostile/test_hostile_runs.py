"""Hostile round two, runs (issue 28): nothing lost, no traceback, no silent wrong answer.

Each case (:mod:`benchmarks.faults.hostile_runs`) runs the real ``zerotune`` CLI in its own process with the stand-in
launcher and a stand-in rank of its own (DeepSpeed's result files, plus the probe's stream, a barrier standing
for a collective, a self-inflicted SIGSTOP, a helper that leaves the run's tree, group, session and
environment), and returns what :func:`~benchmarks.faults.hostile_runs.matrix_cases` reports to
benchmarks/fault_matrix.py: why the fault was not survived (empty when it was), finished results lost or changed,
processes left, tracebacks seen. The tests assert that report is clean and the case's own facts (status, error,
answer).

- **a log line is not an OOM**: a script that prints "out of memory-mapped shards" and raises
  ``FileNotFoundError`` fails with that error, is run again on a rerun, and the answer stands;
- **progress is the probe's steps**: a quiet run that records a step every 0.8 s outlives a 2 s
  ``--hang-timeout``;
- **a default timeout**: without ``--timeout`` a rank stopped by SIGSTOP in a measured run (its peer waits at
  the barrier) is killed at the default derived from the profile run, and a SIGSTOPped profile run at the
  bound for an unknown start-up; the tuning ends either way;
- **a helper outlives nothing**: a daemon a rank starts with a cleared environment, in its own session,
  orphaned by a double fork, is killed with its experiment.
"""
from __future__ import annotations

import re

import pytest

from benchmarks.faults.hostile_runs import matrix_cases
from zerotune.core.experiment import Status
from zerotune.run.expdir import classify

CLEAN = {"why": [], "lost": [], "left": [], "tracebacks": []}


@pytest.mark.e2e  # one or two real tuner processes each: 6 to 15 s
@pytest.mark.parametrize("case", matrix_cases(), ids=[re.sub(r"\W+", "-", c[1]) for c in matrix_cases()])
def test_a_hostile_run_is_survived(tmp_path, case):
    _, _, run = case
    assert run(tmp_path) == CLEAN


# --- a failure is an OOM only when the error a rank raised says so -----------------------------------

TRACEBACK = "Traceback (most recent call last):\n  File \"train.py\", line 9, in <module>\n    main()\n"
CPU_OOM = ("RuntimeError: [enforce fail at alloc_cpu.cpp:117] data. DefaultCPUAllocator: can't allocate memory: you "
           "tried to allocate 1073741824 bytes. Error code 12 (Cannot allocate memory)")
CUDA_OOM = ("torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of "
            "79.19 GiB of which 1.06 GiB is free.")
LAUNCHER_REPORT = ("subprocess.CalledProcessError: Command '['/usr/bin/python', '-u', 'train.py', '--local_rank=1']' "
                   "returned non-zero exit status 1.")

# (id, log text, status, error)
LOGS = [
    ("log-line-then-FileNotFoundError",
     "read 4096 samples out of memory-mapped shards\n" + TRACEBACK
     + "FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-00007.bin'\n",
     Status.FAILED, "exit code 1: FileNotFoundError: [Errno 2] No such file or directory: '/data/shard-00007.bin'"),
    ("a warning naming CUDA OOM, then a ValueError",
     "WARNING: CUDA out of memory on the last batch, retrying smaller\n" + TRACEBACK + "ValueError: bad shape\n",
     Status.FAILED, "exit code 1: ValueError: bad shape"),
    ("an exception whose message mentions memory-mapped files",
     TRACEBACK + "OSError: read past the end: out of memory-mapped region\n", Status.FAILED,
     "exit code 1: OSError: read past the end: out of memory-mapped region"),
    ("torch CPU allocator", TRACEBACK + CPU_OOM + "\n", Status.OOM, CPU_OOM),
    ("torch CUDA OOM under a rank prefix, then the launcher's report",
     "[rank1]: " + TRACEBACK.replace("\n  ", "\n[rank1]:   ") + "[rank1]: " + CUDA_OOM + "\n" + LAUNCHER_REPORT + "\n",
     Status.OOM, "[rank1]: " + CUDA_OOM),
    ("a peer's broken connection after the OOM",
     TRACEBACK + CUDA_OOM + "\n" + TRACEBACK + "RuntimeError: [gloo] Connection closed by peer [127.0.0.1]:29500\n",
     Status.OOM, CUDA_OOM),
    ("Python's MemoryError", TRACEBACK + "MemoryError\n", Status.OOM, "MemoryError"),
    ("C++ bad_alloc", "terminate called after throwing an instance of 'std::bad_alloc'\n  what():  std::bad_alloc\n",
     Status.OOM, "terminate called after throwing an instance of 'std::bad_alloc'"),
    ("dlopen under RLIMIT_DATA", TRACEBACK + "ImportError: /venv/lib/libtorch_cpu.so: failed to map segment from "
     "shared object\n", Status.OOM, "ImportError: /venv/lib/libtorch_cpu.so: failed to map segment from shared object"),
    ("a rank's error, not the launcher's report of it",
     TRACEBACK + "KeyError: 'input_ids'\n" + TRACEBACK + LAUNCHER_REPORT + "\n", Status.FAILED,
     "exit code 1: KeyError: 'input_ids'"),
]


@pytest.mark.parametrize("case", LOGS, ids=[c[0] for c in LOGS])
def test_only_a_raised_allocator_error_is_an_oom_and_the_real_error_is_shown(case):
    _, log, status, error = case
    assert classify(1, None, "throughput", log, False) == (status, error)
