"""Tensor parallelism inside FSDP v2: which weights split over the mesh's ``tensor`` axis, per model family.

With ``tensor_parallel_size`` T > 1 the devices form a ``(replica, fsdp, tensor)`` mesh. Inside each decoder
block the attention is split by heads (q/k/v column-wise: the output dim over ``tensor``; o_proj row-wise: the
input dim over ``tensor``) and the MLP likewise (gate/up column, down row), Megatron-style, so one block needs
one all-reduce over ``tensor`` after attention and one after the MLP. Every split weight keeps FSDP sharding
over ``fsdp`` on its other dim (``q_proj.weight``: ``("tensor", "fsdp")``); parameters no plan names (norms,
position embeddings, GPT-2's attention, LoRA adapters) are sharded as plain FSDP over ``fsdp`` and ``tensor``
together (1-D ones over ``fsdp`` only), so every device holds about 1/N of the model as on a 1D mesh. Attention
of a model whose q_proj is split runs through :func:`head_local_attention`, which keeps each device on its heads.

A plan is a plain mapping ``{pattern: axes}``: ``axes`` holds one entry per dim of the weight (a mesh axis name,
a list of them, or None); ``pattern`` is a glob matched against the parameter's name or any dotted suffix of it
(``mlp.down_proj.weight`` matches ``model.layers.3.mlp.down_proj.weight``), or ``re:<regex>`` searched in it.
Names are those inside the FSDP unit being wrapped (``self_attn.q_proj.weight`` for a decoder block), with PEFT's
``.base_layer`` removed; LoRA's ``lora_A``/``lora_B`` match no family plan and stay plain FSDP, which is
correct (XLA inserts what their products need) though not tensor-parallel.

This module imports no torch_xla at import time: the planner uses :func:`resolve_plan` on meta skeletons.
"""

from __future__ import annotations

import fnmatch
import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional, Sequence, Union

from torch import nn

from ..errors import ConfigError

logger = logging.getLogger(__name__)

TENSOR_AXIS = "tensor"
MESH_AXES = ("replica", "fsdp", TENSOR_AXIS)
Axes = tuple[Union[None, str, tuple[str, ...]], ...]

# nn.Linear stores [out, in]: column-parallel splits out (dim 0) over tensor, row-parallel splits in (dim 1)
COLUMN: Axes = (TENSOR_AXIS, "fsdp")
ROW: Axes = ("fsdp", TENSOR_AXIS)
# a column-parallel bias follows its weight's output split; fsdp inside each tensor block keeps it sharded
COLUMN_BIAS: Axes = ((TENSOR_AXIS, "fsdp"),)
VOCAB: Axes = (TENSOR_AXIS, "fsdp")  # embedding / LM head [vocab, hidden]: the vocabulary over tensor

_LLAMA_BLOCK: dict[str, Axes] = {
    "self_attn.q_proj.weight": COLUMN, "self_attn.k_proj.weight": COLUMN, "self_attn.v_proj.weight": COLUMN,
    "self_attn.o_proj.weight": ROW,
    "mlp.gate_proj.weight": COLUMN, "mlp.up_proj.weight": COLUMN, "mlp.down_proj.weight": ROW,
}
_LLAMA_VOCAB: dict[str, Axes] = {"embed_tokens.weight": VOCAB, "lm_head.weight": VOCAB}
_QKV_BIAS: dict[str, Axes] = {f"self_attn.{p}_proj.bias": COLUMN_BIAS for p in "qkv"}
# GPT-2's Conv1D stores [in, out] (transposed): column-parallel is dim 1 over tensor, row-parallel dim 0.
# Its attention stays fsdp-only: c_attn packs q, k and v along its output dim, so a contiguous split over
# tensor would cut across q/k/v instead of giving each device whole heads, and o_proj's (c_proj's) row split
# only pays off with head-split attention.
_GPT2_BLOCK: dict[str, Axes] = {
    "mlp.c_fc.weight": ("fsdp", TENSOR_AXIS), "mlp.c_fc.bias": COLUMN_BIAS, "mlp.c_proj.weight": (TENSOR_AXIS, "fsdp"),
}
_GPT2_VOCAB: dict[str, Axes] = {"wte.weight": VOCAB, "lm_head.weight": VOCAB}


