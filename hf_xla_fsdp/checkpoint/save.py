"""Saving: every rank writes its files into a staging directory, rank 0 marks the save complete and publishes it.

What a rank's tensors are is the engine's business (:meth:`~hf_xla_fsdp.engines.base.Engine.rank_state`);
the file protocol here is the same for every engine: tensors streamed into
``rank-R-of-W.safetensors``, metadata into ``rank-R-of-W.json``, then ``checkpoint_complete.json``
and an atomic rename.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import CheckpointError
from .checksums import default_algorithm, table_digest
from .layout import (
    COMPLETE_MARKER,
    FORMAT,
    RNG_CPU,
    publish,
    rank_file_stem,
    staging_dir,
    write_bytes_atomic,
)
from .readers import LAYOUT_FLAT
from .safetensors_io import write_safetensors_streaming
from .state import rng_meta


def rank_world(model: nn.Module) -> tuple[int, int]:
    """``(rank, world size)`` in rank files: FSDP v1 ranks, or SPMD processes for FSDP v2."""
    from ..engines import engine_of

    return engine_of(model).rank_world(model)


def _model_meta(model: nn.Module) -> dict[str, Any]:
    """The transformers config of the model inside the wrappers (under adapters, the base model's) and, for a
    PEFT model, every adapter's peft config (so the checkpoint can become adapter files on its own)."""
    import json

    from ..engines import unwrap

    inner = unwrap(model)
    out: dict[str, Any] = {"model_config": None}
    adapters = getattr(inner, "peft_config", None)
    if adapters is not None and hasattr(inner, "get_base_model"):  # a peft.PeftModel (peft itself is not imported)
        def plain(value: Any) -> Any:  # sets (target_modules) as sorted lists, enums and the like as text
            return sorted(value) if isinstance(value, (set, frozenset)) else str(value)

        out["peft"] = {"adapters": {name: json.loads(json.dumps(cfg.to_dict(), default=plain))
                                    for name, cfg in adapters.items()},
                       "active_adapter": getattr(inner, "active_adapter", None)}
        inner = inner.get_base_model()
    config = getattr(inner, "config", None)
    if config is not None:
        out["model_config"] = config.to_dict()
        out["model_config"]["architectures"] = [type(inner).__name__]
    return out


def write_rank_file(
    ckpt_dir: Union[str, Path],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    *,
    step: int = 0,
    run_id: Optional[str] = None,
    plugin: Any = None,
    extra: Optional[dict[str, Any]] = None,
) -> Path:
    """Write the calling rank's files into the staging directory of ``ckpt_dir``; returns the tensor file."""
    from ..engines import engine_of
    from ..runtime import sync

    engine = engine_of(model)
    rank, world = engine.rank_world(model)
    stage = staging_dir(ckpt_dir)
    stage.mkdir(parents=True, exist_ok=True)
    sync()  # pending updates land before reading values
    state = engine.rank_state(model, optimizer)
    cpu_rng = torch.get_rng_state()
    specs = [*state.specs, (RNG_CPU, tuple(cpu_rng.shape), cpu_rng.dtype)]
    stem = rank_file_stem(rank, world)
    tensor_path = stage / f"{stem}.safetensors"
    tmp = stage / f".{stem}.safetensors.tmp"
    algorithm = default_algorithm()
    sums = write_safetensors_streaming(tmp, specs, lambda name: cpu_rng if name == RNG_CPU else state.produce(name),
                                       {"format": "pt"}, checksum=algorithm)
    tmp.replace(tensor_path)
    meta = {
        "format": FORMAT, "file_id": uuid.uuid4().hex, "tensor_file_bytes": tensor_path.stat().st_size,
        "checksums": {"algorithm": algorithm, "tensors": sums},
        "rank": rank, "world_size": world, "run_id": run_id, "step": int(step), **state.meta,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": rng_meta(), **_model_meta(model),
        "plugin": plugin.to_dict() if plugin is not None else None,
        "extra": extra or {},
    }
    try:
        data = json.dumps(meta, indent=1).encode()
    except TypeError as err:
        raise CheckpointError(f"checkpoint metadata is not JSON-serialisable ({err}); "
                              "keep `extra` and the scheduler state plain") from None
    write_bytes_atomic(stage / f"{stem}.json", data)
    return tensor_path


def mark_complete(ckpt_dir: Union[str, Path], world_size: int) -> Path:
    """Rank 0, after every rank wrote its files: write the completion marker into the staging directory.

    The checkpoint is then readable at :func:`staging_dir` (e.g. to consolidate it in place) but not
    yet visible under its name; :func:`commit_checkpoint` publishes it.
    """
    ckpt_dir = Path(ckpt_dir)
    stage = staging_dir(ckpt_dir)
    files, first = {}, None
    for rank in range(world_size):
        stem = rank_file_stem(rank, world_size)
        meta_path, tensor_path = stage / f"{stem}.json", stage / f"{stem}.safetensors"
        if not meta_path.is_file() or not tensor_path.is_file():
            raise CheckpointError(f"cannot commit {ckpt_dir}: rank {rank} has not written {stem}.safetensors/.json")
        meta = json.loads(meta_path.read_text())
        first = first or meta
        files[tensor_path.name] = {"file_id": meta["file_id"], "bytes": meta["tensor_file_bytes"],
                                   "checksums": table_digest(meta.get("checksums"))}
    rank_files = set(files) | {f"{Path(n).stem}.json" for n in files}
    for stray in stage.iterdir():  # leftovers of an earlier save that was killed (e.g. another world size)
        if stray.is_file() and stray.name.startswith("rank-") and stray.name not in rank_files:
            stray.unlink()
    marker = {"format": FORMAT, "engine": first.get("engine", LAYOUT_FLAT), "world_size": world_size,
              "step": first["step"], "run_id": first["run_id"], "files": files}
    write_bytes_atomic(stage / COMPLETE_MARKER, json.dumps(marker, indent=1).encode())
    return stage


def commit_checkpoint(ckpt_dir: Union[str, Path], world_size: int, *, marked: bool = False) -> Path:
    """Rank 0, after every rank wrote its files: write the completion marker and publish the directory.

    ``marked=True`` when :func:`mark_complete` already ran for this save (a marker left in the
    staging directory by a killed save is never trusted otherwise).
    """
    ckpt_dir = Path(ckpt_dir)
    stage = staging_dir(ckpt_dir)
    if not marked:
        mark_complete(ckpt_dir, world_size)
    publish(stage, ckpt_dir)
    return ckpt_dir


def save_checkpoint(
    ckpt_dir: Union[str, Path],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    *,
    step: int = 0,
    run_id: Optional[str] = None,
    plugin: Any = None,
    extra: Optional[dict[str, Any]] = None,
    barrier: Optional[Callable[[str], None]] = None,
    before_commit: Optional[Callable[[Path], None]] = None,
) -> Path:
    """Save the calling rank's shard and, once every rank has, publish ``ckpt_dir`` atomically.

    Call it on every rank. ``barrier`` defaults to ``xm.rendezvous`` when several processes run.
    ``before_commit(stage)`` runs on rank 0 once the save is marked complete in its staging
    directory and before it is published (to add side files, or a consolidated copy, atomically).
    """
    from ..runtime import default_barrier

    barrier = barrier or default_barrier
    write_rank_file(ckpt_dir, model, optimizer, scheduler, step=step, run_id=run_id, plugin=plugin, extra=extra)
    barrier("hf_xla_fsdp.save.written")
    rank, world = rank_world(model)
    if rank == 0:
        mark_complete(ckpt_dir, world)
        if before_commit is not None:
            before_commit(staging_dir(ckpt_dir))
        commit_checkpoint(ckpt_dir, world, marked=True)
    barrier("hf_xla_fsdp.save.committed")
    return Path(ckpt_dir)
