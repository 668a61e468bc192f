"""zerotune's step probe: one JSON line per optimizer step, in every rank, with no change to the script.

The local launch puts this directory first on the ranks' ``PYTHONPATH`` and sets
``PYTHON_ZEROTUNE_PROBE_DIR`` (:func:`zerotune.deepspeed.launcher.launch_env`), so Python's ``site``
imports this file at start-up in every process of the launch (the launcher too). Without
``PYTHON_ZEROTUNE_PROBE_DIR`` it only chains to the user's own ``sitecustomize``.

With it, an import hook (a ``sys.meta_path`` finder) waits for ``deepspeed.runtime.engine``;
nothing imports deepspeed or torch at start-up. Once that module has run, the hook wraps
``DeepSpeedEngine.forward`` (only to note the first forward's time) and ``DeepSpeedEngine.step``,
which the script calls once per micro step. Whether a call is the gradient-accumulation boundary
is asked before the original ``step`` runs; after a boundary step returns, the rank appends one
line to ``<PYTHON_ZEROTUNE_PROBE_DIR>/probe.rank<RANK>.jsonl`` and flushes it::

    {"rank": 0, "step": 3, "t": 12345.678, "step_s": 0.0412, "boundary_s": 0.0061, "micro_steps": 1,
     "train_batch_size": 8, "peak_bytes": 734003200, "base_bytes": 524288000}

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
- ``peak_bytes``: on CUDA ``torch.cuda.max_memory_allocated()`` (and ``peak_reserved_bytes``,
  ``torch.cuda.max_memory_reserved()``, and ``device_peak_bytes``, the device at its peak: the reserved
  high-water mark plus what lies outside the allocator, :func:`_device_peak`); on CPU the largest
  ``VmData`` so far (what ``RLIMIT_DATA``, the per-rank budget, limits), sampled every 5 ms from the
  engine module's import to the end of step 2 and at each record after it (:class:`_DataPeak`), and
  ``rss_peak_bytes``, the resident high-water mark (``ru_maxrss``), which leaves out pages allocated
  and never written; bytes.

The step on which DeepSpeed's autotuning exits (``engine._autotuning_exit`` calls ``exit()``
inside ``step``) is recorded as the ``SystemExit`` passes through the wrapper, so it is not lost;
its ``step_s`` also holds rank 0's writing of ``metrics.json``, a millisecond or so. The end of a
step is when ``step()`` returns on the host: no device synchronisation is added (it would change
what is measured), so on CUDA a single step's time may be shifted by the queued kernels, the mean
over several steps is not. What is lost: a step in progress when the process is killed.

Before the first forward, rank 0 also writes ``engine_config.json`` (:data:`ENGINE_RECORD`): the
config the engine got (a Trainer script's ``"auto"`` values filled in), the model's hidden size as
the Trainer reads it, the engine's micro batch size, gradient accumulation steps and train
batch size, and the memory savers it really runs with (:func:`_savers`: offload, checkpointing). The profile run's record resolves the hidden-size ``"auto"`` values
(:mod:`zerotune.deepspeed.auto`); every experiment's shows what its engine ran with.

In the profile run (the config's ``autotuning.model_info.profile``: DeepSpeed's engine measures
``activation_mem_per_gpu`` across the first forward and exits, ``engine.py:3025-3030``), rank 0 also
writes :data:`ACTIVATIONS_RECORD` as that forward ends: the bytes of the tensors autograd saves for
the backward pass (``torch.autograd.graph.saved_tensors_hooks``, ``torch/autograd/graph.py``), each
storage once, less parameters, views of parameters and module buffers::

    {"saved_bytes": 6572032, "saved_storages": 61, "micro_batch_size": 1,
     "largest_layer_params": 4194304, "persistent_params": 9216}

Under activation checkpointing that forward saves only each checkpointed region's input; the record then
also holds ``recompute_bytes``, the most one region saves beyond its input when it runs with gradients
(what the backward pass holds while it recomputes that region), and ``recompute_regions``, how many were
counted (:class:`_SavedActivations` says how).

Without activation checkpointing, where the model has checkpointable layers (Hugging Face's
``GradientCheckpointingLayer`` subclasses, such as GPT-2's and Llama's blocks), the record also prices it:
``checkpointed_bytes``, what the same forward would hold with non-reentrant checkpointing of every such layer
(the storages saved outside the layers and the layers' inputs, plus the most one layer saves beyond its inputs),
at the record's ``micro_batch_size``, and ``checkpoint_layers``, the layer calls counted
(:class:`_LayerCheckpointing`).

``largest_layer_params``: the most parameters any one module holds directly (its own, not its
children's), elements: ZeRO-3 gathers at least that much to run it. ``persistent_params``: the
elements of the parameters ZeRO-3 keeps gathered (``ds_persist``, set by
``zero/parameter_offload.py:317-330`` from ``stage3_param_persistence_threshold``). Both count full
parameters (``ds_numel`` where ZeRO-3 has partitioned them) and feed the memory model's stage-3 terms.
On CUDA the record also holds ``device_peak_bytes`` (:func:`_device_peak`): what the device held at
the peak, the caching allocator's reserved high-water mark plus what lies outside it (the CUDA
context, NCCL's buffers), from which the tuner calibrates the memory model's fixed overhead per
device, as the backend's sampled peak does on CPU.

On CUDA the profile run also measures the whole step's growth (:class:`_StepGrowth`): the autograd-saved
storages miss what the backward pass allocates on top (the gradient of the logits, of the fp32 loss), a
third of what grows with mbs on GPT-2. Before the first forward the allocator's peak is reset; as
DeepSpeed's ``exit()`` passes through, every rank runs ``loss.backward()`` on the module's output (caught
by a forward hook), and the record gains ``forward_growth_bytes`` and ``step_growth_bytes``: the
allocated high-water mark at the end of the forward, and over the forward and the backward, less what
was allocated before the forward, bytes, for the record's ``micro_batch_size``. No loss found or a
failed backward: only ``forward_growth_bytes``; the ``SystemExit`` always goes on. The backward is the
engine's (``engine.backward``), as training runs it.

On CPU the same figures come from ``torch.profiler``'s memory events (:class:`_HostStepGrowth`): a CPU device has
no allocator counters. At mbs 1 a step's peak is mostly what it holds whatever the mbs (the gradients, ZeRO's
buckets, gathered parameters), so the profile then runs a few more training micro steps on its own batch repeated
2, 4, 8 (and 16) times until two successive slopes agree: ``slope_bytes``, the step's growth per sample, which the
memory model's activation term takes (docs/decisions.md, D111).

That is what a device holds per micro batch for the backward pass, whatever the allocator does.
DeepSpeed's own figure is a change in ``memory_allocated``, which on CPU is the process's RSS
(``accelerator/cpu_accelerator.py:140-154``): in the ZeRO-3 profile run it also holds the parameters
gathered during that forward (released per module in the first iteration,
``zero/partitioned_param_coordinator.py:498``, but kept by the C heap), several times the activations
of a small model.

Once a rank has recorded its first step, it also writes :data:`EXIT_PREFIX` ``<RANK>.json`` as Python
finishes (an ``atexit`` hook; :func:`exit_name`)::

    {"rank": 0, "steps": 20, "uncaught": null, "exit_status": null, "host": "node-1", "address": "10.0.0.2"}

``host``: the rank's hostname. ``address``: the IPv4 address this rank's machine reaches ``MASTER_ADDR`` from (the
source address the kernel picks for it; no packet is sent), so ranks on different nodes have different
addresses; null where it cannot be found.
``uncaught``: the uncaught exception that ended the script (``sys.last_value``, set by Python's
top-level error printing), as ``"Type: message"``, or null. ``exit_status``: the argument of the
last ``sys.exit`` call after the first step (null without one). ``atexit`` hooks run at the start of
the interpreter's finalization, before its C++ teardown: a rank that aborts after writing a clean
record (``terminate called without an active exception``, seen at exit of gloo-backed ranks) crashed
after the script ended, with every step it recorded measured (:func:`zerotune.probe.clean_exits`).

A probe error never breaks training: it is printed to stderr once and the probe goes quiet.
Only this file and ``__init__.py`` are in this directory, since it is on the ranks' import path.
"""
import contextlib
import os
import sys