def _llama_sizes(config: Any) -> dict[str, int]:
    return {"num_attention_heads": config.num_attention_heads,
            "num_key_value_heads": getattr(config, "num_key_value_heads", None) or config.num_attention_heads,
            "intermediate_size": config.intermediate_size}


def _gpt2_sizes(config: Any) -> dict[str, int]:
    return {"n_inner": config.n_inner or 4 * config.n_embd}


@dataclass(frozen=True)
class FamilyPlan:
    """The tensor-parallel plan of one model family: its weights' axes and the sizes T must divide."""

    block: Mapping[str, Axes]
    vocab: Mapping[str, Axes]  # applied only when T divides the vocabulary (else fsdp-only, noted in the log)
    sizes: Callable[[Any], dict[str, int]]


#: config.model_type -> plan (Llama-shaped families share one)
FAMILY_PLANS: dict[str, FamilyPlan] = {
    "llama": FamilyPlan(_LLAMA_BLOCK, _LLAMA_VOCAB, _llama_sizes),
    "mistral": FamilyPlan(_LLAMA_BLOCK, _LLAMA_VOCAB, _llama_sizes),
    "gemma": FamilyPlan(_LLAMA_BLOCK, _LLAMA_VOCAB, _llama_sizes),
    "qwen2": FamilyPlan({**_LLAMA_BLOCK, **_QKV_BIAS}, _LLAMA_VOCAB, _llama_sizes),
    "gpt2": FamilyPlan(_GPT2_BLOCK, _GPT2_VOCAB, _gpt2_sizes),
}


@dataclass
class TensorPlan:
    """The resolved plan of one model for one tensor size: pattern -> axes (see the module docstring)."""

    size: int
    weights: dict[str, Axes] = field(default_factory=dict)

    def axes_for(self, name: str) -> Optional[Axes]:
        """The axes of the parameter ``name`` (relative to its FSDP unit), or None when no pattern names it."""
        name = name.replace(".base_layer.", ".")  # PEFT's LoRA wrapper keeps the original weight there
        parts = name.split(".")
        suffixes = [".".join(parts[i:]) for i in range(len(parts))]
        for pattern, axes in self.weights.items():
            if pattern.startswith("re:"):
                if re.search(pattern[3:], name):
                    return axes
            elif any(fnmatch.fnmatchcase(s, pattern) for s in suffixes):
                return axes
        return None


def _axes(value: Any, where: str) -> Axes:
    """Axes from a user mapping (JSON lists or tuples; None/null for an unsplit dim), checked against the mesh."""
    if not isinstance(value, (list, tuple)):
        raise ConfigError(f"tensor_parallel_plan[{where!r}]={value!r} must be a list with one entry per weight dim, "
                          f"each a mesh axis ({', '.join(MESH_AXES)}), a list of them or null")
    out: list[Union[None, str, tuple[str, ...]]] = []
    for entry in value:
        names = entry if isinstance(entry, (list, tuple)) else [entry]
        for n in names:
            if n is not None and n not in MESH_AXES:
                raise ConfigError(f"tensor_parallel_plan[{where!r}] names mesh axis {n!r}; allowed: {', '.join(MESH_AXES)}")
        out.append(tuple(names) if isinstance(entry, (list, tuple)) else entry)
    return tuple(out)


def parse_plan(value: Any) -> Optional[dict[str, Axes]]:
    """``tensor_parallel_plan`` as given (a mapping, or its JSON text) -> pattern -> axes; None stays None."""
    if value is None:
        return None
    if isinstance(value, str):
        import json

        try:
            value = json.loads(value)
        except json.JSONDecodeError as err:
            raise ConfigError(f"tensor_parallel_plan is not valid JSON: {err}") from None
    if not isinstance(value, Mapping):
        raise ConfigError(f"tensor_parallel_plan must be a mapping {{param-name glob or 're:regex': axes}}, "
                          f"got {type(value).__name__}")
    out = {}
    for pattern, axes in value.items():
        if str(pattern).startswith("re:"):
            try:
                re.compile(str(pattern)[3:])
            except re.error as err:
                raise ConfigError(f"tensor_parallel_plan key {pattern!r} is not a valid regex: {err}") from None
        out[str(pattern)] = _axes(axes, str(pattern))
    return out


