"""The peak memory the probe records: on CPU the ``VmData`` sampler, on CUDA the device's peak, and the cap
of a CUDA device's caching allocator at the rank's budget.

A step record's ``peak_bytes`` (bytes, `_peaks`) is on CUDA ``torch.cuda.max_memory_allocated()``, beside
``peak_reserved_bytes`` (``torch.cuda.max_memory_reserved()``) and ``device_peak_bytes``, the device at its peak
(`_device_peak`): the peak the budget limits there. On CPU it is the largest ``VmData`` so far (what
``RLIMIT_DATA``, the per-rank budget, limits; sampled by `_DataPeak`), beside ``rss_peak_bytes`` (``ru_maxrss``,
which leaves out pages allocated and never written). The cap: `cap_allocator`.
Evidence: docs/decisions.md, D26, D202, D203.
"""
import os
import sys

# The name starts with PYTHON so that DeepSpeed's multi-node runner forwards it to the other nodes' ranks (as it
# does the probe's directory, ``sitecustomize.PROBE_DIR_ENV``).
BUDGET_ENV = "PYTHON_ZEROTUNE_DEVICE_BUDGET"  # bytes per device, on CUDA ranks (`cap_allocator`)


def _peaks(engine) -> dict:
    """The peaks a step record carries, bytes (the module docstring)."""
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
    ``RLIMIT_DATA``, the CPU backend's per-rank budget, limits), sampled every `period_s` by a
    daemon thread from ``/proc/self/status``. Linux keeps no high-water mark of it, and the peak of a
    training step lasts tens of milliseconds (the backward pass holds the activations, the gradients
    and the reduction's flat copy at once; docs/decisions.md, D202). The resident high-water mark
    (``ru_maxrss``) is no substitute: it leaves out pages allocated and never written, such as most of
    a reduce bucket, which the budget counts.

    The thread runs until the end of optimizer step `SAMPLED_STEPS` (`stop`), then each
    record samples once: by then every step's allocations have happened (the first step creates the
    optimizer states, the second holds them with the activations, the gradients and the reduction's
    copy), and the steps measured for the metric run without it. A later step whose batch is longer than
    every earlier one (`note_seq_len`) allocates more: the thread runs again until its record, so that
    the run's peak is the peak of its longest batch, as ``zerotune.model.tokens`` reads it."""

    running: "_DataPeak | None" = None
    period_s = 0.005
    SAMPLED_STEPS = 2
    PATH = "/proc/self/status"

    def __init__(self):
        self._peak = 0
        self._stopped = False
        self._thread = None
        self._longest = 0  # tokens: the longest sequence length a forward has held so far (note_seq_len)

    def stop(self) -> None:
        """End the sampling thread (its last sample is kept; `peak` still samples once per call)."""
        self._stopped = True

    def note_seq_len(self, seq_len: int) -> None:
        """A forward's sequence length: one longer than every earlier forward's restarts a stopped thread,
        which the step's record stops again (a longer batch's peak lies within its step)."""
        if seq_len <= self._longest:
            return
        self._longest = seq_len
        if self._stopped:
            self._stopped = False
            if self._thread is None or not self._thread.is_alive():  # else the stopped thread goes on
                self.run_in_background()

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
        """Sample every `period_s` in a daemon thread until `stop`."""
        import threading
        self._thread = threading.Thread(target=self._loop, name="zerotune-vmdata", daemon=True)
        self._thread.start()

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
    """On CPU ranks, ``{"data_peak_bytes": n}``: the largest ``VmData`` so far (`_DataPeak`);
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
    """On a CUDA rank with a budget (`BUDGET_ENV`, set by zerotune for its experiments), cap the caching
    allocator of the engine's device at it (`cap_allocator`), before the first forward: the budget is a
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
