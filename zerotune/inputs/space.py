"""Tuning spaces: from a user's ds_config and a space of candidates to a list of experiments (pure logic).

A tuning space is shaped like a ds_config in which any value may be a list of candidates
(``{"train_micro_batch_size_per_gpu": [2, 4, 8]}``); `generate` expands it over a base config into `Candidate`s. Every
list in the space is a list of candidates, except at keys DeepSpeed expects a list
(`zerotune.deepspeed.keys.is_list_valued`), where only a list of lists is; lists in the base config are settings; a
candidate is taken whole; ``$NAME`` strings are variables (`zerotune.inputs.placeholders`). The order is deterministic:
dimensions sorted by path (``$NAME`` variables first), candidates as given, the last varying fastest.
"""
from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass, field
from typing import Any, Callable

from zerotune.core.errors import ConfigError
from zerotune.deepspeed.canonical import (
    ACRONYMS,
    canonical_json,
    canonical_name,
    config_hash,
    leaves,
    normalize,
)
from zerotune.deepspeed.keys import GAS, MBS, TBS, ZERO, is_list_valued
from zerotune.deepspeed.validate import prune, validate
from zerotune.inputs.default_spaces import default_space
from zerotune.inputs.placeholders import check_variables, collect_placeholders, replace_placeholders

__all__ = ["Candidate", "default_space", "generate", "merge"]


@dataclass(frozen=True)
class Candidate:
    """One configuration of a tuning space.

    Attributes:
        name: canonical name (`zerotune.deepspeed.canonical.canonical_name`), unique in the space.
        ds_config: the complete DeepSpeed config to run; shared, do not mutate it.
        knobs: dotted key -> value of the settings that vary between the space's configs (absent ones left out).
        fits: False where the memory model predicts it does not fit: listed (a dry run shows it), never proposed.
    """

    name: str
    ds_config: dict[str, Any] = field(compare=False, repr=False)
    knobs: dict[str, Any] = field(compare=False)
    fits: bool = True


# --------------------------------------------------------------------------------------------
# Generation


def _dimensions(space: Any, path: tuple[str, ...], out: list[tuple[tuple[str, ...], list]]) -> None:
    """Collect (path, candidates) for each list of candidates in the space."""
    if isinstance(space, dict):
        for k, v in space.items():
            _dimensions(v, path + (str(k),), out)
    elif isinstance(space, list):
        dotted = ".".join(path)
        if is_list_valued(dotted) and not (space and all(isinstance(v, list) for v in space)):
            return  # the setting itself, e.g. betas: [0.9, 0.999]
        if not space:
            raise ConfigError(f"tuning space key {dotted}: empty list, expected at least one candidate")
        out.append((path, space))


def _set(d: dict[str, Any], path: tuple[str, ...], value: Any) -> None:
    for k in path[:-1]:
        d = d.setdefault(k, {})
    d[path[-1]] = value


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """Deep merge: ``over`` replaces only the keys it names; dicts merge recursively."""
    out = copy.deepcopy(base)
    for k, v in over.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


def _names_batch(space: dict[str, Any], base: dict[str, Any]) -> tuple[bool, bool]:
    """(space sets mbs or gas, space sets train_batch_size), counting templated base values."""
    templated: dict[str, str] = {}
    collect_placeholders(base, "", templated)
    templated_paths = {p.split("[")[0] for p in templated.values()}

    def named(key: str) -> bool:
        return key in space or key in templated_paths

    return named(MBS) or named(GAS), named(TBS)


def generate(
    base_config: dict[str, Any],
    space: dict[str, Any] | None,
    *,
    stage: int,
    dp_world_size: int,
    variables: dict[str, list[Any]] | None = None,
    fits: Callable[[dict[str, Any]], bool] | None = None,
) -> list[Candidate]:
    """Expand a tuning space over a base config into candidate configs, named and validated at ``dp_world_size``,
    in the module's order.

    Each combination of the space's candidates and of ``variables`` (name, with or without ``$``, -> candidates) is
    deep-merged over ``base_config`` (the space overrides only the keys it names), set to ``stage`` (a space naming
    another stage is an error), stripped of ``autotuning``, pruned (`zerotune.deepspeed.validate.prune`) and
    deduplicated by `zerotune.deepspeed.canonical.config_hash`, which ignores DeepSpeed's defaults (the first
    occurrence keeps its place and its values as built). Where the space sets mbs or gas but not ``train_batch_size``,
    ``train_batch_size`` is removed and DeepSpeed derives it. Each is named by `canonical_name`, the varying keys
    without an acronym as ``extra_keys``; one that ``fits`` (the memory model's predicate) rejects is kept with
    ``fits=False``. A ``space`` None or {} gives the base config.

    Raises:
        ConfigError: a bad space, a placeholder without a variable or a variable without a placeholder, or a
            combination that fails `zerotune.deepspeed.validate.validate` (never a silent drop).
    """
    base, space = _without_autotuning(base_config, space, stage)
    env = check_variables(base, space, variables or {})
    return _named_candidates(_expand(base, space, env, stage), dp_world_size, fits)


