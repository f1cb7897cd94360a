"""Scan over layers: a decoder stack compiles as one layer in a loop instead of N unrolled copies.

XLA compiles a traced graph whole, so an unrolled stack of N identical blocks costs N times one block's compile
time. :func:`install` turns the ``nn.ModuleList`` that holds a model's blocks into a :class:`ScannedLayers`, and
stores the layers' weights stacked: one ``(N, ...)`` parameter per weight of a layer, held by a parameter-only copy
of the first layer's module tree registered beside the list (``model.layers_scanned.self_attn.q_proj.weight``); the
layers themselves keep their modules, code and attributes but no parameters. Inside its owner's ``forward``,
iterating the list (``for layer in self.layers``, ``self.layers[:n]``) yields a single :class:`ScanStep`, whose one
call runs every block through torch_xla's scan with the stacked weights as the loop's inputs, so the model's own loop
body runs once and the graph holds one block; the optimizer updates one tensor per weight of a layer, not N.

Stored stacked because stacking per step is not enough: stacking N per-layer weights into the loop and slicing N
gradients back out adds per-layer work to the graph, which on XLA:CPU compiled slower than the unrolled layers
(benchmarks/compile.py). Names stay the unrolled model's wherever weights leave the model: ``state_dict()`` (so
``save_pretrained``, PEFT's adapter files, hf_xla_fsdp's rank files and consolidation) gives each layer's slice under
its own name, and ``load_state_dict`` stacks them back; a run resumes its model weights across the setting. The
optimizer's state is the stacked parameters' (it resumes with the same setting).

What crosses the loop: the hidden states are the carry; the other tensor arguments (attention mask, rotary
cos/sin, position ids) are loop inputs repeated over the layers; everything else (``None``, flags) is a constant
of the traced body. A KV cache cannot live in a scan (each layer writes its own slot): in training mode the layers
get none (training never reads it back); a forward with a filled cache, or one whose outputs are being recorded
(``output_hidden_states``/``output_attentions``), runs the list unrolled, as before.

Activation checkpointing inside the scan is the scan's own: each layer's activations are recomputed in backward
(min-cut rematerialization of the one traced layer), replacing ``checkpoint_module`` and transformers' gradient
checkpointing, which cannot run inside a traced body.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ScanAnnotations", "ScanStep", "ScannedLayers", "check_homogeneous", "find_stacks", "install", "is_scanned",
           "stacked_weights"]

#: per-layer attributes that differ between otherwise identical layers without changing what they compute
_PER_LAYER_ATTRIBUTES = frozenset({"layer_idx", "layer_id", "layer_number", "idx", "block_idx"})
_PLAIN = (bool, int, float, str, type(None))


def _module_signature(module: nn.Module) -> dict[str, Any]:
    """The plain attributes of ``module`` and its submodules that decide what it computes (qualified names)."""
    found: dict[str, Any] = {"": type(module).__name__}
    for prefix, sub in module.named_modules():
        for key, value in vars(sub).items():
            if key.startswith("_") or key in _PER_LAYER_ATTRIBUTES:
                continue
            if isinstance(value, _PLAIN) or (isinstance(value, tuple) and all(isinstance(v, _PLAIN) for v in value)):
                found[f"{prefix}.{key}" if prefix else key] = value
        if prefix:
            found[f"{prefix}:class"] = type(sub).__name__
    for name, tensor in [*module.named_parameters(), *module.named_buffers()]:
        found[f"{name}:tensor"] = (tuple(tensor.shape), tensor.dtype, tensor.requires_grad)
    return found


def check_homogeneous(layers: Sequence[nn.Module], owner: str) -> None:
    """Refuse, in one line, layers that do not compute the same function of different weights (a scan runs the first
    layer's code with every layer's weights): a different class, attribute (e.g. ``attention_type``) or weight shape."""
    if not layers:
        return
    first = _module_signature(layers[0])
    for index, layer in enumerate(layers[1:], start=1):
        other = _module_signature(layer)
        if other == first:
            continue
        key = next(k for k in sorted(set(first) | set(other)) if first.get(k, "<absent>") != other.get(k, "<absent>"))
        what = key[:-len(":class")] + " class" if key.endswith(":class") else key.replace(":tensor", " (shape, dtype, trainable)")
        raise ConfigError(
            f"scan_layers: the layers of {owner} differ ({what or 'class'} is {first.get(key, '<absent>')!r} in layer 0, "
            f"{other.get(key, '<absent>')!r} in layer {index}), so they cannot run as one scanned layer; set "
            "scan_layers=false for this model")


def find_stacks(model: nn.Module, blocks: Sequence[nn.Module]) -> list[tuple[str, nn.ModuleList]]:
    """The ``ModuleList`` s of ``model`` (qualified name, list) whose children are all among ``blocks`` (the FSDP
    units or the selected blocks), with at least two children."""
    wanted = {id(b) for b in blocks}
    return [(name, m) for name, m in model.named_modules()
            if isinstance(m, nn.ModuleList) and len(m) > 1 and all(id(c) in wanted for c in m)]


def is_scanned(model: nn.Module) -> bool:
    """True when ``model`` holds a :class:`ScannedLayers`."""
    return any(isinstance(m, ScannedLayers) for m in model.modules())


class _Config:
    """How one scanned list reaches its layers' code and annotates the stacked weights (set by :func:`install`)."""

    def __init__(self, unwrap: Callable[[nn.Module], nn.Module], remat: bool, annotations: "ScanAnnotations") -> None:
        self.unwrap = unwrap
        self.remat = remat
        self.annotations = annotations
        self.bodies: dict[Any, Callable] = {}  # traced once per static signature (scan's cache is keyed by the body)