def resolve_plan(config: Any, size: int, override: Optional[Mapping[str, Axes]] = None) -> TensorPlan:
    """The plan for a model of ``config`` split over ``size`` devices: ``override`` if given, else its family's.

    Raises a one-line ConfigError for a family with no plan (and no override) or a size T does not divide.
    """
    if override is not None:
        return TensorPlan(size, dict(override))
    model_type = getattr(config, "model_type", None)
    family = FAMILY_PLANS.get(model_type)
    if family is None:
        raise ConfigError(f"tensor_parallel_size={size}: no tensor-parallel plan for model_type {model_type!r} (plans: "
                          f"{', '.join(sorted(FAMILY_PLANS))}); give tensor_parallel_plan "
                          "{param-name glob: axes} or set tensor_parallel_size: 1")
    for what, n in family.sizes(config).items():
        if n % size:
            raise ConfigError(f"tensor_parallel_size={size} does not divide {what}={n} of this {model_type} model; "
                              f"choose a tensor_parallel_size that divides it")
    weights = dict(family.block)
    vocab = getattr(config, "vocab_size", 0) or 0
    if vocab % size == 0:
        weights.update(family.vocab)
    else:  # XLA would pad an uneven split; the embedding and LM head stay plain FSDP instead
        logger.warning("tensor_parallel_size=%d does not divide vocab_size=%d: embeddings and LM head stay plain FSDP "
                       "(sharded over fsdp x tensor on one dim)", size, vocab)
    return TensorPlan(size, weights)


def find_config(module: nn.Module) -> Any:
    """The transformers config of ``module`` (a model, or a block whose attention / MLP keeps it)."""
    for m in module.modules():
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "model_type"):
            return config
    return None


def _owner(module: nn.Module, name: str) -> tuple[nn.Module, str]:
    path, _, leaf = name.rpartition(".")
    return (module.get_submodule(path) if path else module), leaf


def _split_kind(module: nn.Module, leaf: str, axes: Axes) -> Optional[str]:
    """``"column"`` when the module's output features are split over tensor, ``"row"`` when its input features are,
    else None (only the weight of a Linear / Conv1D / Embedding says so)."""
    if leaf != "weight" or len(axes) != 2:
        return None
    has = [a == TENSOR_AXIS or (isinstance(a, tuple) and TENSOR_AXIS in a) for a in axes]
    out_dim = 1 if type(module).__name__ == "Conv1D" else 0  # Conv1D stores [in, out]
    if isinstance(module, nn.Embedding):
        return "row" if has[0] else None  # a vocab-split lookup: each device adds its rows, the output is whole
    if has[out_dim]:
        return "column"
    if has[1 - out_dim]:
        return "row"
    return None


#: transformers attention implementation (``config._attn_implementation``, not saved in config.json) that keeps
#: the heads split over ``tensor``: set on models whose q_proj is column-split
HEAD_LOCAL = "hf_xla_fsdp_head_local"


def register_head_local_attention() -> str:
    """Register :func:`head_local_attention` (and transformers' eager mask for it); returns its name."""
    from transformers.masking_utils import AttentionMaskInterface, eager_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(HEAD_LOCAL, head_local_attention)
    AttentionMaskInterface.register(HEAD_LOCAL, eager_mask)
    return HEAD_LOCAL


def head_local_attention(module: nn.Module, query: Any, key: Any, value: Any, attention_mask: Any,
                         scaling: float, dropout: float = 0.0, **kwargs: Any) -> tuple[Any, Any]:
    """transformers' eager attention, with einsums and sharding annotations so each device keeps its heads.

    Both SDPA and eager attention multiply through ``matmul`` on 4-D tensors, which XLA lowers by merging batch and
    heads into one dim; with the batch split over fsdp (more than one sample per device) and the heads over tensor
    that merged dim has no tiling, so XLA all-gathers q, k and v over ``tensor`` and every device computes every head
    (seen in the partitioned HLO). ``einsum`` keeps batch and heads as two dims.
    """
    import torch
    import torch_xla.distributed.spmd as xs

    mesh = xs.get_global_mesh()
    batch = ("replica", "fsdp")
    groups = query.shape[1] // key.shape[1]
    if groups > 1:  # GQA: each device's KV heads serve its own query heads (T divides the KV heads)
        key, value = key.repeat_interleave(groups, dim=1), value.repeat_interleave(groups, dim=1)
    for t in (query, key, value):
        xs.mark_sharding(t, mesh, (batch, TENSOR_AXIS, None, None))
    weights = torch.einsum("bhqd,bhkd->bhqk", query, key) * scaling
    if attention_mask is not None:
        weights = weights + attention_mask[:, :, :, : key.shape[-2]]
    weights = torch.nn.functional.softmax(weights, dim=-1, dtype=torch.float32).to(query.dtype)
    weights = torch.nn.functional.dropout(weights, p=dropout, training=module.training)
    out = torch.einsum("bhqk,bhkd->bhqd", weights, value).transpose(1, 2).contiguous()
    xs.mark_sharding(out, mesh, (batch, None, TENSOR_AXIS, None))
    return out, weights


