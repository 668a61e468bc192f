"""``zerotune estimate``: a what-if that runs nothing (examples: docs/estimate.md).

For a model (a profile run on disk, ``--num-params`` with activation bytes per sample, or a Hugging Face
``config.json``) and hardware (``--num_gpus``, ``--num_nodes``, device and host memory) it gives the memory model's
bytes per device by component for each ZeRO stage, offload choice and, where checkpointed activations are known,
activation checkpointing off and on, with the largest mbs that fits (`estimate`, `render`). A checkpointing row's
config carries ``gradient_checkpointing: true``, so its bytes are the tuner's. Bad input raises
`zerotune.core.errors.ConfigError` naming the argument (exit 2).
"""
from __future__ import annotations

import argparse
import itertools
import json
from dataclasses import asdict, dataclass, field
from typing import Any

from zerotune.core import user_files
from zerotune.core.arguments import MAX_COUNT, whole
from zerotune.core.errors import ConfigError
from zerotune.core.units import format_bytes, parse_bytes
from zerotune.deepspeed.config import CONFIG_RULE
from zerotune.deepspeed.config import precision as config_precision
from zerotune.deepspeed.keys import CHECKPOINTING
from zerotune.deepspeed.validate import check_sections
from zerotune.model.coverage import unmodelled_keys
from zerotune.model.hf_config import architecture, read_config
from zerotune.model.memory import MemoryModel
from zerotune.model.profile import CHECKPOINTED_ACTIVATIONS_KEY, SAVED_ACTIVATIONS_KEY, ModelInfo
from zerotune.model.zero_options import approximations
from zerotune.probe import read_checkpointed_activations, read_model_shapes, read_saved_activations