def _without_autotuning(base_config: dict[str, Any], space: dict[str, Any] | None, stage: int
                        ) -> tuple[dict[str, Any], dict[str, Any]]:
    """(base, space): shallow copies without their ``autotuning`` sections, once ``stage`` is a ZeRO
    stage and the space names no other one."""
    if isinstance(stage, bool) or stage not in (0, 1, 2, 3):
        raise ConfigError(f"stage = {stage!r}: expected 0, 1, 2 or 3")
    space = dict(space or {})
    base = {k: v for k, v in base_config.items() if k != "autotuning"}
    space.pop("autotuning", None)
    space_stage = space.get(ZERO, {}).get("stage", stage) if isinstance(space.get(ZERO), dict) else stage
    if space_stage != stage:
        raise ConfigError(f"tuning space {ZERO}.stage = {space_stage!r}, but generating stage {stage}")
    return base, space


def _expand(base: dict[str, Any], space: dict[str, Any], env: dict[str, list[Any]], stage: int
            ) -> list[dict[str, Any]]:
    """Every combination of the space's candidates and the variables' values (the documented order),
    merged over ``base`` at ``stage``, pruned, normalized, and deduplicated by config hash."""
    dims: list[tuple[tuple[str, ...], list]] = []
    _dimensions(space, (), dims)
    dims += [(("$" + name,), values) for name, values in env.items()]
    dims.sort(key=lambda d: d[0])
    sets_batch, sets_tbs = _names_batch(space, base)

    configs: list[dict[str, Any]] = []
    seen: set[str] = set()
    for combo in itertools.product(*(values for _, values in dims)):
        cfg = _combination(base, space, dims, combo, stage, drop_tbs=sets_batch and not sets_tbs)
        key = config_hash(cfg)
        if key not in seen:
            seen.add(key)
            configs.append(cfg)
    return configs


def _combination(base: dict[str, Any], space: dict[str, Any], dims: list[tuple[tuple[str, ...], list]],
                 combo: tuple, stage: int, drop_tbs: bool) -> dict[str, Any]:
    """The config of one combination (one value per dimension of ``dims``): the space with its
    choices, merged over ``base``, placeholders replaced, at ``stage``, pruned and normalized;
    ``drop_tbs``: without ``train_batch_size`` (DeepSpeed derives it)."""
    choice = copy.deepcopy(space)
    values = {}
    for (path, _), value in zip(dims, combo):
        if path[0].startswith("$"):
            values[path[0][1:]] = value
        else:
            _set(choice, path, value)
    cfg = replace_placeholders(merge(base, choice), values)
    if not isinstance(cfg.get(ZERO, {}), dict):
        raise ConfigError(f"{ZERO} = {cfg[ZERO]!r}: expected an object such as {{\"stage\": 2}}")
    cfg.setdefault(ZERO, {})["stage"] = stage
    if drop_tbs:
        cfg.pop(TBS, None)
    return normalize(prune(cfg))


def _named_candidates(configs: list[dict[str, Any]], dp_world_size: int,
                      fits: Callable[[dict[str, Any]], bool] | None) -> list[Candidate]:
    """``configs`` validated and named, in order, their knobs being the settings that vary between them.

    Raises:
        ConfigError: a config that fails `zerotune.deepspeed.validate.validate`.
        RuntimeError: two configs with the same canonical name.
    """
    varying = _varying_paths(configs)
    named = {tuple(k.split(".")) for k in ACRONYMS}
    extra_keys = [".".join(p) for p in varying if p not in named]
    candidates = []
    names: dict[str, dict[str, Any]] = {}
    for cfg in configs:
        knobs = {".".join(p): v for p, v in leaves(cfg) if p in varying}
        try:
            validate(cfg, dp_world_size)
        except ConfigError as e:
            raise ConfigError(f"tuning space gives an invalid config ({_describe(knobs)}): {e}") from None
        name = canonical_name(cfg, extra_keys)
        if name in names:  # only two configs whose 32-bit hash prefixes collide
            raise RuntimeError(f"canonical name collision: {name}")
        names[name] = cfg
        candidates.append(Candidate(name, cfg, knobs, bool(fits(cfg)) if fits else True))
    return candidates


def _varying_paths(configs: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """Leaf key paths whose value (or presence) differs between configs, sorted."""
    per_config = [dict(leaves(c)) for c in configs]
    keys = sorted(set().union(*per_config)) if per_config else []
    out = []
    for k in keys:
        texts = {canonical_json({"v": d[k]}) if k in d else None for d in per_config}
        if len(texts) > 1:
            out.append(k)
    return out


def _describe(knobs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in knobs.items()) or "the base config"
