"""Installing the probe into DeepSpeed's engine: the import hook, the engine's wrapped methods and the engine record.

`install` waits for ``deepspeed.runtime.engine`` (nothing imports deepspeed or torch at start-up), then wraps the
engine's ``forward``, ``step`` and ``allreduce_gradients`` (`_install`). Rules for what the records hold:
- A rank records a line after each boundary ``step()`` returns (`.records._Probe.record`), and on the step where
  DeepSpeed's autotuning exits, as its ``SystemExit`` passes (its ``step_s`` holds rank 0's ``metrics.json`` write).
- A step ends when ``step()`` returns on the host: no device synchronisation is added, so on CUDA one step's time
  may be shifted by the queued kernels, the mean over several is not. A step in progress at a kill is lost.
- Before the first forward rank 0 writes ``engine_config.json`` (`_record_engine`).
"""
import os
import sys

from .activations import _SavedActivations
from .batch import _note_batch
from .growth import _StepGrowth
from .padding import pad_batch, pad_length
from .peak import _cap_device, _DataPeak, _on_cuda
from .records import ENGINE_RECORD, _Probe, _rank, _write_record

ENGINE_MODULE = "deepspeed.runtime.engine"


def _note_base(probe: _Probe, engine) -> None:
    """On CUDA, the allocated bytes before the step's first forward (``base_bytes``, noted once per step)."""
    torch = sys.modules.get("torch")
    if probe.failed or not _on_cuda(torch, engine):
        return
    state = probe.state(engine)
    if state["base"] is None:
        state["base"] = int(torch.cuda.memory_allocated())


def _install(module, probe: _Probe) -> None:
    """Wrap the engine module's ``DeepSpeedEngine.forward``, ``step`` and ``allreduce_gradients``; in a CPU rank
    (``DS_ACCELERATOR=cpu``, and ``LOCAL_RANK``, which the launcher sets for its ranks only) start the ``VmData``
    sampler (`_DataPeak`): the launcher processes import the engine module too but never step (D203)."""
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
    """``forward`` noting the first forward's time and each batch's shape (`.batch._note_batch`), the batch first
    padded where asked (`.padding`); before the first, rank 0 records the engine (`_record_engine`), and in the profile
    run the saved activations (`_SavedActivations`) and the step's growth (`_StepGrowth`) are measured."""
    import functools
    import time

    @functools.wraps(forward)
    def probed_forward(self, *args, **kwargs):
        first = probe.first_forward is None
        if first:
            probe.first_forward = time.monotonic()
            probe.pad_to = pad_length(probe.directory)
        if probe.pad_to is not None:  # --verify-longest: the batch at the longest length (.padding)
            try:
                args, kwargs = pad_batch(args, kwargs, probe.pad_to)
            except Exception as e:  # noqa: BLE001 - the probe never breaks training; its records say so
                probe.fail("padding the batch to the longest length", e)
        _note_batch(probe, self, args, kwargs)
        if first:
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
                    counter.count_square(args, kwargs)
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
    """``step`` counting micro steps, timing the boundary's call (``boundary_s``) and recording its line after it."""
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
    """``allreduce_gradients`` adding its time to ``boundary_s`` when ``backward()`` calls it at the boundary."""
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
    """Rank 0 writes `ENGINE_RECORD` once, before the first forward: the config the engine got (a Trainer script's
    with its "auto" values filled in), the model's hidden size as the Trainer reads it, its maximum positions, the
    engine's mbs, gas and train batch size, its Ulysses degree (``sequence_parallel_size``: the size of the group a
    script's mpu set up, 1 without one), and the memory savers it really runs with (`_savers`). The profile run's
    record resolves the hidden-size ``"auto"`` values (`zerotune.deepspeed.auto`)."""
    def record():
        if _rank(engine) != 0:
            return None
        config = getattr(getattr(engine, "_config", None), "_param_dict", None)
        return {"ds_config": config if isinstance(config, dict) else None,
                "hidden_size": _hidden_size(getattr(engine, "module", None)),
                "max_positions": _max_positions(getattr(engine, "module", None)),
                "train_micro_batch_size_per_gpu": int(engine.train_micro_batch_size_per_gpu()),
                "gradient_accumulation_steps": int(engine.gradient_accumulation_steps()),
                "train_batch_size": int(engine.train_batch_size()),
                "sequence_parallel_size": int(getattr(engine, "sequence_parallel_size", 1) or 1), **_savers(engine)}
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


def _max_positions(module) -> int | None:
    """The longest sequence the model takes: a Hugging Face config's ``n_positions`` or ``max_position_embeddings``
    (or the same in ``config.text_config``); None for a model without one."""
    config = getattr(module, "config", None)
    for owner in (config, getattr(config, "text_config", None)):
        for key in ("n_positions", "max_position_embeddings"):
            value = getattr(owner, key, None) if owner is not None else None
            if isinstance(value, int) and not isinstance(value, bool) and value > 0:
                return value
    return None


def _record(probe: _Probe, engine, state: dict | None, boundary: bool) -> None:
    if boundary and state is not None and not probe.failed:
        try:
            probe.record(engine, state)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            probe.fail("recording a step", e)


class _EngineFinder:
    """A ``sys.meta_path`` finder: ``deepspeed.runtime.engine`` loads as usual, then `_install` wraps it, once."""

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
    """The module's own loader, then `_install` once the module has run."""

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


def install(directory: str) -> None:
    """Install the probe writing into ``directory``: into the engine module if already imported (a warm rank, forked
    from a server that preloaded DeepSpeed: `zerotune.run.warm.rank`), else by the import hook. A failure is printed."""
    try:
        probe = _Probe(directory)
        module = sys.modules.get(ENGINE_MODULE)
        if module is not None and hasattr(module, "DeepSpeedEngine"):
            _install(module, probe)
        else:
            sys.meta_path.insert(0, _EngineFinder(probe))
    except Exception as e:  # noqa: BLE001
        print(f"zerotune probe: not installed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
