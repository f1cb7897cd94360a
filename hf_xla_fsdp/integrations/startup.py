"""Start-up effects, in one place: what must happen in a training process before its script uses the XLA device.

FSDP v2 runs under SPMD, which must start before anything touches the device; transformers' ``TrainingArguments``
touch it as soon as they are built (their ``_setup_devices`` makes accelerate's ``PartialState``). :func:`install`
makes arguments built from then on start SPMD themselves when their ``fsdp_config`` asks for v2, and starts it at
once when the command line's ``--fsdp_config`` does. Importing ``hf_xla_fsdp`` alone runs none of this; importing
the Trainer integration (the one-line swap) does, and so do the launcher and the start-up hook.

accelerate's ``gather_object`` raises ``NotImplementedError`` on XLA; :func:`patch_gather_object` (run when an
``XlaFsdpAccelerator`` is built, never on import) makes it gather there.

Launched scripts (``hf-xla-fsdp launch``, or any launcher with ``HF_XLA_FSDP=1`` through the start-up hook) keep
their settings here (:func:`set_launch_settings`), so ``TrainingArguments`` start SPMD for them too; which classes
they build is :mod:`hf_xla_fsdp.integrations.launched`'s business (it sits above the Trainer and the Accelerator).
"""

from __future__ import annotations

import functools
import json
import os
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
            setup_runtime(plugin, what)
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


# --------------------------------------------------------------------------- accelerate's extract_model_from_parallel
_upstream_extract: Optional[Callable[..., Any]] = None


def extract_dispatch(model: Any, *args: Any) -> Any:
    """What accelerate's ``extract_model_from_parallel`` does once patched: an XLA FSDP unit gives the user's module
    inside it first, then upstream's own code runs on that."""
    from ..engines import unwrap

    assert _upstream_extract is not None  # set together with the patch
    return _upstream_extract(unwrap(model), *args)


def _patched_extract(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                     recursive: bool = False) -> Any:
    # as _patched_gather_object: only this code object is installed, into upstream's function
    from hf_xla_fsdp.integrations.startup import extract_dispatch

    return extract_dispatch(model, keep_fp32_wrapper, keep_torch_compile, recursive)


def patch_extract_model() -> None:
    """accelerate's ``extract_model_from_parallel`` sees through XLA FSDP units, however it was imported.

    It is how accelerate (``is_peft_model``) and transformers (``unwrap_model``) find the model inside distributed
    wrappers; TRL asks ``is_peft_model(trainer.model)`` to choose the reference of a LoRA run (the adapters disabled),
    and our units are not among the wrappers upstream knows. Replaces the function's code, as
    :func:`patch_gather_object` does; idempotent.
    """
    global _upstream_extract
    from accelerate.utils import other

    target = other.extract_model_from_parallel
    if target.__code__ is _patched_extract.__code__:
        return
    names = target.__code__.co_varnames[:target.__code__.co_argcount]
    if target.__code__.co_freevars or names != ("model", "keep_fp32_wrapper", "keep_torch_compile", "recursive"):
        raise ConfigError("accelerate.utils.other.extract_model_from_parallel changed shape; hf_xla_fsdp cannot make it "
                          "see through XLA FSDP units (`hf-xla-fsdp env` lists the supported accelerate versions)")
    _upstream_extract = types.FunctionType(target.__code__, target.__globals__, target.__name__, target.__defaults__,
                                           target.__closure__)
    target.__code__ = _patched_extract.__code__


# --------------------------------------------------------------------------- launched scripts
_launch: dict[str, Any] = {"resolve": None, "plugin": None, "resolved": False}


def setup_runtime(plugin: XlaFsdpPlugin, what: str) -> None:
    """The XLA runtime as ``plugin``'s engine needs it (FSDP v2: SPMD), or the one line saying why it is too late."""
    from ..session import XlaFsdpSession

    XlaFsdpSession(plugin).setup_runtime(what=what)


def set_launch_settings(plugin: Optional[XlaFsdpPlugin] = None, resolve: Optional[Callable[[], Any]] = None) -> None:
    """The launched script's settings: ``plugin`` now (the launcher), or ``resolve()`` on first use (the start-up
    hook, which must read the script's arguments, not the launcher's); a known plugin is never replaced by a resolver."""
    if plugin is not None:
        _launch.update(plugin=plugin, resolved=True, resolve=None)
    elif resolve is not None and not _launch["resolved"] and _launch["resolve"] is None:
        _launch["resolve"] = resolve


def launch_plugin() -> Optional[XlaFsdpPlugin]:
    """The settings of the launched script (``None`` outside a launch, or when no source gives any)."""
    if not _launch["resolved"] and _launch["resolve"] is not None:
        _launch["plugin"], _launch["resolved"] = _launch["resolve"](), True
    return _launch["plugin"]
