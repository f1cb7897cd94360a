"""Sharded rank checkpoints: layout and atomic publish, safetensors I/O, readers of every rank-file format,
save, load/reshard and streaming consolidation, for every engine.

This package imports torch only, never torch_xla nor an engine: what a rank's tensors are and how they
go back onto the devices is asked of the engine that wrapped the model, found on the model itself
(:mod:`.codec`), so consolidation and inspection run on any machine with torch.
"""

from __future__ import annotations

from .background import wait_for_pending_save
from .layout import COMPLETE_MARKER, FORMAT, MODEL_PREFIX, OPTIM_PREFIX, RNG_CPU, rank_file_stem, read_marker, staging_dir
from .load import load_checkpoint, restore_rng_state
from .readers import RankFile, RankSet, open_checkpoint, open_rank_file
from .save import commit_checkpoint, mark_complete, rank_world, save_checkpoint, write_rank_file

__all__ = [
    "COMPLETE_MARKER", "FORMAT", "MODEL_PREFIX", "OPTIM_PREFIX", "RNG_CPU", "RankFile", "RankSet", "commit_checkpoint",
    "load_checkpoint", "mark_complete", "open_checkpoint", "open_rank_file", "rank_file_stem", "rank_world",
    "read_marker", "restore_rng_state", "save_checkpoint", "staging_dir", "wait_for_pending_save", "write_rank_file",
]
