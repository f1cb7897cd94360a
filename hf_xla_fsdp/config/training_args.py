"""Settings from transformers' ``TrainingArguments``: ``--fsdp --fsdp_config`` and the flags that mean something
else on XLA FSDP (mixed precision, gradient checkpointing, the fused AdamW default)."""

from __future__ import annotations

import dataclasses
import json
import logging
import os
from typing import Any, Mapping

from ..errors import ConfigError
from ..plugin import XlaFsdpPlugin
from .keys import read_settings_file

logger = logging.getLogger(__name__)

_FUSED_OPTIMIZERS = ("adamw_torch_fused",)


def plugin_from_training_args(args: Any) -> XlaFsdpPlugin:
    """The plugin described by ``--fsdp --fsdp_config`` and the arguments' precision and checkpointing flags.

    ``bf16``/``fp16`` become the engine's compute dtype (never autocast); ``gradient_checkpointing`` becomes the
    engine's ``activation_checkpointing`` around every block (torch's checkpoint has no XLA device module). Those
    arguments are adjusted in place (the fused AdamW default: :func:`unfuse_optimizer`, for the engines that need it).
    """
    fsdp_config = getattr(args, "fsdp_config", None) or {}
    if isinstance(fsdp_config, (str, os.PathLike)):  # left as given when --fsdp is off (transformers reads it only then)
        fsdp_config = read_settings_file(fsdp_config, "fsdp_config", json.load, json.JSONDecodeError, "JSON")
    named_engine = isinstance(fsdp_config, Mapping) and fsdp_config.get("engine") is not None
    if not named_engine and (not args.fsdp or not isinstance(fsdp_config, Mapping) or not fsdp_config.get("xla")):
        raise ConfigError('XlaFsdpTrainer needs --fsdp and an --fsdp_config JSON with "xla": true '
                          '(e.g. examples/xla_fsdp_config.json), or an fsdp_config naming the engine ({"engine": "fsdp2"})')
    return adjust_for_xla(XlaFsdpPlugin.from_fsdp_config(fsdp_config), args)


def unfuse_optimizer(args: Any) -> None:
    """The fused AdamW default becomes ``adamw_torch`` (for an engine without fused optimizer kernels: XLA)."""
    optim = str(getattr(args.optim, "value", args.optim))
    if optim in _FUSED_OPTIMIZERS:
        # torch's fused AdamW has no XLA kernel; the same update unfused compiles into the step graph
        logger.warning("optim=%s has no XLA kernel; using adamw_torch", optim)
        args.optim = "adamw_torch"


def adjust_for_xla(plugin: XlaFsdpPlugin, args: Any) -> XlaFsdpPlugin:
    """``plugin`` with the arguments' mixed precision and checkpointing applied (see :func:`plugin_from_training_args`)."""
    if args.bf16 or args.fp16:  # the engine's compute dtype (before any block is wrapped), never autocast
        flag = "bf16" if args.bf16 else "fp16"
        plugin = plugin.with_mixed_precision(flag, f"TrainingArguments({flag}=True)")
    asked = [name for name in ("activation_checkpointing", "gradient_checkpointing") if getattr(args, name, False)]
    if asked:
        logger.warning("%s=True: using the engine's activation_checkpointing (around every block) instead", asked[0])
        for name in asked:
            setattr(args, name, False)
        if not plugin.activation_checkpointing:
            plugin = dataclasses.replace(plugin, activation_checkpointing=True)
    return plugin
