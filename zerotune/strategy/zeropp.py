"""ZeRO++'s hierarchical partition (hpZ, ``zero_hpz_partition_size``) on a multi-node ZeRO-3 best (D338): each node's
ranks keep a secondary partition of the parameters (memory the model prices, ``2Ψ/h``) so that the backward's
all-gathers stay inside the node; where inter-node links bind, that wins. It is probed once at the best mbs after the
savers, with h = the ranks a node runs, and kept where it beats the best. Its quantized collectives (qwZ, qgZ) are
knobs of the knob phase on CUDA (`zerotune.inputs.default_spaces`)."""
from __future__ import annotations

from typing import Callable

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.keys import ZERO
from zerotune.inputs.space import merge
from zerotune.strategy.evaluation import Evaluator
from zerotune.strategy.result import Saver
from zerotune.strategy.variants import Best

__all__ = ["HPZ", "hierarchical_partition"]

HPZ = "zero_hpz_partition_size"


def hierarchical_partition(ev: Evaluator, best: Best | None, at_best: Callable[[int, Saver, str], bool]) -> bool:
    """Probe hpZ over a node's ranks on the best config, through ``at_best``
    (`zerotune.strategy.savers.SaverPhase.at_best`), where the job runs on several nodes with several ranks each and
    the best is ZeRO-3 without hpZ; True when it became the best."""
    job = ev.job
    if best is None or best.result.stage != 3 or job.num_nodes < 2 or job.slots_per_node < 2:
        return False
    saver, h = best.result.saver, job.slots_per_node
    own = saver.settings if saver is not None else {}
    try:
        zero = ev.builder.config(3, best.point.mbs, own).get(ZERO, {})
    except ConfigError:
        return False
    if int(zero.get(HPZ) or 1) > 1:
        return False
    name = f"{saver.name} + hpZ {h}" if saver is not None else f"hpZ {h}"
    lead = (f"ZeRO-3 over {job.num_nodes} nodes: a secondary partition over a node's {h} ranks keeps the backward's "
            f"all-gathers inside the node; probed at the best mbs={{mbs}} (memory model: largest mbs {{est}}); ")
    return at_best(3, Saver(name, merge(own, {ZERO: {HPZ: h}})), lead)