def apply_plan(module: nn.Module, plan: TensorPlan, mesh: Any, batch_axes: Sequence[str]) -> int:
    """Mark the planned weights of ``module`` (already on the XLA device) with their 2D sharding, and annotate
    the outputs of the split layers; returns how many weights were split. Every other parameter is sharded over
    ``fsdp`` and ``tensor`` together on its largest dim (plain FSDP over all devices; 1-D ones over ``fsdp`` only).
    Parameters sharded already are left alone. Attention modules whose q_proj is column-split switch to
    :func:`head_local_attention` (through their config's ``_attn_implementation``).

    A column-parallel layer's output is marked split over batch and over ``tensor`` on its last dim (so attention
    runs on the local heads, the MLP on the local intermediate slice); a row-parallel layer's output is marked split
    over batch only, which makes XLA all-reduce the partial sums over ``tensor`` right there.
    """
    import torch_xla
    import torch_xla.distributed.spmd as xs

    batch = tuple(batch_axes)
    count = 0
    hooked: set[int] = set()
    columns: set[int] = set()
    for name, param in list(module.named_parameters()):
        if torch_xla._XLAC._get_xla_sharding_spec(param):
            continue
        axes = plan.axes_for(name)
        if axes is None:
            if param.dim():  # not split: plain FSDP over every device, as on a 1D mesh (fsdp alone would leave
                # a copy on each of the T devices); its largest dim, as SpmdFullyShardedDataParallel picks;
                spec: list[Any] = [None] * param.dim()
                # a 1-D one (norm weight, bias) over fsdp only: split over all devices, XLA broadcasts the shard
                # to [batch, seq, hidden] and then all-gathers that activation-sized tensor ("involuntary full
                # rematerialization"); split over fsdp it all-gathers the weight itself, as on a 1D mesh
                axis: Any = ("fsdp", TENSOR_AXIS) if param.dim() > 1 else "fsdp"
                spec[list(param.shape).index(max(param.shape))] = axis
                xs.mark_sharding(param, mesh, tuple(spec))
            continue
        if len(axes) != param.dim():
            raise ConfigError(f"tensor_parallel_plan gives {len(axes)} axes for {name}, which has {param.dim()} dims "
                              f"{list(param.shape)}")
        xs.mark_sharding(param, mesh, axes)
        count += 1
        owner, leaf = _owner(module, name)
        kind = _split_kind(owner, leaf, axes)
        if kind is not None and id(owner) not in hooked:
            hooked.add(id(owner))
            owner.register_forward_hook(_output_hook(mesh, batch, kind == "column"))
            if kind == "column":
                columns.add(id(owner))
    for sub in module.modules():
        q_proj = getattr(sub, "q_proj", None)
        q_proj = getattr(q_proj, "base_layer", q_proj)  # PEFT
        config = getattr(sub, "config", None)
        if (id(q_proj) in columns and hasattr(sub, "num_key_value_groups")
                and getattr(config, "_attn_implementation", None) in ("sdpa", "eager", HEAD_LOCAL)):
            config._attn_implementation = register_head_local_attention()
    return count


def _output_hook(mesh: Any, batch: tuple[str, ...], split_last: bool) -> Callable[..., None]:
    def hook(_module: nn.Module, _inputs: Any, output: Any) -> None:
        import torch
        import torch_xla.distributed.spmd as xs

        if isinstance(output, torch.Tensor) and output.dim() >= 2 and output.device.type == "xla":
            spec = (batch,) + (None,) * (output.dim() - 2) + (TENSOR_AXIS if split_last else None,)
            xs.mark_sharding(output, mesh, spec)

    return hook
