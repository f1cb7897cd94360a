"""Which blocks become FSDP units (nested ZeRO-3) or stay inside the root unit (ZeRO-2).

The selection follows torch_xla's auto-wrap decision procedure on module classes or sizes, on any model
(a ``meta`` skeleton too); the wrapping itself is the engine's, called by the session.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Sequence

from torch import nn

from ..errors import ConfigError

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

logger = logging.getLogger(__name__)

__all__ = ["BlockPlan", "plan_blocks", "replace_submodule", "resolve_classes", "select_blocks"]


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


def transformer_policy(module: nn.Module, recurse: bool, unwrapped_params: int, classes: tuple[type, ...]) -> bool:
    """torch_xla's ``transformer_auto_wrap_policy``: always recurse; wrap instances of ``classes``."""
    return True if recurse else isinstance(module, classes)


#: torch_xla's (and torch's) ``size_based_auto_wrap_policy`` defaults: a MultiheadAttention is never split, containers
#: never become units
FORCE_LEAF_MODULES = (nn.MultiheadAttention,)
EXCLUDE_WRAP_MODULES = (nn.ModuleList, nn.ModuleDict)


def size_policy(module: nn.Module, recurse: bool, unwrapped_params: int, min_num_params: int) -> bool:
    """torch_xla's ``size_based_auto_wrap_policy`` with its default leaf and excluded modules."""
    is_large = unwrapped_params >= min_num_params
    if recurse:
        return is_large and not isinstance(module, FORCE_LEAF_MODULES)
    return is_large and not isinstance(module, EXCLUDE_WRAP_MODULES)


def _wrap_policy(model: nn.Module, plugin: "XlaFsdpPlugin") -> Callable[..., bool]:
    # torch_xla's two policies, written out: selecting blocks must not import torch_xla (engine fsdp2, the planner)
    if plugin.min_num_params > 0:
        return functools.partial(size_policy, min_num_params=plugin.min_num_params)
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
    return functools.partial(transformer_policy, classes=tuple(resolve_classes(model, names)))


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


@dataclass(frozen=True)
class BlockPlan:
    """The blocks a model's wrapping touches, and whether each becomes its own FSDP unit."""

    #: qualified names of the selected blocks, innermost first (activation checkpointing wraps each)
    names: list[str]
    #: ZeRO-3: every selected block is its own unit; ZeRO-2: the root unit holds them all
    nested: bool

    @property
    def units(self) -> list[str]:
        """The blocks that become FSDP units of their own."""
        return self.names if self.nested else []


def plan_blocks(model: nn.Module, plugin: "XlaFsdpPlugin") -> BlockPlan:
    """Where ``plugin`` wraps ``model``: the one place that turns ``sharding`` into nested units or not."""
    return BlockPlan(select_blocks(model, plugin), nested=plugin.sharding == "zero3")


def replace_submodule(root: nn.Module, name: str, new: nn.Module) -> None:
    """Put ``new`` where ``root.get_submodule(name)`` was."""
    parent_name, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent_name) if parent_name else root, child, new)
