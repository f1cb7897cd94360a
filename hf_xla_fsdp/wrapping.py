"""Choosing the blocks that become FSDP units and wrapping them (nested ZeRO-3 or root-only ZeRO-2)."""

from __future__ import annotations

import functools
import logging
from typing import Callable, Iterator

from torch import nn

from .plugin import ConfigError, XlaFsdpPlugin, resolve_classes

logger = logging.getLogger(__name__)


def fsdp_class() -> type:
    """``XlaFullyShardedDataParallel`` (imported lazily: importing torch_xla starts its runtime)."""
    from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

    return XlaFullyShardedDataParallel


def fsdp_classes() -> tuple[type, ...]:
    """The FSDP unit classes of both engines: v1 ``XlaFullyShardedDataParallel``, v2 ``SpmdFullyShardedDataParallel``."""
    from .spmd import spmd_class

    return fsdp_class(), spmd_class()


def is_wrapped(model: nn.Module) -> bool:
    """True when ``model`` or any submodule is already an XLA FSDP unit (either engine)."""
    try:
        classes = fsdp_classes()
    except ImportError:
        return False
    return any(isinstance(m, classes) for m in model.modules())


def is_v2(model: nn.Module) -> bool:
    """True when ``model`` is (or holds) an FSDP v2 (SPMD) unit."""
    from .spmd import spmd_class

    return any(isinstance(m, spmd_class()) for m in model.modules())


def _wrap_policy(model: nn.Module, plugin: XlaFsdpPlugin) -> Callable[..., bool]:
    from torch_xla.distributed.fsdp.wrap import size_based_auto_wrap_policy, transformer_auto_wrap_policy

    if plugin.min_num_params > 0:
        return functools.partial(size_based_auto_wrap_policy, min_num_params=plugin.min_num_params)
    names = plugin.transformer_layer_cls_to_wrap
    if names is None:
        present = {type(m).__name__ for m in model.modules()}
        # _no_split_modules may list classes of composite siblings that this model does not contain
        names = sorted(n for n in (getattr(model, "_no_split_modules", None) or ()) if n in present)
        if not names:
            logger.warning(
                "%s has no _no_split_modules; only the root is wrapped. Set transformer_layer_cls_to_wrap "
                "or min_num_params to get nested FSDP units.", type(model).__name__,
            )
            return lambda **_: False
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls=resolve_classes(model, names))


def select_blocks(model: nn.Module, plugin: XlaFsdpPlugin) -> list[str]:
    """Qualified names of the modules that become their own FSDP unit, innermost first.

    Follows torch_xla's ``_recursive_wrap`` decision procedure exactly, but only names the
    modules, so it works on a ``meta`` skeleton and no module is touched.
    """
    policy = _wrap_policy(model, plugin)
    chosen: list[str] = []

    def visit(module: nn.Module, name: str) -> int:
        num_params = sum(p.numel() for p in module.parameters())
        if not policy(module=module, recurse=True, unwrapped_params=num_params):
            return 0
        wrapped = sum(visit(child, f"{name}.{cname}" if name else cname) for cname, child in module.named_children())
        if name and policy(module=module, recurse=False, unwrapped_params=num_params - wrapped):
            chosen.append(name)
            return num_params
        return wrapped

    visit(model, "")
    return chosen


def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``root.get_submodule(name)`` was."""
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)


def wrap_block(block: nn.Module, plugin: XlaFsdpPlugin, nested: bool) -> nn.Module:
    """Activation-checkpoint ``block`` if asked, and make it an FSDP unit when ``nested``."""
    if plugin.version == 2:
        from . import spmd

        return spmd.wrap_block(block, plugin, nested)
    if plugin.activation_checkpointing:
        from torch_xla.distributed.fsdp import checkpoint_module

        block = checkpoint_module(block)
    if nested:
        block = fsdp_class()(block, **plugin.fsdp_kwargs())
    return block


def wrap_root(model: nn.Module, plugin: XlaFsdpPlugin) -> nn.Module:
    """The outer FSDP unit: shards every parameter no inner unit owns."""
    if plugin.version == 2:
        from . import spmd

        return spmd.wrap_root(model, plugin)
    if getattr(model.config, "use_cache", False) and plugin.activation_checkpointing:
        model.config.use_cache = False  # a KV cache is incompatible with recomputed activations
    return fsdp_class()(model, **plugin.fsdp_kwargs())


def check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model that already holds XLA FSDP units: wrapping twice would shard shards."""
    if is_wrapped(model):
        unit = next(type(m).__name__ for m in model.modules() if isinstance(m, fsdp_classes()))
        raise ConfigError(
            f"{type(model).__name__} is already wrapped with {unit}; "
            "pass the unwrapped model to XlaFsdpPlugin.wrap (or use it as it is)"
        )


def wrap_model(model: nn.Module, plugin: XlaFsdpPlugin) -> nn.Module:
    """Nested (zero3) or root-only (zero2) XLA FSDP wrapping of an eager ``model``."""
    check_not_wrapped(model)
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("the model has parameters on the meta device; use XlaFsdpPlugin.build to materialize it")
    nested = plugin.sharding == "zero3"
    for name in select_blocks(model, plugin):
        replace_submodule(model, name, wrap_block(model.get_submodule(name), plugin, nested))
    return wrap_root(model, plugin)


def fsdp_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, unit)`` for every XLA FSDP unit in ``model``, either engine (the root has name ``""``)."""
    classes = fsdp_classes()
    for name, module in model.named_modules():
        if isinstance(module, classes):
            yield name, module


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside an FSDP unit (and its parameter-flattening wrapper), or ``model``."""
    from torch_xla.distributed.fsdp.xla_flatten_params_wrapper import XlaFlattenParamsWrapper

    classes = (*fsdp_classes(), XlaFlattenParamsWrapper)
    while isinstance(model, classes):
        model = model.module
    return model
