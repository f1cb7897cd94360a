"""Every change hf_xla_fsdp makes to an upstream class or function, in one module; none happens on import.

* ``TrainingArguments._setup_devices`` (:func:`patch_training_arguments`): arguments built from then on ready the XLA
  runtime for their settings (FSDP v2: SPMD) before they take the device. Their ``_setup_devices`` (first read in
  ``__post_init__``) builds accelerate's ``PartialState``, which takes the XLA device and counts processes; SPMD has to
  be on before that, whatever way the config arrived (command line, JSON/YAML file, a dict in code, a
  ``TrainingArguments`` subclass such as TRL's configs, or only the launch's settings).
* ``Trainer.__new__`` / ``Accelerator.__new__`` (:func:`patch_new`): a launched script's stock classes build their XLA
  FSDP versions (what they build is :mod:`.launched`'s decision).
* accelerate's ``gather_object`` (:func:`patch_gather_object`): it raises ``NotImplementedError`` on XLA; patched, it
  gathers there.
* accelerate's ``extract_model_from_parallel`` (:func:`patch_extract_model`): it sees through XLA FSDP units (so
  ``is_peft_model`` finds a LoRA policy inside them, as TRL asks it to pick the adapters-disabled reference).

Who opts in: importing the Trainer integration (the one-line swap) patches ``TrainingArguments``; building an
``XlaFsdpAccelerator`` patches ``gather_object`` and ``extract_model_from_parallel``; ``hf-xla-fsdp launch`` and the
start-up hook (``HF_XLA_FSDP=1``) patch all of them (:func:`hf_xla_fsdp.integrations.launched.install_launch`).
Which patches are installed is part of the process state (``process_state().patched``). ``HF_XLA_FSDP_AUTO_SPMD=0``
keeps ``TrainingArguments`` from readying the runtime (SPMD is then the script's business).
"""

from __future__ import annotations

import contextlib
import functools
import os
import types
from typing import Any, Callable, Iterator, Optional

from ..config.resolve import current_launch_sources, names_settings
from ..config.training_args import training_args_sources
from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin
from ..process import STOCK_ACCELERATOR, process_state
from ..session.bootstrap import ready_runtime

#: set to 0 to keep TrainingArguments from readying the runtime (SPMD is then the script's business)
AUTO_SPMD_ENV = "HF_XLA_FSDP_AUTO_SPMD"


# --------------------------------------------------------------------------- TrainingArguments
def ready_for_arguments(args: Any, what: str) -> None:
    """Ready the runtime for the settings ``args`` and the launch give, before ``args`` take the device.

    Outside a launch, settings that cannot be read are left for XlaFsdpTrainer to report with the other arguments;
    under a launch (which opted in), or when the runtime can no longer be readied, the one line is raised here.
    """
    if os.environ.get(AUTO_SPMD_ENV, "1").strip().lower() in ("0", "false", "no"):
        return
    launch = current_launch_sources()
    try:
        own = training_args_sources(args)
        if launch is None and not names_settings(own):
            return
        plugin = XlaFsdpPlugin.resolve([*(launch or []), *own])
    except ConfigError:
        if launch is None:
            return
        raise
    ready_runtime(plugin, what=what)


def patch_training_arguments() -> None:
    """``TrainingArguments`` built from now on ready the runtime for their settings first (see the module docstring).

    Idempotent; on another transformers layout nothing is patched (XlaFsdpTrainer's own check still applies).
    """
    import torch
    from transformers import TrainingArguments

    original = TrainingArguments.__dict__.get("_setup_devices")
    if not isinstance(original, functools.cached_property) or getattr(original.func, "_hf_xla_fsdp", False):
        return

    def _setup_devices(self: TrainingArguments) -> torch.device:
        ready_for_arguments(self, "code that ran before these TrainingArguments were built")
        return original.func(self)

    _setup_devices._hf_xla_fsdp = True  # type: ignore[attr-defined]
    patched = functools.cached_property(_setup_devices)
    patched.__set_name__(TrainingArguments, "_setup_devices")
    TrainingArguments._setup_devices = patched
    process_state().patched.add("TrainingArguments")


