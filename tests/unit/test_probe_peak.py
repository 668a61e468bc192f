"""The probe's peaks: on CPU the largest VmData (what RLIMIT_DATA limits), sampled every 5 ms in the rank
until the end of optimizer step 2 and through any later step with a longer batch than before, then once per
record; on CUDA the device's beside the allocator's."""
import json
import threading
import time
import types

from zerotune.probe._zerotune_probe.batch import _note_batch
from zerotune.probe._zerotune_probe.peak import _data_peak, _DataPeak, _peaks
from zerotune.probe._zerotune_probe.records import _Probe


def vmdata() -> int:
    return _DataPeak().sample()


def sampler_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "zerotune-vmdata" and t.daemon]


def test_a_transient_allocation_shorter_than_a_step_is_in_the_peak_and_stop_ends_the_thread():
    """A 256 MiB buffer held for 50 ms, then freed: VmData is back down, and the sampler kept the peak."""
    sampler = _DataPeak()
    assert sampler.sample() > 0 and sampler.period_s == 0.005
    threads = len(sampler_threads())
    sampler.run_in_background()
    assert len(sampler_threads()) == threads + 1
    before = vmdata()
    buffer = bytearray(256 * 2**20)  # above glibc's mmap threshold: mapped, and unmapped when freed
    time.sleep(0.05)
    held = vmdata()
    del buffer
    time.sleep(0.02)
    after = vmdata()
    assert held - before >= 256 * 2**20 and held - after >= 256 * 2**20
    sampler.stop()
    assert sampler._peak >= held  # kept after the buffer went: about 10 samples fell while it was held
    time.sleep(0.05)
    assert len(sampler_threads()) == threads  # the thread ended


def test_the_sampling_thread_stops_once_step_2_is_recorded(tmp_path, monkeypatch):
    sampler = _DataPeak()
    monkeypatch.setattr(_DataPeak, "running", sampler)
    probe = _Probe(str(tmp_path))
    engine = types.SimpleNamespace(global_rank=0, train_batch_size=lambda: 4)
    state = probe.state(engine)
    state["last"] = time.monotonic()
    probe.record(engine, state)
    assert not sampler._stopped
    probe.record(engine, state)
    assert sampler._stopped
    lines = (tmp_path / "probe.rank0.jsonl").read_text().splitlines()
    assert len(lines) == 2 and all('"peak_bytes"' in ln and '"rss_peak_bytes"' in ln for ln in lines)


def test_a_step_longer_than_every_earlier_one_is_sampled_again_until_its_record(tmp_path, monkeypatch):
    """Steps 1-2 at 32 tokens, then 512 at step 3: its transient 256 MiB is in the peak; step 4 at 512 again,
    no longer than before, runs without the thread, and step 5 at 1,024 brings it back."""
    import torch
    sampler = _DataPeak()
    monkeypatch.setattr(_DataPeak, "running", sampler)
    sampler.run_in_background()
    probe = _Probe(str(tmp_path))
    probe.first_forward = time.monotonic()
    engine = types.SimpleNamespace(global_rank=0, train_batch_size=lambda: 4)
    threads = len(sampler_threads())

    def step(tokens: int, hold_s: float = 0.0) -> int:
        _note_batch(probe, engine, (torch.zeros(4, tokens, dtype=torch.int64),), {})
        running, before = not sampler._stopped, vmdata()
        if hold_s:
            buffer = bytearray(256 * 2**20)
            time.sleep(hold_s)
            del buffer
            time.sleep(0.02)
        assert vmdata() - before < 256 * 2**20  # freed before the record's own sample
        probe.record(engine, probe.state(engine))
        return running

    assert step(32) and step(32) and sampler._stopped
    time.sleep(0.05)
    assert len(sampler_threads()) == threads - 1
    peak = sampler._peak
    assert step(512, hold_s=0.05) and sampler._stopped  # sampled through step 3, stopped at its record
    assert sampler._peak - peak >= 256 * 2**20
    assert not step(512) and step(1024) and sampler._stopped
    time.sleep(0.05)
    assert len(sampler_threads()) == threads - 1  # one thread at most, ended again
    lines = [json.loads(ln) for ln in (tmp_path / "probe.rank0.jsonl").read_text().splitlines()]
    assert [ln["seq_len"] for ln in lines] == [32, 32, 512, 512, 1024]
    assert lines[2]["peak_bytes"] - lines[1]["peak_bytes"] >= 256 * 2**20


def test_the_cpu_record_holds_the_vmdata_peak_and_the_resident_one_beside_it(monkeypatch):
    import torch  # noqa: F401 - the figures below need a process that holds torch, run alone or in the suite
    monkeypatch.setattr(_DataPeak, "running", None)  # this test's own sampler, gone after it
    assert _data_peak() == {}  # no sampler (CUDA, or not a rank): nothing in the profile record
    _DataPeak.start()
    sampler = _DataPeak.running
    try:
        peaks = _peaks(object())  # an engine without a device: CPU
        assert set(peaks) == {"peak_bytes", "rss_peak_bytes"}
        # the largest VmData so far (this test process has imported torch: over 50 MiB), never above a later read
        assert 50 * 2**20 < peaks["peak_bytes"] <= sampler.peak()
        assert peaks["rss_peak_bytes"] > 50 * 2**20
        assert peaks["peak_bytes"] <= _data_peak()["data_peak_bytes"]  # the profile record's figure
    finally:
        sampler.stop()


def test_the_cuda_record_holds_the_devices_peak_beside_the_allocators(monkeypatch):
    # a stand-in for a CUDA device (no GPU on this machine): 80 GB, 70 GB free, 6 GB reserved now, 9 GB at the
    # reserved peak, 7 GB at the allocated peak; outside the allocator (context, NCCL): 80 - 70 - 6 = 4 GB
    import torch
    for name, value in (("is_available", True), ("max_memory_allocated", 7 * 10**9),
                        ("max_memory_reserved", 9 * 10**9), ("memory_reserved", 6 * 10**9),
                        ("mem_get_info", (70 * 10**9, 80 * 10**9))):
        monkeypatch.setattr(torch.cuda, name, lambda *a, v=value: v)
    engine = types.SimpleNamespace(device=torch.device("cuda", 0))
    assert _peaks(engine) == {"peak_bytes": 7 * 10**9, "peak_reserved_bytes": 9 * 10**9,
                                           "device_peak_bytes": 13 * 10**9}

