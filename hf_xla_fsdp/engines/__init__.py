"""The FSDP engines behind one seam: :class:`~.base.Engine`, chosen once per session.

``engine_for(plugin)`` picks the engine a plugin configures (``version``); the session calls it once and
passes the engine on. ``engine_of(model)`` is the engine that wrapped a model: every unit an engine makes
carries it (``checkpoint.codec.CODEC_ATTR``). Only this package knows which engine runs; a third engine
is a new module here, one line in ``ENGINES`` and one entry in the plugin's ``version`` choices. Importing
this package does not import torch_xla.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional

from torch import nn

from ..checkpoint.codec import CODEC_ATTR, RankState, Restored
from ..errors import ConfigError
from .base import Engine, PlannedUnit, in_evaluation_mode
from .v1 import XlaFsdpV1
from .v2 import XlaFsdpV2

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

ENGINES: dict[int, Engine] = {engine.version: engine for engine in (XlaFsdpV1(), XlaFsdpV2())}


def engine_for(plugin: "XlaFsdpPlugin") -> Engine:
    """The engine ``plugin.version`` selects (the plugin has validated the version already)."""
    try:
        return ENGINES[plugin.version]
    except KeyError:
        raise ConfigError(f"version={plugin.version!r} is not valid; allowed values: "
                          + ", ".join(f"{v} = {e.title}" for v, e in sorted(ENGINES.items()))) from None


def unit_classes() -> tuple[type, ...]:
    """The FSDP unit class of every engine (imports torch_xla)."""
    return tuple(engine.unit_class() for engine in ENGINES.values())


def _engine_of_unit(module: nn.Module) -> Optional[Engine]:
    tagged = module.__dict__.get(CODEC_ATTR)
    if tagged is not None:
        return tagged
    for engine in ENGINES.values():  # a unit made outside this package (e.g. plain XlaFullyShardedDataParallel)
        if isinstance(module, engine.unit_class()):
            return engine
    return None


def engine_of(model: nn.Module) -> Engine:
    """The engine whose FSDP units wrap ``model``."""
    for module in model.modules():
        engine = _engine_of_unit(module)
        if engine is not None:
            return engine
    raise ConfigError(f"{type(model).__name__} is not wrapped with XLA FSDP; wrap it with XlaFsdpPlugin.wrap or build it "
                      "with XlaFsdpPlugin.build first")


def is_wrapped(model: nn.Module) -> bool:
    """True when ``model`` or any submodule is already an XLA FSDP unit (any engine)."""
    if any(CODEC_ATTR in m.__dict__ for m in model.modules()):
        return True
    try:
        classes = unit_classes()
    except ImportError:
        return False
    return any(isinstance(m, classes) for m in model.modules())


def fsdp_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, unit)`` for every XLA FSDP unit in ``model``, any engine (the root has name ``""``)."""
    classes = unit_classes()
    for name, module in model.named_modules():
        if isinstance(module, classes):
            yield name, module


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside FSDP units (and their inner wrappers, e.g. parameter flattening), or ``model``."""
    classes = unit_classes() + tuple(w for e in ENGINES.values() for w in e.inner_wrappers())
    while isinstance(model, classes):
        model = model.module
    return model


__all__ = ["ENGINES", "Engine", "PlannedUnit", "RankState", "Restored", "engine_for", "engine_of", "fsdp_units",
           "in_evaluation_mode", "is_wrapped", "unit_classes", "unwrap"]
