"""The probe's records: one JSON line per optimizer step in each rank's stream, and an exit record per rank.

- After each boundary ``step()`` (`.engine`) a rank appends one line to its stream, ``probe.rank<RANK>.jsonl`` in
  ``<PYTHON_ZEROTUNE_PROBE_DIR>`` (`stream_name`), and flushes it; the fields are in `_Probe.record`.
- From its first step record on, a rank writes ``exit.rank<RANK>.json`` as Python finishes (`_Probe.write_exit`).
- A probe error is printed to stderr once and the probe goes quiet; training goes on.
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
        #                                      "base", "batch_samples", "seq_len", "tokens"}
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
                                            "batch_samples": None, "seq_len": None, "tokens": None}
        return s

    def record(self, engine, state: dict) -> None:
        """Append this optimizer step's line to the rank's stream. Its fields (times in seconds):

        ``rank``; ``step``, from 1 in this process; ``t``, ``time.monotonic()`` when the step returned; ``step_s``,
        wall time since the previous optimizer step ended (the script's work between engine calls included; step 1
        counts from the first forward, never steady state); ``boundary_s``, the part of ``step_s`` done once per
        optimizer step (the boundary ``step()`` and the boundary ``allreduce_gradients()`` in ``backward()``), the only
        part a larger gas amortizes (ZeRO-1's reduction in the backward hooks, ``overlap_comm``, is not in it);
        ``micro_steps``, ``step()`` calls in this step (1 under the Hugging Face Trainer); ``train_batch_size``, global
        samples per optimizer step; ``batch_samples``, ``seq_len``: the most samples a micro batch held and its longest
        token sequence, ``tokens`` the samples times the sequence length summed over its forwards (`.batch`; null where
        unknown); ``peak_bytes`` and the peaks beside it (`.peak._peaks`);
        ``base_bytes``, on CUDA the allocated bytes before the step's first forward (`.engine._note_base`);
        ``autotp_size``, the engine's AutoTP degree where over 1 (its ranks hold the same batch).
        """
        import time
        t = time.monotonic()
        state["step"] += 1
        line = {"rank": _rank(engine), "step": state["step"], "t": t,
                "step_s": t - state["last"] if state["last"] is not None else None,
                "boundary_s": state["boundary"], "micro_steps": state["micro"],
                "train_batch_size": int(engine.train_batch_size()), "batch_samples": state["batch_samples"],
                "seq_len": state["seq_len"], "tokens": state["tokens"] if (state["tokens"] or 0) > 0 else None}
        tp = _autotp_size(engine)
        if tp > 1:
            line["autotp_size"] = tp
        line.update(_peaks(engine))
        if state.get("base") is not None:
            line["base_bytes"] = state["base"]
        if line["step"] >= _DataPeak.SAMPLED_STEPS and _DataPeak.running is not None:
            _DataPeak.running.stop()
        state["last"], state["micro"], state["boundary"], state["base"] = t, 0, 0.0, None
        state["batch_samples"] = state["seq_len"] = state["tokens"] = None
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
        """The ``atexit`` hook: this rank's exit record, ``{"rank", "steps", "uncaught", "exit_status", "host",
        "address"}`` (the last two: `_node`). ``uncaught``: the exception that ended the script (``sys.last_value``),
        ``"Type: message"``; ``exit_status``: the last ``sys.exit`` argument after the first step; each null when
        none. ``atexit`` hooks run before the C++ teardown: a rank aborting after a clean record (``terminate called
        without an active exception``) crashed after the script ended, every step it recorded measured
        (`zerotune.probe.clean_exits`).
        """
        def record():
            last, status = getattr(sys, "last_value", None), self.exit_status
            return {"rank": self.exit_rank, "steps": sum(s["step"] for s in self.engines.values()),
                    "uncaught": f"{type(last).__name__}: {last}"[:300] if last is not None else None,
                    "exit_status": status if status is None or isinstance(status, int) else str(status)[:300],
                    **_node()}
        _write_record(os.path.join(self.directory, exit_name(self.exit_rank)), record, "writing the exit record")


def _node() -> dict:
    """``host``, this rank's hostname, and ``address``, the IPv4 source address the kernel picks to reach
    ``MASTER_ADDR`` (no packet is sent), which differs between nodes; null where it cannot be found."""
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
    """Write the JSON object ``make_record()`` returns (None: nothing) to ``path`` atomically; a failure is printed."""
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


def _autotp_size(engine) -> int:
    """The engine's ``tensor_parallel.autotp_size`` (1 without AutoTP or on a DeepSpeed without it)."""
    try:
        tp = engine.autotp_size()
        return tp if isinstance(tp, int) and not isinstance(tp, bool) and tp > 1 else 1
    except Exception:  # noqa: BLE001 - the probe never breaks training
        return 1