# The name starts with PYTHON so that DeepSpeed's multi-node runner forwards it to the other nodes' ranks
# (deepspeed/launcher/runner.py EXPORT_ENVS exports variables starting with PYTHON, MLFLOW, MV2, UCX).
PROBE_DIR_ENV = "PYTHON_ZEROTUNE_PROBE_DIR"
BUDGET_ENV = "PYTHON_ZEROTUNE_DEVICE_BUDGET"  # bytes per device, on CUDA ranks (:func:`cap_allocator`)
STREAM_PREFIX, STREAM_SUFFIX = "probe.rank", ".jsonl"
ENGINE_RECORD = "engine_config.json"
ACTIVATIONS_RECORD = "activations.json"
EXIT_PREFIX, EXIT_SUFFIX = "exit.rank", ".json"
ENGINE_MODULE = "deepspeed.runtime.engine"


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
        #                                      "base"}
        self.first_forward: float | None = None
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
                                            "last": self.first_forward, "file": None, "base": None}
        return s

    def record(self, engine, state: dict) -> None:
        import time
        t = time.monotonic()
        state["step"] += 1
        line = {"rank": _rank(engine), "step": state["step"], "t": t,
                "step_s": t - state["last"] if state["last"] is not None else None,
                "boundary_s": state["boundary"], "micro_steps": state["micro"],
                "train_batch_size": int(engine.train_batch_size())}
        line.update(_peaks(engine))
        if state.get("base") is not None:
            line["base_bytes"] = state["base"]
        if line["step"] >= _DataPeak.SAMPLED_STEPS and _DataPeak.running is not None:
            _DataPeak.running.stop()
        state["last"], state["micro"], state["boundary"], state["base"] = t, 0, 0.0, None
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


def _peaks(engine) -> dict:
    torch = sys.modules.get("torch")
    if _on_cuda(torch, engine):
        return {"peak_bytes": int(torch.cuda.max_memory_allocated()),
                "peak_reserved_bytes": int(torch.cuda.max_memory_reserved()), **_device_peak(torch, engine)}
    import resource
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
    data = _DataPeak.running.peak() if _DataPeak.running is not None else 0
    return {"peak_bytes": data or rss, "rss_peak_bytes": rss}


class _DataPeak:
    """On CPU, the largest ``VmData`` of this process (its private writable memory: what
    ``RLIMIT_DATA``, the CPU backend's per-rank budget, limits), sampled every :attr:`period_s` by a
    daemon thread from ``/proc/self/status``. Linux keeps no high-water mark of it, and the peak of a
    training step lasts tens of milliseconds (the backward pass holds the activations, the gradients
    and the reduction's flat copy at once; docs/decisions.md, D202). The resident high-water mark
    (``ru_maxrss``) is no substitute: it leaves out pages allocated and never written, such as most of
    a reduce bucket, which the budget counts.

    The thread runs until the end of optimizer step :attr:`SAMPLED_STEPS` (:meth:`stop`), then each
    record samples once: by then every step's allocations have happened (the first step creates the
    optimizer states, the second holds them with the activations, the gradients and the reduction's
    copy), and the steps measured for the metric run without it."""

    running: "_DataPeak | None" = None
    period_s = 0.005
    SAMPLED_STEPS = 2
    PATH = "/proc/self/status"

    def __init__(self):
        self._peak = 0
        self._stopped = False

    def stop(self) -> None:
        """End the sampling thread (its last sample is kept; :meth:`peak` still samples once per call)."""
        self._stopped = True

    @classmethod
    def start(cls) -> None:
        """Start the sampler once per process (a no-op where ``/proc/self/status`` has no VmData)."""
        if cls.running is not None:
            return
        sampler = cls()
        if not sampler.sample():
            return
        cls.running = sampler
        sampler.run_in_background()

    def run_in_background(self) -> None:
        """Sample every :attr:`period_s` in a daemon thread until :meth:`stop`."""
        import threading
        threading.Thread(target=self._loop, name="zerotune-vmdata", daemon=True).start()

    def sample(self) -> int:
        """Read ``VmData`` now, bytes (0 when unknown), and keep the largest."""
        try:
            with open(self.PATH) as f:
                for line in f:
                    if line.startswith("VmData:"):
                        value = int(line.split()[1]) * 1024
                        self._peak = max(self._peak, value)
                        return value
        except (OSError, ValueError):
            pass
        return 0

    def peak(self) -> int:
        """The largest ``VmData`` seen so far, now included, bytes."""
        self.sample()
        return self._peak

    def _loop(self) -> None:
        import time
        while not self._stopped:
            time.sleep(self.period_s)
            self.sample()


