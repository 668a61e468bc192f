"""Partial optimizer offload (``offload_optimizer.ratio``, ZeRO-3): where the best config offloads the whole optimizer
to the host, the largest share of its sub-groups that the memory model fits back on the device at the best mbs,
probed there (D337). DeepSpeed offloads whole sub-groups (``int((1 - ratio) * G)`` of G stay, `ZeroOptions`), so
the candidates are the G - 1 partial shares, from the most kept down; the first that fits is launched, and kept only
where it beats the full offload at the same mbs (the share one sub-group larger did not fit)."""
from __future__ import annotations

from typing import Callable

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.keys import ZERO
from zerotune.inputs.space import merge
from zerotune.strategy.evaluation import Evaluator
from zerotune.strategy.result import Saver
from zerotune.strategy.variants import Best

__all__ = ["offload_ratio", "partial_offload"]


def offload_ratio(kept: int, groups: int) -> float:
    """The ``offload_optimizer.ratio`` that keeps ``kept`` of ``groups`` sub-groups on the device: DeepSpeed keeps
    ``int((1 - ratio) * groups)``, so the ratio is taken half a sub-group below ``kept`` (rounded to 4 places)."""
    return round(1 - (kept + 0.5) / groups, 4)


def partial_offload(ev: Evaluator, best: Best | None, hi: int, at_best: Callable[[int, Saver, str], bool]) -> bool:
    """Try the largest partial offload that fits the best mbs (at most ``hi``) where the best is ZeRO-3 with the
    optimizer (not the parameters) offloaded to the host, by a saver or by the user's config, through ``at_best``
    (`zerotune.strategy.savers.SaverPhase.at_best`); True when it became the best. Says in the savers notes why none
    was tried where the best offloads but a ratio cannot help (one sub-group a rank, or no share fits)."""
    if best is None or best.result.stage != 3:
        return False
    saver, mbs, budget, memory = best.result.saver, best.point.mbs, ev.job.device_memory_bytes, ev.result.memory
    own = saver.settings if saver is not None else {}
    try:
        config = ev.builder.config(3, mbs, own)
    except ConfigError:
        return False
    zero = config.get(ZERO, {})
    offload = zero.get("offload_optimizer") or {}
    if offload.get("device") != "cpu" or "ratio" in offload or (zero.get("offload_param") or {}).get("device") in (
            "cpu", "nvme"):
        return False
    groups = memory.prior.sub_groups(config)
    for kept in range(groups - 1, 0, -1):
        ratio = offload_ratio(kept, groups)
        settings = merge(own, {ZERO: {"offload_optimizer": {"device": "cpu", "ratio": ratio}}})
        if memory.max_mbs(ev.builder.config(3, mbs, settings), budget, cap=hi) >= mbs:
            name = f"{saver.name if saver is not None else 'offload optimizer'} ratio {ratio}"
            lead = (f"the best offloads the whole optimizer; {kept} of its {groups} sub-groups a rank kept on the "
                    f"device fit mbs={{mbs}} (memory model: largest mbs {{est}}): probed there; ")
            return at_best(3, Saver(name, settings), lead)
    why = ("one optimizer sub-group a rank (zero_optimization.sub_group_size holds its whole partition): a ratio "
           "offloads all of it or none" if groups < 2 else
           f"no share of its {groups} sub-groups a rank kept on the device fits mbs={mbs} by the memory model")
    ev.result.savers_notes.append(f"offload_optimizer.ratio: not tried on {best.result.label}: {why}")
    return False
