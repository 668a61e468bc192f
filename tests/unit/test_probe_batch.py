"""What a batch held: the samples and the sequence length the probe reads from the shapes of the tensors the
engine's forward receives, kept per optimizer step and written in its record."""
import json
import time
import types

import torch

from zerotune.probe._zerotune_probe.batch import SCANNED, _batch_shape, _note_batch
from zerotune.probe._zerotune_probe.engine import _probed_forward
from zerotune.probe._zerotune_probe.records import _Probe


def test_a_hugging_face_batch_gives_its_samples_and_its_token_count():
    ids = torch.zeros(4, 128, dtype=torch.int64)
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    assert _batch_shape((batch,), {}) == (4, 128)  # engine(batch)
    assert _batch_shape((), batch) == (4, 128)  # engine(**batch), as the Trainer calls it
    assert _batch_shape(([batch["input_ids"]],), {}) == (4, 128)  # one level into a list
    # the longest integer tensor of 2+ dims; float and bool tensors and 1-dim ones say nothing of tokens
    assert _batch_shape((torch.zeros(4, 96, dtype=torch.int32), torch.zeros(4, 512, 8)),
                        {"mask": torch.ones(4, 1024, dtype=torch.bool), "ids": torch.zeros(4, 100, dtype=torch.int64),
                         "lengths": torch.zeros(4, dtype=torch.int64)}) == (4, 100)


def test_an_image_batch_has_samples_and_no_sequence_length():
    assert _batch_shape((torch.zeros(8, 3, 32, 32),), {}) == (8, None)
    assert _batch_shape(((torch.zeros(8, 3, 32, 32), torch.zeros(8, dtype=torch.int64)),), {}) == (8, None)


def test_nothing_tensor_like_gives_nothing():
    assert _batch_shape((1, "text", [1, 2], {"ids": [[1, 2]]}), {"x": None}) == (None, None)
    assert _batch_shape((torch.tensor(3.0), torch.tensor(7)), {}) == (None, None)  # 0-dim: a scalar argument
    assert _batch_shape((), {}) == (None, None)
    # two levels deep is not looked at, nor past the first SCANNED values of a container
    assert _batch_shape(({"inner": {"ids": torch.zeros(2, 7, dtype=torch.int64)}},), {}) == (None, None)
    assert _batch_shape(([0] * SCANNED + [torch.zeros(2, 7, dtype=torch.int64)],), {}) == (None, None)


class _Unreadable(torch.Tensor):
    @property
    def shape(self):
        raise RuntimeError("no shape")


def test_the_step_record_holds_its_micro_batches_largest_and_a_failure_never_reaches_training(tmp_path):
    probe = _Probe(str(tmp_path))
    probe.first_forward = time.monotonic()
    engine = types.SimpleNamespace(global_rank=0, train_batch_size=lambda: 8)
    for ids in (torch.zeros(4, 100, dtype=torch.int64), torch.zeros(3, 128, dtype=torch.int64)):  # gas 2
        _note_batch(probe, engine, (), {"input_ids": ids})
    _note_batch(probe, engine, (torch.zeros(4, 8).as_subclass(_Unreadable),), {})  # adds nothing, raises nothing
    probe.record(engine, probe.state(engine))
    _note_batch(probe, engine, (torch.zeros(8, 3, 32, 32),), {})
    probe.record(engine, probe.state(engine))
    probe.record(engine, probe.state(engine))  # a step whose forwards the probe did not see
    lines = [json.loads(ln) for ln in (tmp_path / "probe.rank0.jsonl").read_text().splitlines()]
    assert [(ln["batch_samples"], ln["seq_len"]) for ln in lines] == [(4, 128), (8, None), (None, None)]
    # tokens: samples x sequence length summed over the step's forwards (4 x 100 + 3 x 128); unknown once a forward
    # lacks either (the unreadable one in step 1 raised before adding; step 2's images have no token ids)
    assert [ln["tokens"] for ln in lines] == [784, None, None]
    assert not probe.failed


def test_the_wrapped_forward_notes_the_batch_from_the_first_call_on(tmp_path):
    probe = _Probe(str(tmp_path))
    forward = _probed_forward(lambda self, *args, **kwargs: "loss", probe)
    engine = types.SimpleNamespace(global_rank=1, module=None, _config=None, train_batch_size=lambda: 2,
                                   train_micro_batch_size_per_gpu=lambda: 2, gradient_accumulation_steps=lambda: 1)
    assert forward(engine, torch.zeros(2, 64, dtype=torch.int64)) == "loss"
    state = probe.state(engine)
    assert (state["batch_samples"], state["seq_len"]) == (2, 64)
    assert state["last"] == probe.first_forward  # step 1 is still timed from the first forward