def _data_peak() -> dict:
    """On CPU ranks, ``{"data_peak_bytes": n}``: the largest ``VmData`` so far (:class:`_DataPeak`);
    elsewhere ``{}``. The profile run's record carries it: the run exits in its first forward, before
    any step record, and the tuner calibrates the memory model from it."""
    return {"data_peak_bytes": _DataPeak.running.peak()} if _DataPeak.running is not None else {}


def _on_cuda(torch, engine) -> bool:
    """Whether ``engine`` runs on a CUDA device that ``torch`` (None: not imported) sees."""
    device = getattr(engine, "device", None)
    return torch is not None and getattr(device, "type", device) == "cuda" and bool(torch.cuda.is_available())


def _device_peak(torch, engine, reserved_floor: int = 0) -> dict:
    """On CUDA, ``{"device_peak_bytes": n}``: ``torch.cuda.max_memory_reserved()`` (at least
    ``reserved_floor``, the high-water mark before a reset of the peaks) plus what the device holds outside
    the caching allocator now (``mem_get_info``'s total - free, less ``memory_reserved()``: the CUDA
    context, NCCL, other processes). Elsewhere ``{}``."""
    if not _on_cuda(torch, engine):
        return {}
    free, total = torch.cuda.mem_get_info()
    outside = max(0, int(total) - int(free) - int(torch.cuda.memory_reserved()))
    return {"device_peak_bytes": max(int(torch.cuda.max_memory_reserved()), int(reserved_floor)) + outside}


def cap_allocator(cuda, device: int, budget_bytes: int) -> float | None:
    """Cap the caching allocator of CUDA device ``device`` so that what the device holds stays within
    ``budget_bytes``: ``set_per_process_memory_fraction((budget - outside) / total)``, where ``outside`` is
    what lies outside the allocator now (``mem_get_info``'s total - free, less ``memory_reserved``: the CUDA
    context, NCCL, other processes). An allocation past it raises CUDA's own out-of-memory error, as a
    smaller device would. ``cuda`` is ``torch.cuda`` (or a stand-in with those functions). Returns the
    fraction set; None when the budget leaves the allocator the whole device (nothing set)."""
    free, total = cuda.mem_get_info(device)
    outside = max(0, int(total) - int(free) - int(cuda.memory_reserved(device)))
    fraction = max(0.0, (int(budget_bytes) - outside) / int(total))
    if fraction >= 1.0:
        return None
    cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def _cap_device(engine) -> None:
    """On a CUDA rank with a budget (:data:`BUDGET_ENV`, set by zerotune for its experiments), cap the caching
    allocator of the engine's device at it (:func:`cap_allocator`), before the first forward: the budget is a
    limit, not advice, as ``RLIMIT_DATA`` makes it on CPU ranks. A failure is printed; training goes on."""
    torch = sys.modules.get("torch")
    budget = os.environ.get(BUDGET_ENV)
    if not budget or not _on_cuda(torch, engine):
        return
    try:
        device = engine.device.index if engine.device.index is not None else torch.cuda.current_device()
        fraction = cap_allocator(torch.cuda, device, int(budget))
        if fraction is not None:
            print(f"zerotune probe: device {device}'s caching allocator capped at {fraction:.4f} of the device "
                  f"(budget {int(budget)} bytes)", file=sys.stderr, flush=True)
    except Exception as e:  # noqa: BLE001 - the probe never breaks training
        print(f"zerotune probe: capping the device at its budget failed: {type(e).__name__}: {e}",
              file=sys.stderr, flush=True)


def _note_base(probe: _Probe, engine) -> None:
    """On CUDA, the allocated bytes before the step's first forward (``base_bytes``, noted once per step)."""
    torch = sys.modules.get("torch")
    if probe.failed or not _on_cuda(torch, engine):
        return
    state = probe.state(engine)
    if state["base"] is None:
        state["base"] = int(torch.cuda.memory_allocated())


def _install(module, probe: _Probe) -> None:
    """Wrap ``DeepSpeedEngine.forward``, ``DeepSpeedEngine.step`` and ``DeepSpeedEngine.allreduce_gradients``
    (timed at the boundary: ``boundary_s``) of the engine module; in a CPU rank
    (``DS_ACCELERATOR=cpu``, as zerotune launches CPU ranks, and ``LOCAL_RANK``, which the launcher sets
    for its ranks only) start the ``VmData`` sampler (:class:`_DataPeak`). The launcher processes import
    the engine module too (``import deepspeed`` does) but never step: a sampler there would wake every
    5 ms for the whole run on the ranks' cores, slowing them (docs/decisions.md, D203)."""
    if os.environ.get("DS_ACCELERATOR") == "cpu" and "LOCAL_RANK" in os.environ:
        _DataPeak.start()
    engine_cls = module.DeepSpeedEngine
    forward, step = engine_cls.forward, engine_cls.step
    engine_cls.forward, engine_cls.step = _probed_forward(forward, probe), _probed_step(step, probe)
    allreduce = getattr(engine_cls, "allreduce_gradients", None)
    if allreduce is None:
        return
    engine_cls.allreduce_gradients = _probed_allreduce(allreduce, probe)


def _probed_forward(forward, probe: _Probe):
    """``DeepSpeedEngine.forward`` noting the first forward's time; before it, rank 0 records the engine
    (:func:`_record_engine`), and in the profile run the forward's saved activations are counted
    (:class:`_SavedActivations`)."""
    import functools
    import time

    @functools.wraps(forward)
    def probed_forward(self, *args, **kwargs):
        if probe.first_forward is None:
            probe.first_forward = time.monotonic()
            _cap_device(self)
            _record_engine(probe, self)
            counter = _SavedActivations.for_profile(probe, self)
            if counter is not None:
                growth = _StepGrowth.for_profile(self)
                try:
                    with counter.hooks():
                        return forward(self, *args, **kwargs)
                except SystemExit:  # DeepSpeed's profile exit(): measure the backward, then exit
                    if growth is not None:
                        growth.at_exit(self)
                    raise
                finally:
                    counter.write(growth.figures() if growth is not None else {})
                    if growth is not None:
                        growth.close()
        try:
            _note_base(probe, self)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            probe.fail("reading the allocated memory before a forward", e)
        return forward(self, *args, **kwargs)
    return probed_forward


