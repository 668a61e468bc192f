"""The probe's records: one JSON line per optimizer step in each rank's stream, and an exit record per rank.

The stream is ``<PYTHON_ZEROTUNE_PROBE_DIR>/probe.rank<RANK>.jsonl`` (`stream_name`); after a boundary
``step()`` returns (`.engine`), the rank appends one line to it and flushes it::

    {"rank": 0, "step": 3, "t": 12345.678, "step_s": 0.0412, "boundary_s": 0.0061, "micro_steps": 1,
     "train_batch_size": 8, "batch_samples": 4, "seq_len": 128, "peak_bytes": 734003200, "base_bytes": 524288000}

- ``step``: the optimizer step's index in this process, from 1.
- ``t``: ``time.monotonic()`` when the step returned, seconds.
- ``step_s``: wall time since the end of the previous optimizer step, seconds: everything the
  script does between engine calls (data loading, logging) is in it. Step 1 is measured from the
  start of the engine's first forward call, so the time before it (the first batch's loading) is
  lost; step 1 holds first allocations and compilation anyway and is never steady state.
- ``boundary_s``: the part of ``step_s`` spent in the work done once per optimizer step, at the
  gradient-accumulation boundary: the boundary ``step()`` call (the optimizer step; ZeRO 1-2's
  parameter all-gather; the gradient reduction where ``step()`` runs it) and the boundary
  ``allreduce_gradients()`` call that ``backward()`` makes (ZeRO 0's all-reduce, ZeRO 1's reduction
  without ``overlap_comm``, ZeRO 2-3's reduction epilogue), seconds. A larger gas amortizes this
  part only (the tuner's bound on what doubling gas can gain); ZeRO-1's reduction in the backward
  hooks (``overlap_comm``) is not in it.
- ``micro_steps``: ``step()`` calls in this optimizer step (gradient accumulation steps; 1 under
  the Hugging Face Trainer, whose accelerate calls ``step()`` only at the boundary).
- ``train_batch_size``: ``engine.train_batch_size()``, global samples per optimizer step.
- ``batch_samples`` and ``seq_len``: what the micro batches of this step held, from the shapes of the tensors the
  engine's forward received (`.batch`): the most samples one held (their leading dimension) and the longest
  sequence, tokens (the largest second dimension of an integer tensor of 2+ dimensions: token ids); null where
  no forward argument said (no tensor; for ``seq_len``, no token ids: images, float features).
- ``peak_bytes`` and the peaks beside it: `.peak._peaks`. ``base_bytes``: on CUDA the allocated bytes
  before the step's first forward (`.engine._note_base`).

Once a rank has recorded its first step, it also writes `EXIT_PREFIX` ``<RANK>.json`` as Python
finishes (an ``atexit`` hook; `exit_name`)::

    {"rank": 0, "steps": 20, "uncaught": null, "exit_status": null, "host": "node-1", "address": "10.0.0.2"}

``host``: the rank's hostname. ``address``: the IPv4 address this rank's machine reaches ``MASTER_ADDR`` from (the
source address the kernel picks for it; no packet is sent), so ranks on different nodes have different
addresses; null where it cannot be found.
``uncaught``: the uncaught exception that ended the script (``sys.last_value``, set by Python's
top-level error printing), as ``"Type: message"``, or null. ``exit_status``: the argument of the
last ``sys.exit`` call after the first step (null without one). ``atexit`` hooks run at the start of
the interpreter's finalization, before its C++ teardown: a rank that aborts after writing a clean
record (``terminate called without an active exception``, seen at exit of gloo-backed ranks) crashed
after the script ended, with every step it recorded measured (``zerotune.probe.clean_exits``).

A probe error never breaks training: it is printed to stderr once and the probe goes quiet.
"""
import os
import sys

from .peak import _DataPeak, _peaks

STREAM_PREFIX, STREAM_SUFFIX = "probe.rank", ".jsonl"
ENGINE_RECORD = "engine_config.json"
ACTIVATIONS_RECORD = "activations.json"
EXIT_PREFIX, EXIT_SUFFIX = "exit.rank", ".json"


def stream_name(rank: int) -> str:
    """The file name of rank ``rank``'s stream."""
    return f"{STREAM_PREFIX}{rank}{STREAM_SUFFIX}"


def exit_name(rank: int) -> str:
    """The file name of rank ``rank``'s exit record."""
    return f"{EXIT_PREFIX}{rank}{EXIT_SUFFIX}"