def test_the_longest_batch_pads_token_ids_labels_with_the_ignored_index(tmp_path):
    from zerotune.probe._zerotune_probe.padding import pad_batch, pad_length

    ids = torch.arange(6, dtype=torch.int64).reshape(2, 3) + 1
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(),
             "pixel_values": torch.ones(2, 3), "mask": torch.ones(2, 3, dtype=torch.bool)}
    args, kwargs = pad_batch((), batch, length=5)
    assert args == () and kwargs["input_ids"].tolist() == [[1, 2, 3, 0, 0], [4, 5, 6, 0, 0]]
    assert kwargs["attention_mask"].tolist() == [[1, 1, 1, 0, 0]] * 2
    assert kwargs["labels"].tolist() == [[1, 2, 3, -100, -100], [4, 5, 6, -100, -100]]
    assert kwargs["pixel_values"] is batch["pixel_values"] and kwargs["mask"] is batch["mask"]  # not token ids
    (inner,), _ = pad_batch(({"input_ids": ids},), {}, length=4)  # engine(batch): one level into it
    assert inner["input_ids"].shape == (2, 4) and _batch_shape((inner,), {}) == (2, 4)
    longer = torch.zeros(2, 9, dtype=torch.int64)
    assert pad_batch((longer, torch.zeros(2, 3, 4, dtype=torch.int64)), {}, length=5)[0][0] is longer
    assert pad_batch((ids,), {}, length=None) == ((ids,), {})
    assert pad_length(str(tmp_path)) is None  # no file
    for text, length in (("", None), ("0", None), ("2k", None), ("1024\n", 1024)):
        (tmp_path / "pad_seq_len.txt").write_text(text)
        assert pad_length(str(tmp_path)) == length


def test_the_profiles_score_count_cuts_token_ids_to_a_length_and_leaves_the_rest():
    from zerotune.probe._zerotune_probe.padding import cut_batch

    ids = torch.arange(8, dtype=torch.int64).reshape(2, 4)
    features = torch.ones(2, 4)
    args, kwargs = cut_batch((ids, features), {"labels": ids, "batch": {"input_ids": ids}}, 3)
    assert args[0].tolist() == [[0, 1, 2], [4, 5, 6]] and args[1] is features
    assert kwargs["labels"].shape == (2, 3) and kwargs["batch"]["input_ids"].shape == (2, 3)
    assert cut_batch((ids,), {}, 5)[0][0].shape == (2, 4)  # shorter already: as it is


def test_the_wrapped_forward_pads_to_the_length_its_directory_names_at_the_first_forward(tmp_path):
    probe = _Probe(str(tmp_path))
    forward = _probed_forward(lambda self, *args, **kwargs: tuple(kwargs["input_ids"].shape), probe)
    engine = types.SimpleNamespace(global_rank=1, module=None, _config=None, train_batch_size=lambda: 2,
                                   train_micro_batch_size_per_gpu=lambda: 2, gradient_accumulation_steps=lambda: 1)
    (tmp_path / "pad_seq_len.txt").write_text("96")  # written before the launch (zerotune.run.expdir.prepare)
    assert forward(engine, input_ids=torch.zeros(2, 64, dtype=torch.int64)) == (2, 96)
    (tmp_path / "pad_seq_len.txt").unlink()  # read once: later forwards keep it
    assert forward(engine, input_ids=torch.zeros(2, 80, dtype=torch.int64)) == (2, 96)
    assert probe.state(engine)["seq_len"] == 96 and not probe.failed  # the record says what the model got


def test_an_autotp_engine_writes_its_degree_and_a_plain_one_none(tmp_path):
    probe = _Probe(str(tmp_path))
    probe.first_forward = time.monotonic()
    for rank, autotp in ((0, lambda: 2), (1, lambda: 1)):
        engine = types.SimpleNamespace(global_rank=rank, train_batch_size=lambda: 8, autotp_size=autotp)
        probe.record(engine, probe.state(engine))
    engine = types.SimpleNamespace(global_rank=2, train_batch_size=lambda: 8)  # a DeepSpeed without AutoTP
    probe.record(engine, probe.state(engine))
    lines = [json.loads((tmp_path / f"probe.rank{r}.jsonl").read_text()) for r in (0, 1, 2)]
    assert [ln.get("autotp_size") for ln in lines] == [2, None, None]
