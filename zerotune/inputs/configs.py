"""The one config builder: every experiment's ds_config and name, profile, mbs phase and knob phase alike.

Each config (`ConfigBuilder.config`) is the user's ds_config (a list of candidates takes its first until the knob
phase tunes it; ``autotuning`` dropped) at a ZeRO stage and mbs, with the batch semantics' gas and
``train_batch_size = mbs * gas * DP world size`` (over a Ulysses degree: `ConfigBuilder.batch`), the phase's settings
deep-merged over it, pruned and validated. Its name is the canonical name of its content, so the same config has the
same name whichever phase asks, and runs once.
A Trainer config's ``"auto"`` values are resolved as `zerotune.deepspeed.auto` says (the hidden-size ones from the
profile run, `ConfigBuilder.model_autos`).
"""
from __future__ import annotations

import copy
import dataclasses
from typing import Any, Callable

from zerotune.core.errors import ConfigError
from zerotune.core.experiment import Experiment, ExperimentKind
from zerotune.deepspeed.auto import (
    ENGINE_RECORD,
    MODEL_AUTO_KEYS,
    auto_paths,
    hidden_size_autos,
    read_engine_record,
    resolve,
)
from zerotune.deepspeed.canonical import ACRONYMS, canonical_name
from zerotune.deepspeed.keys import GAS, MBS, TBS, ZERO, ZERO_DEFAULTS, candidate_lists, is_list_valued
from zerotune.deepspeed.validate import prune, validate
from zerotune.inputs.batch import BatchSemantics
from zerotune.inputs.job import Job
from zerotune.inputs.space import Candidate, default_space, generate, merge
from zerotune.inputs.variables import first_values, placeholder_paths, substitute
from zerotune.model.zero_options import ZeroOptions

PROFILE_BUCKET_SIZE = 10_000_000
"""Elements per reduce/prefetch bucket and live parameters in the profile run (40 MB in fp32): small,
so that the profile fits wherever any stage could, as DeepSpeed's own autotuner profiles with its
minimum-memory config."""

PROFILE_STAGE = 3
"""The profile run's ZeRO stage where the job tunes it (`ConfigBuilder.profile_stage`)."""


