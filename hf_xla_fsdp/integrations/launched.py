"""What an unmodified script gets under ``hf-xla-fsdp launch`` or any launcher with ``HF_XLA_FSDP=1`` (the start-up
hook): :func:`install_launch` patches upstream classes as their modules load (:mod:`hf_xla_fsdp.importhooks`), so
import order does not matter. ``TrainingArguments`` ready the runtime; ``transformers.Trainer`` and every subclass
build ``xla_fsdp_trainer(cls)`` (the one way a Trainer gets XLA FSDP); ``accelerate.Accelerator`` builds an
``XlaFsdpAccelerator``; ``from_pretrained`` / ``from_config`` load lazily (:mod:`hf_xla_fsdp.modeling.lazy`). How
each patch works is :mod:`.patches`'; the settings are the launch's
(:func:`hf_xla_fsdp.config.resolve.current_launch_sources`).
"""

from __future__ import annotations

from typing import Any, Optional

from .. import importhooks
from ..config.resolve import current_launch_sources, hook_sources, watch_launch
from ..modeling import lazy
from ..plugin import XlaFsdpPlugin
from ..session.bootstrap import ready_runtime
from . import patches


def install_launch() -> None:
    """Patch the upstream classes for a launched script, as their modules load (idempotent)."""
    importhooks.when_imported("transformers.training_args", lambda module: patches.patch_training_arguments())
    importhooks.when_imported("transformers.trainer",
                              lambda module: patches.patch_new(module.Trainer, launched_trainer_class, "Trainer.__new__"))
    importhooks.when_imported("accelerate.accelerator",
                              lambda module: patches.patch_new(module.Accelerator, launched_accelerator_class,
                                                               "Accelerator.__new__"))
    # from_pretrained / from_config build like the documented path: weights read block by block when wrapped
    importhooks.when_imported("transformers.modeling_utils", lambda module: patches.patch_lazy_loading(loads_lazily))
    importhooks.when_imported("peft.tuners.tuners_utils", patches.patch_peft_for_lazy_models)


def loads_lazily() -> bool:
    """``from_pretrained`` / ``from_config`` return lazily loaded models now (:mod:`hf_xla_fsdp.modeling.lazy`): in a
    launched process whose settings keep ``meta_init`` (the default), unless switched off."""
    def launch_meta_init() -> Optional[bool]:
        sources = current_launch_sources()
        return None if sources is None else XlaFsdpPlugin.resolve(sources).meta_init

    return lazy.enabled(launch_meta_init)


def start(what: str = "the launcher") -> None:
    """In a launched process, before the script: the patches, and the runtime readied for the launch's settings
    (FSDP v2: SPMD before the script can touch the device)."""
    install_launch()
    sources = current_launch_sources()
    if sources:
        ready_runtime(XlaFsdpPlugin.resolve(sources), what=what)


def hooked(module: Any) -> None:
    """The start-up hook's entry (``transformers.training_args``, ``transformers.trainer`` or
    ``accelerate.accelerator`` was just imported): patch for a launched script; its settings are read on first use
    (the script's own arguments, the accelerate YAML it was launched with), unless a launcher handed them over."""
    watch_launch(hook_sources)
    install_launch()


def launched_trainer_class(requested: type) -> type:
    """``requested`` (``transformers.Trainer`` or a subclass) with XLA FSDP: ``xla_fsdp_trainer(requested)``."""
    from .trainer import xla_fsdp_trainer

    return xla_fsdp_trainer(requested)


def launched_accelerator_class(requested: type) -> Optional[type]:
    """``XlaFsdpAccelerator`` for ``accelerate.Accelerator`` itself (not inside a Trainer's own set-up, see
    :func:`.patches.stock_accelerator`); ``None`` (the class asked for) otherwise."""
    from accelerate import Accelerator

    from ..process import STOCK_ACCELERATOR

    if requested is not Accelerator or STOCK_ACCELERATOR.get():
        return None
    from .accelerate import XlaFsdpAccelerator

    return XlaFsdpAccelerator
