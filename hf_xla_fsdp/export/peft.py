"""PEFT adapters (LoRA and the other peft tuners) on sharded models: saving what peft saves, and merging.

A ``PeftModel`` is wrapped like any model: frozen base weights are sharded as usual, only the
trainable parameters get gradients and optimizer state. What differs is the output: from a
sharded checkpoint of a PEFT model, :func:`write_adapters` reads *only* the adapter tensors (never
the base) and writes exactly what ``PeftModel.save_pretrained`` writes on one device
(``adapter_config.json`` + ``adapter_model.safetensors`` with peft's key names);
:func:`merged_outputs` streams the base tensors with the LoRA updates merged in, for a full
``from_pretrained``-ready model. peft is imported only here, and only when used.
"""

from __future__ import annotations

import math
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Union

import torch
from torch import nn

from ..errors import CheckpointError, ConfigError
from ..modeling.adapters import require_peft

if TYPE_CHECKING:
    from ..checkpoint.readers import RankSet

PEFT_PREFIX = "base_model.model."




def is_peft_model(model: Any) -> bool:
    """True for a ``peft.PeftModel`` (checked by duck type, so peft need not be installed)."""
    return hasattr(model, "peft_config") and hasattr(model, "get_base_model") and hasattr(model, "active_adapter")


# --------------------------------------------------------------------------- which tensors are the adapter's
def _peft_config(peft: Any, saved: dict[str, Any]) -> Any:
    from peft import PeftConfig

    return PeftConfig.from_peft_type(**saved) if hasattr(PeftConfig, "from_peft_type") else peft.get_peft_config(saved)


def meta_peft_model(config: Any, adapters: dict[str, dict[str, Any]]) -> nn.Module:
    """A PeftModel skeleton on ``meta`` (nothing allocated) from the base config and the saved peft configs."""
    peft = require_peft()
    from ..modeling.meta_init import model_class

    cls = model_class(config)
    with torch.device("meta"):
        base = cls._from_config(config) if hasattr(cls, "_from_config") else cls.from_config(config)
        names = list(adapters)
        model = peft.get_peft_model(base, _peft_config(peft, dict(adapters[names[0]])), adapter_name=names[0])
        for name in names[1:]:
            model.add_adapter(name, _peft_config(peft, dict(adapters[name])))
    return model


def adapter_keys(model: nn.Module, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
                 adapter_name: str = "default") -> dict[str, str]:
    """peft's saved key -> the full state-dict name it comes from, as ``PeftModel.save_pretrained`` would pick them.

    ``shapes`` holds every tensor of the full model; peft's own selection runs on meta placeholders,
    so only the chosen tensors need to be read afterwards.
    """
    peft = require_peft()
    placeholders = {name: torch.empty(shape, dtype=dtype, device="meta") for name, (shape, dtype) in shapes.items()}
    origin = {id(t): name for name, t in placeholders.items()}
    chosen = peft.get_peft_model_state_dict(model, state_dict=placeholders, adapter_name=adapter_name)
    return {key: origin[id(t)] for key, t in chosen.items() if id(t) in origin}


# --------------------------------------------------------------------------- writing adapter files
def write_adapters(model: nn.Module, ranks: "RankSet", output: Union[str, os.PathLike], *,
                   side_sources: Optional[list[Path]] = None) -> dict[str, Any]:
    """``adapter_config.json`` + ``adapter_model.safetensors`` for every adapter of ``model``, from the rank files.

    ``model`` is a PeftModel with the plain module structure (peft picks adapter tensors by walking
    the modules, which FSDP wrappers rename): the meta skeleton of :func:`meta_peft_model`. Only the
    adapter tensors are read. The output appears only when complete (staged, then merged into ``output``).
    """
    from ..checkpoint.consolidate import copy_side_files, plan_outputs
    from ..checkpoint.layout import merge_into

    plan = {t.name: t for t in plan_outputs(ranks)}
    shapes = {name: (t.shape, t.dtype) for name, t in plan.items()}
    output = Path(output)
    output.parent.mkdir(parents=True, exist_ok=True)
    stage = output.parent / f".{output.name}.adapters-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    written = {}
    try:
        for adapter in model.peft_config:
            keys = adapter_keys(model, shapes, adapter)
            if not keys:
                raise CheckpointError(f"{ranks.source} holds no tensor of adapter {adapter!r}")
            state = {plan[full].name: plan[full].read(ranks) for full in keys.values()}
            ranks.finish_verification()
            # peft's own writer: its key names, its config file, its README
            model.save_pretrained(str(stage), selected_adapters=[adapter], state_dict=state, is_main_process=True)
            written[adapter] = len(keys)
        copy_side_files(side_sources or [], stage)
        merge_into(stage, output)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
    return {"output": str(output), "adapters": written}


def consolidate_adapters(ranks: "RankSet", config: Any, output: Union[str, os.PathLike], *,
                         side_sources: Optional[list[Path]] = None) -> dict[str, Any]:
    """Adapter files from a sharded checkpoint of a PEFT model, with no model in memory (a meta skeleton)."""
    saved = (ranks.meta or {}).get("peft") or {}
    if not saved.get("adapters"):
        raise CheckpointError(f"{ranks.source} is not a checkpoint of a PEFT model (no adapter configs saved)")
    return write_adapters(meta_peft_model(config, saved["adapters"]), ranks, output, side_sources=side_sources)