# --------------------------------------------------------------------------- Trainer.__new__, Accelerator.__new__
def patch_new(cls: type, build: Callable[[type], Optional[type]], name: str) -> None:
    """``cls(...)`` and its subclasses' constructions build ``build(requested class)`` instead (``None``: the requested
    class); Python then runs that class's ``__init__``, as it is a subclass of the one asked for. Idempotent."""
    if "__new__" in cls.__dict__:
        return

    def __new__(requested: type, *args: Any, **kwargs: Any) -> Any:
        return object.__new__(build(requested) or requested)

    cls.__new__ = staticmethod(__new__)
    process_state().patched.add(name)


@contextlib.contextmanager
def stock_accelerator() -> Iterator[None]:
    """While inside, ``accelerate.Accelerator(...)`` builds the stock class even in a launched script (a Trainer's base
    class makes one, which the XLA FSDP trainer then replaces by its own on its session)."""
    token = STOCK_ACCELERATOR.set(True)
    try:
        yield
    finally:
        STOCK_ACCELERATOR.reset(token)


# --------------------------------------------------------------------------- accelerate's gather_object on XLA
def gather_object_dispatch(obj: Any) -> Any:
    """What accelerate's ``gather_object`` does once patched: on XLA (where upstream raises ``NotImplementedError``)
    the implementation given to :func:`patch_gather_object`; on any other distributed type upstream's own code."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = process_state()
    if state.gather_object_on_xla is not None and PartialState().distributed_type == DistributedType.XLA:
        return state.gather_object_on_xla(obj)
    assert state.upstream_gather_object is not None  # set together with the patch
    return state.upstream_gather_object(obj)


def _patched_gather_object(object: Any) -> Any:  # noqa: A002 - upstream's parameter name, kept for keyword callers
    # only this code object is installed into upstream's function: it names nothing of the module it runs in
    # (upstream's globals), it imports what it needs
    from hf_xla_fsdp.integrations.patches import gather_object_dispatch

    return gather_object_dispatch(object)


def patch_gather_object(on_xla: Callable[[Any], list[Any]]) -> None:
    """accelerate's ``gather_object`` gathers with ``on_xla`` when the distributed type is XLA, however it was
    imported (``accelerate.utils.gather_object``, ``from accelerate.utils import gather_object`` in a script imported
    before this ran, ``Accelerator.gather_for_metrics``, ``verify_operation`` in debug mode).

    Those are all references to one function object, so the patch replaces that object's code rather than a module
    attribute (which the names bound earlier would not see); upstream's own code runs, unchanged, for every other
    distributed type. Idempotent; the latest ``on_xla`` is used.
    """
    from accelerate.utils import operations

    state = process_state()
    upstream = swap_code(operations.gather_object, _patched_gather_object, ("object",), "gather_object",
                         "accelerate.utils.operations.gather_object changed shape; hf_xla_fsdp cannot make it gather "
                         "on XLA (`hf-xla-fsdp env` lists the supported accelerate versions)")
    if upstream is not None:
        state.upstream_gather_object = upstream
    state.gather_object_on_xla = on_xla


def swap_code(target: types.FunctionType, replacement: Callable[..., Any], leading: tuple[str, ...], name: str,
              changed: str) -> Optional[types.FunctionType]:
    """Install ``replacement``'s code into the function object ``target`` (every name bound to it sees the patch) and
    return a copy of ``target`` as upstream wrote it; ``None`` when it is patched already. ``leading``: the parameter
    names ``target`` must start with, else ``changed`` is raised (upstream changed shape); ``name`` is recorded in the
    process state's ``patched``."""
    code = target.__code__
    if code is replacement.__code__:
        return None
    if code.co_freevars or code.co_varnames[:len(leading)] != leading:
        raise ConfigError(changed)
    upstream = types.FunctionType(code, target.__globals__, target.__name__, target.__defaults__, target.__closure__)
    target.__code__ = replacement.__code__
    process_state().patched.add(name)
    return upstream


# --------------------------------------------------------------------------- accelerate's extract_model_from_parallel
def extract_dispatch(model: Any, *args: Any) -> Any:
    """What accelerate's ``extract_model_from_parallel`` does once patched: an XLA FSDP unit gives the user's module
    inside it first, then upstream's own code runs on that."""
    from ..engines import unwrap

    upstream = process_state().upstream_extract_model
    assert upstream is not None  # set together with the patch
    return upstream(unwrap(model), *args)


def _patched_extract(model: Any, keep_fp32_wrapper: bool = True, keep_torch_compile: bool = True,
                     recursive: bool = False) -> Any:
    # as _patched_gather_object: only this code object is installed, into upstream's function
    from hf_xla_fsdp.integrations.patches import extract_dispatch

    return extract_dispatch(model, keep_fp32_wrapper, keep_torch_compile, recursive)


