"""The FSDP engines behind one seam: :class:`~.base.Engine`, chosen once.

``engine_for(plugin)`` picks the engine a plugin configures (``version``), ``engine_of(model)``
the engine that wrapped a model. Only this package knows which engine runs; a third engine is a
new module here and one line in ``ENGINES``. Importing this package does not import torch_xla.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator

from torch import nn

from ..errors import ConfigError
from .base import Engine, RankState, Restored
from .v1 import XlaFsdpV1
from .v2 import XlaFsdpV2

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

ENGINES: dict[int, Engine] = {engine.version: engine for engine in (XlaFsdpV1(), XlaFsdpV2())}


def engine_versions() -> str:
    """``"1 (FSDP v1 ...), 2 (FSDP v2 ...)"``: the allowed ``version`` values, for messages."""
    return ", ".join(f"{v} = {e.title}" for v, e in sorted(ENGINES.items()))


def engine_for(plugin: "XlaFsdpPlugin") -> Engine:
    """The engine ``plugin.version`` selects."""
    try:
        return ENGINES[plugin.version]
    except KeyError:
        raise ConfigError(f"version={plugin.version!r} is not valid; allowed values: {engine_versions()}") from None


def unit_classes() -> tuple[type, ...]:
    """The FSDP unit class of every engine (imports torch_xla)."""
    return tuple(engine.unit_class() for engine in ENGINES.values())


def _engine_of_unit(module: nn.Module) -> Engine | None:
    for engine in ENGINES.values():
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


__all__ = ["ENGINES", "Engine", "RankState", "Restored", "engine_for", "engine_of", "engine_versions", "fsdp_units",
           "is_wrapped", "unit_classes", "unwrap"]