def _probed_step(step, probe: _Probe):
    """``DeepSpeedEngine.step`` counting micro steps, timing the boundary's call (``boundary_s``) and
    recording a line after the boundary's call returns, or as DeepSpeed's autotuning exit passes through."""
    import functools
    import time

    @functools.wraps(step)
    def probed_step(self, *args, **kwargs):
        boundary, state = False, None
        if not probe.failed:
            try:
                state = probe.state(self)
                state["micro"] += 1
                boundary = bool(self.is_gradient_accumulation_boundary())
            except Exception as e:  # noqa: BLE001 - the probe never breaks training
                probe.fail("reading the engine before step", e)
        start = time.monotonic()
        if state is not None:
            state["in_step"] = True
        try:
            result = step(self, *args, **kwargs)
        except SystemExit:  # DeepSpeed's autotuning exit, at the end of the step
            _end_step(state, boundary, start)
            _record(probe, self, state, boundary)
            raise
        except BaseException:
            _end_step(state, False, start)
            raise
        _end_step(state, boundary, start)
        _record(probe, self, state, boundary)
        return result
    return probed_step


def _probed_allreduce(allreduce, probe: _Probe):
    """``DeepSpeedEngine.allreduce_gradients`` adding its time to ``boundary_s`` when ``backward()`` calls
    it at the boundary (inside ``step()`` it is timed with the step)."""
    import functools
    import time

    @functools.wraps(allreduce)
    def probed_allreduce(self, *args, **kwargs):
        state = None
        if not probe.failed:
            try:
                state = probe.state(self)
                if state["in_step"] or not self.is_gradient_accumulation_boundary():
                    state = None  # inside step(): timed with it; between boundaries: not once per step
            except Exception as e:  # noqa: BLE001 - the probe never breaks training
                probe.fail("reading the engine before allreduce_gradients", e)
                state = None
        start = time.monotonic()
        try:
            return allreduce(self, *args, **kwargs)
        finally:
            if state is not None:
                state["boundary"] += time.monotonic() - start
    return probed_allreduce


def _end_step(state: dict | None, boundary: bool, start: float) -> None:
    """After a ``step()`` call: add its time to ``boundary_s`` when it was the boundary's."""
    import time
    if state is not None:
        state["in_step"] = False
        if boundary:
            state["boundary"] += time.monotonic() - start


def _record_engine(probe: _Probe, engine) -> None:
    """Rank 0 writes :data:`ENGINE_RECORD` once, before the first forward: the config the engine got
    (for a Trainer script, with its "auto" values filled in), the model's hidden size as the Trainer
    reads it, and the engine's batch sizes. A failure is reported and steps are still recorded."""
    def record():
        if _rank(engine) != 0:
            return None
        config = getattr(getattr(engine, "_config", None), "_param_dict", None)
        return {"ds_config": config if isinstance(config, dict) else None,
                "hidden_size": _hidden_size(getattr(engine, "module", None)),
                "train_micro_batch_size_per_gpu": int(engine.train_micro_batch_size_per_gpu()),
                "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
                "train_batch_size": int(engine.train_batch_size()), **_savers(engine)}
    _write_record(os.path.join(probe.directory, ENGINE_RECORD), record, "recording the engine's config")


def _savers(engine) -> dict:
    """What the engine and the model really run with, beyond the config: ``offload_optimizer`` (ZeRO 1-2's
    ``cpu_offload``, ZeRO-3's ``offload_optimizer``, ``zero/stage_1_and_2.py:221``, ``zero/stage3.py:824``),
    ``offload_param`` (``stage3.py:831``), and ``gradient_checkpointing`` (a Hugging Face model's
    ``is_gradient_checkpointing``; absent for other models)."""
    optimizer = getattr(engine, "optimizer", None)
    module = getattr(engine, "module", None)
    out = {"offload_optimizer": bool(getattr(optimizer, "cpu_offload", False)
                                     or getattr(optimizer, "offload_optimizer", False)),
           "offload_param": bool(getattr(optimizer, "offload_param", False))}
    checkpointing = getattr(module, "is_gradient_checkpointing", None)
    if isinstance(checkpointing, bool):
        out["gradient_checkpointing"] = checkpointing
    return out


