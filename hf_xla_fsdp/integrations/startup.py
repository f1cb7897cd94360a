"""Start-up effects, in one place: what must happen in a training process before its script uses the XLA device.

FSDP v2 runs under SPMD, which must start before anything touches the device; transformers' ``TrainingArguments``
touch it as soon as they are built (their ``_setup_devices`` makes accelerate's ``PartialState``). :func:`install`
makes arguments built from then on start SPMD themselves when their ``fsdp_config`` asks for v2, and starts it at
once when the command line's ``--fsdp_config`` does. Importing ``hf_xla_fsdp`` alone runs none of this; importing
the Trainer integration (the one-line swap) does, and so do the launcher and the start-up hook.

accelerate's ``gather_object`` raises ``NotImplementedError`` on XLA; :func:`patch_gather_object` (run when an
``XlaFsdpAccelerator`` is built, never on import) makes it gather there.

Launched scripts (``hf-xla-fsdp launch``, or any launcher with ``HF_XLA_FSDP=1`` through the start-up hook) run
unmodified: :func:`install_launch` makes ``transformers.Trainer`` and every subclass of it (TRL's trainers, the
script's own) and ``accelerate.Accelerator`` build their XLA FSDP versions, whenever and however they are imported,
with the launch settings (:func:`hf_xla_fsdp.config.sources.launch_settings`).
"""

from __future__ import annotations

import contextvars
import functools
import json
import os
import sys
import types
from typing import Any, Callable, Optional

from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin

#: set to 0 to keep every start-up effect off (SPMD is then the script's business)
AUTO_SPMD_ENV = "HF_XLA_FSDP_AUTO_SPMD"


def enable_spmd_if_configured(argv: Optional[list[str]] = None) -> bool:
    """Start SPMD when the command line's ``--fsdp_config`` asks for FSDP v2; returns whether it did.

    A bad config is reported here, before anything runs.
    """
    from ..config.sources import fsdp_config_from_argv
    from ..session import XlaFsdpSession

    settings = fsdp_config_from_argv(argv)
    if settings is None:
        return False
    session = XlaFsdpSession(XlaFsdpPlugin.from_fsdp_config(settings))
    if session.engine.spmd:
        session.setup_runtime()
    return session.engine.spmd


def auto_spmd(fsdp_config: Any, what: str) -> None:
    """Start SPMD when ``fsdp_config`` (dict, path or inline JSON) asks for FSDP v2.

    A config that cannot be read is left for the trainer to report with the other arguments; SPMD that can no
    longer start fails here, with the one line the script needs (never a forced switch, which segfaults later).
    """
    if os.environ.get(AUTO_SPMD_ENV, "1").strip().lower() in ("0", "false", "no") or not fsdp_config:
        return
    from ..session import XlaFsdpSession

    try:
        if isinstance(fsdp_config, str) and fsdp_config.lstrip().startswith("{"):
            fsdp_config = json.loads(fsdp_config)
        session = XlaFsdpSession(XlaFsdpPlugin.from_fsdp_config(fsdp_config))
    except (ConfigError, ValueError, TypeError):  # not ours to judge here: XlaFsdpTrainer reports it with the rest
        return
    if session.engine.spmd:
        session.setup_runtime(what=what)


def patch_training_arguments() -> None:
    """``TrainingArguments`` built from now on start SPMD themselves when their fsdp_config asks for v2.

    Their ``_setup_devices`` (first read in ``__post_init__``) builds accelerate's ``PartialState``, which takes
    the XLA device and counts processes; SPMD has to be on before that, whatever way the config arrived
    (command line, JSON/YAML file, a dict in code, a ``TrainingArguments`` subclass such as TRL's configs).
    Idempotent; on another transformers layout nothing is patched (XlaFsdpTrainer's own check still applies).
    """
    import torch
    from transformers import TrainingArguments

    original = TrainingArguments.__dict__.get("_setup_devices")
    if not isinstance(original, functools.cached_property) or getattr(original.func, "_hf_xla_fsdp", False):
        return

    def _setup_devices(self: TrainingArguments) -> torch.device:
        what = "code that ran before these TrainingArguments were built"
        if getattr(self, "fsdp", None):
            auto_spmd(getattr(self, "fsdp_config", None), what)
        plugin = launch_plugin()  # a launched script: the launch settings may ask for v2 without any flag
        if plugin is not None and plugin.version == 2:
            _setup_runtime(plugin, what)
        return original.func(self)

    _setup_devices._hf_xla_fsdp = True  # type: ignore[attr-defined]
    patched = functools.cached_property(_setup_devices)
    patched.__set_name__(TrainingArguments, "_setup_devices")
    TrainingArguments._setup_devices = patched


def install(argv: Optional[list[str]] = None) -> None:
    """Every start-up effect: ``TrainingArguments`` patched, and SPMD started now when the command line's
    ``--fsdp_config`` (or a lone ``args.json``) asks for FSDP v2, before the script uses the XLA device."""
    from ..config.sources import fsdp_config_from_argv

    patch_training_arguments()
    try:
        settings = fsdp_config_from_argv(argv)
    except Exception:  # an unreadable arguments file (JSON, YAML, I/O): HfArgumentParser reports it
        return
    auto_spmd(settings, "code that ran before hf_xla_fsdp's trainer was imported")


# --------------------------------------------------------------------------- accelerate's gather_object on XLA
_gather_object_on_xla: Optional[Callable[[Any], list[Any]]] = None
_upstream_gather_object: Optional[Callable[[Any], Any]] = None


