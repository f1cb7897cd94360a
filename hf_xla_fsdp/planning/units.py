"""Sizing a sharded model from its meta skeleton: units, parameters and bytes per rank."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import nn

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

SHARD_SIZE_MULTIPLE = 128  # XlaFullyShardedDataParallel pads every shard to a multiple of this


def _padded_numel(numel: int, world_size: int) -> int:
    unit = world_size * SHARD_SIZE_MULTIPLE
    return -(-numel // unit) * unit


def unit_params(model: nn.Module, blocks: list[str]) -> dict[str, list[Any]]:
    """Parameters owned by each FSDP unit (innermost unit wins; the root is ``""``), each counted once."""
    owner: dict[int, str] = {}
    params: dict[str, list[Any]] = {name: [] for name in [*blocks, ""]}
    for name in [*blocks, ""]:
        module = model.get_submodule(name) if name else model
        for p in module.parameters():
            if id(p) not in owner:
                owner[id(p)] = name
                params[name].append(p)
    return params


def plan(source: Any, plugin: "XlaFsdpPlugin", world_size: int = 1) -> dict[str, Any]:
    """Describe how ``source`` would be sharded over ``world_size`` ranks (nothing is materialized)."""
    from ..modeling.meta_init import build_skeleton, resolve_source
    from ..modeling.wrapping import plan_blocks

    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    src = resolve_source(source)
    sk = build_skeleton(src, record_init=False)  # sizing needs the skeleton only
    model = sk.model
    blocks = plan_blocks(model, plugin).units
    units = unit_params(model, blocks)
    from ..engines import engine_for

    flat = engine_for(plugin, require_runtime=False).flat_shards

    def shard_bytes(p: Any) -> int:
        if flat:  # flattened, padded to a multiple of world * 128 (XlaFullyShardedDataParallel)
            return _padded_numel(p.numel(), world_size) // world_size * p.element_size()
        rows = -(-p.shape[0] // world_size) if p.dim() else 0  # dim-0 rows, as many as the fullest rank's
        return (rows * (p.numel() // p.shape[0]) if p.dim() else p.numel()) * p.element_size()

    per_unit = []
    for name, params in units.items():
        numel = sum(p.numel() for p in params)
        nbytes = sum(p.numel() * p.element_size() for p in params)
        shard = sum(shard_bytes(p) for p in params)
        per_unit.append({"unit": name or "<root>", "params": numel, "bytes": nbytes, "bytes_per_rank": shard})
    total = sum(u["params"] for u in per_unit)
    return {
        "model": type(model).__name__,
        "world_size": world_size,
        "engine": plugin.engine_key,
        "sharding": plugin.sharding,
        "num_units": len(per_unit),
        "total_params": total,
        "total_bytes": sum(u["bytes"] for u in per_unit),
        "bytes_per_rank": sum(u["bytes_per_rank"] for u in per_unit),
        "largest_unit_bytes": max(u["bytes"] for u in per_unit),
        "units": per_unit,
    }
