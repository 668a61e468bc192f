"""zerotune.core.step_record.StepRecord: a probe stream line, parsed and validated once, exactly."""
from zerotune.core.step_record import StepRecord
from zerotune.probe import read_streams, step_records, stream_name

LINE = ('{"rank": 1, "step": 3, "t": 12345.678, "step_s": 0.0412, "boundary_s": 0.0061, "micro_steps": 2, '
        '"train_batch_size": 8, "peak_bytes": 734003200, "rss_peak_bytes": 700000000}')


def test_a_probe_line_parses_into_its_fields():
    assert StepRecord.parse(LINE) == StepRecord(rank=1, step=3, t=12345.678, step_s=0.0412, boundary_s=0.0061,
                                                micro_steps=2, train_batch_size=8, peak_bytes=734003200,
                                                rss_peak_bytes=700000000)
    assert StepRecord.parse(LINE).peak == 734003200


def test_a_line_that_is_not_a_json_object_is_no_record():
    assert StepRecord.parse('{"rank": 0, "step": 3, "t": 12') is None  # a rank killed while writing
    assert StepRecord.parse("[1, 2]") is None
    assert StepRecord.parse("") is None


def test_a_value_that_is_not_a_finite_number_counts_as_missing():
    record = StepRecord.parse('{"step": true, "t": NaN, "step_s": "0.5", "boundary_s": Infinity, '
                              '"train_batch_size": false, "peak_bytes": null}')
    assert record == StepRecord()
    assert StepRecord.from_dict({"step": 2.0, "rank": 1.0}) == StepRecord()  # step and rank: integers only
    # counts and bytes are truncated to integers, as the readers did
    assert StepRecord.from_dict({"train_batch_size": 8.9, "peak_bytes": 1.5e9}) == StepRecord(
        train_batch_size=8, peak_bytes=1_500_000_000)


def test_on_cuda_the_peak_is_the_devices():
    record = StepRecord.from_dict({"step": 1, "peak_bytes": 7 * 10**9, "peak_reserved_bytes": 9 * 10**9,
                                   "device_peak_bytes": 13 * 10**9})
    assert (record.peak, record.peak_reserved_bytes) == (13 * 10**9, 9 * 10**9)
    assert StepRecord.from_dict({"step": 1, "device_peak_bytes": "13"}).peak is None


def test_step_records_validates_each_decoded_line_as_a_read_stream_does():
    assert step_records({0: [{"step": 2, "step_s": 0.25}, {"step": True, "t": "12"}], 1: []}) == {
        0: [StepRecord(step=2, step_s=0.25), StepRecord()], 1: []}


def test_read_streams_skips_the_lines_that_are_not_objects(tmp_path):
    (tmp_path / stream_name(0)).write_text(LINE + "\n" + "not json\n" + '{"step": 4}\n' + '{"step": 5, "t')
    (tmp_path / stream_name(1)).write_text("")
    assert read_streams(tmp_path) == {0: [StepRecord.parse(LINE), StepRecord(step=4)], 1: []}


def test_what_a_batch_held_parses_and_a_line_of_an_older_probe_still_does():
    record = StepRecord.parse(LINE[:-1] + ', "batch_samples": 4, "seq_len": 128}')
    assert (record.batch_samples, record.seq_len) == (4, 128)
    assert record == StepRecord(**{**StepRecord.parse(LINE).__dict__, "batch_samples": 4, "seq_len": 128})
    old = StepRecord.parse(LINE)  # written before the probe recorded batches
    assert (old.batch_samples, old.seq_len) == (None, None) and old.step == 3
    assert StepRecord.from_dict({"step": 1, "batch_samples": 8, "seq_len": None}).seq_len is None  # no token ids


def test_a_batch_size_or_sequence_length_that_is_not_an_int_of_at_least_1_counts_as_missing():
    for bad in (0, -3, 128.0, 12.5, "128", True, None, [128], float("nan")):
        record = StepRecord.from_dict({"step": 2, "batch_samples": bad, "seq_len": bad})
        assert (record.step, record.batch_samples, record.seq_len) == (2, None, None), bad