# --------------------------------------------------------------------------- merging LoRA into the base
_LORA = re.compile(r"^(?P<module>.+)\.lora_(?P<which>[AB])\.(?P<adapter>[^.]+)\.weight$")


@dataclass
class MergedTensor:
    """One tensor of the merged model: a base tensor, plus ``scale * B @ A`` when LoRA targets it."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    base: Any
    lora: Optional[tuple[Any, Any, float, bool]] = None  # (A, B, scaling, fan_in_fan_out)

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    def read(self, ranks: "RankSet") -> torch.Tensor:
        """The base tensor with the LoRA update merged in (computed in fp32)."""
        weight = self.base.read(ranks).float()
        if self.lora is not None:
            a, b, scaling, fan_in_fan_out = self.lora
            delta = (b.read(ranks).float() @ a.read(ranks).float()) * scaling
            weight += delta.T if fan_in_fan_out else delta
        return weight.to(self.dtype)


def merged_outputs(ranks: "RankSet", plan: list[Any]) -> list[Any]:
    """The full (merged) model's tensors, under the base model's names, from a PEFT checkpoint's plan."""
    saved = (ranks.meta or {}).get("peft") or {}
    adapters = saved.get("adapters") or {}
    if not adapters:
        raise ConfigError(f"merge_adapters needs a checkpoint of a PEFT model; {ranks.source} holds a plain model")
    if len(adapters) != 1:
        raise ConfigError(f"{ranks.source} holds {len(adapters)} adapters ({', '.join(adapters)}); merging picks one: "
                          "save with a single adapter")
    (adapter, cfg), = adapters.items()
    if str(cfg.get("peft_type", "")).upper() != "LORA" or cfg.get("use_dora"):
        raise ConfigError(f"merge_adapters supports plain LoRA; adapter {adapter!r} is {cfg.get('peft_type')}"
                          f"{' with DoRA' if cfg.get('use_dora') else ''}: merge it with peft's merge_and_unload instead")
    by_name = {t.name: t for t in plan}
    loras: dict[str, dict[str, Any]] = {}
    for t in plan:
        m = _LORA.match(t.name)
        if m and m["adapter"] == adapter:
            loras.setdefault(m["module"], {})[m["which"]] = t
    out: list[Any] = []
    for t in plan:
        name = t.name
        if _LORA.match(name) or ".lora_" in name or ".original_module." in name:
            continue  # adapters are merged below; a modules_to_save original gives way to its trained copy
        if f".modules_to_save.{adapter}." in name:
            name = name.replace(f".modules_to_save.{adapter}.", ".")
        elif ".modules_to_save." in name:
            continue
        module = name.rsplit(".", 1)[0].removesuffix(".base_layer")
        lora = None
        if name.endswith(".base_layer.weight") and module in loras:
            r = int(cfg.get("r", 8))
            alpha = float(cfg.get("lora_alpha", 8))
            pattern = (cfg.get("rank_pattern") or {}), (cfg.get("alpha_pattern") or {})
            if pattern[0] or pattern[1]:
                raise ConfigError("merge_adapters does not support rank_pattern/alpha_pattern; use peft's merge_and_unload")
            scaling = alpha / math.sqrt(r) if cfg.get("use_rslora") else alpha / r
            lora = (loras[module]["A"], loras[module]["B"], scaling, bool(cfg.get("fan_in_fan_out")))
        name = name.replace(".base_layer.", ".")
        out.append(MergedTensor(name.removeprefix(PEFT_PREFIX), t.shape, t.dtype, by_name[t.name], lora))
    return out


# --------------------------------------------------------------------------- one entry point for every checkpoint
def consolidate_checkpoint(ckpt: Union[str, os.PathLike], output: Union[str, os.PathLike], *,
                           merge_adapters: bool = False, ckpt_suffix: Optional[str] = None,
                           config: Union[str, os.PathLike, None] = None, dtype: str = "auto",
                           max_shard_size: Union[int, str] = "5GB", overwrite: bool = False,
                           progress: bool = True) -> dict[str, Any]:
    """Consolidate any checkpoint: a plain model into a ``from_pretrained`` dir; a PEFT model into its adapter
    files, or with ``merge_adapters`` into the full model with the LoRA updates merged in."""
    from ..checkpoint.consolidate import consolidate, load_config, side_file_sources
    from ..checkpoint.layout import check_output
    from ..checkpoint.readers import open_checkpoint

    ranks = open_checkpoint(ckpt, ckpt_suffix)
    kwargs = dict(ckpt_suffix=ckpt_suffix, config=config, dtype=dtype, max_shard_size=max_shard_size,
                  overwrite=overwrite, progress=progress)
    if not (ranks.meta or {}).get("peft"):
        if merge_adapters:
            raise ConfigError(f"merge_adapters needs a checkpoint of a PEFT model; {ckpt} holds a plain model "
                              "(consolidate it without merge_adapters)")
        return consolidate(ckpt, output, **kwargs)
    if merge_adapters:
        return consolidate(ckpt, output, plan_transform=merged_outputs, **kwargs)
    check_output(Path(output), overwrite)
    return consolidate_adapters(ranks, load_config(config, ranks), output, side_sources=side_file_sources(ckpt, config))
