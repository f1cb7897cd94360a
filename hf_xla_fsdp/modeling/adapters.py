"""PEFT adapters attached to a model skeleton on ``meta``, before it is materialized block by block.

``XlaFsdpPlugin.build(pretrained_dir, peft_config=LoraConfig(...))`` builds the base on meta,
injects the adapters there (``get_peft_model(..., low_cpu_mem_usage=True)``: nothing allocated),
then materializes one block at a time as for any model: the base tensors are read from the
pretrained files under their original names (peft's ``base_layer`` / ``original_module`` /
``modules_to_save`` copies map back to them) and the adapter tensors get peft's own init
(``reset_lora_parameters``: LoRA B is zero, so the model starts as the base). The base is never
whole in memory. peft is imported only here, and only when used.
"""

from __future__ import annotations

import re
from typing import Any, Optional

import torch
from torch import nn

from ..errors import ConfigError

EXTRA = "hf_xla_fsdp[finetune]"

# peft's wrappers around a base module: their tensors are the base module's, under the base name
_BASE_SEGMENTS = re.compile(r"\.(base_layer|original_module|modules_to_save\.[^.]+)(?=\.)")


def require_peft() -> Any:
    """The ``peft`` module, or one line saying which extra to install."""
    try:
        import peft
    except ImportError:
        raise ConfigError(f"this needs peft, which is not installed: pip install '{EXTRA}'") from None
    return peft


def attach_adapters(model: nn.Module, peft_config: Any, adapter_name: str = "default") -> nn.Module:
    """``get_peft_model`` on a skeleton whose tensors are on meta; the adapters stay on meta too.

    peft's own check that the target modules exist runs here, before anything is allocated.
    """
    peft = require_peft()
    try:
        return peft.get_peft_model(model, peft_config, adapter_name=adapter_name, low_cpu_mem_usage=True)
    except ValueError as err:  # e.g. target modules that the model does not have
        raise ConfigError(f"peft_config does not fit {type(model).__name__}: {' '.join(str(err).split())}") from None


def checkpoint_key(name: str) -> Optional[str]:
    """The pretrained checkpoint key of a skeleton tensor name; None for an adapter's own tensor.

    ``layers.0.q_proj.base_layer.weight`` -> ``layers.0.q_proj.weight``;
    ``lm_head.modules_to_save.default.weight`` -> ``lm_head.weight``; ``...lora_A.default.weight`` -> None.
    """
    if any(part.startswith("lora_") for part in name.split(".")):
        return None
    return _BASE_SEGMENTS.sub("", name)


def adapter_layers(modules: list[nn.Module]) -> list[nn.Module]:
    """The peft tuner layers among ``modules`` (the ones whose adapter tensors need an init)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    return [m for m in modules if isinstance(m, BaseTunerLayer)]


def init_adapters(layers: list[nn.Module], peft_model: nn.Module) -> None:
    """Give every LoRA adapter of ``layers`` peft's own initial values (A random, B zero by default)."""
    configs = getattr(peft_model, "peft_config", {})
    for layer in layers:
        reset = getattr(layer, "reset_lora_parameters", None)
        if reset is None:  # other tuners have no common re-init entry point
            raise ConfigError(f"{type(layer).__name__} adapters cannot be initialized on meta (LoRA can); call "
                              "get_peft_model on a model built with XlaFsdpPlugin.build(..., meta_init=False) instead")
        for adapter in layer.lora_A.keys():
            # on meta nothing ran peft's construction, which draws nn.Linear's own init for A then B before its reset
            # (with init_lora_weights=False that is the only init: skipping it left uninitialized memory)
            for part in (layer.lora_A[adapter], layer.lora_B[adapter]):
                if hasattr(part, "reset_parameters"):
                    part.reset_parameters()
            reset(adapter, getattr(configs.get(adapter), "init_lora_weights", True))
        for adapter in getattr(layer, "lora_embedding_A", {}).keys():
            with torch.no_grad():  # peft's construction: torch.randn for A then B
                layer.lora_embedding_A[adapter].normal_()
                layer.lora_embedding_B[adapter].normal_()
            reset(adapter, getattr(configs.get(adapter), "init_lora_weights", True))
