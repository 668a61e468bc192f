"""The peak memory the probe records, and the cap of a CUDA device's caching allocator at the rank's budget
(`cap_allocator`); D26, D202, D203.

A step record's ``peak_bytes`` (`_peaks`) is on CUDA ``torch.cuda.max_memory_allocated()``, beside
``peak_reserved_bytes`` (``max_memory_reserved()``) and ``device_peak_bytes`` (`_device_peak`), the peak the budget
limits there. On CPU it is the largest ``VmData`` so far (what ``RLIMIT_DATA``, the per-rank budget, limits:
`_DataPeak`), beside ``rss_peak_bytes`` (``ru_maxrss``, which leaves out pages allocated and never written).
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
    """On CPU, the largest ``VmData`` of this process, sampled every `period_s` from ``/proc/self/status`` by a daemon
    thread: Linux keeps no high-water mark of it, and a training step's peak lasts tens of milliseconds (D202).

    The thread runs until the record of optimizer step `SAMPLED_STEPS` (`stop`), by when every step's allocations have
    happened; then each record samples once, so the steps measured for the metric run without it. A later batch
    longer than every earlier one (`note_seq_len`) runs it again until its record, so that the run's peak is its
    longest batch's, as ``zerotune.model.tokens`` reads it."""

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
        """A forward's sequence length: one longer than any before restarts a stopped thread until the step's record."""
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
    """On CPU ranks ``{"data_peak_bytes": n}`` (`_DataPeak`), else ``{}``: for the profile run's record, as the run
    exits in its first forward, before any step record."""
    return {"data_peak_bytes": _DataPeak.running.peak()} if _DataPeak.running is not None else {}


def _on_cuda(torch, engine) -> bool:
    """Whether ``engine`` runs on a CUDA device that ``torch`` (None: not imported) sees."""
    device = getattr(engine, "device", None)
    return torch is not None and getattr(device, "type", device) == "cuda" and bool(torch.cuda.is_available())


def _device_peak(torch, engine, reserved_floor: int = 0) -> dict:
    """On CUDA ``{"device_peak_bytes": n}``: ``max_memory_reserved()`` (at least ``reserved_floor``, the mark before a
    reset of the peaks) plus what the device holds outside the caching allocator now (``mem_get_info``'s total - free,
    less ``memory_reserved()``: the CUDA context, NCCL, other processes); elsewhere ``{}``."""
    if not _on_cuda(torch, engine):
        return {}
    free, total = torch.cuda.mem_get_info()
    outside = max(0, int(total) - int(free) - int(torch.cuda.memory_reserved()))
    return {"device_peak_bytes": max(int(torch.cuda.max_memory_reserved()), int(reserved_floor)) + outside}


def cap_allocator(cuda, device: int, budget_bytes: int) -> float | None:
    """Cap the caching allocator of CUDA device ``device`` so that the device holds at most ``budget_bytes``:
    ``set_per_process_memory_fraction((budget - outside) / total)``, ``outside`` as in `_device_peak`; past it an
    allocation raises CUDA's own out-of-memory error, as on a smaller device. ``cuda``: ``torch.cuda`` or a stand-in.
    Returns the fraction set; None when the budget leaves the allocator the whole device (nothing set)."""
    free, total = cuda.mem_get_info(device)
    outside = max(0, int(total) - int(free) - int(cuda.memory_reserved(device)))
    fraction = max(0.0, (int(budget_bytes) - outside) / int(total))
    if fraction >= 1.0:
        return None
    cuda.set_per_process_memory_fraction(fraction, device)
    return fraction


def _cap_device(engine) -> None:
    """On a CUDA rank with a budget (`BUDGET_ENV`), cap the engine's device at it before the first forward
    (`cap_allocator`): the budget is a limit, as ``RLIMIT_DATA`` makes it on CPU ranks. A failure is printed."""
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
