"""Loading: one entry point for every engine; the engine restores its tensors, the rest is shared here."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import CheckpointError
from .codec import CheckpointCodec, codec_of
from .layout import COMPLETE_MARKER, RNG_CPU, check_side_files, rank_file_stem, read_marker
from .readers import LAYOUT_FLAT, LAYOUT_PIECES, RankFile, check_present, marker_layout, open_own
from .schema import check_like
from .state import restore_rng

_LAYOUT_TITLES = {LAYOUT_FLAT: "FSDP v1", LAYOUT_PIECES: "FSDP v2 (SPMD)"}


def _restore_rng_from(f: RankFile, codec: CheckpointCodec) -> None:
    restore_rng(f.meta, f.get(RNG_CPU) if RNG_CPU in f.names() else None, codec.set_rng_state)


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
    from .background import wait_for_pending_save

    wait_for_pending_save()  # a save still being written in the background (maybe this one) ends first
    engine = codec_of(model)
    rank, world = engine.rank_world(model)
    fetched, ckpt_dir, marker = _located(ckpt_dir, lambda m: _needed(m, engine.checkpoint_layout, rank, world))
    saved = marker_layout(ckpt_dir, marker)
    if saved != engine.checkpoint_layout:
        was, now = _LAYOUT_TITLES.get(saved, saved), _LAYOUT_TITLES.get(engine.checkpoint_layout, engine.title)
        raise CheckpointError(f"{ckpt_dir} was saved by {was} and cannot be resumed into an {now} model; "
                              "consolidate it (hf-xla-fsdp consolidate) and build the model from that directory")
    restored = engine.restore(ckpt_dir, marker, model, optimizer)
    del fetched  # a local copy of a URL's files goes now
    meta = restored.meta
    if scheduler is not None and meta.get("scheduler") is not None:
        source = (restored.rng_file.path if meta is restored.rng_file.meta
                  else ckpt_dir / f"{rank_file_stem(0, int(marker['world_size']))}.safetensors").with_suffix(".json")
        check_like(meta["scheduler"], scheduler.state_dict(), "scheduler", source, "scheduler")
        scheduler.load_state_dict(meta["scheduler"])
    if restore_rng:
        _restore_rng_from(restored.rng_file, engine)
    return {"step": meta.get("step", 0), "extra": meta.get("extra", {}), "run_id": meta.get("run_id"),
            **restored.info}


def restore_rng_state(ckpt_dir: Union[str, Path], model: nn.Module) -> None:
    """Restore the Python, NumPy, torch CPU and XLA RNG states the calling rank saved in ``ckpt_dir``.

    After a world-size change rank r takes the state of saved rank ``r % saved_world_size``.
    """
    from .background import wait_for_pending_save

    wait_for_pending_save()
    codec = codec_of(model)
    rank, _ = codec.rank_world(model)

    def own(marker: dict[str, Any]) -> list[str]:
        world = int(marker["world_size"])
        return [f"{rank_file_stem(rank % world, world)}.safetensors"]

    fetched, ckpt_dir, marker = _located(ckpt_dir, own)
    saved_world = int(marker["world_size"])
    _restore_rng_from(open_own(ckpt_dir, marker, rank % saved_world, saved_world), codec)
    del fetched


def _needed(marker: dict[str, Any], layout: str, rank: int, world: int) -> Optional[list[str]]:
    """The rank files a rank reads to resume: its own when nothing changed, else all (resharding reads rows of each)."""
    if int(marker["world_size"]) == world and marker.get("engine", LAYOUT_FLAT) == layout == LAYOUT_FLAT:
        return [f"{rank_file_stem(rank, world)}.safetensors"]
    return None


def _located(ckpt: Union[str, Path], needed: Callable[[dict[str, Any]], Optional[list[str]]],
             ) -> tuple[Any, Path, dict[str, Any]]:
    """A checkpoint to read from: its local directory (for a URL, a temporary copy of only the ``needed(marker)``
    files), its validated marker, and the check that every needed file is there before anything is read."""
    from .storage import Fetched, is_url, local_path, remote_fs

    fetched = None
    if is_url(ckpt):
        fs, root = remote_fs(str(ckpt))
        try:
            names = needed(json.loads(fs.cat_file(f"{root}/{COMPLETE_MARKER}")))
        except (FileNotFoundError, ValueError, KeyError, TypeError, AttributeError):
            names = []  # Fetched / read_marker say what is wrong
        fetched = Fetched(str(ckpt), names)
        path = fetched.path
    else:
        path = local_path(ckpt)
    marker = read_marker(path)
    check_present(path, marker, needed(marker))
    if fetched is None:  # the side files a resume may read (trainer state, config, tokenizer) are intact
        check_side_files(path, marker)
    return fetched, path, marker
