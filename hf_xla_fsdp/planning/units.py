"""Sizing a sharded model from its meta skeleton: units, parameters and bytes per rank."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

from torch import nn

from ..engines import PlannedUnit, engine_for

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin


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


def planned_units(model: nn.Module, plugin: "XlaFsdpPlugin") -> list[PlannedUnit]:
    """The FSDP units ``plugin`` makes of ``model`` (a meta skeleton), innermost first and the root (``"<root>"``)
    last, with their own parameters' ``(numel, shape)`` and names within the unit: what an engine plans shards of."""
    from ..modeling.wrapping import plan_blocks

    blocks = plan_blocks(model, plugin).units
    out = []
    for name, params in unit_params(model, blocks).items():
        ids = {id(p) for p in params}
        # in unit_params' order (parameters() is named_parameters() without the names)
        names = [n for n, p in (model.get_submodule(name) if name else model).named_parameters() if id(p) in ids]
        out.append(PlannedUnit(name or "<root>", tuple((p.numel(), tuple(p.shape)) for p in params), tuple(names)))
    return out


def plan(source: Any, plugin: "XlaFsdpPlugin", world_size: int = 1) -> dict[str, Any]:
    """Describe how ``source`` would be sharded over ``world_size`` ranks (nothing is materialized)."""
    from ..modeling.meta_init import build_skeleton, resolve_source

    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    src = resolve_source(source)
    model = build_skeleton(src, record_init=False).model  # sizing needs the skeleton only
    units = planned_units(model, plugin)
    shards, _ = engine_for(plugin).plan_shards(units, src.config, world_size, plugin)  # the engine's own rule
    elem = next(model.parameters()).element_size()
    per_unit = [{"unit": unit.name, "params": sum(n for n, _ in unit.params),
                 "bytes": sum(n for n, _ in unit.params) * elem,
                 "bytes_per_rank": sum(math.prod(s) for s in mine) * elem} for unit, mine in zip(units, shards)]
    total = sum(u["params"] for u in per_unit)
    return {
        "model": type(model).__name__,
        "world_size": world_size,
        "sharding": plugin.sharding,
        "num_units": len(per_unit),
        "total_params": total,
        "total_bytes": sum(u["bytes"] for u in per_unit),
        "bytes_per_rank": sum(u["bytes_per_rank"] for u in per_unit),
        "largest_unit_bytes": max(u["bytes"] for u in per_unit),
        "units": per_unit,
    }
