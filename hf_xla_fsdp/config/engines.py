"""The settings' rules about engines, derived from what each engine declares (``hf_xla_fsdp.engines.ENGINES``).

Nothing here names an engine: which spellings of ``engine`` select which engine, the default, which settings an
engine honours or refuses, and which accelerate ``distributed_type`` it runs under are read from the engines'
declarations (:class:`hf_xla_fsdp.engines.base.Engine`), so a new engine is known here the moment it is registered.
Every function reads the registry when called (never a copy made at import).
"""

from __future__ import annotations

from typing import Any, Collection, Optional

from ..engines import ENGINES
from ..engines.base import Engine
from ..errors import ConfigError


def engine_label(key: Any) -> str:
    """How messages name an engine: ``engine=<key>``."""
    return f"engine={key}"


def engine_spellings() -> tuple[str, ...]:
    """Every value the ``engine`` setting accepts: the keys, then the older spellings (aliases)."""
    aliases = [a for engine in ENGINES.values() for a in engine.aliases if a not in ENGINES]
    return tuple(ENGINES) + tuple(dict.fromkeys(aliases))


def allowed_engines() -> str:
    """The allowed values of ``engine``, for messages: ``'xla_v1' (title), ...``."""
    return ", ".join(f"{key!r} ({engine.title})" for key, engine in ENGINES.items())


def versioned() -> dict[int, Engine]:
    """The engines the older ``version`` setting selects, by version."""
    return {engine.version: engine for engine in ENGINES.values() if engine.version is not None}


def select_engine(spelling: Optional[str], version: Optional[int]) -> Engine:
    """The engine ``engine=spelling`` (a key or an alias) with the older ``version`` setting selects; ``spelling``
    None: the engine of ``version``. One line when they name no engine, or two different ones."""
    if spelling is None:
        by_version = versioned()
        if version not in by_version:
            raise ConfigError(f"version={version!r} is not valid; allowed values: "
                              + ", ".join(f"{v} (engine={e.key}, {e.title})" for v, e in sorted(by_version.items())))
        return by_version[version]
    text = str(spelling).strip().lower()
    if text in ENGINES:
        engine = ENGINES[text]
        if version is not None and version != engine.version:
            raise ConfigError(_version_conflict(version, engine))
        return engine
    named = [engine for engine in ENGINES.values() if text in engine.aliases]
    if not named:
        raise ConfigError(f"engine={spelling!r} is not valid; allowed values: {allowed_engines()} (or leave it unset)")
    if version is None:
        return named[0]
    for engine in named:
        if engine.version == version:
            return engine
    raise ConfigError(f"engine={text}, version={version!r} name no engine; allowed versions with engine={text}: "
                      + ", ".join(f"{e.version} (engine={e.key})" for e in named if e.version is not None))


def _version_conflict(version: Any, engine: Engine) -> str:
    owners = [e for e in ENGINES.values() if e.version == version]
    if engine.version is None:
        return (f"version applies to {' or '.join(engine_label(e.key) for e in versioned().values())} only; remove it "
                f"for {engine_label(engine.key)}")
    selects = f" selects {engine_label(owners[0].key)}" if owners else " names no engine"
    return f"version={version!r}{selects}, not {engine_label(engine.key)}; remove version (engine names the engine)"


def default_engine(changed: Collection[str] = ()) -> Engine:
    """The engine of settings that name none: the first registered engine whose runtime is installed, unless it does
    not honour a setting in ``changed`` (set to another value than its default): then the first registered engine
    (what the library was made for; its own checks then name the setting)."""
    first = next(iter(ENGINES.values()))
    installed = next((e for e in ENGINES.values() if e.missing_runtime() is None), first)
    if any(installed.key not in honouring(name) for name in changed):
        return first
    return installed


def honouring(setting: str) -> tuple[str, ...]:
    """The keys of the engines that honour ``setting``: those listing it in their ``honours``, or every engine when
    none lists it."""
    listed = tuple(key for key, engine in ENGINES.items() if setting in engine.honours)
    return listed or tuple(ENGINES)


def refused(setting: str) -> dict[str, tuple[tuple[Any, ...], str]]:
    """Engine key -> (the values of ``setting`` it refuses, why), for the engines refusing any."""
    return {key: engine.refuses[setting] for key, engine in ENGINES.items() if setting in engine.refuses}


def launchers(key: str) -> tuple[tuple[str, ...], str]:
    """The accelerate ``distributed_type`` values engine ``key`` runs under, and the fix when a launch says another."""
    engine = ENGINES[key]
    return engine.launchers, engine.launcher_fix


def xla_spellings() -> tuple[str, ...]:
    """The ``engine`` values naming an engine that runs on torch_xla (what transformers' ``"xla": true`` means)."""
    return tuple(s for s in engine_spellings() if _runs_on_xla(s))


def _runs_on_xla(spelling: str) -> bool:
    engines = [ENGINES[spelling]] if spelling in ENGINES else [e for e in ENGINES.values() if spelling in e.aliases]
    return all(e.runtime_module == "torch_xla" for e in engines)


def one_process_engines() -> list[Engine]:
    """The engines that drive every device from one process (SPMD) on torch_xla: what accelerate's
    ``fsdp_version: 2`` with ``distributed_type: NO`` can mean there."""
    return [e for e in ENGINES.values() if e.spmd and "NO" in e.launchers and e.runtime_module == "torch_xla"]


def torch_fsdp2_engine() -> Engine:
    """The engine accelerate's ``fsdp_version: 2`` (torch's ``fully_shard``) means."""
    return next(e for e in ENGINES.values() if e.torch_fsdp2)


__all__ = ["allowed_engines", "default_engine", "engine_label", "engine_spellings", "honouring", "launchers",
           "one_process_engines", "refused", "select_engine", "torch_fsdp2_engine", "versioned", "xla_spellings"]
