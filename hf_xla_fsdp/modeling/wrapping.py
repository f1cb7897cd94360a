"""Choosing the blocks that become FSDP units and wrapping them (nested ZeRO-3 or root-only ZeRO-2).

The selection follows torch_xla's auto-wrap decision procedure on module classes or sizes; the
wrapping itself is the engine's (:meth:`~hf_xla_fsdp.engines.base.Engine.wrap_block`).
"""

from __future__ import annotations

import functools
import logging
from typing import TYPE_CHECKING, Callable, Sequence

from torch import nn

from ..engines import engine_for, fsdp_units, is_wrapped, unit_classes, unwrap
from ..errors import ConfigError

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

logger = logging.getLogger(__name__)

__all__ = ["check_not_wrapped", "fsdp_class", "fsdp_classes", "fsdp_units", "is_wrapped", "replace_submodule",
           "resolve_classes", "select_blocks", "unwrap", "wrap_block", "wrap_model", "wrap_root"]


def fsdp_class() -> type:
    """``XlaFullyShardedDataParallel``, FSDP v1's unit class (imported lazily: importing torch_xla starts its runtime)."""
    from ..engines import ENGINES

    return ENGINES[1].unit_class()


def fsdp_classes() -> tuple[type, ...]:
    """The FSDP unit classes of every engine."""
    return unit_classes()


def resolve_classes(model: nn.Module, names: Sequence[str]) -> set[type]:
    """Resolve module class names against the classes that occur in ``model``."""
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(
            f"transformer_layer_cls_to_wrap names {missing} not found in {type(model).__name__}; "
            f"its module classes are: {', '.join(sorted(present))}"
        )
    return {present[n] for n in names}


def _wrap_policy(model: nn.Module, plugin: "XlaFsdpPlugin") -> Callable[..., bool]:
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


def select_blocks(model: nn.Module, plugin: "XlaFsdpPlugin") -> list[str]:
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


def wrap_block(block: nn.Module, plugin: "XlaFsdpPlugin", nested: bool) -> nn.Module:
    """Activation-checkpoint ``block`` if asked, and make it an FSDP unit when ``nested``."""
    return engine_for(plugin).wrap_block(block, plugin, nested)


def wrap_root(model: nn.Module, plugin: "XlaFsdpPlugin") -> nn.Module:
    """The outer FSDP unit: shards every parameter no inner unit owns."""
    return engine_for(plugin).wrap_root(model, plugin)


def check_not_wrapped(model: nn.Module) -> None:
    """Refuse a model that already holds XLA FSDP units: wrapping twice would shard shards."""
    if is_wrapped(model):
        unit = next(type(m).__name__ for m in model.modules() if isinstance(m, unit_classes()))
        raise ConfigError(
            f"{type(model).__name__} is already wrapped with {unit}; "
            "pass the unwrapped model to XlaFsdpPlugin.wrap (or use it as it is)"
        )


def wrap_model(model: nn.Module, plugin: "XlaFsdpPlugin") -> nn.Module:
    """Nested (zero3) or root-only (zero2) XLA FSDP wrapping of an eager ``model``."""
    check_not_wrapped(model)
    if any(p.is_meta for p in model.parameters()):
        raise ConfigError("the model has parameters on the meta device; use XlaFsdpPlugin.build to materialize it")
    engine_for(plugin).setup_runtime(plugin)
    nested = plugin.sharding == "zero3"
    for name in select_blocks(model, plugin):
        replace_submodule(model, name, wrap_block(model.get_submodule(name), plugin, nested))
    return wrap_root(model, plugin)