OFFLOADS = (("none", {}), ("optimizer cpu", {"offload_optimizer": {"device": "cpu"}}),
            ("optimizer+params cpu", {"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}))
"""The offload choices estimated: none (every stage), the optimizer (stages 1-3), both (stage 3)."""


ATTENTIONS = ("eager", "sdpa", "flash")
"""How a Hugging Face model runs attention (``attn_implementation``): ``eager`` stores each layer's scores and
softmax; ``sdpa`` (CPU's and CUDA's flash kernels, CUDA's memory-efficient one) and ``flash`` store none of them
(`zerotune.model.fake_forward` counts both on the model's own forward)."""


@dataclass
class Row:
    """One ZeRO stage, offload choice and activation checkpointing choice: bytes per device by component at
    mbs 1, the largest mbs that fits (0: none, None: activations unknown) and host bytes per node."""

    stage: int
    offload: str
    checkpointing: bool
    parameters: int
    gradients: int
    optimizer_states: int
    buffers: int
    overhead: int
    activations_mbs1: int | None
    total_mbs1: int
    max_mbs: int | None
    activations_max_mbs: int | None
    host_per_node: int
    fits_host: bool | None


@dataclass
class Estimate:
    """What ``zerotune estimate`` prints: the inputs and one `Row` per stage, offload and checkpointing choice.
    ``checkpointed_activation_bytes_per_sample``: None when unknown (only rows without checkpointing). ``notes``:
    what the model source assumed. ``active_params``, ``experts``: the parameters a token runs through and ``(k, E)``
    (None, ``(0, 0)``: unknown, or dense). ``unmodelled``, ``approximated``: the ``--deepspeed`` keys the memory
    model does not price (`zerotune.model.coverage.unmodelled_keys`) and what it assumes for those it prices in part
    (`zerotune.model.zero_options.approximations`)."""

    model_source: str
    num_params: int
    trainable_params: int
    activation_bytes_per_sample: int | None
    checkpointed_activation_bytes_per_sample: int | None
    precision: str
    optimizer: str
    num_nodes: int
    gpus_per_node: int
    mp_size: int
    dp_world_size: int
    device_memory_bytes: int
    host_memory_bytes: int | None
    rows: list[Row]
    notes: list[str] = field(default_factory=list)
    active_params: int | None = None
    experts: tuple[int, int] = (0, 0)
    unmodelled: list[str] = field(default_factory=list)
    approximated: list[str] = field(default_factory=list)


def add_parser(sub: argparse._SubParsersAction) -> None:
    """Register the ``estimate`` subcommand on the CLI's subparsers."""
    p = sub.add_parser("estimate", help="bytes per device for each ZeRO stage, offload and activation "
                                        "checkpointing, for hardware you don't have (runs nothing)")
    m = p.add_argument_group("the model (one of)")
    m.add_argument("--profile", default=None, help="a profile run on disk: its directory (model_info.json) or the file")
    m.add_argument("--num-params", default=None, help="parameters, e.g. 13e9")
    m.add_argument("--hf-config", default=None, help="a Hugging Face config.json (or its directory)")
    m.add_argument("--trainable-params", default=None, help="with --num-params: parameters with requires_grad "
                                                            "(default all)")
    m.add_argument("--activation-bytes", default=None,
                   help="activation memory per sample, e.g. 1.5GiB (with --num-params; without it the largest mbs is "
                        "not estimated)")
    m.add_argument("--seq-len", type=whole(1, 2**31 - 1), default=None,
                   help="with --hf-config: tokens per sample (default: its maximum positions)")
    m.add_argument("--attention", choices=ATTENTIONS, default=None,
                   help="with --hf-config: how the model runs attention (default: the config's attn_implementation, "
                        "else transformers' default, sdpa); eager stores every layer's tokens x tokens scores, sdpa "
                        "(on CUDA) and flash do not")
    m.add_argument("--flash-attention", action="store_const", const="flash", dest="attention",
                   help="with --hf-config: --attention flash")
    m.add_argument("--activation-checkpointing", action="store_true",
                   help="with --hf-config or --profile: only the rows with every layer checkpointed (keeps its "
                        "input, recomputes in backward); without it both, where the checkpointed term is known")
    h = p.add_argument_group("the hardware (the launcher's names)")
    h.add_argument("--num_gpus", "--num_accelerators", type=whole(1, MAX_COUNT), default=1,
                   help="devices per node (default 1)")
    h.add_argument("--num_nodes", type=whole(1, MAX_COUNT), default=1, help="nodes (default 1)")
    h.add_argument("--device-memory", default=None, help="memory per device, e.g. 40GiB (required)")
    h.add_argument("--host-memory", default=None, help="memory per node, e.g. 512GiB: checks offload's host bytes")
    t = p.add_argument_group("training")
    t.add_argument("--deepspeed", "--deepspeed_config", dest="ds_config", default=None,
                   help="a ds_config: precision, optimizer and buckets from it (default bf16, AdamW, DeepSpeed's buckets)")
    t.add_argument("--precision", choices=("bf16", "fp16", "fp32"), default=None, help="overrides the config's")
    t.add_argument("--mp-size", type=whole(1, MAX_COUNT), default=1, help="model-parallel size (default 1)")
    t.add_argument("--overhead", default="0", help="fixed bytes per device not modelled (CUDA context, NCCL), "
                                                   "e.g. 1GiB (default 0)")
    t.add_argument("--max-mbs", type=whole(1, 2**31 - 1), default=1024, help="largest mbs considered (default 1024)")
    p.add_argument("--json", action="store_true", help="print JSON")


def _count(text: str, what: str) -> int:
    try:
        value = float(text)
    except (TypeError, ValueError):
        raise ConfigError(f"{what} = {text!r}: expected a number of parameters, e.g. 13e9") from None
    if not value >= 1 or value >= 2**63:
        raise ConfigError(f"{what} = {text!r}: expected a positive number of parameters")
    return int(value)


def _read_profile(path: str) -> dict[str, Any]:
    p, label = user_files.file_in(path, "model_info.json", "--profile")
    data = user_files.load_object(p, label, "expected a profile run's directory or its model_info.json")
    if not isinstance(data.get("num_params"), (int, float)) or data["num_params"] <= 0:
        raise ConfigError(f"--profile {path}: {p.name} has no positive num_params (DeepSpeed's model_info.json)")
    saved = read_saved_activations(p.parent)  # the probe's record beside it, as the tuner reads it
    if saved is not None:
        data[SAVED_ACTIVATIONS_KEY] = saved
    data.update(read_model_shapes(p.parent))
    checkpointed = read_checkpointed_activations(p.parent)
    if checkpointed is not None:
        data[CHECKPOINTED_ACTIVATIONS_KEY] = checkpointed
    return data


def _ds_config(args: argparse.Namespace) -> dict[str, Any]:
    cfg: dict[str, Any] = {"optimizer": {"type": "AdamW"}, "bf16": {"enabled": True}}
    if args.ds_config:
        cfg = user_files.load_object(args.ds_config, f"--deepspeed {args.ds_config}", CONFIG_RULE)
        check_sections(cfg, f"--deepspeed {args.ds_config}", candidates=False)
    if args.precision:
        cfg = {k: v for k, v in cfg.items() if k not in ("fp16", "bf16", "bfloat16")}
        if args.precision != "fp32":
            cfg[args.precision] = {"enabled": True}
    return cfg


@dataclass(frozen=True)
class _Model:
    """The model as given: its description, parameters, activation bytes per sample without and with checkpointing
    (None: unknown), the layer sizes the memory model takes as keywords, and what the source assumed."""

    source: str
    num_params: int
    trainable: int
    activations: int | None
    extra: dict[str, int]
    checkpointed: int | None = None
    notes: tuple[str, ...] = ()
    active: int | None = None
    experts: tuple[int, int] = (0, 0)


@dataclass(frozen=True)
class _Hardware:
    """The hardware and bounds as given: bytes per device and per node (None: not checked), devices."""

    budget: int
    host: int | None
    overhead: int
    gpus: int
    nodes: int
    mp: int
    max_mbs: int
    dp: int


def estimate(args: argparse.Namespace) -> Estimate:
    """The estimate for parsed ``zerotune estimate`` arguments.

    Raises:
        ConfigError: bad or missing input, naming the argument.
    """
    model_flag = _model_flag(args)
    cfg = _ds_config(args)
    prec = config_precision(cfg)
    given = _model(args, model_flag, prec)
    hw = _hardware(args)
    model = MemoryModel(given.num_params, given.activations or 0, hw.dp, mp_size=hw.mp, overhead_bytes=hw.overhead,
                        trainable_params=given.trainable, checkpointed_activation_bytes_per_sample=given.checkpointed,
                        **given.extra)
    if args.activation_checkpointing and given.checkpointed is None:
        raise ConfigError(f"--activation-checkpointing: the profile run {args.profile} did not price activation "
                          "checkpointing (no checkpointable layer without it, or an older probe)")
    choices = (True,) if args.activation_checkpointing else (False, True) if given.checkpointed is not None else (False,)
    rows = _rows(model, cfg, hw, given.activations, choices)
    return Estimate(given.source, given.num_params, given.trainable, given.activations, given.checkpointed, prec,
                    str((cfg.get("optimizer") or {}).get("type", "adam")),
                    hw.nodes, hw.gpus, hw.mp, hw.dp, hw.budget, hw.host, rows, list(given.notes), given.active,
                    given.experts, unmodelled_keys(cfg), approximations(cfg))


def _model_flag(args: argparse.Namespace) -> str:
    """The one flag that gives the model; flags that go with another one are refused."""
    sources = [name for name, value in (("--profile", args.profile), ("--num-params", args.num_params),
                                        ("--hf-config", args.hf_config)) if value is not None]
    if len(sources) != 1:
        raise ConfigError("give the model by exactly one of --profile, --num-params or --hf-config"
                          + (f" (got {', '.join(sources)})" if sources else ""))
    for flag, value, source in (("--trainable-params", args.trainable_params, "--num-params"),
                                ("--activation-bytes", args.activation_bytes, "--num-params"),
                                ("--seq-len", args.seq_len, "--hf-config"),
                                ("--attention", args.attention, "--hf-config"),
                                ("--activation-checkpointing", args.activation_checkpointing or None,
                                 "--hf-config or --profile")):
        if value is not None and sources[0] not in source.split(" or "):
            raise ConfigError(f"{flag} goes with {source}")
    return sources[0]


def _model(args: argparse.Namespace, flag: str, prec: str) -> _Model:
    """The model from its flag (``prec``: the training precision, for a Hugging Face config's activations)."""
    if flag == "--profile":
        return _model_from_profile(args)
    if flag == "--num-params":
        return _model_from_num_params(args)
    return _model_from_hf_config(args, prec)


def _model_from_profile(args: argparse.Namespace) -> _Model:
    info = _read_profile(args.profile)
    num_params = int(info["num_params"])
    trainable = int(info.get("trainable_num_params", num_params))
    model_info = ModelInfo.from_metrics(info)
    return _Model(f"profile run {args.profile}", num_params, trainable, model_info.activation_mem_per_gpu,
                  {"largest_layer_params": model_info.largest_layer_params,
                   "persistent_params": model_info.persistent_params}, model_info.checkpointed_activation_mem_per_gpu)


def _model_from_num_params(args: argparse.Namespace) -> _Model:
    num_params = _count(args.num_params, "--num-params")
    trainable = num_params if args.trainable_params is None else _count(args.trainable_params, "--trainable-params")
    if trainable > num_params:
        raise ConfigError(f"--trainable-params {args.trainable_params}: more than --num-params {args.num_params}")
    activations = (parse_bytes(args.activation_bytes, "--activation-bytes")
                   if args.activation_bytes is not None else None)
    return _Model(f"--num-params {args.num_params}", num_params, trainable, activations, {})


def _model_from_hf_config(args: argparse.Namespace, prec: str) -> _Model:
    config = read_config(args.hf_config)
    attention, why = _attention(args.attention, config)
    arch, checkpointed = (architecture(config, seq_len=args.seq_len, bytes_per_activation=4 if prec == "fp32" else 2,
                                       attention=attention, checkpointing=checkpointing,
                                       source=f"--hf-config {args.hf_config}") for checkpointing in (False, True))
    counted = (f"; activations counted on its {arch.activations_counted} forward over fake CPU tensors"
               if arch.activations_counted else "")
    source = (f"Hugging Face config {args.hf_config}" + (f" ({arch.built_by} on the meta device{counted})"
                                                         if arch.built_by else "") + f", seq_len {arch.seq_len}"
              + f", attention {attention} ({why})")
    return _Model(source, arch.num_params, arch.num_params, arch.activation_bytes_per_sample,
                  {"largest_layer_params": arch.largest_layer_params, "persistent_params": arch.persistent_params},
                  checkpointed.activation_bytes_per_sample, arch.notes, arch.active_params, arch.experts)


def _attention(given: str | None, config: dict[str, Any]) -> tuple[str, str]:
    """The attention the model runs (`ATTENTIONS`) and where that came from: ``--attention``, else the config's
    ``attn_implementation`` (``flash_attention_2``/``_3`` read as flash), else transformers' default, SDPA."""
    if given is not None:
        return given, "--attention"
    stated = str(config.get("attn_implementation") or config.get("_attn_implementation") or "")
    if stated.startswith("flash"):
        return "flash", f"the config's attn_implementation {stated}"
    if stated in ATTENTIONS:
        return stated, "the config's attn_implementation"
    return "sdpa", "transformers' default; its CUDA kernels store no scores"


def _hardware(args: argparse.Namespace) -> _Hardware:
    """The hardware options, parsed and checked (``--mp-size`` divides the devices)."""
    if args.device_memory is None:
        raise ConfigError("--device-memory is required: the memory of one device, e.g. 40GiB")
    budget = parse_bytes(args.device_memory, "--device-memory")
    host = parse_bytes(args.host_memory, "--host-memory") if args.host_memory is not None else None
    overhead = 0 if str(args.overhead).strip() == "0" else parse_bytes(args.overhead, "--overhead")
    gpus, nodes, mp, max_mbs = args.num_gpus, args.num_nodes, args.mp_size, args.max_mbs  # argparse bounds them
    if (gpus * nodes) % mp:
        raise ConfigError(f"--mp-size {mp} does not divide the {gpus * nodes} devices")
    return _Hardware(budget, host, overhead, gpus, nodes, mp, max_mbs, gpus * nodes // mp)


def _rows(model: MemoryModel, cfg: dict[str, Any], hw: _Hardware, activations: int | None,
          checkpointing: tuple[bool, ...] = (False,)) -> list[Row]:
    """One `Row` per ZeRO stage, offload choice the stage allows (`OFFLOADS`) and activation checkpointing choice
    in ``checkpointing`` (True: the config carries ``gradient_checkpointing: true``), in order."""
    rows = []
    for stage, (name, offload), checkpointed in itertools.product(range(4), OFFLOADS, checkpointing):
        if (stage == 0 and offload) or (stage < 3 and "offload_param" in offload):
            continue
        zero = {**(cfg.get("zero_optimization") or {}), "stage": stage}
        for key in ("offload_optimizer", "offload_param"):
            zero.pop(key, None)
        c = {**{k: v for k, v in cfg.items() if k != CHECKPOINTING}, "zero_optimization": {**zero, **offload},
             **({CHECKPOINTING: True} if checkpointed else {})}
        b = model.breakdown(c, mbs=1)
        fit = (model.max_mbs(c, hw.budget, cap=hw.max_mbs) if activations
               else (None if model.fits(c, hw.budget, 1) else 0))
        host_node = b.host * hw.gpus
        rows.append(Row(stage, name, checkpointed, b.parameters, b.gradients, b.optimizer_states, b.buffers,
                        b.overhead, b.activations if activations else None, b.total, fit,
                        (model.breakdown(c, mbs=fit).activations if activations and fit else None),
                        host_node, None if hw.host is None else host_node <= hw.host))
    return rows


def render(est: Estimate) -> str:
    """The estimate as a text table with a header and notes."""
    act = "unknown" if not est.activation_bytes_per_sample else format_bytes(est.activation_bytes_per_sample)
    act += " per sample" + (f" ({format_bytes(est.checkpointed_activation_bytes_per_sample)} with activation "
                            "checkpointing)" if est.checkpointed_activation_bytes_per_sample is not None else "")
    k, experts = est.experts
    active = (f"; {est.active_params:,} active per token: {k} of {experts} experts, embeddings included"
              if k else "")
    lines = [f"model: {est.model_source}: {est.num_params:,} parameters ({est.trainable_params:,} trainable{active}), "
             f"activations {act}; {est.precision}, {est.optimizer}",
             f"hardware: {est.num_nodes} node(s) x {est.gpus_per_node} device(s), {format_bytes(est.device_memory_bytes)}"
             f" per device" + (f", {format_bytes(est.host_memory_bytes)} host memory per node" if est.host_memory_bytes
                               else "") + f"; DP world size {est.dp_world_size}, MP size {est.mp_size}",
             ""]
    head = ("stage", "offload", "ckpt", "params", "grads", "optimizer", "buffers", "act@mbs1", "total@mbs1", "max mbs",
            "act@max", "host/node")
    table = [head]
    for r in est.rows:
        max_mbs = ("?" if r.max_mbs is None else ("does not fit" if r.max_mbs == 0 else str(r.max_mbs)))
        host = format_bytes(r.host_per_node) if r.host_per_node else "-"
        if r.fits_host is False:
            host += " (over)"
        table.append((str(r.stage), r.offload, "on" if r.checkpointing else "off", format_bytes(r.parameters),
                      format_bytes(r.gradients), format_bytes(r.optimizer_states), format_bytes(r.buffers),
                      "?" if r.activations_mbs1 is None else format_bytes(r.activations_mbs1), format_bytes(r.total_mbs1),
                      max_mbs, "-" if r.activations_max_mbs is None else format_bytes(r.activations_max_mbs), host))
    widths = [max(len(row[i]) for row in table) for i in range(len(head))]
    for row in table:
        lines.append("  ".join(cell.rjust(w) if i > 2 else cell.ljust(w) for i, (cell, w) in enumerate(zip(row, widths))))
    lines += ["", "Bytes per device (the memory model, zerotune/model/memory.py). Not counted: "
              + ("the fixed per-device overhead (CUDA context, NCCL; --overhead), " if not any(r.overhead for r in est.rows)
                 else "") + "allocator fragmentation."]
    if not est.activation_bytes_per_sample:
        lines.append("Activations unknown (--activation-bytes): the largest mbs is not estimated; "
                     "'does not fit' means the model states alone are over the device memory.")
    lines += [f"Assumed: {note}." for note in est.notes]
    if est.unmodelled:
        lines.append(f"Not in the memory model: {', '.join(est.unmodelled)}: the bytes above leave them out.")
    lines += [f"Approximated: {n}." for n in est.approximated]
    return "\n".join(lines)


def to_json(est: Estimate) -> str:
    return json.dumps(asdict(est), indent=2)


def run(args: argparse.Namespace) -> int:
    """The ``estimate`` subcommand: print the table (or JSON); 0."""
    est = estimate(args)
    print(to_json(est) if args.json else render(est))
    return 0
