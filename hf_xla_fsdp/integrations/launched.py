"""Launched scripts: unmodified scripts whose ``transformers.Trainer`` (and every subclass) and ``accelerate.Accelerator``
build their XLA FSDP versions, under ``hf-xla-fsdp launch`` or any launcher with ``HF_XLA_FSDP=1`` (the start-up hook,
``hf_xla_fsdp_hook.pth``).

:func:`install_launch` patches the upstream classes as their modules load (:mod:`hf_xla_fsdp.importhooks`), so the
script's import order does not matter: ``Trainer.__new__`` builds :func:`launched_trainer_class` of the class asked
for (``XlaFsdpTrainerMixin`` first, as ``xla_fsdp_trainer`` does, so TRL's trainers and the script's own subclasses,
defined anywhere and at any time, keep their own ``__init__`` inside ours); ``Accelerator.__new__`` builds an
``XlaFsdpAccelerator`` (``Accelerator`` itself only: the script's own subclasses stay theirs). The settings are
:func:`launch_settings`'s; the runtime effects (SPMD from ``TrainingArguments``) are
:mod:`hf_xla_fsdp.integrations.startup`'s.
"""

from __future__ import annotations

import contextvars
import json
import os
import sys
from typing import Any, Optional, Sequence, Union

from .. import importhooks
from ..config.keys import read_accelerate_yaml, read_settings_file
from ..config.sources import find_accelerate_config, fsdp_config_from_argv
from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin
from . import startup


def launch_settings(argv: Optional[Sequence[str]] = None, yaml_path: Union[str, os.PathLike, None] = None,
                    fsdp_config: Any = None) -> Optional[XlaFsdpPlugin]:
    """The settings of a launched script (an ``XlaFsdpPlugin``, or ``None`` when no source gives any).

    Sources, in this order: the script's own ``--fsdp_config`` (its Trainer flags, read from ``argv``), the
    ``fsdp_config:`` mapping of the accelerate YAML ``yaml_path``, an explicit ``fsdp_config`` (dict, path or inline
    JSON) given to the launcher. Each contributes the settings it names; two sources that name the same setting, or
    that select different engines (``version``; absent means 1, as ``xla_fsdp_v2`` absent does), with different
    values are a conflict: one line naming both, before anything runs.
    """
    sources: list[tuple[str, dict[str, Any]]] = []

    def add(source: str, settings: Any) -> None:
        if isinstance(settings, (str, os.PathLike)):
            path = str(settings)
            settings = read_settings_file(path, "fsdp_config", json.load, json.JSONDecodeError, "JSON")
            source = f"{source} {path}"
        if not isinstance(settings, dict):
            raise ConfigError(f"{source} must be a JSON object / mapping of settings, got {type(settings).__name__}")
        explicit = XlaFsdpPlugin._normalize(settings, source)
        XlaFsdpPlugin(**explicit)  # each source valid on its own: its own one-line error names it
        sources.append((source, explicit))

    flags = fsdp_config_from_argv(list(argv) if argv is not None else None)
    if flags is not None:
        add("the script's --fsdp_config", flags)
    if yaml_path is not None:
        data = read_accelerate_yaml(yaml_path)
        mapping = data.get("fsdp_config") if isinstance(data, dict) else None
        if mapping:
            add(f"fsdp_config in {yaml_path}", mapping)
    if fsdp_config is not None:
        if isinstance(fsdp_config, str) and fsdp_config.lstrip().startswith("{"):
            try:
                fsdp_config = json.loads(fsdp_config)
            except json.JSONDecodeError as err:
                raise ConfigError(f"--fsdp_config {fsdp_config!r} is not valid JSON: {err}") from None
        add("the launcher's --fsdp_config", fsdp_config)
    if not sources:
        return None
    built = [(source, explicit, XlaFsdpPlugin(**explicit)) for source, explicit in sources]
    merged: dict[str, Any] = {}
    for i, (source, explicit, plugin) in enumerate(built):
        for other_source, other_explicit, other in built[:i]:
            # the engine a source selects is compared even where it is implied (version absent means 1); engine
            # only where both name it (an unnamed one is the installed runtime's default, not a choice)
            for key in sorted({"version"} | (set(explicit) & set(other_explicit))):
                if getattr(plugin, key) != getattr(other, key):
                    raise ConfigError(f"{other_source} and {source} disagree: {key}={getattr(other, key)!r} vs "
                                      f"{getattr(plugin, key)!r}; keep the setting in one place")
        merged = {**explicit, **merged}  # an earlier source's value stands (they agree anyway)
    return XlaFsdpPlugin(**merged)


# --------------------------------------------------------------------------- the start-up hook and the classes
_stock_accelerator = contextvars.ContextVar("hf_xla_fsdp_stock_accelerator", default=False)


def _hook_settings() -> Optional[XlaFsdpPlugin]:
    """Under a stock launcher: the script's ``--fsdp_config`` and the accelerate YAML this process was launched with."""
    return launch_settings(sys.argv[1:], find_accelerate_config())