class _LayerCheckpointing:
    """In the profile run's first forward, what the same forward would hold with non-reentrant activation
    checkpointing of every checkpointable layer (``torch.utils.checkpoint``, ``use_reentrant=False``, the
    Trainer's default in transformers 5): ``checkpointed_bytes`` and ``checkpoint_layers`` in
    :data:`ACTIVATIONS_RECORD`.

    The layers: modules whose class derives from one named :attr:`LAYER_CLASS` (transformers'
    ``modeling_layers.GradientCheckpointingLayer``: GPT-2's, Llama's decoder layers) whose
    ``gradient_checkpointing`` is not True. A forward pre-hook and an ``always_call`` forward hook (both
    ``with_kwargs``) keep the stack of layer calls running; each storage saved for the backward pass
    (:meth:`_SavedActivations.pack`) goes to the innermost running call, or outside any layer. A checkpointed
    layer's forward saves nothing and keeps its inputs (the tensors among its args and kwargs: the
    non-reentrant checkpoint holds them for the recomputation, ``torch/utils/checkpoint.py``,
    ``_checkpoint_without_reentrant_generator``); the backward pass recomputes one layer at a time, holding what
    it saves beyond its inputs. So ``checkpointed_bytes`` = the storages saved outside any layer together with
    the layers' inputs, each storage once, plus the most one layer call saved beyond its own inputs (or a
    checkpointed region's ``recompute_bytes``, if larger), at the record's micro batch size. Parameters and
    buffers are never counted (:meth:`_SavedActivations._count`). A failure is printed once and ends the
    counting: the record then has neither key."""

    LAYER_CLASS = "GradientCheckpointingLayer"

    def __init__(self, layers: list, count):
        self.layers, self.count = layers, count  # count(storages, tensor, exclude): _SavedActivations._count
        self.outside: dict[int, int] = {}  # data_ptr -> bytes, saved outside any layer call
        self.inputs: dict[int, int] = {}  # the layers' input storages
        self.stack: list[tuple[dict, frozenset]] = []  # (what the call saved beyond its inputs, its inputs)
        self.most, self.calls, self.measuring, self.paused = 0, 0, True, False

    @classmethod
    def for_module(cls, module, count) -> "_LayerCheckpointing | None":
        """The counter for ``module``'s checkpointable layers that are not checkpointed; None without any."""
        layers = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is not True
                  and any(c.__name__ == cls.LAYER_CLASS for c in type(m).__mro__)]
        return cls(layers, count) if layers else None

    def fail(self, what: str, error: BaseException) -> None:
        if self.measuring:
            self.measuring = False
            print(f"zerotune probe: {what} failed, checkpointing not priced: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)

    def saved(self, tensor) -> None:
        """A storage saved for the backward pass: the innermost running layer call's, or outside any."""
        if not self.measuring:
            return
        try:
            if self.stack:
                saved, inputs = self.stack[-1]
                self.count(saved, tensor, inputs)
            else:
                self.count(self.outside, tensor)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.fail("attributing a saved tensor to a layer", e)

    def _enter(self, module, args, kwargs) -> None:
        if not self.measuring or self.paused:
            return
        try:
            tensors: dict[int, int] = {}
            for value in (*args, *kwargs.values()):
                for tensor in (value if isinstance(value, (tuple, list)) else (value,)):  # Llama's (cos, sin)
                    if hasattr(tensor, "untyped_storage"):
                        self.count(tensors, tensor)
            self.inputs.update(tensors)
            self.stack.append(({}, frozenset(tensors)))
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.fail("reading a layer's inputs", e)

    def _leave(self, module, args, kwargs, output) -> None:
        if not self.measuring or self.paused or not self.stack:
            return
        saved, _ = self.stack.pop()
        self.most, self.calls = max(self.most, sum(saved.values())), self.calls + 1

    @contextlib.contextmanager
    def hooks(self):
        """The layers' forward hooks, removed on exit."""
        handles = []
        try:
            for layer in self.layers:
                handles.append(layer.register_forward_pre_hook(self._enter, with_kwargs=True))
                handles.append(layer.register_forward_hook(self._leave, with_kwargs=True, always_call=True))
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.fail("hooking the checkpointable layers", e)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def figures(self, recompute_bytes: int = 0) -> dict:
        """``checkpointed_bytes`` and ``checkpoint_layers`` (the class docstring); ``{}`` when no layer call was
        counted or the counting failed."""
        if not self.measuring or not self.calls or self.stack:
            return {}
        kept = {**self.outside, **self.inputs}
        return {"checkpointed_bytes": int(sum(kept.values()) + max(self.most, recompute_bytes)),
                "checkpoint_layers": self.calls}


class _SavedActivations:
    """Counts the bytes autograd saves for the backward pass during the profile run's first forward
    (every rank), and writes :data:`ACTIVATIONS_RECORD` (rank 0). The pack hook returns the tensor itself:
    nothing is copied, the forward runs as it would.

    Activation checkpointing: a checkpointed region's forward saves only its inputs (the reentrant
    variant runs it under ``no_grad``, the non-reentrant one under its own saved-tensor hooks, which
    take precedence), and its activations are live again, one region at a time, while the backward
    pass recomputes it. To see them, while the counted forward runs, the entry points of
    ``torch.utils.checkpoint`` (``CheckpointFunction.apply`` and
    ``_checkpoint_without_reentrant_generator``, looked up when ``checkpoint`` is called, so a script that
    bound ``checkpoint`` itself is covered) and of DeepSpeed's ``deepspeed.checkpointing``
    (``CheckpointFunction.apply``) are wrapped: each region runs once more before the checkpoint's own
    run, with gradients and this counter's hooks, its output dropped at once; the most one region saves
    beyond its inputs is ``recompute_bytes``. The profile run exits at the end of that forward, so the
    extra run changes nothing the tuning measures."""

    CHECKPOINT_MODULES = ("torch.utils.checkpoint", "deepspeed.runtime.activation_checkpointing.checkpointing")

    def __init__(self, probe: _Probe, engine, torch):
        self.probe, self.engine, self.torch = probe, engine, torch
        module = getattr(engine, "module", None)
        tensors = list(module.parameters()) + list(module.buffers()) if module is not None else []
        self.resident = {t.untyped_storage().data_ptr() for t in tensors}  # parameters and buffers
        self.storages: dict[int, int] = {}  # data_ptr -> bytes
        self.shapes = self._shapes(module) if module is not None else {}
        self.recompute_bytes, self.regions, self.measuring = 0, 0, True
        self.layers = self._layers(module) if module is not None else None

    @staticmethod
    def _shapes(module) -> dict:
        """``largest_layer_params`` and ``persistent_params`` of ``module`` (see the module docstring)."""
        def numel(p):
            return int(getattr(p, "ds_numel", None) or p.numel())
        largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
        persistent = sum(numel(p) for p in module.parameters() if getattr(p, "ds_persist", False))
        return {"largest_layer_params": largest, "persistent_params": persistent}

    @classmethod
    def for_profile(cls, probe: _Probe, engine) -> "_SavedActivations | None":
        torch = sys.modules.get("torch")
        try:
            if torch is None or not engine.autotuning_profile_model_info():
                return None
            return cls(probe, engine, torch)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            print(f"zerotune probe: counting activations failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return None

    def _count(self, storages: dict, tensor, exclude=frozenset()) -> None:
        """Add ``tensor``'s storage to ``storages`` unless it is a parameter's, a view of one, a module
        buffer's or in ``exclude``."""
        try:
            parameter = self.torch.nn.Parameter
            if not (isinstance(tensor, parameter) or isinstance(tensor._base, parameter)):
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.resident and ptr not in exclude:
                    storages[ptr] = storage.nbytes()
        except Exception:  # noqa: BLE001 - a tensor without a storage (sparse, meta): not counted
            pass

    def _layers(self, module) -> "_LayerCheckpointing | None":
        try:
            return _LayerCheckpointing.for_module(module, self._count)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            print(f"zerotune probe: finding the checkpointable layers failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            return None

    def pack(self, tensor):
        self._count(self.storages, tensor)
        if self.layers is not None:
            self.layers.saved(tensor)
        return tensor

    def region(self, function, args, kwargs) -> None:
        """Run one checkpointed region (``function(*args, **kwargs)``) with gradients and count what it
        saves beyond its inputs; the output is dropped. A failure is printed once and ends the counting
        of regions; the checkpoint's own run goes on."""
        if not self.measuring:
            return
        torch = self.torch
        try:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            for tensor in tensors:  # kept until the backward pass recomputes the region (DeepSpeed's checkpoint
                self._count(self.storages, tensor)  # keeps them outside autograd's saved tensors)
                if self.layers is not None:
                    self.layers.saved(tensor)
            inputs = {a.untyped_storage().data_ptr() for a in tensors}
            saved: dict[int, int] = {}

            def pack(tensor):
                self._count(saved, tensor, inputs)
                return tensor
            if self.layers is not None:  # a layer inside the region: its real run is the one counted
                self.layers.paused = True
            try:
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    out = function(*args, **kwargs)
            finally:
                if self.layers is not None:
                    self.layers.paused = False
            del out
            self.recompute_bytes = max(self.recompute_bytes, sum(saved.values()))
            self.regions += 1
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.measuring = False
            print(f"zerotune probe: counting a checkpointed region failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)

    def _wrapped_checkpoints(self) -> list:
        """``(module, name, wrapper)`` for each checkpoint entry point of :data:`CHECKPOINT_MODULES` loaded
        in this process (see the class docstring)."""
        import inspect
        counter, wrapped = self, []
        for name in self.CHECKPOINT_MODULES:
            module = sys.modules.get(name)
            function_cls = getattr(module, "CheckpointFunction", None)
            if function_cls is not None:  # apply(function, preserve_rng_state or all_outputs, *args)
                def apply(function, flag, *args, _apply=function_cls.apply):
                    counter.region(function, args, {})
                    return _apply(function, flag, *args)
                stand_in = type("CheckpointFunction", (), {"apply": staticmethod(apply)})
                wrapped.append((module, "CheckpointFunction", stand_in))
            generator = getattr(module, "_checkpoint_without_reentrant_generator", None)
            if generator is not None:  # (fn, preserve_rng_state, context_fn, ..., *args, **kwargs)
                parameters = inspect.signature(generator).parameters.values()
                named = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters)

                def regions(fn, *rest, _generator=generator, _named=named, **kwargs):
                    counter.region(fn, rest[_named - 1:], kwargs)
                    return _generator(fn, *rest, **kwargs)
                wrapped.append((module, "_checkpoint_without_reentrant_generator", regions))
        return wrapped

    @contextlib.contextmanager
    def hooks(self):
        """The counting hooks, the checkpointable layers' hooks (:class:`_LayerCheckpointing`) and, where
        checkpointing is loaded, the wrapped entry points, all removed on exit (DeepSpeed's profile ``exit()``
        included)."""
        try:
            wrapped = self._wrapped_checkpoints()
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            wrapped = []
            print(f"zerotune probe: wrapping checkpointing failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        originals = [(module, name, getattr(module, name)) for module, name, _ in wrapped]
        try:
            for module, name, wrapper in wrapped:
                setattr(module, name, wrapper)
            layers = self.layers.hooks() if self.layers is not None else contextlib.nullcontext()
            with layers, self.torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
                yield
        finally:
            for module, name, original in originals:
                setattr(module, name, original)

    def write(self, growth: dict | None = None) -> None:
        """Rank 0 writes :data:`ACTIVATIONS_RECORD`, with ``growth`` (:meth:`_StepGrowth.figures`: on CUDA
        the step's growth and the device's peak at the end of the forward) over the keys it shares; every
        rank counts, so that every rank runs the checkpointed regions once more and ZeRO-3's parameter
        gathers stay matched across the ranks."""
        if _rank(self.engine) != 0:
            return
        _write_record(os.path.join(self.probe.directory, ACTIVATIONS_RECORD), lambda: {
            "saved_bytes": int(sum(self.storages.values())), "saved_storages": len(self.storages),
            **({"recompute_bytes": int(self.recompute_bytes), "recompute_regions": self.regions}
               if self.regions else {}),
            **(self.layers.figures(self.recompute_bytes) if self.layers is not None else {}),
            "micro_batch_size": int(self.engine.train_micro_batch_size_per_gpu()), **self.shapes,
            **_device_peak(self.torch, self.engine), **_data_peak(), **(growth or {})}, "recording activations")


def find_loss(output, tensor_type):
    """The scalar loss in a module's output: the output itself when it is a ``tensor_type`` of one element
    that requires grad, else the same test on its ``loss`` (a Hugging Face ``ModelOutput`` or a dict's
    ``"loss"``), else on the first element of a tuple or list; None when there is none."""
    for _ in range(8):  # nested at most this deep
        if isinstance(output, tensor_type):
            return output if output.numel() == 1 and output.requires_grad else None
        if isinstance(output, dict):  # a ModelOutput is an OrderedDict
            output = output.get("loss")
        elif hasattr(output, "loss"):
            output = output.loss
        elif isinstance(output, (tuple, list)) and output:
            output = output[0]
        else:
            return None
    return None


def growth_bytes(peak_bytes: int, before_bytes: int) -> int:
    """What a stretch of work added to the allocated memory at its peak: ``peak - before``, never below 0."""
    return max(0, int(peak_bytes) - int(before_bytes))


class _StepGrowth:
    """On CUDA, in the profile run: the allocated high-water mark over the first forward and over that
    forward plus ``loss.backward()``, less what was allocated before the forward (the module docstring).
    Every rank runs the backward (ZeRO's gradient hooks reduce across the ranks); a failure is printed and
    leaves the forward's figure. ``torch`` is the module or a stand-in with its ``cuda`` functions."""

    def __init__(self, torch, engine):
        self.torch = torch
        self.output, self.forward_end = None, {}
        self._start()
        self.inputs = ((), {})
        self.handle = engine.module.register_forward_hook(self._keep, with_kwargs=True)

    def _start(self) -> None:
        torch = self.torch
        self.reserved_floor = int(torch.cuda.max_memory_reserved())  # the reset below clears it
        torch.cuda.reset_peak_memory_stats()
        self.before = int(torch.cuda.memory_allocated())

    def _forward_end(self, engine) -> dict:
        """The forward's growth (and on CUDA the device's peak), read as the forward ends."""
        return {"forward_growth_bytes": growth_bytes(self.torch.cuda.max_memory_allocated(), self.before),
                **_device_peak(self.torch, engine, self.reserved_floor)}

    def _step_growth(self) -> int:
        """The growth over the forward and the backward, read after the backward."""
        return growth_bytes(self.torch.cuda.max_memory_allocated(), self.before)

    def _backward_start(self) -> None:
        """Before the backward (on CPU the profiler's second window)."""

    def _slope(self, engine) -> dict:
        """More figures after the step's (on CPU the growth per sample: :meth:`_HostStepGrowth._slope`)."""
        return {}

    @classmethod
    def for_profile(cls, engine) -> "_StepGrowth | None":
        torch = sys.modules.get("torch")
        try:
            if torch is None:
                return None
            return cls(torch, engine) if _on_cuda(torch, engine) else _HostStepGrowth(torch, engine)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            print(f"zerotune probe: measuring the step's growth failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
            return None

    def _keep(self, module, args, kwargs, output) -> None:
        self.output, self.inputs = output, (args, kwargs)

    def at_exit(self, engine) -> None:
        """As DeepSpeed's profile ``exit()`` passes: note the forward's figures, then run the backward."""
        torch = self.torch
        try:
            self.forward_end = self._forward_end(engine)
            loss, self.output = find_loss(self.output, torch.Tensor), None
            if loss is None:
                raise ValueError("no scalar loss that requires grad in the module's output")
            self._backward_start()
            engine.backward(loss)
            del loss
            self.forward_end["step_growth_bytes"] = self._step_growth()
            self.forward_end.update(self._slope(engine))
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            print(f"zerotune probe: measuring the backward's growth failed, the forward's kept: "
                  f"{type(e).__name__}: {e}", file=sys.stderr, flush=True)

    def figures(self) -> dict:
        """The record's keys measured so far (``{}`` before :meth:`at_exit`)."""
        return dict(self.forward_end)

    def close(self) -> None:
        self.output = None
        try:
            self.handle.remove()
        except Exception:  # noqa: BLE001 - the probe never breaks training
            pass


class _HostStepGrowth(_StepGrowth):
    """On CPU, in the profile run: the same figures from ``torch.profiler``'s memory events (``profile_memory``:
    every allocation and free of torch's CPU allocator, with its size), which a CPU device lacks counters
    for. Two windows: the forward, whose running sum's maximum is its growth and whose end level is what the
    backward starts from; then the backward, whose running sum's maximum on top of that level is the step's
    growth. The heap's own slack (glibc keeps freed pages) is not in them: the runs' peaks fit it
    (docs/decisions.md, D111)."""

    def _start(self) -> None:
        self.level = 0  # what the forward left allocated, bytes over the start
        self.profiler = self._window()

    def _window(self):
        profiler = self.torch.profiler.profile(activities=[self.torch.profiler.ProfilerActivity.CPU],
                                               profile_memory=True)
        profiler.start()
        return profiler

    def _close_window(self) -> tuple[int, int]:
        """Stop the window's profiler: the running sum of its memory events at its maximum and at its end."""
        profiler, self.profiler = self.profiler, None
        if profiler is None:
            return 0, 0
        profiler.stop()
        events = sorted((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                        if e.name() == "[memory]")
        level = high = 0
        self.levels = []
        for _, nbytes in events:
            level += nbytes
            high = max(high, level)
            self.levels.append(level)
        return high, level

    def _forward_end(self, engine) -> dict:
        high, self.level = self._close_window()
        self.high = high
        return {"forward_growth_bytes": max(0, high)}

    def _backward_start(self) -> None:
        self.profiler = self._window()

    def _step_growth(self) -> int:
        high, _ = self._close_window()
        return max(0, self.high, self.level + high)

    def _slope(self, engine) -> dict:
        """``slope_bytes``, bytes per sample: more training micro steps (the engine's forward and backward,
        DeepSpeed's profile exit held off), their inputs the profile's batch repeated :data:`SLOPE_FACTORS` times
        along its first dimension, each twice the last. A step's peak is the larger of what it holds whatever
        the mbs (the gradients, ZeRO's buckets, the parameters ZeRO-3 gathers) and what grows with the mbs, so
        the slope between two steps rises to the activations' as they take over the peak: the series stops
        when two successive slopes agree within :data:`SLOPE_AGREEMENT`, and the slope is the last one. It also
        stops before a step whose growth (twice the last) would take ``VmData`` over :data:`SLOPE_HEADROOM` of
        the rank's ``RLIMIT_DATA``, after a step longer than :data:`SLOPE_STEP_S`, or at a step that fails (out
        of memory); the ranks decide together (:func:`_every_rank`), since each step runs ZeRO's collectives.
        Also recorded: ``slope_growth_bytes`` (each step's growth), ``slope_data_peak_bytes``
        (``VmData``'s peak after each), ``slope_ended`` (why the series stopped) and ``data_peak_bytes`` as
        before these steps. An input tensor whose first dimension is not the profile's mbs is passed unchanged.
        Fewer than two steps: no slope."""
        import time
        torch = self.torch
        mbs = int(engine.train_micro_batch_size_per_gpu())
        growths, peaks, slopes, before, ended, took = [], [], [], _data_peak(), "factors", 0.0
        self.handle.remove()  # the forward hook would keep the widened inputs
        engine.autotuning_profile_model_info = lambda: False  # the instance's, over the method, for these steps
        try:
            for i, factor in enumerate(SLOPE_FACTORS):
                if i:
                    reason = ("agreed" if len(slopes) >= 2 and abs(slopes[-1] - slopes[-2]) <= SLOPE_AGREEMENT
                              * slopes[-1] else "time" if took > SLOPE_STEP_S
                              else "memory" if not _room_for(2 * growths[-1]) else None)
                    if not _every_rank(torch, reason is None):  # a collective step runs on all ranks or none
                        ended = reason or "another rank"
                        break
                start = time.monotonic()
                args, kwargs = _widen(self.inputs, factor, mbs, torch.Tensor)
                self.profiler = self._window()
                forward = engine if callable(engine) else engine.forward  # the engine is a torch module
                loss = find_loss(forward(*args, **kwargs), torch.Tensor)
                if loss is None:
                    raise ValueError("no scalar loss that requires grad in the module's output")
                engine.backward(loss)
                del loss, args, kwargs
                growths.append(self._close_window()[0])
                peaks.append(_data_peak().get("data_peak_bytes"))
                if i:
                    slopes.append(max(0, growths[-1] - growths[-2]) // ((factor - SLOPE_FACTORS[i - 1]) * mbs))
                took = time.monotonic() - start
        except (Exception, SystemExit) as e:  # noqa: BLE001 - the probe never breaks training
            ended = "failed"
            print(f"zerotune probe: a micro step measuring the growth per sample failed at "
                  f"{SLOPE_FACTORS[len(growths)]}x the profile's batch: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
        finally:
            self.inputs = ((), {})
            try:
                del engine.autotuning_profile_model_info
            except AttributeError:
                pass
        if ended == "factors" and len(slopes) >= 2 and abs(slopes[-1] - slopes[-2]) <= SLOPE_AGREEMENT * slopes[-1]:
            ended = "agreed"
        return {**before, **({"slope_growth_bytes": growths, "slope_ended": ended} if growths else {}),
                **({"slope_data_peak_bytes": peaks} if any(peaks) else {}),
                **({"slope_bytes": slopes[-1]} if slopes else {})}

    def close(self) -> None:
        super().close()
        try:
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler = None
        except Exception:  # noqa: BLE001 - the probe never breaks training
            pass


SLOPE_FACTORS = (2, 4, 8, 16)
"""The profile's batch repeated this many times, in turn, for the micro steps that measure the growth per sample on
CPU (:meth:`_HostStepGrowth._slope`): all above the profile's own, whose growth also holds what a first step
allocates once."""
SLOPE_AGREEMENT = 0.02
"""Two successive slopes this close (relative to the last): the activations set the peak; the series stops. The
allocator's bytes are exact, so two steps on the activations' line agree to the byte (docs/decisions.md, D111)."""
SLOPE_STEP_S = 5.0
"""A wider micro step that took longer (seconds) is the last: the profile run stays cheap."""
SLOPE_HEADROOM = 0.8
"""A wider micro step is not run where ``VmData`` plus its expected growth would pass this share of ``RLIMIT_DATA``."""


def _every_rank(torch, go: bool) -> bool:
    """Whether every rank says ``go`` (a MIN all-reduce over ``torch.distributed``'s default group, on the CPU
    ranks' gloo); ``go`` itself where no group is initialised."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()):
        return go
    flag = torch.tensor([1 if go else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    return bool(flag.item())


def _room_for(growth_bytes: int) -> bool:
    """Whether ``VmData`` now plus ``growth_bytes`` stays within :data:`SLOPE_HEADROOM` of the process's soft
    ``RLIMIT_DATA`` (True without a limit or where either cannot be read)."""
    import resource
    try:
        limit = resource.getrlimit(resource.RLIMIT_DATA)[0]
    except (OSError, ValueError):
        return True
    if limit == resource.RLIM_INFINITY or _DataPeak.running is None:
        return True
    return _DataPeak.running.sample() + growth_bytes <= SLOPE_HEADROOM * limit


def _widen(inputs: tuple, factor: int, mbs: int, tensor_type) -> tuple:
    """``(args, kwargs)`` with every tensor whose first dimension is ``mbs`` repeated ``factor`` times along it,
    in nested tuples, lists and dicts too; anything else as it is."""
    def widen(value):
        if isinstance(value, tensor_type):
            if value.dim() >= 1 and value.shape[0] == mbs:
                return value.detach().repeat(factor, *([1] * (value.dim() - 1)))
            return value
        if isinstance(value, dict):
            return type(value)((k, widen(v)) for k, v in value.items())
        if isinstance(value, tuple) and hasattr(value, "_fields"):  # a named tuple
            return type(value)(*(widen(v) for v in value))
        if isinstance(value, (tuple, list)):
            return type(value)(widen(v) for v in value)
        return value
    args, kwargs = inputs
    return tuple(widen(a) for a in args), {k: widen(v) for k, v in kwargs.items()}


def _hidden_size(module) -> int | None:
    """The model's hidden size where the Trainer reads it (``transformers.integrations.deepspeed``,
    ``trainer_config_finalize``): ``config.hidden_size``, the largest of ``config.hidden_sizes``, or the
    same in ``config.text_config``; None for a model without one."""
    config = getattr(module, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        if owner is None:
            continue
        if getattr(owner, "hidden_size", None) is not None:
            return int(owner.hidden_size)
        if getattr(owner, "hidden_sizes", None):
            return int(max(owner.hidden_sizes))
    return None


def _record(probe: _Probe, engine, state: dict | None, boundary: bool) -> None:
    if boundary and state is not None and not probe.failed:
        try:
            probe.record(engine, state)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            probe.fail("recording a step", e)


class _EngineFinder:
    """A ``sys.meta_path`` finder that lets ``deepspeed.runtime.engine`` load as usual, then
    wraps its engine (:func:`_install`), once."""

    def __init__(self, probe: _Probe):
        self.probe = probe
        self.done = False

    def find_spec(self, name, path=None, target=None):
        if name != ENGINE_MODULE or self.done:
            return None
        self.done = True  # once (and not from the search below)
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None) if finder is not self else None
            spec = find(name, path, target) if find is not None else None
            if spec is not None:
                if spec.loader is not None:
                    spec.loader = _InstallingLoader(spec.loader, self.probe)
                return spec
        return None


class _InstallingLoader:
    """The module's own loader, then :func:`_install` once the module has run."""

    def __init__(self, loader, probe: _Probe):
        self.loader, self.probe = loader, probe

    def __getattr__(self, name):  # get_source, get_filename, ... as the real loader
        return getattr(self.loader, name)

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        try:
            _install(module, self.probe)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.probe.fail("installing the probe", e)


def _chain() -> None:
    """Run the next ``sitecustomize`` on ``sys.path`` after this directory (the user's own)."""
    import importlib.machinery
    import importlib.util
    here = os.path.dirname(os.path.abspath(__file__))
    rest = [p for p in sys.path if os.path.abspath(p or os.curdir) != here]
    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", rest)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


def install(directory: str) -> None:
    """Install the probe writing into ``directory`` in this process: into the engine module if it is already
    imported (a warm rank, forked from a server that preloaded DeepSpeed: :mod:`zerotune.run.warm.rank`), else by
    the import hook that waits for it. A failure is printed; training goes on."""
    try:
        probe = _Probe(directory)
        module = sys.modules.get(ENGINE_MODULE)
        if module is not None and hasattr(module, "DeepSpeedEngine"):
            _install(module, probe)
        else:
            sys.meta_path.insert(0, _EngineFinder(probe))
    except Exception as e:  # noqa: BLE001
        print(f"zerotune probe: not installed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)


def _main() -> None:
    directory = os.environ.get(PROBE_DIR_ENV)
    if directory:
        install(directory)
    _chain()


if __name__ == "sitecustomize":  # imported by ``site`` at start-up, not as zerotune.probe.sitecustomize
    _main()
