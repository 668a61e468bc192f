"""The longest batch on demand (``--verify-longest``, D309): every micro batch's token ids padded to one sequence
length before the engine's forward, so that one run measures the peak of the longest batch the training can meet.

- `PAD_FILE` in the probe's directory (the experiment's, on every backend and node) holds the length in tokens,
  read at the process's first forward (`pad_length`); no file, or not a number: nothing is padded.
- Only integer token-id tensors of shape ``[samples, tokens]`` are padded (`pad_batch`); a script whose batch is not
  (images, float features, packed or pre-embedded sequences) measures its own batches' peak.
- `cut_batch` does the reverse for the profile's count of attention scores (`.activations`).
"""
import os
import sys
from collections.abc import Mapping

PAD_FILE = "pad_seq_len.txt"
LABEL_PAD = -100
LABEL_KEYS = ("labels", "label", "lm_labels")


def pad_length(directory: str):
    """The positive whole number `PAD_FILE` in ``directory`` holds, else None. Read at the first forward, not at import:
    a warm rank imports the probe before its run's directory is known."""
    try:
        with open(os.path.join(directory, PAD_FILE)) as f:
            text = f.read(32).strip()
    except OSError:
        return None
    return int(text) if text.isdigit() and int(text) > 0 else None


def pad_batch(args: tuple, kwargs: dict, length) -> tuple:
    """``(args, kwargs)`` with their token-id tensors padded to ``length`` tokens; the same objects where ``length`` is
    None, torch is not imported, or nothing is shorter.

    It looks where `.batch` looks and pads at the end the integer-dtype tensors of exactly two dimensions shorter than
    ``length``: ``labels`` with -100 (which torch's and Hugging Face's cross-entropy ignore), the others
    (``input_ids``, ``attention_mask``...) with 0 (a pad token's attention mask is 0, so its id is never read)."""
    torch = sys.modules.get("torch")
    if length is None or torch is None:
        return args, kwargs
    pad = _Pad(torch, length)
    return tuple(pad.value(v, None) for v in args), {k: pad.value(v, k) for k, v in kwargs.items()}


def cut_batch(args: tuple, kwargs: dict, length: int) -> tuple:
    """``(args, kwargs)`` with the tensors `pad_batch` pads cut to their first ``length`` tokens (torch imported)."""
    cut = _Pad(sys.modules["torch"], length, cut=True)
    return tuple(cut.value(v, None) for v in args), {k: cut.value(v, k) for k, v in kwargs.items()}


class _Pad:
    def __init__(self, torch, length: int, cut: bool = False):
        self.torch, self.length, self.cut = torch, length, cut

    def value(self, value, key, depth: int = 0):
        """``value`` padded where it is a token-id tensor, or a container of them one level down."""
        if isinstance(value, self.torch.Tensor):
            return self.tensor(value, key)
        if depth == 0 and isinstance(value, Mapping):
            return {k: self.value(v, k, 1) for k, v in value.items()}
        if depth == 0 and isinstance(value, (list, tuple)):
            return type(value)(self.value(v, None, 1) for v in value)
        return value

    def tensor(self, t, key):
        dtype = t.dtype
        if t.dim() != 2 or dtype.is_floating_point or dtype.is_complex or dtype == self.torch.bool:
            return t
        if self.cut:
            return t[:, :self.length]
        if t.shape[1] >= self.length:
            return t
        fill = LABEL_PAD if key in LABEL_KEYS else 0
        return self.torch.nn.functional.pad(t, (0, self.length - t.shape[1]), value=fill)
