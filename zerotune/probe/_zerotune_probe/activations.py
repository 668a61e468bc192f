"""What the profile run's first forward holds for the backward pass, in rank 0's `.records.ACTIVATIONS_RECORD`.

``saved_bytes``: the storages autograd saves for the backward pass, each once, less parameters, their views and
module buffers, at the record's ``micro_batch_size``. Under checkpointing the record adds ``recompute_bytes``
(`_SavedActivations`); without it, where the model has checkpointable layers, ``checkpointed_bytes``
(`_LayerCheckpointing`); then ``square_saved_bytes`` (`_SavedActivations.count_square`), the ZeRO-3 shapes
(`_SavedActivations._shapes`), the device's peak (`.peak`) and the step's growth (`.growth`). DeepSpeed's
``activation_mem_per_gpu`` is not used: on CPU that RSS change also holds the ZeRO-3 parameters the forward gathered.
"""
import contextlib
import os
import sys

from .padding import cut_batch
from .peak import _data_peak, _device_peak
from .records import ACTIVATIONS_RECORD, _Probe, _rank, _write_record


class _LayerCheckpointing:
    """What the profile's first forward would hold with non-reentrant activation checkpointing
    (``torch.utils.checkpoint``, ``use_reentrant=False``, the Trainer's default in transformers 5) of every
    checkpointable layer: ``checkpointed_bytes`` and ``checkpoint_layers`` (D109).

    The layers: modules whose class derives from one named `LAYER_CLASS` (transformers'
    ``modeling_layers.GradientCheckpointingLayer``) whose ``gradient_checkpointing`` is not True. Forward hooks keep
    the stack of running layer calls; each saved storage goes to the innermost call, or outside any layer. A
    checkpointed layer saves only its inputs (``_checkpoint_without_reentrant_generator`` holds them for the
    recomputation), and the backward recomputes one layer at a time. So ``checkpointed_bytes`` = the storages saved
    outside any layer with the layers' inputs, each once, plus the most one layer call saved beyond its inputs (or a
    checkpointed region's ``recompute_bytes``, if larger). A failure ends the counting: the record has neither key."""

    LAYER_CLASS = "GradientCheckpointingLayer"

    def __init__(self, layers: list, count):
        self.layers, self.count = layers, count  # count(storages, tensor, exclude): _SavedActivations._count
        self.outside: dict[int, int] = {}  # data_ptr -> bytes, saved outside any layer call
        self.inputs: dict[int, int] = {}  # the layers' input storages
        self.stack: list[tuple[dict, frozenset]] = []  # (what the call saved beyond its inputs, its inputs)
        self.most, self.calls, self.measuring, self.paused = 0, 0, True, False

    @classmethod
    def for_module(cls, module, count) -> "_LayerCheckpointing | None":
        """The counter for ``module``'s checkpointable layers that are not checkpointed; None without any."""
        layers = [m for m in module.modules() if getattr(m, "gradient_checkpointing", False) is not True
                  and any(c.__name__ == cls.LAYER_CLASS for c in type(m).__mro__)]
        return cls(layers, count) if layers else None

    def fail(self, what: str, error: BaseException) -> None:
        if self.measuring:
            self.measuring = False
            print(f"zerotune probe: {what} failed, checkpointing not priced: {type(error).__name__}: {error}",
                  file=sys.stderr, flush=True)

    def saved(self, tensor) -> None:
        """A storage saved for the backward pass: the innermost running layer call's, or outside any."""
        if not self.measuring:
            return
        try:
            if self.stack:
                saved, inputs = self.stack[-1]
                self.count(saved, tensor, inputs)
            else:
                self.count(self.outside, tensor)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.fail("attributing a saved tensor to a layer", e)

    def _enter(self, module, args, kwargs) -> None:
        if not self.measuring or self.paused:
            return
        try:
            tensors: dict[int, int] = {}
            for value in (*args, *kwargs.values()):
                for tensor in (value if isinstance(value, (tuple, list)) else (value,)):  # Llama's (cos, sin)
                    if hasattr(tensor, "untyped_storage"):
                        self.count(tensors, tensor)
            self.inputs.update(tensors)
            self.stack.append(({}, frozenset(tensors)))
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.fail("reading a layer's inputs", e)

    def _leave(self, module, args, kwargs, output) -> None:
        if not self.measuring or self.paused or not self.stack:
            return
        saved, _ = self.stack.pop()
        self.most, self.calls = max(self.most, sum(saved.values())), self.calls + 1

    @contextlib.contextmanager
    def hooks(self):
        """The layers' forward hooks, removed on exit."""
        handles = []
        try:
            for layer in self.layers:
                handles.append(layer.register_forward_pre_hook(self._enter, with_kwargs=True))
                handles.append(layer.register_forward_hook(self._leave, with_kwargs=True, always_call=True))
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.fail("hooking the checkpointable layers", e)
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def figures(self, recompute_bytes: int = 0) -> dict:
        """``checkpointed_bytes`` and ``checkpoint_layers``; ``{}`` without a counted layer call or after a failure."""
        if not self.measuring or not self.calls or self.stack:
            return {}
        kept = {**self.outside, **self.inputs}
        return {"checkpointed_bytes": int(sum(kept.values()) + max(self.most, recompute_bytes)),
                "checkpoint_layers": self.calls}