def patch_extract_model() -> None:
    """accelerate's ``extract_model_from_parallel`` sees through XLA FSDP units, however it was imported.

    It is how accelerate (``is_peft_model``) and transformers (``unwrap_model``) find the model inside distributed
    wrappers; TRL asks ``is_peft_model(trainer.model)`` to choose the reference of a LoRA run (the adapters disabled),
    and our units are not among the wrappers upstream knows. Replaces the function's code, as
    :func:`patch_gather_object` does; idempotent.
    """
    from accelerate.utils import other

    target = other.extract_model_from_parallel
    if target.__code__.co_argcount != 4:  # exactly upstream's four parameters, which the replacement passes on
        raise ConfigError(_EXTRACT_CHANGED)
    upstream = swap_code(target, _patched_extract, ("model", "keep_fp32_wrapper", "keep_torch_compile", "recursive"),
                         "extract_model_from_parallel", _EXTRACT_CHANGED)
    if upstream is not None:
        process_state().upstream_extract_model = upstream


_EXTRACT_CHANGED = ("accelerate.utils.other.extract_model_from_parallel changed shape; hf_xla_fsdp cannot make it see "
                    "through XLA FSDP units (`hf-xla-fsdp env` lists the supported accelerate versions)")


# --------------------------------------------------------------------------- lazy from_pretrained / from_config
def patch_lazy_loading(go_lazy: Callable[[], bool]) -> None:
    """``PreTrainedModel.from_pretrained`` and ``._from_config`` (what ``AutoModel*.from_pretrained`` /
    ``from_config`` call) return models loaded lazily while ``go_lazy()`` says so
    (:mod:`hf_xla_fsdp.modeling.lazy`); ``resize_token_embeddings`` loads such a model whole first (it needs the
    weights). Idempotent."""
    from transformers import PreTrainedModel

    from ..modeling import lazy

    state = process_state()
    if "PreTrainedModel.from_pretrained" in state.patched:
        return
    loaded = PreTrainedModel.__dict__["from_pretrained"].__func__
    built = PreTrainedModel.__dict__["_from_config"].__func__
    resize = PreTrainedModel.resize_token_embeddings

    @functools.wraps(loaded)
    def from_pretrained(cls: type, name: Any, *args: Any, **kwargs: Any) -> Any:
        if not go_lazy():
            return loaded(cls, name, *args, **kwargs)
        return lazy.lazy_from_pretrained(cls, functools.partial(loaded, cls), name, *args, **kwargs)

    @functools.wraps(built)
    def _from_config(cls: type, config: Any, **kwargs: Any) -> Any:
        if not go_lazy():
            return built(cls, config, **kwargs)
        return lazy.lazy_from_config(cls, functools.partial(built, cls), config, **kwargs)

    @functools.wraps(resize)
    def resize_token_embeddings(self: Any, *args: Any, **kwargs: Any) -> Any:
        found = lazy.lazy_state(self)
        if found is not None:  # new rows are initialized from the old ones (their mean): the values are needed
            found.materialize("resize_token_embeddings")
        return resize(self, *args, **kwargs)

    PreTrainedModel.from_pretrained = classmethod(from_pretrained)
    PreTrainedModel._from_config = classmethod(_from_config)
    PreTrainedModel.resize_token_embeddings = resize_token_embeddings
    state.patched.add("PreTrainedModel.from_pretrained")


def patch_peft_for_lazy_models(module: Any) -> None:
    """peft's tuners (``get_peft_model``, ``PeftModel(...)``, ``LoraModel(...)``) load a lazily loaded base model
    whole first: the adapters they add are made on the base layers' device and initialized there. Idempotent."""
    from ..modeling import lazy

    tuner = module.BaseTuner
    original = tuner.__init__
    if getattr(original, "_hf_xla_fsdp", False):
        return

    @functools.wraps(original)
    def __init__(self: Any, model: Any, *args: Any, **kwargs: Any) -> None:
        found = lazy.lazy_state(model)
        if found is not None:
            found.materialize(f"peft's {type(self).__name__}")
        original(self, model, *args, **kwargs)

    __init__._hf_xla_fsdp = True  # type: ignore[attr-defined]
    tuner.__init__ = __init__
    process_state().patched.add("peft BaseTuner.__init__")