class ScanAnnotations:
    """What the engine tells the scan about its devices; the defaults: no sharding, nothing to materialize."""

    def spec(self, tensor: torch.Tensor) -> Optional[tuple]:
        """``tensor``'s partition spec (one entry per dimension), or None when it has no sharding."""
        return None

    def mark(self, tensor: torch.Tensor, spec: tuple) -> None:
        """Annotate ``tensor`` with the partition spec ``spec``."""

    def output(self, tensor: torch.Tensor) -> None:
        """Annotate the scan's final hidden states like a block's output."""

    def materialize(self, tensors: list[torch.Tensor]) -> None:
        """Compute ``tensors`` in one graph (the per-layer slices a ``state_dict`` hands out)."""

    def restacked(self, layers: list[torch.Tensor], stacked: nn.Parameter) -> None:
        """The parameters ``layers`` now live in ``stacked`` (e.g. their fp32 master copies follow)."""


class _Stacked:
    """One scanned list's weights: ``rel`` (a parameter's name inside one layer) -> the ``(N, ...)`` parameter, the
    owner-relative ``state_dict`` keys of its N slices, and one layer's partition spec."""

    def __init__(self, attr: str) -> None:
        self.attr = attr  # the owner's attribute holding the stacked copy
        self.params: dict[str, nn.Parameter] = {}
        self.keys: dict[str, list[str]] = {}
        self.specs: dict[str, Optional[tuple]] = {}


class ScannedLayers(nn.ModuleList):
    """A ``ModuleList`` of identical layers that its owner's ``forward`` iterates as one :class:`ScanStep`.

    Everywhere else (wrapping, ``state_dict``, PEFT, ``len``, indexing by int) it is the plain list it was.
    """

    _scan: _Config
    _scan_active: bool
    _stacked: _Stacked

    def __iter__(self) -> Iterator[nn.Module]:
        if getattr(self, "_scan_active", False):
            return iter([ScanStep(list(self._modules.values()), self._scan, self._stacked, slice(None))])
        return super().__iter__()

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            layers = list(self._modules.values())[idx]
            if getattr(self, "_scan_active", False):
                return _ScannedSlice(layers, self._scan, self._stacked, idx)
            return nn.ModuleList(layers)
        return super().__getitem__(idx)