def gather_object_dispatch(obj: Any) -> Any:
    """What accelerate's ``gather_object`` does once patched: on XLA (where upstream raises ``NotImplementedError``)
    the implementation given to :func:`patch_gather_object`; on any other distributed type upstream's own code."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    if _gather_object_on_xla is not None and PartialState().distributed_type == DistributedType.XLA:
        return _gather_object_on_xla(obj)
    assert _upstream_gather_object is not None  # set together with the patch
    return _upstream_gather_object(obj)


def _patched_gather_object(object: Any) -> Any:  # noqa: A002 - upstream's parameter name, kept for keyword callers
    # only this code object is installed into upstream's function: it names nothing of the module it runs in
    # (upstream's globals), it imports what it needs
    from hf_xla_fsdp.integrations.startup import gather_object_dispatch

    return gather_object_dispatch(object)


def patch_gather_object(on_xla: Callable[[Any], list[Any]]) -> None:
    """accelerate's ``gather_object`` gathers with ``on_xla`` when the distributed type is XLA, however it was
    imported (``accelerate.utils.gather_object``, ``from accelerate.utils import gather_object`` in a script imported
    before this ran, ``Accelerator.gather_for_metrics``, ``verify_operation`` in debug mode).

    Those are all references to one function object, so the patch replaces that object's code rather than a module
    attribute (which the names bound earlier would not see); upstream's own code runs, unchanged, for every other
    distributed type. Idempotent; the latest ``on_xla`` is used.
    """
    global _gather_object_on_xla, _upstream_gather_object
    from accelerate.utils import operations

    target = operations.gather_object
    if target.__code__ is not _patched_gather_object.__code__:
        if target.__code__.co_freevars or target.__code__.co_varnames[:1] != ("object",):
            raise ConfigError("accelerate.utils.operations.gather_object changed shape; hf_xla_fsdp cannot make it "
                              "gather on XLA (`hf-xla-fsdp env` lists the supported accelerate versions)")
        _upstream_gather_object = types.FunctionType(target.__code__, target.__globals__, target.__name__,
                                                     target.__defaults__, target.__closure__)
        target.__code__ = _patched_gather_object.__code__
    _gather_object_on_xla = on_xla


# --------------------------------------------------------------------------- launched scripts
#: the opt-in of the start-up hook (hf_xla_fsdp_hook.pth): set to 1 under any launcher (e.g. `accelerate launch`)
HOOK_ENV = "HF_XLA_FSDP"

_launch: dict[str, Any] = {"resolve": None, "plugin": None, "resolved": False}
_stock_accelerator = contextvars.ContextVar("hf_xla_fsdp_stock_accelerator", default=False)


def _setup_runtime(plugin: XlaFsdpPlugin, what: str) -> None:
    from ..session import XlaFsdpSession

    XlaFsdpSession(plugin).setup_runtime(what=what)


def launch_plugin() -> Optional[XlaFsdpPlugin]:
    """The settings of the launched script (``None`` outside a launch, or when no source gives any); resolved on
    first use, so the start-up hook reads the script's arguments, not the launcher's."""
    if not _launch["resolved"] and _launch["resolve"] is not None:
        _launch["plugin"], _launch["resolved"] = _launch["resolve"](), True
    return _launch["plugin"]


def _hook_settings() -> Optional[XlaFsdpPlugin]:
    """Under a stock launcher: the script's ``--fsdp_config`` and the accelerate YAML this process was launched with."""
    from ..config.sources import find_accelerate_config, launch_settings

    return launch_settings(sys.argv[1:], find_accelerate_config())


def install_launch(plugin: Optional[XlaFsdpPlugin] = None, resolve: Optional[Callable[[], Any]] = None) -> None:
    """Patch the upstream classes for a launched script (idempotent), as their modules load.

    ``plugin``: the launch settings, known now (``hf-xla-fsdp launch``); ``resolve``: how to find them on first use
    (the start-up hook). ``TrainingArguments`` start SPMD for v2 settings; ``transformers.Trainer`` and its subclasses
    build :func:`launched_trainer_class` instances; ``accelerate.Accelerator`` builds an ``XlaFsdpAccelerator``.
    """
    from .. import importhooks

    if plugin is not None:
        _launch.update(plugin=plugin, resolved=True, resolve=None)
    elif resolve is not None and not _launch["resolved"]:
        _launch["resolve"] = resolve
    importhooks.when_imported("transformers.training_args", lambda module: patch_training_arguments())
    importhooks.when_imported("transformers.trainer", _patch_trainer)
    importhooks.when_imported("accelerate.accelerator", _patch_accelerator)


def _hook_launch() -> None:
    if _launch["resolve"] is None and not _launch["resolved"]:
        install_launch(resolve=_hook_settings)


def hooked_training_args(module: Any) -> None:
    """Start-up hook: ``transformers.training_args`` was imported."""
    _hook_launch()


def hooked_trainer(module: Any) -> None:
    """Start-up hook: ``transformers.trainer`` was imported."""
    _hook_launch()


def hooked_accelerator(module: Any) -> None:
    """Start-up hook: ``accelerate.accelerator`` was imported."""
    _hook_launch()


class LaunchedTrainerMixin:
    """What a launched script's Trainer adds to XlaFsdpTrainerMixin: the launch settings when the arguments carry no
    XLA ``fsdp_config`` (a YAML, or the launcher's ``--fsdp_config``), and the stock accelerator its base builds."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        plugin = launch_plugin()
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
                        kwargs["fsdp_plugin"] = launch_plugin()
                    super().__init__(*args, **kwargs)

            LaunchedAccelerator.__name__ = LaunchedAccelerator.__qualname__ = "XlaFsdpAccelerator"
            _launched_accelerator = LaunchedAccelerator
        cls = _launched_accelerator
    return object.__new__(cls)


def _patch_accelerator(module: Any) -> None:
    accelerator = module.Accelerator
    if "__new__" not in accelerator.__dict__:
        accelerator.__new__ = staticmethod(_accelerator_new)
