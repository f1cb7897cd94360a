"""Start-up effects, in one place: what must happen in a training process before its script uses the XLA device.

FSDP v2 runs under SPMD, which must start before anything touches the device; transformers' ``TrainingArguments``
touch it as soon as they are built (their ``_setup_devices`` makes accelerate's ``PartialState``). :func:`install`
makes arguments built from then on start SPMD themselves when their ``fsdp_config`` asks for v2, and starts it at
once when the command line's ``--fsdp_config`` does. Importing ``hf_xla_fsdp`` alone runs none of this; importing
the Trainer integration (the one-line swap) does, and so do the launcher and the start-up hook.
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any, Optional

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
        if getattr(self, "fsdp", None):
            auto_spmd(getattr(self, "fsdp_config", None), "code that ran before these TrainingArguments were built")
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
