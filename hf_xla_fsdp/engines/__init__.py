"""The FSDP engines behind one seam: :class:`~.base.Engine`, chosen once per session.

``engine_for(plugin)`` is the engine a plugin selects (``plugin.engine``, one of the keys of ``ENGINES``); the session
calls it once and passes the engine on. ``engine_of(model)`` is the engine that wrapped a model: every unit an engine
makes carries it (``checkpoint.codec.CODEC_ATTR``). Only this package knows which engine runs.

Each engine class declares what the rest of the library knows of it (:class:`~.base.Engine`'s declarations: key,
aliases, name, title, launchers, the settings it honours and refuses); the settings' rules
(:mod:`hf_xla_fsdp.config.engines`), the CLI's choices, the settings table and model cards derive from ``ENGINES``.
A new engine is a new module here and one entry in ``ENGINES`` (its order is the preference of the default: the first
engine whose runtime is installed). Importing this package imports neither torch_xla nor any engine's runtime.
"""

from __future__ import annotations

import sys
from typing import Iterator, Optional

from torch import nn

from ..checkpoint.codec import CODEC_ATTR, RankState, Restored
from ..errors import ConfigError
from .base import Engine, EngineSettings, PlannedUnit, in_evaluation_mode
from .fsdp2 import Fsdp2
from .v1 import XlaFsdpV1
from .v2 import XlaFsdpV2

#: every engine by its key, in the order of preference for the default
ENGINES: dict[str, Engine] = {engine.key: engine for engine in (XlaFsdpV1(), XlaFsdpV2(), Fsdp2())}


def engine_for(plugin: EngineSettings, require_runtime: bool = True) -> Engine:
    """The engine ``plugin.engine`` selects (the plugin has validated it already); with ``require_runtime``, one
    line when that engine's runtime is not installed (the planner, which runs nothing, passes False)."""
    try:
        engine = ENGINES[plugin.engine]
    except KeyError:
        raise ConfigError(f"engine={plugin.engine!r} is not valid; allowed values: "
                          + ", ".join(f"{k} = {e.title}" for k, e in ENGINES.items())) from None
    missing = engine.missing_runtime() if require_runtime else None
    if missing:
        raise ConfigError(missing)
    return engine


def _loaded_unit_classes() -> tuple[type, ...]:
    """The unit class of every engine whose runtime this process has imported: a model cannot hold units of a
    library never imported, and asking would import it (torch_xla starts its runtime on import)."""
    out = []
    for engine in ENGINES.values():
        if engine.runtime_module is None or engine.runtime_module in sys.modules:
            try:
                out.append(engine.unit_class())
            except ImportError:
                continue
    return tuple(out)


def unit_classes() -> tuple[type, ...]:
    """The FSDP unit class of every engine whose runtime is imported in this process."""
    return _loaded_unit_classes()


def _engine_of_unit(module: nn.Module) -> Optional[Engine]:
    tagged = module.__dict__.get(CODEC_ATTR)
    if tagged is not None:
        return tagged
    for engine in ENGINES.values():  # a unit made outside this package (e.g. plain XlaFullyShardedDataParallel)
        if (engine.runtime_module is None or engine.runtime_module in sys.modules) and isinstance(module, engine.unit_class()):
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
    classes = unit_classes()
    return any(isinstance(m, classes) for m in model.modules())


def fsdp_units(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """``(name, unit)`` for every XLA FSDP unit in ``model``, any engine (the root has name ``""``)."""
    classes = unit_classes()
    for name, module in model.named_modules():
        if isinstance(module, classes):
            yield name, module


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module inside FSDP units (and their inner wrappers, e.g. parameter flattening), or ``model``."""
    for module in model.modules():
        engine = _engine_of_unit(module)
        if engine is not None:
            return engine.unwrap(model)
    return model


__all__ = ["ENGINES", "Engine", "PlannedUnit", "RankState", "Restored", "engine_for", "engine_of", "fsdp_units",
           "in_evaluation_mode", "is_wrapped", "unit_classes", "unwrap"]