class _ScannedSlice:
    """What ``layers[:n]`` is inside the owner's forward: iterating it yields one :class:`ScanStep`."""

    def __init__(self, layers: list[nn.Module], config: _Config, stacked: _Stacked, part: slice) -> None:
        self._layers, self._config, self._stacked, self._part = layers, config, stacked, part

    def __iter__(self) -> Iterator[Any]:
        return iter([ScanStep(self._layers, self._config, self._stacked, self._part)] if self._layers else [])

    def __len__(self) -> int:
        return len(self._layers)


def _recording_outputs() -> bool:
    """True when transformers is collecting per-layer outputs (``output_hidden_states``/``output_attentions``)
    through hooks, which only an unrolled loop can feed."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # another transformers layout: nothing records through that path
        return False
    try:
        return bool(_active_collector.get())
    except LookupError:
        return False


def _is_cache(value: Any) -> bool:
    try:
        from transformers.cache_utils import Cache
    except ImportError:
        return False
    return isinstance(value, Cache)


@contextlib.contextmanager
def _plain_forward(layer: nn.Module) -> Iterator[None]:
    """Run ``layer`` without its own activation checkpointing (``checkpoint_module``'s patched forward,
    transformers' ``gradient_checkpointing``): the scan recomputes activations itself, and neither runs traced."""
    patched = layer.__dict__.get("forward") if "_xla_checkpointed_forward_original" in layer.__dict__ else None
    flags = [(m, m.gradient_checkpointing) for m in layer.modules() if getattr(m, "gradient_checkpointing", False) is True]
    try:
        if patched is not None:
            layer.forward = layer._xla_checkpointed_forward_original
        for m, _ in flags:
            m.gradient_checkpointing = False
        yield
    finally:
        if patched is not None:
            layer.forward = patched
        for m, value in flags:
            m.gradient_checkpointing = value


class ScanStep:
    """Every layer of a :class:`ScannedLayers` in one call: ``step(hidden_states, *args, **kwargs)`` returns what the
    last layer would have returned. Attributes read by the owner's loop (e.g. ``attention_type``) are the first
    layer's, which every layer shares (:func:`check_homogeneous`)."""

    def __init__(self, layers: list[nn.Module], config: _Config, stacked: _Stacked, part: slice) -> None:
        self._layers, self._config, self._stacked, self._part = layers, config, stacked, part

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config.unwrap(self._layers[0]), name)

    def _weights(self) -> dict[str, torch.Tensor]:
        """The stacked weights of the layers this step runs (a slice of them for ``layers[:n]``)."""
        whole = self._part == slice(None)
        return {rel: p if whole else p[self._part] for rel, p in self._stacked.params.items()}

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        layers = self._layers
        first = self._config.unwrap(layers[0])
        caches = [v for v in tree_flatten((args, kwargs))[0] if _is_cache(v)]
        filled = any(c.get_seq_length() > 0 for c in caches)
        if (caches and (not first.training or filled)) or _recording_outputs() or len(layers) < 2:
            return self._unrolled(hidden_states, args, kwargs)
        return self._scanned(hidden_states, args, kwargs)

    def _unrolled(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        """Layer by layer, each with its slice of the stacked weights (a filled KV cache, recorded outputs)."""
        weights = self._weights()
        out: Any = hidden_states
        for i, layer in enumerate(self._layers):
            inner = self._config.unwrap(layer)
            hidden = out[0] if isinstance(out, tuple) else out
            out = torch.func.functional_call(inner, {rel: w[i] for rel, w in weights.items()}, (hidden, *args), kwargs,
                                             strict=False)
        return out

    def _scanned(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        config = self._config
        inner = [config.unwrap(layer) for layer in self._layers]
        first = inner[0]
        n = len(inner)

        # the stacked weights are the loop's inputs; buffers (few, never trained) are stacked here
        stacked = self._weights()
        for name, _ in first.named_buffers():
            stacked[name] = torch.stack([m.get_buffer(name) for m in inner])
        names = list(stacked)

        # the other arguments: tensors enter the loop as per-layer inputs, the rest are constants of the body
        leaves, spec = tree_flatten((args, kwargs))
        tensor_slots, inputs, constants = [], [], []
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor):
                tensor_slots.append(i)
                is_bool = leaf.dtype == torch.bool  # a boolean loop input does not trace: it crosses as float
                value = leaf.to(torch.float32) if is_bool else leaf
                inputs.append(value.unsqueeze(0).expand(n, *value.shape))
                constants.append(("bool" if is_bool else "tensor", None))
            elif _is_cache(leaf):
                constants.append(("const", None))  # training: the layers write no cache
            else:
                constants.append(("const", leaf))
        key = (spec, tuple((kind, value if _hashable(value) else id(value)) for kind, value in constants),
               tuple(names), first.training, n)
        body = config.bodies.get(key)
        if body is None:
            body = _make_body(first, names, spec, constants, tensor_slots)
            config.bodies[key] = body
        partition_fn = None
        if config.remat or any(getattr(m, "gradient_checkpointing", False) is True for m in first.modules()) \
                or "_xla_checkpointed_forward_original" in first.__dict__:
            from functorch.compile import min_cut_rematerialization_partition

            partition_fn = min_cut_rematerialization_partition
        extra = {"partition_fn": partition_fn} if partition_fn is not None else {}
        final = _scan(body, hidden_states, (stacked, tuple(inputs)), **extra)
        config.annotations.output(final)
        meta = body.output_tail  # type: ignore[attr-defined]
        return final if meta is None else (final, *meta)


def _scan(body: Callable, init: torch.Tensor, xs: Any, **options: Any) -> torch.Tensor:
    """``torch_xla.experimental.scan.scan(body, init, xs)``'s final carry, with a backward that works without jax.

    Under SPMD, torch_xla's own backward ties each gradient's sharding to its input's with jax's ``shard_alike``,
    which needs jax and torchax in the process (torchax renames PyTorch's PrivateUse1 backend: pinned-memory data
    loaders then fail). Here the gradients of the stacked weights get their sharding from the stacked parameters
    they accumulate into, so the plain backward is used.
    """
    from torch_xla.experimental import scan as xscan

    forward, alias_input, backward = xscan.value_and_grad_partitioned(body, init, xs, is_fn_pure=True, **options)
    carry, _ = _scan_function().apply(forward, alias_input, backward, init, xs)
    return carry


@functools.cache
def _scan_function() -> type:
    """torch_xla's ``Scan`` autograd function (same forward) with the backward loop run as traced, no ``shard_as``."""
    from torch_xla.experimental import scan as xscan
    from torch_xla.experimental.pytreeify import pytreeify

    @pytreeify
    class _Scan(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, forward: Callable, alias_input: Callable, backward: Callable, init: Any, xs: Any) -> Any:
            with torch.no_grad():
                carry, ys = xscan._scan_impl_pytree(forward, init, xs)
                ys, partial_activations = ys
            activations = alias_input(partial_activations, xs)
            ctx._backward = backward
            xscan._save_for_backward(ctx, {"init": init, "xs": xs, "activations": activations})
            return carry, ys

        @staticmethod
        def backward(ctx: Any, grad_carry: Any, grad_ys: Any) -> Any:
            saved = xscan._load_from_context(ctx)
            with torch.no_grad():
                grad_init, grad_xs = xscan._scan_impl_pytree(ctx._backward, grad_carry,
                                                             (grad_ys, saved["activations"]), reverse=True)
            return None, None, None, grad_init, grad_xs

    return _Scan


def _hashable(value: Any) -> bool:
    try:
        hash(value)
    except TypeError:
        return False
    return True


def _make_body(layer: nn.Module, names: list[str], spec: Any, constants: list[tuple[str, Any]],
               tensor_slots: list[int]) -> Callable:
    """The scan body for one static signature: run ``layer``'s code with one layer's weights and inputs."""

    def body(carry: torch.Tensor, xs: tuple[dict[str, torch.Tensor], tuple[torch.Tensor, ...]]) -> tuple[torch.Tensor, None]:
        weights, inputs = xs
        leaves = [value for _, value in constants]
        for slot, (kind, _), value in zip(tensor_slots, [constants[s] for s in tensor_slots], inputs):
            leaves[slot] = value.to(torch.bool) if kind == "bool" else value
        args, kwargs = tree_unflatten(leaves, spec)
        with _plain_forward(layer):
            out = torch.func.functional_call(layer, weights, (carry, *args), kwargs, strict=False)
        if isinstance(out, tuple):
            if any(isinstance(t, torch.Tensor) for t in out[1:]):
                raise ConfigError(f"scan_layers: {type(layer).__name__} returns tensors besides its hidden states "
                                  "(attention weights?), which a scan cannot carry; set scan_layers=false")
            body.output_tail = tuple(out[1:])  # type: ignore[attr-defined]
            out = out[0]
        else:
            body.output_tail = None  # type: ignore[attr-defined]
        return out, None

    body.output_tail = None  # type: ignore[attr-defined]
    return body


def install(model: nn.Module, blocks: Sequence[nn.Module], *, unwrap: Callable[[nn.Module], nn.Module],
            remat: bool = False, annotations: Optional[ScanAnnotations] = None) -> list[str]:
    """Make every list of ``blocks`` in ``model`` a :class:`ScannedLayers` with its weights stored stacked; returns
    the lists' qualified names.

    ``unwrap`` gives a block's own module inside its FSDP unit; ``remat`` recomputes activations in backward;
    ``annotations`` is the engine's sharding of weights and outputs. Refuses, in one line, a model with no such list,
    with layers that differ, or with a weight shared between layers.
    """
    from .. import upstream

    upstream.require("scan")  # torch_xla's scan internals the loop runs on
    stacks = find_stacks(model, blocks)
    if not stacks:
        raise ConfigError(f"scan_layers: {type(model).__name__} has no list of two or more identical blocks (its FSDP "
                          "units) to scan; set scan_layers=false or transformer_layer_cls_to_wrap to its decoder layer class")
    config = _Config(unwrap, remat, annotations or ScanAnnotations())
    owners = {}
    for name, layers in stacks:
        check_homogeneous([unwrap(layer) for layer in layers], f"{type(model).__name__}.{name}")
        parent_name = name.rpartition(".")[0]
        owners[name] = model.get_submodule(parent_name) if parent_name else model
    for name, layers in stacks:
        if isinstance(layers, ScannedLayers):
            continue
        owner, attr = owners[name], name.rpartition(".")[2]
        stacked = _store_stacked(owner, attr, layers, config)
        layers.__class__ = ScannedLayers
        layers._scan = config
        layers._scan_active = False
        layers._stacked = stacked
        _activate_in_forward(owner, layers)
        _translate_state_dict(owner, stacked, config)
    logger.info("scan_layers: %s run as one scanned layer each", ", ".join(f"{n} ({len(m)} layers)" for n, m in stacks))
    return [name for name, _ in stacks]


def _skeleton(module: nn.Module) -> nn.Module:
    """A copy of ``module``'s tree (same classes and attributes: what transformers' weight-decay grouping looks at)
    without parameters, buffers or hooks: the holder of the stacked weights, never called."""
    clone = object.__new__(type(module))
    clone.__dict__.update(module.__dict__)
    for key, value in module.__dict__.items():
        if "hooks" in key and isinstance(value, dict):
            clone.__dict__[key] = type(value)()
    clone.__dict__["_parameters"] = {}
    clone.__dict__["_buffers"] = {}
    clone.__dict__["_non_persistent_buffers_set"] = set()
    clone.__dict__["_modules"] = {k: _skeleton(v) for k, v in module._modules.items() if v is not None}
    return clone


def _store_stacked(owner: nn.Module, attr: str, layers: nn.ModuleList, config: _Config) -> _Stacked:
    """Move the layers' parameters into ``(N, ...)`` parameters of a skeleton registered as ``owner.<attr>_scanned``."""
    inner = [config.unwrap(layer) for layer in layers]
    key_of = {id(p): n for n, p in owner.named_parameters(remove_duplicate=False)}
    skeleton = _skeleton(inner[0])
    out = _Stacked(attr + "_scanned")
    for rel, _ in list(inner[0].named_parameters()):
        tensors = [m.get_parameter(rel) for m in inner]
        if len({id(t) for t in tensors}) != len(tensors):
            raise ConfigError(f"scan_layers: {rel} is one weight shared by several layers of {type(owner).__name__}."
                              f"{attr}, which stacking would duplicate; set scan_layers=false for this model")
        spec = config.annotations.spec(tensors[0])
        with torch.no_grad():
            stacked = nn.Parameter(torch.stack([t.detach() for t in tensors]), requires_grad=tensors[0].requires_grad)
        if spec is not None:  # the layer axis stays whole (the loop walks it); each layer's slice keeps its split
            config.annotations.mark(stacked, (None, *spec))
        config.annotations.restacked(tensors, stacked)
        config.annotations.materialize([stacked])  # one weight at a time: the layers' copies go as the stack comes
        prefix, _, leaf = rel.rpartition(".")
        skeleton.get_submodule(prefix).register_parameter(leaf, stacked)
        out.params[rel], out.specs[rel] = stacked, spec
        out.keys[rel] = [key_of[id(t)] for t in tensors]
        for m in inner:
            del m.get_submodule(prefix)._parameters[leaf]
    owner.add_module(out.attr, skeleton)
    return out


_SLICES = threading.local()


@contextlib.contextmanager
def names_only() -> Iterator[None]:
    """``state_dict()`` inside gives the layers' slices as lazy views: nothing computed or copied (for code that
    needs the names and shapes only, e.g. a restore, which writes the stacked parameters itself)."""
    _SLICES.lazy = True
    try:
        yield
    finally:
        _SLICES.lazy = False


def _translate_state_dict(owner: nn.Module, stacked: _Stacked, config: _Config) -> None:
    """``owner.state_dict()`` names each layer's slice as the unrolled model would; ``load_state_dict`` stacks them."""

    def to_layers(module: nn.Module, state: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        lazy = getattr(_SLICES, "lazy", False)
        slices = []
        for rel in stacked.params:
            value = state.pop(f"{prefix}{stacked.attr}.{rel}", None)
            if value is None:
                continue
            for i, key in enumerate(stacked.keys[rel]):
                if lazy:
                    state[prefix + key] = value[i]
                    continue
                piece = value[i].clone()  # its own tensor (a view would be synced without its sharding)
                if stacked.specs[rel] is not None:
                    config.annotations.mark(piece, stacked.specs[rel])
                state[prefix + key] = piece
                slices.append(piece)
        config.annotations.materialize(slices)  # one graph for every slice, not one per tensor read

    def to_stacked(state: dict[str, Any], prefix: str, *args: Any) -> None:
        for rel in stacked.params:
            keys = [prefix + key for key in stacked.keys[rel]]
            if all(key in state for key in keys):
                state[f"{prefix}{stacked.attr}.{rel}"] = torch.stack([state.pop(key) for key in keys])

    owner._register_state_dict_hook(to_layers)
    owner._register_load_state_dict_pre_hook(to_stacked)


def stacked_weights(model: nn.Module) -> list[tuple[nn.Parameter, list[str]]]:
    """Each stacked parameter of ``model`` with the names (relative to ``model``, as its ``state_dict`` gives them)
    of its per-layer slices, in order."""
    out = []
    for name, module in model.named_modules():
        if isinstance(module, ScannedLayers):
            owner = name.rpartition(".")[0]
            prefix = owner + "." if owner else ""
            for rel, param in module._stacked.params.items():
                out.append((param, [prefix + key for key in module._stacked.keys[rel]]))
    return out


def stacked_origins(model: nn.Module) -> dict[str, list[str]]:
    """Name of each stacked parameter in ``model.named_parameters()`` -> the ``state_dict`` names of its slices."""
    by_id = {id(p): names for p, names in stacked_weights(model)}
    return {name: by_id[id(p)] for name, p in model.named_parameters() if id(p) in by_id}


def _activate_in_forward(owner: nn.Module, layers: ScannedLayers) -> None:
    """The list scans only while ``owner.forward`` runs (the model's own loop), never for code that walks it."""

    def start(module: nn.Module, args: Any, kwargs: Any) -> None:
        layers._scan_active = True

    def stop(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        layers._scan_active = False

    owner.register_forward_pre_hook(start, with_kwargs=True)
    owner.register_forward_hook(stop, with_kwargs=True, always_call=True)