class _Probe:
    """The per-process state: the first forward's time, and per engine its steps and file."""

    def __init__(self, directory: str):
        self.directory = directory
        self.engines: dict[int, dict] = {}  # id(engine) -> {"step", "micro", "boundary", "in_step", "last", "file",
        #                                      "base", "batch_samples", "seq_len"}
        self.first_forward: float | None = None
        self.pad_to: int | None = None  # tokens every micro batch is padded to (.padding), set at the first forward
        self.failed = False
        self.exit_rank: int | None = None  # set with the first step record: this process writes an exit record
        self.exit_status = None  # the last sys.exit argument after that

    def fail(self, what: str, error: BaseException) -> None:
        if not self.failed:
            self.failed = True
            print(f"zerotune probe: {what} failed, no more steps recorded: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)

    def state(self, engine) -> dict:
        s = self.engines.get(id(engine))
        if s is None:
            s = self.engines[id(engine)] = {"step": 0, "micro": 0, "boundary": 0.0, "in_step": False,
                                            "last": self.first_forward, "file": None, "base": None,
                                            "batch_samples": None, "seq_len": None}
        return s

    def record(self, engine, state: dict) -> None:
        import time
        t = time.monotonic()
        state["step"] += 1
        line = {"rank": _rank(engine), "step": state["step"], "t": t,
                "step_s": t - state["last"] if state["last"] is not None else None,
                "boundary_s": state["boundary"], "micro_steps": state["micro"],
                "train_batch_size": int(engine.train_batch_size()), "batch_samples": state["batch_samples"],
                "seq_len": state["seq_len"]}
        line.update(_peaks(engine))
        if state.get("base") is not None:
            line["base_bytes"] = state["base"]
        if line["step"] >= _DataPeak.SAMPLED_STEPS and _DataPeak.running is not None:
            _DataPeak.running.stop()
        state["last"], state["micro"], state["boundary"], state["base"] = t, 0, 0.0, None
        state["batch_samples"] = state["seq_len"] = None
        if state["file"] is None:
            state["file"] = open(os.path.join(self.directory, stream_name(line["rank"])), "a")
            self.watch_exit(line["rank"])
        import json
        state["file"].write(json.dumps(line) + "\n")
        state["file"].flush()

    def watch_exit(self, rank: int) -> None:
        """From now on, note ``sys.exit`` calls, and write this rank's exit record as Python finishes."""
        if self.exit_rank is not None:
            return
        import atexit
        self.exit_rank = rank
        real_exit = sys.exit

        def noted_exit(status=None):
            self.exit_status = status
            real_exit(status)

        sys.exit = noted_exit
        atexit.register(self.write_exit)

    def write_exit(self) -> None:
        """The ``atexit`` hook: this rank's exit record (module docstring)."""
        def record():
            last, status = getattr(sys, "last_value", None), self.exit_status
            return {"rank": self.exit_rank, "steps": sum(s["step"] for s in self.engines.values()),
                    "uncaught": f"{type(last).__name__}: {last}"[:300] if last is not None else None,
                    "exit_status": status if status is None or isinstance(status, int) else str(status)[:300],
                    **_node()}
        _write_record(os.path.join(self.directory, exit_name(self.exit_rank)), record, "writing the exit record")


def _node() -> dict:
    """Where this rank runs: ``host`` and ``address`` (module docstring)."""
    import socket
    address = None
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((os.environ.get("MASTER_ADDR") or "127.0.0.1", 9))  # a UDP connect routes, sends nothing
            address = s.getsockname()[0]
    except OSError:
        pass
    return {"host": socket.gethostname(), "address": address}


def _write_record(path: str, make_record, what: str) -> None:
    """Write the JSON object ``make_record()`` returns (None: nothing) to ``path`` atomically (a reader
    never sees half of it). A failure is printed to stderr, naming ``what``; training goes on."""
    try:
        import json
        record = make_record()
        if record is None:
            return
        with open(path + ".tmp", "w") as f:
            json.dump(record, f, default=str)
        os.replace(path + ".tmp", path)
    except Exception as e:  # noqa: BLE001 - the probe never breaks training
        print(f"zerotune probe: {what} failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _rank(engine) -> int:
    rank = getattr(engine, "global_rank", None)
    return int(rank) if rank is not None else int(os.environ.get("RANK", "0"))
