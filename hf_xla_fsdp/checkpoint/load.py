"""Loading: one entry point for every engine; the engine restores its tensors, the rest is shared here."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Union

import torch
from torch import nn

from ..errors import CheckpointError
from .layout import RNG_CPU, read_marker
from .readers import LAYOUT_FLAT, LAYOUT_PIECES, RankFile, marker_layout, open_own
from .state import restore_rng

_LAYOUT_TITLES = {LAYOUT_FLAT: "FSDP v1", LAYOUT_PIECES: "FSDP v2 (SPMD)"}


def _restore_rng_from(f: RankFile) -> None:
    restore_rng(f.meta, f.get(RNG_CPU) if RNG_CPU in f.names() else None)


def load_checkpoint(
    ckpt_dir: Union[str, Path],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore the calling rank's model shard, optimizer, scheduler and RNG from ``ckpt_dir``.

    A checkpoint saved with another world size (or device count) is resharded on the fly, reading
    only what this rank needs. Returns ``step``, ``extra``, ``run_id``, ``saved_world_size`` (and
    what the engine adds, e.g. ``saved_devices``).
    """
    from ..engines import engine_of
    from .background import wait_for_pending_save

    wait_for_pending_save()  # a save still being written in the background (maybe this one) ends first
    ckpt_dir = Path(ckpt_dir)
    engine = engine_of(model)
    marker = read_marker(ckpt_dir)
    saved = marker_layout(ckpt_dir, marker)
    if saved != engine.checkpoint_layout:
        was, now = _LAYOUT_TITLES.get(saved, saved), _LAYOUT_TITLES.get(engine.checkpoint_layout, engine.title)
        raise CheckpointError(f"{ckpt_dir} was saved by {was} and cannot be resumed into an {now} model; "
                              "consolidate it (hf-xla-fsdp consolidate) and build the model from that directory")
    restored = engine.restore(ckpt_dir, marker, model, optimizer)
    meta = restored.meta
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if restore_rng:
        _restore_rng_from(restored.rng_file)
    return {"step": meta.get("step", 0), "extra": meta.get("extra", {}), "run_id": meta.get("run_id"),
            **restored.info}


def restore_rng_state(ckpt_dir: Union[str, Path], model: nn.Module) -> None:
    """Restore the Python, NumPy, torch CPU and XLA RNG states the calling rank saved in ``ckpt_dir``.

    After a world-size change rank r takes the state of saved rank ``r % saved_world_size``.
    """
    from ..engines import engine_of
    from .background import wait_for_pending_save

    wait_for_pending_save()
    ckpt_dir = Path(ckpt_dir)
    marker = read_marker(ckpt_dir)
    saved_world = int(marker["world_size"])
    rank, _ = engine_of(model).rank_world(model)
    _restore_rng_from(open_own(ckpt_dir, marker, rank % saved_world, saved_world))