class ConfigBuilder:
    """Builds and names the experiments of one `Job`.

    Raises (every method):
        ConfigError: the config at that stage and mbs is invalid (`zerotune.deepspeed.validate.validate`).
    """

    def __init__(self, job: Job):
        self.job = job
        # a Trainer script's "auto" values: those its arguments give now, the model's after the profile
        # $VAR placeholders: the knob phase expands the template, every other config takes the first candidates
        self._template = resolve(job.user_config, job.script_autos)
        self._user = substitute(self._template, first_values(job.variables))
        self._model_auto_keys = [p for p in auto_paths(self._user) if p in MODEL_AUTO_KEYS]
        self._model_autos: dict[str, int] | None = None if self._model_auto_keys else {}
        base = first_candidates(self._user)
        base.pop("autotuning", None)
        self._base = base
        # the Trainer fills the batch from its arguments: DeepSpeed derives train_batch_size (mbs x gas x
        # DP) unless the user fixed it (see zerotune.deepspeed.auto: the Trainer's own sum is wrong on CPU)
        tbs = job.user_config.get(TBS)
        self._derive_tbs = MBS in job.arg_mappings and (isinstance(tbs, bool) or not isinstance(tbs, int))
        # the user's lists of candidates at keys without an acronym vary within the job: they are
        # not written into names, so configs that set them carry a hash in their name
        varying = [p for name, paths in placeholder_paths(job.user_config).items()
                   if len(job.variables.get(name, ())) > 1 for p in paths]
        self._extra_keys = tuple(dict.fromkeys(k for k in [*(k for k, _ in candidate_lists(job.user_config)), *varying]
                                               if k not in ACRONYMS))

    def config(self, stage: int, mbs: int, settings: dict[str, Any] | None = None,
               gas: int | None = None) -> dict[str, Any]:
        """The user's config at ``stage``, ``mbs`` and ``gas`` (default: the batch semantics' gas at that mbs) with
        ``settings`` deep-merged over it, pruned and validated, every ``"auto"`` zerotune reads resolved."""
        return self._build(resolve(self._base, self.model_autos()), stage, mbs, settings, gas)

    def _build(self, base: dict[str, Any], stage: int, mbs: int, settings: dict[str, Any] | None,
               gas: int | None) -> dict[str, Any]:
        cfg = merge(base, settings or {})
        if not isinstance(cfg.get(ZERO, {}), dict):
            cfg[ZERO] = {}
        cfg.setdefault(ZERO, {})["stage"] = stage
        batch = self.batch(cfg)
        cfg[MBS] = mbs
        cfg[GAS] = gas = gas or batch.gas_for(mbs)
        cfg[TBS] = mbs * gas * batch.dp_world_size
        if self._derive_tbs:
            del cfg[TBS]
        cfg = prune(cfg)
        validate(cfg, batch.dp_world_size)
        return cfg

    def batch(self, ds_config: dict[str, Any]) -> BatchSemantics:
        """The job's batch semantics for ``ds_config``: a Ulysses degree other than the user's counts its ranks as one
        replica in ``train_batch_size`` (DP world size / ``sequence_parallel_size``, D331)."""
        sp = ZeroOptions.of(ds_config).sp
        dp = self.job.dp_world_size // sp
        return self.job.batch if dp == self.job.batch.dp_world_size else dataclasses.replace(self.job.batch,
                                                                                            dp_world_size=dp)

    def model_autos(self) -> dict[str, int]:
        """The values of the user's hidden-size ``"auto"`` keys (`MODEL_AUTO_KEYS`) from the hidden size the profile
        run recorded (read once; empty when the config has none).

        Raises:
            ConfigError: naming the keys, where no profile run left a record or the model has no hidden size.
        """
        if self._model_autos is None:
            exp_dir = self.job.exps_dir / self.profile().name
            record = read_engine_record(exp_dir)
            hidden = record.get("hidden_size") if record else None
            if not isinstance(hidden, int) or hidden < 1:
                why = (f"the model has no hidden size ({exp_dir / ENGINE_RECORD})" if record else
                       f"no profile run has recorded it ({exp_dir / ENGINE_RECORD} is missing)")
                raise ConfigError(f"{self.job.config_path}: {', '.join(self._model_auto_keys)} = \"auto\": the Trainer "
                                  f"fills it from the model's hidden size, and {why}; run 'zerotune tune' (its "
                                  f"profile run records it) or give a number")
            self._model_autos = hidden_size_autos(hidden)
        return self._model_autos

    def name(self, ds_config: dict[str, Any]) -> str:
        """The canonical name of a config of this job (see `zerotune.deepspeed.canonical.canonical_name`)."""
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

    def profile_stage(self) -> int:
        """The profile run's ZeRO stage: `PROFILE_STAGE` (the least memory, as DeepSpeed's autotuner profiles) when the
        job tunes it, else the highest it tunes; a stage the job excludes is never launched (DeepSpeed may refuse the
        user's config there)."""
        return PROFILE_STAGE if PROFILE_STAGE in self.job.stages else max(self.job.stages)

    def profile(self) -> Experiment:
        """The profile run: `profile_stage` at the smallest mbs with small buckets, at the largest listed Ulysses degree
        (the least activation memory; a script that does not take Ulysses fails here, `zerotune.run.expdir`);
        DeepSpeed's engine writes ``model_info.json`` and exits in the first forward
        (``autotuning.model_info.profile``)."""
        small = {"reduce_bucket_size": PROFILE_BUCKET_SIZE, "stage3_prefetch_bucket_size": PROFILE_BUCKET_SIZE,
                 "stage3_max_live_parameters": PROFILE_BUCKET_SIZE}
        stage = self.profile_stage()
        # the model's "auto" values are not known yet (this run records them): small buckets, and
        # DeepSpeed's default persistence threshold
        before = {key: ZERO_DEFAULTS[stage][key.split(".")[-1]] for key in MODEL_AUTO_KEYS}
        ulysses = {"sequence_parallel_size": self.job.sp_degrees[-1]} if self.job.sp_degrees else {}
        cfg = self._build(resolve(self._base, before), stage, self.job.min_mbs, {ZERO: small, **ulysses}, None)
        exp = self.experiment(cfg, ExperimentKind.PROFILE)
        exp.ds_config["autotuning"] = {"model_info": {"profile": True}}
        return exp

    def mbs_experiment(self, stage: int, mbs: int, gas: int | None = None,
                       settings: dict[str, Any] | None = None) -> Experiment:
        """The mbs phase's experiment (the gas phase's with ``gas``): the user's config at ``stage``
        and ``mbs``, with ``settings`` (a memory saver's, `zerotune.strategy.savers`) merged over it."""
        return self.experiment(self.config(stage, mbs, settings, gas=gas),
                               ExperimentKind.GAS if gas else ExperimentKind.MBS)

    def knob_space(self, stage: int, mbs: int, fits: Callable[[dict], bool] | None = None,
                   gas: int | None = None, settings: dict[str, Any] | None = None) -> list[Candidate]:
        """The knob phase's candidates for ``stage`` at ``mbs`` and ``gas``, named by `name`: zerotune's default space
        for the stage with the user's settings, lists of candidates and ``$VAR`` variables over it. A candidate
        ``fits`` (the memory model's predicate) rejects keeps ``fits=False``; ``settings`` (a memory saver's) are
        merged over the base config, never named by the space."""
        resolved = resolve(self._template, self.model_autos())
        user = {k: v for k, v in resolved.items() if k not in ("autotuning", MBS, GAS, TBS)}
        user_zero = {k: v for k, v in (user.get(ZERO) or {}).items() if k != "stage"}
        space = default_space(stage, zeropp=self.job.num_nodes > 1 and not self.job.cpu)
        space[ZERO].update(user_zero)
        space.update({k: v for k, v in user.items() if k != ZERO})
        base = self.config(stage, mbs, settings, gas=gas)
        candidates = generate(base, space, stage=stage, dp_world_size=self.batch(base).dp_world_size,
                              variables=self.job.variables or None, fits=fits)
        return [dataclasses.replace(c, name=self.name(c.ds_config)) for c in candidates]


def first_candidates(config: Any, path: str = "") -> Any:
    """A copy of ``config`` where each list of candidates is its first candidate; lists that are DeepSpeed settings
    themselves (``optimizer.params.betas``...) are kept."""
    if isinstance(config, dict):
        return {k: first_candidates(v, f"{path}.{k}" if path else k) for k, v in config.items()}
    if isinstance(config, list) and config and not is_list_valued(path):
        return copy.deepcopy(config[0])
    return copy.deepcopy(config)
