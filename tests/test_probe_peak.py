"""The probe's CPU peak: the largest VmData (what RLIMIT_DATA limits), sampled every 5 ms in the rank."""
import threading
import time

from zerotune.probe import sitecustomize as probe_module


def vmdata() -> int:
    return probe_module._DataPeak().sample()


def test_a_transient_allocation_shorter_than_a_step_is_in_the_peak():
    """A 256 MiB buffer held for 50 ms, then freed: VmData is back down, and the sampler kept the peak,
    which the resident high-water mark also sees here only because the buffer is written (zero-filled)."""
    probe_module._DataPeak.start()
    sampler = probe_module._DataPeak.running
    assert sampler is not None and sampler.period_s == 0.005
    before = vmdata()
    buffer = bytearray(256 * 2**20)  # above glibc's mmap threshold: mapped, and unmapped when freed
    time.sleep(0.05)
    held = vmdata()
    del buffer
    time.sleep(0.02)
    after = vmdata()
    assert held - before >= 256 * 2**20 and held - after >= 256 * 2**20
    assert sampler.peak() >= held  # kept after the buffer went: 10 samples fell while it was held
    assert any(t.name == "zerotune-vmdata" and t.daemon for t in threading.enumerate())


def test_the_cpu_record_holds_the_vmdata_peak_and_the_resident_one_beside_it():
    probe_module._DataPeak.start()
    peaks = probe_module._peaks(object())  # an engine without a device: CPU
    assert set(peaks) == {"peak_bytes", "rss_peak_bytes"}
    # the largest VmData so far (this test process has imported torch: over 50 MiB), never above a later read
    assert 50 * 2**20 < peaks["peak_bytes"] <= probe_module._DataPeak.running.peak()
    assert peaks["rss_peak_bytes"] > 50 * 2**20
