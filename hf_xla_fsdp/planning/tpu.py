"""Does a model train on a TPU slice? Memory per chip from the meta skeleton, against the chip's HBM.

Exact (the engine's own padding and sharding rules, :meth:`hf_xla_fsdp.engines.Engine.plan_shards`, tested against
wrapped models' tensors): parameter, gradient and optimizer-state bytes per chip, and the bytes of the largest
all-gathered unit. The planner asks the engine; it knows no engine's rule itself.
Estimates (labelled so everywhere): the gathered working set during a step and the activations.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch

from ..engines import PlannedUnit, engine_for
from ..errors import ConfigError
from .units import planned_units

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

GIB = 2**30


@dataclass(frozen=True)
class TpuGeneration:
    """One TPU generation as Google Cloud publishes it."""

    name: str
    hbm_bytes: int  # per chip
    cores_per_chip: int  # TensorCores
    counts_cores: bool  # the slice name's number counts TensorCores (v4-8 = 4 chips), else chips
    sizes: tuple[int, ...]  # standard slice sizes, in the unit the name counts
    aliases: tuple[str, ...] = ()
    source: str = ""
    peak_bf16_flops: float = 0.0  # per chip, dense bf16 matrix multiplies
    device_kinds: tuple[str, ...] = ()  # what the PJRT runtime reports as the device kind of its chips


# The one table of TPU hardware. Source: Google Cloud TPU documentation, "System architecture" and
# "Configurations" of each generation (checked 2026-11):
#   https://cloud.google.com/tpu/docs/v4   : 2 TensorCores per chip, "HBM2 capacity 32 GiB"; accelerator type
#                                            v4-N counts TensorCores (v4-8 = 4 chips); pod 4096 chips
#   https://cloud.google.com/tpu/docs/v5e  : 1 TensorCore per chip, "HBM2 capacity 16 GB"; v5litepod-N counts
#                                            chips; slices 1, 4, 8, 16, 32, 64, 128, 256 chips
#   https://cloud.google.com/tpu/docs/v5p  : 2 TensorCores per chip, "HBM2e capacity 95 GB"; v5p-N counts
#                                            TensorCores ("v5p-32 ... 32 TensorCores (16 chips)"); up to 6144 chips
#   https://cloud.google.com/tpu/docs/v6e  : 1 TensorCore per chip, "HBM capacity per chip 32 GB"; 256-chip pods
# The pages write GB for v5e/v5p/v6e and GiB for v4; HBM stacks come in binary sizes, so all four are taken
# as GiB (the runtime reserves a little of it: a plan within a few percent of the limit is marginal).
# Peak bf16 compute per chip, the same pages ("Peak compute per chip (bf16)"): v4 275 TFLOP/s, v5e 197, v5p 459,
# v6e 918. The device kinds are PJRT's TPU client's (``xm.xla_device_kind()``; JAX reports the same strings:
# "TPU v4", "TPU v5 lite" = v5e, "TPU v5" = v5p, "TPU v6 lite" = v6e).
_POW2_CORES = tuple(2**k for k in range(3, 14))  # 8 .. 8192
TPU_GENERATIONS: dict[str, TpuGeneration] = {
    "v4": TpuGeneration("v4", 32 * GIB, 2, True, _POW2_CORES, source="https://cloud.google.com/tpu/docs/v4",
                        peak_bf16_flops=275e12, device_kinds=("TPU v4",)),
    "v5e": TpuGeneration("v5e", 16 * GIB, 1, False, (1, 4, 8, 16, 32, 64, 128, 256), aliases=("v5litepod",),
                         source="https://cloud.google.com/tpu/docs/v5e", peak_bf16_flops=197e12,
                         device_kinds=("TPU v5 lite", "TPU v5e")),
    "v5p": TpuGeneration("v5p", 95 * GIB, 2, True, _POW2_CORES + (12288,), source="https://cloud.google.com/tpu/docs/v5p",
                         peak_bf16_flops=459e12, device_kinds=("TPU v5", "TPU v5p")),
    "v6e": TpuGeneration("v6e", 32 * GIB, 1, False, (1, 4, 8, 16, 32, 64, 128, 256),
                         source="https://cloud.google.com/tpu/docs/v6e", peak_bf16_flops=918e12,
                         device_kinds=("TPU v6 lite", "TPU v6e")),
}


def generation_for_device_kind(kind: Optional[str]) -> Optional[TpuGeneration]:
    """The TPU generation whose chips the runtime reports as ``kind`` (``xm.xla_device_kind()``), or whose name or
    alias ``kind`` is (a slice's accelerator type, as read under SPMD: ``v5litepod``); None for any other device
    (XLA:CPU reports ``cpu``)."""
    wanted = str(kind or "").strip().lower()
    return next((g for g in TPU_GENERATIONS.values()
                 if wanted in (*(k.lower() for k in g.device_kinds), g.name, *g.aliases)), None)


@dataclass(frozen=True)
class TpuSlice:
    """A named slice: its generation and chip count (one XLA device, so one FSDP rank, per chip)."""

    name: str
    generation: TpuGeneration
    chips: int

    @property
    def hbm_bytes(self) -> int:
        """HBM of one chip."""
        return self.generation.hbm_bytes


def known_slices() -> str:
    """The known slice names, for messages."""
    parts = []
    for gen in TPU_GENERATIONS.values():
        names = ", ".join(f"{gen.name}-{n}" for n in gen.sizes)
        alias = f" (also {gen.aliases[0]}-N)" if gen.aliases else ""
        parts.append(f"{names}{alias}")
        if gen.counts_cores:
            parts[-1] += f" [{gen.name}-N counts TensorCores, {gen.cores_per_chip} per chip]"
    return "; ".join(parts)


def parse_slice(name: str) -> TpuSlice:
    """``v5p-8`` -> 4 chips of 95 GiB; an unknown name lists the known ones."""
    m = re.fullmatch(r"\s*([a-z0-9]+?)-(\d+)\s*", str(name).lower())
    gen = None
    if m:
        prefix, count = m.group(1), int(m.group(2))
        gen = next((g for g in TPU_GENERATIONS.values() if prefix == g.name or prefix in g.aliases), None)
    if gen is None or count not in gen.sizes:
        raise ConfigError(f"unknown TPU slice {name!r}; known slices: {known_slices()}")
    chips = count // gen.cores_per_chip if gen.counts_cores else count
    return TpuSlice(f"{gen.name}-{count}", gen, chips)


def slice_for(gen: TpuGeneration, count: int) -> TpuSlice:
    """The slice of ``gen`` named with ``count``."""
    return TpuSlice(f"{gen.name}-{count}", gen, count // gen.cores_per_chip if gen.counts_cores else count)


# --------------------------------------------------------------------------- estimates
def _dims(config: Any) -> dict[str, int]:
    """Transformer dimensions of a config (text or vision), for the activation estimate."""
    get = lambda *names, default=None: next((getattr(config, n) for n in names if getattr(config, n, None)), default)  # noqa: E731
    hidden = get("hidden_size", "n_embd", "d_model")
    layers = get("num_hidden_layers", "n_layer", "num_layers")
    heads = get("num_attention_heads", "n_head")
    if not (hidden and layers and heads):
        raise ConfigError(f"{type(config).__name__} names no hidden_size / num_hidden_layers / num_attention_heads: "
                          "the activation estimate needs a transformer config")
    return dict(hidden=int(hidden), layers=int(layers), heads=int(heads),
                kv_heads=int(get("num_key_value_heads", default=heads)),
                inter=int(get("intermediate_size", "n_inner", "ffn_dim", default=4 * hidden)),
                vocab=int(get("vocab_size", default=0) or 0),
                gated=int(bool(getattr(config, "hidden_act", None) in ("silu", "swiglu")
                               or "llama" in type(config).__name__.lower())))


def default_seq_len(config: Any) -> int:
    """Tokens per sample: patches + 1 for a ViT, else ``max_position_embeddings`` capped at 2048."""
    image, patch = getattr(config, "image_size", None), getattr(config, "patch_size", None)
    if image and patch:
        return (int(image) // int(patch)) ** 2 + 1
    return min(int(getattr(config, "max_position_embeddings", None) or 2048), 2048)


def activation_bytes(config: Any, batch: int, seq: int, elem: int, checkpointing: bool, num_labels: int = 0,
                     tensor: int = 1) -> dict[str, int]:
    """ESTIMATE of the activations a training step keeps for backward, per chip (``batch`` samples of ``seq``).

    Per layer, the tensors autograd saves in a standard pre-norm block (after Korthikanti et al. 2022,
    "Reducing Activation Recomputation in Large Transformer Models", without dropout masks): two norm
    inputs and outputs, Q, K, V, the attention probabilities (``heads * seq^2``: XLA's SDPA lowering
    materializes them), the attention output, the MLP's up/gate projections and activation. With
    activation checkpointing only each block's input is kept, plus one block's activations during its
    recomputation. Plus the logits and their fp32 copy for the loss (causal LMs).

    With tensor parallelism over ``tensor`` chips, ``batch`` samples are shared by those chips: the tensors inside
    attention and the MLP (Q, K, V, probabilities, attention output, MLP projections) and the logits are split over
    them; block inputs and norms are not (assumes the Llama-style plan, where attention and MLP are both split).
    """
    d = _dims(config)
    h, kv, inter = d["hidden"], d["hidden"] * d["kv_heads"] // d["heads"], d["inter"]
    tokens = batch * seq
    split = tokens * (2 * h + 2 * kv + (3 if d["gated"] else 2) * inter) + batch * d["heads"] * seq * seq
    per_layer_elems = tokens * 4 * h + -(-split // tensor)
    per_layer = per_layer_elems * elem
    outputs = d["vocab"] if d["vocab"] else num_labels
    logits = -(-(batch * (seq if d["vocab"] else 1)) * outputs * (elem + 4 + 4) // tensor)  # logits, fp32 upcast, grad
    full = d["layers"] * per_layer + logits
    ckpt = d["layers"] * tokens * h * elem + per_layer + logits
    return {"without_checkpointing": full, "with_checkpointing": ckpt,
            "used": ckpt if checkpointing else full, "per_layer": per_layer, "logits": logits}


# --------------------------------------------------------------------------- the plan
OPTIMIZERS = ("adamw", "sgd", "adafactor")


def optimizer_numels(optimizer: str, shard_shapes: list[tuple[int, ...]]) -> int:
    """Elements of optimizer state per chip (all fp32) for the local shards.

    adamw: ``exp_avg`` + ``exp_avg_sq`` (its ``step`` is a host scalar); sgd: none (torch's default
    ``momentum=0``); adafactor (transformers, ``beta1=None``): a factored row + column statistic for
    tensors of 2+ dims, a full ``exp_avg_sq`` for 1-D ones, and a 0-d ``RMS`` per tensor. FSDP v1
    shards are flat (1-D, full statistic) unless ``shard_param_on_dim_0``; v2 shards keep their shape.
    """
    if optimizer == "adamw":
        return 2 * sum(math.prod(s) for s in shard_shapes)
    if optimizer == "sgd":
        return 0
    if optimizer == "adafactor":
        total = len(shard_shapes)
        for shape in shard_shapes:
            total += math.prod(shape[:-1]) + math.prod(shape[:-2]) * shape[-1] if len(shape) >= 2 else math.prod(shape)
        return total
    raise ConfigError(f"optimizer={optimizer!r} is not valid; allowed values: {', '.join(OPTIMIZERS)}")


def _dtype_size(dtype: Optional[torch.dtype]) -> int:
    return torch.finfo(dtype or torch.float32).bits // 8


@dataclass
class _Model:
    """What the plan needs from the skeleton, extracted once (re-planned for other chip counts cheaply)."""

    config: Any
    class_name: str
    planned: list[PlannedUnit]  # the units, their own parameters' (numel, shape) and names within them
    buffer_bytes: int
    total_params: int

    @property
    def units(self) -> list[tuple[str, list[tuple[int, tuple[int, ...]]]]]:
        """``(unit name, [(numel, shape), ...])`` of every unit."""
        return [(u.name, list(u.params)) for u in self.planned]


def _load_model(source: Any, plugin: "XlaFsdpPlugin") -> _Model:
    from ..modeling.meta_init import build_skeleton, resolve_source
    from .presets import is_preset, preset_config

    src = resolve_source(preset_config(source) if is_preset(source) else source)
    model = build_skeleton(src, record_init=False).model
    planned = planned_units(model, plugin)
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    return _Model(src.config, type(model).__name__, planned, buffers, sum(n for u in planned for n, _ in u.params))


def _per_chip(m: _Model, plugin: "XlaFsdpPlugin", chips: int, optimizer: str, batch: int, seq: int,
              checkpointing: bool, compute: Optional[torch.dtype]) -> dict[str, Any]:
    """Bytes per chip for ``chips`` chips (exact parts and estimates); the engine says how it shards."""
    engine = engine_for(plugin, require_runtime=False)
    shards, gathered_unit = engine.plan_shards(m.planned, m.config, chips, plugin)
    shard_shapes = [shape for unit in shards for shape in unit]
    tensor = engine.devices_per_sample(plugin)
    elem = _dtype_size(compute)
    params = 4 * sum(math.prod(s) for s in shard_shapes)
    optim = 4 * optimizer_numels(optimizer, shard_shapes)
    names = [name for name, _ in m.units]
    largest = max(range(len(names)), key=lambda i: gathered_unit[i])
    nested = [g for name, g in zip(names, gathered_unit) if name != "<root>"]
    root = gathered_unit[names.index("<root>")]
    # ESTIMATE of the gathered working set: the root stays gathered for the whole step (disable_reshard_on_root,
    # v1's default; v2 gathers it like any unit), plus one nested unit's full parameters and full gradients in
    # backward (before the reduce-scatter); root only (zero2): the whole model's parameters and gradients
    root_kept = engine.root_stays_gathered(plugin)
    if not nested:
        gathered = 2 * root * elem
    else:
        gathered = (root if root_kept else 0) * elem + 2 * max(nested + ([root] if not root_kept else [])) * elem
    acts = activation_bytes(m.config, batch, seq, elem, checkpointing, getattr(m.config, "num_labels", 0) or 0,
                            tensor=tensor)
    buffers = m.buffer_bytes  # replicated on every chip (cast to buffer_dtype: counted in fp32, an upper bound)
    exact = params + params + optim + buffers
    total = exact + gathered + acts["used"]
    mesh = engine.plan_mesh(plugin, chips)
    return {
        "chips": chips, "mesh": mesh,
        "parameters": params, "gradients": params, "optimizer_state": optim, "buffers": buffers,
        "largest_unit": {"unit": names[largest], "gathered_bytes": gathered_unit[largest] * elem},
        "estimate_gathered_working_set": gathered,
        "estimate_activations": {"with_checkpointing": acts["with_checkpointing"],
                                 "without_checkpointing": acts["without_checkpointing"], "used": acts["used"]},
        "total": total,
    }


def chip_memory(source: Any, plugin: "XlaFsdpPlugin", chips: int, *, optimizer: str = "adamw", batch_size: int = 1,
                seq_len: Optional[int] = None) -> dict[str, Any]:
    """Bytes per chip (one FSDP rank per chip) of training ``source`` with ``plugin`` over ``chips`` chips."""
    m = _load_model(source, plugin)
    return _per_chip(m, plugin, chips, optimizer, batch_size, int(seq_len or default_seq_len(m.config)),
                     plugin.activation_checkpointing, plugin.compute_dtype)


def plan_tpu(source: Any, plugin: "XlaFsdpPlugin", tpu: str, *, batch_size: int = 1, seq_len: Optional[int] = None,
             optimizer: str = "adamw") -> dict[str, Any]:
    """Per-chip memory of training ``source`` with ``plugin`` on the slice ``tpu``, and whether it fits.

    ``batch_size`` is per chip; with ``tensor_parallel_size`` T > 1, per group of T chips (they share each sample:
    the global batch is ``batch_size * chips / T``). Nothing is materialized: the model is a meta skeleton.
    """
    slc = parse_slice(tpu)
    auto = plugin.tensor_parallel_size == "auto"
    if auto:  # planned as FSDP alone first; the proposed size is then the plan
        plugin = dataclasses.replace(plugin, tensor_parallel_size=1)
    if optimizer not in OPTIMIZERS:
        raise ConfigError(f"optimizer={optimizer!r} is not valid; allowed values: {', '.join(OPTIMIZERS)}")
    if batch_size < 1:
        raise ConfigError(f"batch_size={batch_size} must be >= 1")
    m = _load_model(source, plugin)
    seq = int(seq_len or default_seq_len(m.config))
    ckpt, compute = plugin.activation_checkpointing, plugin.compute_dtype

    def chip(p: "XlaFsdpPlugin" = plugin, chips: int = slc.chips, b: int = batch_size, c: bool = ckpt,
             dt: Optional[torch.dtype] = compute, model: _Model = m) -> dict[str, Any]:
        return _per_chip(model, p, chips, optimizer, b, seq, c, dt)

    here = chip()
    hbm = slc.hbm_bytes
    fits = here["total"] <= hbm
    suggestions: list[dict[str, Any]] = []
    if not fits:
        suggestions = _suggestions(m, plugin, slc, batch_size, seq, optimizer, chip, source)
    tensor = None
    if engine_for(plugin, require_runtime=False).splits_tensors() and plugin.tensor_parallel_size == 1:
        tensor = smallest_tensor_parallel(plugin, slc, chip)
        if not fits and tensor["size"] is not None:
            plugin = dataclasses.replace(plugin, tensor_parallel_size=tensor["size"])
            if auto:  # tensor_parallel_size: auto takes the planner's choice
                here, fits, suggestions = chip(p=plugin), True, []
            else:
                suggestions.insert(0, {"change": f"--tensor-parallel-size {tensor['size']}",
                                       "total": chip(p=plugin)["total"], "fits": True})
                plugin = dataclasses.replace(plugin, tensor_parallel_size=1)
    return {
        "fits": fits,
        "model": m.class_name, "total_params": m.total_params,
        "tpu": {"slice": slc.name, "chips": slc.chips, "hbm_per_chip": hbm, "source": slc.generation.source},
        "mesh": here["mesh"],
        "settings": {"engine": plugin.engine, "engine_title": engine_for(plugin, require_runtime=False).title,
                     "version": plugin.version, "sharding": plugin.sharding, "optimizer": optimizer,
                     "batch_size_per_chip": batch_size, "seq_len": seq, "activation_checkpointing": ckpt,
                     "compute_dtype": str(compute or torch.float32).removeprefix("torch."),
                     "flatten_parameters": plugin.flatten_parameters,
                     "tensor_parallel_size": plugin.tensor_parallel_size},
        "tensor_parallel": tensor,
        "per_chip": here,
        "headroom": hbm - here["total"],
        "note": "parameters, gradients, optimizer_state, buffers and largest_unit are exact (FSDP's own padding and "
                "sharding rules); estimate_* are estimates (activations after Korthikanti et al. 2022; XLA's "
                "scheduling and fusion change the real peak)",
        "suggestions": suggestions,
        "throughput": _throughput(m, seq, slc),
    }


def _throughput(m: _Model, seq: int, slc: TpuSlice) -> Optional[dict[str, Any]]:
    """ESTIMATE of the tokens per second per chip (:func:`hf_xla_fsdp.planning.flops.expected_tokens_per_second`)."""
    from .flops import expected_tokens_per_second, flops_from_counts

    flops = flops_from_counts(m.config, m.total_params)
    if flops is None or not slc.generation.peak_bf16_flops:
        return None
    return expected_tokens_per_second(flops, seq, slc.generation.peak_bf16_flops)


def smallest_tensor_parallel(plugin: "XlaFsdpPlugin", slc: TpuSlice, chip: Any) -> dict[str, Any]:
    """The smallest tensor_parallel_size (a power of two dividing the chips, allowed by the model's plan) with which
    the plan fits, and why: ``{"size": T or None, "why": one line}``."""
    base = chip()
    if base["total"] <= slc.hbm_bytes:
        return {"size": 1, "why": "fits with FSDP alone (tensor_parallel_size 1): no tensor parallelism needed"}
    tried = []
    t = 2
    while t <= slc.chips // plugin.replica_size:
        if slc.chips % (plugin.replica_size * t) == 0:
            try:
                result = chip(p=dataclasses.replace(plugin, tensor_parallel_size=t))
            except ConfigError as err:  # e.g. heads not divisible: larger sizes are not either, for powers of two
                tried.append(f"{t}: {err}")
                break
            if result["total"] <= slc.hbm_bytes:
                g = lambda n: f"{n / GIB:.2f} GiB"  # noqa: E731
                return {"size": t, "why": f"FSDP alone needs {g(base['total'])} per chip, over the {g(slc.hbm_bytes)} of "
                                          f"HBM; tensor_parallel_size {t} divides the gathered working set by {t} "
                                          f"({g(base['estimate_gathered_working_set'])} -> "
                                          f"{g(result['estimate_gathered_working_set'])}) and the activations inside "
                                          f"blocks, for {g(result['total'])} per chip; each sample is then shared "
                                          f"by {t} chips (global batch / {t})"}
            tried.append(f"{t}: {result['total'] / GIB:.2f} GiB")
        t *= 2
    return {"size": None, "why": "no tensor_parallel_size fits on this slice (" + "; ".join(tried) + ")"}


def choose_tensor_parallel(source: Any, plugin: "XlaFsdpPlugin", devices: int, device_bytes: Optional[int]
                           ) -> tuple[int, str]:
    """``tensor_parallel_size: auto``: the smallest T with which training ``source`` fits ``devices`` devices of
    ``device_bytes`` each (batch 1 per fsdp rank, the model's default sequence length, AdamW), and why."""
    if device_bytes is None:
        return 1, "the runtime reports no device memory limit (XLA:CPU), so FSDP alone"
    base = dataclasses.replace(plugin, tensor_parallel_size=1)
    m = _load_model(source, base)
    seq = default_seq_len(m.config)
    gen = TpuGeneration("device", device_bytes, 1, False, (devices,))
    slc = TpuSlice(f"{devices} devices", gen, devices)

    def chip(p: "XlaFsdpPlugin" = base, chips: int = devices) -> dict[str, Any]:
        return _per_chip(m, p, chips, "adamw", 1, seq, base.activation_checkpointing, base.compute_dtype)

    choice = smallest_tensor_parallel(base, slc, chip)
    if choice["size"] is None:
        return 1, choice["why"] + "; FSDP alone"
    return choice["size"], choice["why"]


def _suggestions(m: _Model, plugin: "XlaFsdpPlugin", slc: TpuSlice, batch: int, seq: int, optimizer: str, chip: Any,
                 source: Any) -> list[dict[str, Any]]:
    """Settings that would make it fit, each with its per-chip total: one change at a time, then all together."""
    import dataclasses

    hbm = slc.hbm_bytes
    out: list[dict[str, Any]] = []

    def add(change: str, result: Optional[dict[str, Any]]) -> None:
        total = None if result is None else result["total"]
        out.append({"change": change, "total": total, "fits": total is not None and total <= hbm})

    def smallest_slice(**kw: Any) -> Optional[TpuSlice]:
        for count in slc.generation.sizes:
            bigger = slice_for(slc.generation, count)
            if bigger.chips >= slc.chips and chip(chips=bigger.chips, **kw)["total"] <= hbm:
                return bigger
        return None

    more = smallest_slice()
    add(f"--tpu {more.name} ({more.chips} chips)" if more else f"more chips alone: no {slc.generation.name} slice fits",
        chip(chips=more.chips) if more else None)
    combined: dict[str, Any] = {}
    if not plugin.activation_checkpointing:
        add("--activation-checkpointing", chip(c=True))
        combined["c"] = True
    if batch > 1:
        best = next((b for b in range(batch - 1, 0, -1) if chip(b=b)["total"] <= hbm), 1)
        add(f"--batch-size {best}", chip(b=best))
    if plugin.sharding == "zero2":
        zero3 = dataclasses.replace(plugin, sharding="zero3")
        combined["p"], combined["model"] = zero3, _load_model(source, zero3)
        add("sharding zero3 (a unit per block)", chip(p=zero3, model=combined["model"]))
    engine = engine_for(plugin, require_runtime=False)  # the planner runs nothing: no runtime needed
    if engine.compute_dtype_saves_memory(plugin) and plugin.compute_dtype in (None, torch.float32):
        add("--compute-dtype bfloat16", chip(dt=torch.bfloat16))
        combined["dt"] = torch.bfloat16
    if combined:
        flags = " ".join(f for k, f in (("c", "--activation-checkpointing"), ("dt", "--compute-dtype bfloat16"),
                                         ("p", "sharding zero3")) if k in combined)
        best = smallest_slice(**combined)
        if best is None:
            add(f"{flags}: no {slc.generation.name} slice fits even so", None)
        else:
            add(f"{flags} --tpu {best.name}", chip(chips=best.chips, **combined))
    return out


def format_plan(report: dict[str, Any]) -> str:
    """The plan as text: one line per quantity, estimates labelled."""
    g = lambda n: f"{n / GIB:8.2f} GiB"  # noqa: E731
    pc, s, t = report["per_chip"], report["settings"], report["tpu"]
    lines = [
        f"{report['model']} ({report['total_params'] / 1e9:.2f}B parameters) on {t['slice']}: {t['chips']} chips x "
        f"{t['hbm_per_chip'] / GIB:.0f} GiB HBM",
        *([f"mesh: replica {report['mesh']['replica']} x fsdp {report['mesh']['fsdp']} x tensor "
           f"{report['mesh']['tensor']}"] if report.get("mesh") else []),
        f"settings: {s.get('engine_title') or s.get('engine')} {s['sharding']}, "
        f"{s['optimizer']}, batch {s['batch_size_per_chip']}/"
        f"{'chip' if s.get('tensor_parallel_size', 1) == 1 else str(s['tensor_parallel_size']) + ' chips'} x "
        f"{s['seq_len']} tokens, compute {s['compute_dtype']}, activation checkpointing "
        f"{'on' if s['activation_checkpointing'] else 'off'}",
        "per chip:",
        f"  parameters (exact)                 {g(pc['parameters'])}",
        f"  gradients (exact)                  {g(pc['gradients'])}",
        f"  optimizer state (exact)            {g(pc['optimizer_state'])}",
        f"  buffers (exact)                    {g(pc['buffers'])}",
        f"  largest unit all-gathered (exact)  {g(pc['largest_unit']['gathered_bytes'])}  ({pc['largest_unit']['unit']})",
        f"  gathered working set (ESTIMATE)    {g(pc['estimate_gathered_working_set'])}",
        f"  activations (ESTIMATE)             {g(pc['estimate_activations']['used'])}  "
        f"(with checkpointing {g(pc['estimate_activations']['with_checkpointing']).strip()}, without "
        f"{g(pc['estimate_activations']['without_checkpointing']).strip()})",
        f"  total                              {g(pc['total'])}  of {g(t['hbm_per_chip']).strip()}",
        f"fits: {'true' if report['fits'] else 'false'}",
    ]
    if report.get("throughput"):
        tp = report["throughput"]
        low, high = tp["tokens_per_second_per_chip"]
        lines.insert(-1, f"throughput (ESTIMATE): {low:,.0f} to {high:,.0f} tokens/s per chip at "
                         f"{tp['mfu_band'][0]:.0%} to {tp['mfu_band'][1]:.0%} MFU ({tp['flops_per_token']:.3g} FLOPs "
                         f"per token, {tp['peak_bf16_flops_per_chip'] / 1e12:.0f} TFLOP/s bf16 per chip)")
    if report.get("tensor_parallel"):
        lines.append(f"tensor parallel: {report['tensor_parallel']['size']} ({report['tensor_parallel']['why']})")
    for sug in report["suggestions"]:
        total = "" if sug["total"] is None else f": {g(sug['total']).strip()} per chip, fits {str(sug['fits']).lower()}"
        lines.append(f"  try {sug['change']}{total}")
    return "\n".join(lines)
