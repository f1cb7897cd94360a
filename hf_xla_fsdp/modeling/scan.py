"""Scan over layers: a decoder stack compiles as one layer in a loop instead of N unrolled copies.

XLA compiles a traced graph whole, so an unrolled stack of N identical blocks costs N times one block's compile
time. :func:`install` turns the ``nn.ModuleList`` that holds a model's blocks into a :class:`ScannedLayers`: the same
list (same children, same parameter names: checkpoints, meta-device construction, PEFT and consolidation see nothing
new), except while its owner's ``forward`` runs. There, iterating the list (``for layer in self.layers``,
``self.layers[:n]``) yields a single :class:`ScanStep`, whose one call runs every block through
``torch_xla.experimental.scan.scan`` with each weight stacked over the layers at run time, so the model's own loop
body runs once and the graph holds one block.

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
from typing import Any, Callable, Iterator, Optional, Sequence

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_unflatten

from ..errors import ConfigError

logger = logging.getLogger(__name__)

__all__ = ["ScanStep", "ScannedLayers", "check_homogeneous", "find_stacks", "install", "is_scanned"]

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

    def __init__(self, unwrap: Callable[[nn.Module], nn.Module], remat: bool,
                 shard_stacked: Optional[Callable[[torch.Tensor, torch.Tensor], None]],
                 shard_output: Optional[Callable[[torch.Tensor], None]]) -> None:
        self.unwrap = unwrap
        self.remat = remat
        self.shard_stacked = shard_stacked
        self.shard_output = shard_output
        self.bodies: dict[Any, Callable] = {}  # traced once per static signature (scan's cache is keyed by the body)


class ScannedLayers(nn.ModuleList):
    """A ``ModuleList`` of identical layers that its owner's ``forward`` iterates as one :class:`ScanStep`.

    Everywhere else (wrapping, ``state_dict``, PEFT, ``len``, indexing by int) it is the plain list it was.
    """

    _scan: _Config
    _scan_active: bool

    def __iter__(self) -> Iterator[nn.Module]:
        if getattr(self, "_scan_active", False):
            return iter([ScanStep(list(self._modules.values()), self._scan)])
        return super().__iter__()

    def __getitem__(self, idx: Any) -> Any:
        if isinstance(idx, slice):
            layers = list(self._modules.values())[idx]
            if getattr(self, "_scan_active", False):
                return _ScannedSlice(layers, self._scan)
            return nn.ModuleList(layers)
        return super().__getitem__(idx)


class _ScannedSlice:
    """What ``layers[:n]`` is inside the owner's forward: iterating it yields one :class:`ScanStep`."""

    def __init__(self, layers: list[nn.Module], config: _Config) -> None:
        self._layers, self._config = layers, config

    def __iter__(self) -> Iterator[Any]:
        return iter([ScanStep(self._layers, self._config)] if self._layers else [])

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

    def __init__(self, layers: list[nn.Module], config: _Config) -> None:
        self._layers, self._config = layers, config

    def __getattr__(self, name: str) -> Any:
        return getattr(self._config.unwrap(self._layers[0]), name)

    def __call__(self, hidden_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        layers = self._layers
        first = self._config.unwrap(layers[0])
        caches = [v for v in tree_flatten((args, kwargs))[0] if _is_cache(v)]
        filled = any(c.get_seq_length() > 0 for c in caches)
        if (caches and (not first.training or filled)) or _recording_outputs() or len(layers) < 2:
            return self._unrolled(hidden_states, args, kwargs)
        return self._scanned(hidden_states, args, kwargs)

    def _unrolled(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        out: Any = hidden_states
        for layer in self._layers:
            out = layer(out[0] if isinstance(out, tuple) else out, *args, **kwargs)
        return out

    def _scanned(self, hidden_states: torch.Tensor, args: tuple, kwargs: dict) -> Any:
        config = self._config
        inner = [config.unwrap(layer) for layer in self._layers]
        first = inner[0]
        n = len(inner)

        # the layers' weights, stacked over the layers (names relative to one layer)
        names = [name for name, _ in first.named_parameters()] + [name for name, _ in first.named_buffers()]
        per_layer = [dict([*m.named_parameters(), *m.named_buffers()]) for m in inner]
        stacked = {}
        for name in names:
            tensors = [weights[name] for weights in per_layer]
            stacked[name] = _Stack.apply(*tensors)
            if config.shard_stacked is not None:
                config.shard_stacked(stacked[name], tensors[0])

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
        if config.shard_output is not None:
            config.shard_output(final)
        meta = body.output_tail  # type: ignore[attr-defined]
        return final if meta is None else (final, *meta)


class _Stack(torch.autograd.Function):
    """``torch.stack`` whose backward gives each layer a gradient of its own: a plain stack's are views of the
    stacked gradient, which XLA would materialize as that one tensor, leaving every slice for the optimizer's graph."""

    @staticmethod
    def forward(ctx: Any, *tensors: torch.Tensor) -> torch.Tensor:
        return torch.stack(tensors)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, ...]:
        return tuple(g.clone() for g in grad.unbind(0))


def _scan(body: Callable, init: torch.Tensor, xs: Any, **options: Any) -> torch.Tensor:
    """``torch_xla.experimental.scan.scan(body, init, xs)``'s final carry, with a backward that works without jax.

    Under SPMD, torch_xla's own backward ties each gradient's sharding to its input's with jax's ``shard_alike``,
    which needs jax and torchax in the process (torchax renames PyTorch's PrivateUse1 backend: pinned-memory data
    loaders then fail). Here the gradients of the stacked weights get their sharding from the weights they flow
    back into (``_Stack``'s backward), so the plain backward is used.
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
            out = torch.func.functional_call(layer, weights, (carry, *args), kwargs, strict=True)
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
            remat: bool = False, shard_stacked: Optional[Callable[[torch.Tensor, torch.Tensor], None]] = None,
            shard_output: Optional[Callable[[torch.Tensor], None]] = None) -> list[str]:
    """Make every list of ``blocks`` in ``model`` a :class:`ScannedLayers`; returns the lists' qualified names.

    ``unwrap`` gives a block's own module inside its FSDP unit; ``remat`` recomputes activations in backward;
    ``shard_stacked(stacked, like)`` annotates a stacked weight like one layer's; ``shard_output`` the final hidden
    states. Refuses, in one line, a model with no such list or with layers that differ.
    """
    stacks = find_stacks(model, blocks)
    if not stacks:
        raise ConfigError(f"scan_layers: {type(model).__name__} has no list of two or more identical blocks (its FSDP "
                          "units) to scan; set scan_layers=false or transformer_layer_cls_to_wrap to its decoder layer class")
    config = _Config(unwrap, remat, shard_stacked, shard_output)
    owners = {}
    for name, layers in stacks:
        check_homogeneous([unwrap(layer) for layer in layers], f"{type(model).__name__}.{name}")
        parent_name = name.rpartition(".")[0]
        owners[name] = model.get_submodule(parent_name) if parent_name else model
    for name, layers in stacks:
        if isinstance(layers, ScannedLayers):
            continue
        layers.__class__ = ScannedLayers
        layers._scan = config
        layers._scan_active = False
        _activate_in_forward(owners[name], layers)
    logger.info("scan_layers: %s run as one scanned layer each", ", ".join(f"{n} ({len(m)} layers)" for n, m in stacks))
    return [name for name, _ in stacks]


def _activate_in_forward(owner: nn.Module, layers: ScannedLayers) -> None:
    """The list scans only while ``owner.forward`` runs (the model's own loop), never for code that walks it."""

    def start(module: nn.Module, args: Any, kwargs: Any) -> None:
        layers._scan_active = True

    def stop(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        layers._scan_active = False

    owner.register_forward_pre_hook(start, with_kwargs=True)
    owner.register_forward_hook(stop, with_kwargs=True, always_call=True)