class _SavedActivations:
    """Counts the bytes autograd saves for the backward pass in the profile run's first forward (every rank) and
    writes `ACTIVATIONS_RECORD` (rank 0). The pack hook returns the tensor itself: the forward runs as it would.

    A checkpointed region's forward saves only its inputs, and its activations are live again, one region at a
    time, while the backward recomputes it. To count them, the entry points of `CHECKPOINT_MODULES` are wrapped
    during the counted forward (looked up when ``checkpoint`` is called, so a script that bound it is covered): each
    region runs once more first, with gradients and these hooks, its output dropped at once; the most one region
    saves beyond its inputs is ``recompute_bytes`` (D22). The profile run exits at the end of that forward, so the
    extra run changes nothing the tuning measures."""

    CHECKPOINT_MODULES = ("torch.utils.checkpoint", "deepspeed.runtime.activation_checkpointing.checkpointing")

    def __init__(self, probe: _Probe, engine, torch):
        self.probe, self.engine, self.torch = probe, engine, torch
        module = getattr(engine, "module", None)
        tensors = list(module.parameters()) + list(module.buffers()) if module is not None else []
        self.resident = {t.untyped_storage().data_ptr() for t in tensors}  # parameters and buffers
        self.storages: dict[int, int] = {}  # data_ptr -> bytes
        self.shapes = self._shapes(module) if module is not None else {}
        self.recompute_bytes, self.regions, self.measuring = 0, 0, True
        self.layers = self._layers(module) if module is not None else None
        self.square: dict[str, int] = {}  # square_seq_len, square_saved_bytes (count_square)

    @staticmethod
    def _shapes(module) -> dict:
        """``largest_layer_params``: the most parameter elements one module holds directly (not its children's):
        ZeRO-3 gathers at least that much to run it. ``persistent_params``: the elements ZeRO-3 keeps gathered
        (``ds_persist``, from ``stage3_param_persistence_threshold``). Both count full parameters (``ds_numel``)."""
        def numel(p):
            return int(getattr(p, "ds_numel", None) or p.numel())
        largest = max((sum(numel(p) for p in m.parameters(recurse=False)) for m in module.modules()), default=0)
        persistent = sum(numel(p) for p in module.parameters() if getattr(p, "ds_persist", False))
        return {"largest_layer_params": largest, "persistent_params": persistent, **_flops_shape(module, numel)}

    @classmethod
    def for_profile(cls, probe: _Probe, engine) -> "_SavedActivations | None":
        torch = sys.modules.get("torch")
        try:
            if torch is None or not engine.autotuning_profile_model_info():
                return None
            return cls(probe, engine, torch)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            print(f"zerotune probe: counting activations failed: {type(e).__name__}: {e}", file=sys.stderr, flush=True)
            return None

    def _count(self, storages: dict, tensor, exclude=frozenset()) -> None:
        """Add ``tensor``'s storage to ``storages`` unless a parameter's, a view of one, a buffer's or excluded."""
        try:
            parameter = self.torch.nn.Parameter
            if not (isinstance(tensor, parameter) or isinstance(tensor._base, parameter)):
                storage = tensor.untyped_storage()
                ptr = storage.data_ptr()
                if ptr not in self.resident and ptr not in exclude:
                    storages[ptr] = storage.nbytes()
        except Exception:  # noqa: BLE001 - a tensor without a storage (sparse, meta): not counted
            pass

    def _layers(self, module) -> "_LayerCheckpointing | None":
        try:
            return _LayerCheckpointing.for_module(module, self._count)
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            print(f"zerotune probe: finding the checkpointable layers failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)
            return None

    def count_square(self, args: tuple, kwargs: dict) -> None:
        """``square_seq_len``, the largest odd length below the batch's, and ``square_saved_bytes``, the saved tensors
        whose last two dimensions both have it (attention scores; 0 under flash attention), from one more forward on
        the counted forward's batch, cut (odd: no tensor square by coincidence, as 32 tokens with 32-wide heads). Every
        rank runs it (ZeRO-3's gathers stay matched); nothing without token ids or with fewer than 4."""
        try:
            seq_len = self.probe.state(self.engine)["seq_len"]
            if not isinstance(seq_len, int) or seq_len < 4:
                return
            length = seq_len - 1 if seq_len % 2 == 0 else seq_len - 2
            args, kwargs = cut_batch(args, kwargs, length)
            square: dict[int, int] = {}

            def pack(tensor):
                if tensor.dim() >= 3 and tensor.shape[-1] == tensor.shape[-2] == length:
                    self._count(square, tensor)
                return tensor
            with self.torch.enable_grad(), self.torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                out = self.engine.module(*args, **kwargs)
            del out
            self.square = {"square_seq_len": length, "square_saved_bytes": int(sum(square.values()))}
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            print(f"zerotune probe: counting attention scores failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)

    def pack(self, tensor):
        self._count(self.storages, tensor)
        if self.layers is not None:
            self.layers.saved(tensor)
        return tensor

    def region(self, function, args, kwargs) -> None:
        """Run one checkpointed region with gradients and count what it saves beyond its inputs; its output is dropped.
        A failure is printed once and ends the counting of regions; the checkpoint's own run goes on."""
        if not self.measuring:
            return
        torch = self.torch
        try:
            tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
            for tensor in tensors:  # kept until the backward pass recomputes the region (DeepSpeed's checkpoint
                self._count(self.storages, tensor)  # keeps them outside autograd's saved tensors)
                if self.layers is not None:
                    self.layers.saved(tensor)
            inputs = {a.untyped_storage().data_ptr() for a in tensors}
            saved: dict[int, int] = {}

            def pack(tensor):
                self._count(saved, tensor, inputs)
                return tensor
            if self.layers is not None:  # a layer inside the region: its real run is the one counted
                self.layers.paused = True
            try:
                with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
                    out = function(*args, **kwargs)
            finally:
                if self.layers is not None:
                    self.layers.paused = False
            del out
            self.recompute_bytes = max(self.recompute_bytes, sum(saved.values()))
            self.regions += 1
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            self.measuring = False
            print(f"zerotune probe: counting a checkpointed region failed: {type(e).__name__}: {e}",
                  file=sys.stderr, flush=True)

    def _wrapped_checkpoints(self) -> list:
        """``(module, name, wrapper)`` per checkpoint entry point of the loaded `CHECKPOINT_MODULES`."""
        import inspect
        counter, wrapped = self, []
        for name in self.CHECKPOINT_MODULES:
            module = sys.modules.get(name)
            function_cls = getattr(module, "CheckpointFunction", None)
            if function_cls is not None:  # apply(function, preserve_rng_state or all_outputs, *args)
                def apply(function, flag, *args, _apply=function_cls.apply):
                    counter.region(function, args, {})
                    return _apply(function, flag, *args)
                stand_in = type("CheckpointFunction", (), {"apply": staticmethod(apply)})
                wrapped.append((module, "CheckpointFunction", stand_in))
            generator = getattr(module, "_checkpoint_without_reentrant_generator", None)
            if generator is not None:  # (fn, preserve_rng_state, context_fn, ..., *args, **kwargs)
                parameters = inspect.signature(generator).parameters.values()
                named = sum(p.kind is p.POSITIONAL_OR_KEYWORD for p in parameters)

                def regions(fn, *rest, _generator=generator, _named=named, **kwargs):
                    counter.region(fn, rest[_named - 1:], kwargs)
                    return _generator(fn, *rest, **kwargs)
                wrapped.append((module, "_checkpoint_without_reentrant_generator", regions))
        return wrapped

    @contextlib.contextmanager
    def hooks(self):
        """The counting hooks, the layers' hooks (`_LayerCheckpointing`) and the wrapped checkpoint entry points, all
        removed on exit (DeepSpeed's profile ``exit()`` included)."""
        try:
            wrapped = self._wrapped_checkpoints()
        except Exception as e:  # noqa: BLE001 - the probe never breaks training
            wrapped = []
            print(f"zerotune probe: wrapping checkpointing failed: {type(e).__name__}: {e}", file=sys.stderr,
                  flush=True)
        originals = [(module, name, getattr(module, name)) for module, name, _ in wrapped]
        try:
            for module, name, wrapper in wrapped:
                setattr(module, name, wrapper)
            layers = self.layers.hooks() if self.layers is not None else contextlib.nullcontext()
            with layers, self.torch.autograd.graph.saved_tensors_hooks(self.pack, lambda tensor: tensor):
                yield
        finally:
            for module, name, original in originals:
                setattr(module, name, original)

    def write(self, growth: dict | None = None) -> None:
        """Rank 0 writes `ACTIVATIONS_RECORD`, ``growth`` (`.growth._StepGrowth.figures`) over the keys it shares. Every
        rank counts, so that every rank runs the checkpointed regions again and ZeRO-3's gathers stay matched."""
        if _rank(self.engine) != 0:
            return
        _write_record(os.path.join(self.probe.directory, ACTIVATIONS_RECORD), lambda: {
            "saved_bytes": int(sum(self.storages.values())), "saved_storages": len(self.storages),
            **({"recompute_bytes": int(self.recompute_bytes), "recompute_regions": self.regions}
               if self.regions else {}),
            **(self.layers.figures(self.recompute_bytes) if self.layers is not None else {}),
            **self.square,
            "micro_batch_size": int(self.engine.train_micro_batch_size_per_gpu()), **self.shapes,
            **_device_peak(self.torch, self.engine), **_data_peak(), **(growth or {}),
            **_device_name(self.torch)}, "recording activations")


TOP_K_KEYS = ("num_experts_per_tok", "moe_topk", "top_k", "num_selected_experts")  # zerotune.model.meta_model's


def _flops_shape(module, numel) -> dict:
    """What model FLOPs per token need beyond the parameter count (`zerotune.model.flops`), from a Hugging Face
    model's config (its text config first) and modules: ``num_layers``, ``hidden_size``; for a mixture of experts
    ``routed_params`` (elements under modules named ``experts``), ``num_experts`` ``E`` and ``experts_per_token``
    ``k``, as `zerotune.model.meta_model.count` finds them. A key it cannot read is left out."""
    config = getattr(module, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    out = {}
    for key, names in (("num_layers", ("num_hidden_layers",)), ("hidden_size", ("hidden_size",)),
                       ("experts_per_token", TOP_K_KEYS)):
        value = next((v for n in names if isinstance(v := getattr(text, n, None), int) and v > 0), None)
        if value is not None and not isinstance(value, bool):
            out[key] = value
    routed, experts = 0, 0
    for name, child in module.named_modules():
        if name.rsplit(".", 1)[-1] == "experts":
            params = list(child.parameters())
            routed += sum(numel(p) for p in params)
            fused = [tuple(getattr(p, "ds_shape", None) or p.shape) for p in params]
            fused = [shape for shape in fused if len(shape) == 3]
            experts = experts or (fused[0][0] if fused else len(child) if hasattr(child, "__len__") else 0)
    if routed and experts:
        out.update(routed_params=int(routed), num_experts=int(experts))
    return out


def _device_name(torch) -> dict:
    """``device_name``, CUDA's name of this rank's device (``NVIDIA H100 80GB HBM3``); nothing elsewhere."""
    try:
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            return {"device_name": str(torch.cuda.get_device_name(torch.cuda.current_device()))}
    except Exception:  # noqa: BLE001 - the probe never breaks training
        pass
    return {}
