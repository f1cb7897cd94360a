"""Settings from transformers' ``TrainingArguments``: ``--fsdp --fsdp_config`` and the flags that mean something
else on XLA FSDP (mixed precision, gradient checkpointing, the fused AdamW default)."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence

from ..errors import ConfigError
from .resolve import Source, current_launch_sources, flag_source, names_settings, plugin_source, precision_source, read_settings

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

logger = logging.getLogger(__name__)

_FUSED_OPTIMIZERS = ("adamw_torch_fused",)
# what transformers' TrainingArguments write into every fsdp_config they process (training_args.py,
# _process_fsdp_args): at these values they say nothing the user gave
_TRANSFORMERS_FILLED = {"min_num_params": 0, "xla_fsdp_v2": False, "xla_fsdp_grad_ckpt": False, "xla": True}
_CHECKPOINTING_FLAGS = ("activation_checkpointing", "gradient_checkpointing")


def training_args_sources(args: Any) -> list[Source]:
    """The settings ``args`` give: their ``fsdp_config`` when ``--fsdp`` is on and it says ``"xla": true`` (the keys
    transformers fills in at their defaults left out), ``bf16``/``fp16`` (the engine's compute dtype, never autocast)
    and ``gradient_checkpointing`` (XLA's ``checkpoint_module`` around every block: torch's checkpoint has no XLA
    device module). A ``fsdp_config`` without ``"xla": true`` is torch FSDP's, not ours: it gives nothing."""
    out: list[Source] = []
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    name = "TrainingArguments' fsdp_config"
    if getattr(args, "fsdp", None) and isinstance(fsdp_config, (str, os.PathLike)):
        # still the path (or inline JSON) while __post_init__ takes the device: SPMD must start before that
        fsdp_config, name = read_settings(fsdp_config, name)
    if getattr(args, "fsdp", None) and isinstance(fsdp_config, Mapping) and fsdp_config.get("xla"):
        given = {k: v for k, v in fsdp_config.items() if k not in _TRANSFORMERS_FILLED or v != _TRANSFORMERS_FILLED[k]}
        out.append(Source(name, given))
    for flag in ("bf16", "fp16"):
        if getattr(args, flag, False):
            out.append(precision_source(f"TrainingArguments({flag}=True)", flag))
    asked = [name for name in _CHECKPOINTING_FLAGS if getattr(args, name, False)]
    if asked:
        out.append(flag_source(f"TrainingArguments({asked[0]}=True)", activation_checkpointing=True))
    return out


def adjust_arguments(args: Any) -> None:
    """Turn off, in ``args``, what the XLA FSDP settings do instead: mixed precision became the compute dtype (never
    autocast, which breaks SDPA attention on XLA; the Trainer's accelerator runs with ``mixed_precision="no"``),
    gradient checkpointing became ``activation_checkpointing``; the fused AdamW default (no XLA kernel) becomes
    ``adamw_torch``."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in _FUSED_OPTIMIZERS:
        # torch's fused AdamW has no XLA kernel; the same update unfused compiles into the step graph
        logger.warning("optim=%s has no XLA kernel; using adamw_torch", optim)
        args.optim = "adamw_torch"
    asked = [name for name in _CHECKPOINTING_FLAGS if getattr(args, name, False)]
    if asked:
        logger.warning("%s=True: using XLA FSDP's activation_checkpointing (checkpoint_module around every block) "
                       "instead", asked[0])
        for name in asked:
            setattr(args, name, False)


def trainer_settings(args: Any, fsdp_plugin: Optional["XlaFsdpPlugin"] = None,
                     extra: Sequence[Source] = ()) -> "XlaFsdpPlugin":
    """The settings of an XLA FSDP Trainer, by the one conflict rule: the launch's (in a launched script), ``args``'
    (:func:`training_args_sources`), ``extra`` (what the trainer class reads from its own config, e.g. TRL's
    ``model_init_kwargs`` dtype) and ``fsdp_plugin``'s; then ``args`` are adjusted (:func:`adjust_arguments`)."""
    from ..plugin import XlaFsdpPlugin

    launch = current_launch_sources()
    sources = [*(launch or []), *training_args_sources(args), *extra]
    if fsdp_plugin is not None:
        sources.append(plugin_source(fsdp_plugin))
    if launch is None and not names_settings(sources):
        raise ConfigError('XlaFsdpTrainer needs --fsdp and an --fsdp_config JSON with "xla": true '
                          "(e.g. examples/xla_fsdp_config.json)")
    plugin = XlaFsdpPlugin.resolve(sources)
    adjust_arguments(args)
    return plugin
