"""The one config builder: every experiment's ds_config and name, profile, mbs phase and knob phase alike.

Each config is the user's ds_config (a key holding a list of candidates takes its first candidate
until the knob phase tunes it; the ``autotuning`` section is dropped) at a ZeRO stage and micro
batch size, with the user's gradient accumulation steps and ``train_batch_size = mbs * gas * DP
world size``, deep-merged with the phase's own settings (the profile's small buckets, a knob
candidate's values), pruned of the settings its stage does not read, and validated before it can
run. Its name is the canonical name of its content (``z1_gas1_tmbspg8``, plus knob acronyms), so
the same config always has the same name, whichever phase asks for it, and runs once.
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from zerotune.core.experiment import Experiment, ExperimentKind
from zerotune.deepspeed.canonical import ACRONYMS, canonical_name
from zerotune.deepspeed.keys import GAS, MBS, TBS, ZERO, is_list_valued
from zerotune.deepspeed.validate import prune, validate
from zerotune.strategy.job import Job
from zerotune.strategy.space import Candidate, default_space, generate, merge

PROFILE_BUCKET_SIZE = 10_000_000
"""Elements per reduce/prefetch bucket and live parameters in the profile run (40 MB in fp32): small,
so that the profile fits wherever any stage could, as DeepSpeed's own autotuner profiles with its
minimum-memory config."""

PROFILE_STAGE = 3


class ConfigBuilder:
    """Builds and names the experiments of one :class:`Job`.

    Raises (every method):
        ConfigError: the config the user's settings give at that stage and mbs is invalid
            (:func:`zerotune.deepspeed.validate.validate`, naming the key).
    """

    def __init__(self, job: Job):
        self.job = job
        base = first_candidates(job.user_config)
        base.pop("autotuning", None)
        self._base = base
        # the user's lists of candidates at keys without an acronym vary within the job: they are
        # not written into names, so configs that set them carry a hash in their name
        self._extra_keys = tuple(k for k in _candidate_keys(job.user_config) if k not in ACRONYMS)

    def config(self, stage: int, mbs: int, settings: dict[str, Any] | None = None,
               gas: int | None = None) -> dict[str, Any]:
        """The user's config at ``stage``, ``mbs`` and ``gas`` (default: the batch semantics' gas at
        that mbs) with ``settings`` deep-merged over it, pruned and validated."""
        cfg = merge(self._base, settings or {})
        if not isinstance(cfg.get(ZERO, {}), dict):
            cfg[ZERO] = {}
        cfg.setdefault(ZERO, {})["stage"] = stage
        cfg[MBS] = mbs
        cfg[GAS] = gas = gas or self.job.batch.gas_for(mbs)
        cfg[TBS] = mbs * gas * self.job.dp_world_size
        cfg = prune(cfg)
        validate(cfg, self.job.dp_world_size)
        return cfg

    def name(self, ds_config: dict[str, Any]) -> str:
        """The canonical name of a config of this job (see :func:`zerotune.deepspeed.canonical.canonical_name`)."""
        return canonical_name(ds_config, self._extra_keys)

    def experiment(self, ds_config: dict[str, Any], kind: ExperimentKind,
                   knobs: dict[str, Any] | None = None) -> Experiment:
        """An experiment on every selected node for ``ds_config``, named from its content; its
        tuning space (for the summary) is ``z<stage>``, ``z<stage>_gas``, ``z<stage>_knobs`` or ``profile``."""
        stage = ds_config[ZERO]["stage"]
        name, space = self.name(ds_config), f"z{stage}"
        if kind is ExperimentKind.PROFILE:
            name, space = f"profile_{name}", "profile"
        elif kind is not ExperimentKind.MBS:
            space = f"z{stage}_{kind.value}"
        return Experiment(name=name, ds_config=ds_config, num_nodes=self.job.num_nodes,
                          num_slots=self.job.slots_per_node, kind=kind, space=space, knobs=dict(knobs or {}))

    def profile(self) -> Experiment:
        """The profile run: ZeRO stage 3 at the smallest mbs with small buckets; DeepSpeed's engine
        writes ``model_info.json`` and exits in the first forward (``autotuning.model_info.profile``)."""
        small = {"reduce_bucket_size": PROFILE_BUCKET_SIZE, "stage3_prefetch_bucket_size": PROFILE_BUCKET_SIZE,
                 "stage3_max_live_parameters": PROFILE_BUCKET_SIZE}
        cfg = self.config(PROFILE_STAGE, self.job.min_mbs, {ZERO: small})
        exp = self.experiment(cfg, ExperimentKind.PROFILE)
        exp.ds_config["autotuning"] = {"model_info": {"profile": True}}
        return exp

    def mbs_experiment(self, stage: int, mbs: int, gas: int | None = None) -> Experiment:
        """The mbs phase's experiment (the gas phase's with ``gas``): the user's config at ``stage``
        and ``mbs``."""
        return self.experiment(self.config(stage, mbs, gas=gas), ExperimentKind.GAS if gas else ExperimentKind.MBS)

    def knob_space(self, stage: int, mbs: int, fits: Callable[[dict], bool] | None = None,
                   gas: int | None = None) -> list[Candidate]:
        """The knob phase's candidates for ``stage`` at ``mbs`` and ``gas``: zerotune's default space for the
        stage (:func:`zerotune.strategy.space.default_space`) with the user's own settings, and the
        user's lists of candidates, over it; named as :meth:`name` names them.

        Args:
            fits: the memory model's predicate; a candidate it rejects keeps ``fits=False``.
        """
        user = {k: v for k, v in self.job.user_config.items() if k not in ("autotuning", MBS, GAS, TBS)}
        user_zero = {k: v for k, v in (user.get(ZERO) or {}).items() if k != "stage"}
        space = default_space(stage)
        space[ZERO].update(user_zero)
        space.update({k: v for k, v in user.items() if k != ZERO})
        candidates = generate(self.config(stage, mbs, gas=gas), space, stage=stage, dp_world_size=self.job.dp_world_size,
                              fits=fits)
        return [dataclasses.replace(c, name=self.name(c.ds_config)) for c in candidates]


def first_candidates(config: Any, path: str = "") -> Any:
    """A copy of ``config`` where each list of candidates (a tuning-space key) is its first candidate.

    Lists that are DeepSpeed settings themselves (``optimizer.params.betas``...) are kept.
    """
    if isinstance(config, dict):
        return {k: first_candidates(v, f"{path}.{k}" if path else k) for k, v in config.items()}
    if isinstance(config, list) and config and not is_list_valued(path):
        return copy.deepcopy(config[0])
    return copy.deepcopy(config)


def _candidate_keys(config: Any, path: str = "") -> list[str]:
    """Dotted keys of ``config`` that hold a list of candidates (``autotuning`` and the stage aside)."""
    if isinstance(config, dict):
        return [k for key, v in config.items() if (path or key != "autotuning")
                for k in _candidate_keys(v, f"{path}.{key}" if path else key)]
    if isinstance(config, list) and not is_list_valued(path) and path not in (f"{ZERO}.stage", MBS, GAS):
        return [path]
    return []
