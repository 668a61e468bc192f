"""What a batch held: the samples and the sequence length of the tensors the engine's forward receives (D308).

Only shapes are read (host metadata: no data read, no device synchronisation), so noting them changes nothing
measured; `_batch_shape` says which tensors count. `_note_batch` keeps per engine the largest of each over an
optimizer step's forwards, which its record writes as ``batch_samples`` and ``seq_len``, and their product summed over
the forwards, ``tokens`` (`.records._Probe.record`).
"""
import sys
from collections.abc import Mapping
from itertools import islice

from .peak import _DataPeak

SCANNED = 32  # values looked at per argument list and per container: a forward's cost stays a few attribute reads


def _batch_shape(args: tuple, kwargs: dict) -> tuple:
    """``(samples, seq_len)`` of one forward's arguments (`_tensors`); each None where no tensor says it, both before
    torch is imported. samples: the leading dimension of the first tensor with one; seq_len: the largest second
    dimension of the integer-dtype tensors of two or more dimensions (token ids; None for images, float features)."""
    torch = sys.modules.get("torch")
    if torch is None:
        return None, None
    samples = seq_len = None
    for tensor in _tensors(torch.Tensor, args, kwargs):
        shape = tensor.shape
        if samples is None and len(shape) >= 1 and shape[0] >= 1:
            samples = int(shape[0])
        if len(shape) >= 2 and shape[1] >= 1 and _integer(torch, tensor.dtype):
            seq_len = max(seq_len or 0, int(shape[1]))
    return samples, seq_len


def _tensors(tensor_type: type, args: tuple, kwargs: dict):
    """The tensors among the arguments and one level into the mappings, lists and tuples among them (a Hugging Face
    batch is a dict of tensors), at most `SCANNED` of each."""
    for value in (*islice(args, SCANNED), *islice(kwargs.values(), SCANNED)):
        if isinstance(value, tensor_type):
            yield value
        elif isinstance(value, (list, tuple, Mapping)):
            items = value.values() if isinstance(value, Mapping) else value
            yield from (v for v in islice(items, SCANNED) if isinstance(v, tensor_type))


def _integer(torch, dtype) -> bool:
    """Whether ``dtype`` holds integers (token ids): neither floating point, complex nor bool."""
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _note_batch(probe, engine, args: tuple, kwargs: dict) -> None:
    """Before ``engine``'s forward: keep its optimizer step's largest samples and sequence length so far and add
    their product to its tokens (a forward without either makes the step's tokens unknown for good); on a CPU
    rank a sequence longer than any before restarts the ``VmData`` sampler (`.peak._DataPeak.note_seq_len`). Call it
    once the first forward's time is set. Never raises."""
    if probe.failed:
        return
    try:
        samples, seq_len = _batch_shape(args, kwargs)
        if seq_len is not None and _DataPeak.running is not None:
            _DataPeak.running.note_seq_len(seq_len)
        state = probe.state(engine)
        for key, value in (("batch_samples", samples), ("seq_len", seq_len)):
            if value is not None and (state[key] is None or value > state[key]):
                state[key] = value
        known = samples is not None and seq_len is not None and state.get("tokens") != -1
        state["tokens"] = (state.get("tokens") or 0) + samples * seq_len if known else -1
    except Exception:  # noqa: BLE001 - the probe never breaks training; the step records what it saw, or None
        return
