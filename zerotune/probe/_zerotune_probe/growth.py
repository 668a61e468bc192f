"""The profile run's step growth, added to `.records.ACTIVATIONS_RECORD` (D111, D204).

``forward_growth_bytes`` and ``step_growth_bytes``, bytes at the record's ``micro_batch_size``: the allocated
high-water mark at the end of the forward, and over the forward and the engine's backward (run on the module's
output as DeepSpeed's ``exit()`` passes), less what was allocated before the forward. Without a loss or with a
failed backward only the forward's is kept; the ``SystemExit`` always goes on. On CUDA the allocator's counters
give them (`_StepGrowth`), on CPU ``torch.profiler``'s memory events (`_HostStepGrowth`), which also give
``slope_bytes``, the growth per sample the memory model's activation term takes.
"""
import sys

from .peak import _data_peak, _DataPeak, _device_peak, _on_cuda

SLOPE_FACTORS = (2, 4, 8, 16)
"""The profile's batch repeated this many times, in turn, for the micro steps that measure the growth per sample on
CPU (`_HostStepGrowth._slope`): all above the profile's own, whose growth also holds what a first step
allocates once."""
SLOPE_AGREEMENT = 0.02
"""Two successive slopes this close (relative to the last): the activations set the peak (the record's
``slope_ended`` says ``agreed``). The allocator's bytes are exact, so two steps on the activations' line agree to the
byte (docs/decisions.md, D111)."""
SLOPE_STEP_S = 5.0
"""A wider micro step that took longer (seconds) is the last: the profile run stays cheap."""
SLOPE_HEADROOM = 0.8
"""A wider micro step is not run where ``VmData`` plus its expected growth would pass this share of ``RLIMIT_DATA``."""


def find_loss(output, tensor_type):
    """The scalar loss in a module's output: the output if a one-element ``tensor_type`` that requires grad, else the
    same test on its ``loss`` (attribute or key), else on a tuple's or list's first element; None without one."""
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
    """On CUDA, the module docstring's figures from the allocator's counters; the step's counts what the backward
    allocates beyond the autograd-saved storages (the logits' gradient, the fp32 loss). Every rank runs the backward
    (ZeRO's gradient hooks reduce across the ranks). ``torch``: the module or a stand-in with its ``cuda`` functions."""

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
        """More figures after the step's (on CPU the growth per sample: `_HostStepGrowth._slope`)."""
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
        """The record's keys measured so far (``{}`` before `at_exit`)."""
        return dict(self.forward_end)

    def close(self) -> None:
        self.output = None
        try:
            self.handle.remove()
        except Exception:  # noqa: BLE001 - the probe never breaks training
            pass


class _HostStepGrowth(_StepGrowth):
    """On CPU, the same figures from ``torch.profiler``'s memory events (every allocation and free of torch's CPU
    allocator): the forward window's running-sum maximum is its growth and its end level the backward's start; the
    backward window's maximum on top of that level is the step's growth. The heap's own slack (glibc keeps freed
    pages) is not in them: the runs' peaks fit it (D111)."""

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
        # by time, and at equal times in the order recorded: sorting on the size too put a free before the
        # allocation it followed within one nanosecond, and the peak lost the smaller one
        events = sorted(((e.start_ns(), e.nbytes()) for e in profiler.profiler.kineto_results.events()
                         if e.name() == "[memory]"), key=lambda event: event[0])
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
        """``slope_bytes`` and ``data_slope_bytes``, bytes per sample, from more training micro steps (forward and
        backward, DeepSpeed's profile exit held off) on the profile's batch repeated `SLOPE_FACTORS` times along its
        first dimension. A step's peak is the larger of what it holds whatever the mbs and what grows with the mbs, so
        the slope between two steps rises to the activations' as they take over: ``slope_bytes`` is the last slope of
        the allocator's bytes, ``data_slope_bytes`` the last rise of ``VmData``'s peak per sample (what the CPU budget
        limits; glibc's heap keeps more than the live tensors). The series stops before a step that would take
        ``VmData`` over `SLOPE_HEADROOM` of ``RLIMIT_DATA``, after one longer than `SLOPE_STEP_S`, or at a failure; the
        ranks decide together (`_every_rank`: each step runs ZeRO's collectives). Also recorded: ``slope_growth_bytes``
        and ``slope_data_peak_bytes`` per step, ``slope_ended`` (why it stopped; ``agreed``: the last two slopes within
        `SLOPE_AGREEMENT`) and ``data_peak_bytes`` before these steps. A tensor whose first dimension is not the mbs is
        passed unchanged; fewer than two steps give no slope."""
        import time
        torch = self.torch
        mbs = int(engine.train_micro_batch_size_per_gpu())
        growths, peaks, slopes, before, ended, took = [], [], [], _data_peak(), "factors", 0.0
        self.handle.remove()  # the forward hook would keep the widened inputs
        engine.autotuning_profile_model_info = lambda: False  # the instance's, over the method, for these steps
        try:
            for i, factor in enumerate(SLOPE_FACTORS):
                if i:
                    reason = ("time" if took > SLOPE_STEP_S
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
        data_slope = {}
        if len(peaks) >= 2 and peaks[-1] and peaks[-2]:
            n = len(peaks)
            data_slope = {"data_slope_bytes": max(0, peaks[-1] - peaks[-2])
                          // ((SLOPE_FACTORS[n - 1] - SLOPE_FACTORS[n - 2]) * mbs)}
        return {**before, **({"slope_growth_bytes": growths, "slope_ended": ended} if growths else {}),
                **({"slope_data_peak_bytes": peaks} if any(peaks) else {}),
                **({"slope_bytes": slopes[-1]} if slopes else {}), **data_slope}

    def close(self) -> None:
        super().close()
        try:
            if self.profiler is not None:
                self.profiler.stop()
                self.profiler = None
        except Exception:  # noqa: BLE001 - the probe never breaks training
            pass


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
    """Whether ``VmData`` now plus ``growth_bytes`` stays within `SLOPE_HEADROOM` of the process's soft
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
    """``(args, kwargs)`` with every tensor whose first dimension is ``mbs``, nested too, repeated ``factor`` times."""
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