def install_launch(plugin: Optional[XlaFsdpPlugin] = None, resolve: Optional[Any] = None) -> None:
    """Patch the upstream classes for a launched script (idempotent), as their modules load.

    ``plugin``: the launch settings, known now (``hf-xla-fsdp launch``); ``resolve``: how to find them on first use
    (the start-up hook). ``TrainingArguments`` start SPMD for v2 settings; ``transformers.Trainer`` and its subclasses
    build :func:`launched_trainer_class` instances; ``accelerate.Accelerator`` builds an ``XlaFsdpAccelerator``.
    """
    startup.set_launch_settings(plugin, resolve)
    importhooks.when_imported("transformers.training_args", lambda module: startup.patch_training_arguments())
    importhooks.when_imported("transformers.trainer", _patch_trainer)
    importhooks.when_imported("accelerate.accelerator", _patch_accelerator)


def hooked(module: Any) -> None:
    """The start-up hook's entry (``transformers.training_args``, ``transformers.trainer`` or
    ``accelerate.accelerator`` was just imported): patch for a launched script, settings read on first use."""
    install_launch(resolve=_hook_settings)


class LaunchedTrainerMixin:
    """What a launched script's Trainer adds to XlaFsdpTrainerMixin: the launch settings (the script's own flags merged
    with the YAML's and the launcher's, so they apply with no ``--fsdp`` flag at all), and the stock accelerator its
    base builds. ``TrainingArguments`` made in code with another engine than the launch settings are a conflict."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        plugin = startup.launch_plugin()
        if plugin is not None and kwargs.get("fsdp_plugin") is None:
            training_args = kwargs.get("args", args[1] if len(args) > 1 else None)
            own = getattr(training_args, "fsdp_config", None) or {}
            if getattr(training_args, "fsdp", None) and isinstance(own, dict) and own.get("xla"):
                version = XlaFsdpPlugin.from_fsdp_config(own).version
                if version != plugin.version:
                    raise ConfigError(f"the TrainingArguments' fsdp_config selects FSDP v{version} but the launch "
                                      f"settings select v{plugin.version}; keep the setting in one place")
            kwargs["fsdp_plugin"] = plugin
        super().__init__(*args, **kwargs)

    def create_accelerator_and_postprocess(self) -> None:
        """The base Trainer's own ``Accelerator`` stays stock here (ours replaces it, on the trainer's session)."""
        token = _stock_accelerator.set(True)
        try:
            super().create_accelerator_and_postprocess()  # type: ignore[misc]
        finally:
            _stock_accelerator.reset(token)


_launched_classes: dict[type, type] = {}


def launched_trainer_class(trainer_cls: type) -> type:
    """``trainer_cls`` (``transformers.Trainer`` or a subclass) with XLA FSDP and the launch settings, made once."""
    from transformers import Trainer

    from .trainer import XlaFsdpTrainer, XlaFsdpTrainerMixin, xla_fsdp_trainer

    if issubclass(trainer_cls, (XlaFsdpTrainerMixin, LaunchedTrainerMixin)):
        return trainer_cls
    if trainer_cls not in _launched_classes:
        base = XlaFsdpTrainer if trainer_cls is Trainer else xla_fsdp_trainer(trainer_cls)
        _launched_classes[trainer_cls] = type(base.__name__, (LaunchedTrainerMixin, base),
                                              {"__module__": base.__module__, "__doc__": base.__doc__,
                                               "__qualname__": base.__qualname__})
    return _launched_classes[trainer_cls]


def _trainer_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    # Trainer subclasses defined anywhere (TRL's, the script's) keep their bases; what is built is the same class with
    # XlaFsdpTrainerMixin first, so the subclass's __init__ runs inside ours (as with xla_fsdp_trainer)
    return object.__new__(launched_trainer_class(cls))


def _patch_trainer(module: Any) -> None:
    trainer = module.Trainer
    if "__new__" not in trainer.__dict__:
        trainer.__new__ = staticmethod(_trainer_new)


_launched_accelerator: Optional[type] = None


def _accelerator_new(cls: type, *args: Any, **kwargs: Any) -> Any:
    global _launched_accelerator
    from accelerate import Accelerator

    if cls is Accelerator and not _stock_accelerator.get():
        if _launched_accelerator is None:
            from .accelerate import XlaFsdpAccelerator

            class LaunchedAccelerator(XlaFsdpAccelerator):
                """``accelerate.Accelerator`` in a launched script: an XlaFsdpAccelerator with the launch settings."""

                def __init__(self, *args: Any, **kwargs: Any) -> None:
                    if kwargs.get("fsdp_plugin") is None and kwargs.get("session") is None:
                        kwargs["fsdp_plugin"] = startup.launch_plugin()
                    super().__init__(*args, **kwargs)

            LaunchedAccelerator.__name__ = LaunchedAccelerator.__qualname__ = "XlaFsdpAccelerator"
            _launched_accelerator = LaunchedAccelerator
        cls = _launched_accelerator
    return object.__new__(cls)


def _patch_accelerator(module: Any) -> None:
    accelerator = module.Accelerator
    if "__new__" not in accelerator.__dict__:
        accelerator.__new__ = staticmethod(_accelerator_new)
