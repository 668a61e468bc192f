"""Batch semantics: how mbs, gradient accumulation steps (gas) and train_batch_size relate in a job (D7, D13, D17).

Under ``train_batch_size = mbs * gas * DP world size``, a numeric ``train_batch_size`` is the recipe, held fixed (mbs
divides ``train_batch_size / DP``, gas follows). Otherwise gas is searched at the best mbs
(`zerotune.strategy.gas_phase`): the user's list of gas values (``[1]`` holds gas), or else the best mbs's batch split
in two (`BatchSemantics.gas_split`), then gas doubled while samples/s improves by the plateau threshold (1%), within
``autotuning.max_train_batch_size`` or `MAX_GAS_DOUBLINGS` doublings, and only where a doubling could pay
(`doubling_gain_bound`). A list of mbs values restricts the mbs search to them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.keys import GAS, MBS, TBS

MAX_GAS_DOUBLINGS = 1
"""Without ``autotuning.max_train_batch_size``, gas doubles at most this many times (2x the user's gas)."""


@dataclass(frozen=True)
class BatchSemantics:
    """The batch rules of one job (build with `from_config`).

    Attributes:
        fixed_train_batch_size: the user's numeric ``train_batch_size`` (held fixed), or None.
        gas: gas of the micro-batch search when the global batch is not fixed.
        mbs_values: the mbs values allowed (None: every integer within the job's bounds).
        gas_values: the user's gas values to try at the best mbs, in order (``gas`` left out).
        gas_doubling: gas doubles at the best mbs (stop at a plateau), the global batch being free.
        max_train_batch_size: ``autotuning.max_train_batch_size``, bounding the doubling (None: `MAX_GAS_DOUBLINGS`).
    """

    dp_world_size: int
    fixed_train_batch_size: int | None = None
    gas: int = 1
    mbs_values: tuple[int, ...] | None = None
    gas_values: tuple[int, ...] = ()
    gas_doubling: bool = False
    max_train_batch_size: int | None = None

    @classmethod
    def from_config(cls, user: dict[str, Any], dp_world_size: int, max_train_batch_size: int | None,
                    source: str, search_gas: bool = True) -> "BatchSemantics":
        """The semantics the user's ds_config asks for; ``search_gas`` False keeps a single gas unless
        ``max_train_batch_size`` bounds the global batch on purpose (a Trainer script whose gas is not mapped raises on
        any other value).

        Raises:
            ConfigError: a batch key that is not a positive integer (or a list of them, or ``"auto"`` for
                ``train_batch_size``), or a ``train_batch_size`` that DP does not divide.
        """
        mbs = user.get(MBS)
        mbs = _values(mbs, MBS, source) if isinstance(mbs, list) else None  # a single value is only a start
        gas = _values(1 if user.get(GAS) is None else user[GAS], GAS, source)  # null: unset, as DeepSpeed reads it
        tbs = user.get(TBS)
        if tbs is not None and tbs != "auto":
            (tbs,) = _values(tbs, TBS, source, single=True)
            if tbs % dp_world_size:
                raise ConfigError(f"{source}: '{TBS}' = {tbs}: not divisible by the DP world size {dp_world_size}")
            return cls(dp_world_size, fixed_train_batch_size=tbs, mbs_values=mbs)
        if isinstance(user.get(GAS), list):  # exactly these gas values ([1]: gas stays 1)
            return cls(dp_world_size, gas=gas[0], mbs_values=mbs, gas_values=tuple(gas[1:]),
                       max_train_batch_size=max_train_batch_size)
        return cls(dp_world_size, gas=gas[0], mbs_values=mbs,
                   gas_doubling=search_gas or max_train_batch_size is not None,
                   max_train_batch_size=max_train_batch_size)

    def allowed_mbs(self, lo: int, hi: int) -> tuple[int, ...] | None:
        """The mbs values the search may try within ``lo..hi`` (None: all of them)."""
        values = self.mbs_values
        if self.fixed_train_batch_size is not None:
            per_rank = self.fixed_train_batch_size // self.dp_world_size
            divisors = [m for m in range(1, per_rank + 1) if per_rank % m == 0]
            values = tuple(m for m in divisors if values is None or m in values)
        return None if values is None else tuple(m for m in values if lo <= m <= hi)

    def gas_for(self, mbs: int) -> int:
        """Gas of the micro-batch search at ``mbs``."""
        if self.fixed_train_batch_size is not None:
            return self.fixed_train_batch_size // (self.dp_world_size * mbs)
        return self.gas

    def max_mbs(self, hi: int) -> int:
        """The largest mbs the train batch bounds allow (at most ``hi``)."""
        if self.fixed_train_batch_size is not None:
            return min(hi, self.fixed_train_batch_size // self.dp_world_size)
        if self.max_train_batch_size is not None:
            return min(hi, self.max_train_batch_size // (self.gas * self.dp_world_size))
        return hi

    def gas_ladder(self, mbs: int) -> list[int]:
        """Gas values to try at ``mbs`` after the micro-batch search (see `gas_values`)."""
        if self.fixed_train_batch_size is not None:
            return []
        if not self.gas_doubling:
            return list(self.gas_values)
        ladder, gas = [], self.gas * 2
        limit = self.max_train_batch_size or mbs * self.gas * self.dp_world_size * 2 ** MAX_GAS_DOUBLINGS
        while mbs * gas * self.dp_world_size <= limit:
            ladder.append(gas)
            gas *= 2
        return ladder

    def gas_split(self, mbs: int, lo: int = 1) -> tuple[int, int] | None:
        """``(mbs // 2, 2 * gas)``: the global batch of ``mbs`` run as two micro-batches of half the size (one sample
        per rank less where ``mbs`` is odd), tried before the doubling as a smaller micro-batch can be faster per
        sample; None where gas is not doubled, or half of ``mbs`` is below ``lo`` or not in the config's mbs values."""
        half = mbs // 2
        if not self.gas_doubling or half < max(1, lo) or (self.mbs_values is not None and half not in self.mbs_values):
            return None
        return half, self.gas * 2

    def describe(self) -> str:
        """One line for the summary: which semantics applied."""
        if self.fixed_train_batch_size is not None:
            return (f"batch: train_batch_size fixed at {self.fixed_train_batch_size} (mbs x gas x DP "
                    f"{self.dp_world_size}); gas follows mbs")
        line = f"batch: gas {self.gas}, train_batch_size = mbs x {self.gas} x DP {self.dp_world_size}"
        if self.gas_values:
            line += f"; gas {list(self.gas_values)} tried at the best mbs (the config's list)"
        elif self.gas_doubling:
            line += ("; the best mbs's global batch split in two (mbs / 2, gas x 2); gas doubled at the best mbs "
                     "while throughput improves, "
                     + (f"within train_batch_size <= {self.max_train_batch_size}" if self.max_train_batch_size
                        else f"at most {2 ** MAX_GAS_DOUBLINGS}x (autotuning.max_train_batch_size bounds it)"))
        if self.mbs_values is not None:
            line += f"; mbs from the config's list {list(self.mbs_values)}"
        return line


def doubling_gain_bound(boundary_share: float | None, ds_config: dict[str, Any]) -> float | None:
    """The most that doubling gas can gain in samples/s, relative (0.01 = 1%), for a run of ``ds_config`` whose step
    spends the share ``boundary_share`` (0..1, `zerotune.core.measure.Measurement.boundary_share`) in work done once
    per optimizer step (D17).

    With ``T = g F + B`` s per step at gas ``g`` (``F`` per micro-step; ``B`` once per step, the boundary's gradient
    reduction and optimizer step in ``engine.py``; ZeRO-2 and 3 reduce every micro-step), the gain is
    ``B / (2 T - B) = s / (2 - s)`` with ``s = B / T``, an upper bound as nothing else changes with gas. None where the
    share misses amortized work: none measured, or ZeRO-1 with ``overlap_comm`` (its reduction runs in gradient hooks,
    ``zero/stage_1_and_2.py``, which the probe does not time).
    """
    if boundary_share is None:
        return None
    zero = ds_config.get("zero_optimization") or {}
    stage = int(zero.get("stage", 0) or 0)
    overlap = zero.get("overlap_comm")
    overlap = stage == 3 if overlap is None else bool(overlap)  # DeepSpeed's default (zero/config.py)
    if stage == 1 and overlap:
        return None
    share = min(max(boundary_share, 0.0), 1.0)
    return share / (2 - share)


def _values(value: Any, key: str, source: str, single: bool = False) -> list[int] | None:
    """A positive int, or (unless ``single``) a non-empty list of them, as a sorted list; None stays None."""
    if value is None:
        return None
    items = value if isinstance(value, list) and not single else [value]
    if not items or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in items):
        expected = "a positive integer" if single else "a positive integer or a list of them"
        raise ConfigError(f"{source}: '{key}' = {value!r}: expected {expected}")
    return sorted(set(items)) if key != GAS else list(dict.fromkeys(items))
