"""Checking a checkpoint without consolidating it: every rank file's structure, ids and tensor checksums."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any, Optional, Union

from .layout import check_side_files
from .readers import open_checkpoint


def verify_checkpoint(ckpt: Union[str, os.PathLike], ckpt_suffix: Optional[str] = None) -> dict[str, Any]:
    """Read every tensor of every rank file of ``ckpt`` and check it against its recorded checksum.

    Raises :class:`~hf_xla_fsdp.errors.CheckpointError` naming the first file and tensor that fail.
    Files saved without checksums (earlier versions, torch_xla's ``.pth``, Trainer ``.bin``) are read
    to the last byte and reported as ``"checksummed_files"`` short of ``"files"``. Returns a summary.
    """
    start = time.perf_counter()
    ranks = open_checkpoint(ckpt, ckpt_suffix)
    if ranks.marker:
        fetched = getattr(ranks, "fetched", None)
        check_side_files(fetched.path if fetched else Path(ranks.source), ranks.marker)
    tensors = nbytes = checksummed = 0
    algorithms = set()
    for f in ranks.files:
        nbytes += f.verify_all()
        tensors += len(f.names())
        if f.checksummed:
            checksummed += 1
            algorithms.add(f.meta["checksums"]["algorithm"])
    return {"checkpoint": str(Path(ckpt)), "ok": True, "world_size": ranks.world_size, "layout": ranks.layout,
            "files": len(ranks.files), "checksummed_files": checksummed, "algorithms": sorted(algorithms),
            "tensors": tensors, "bytes": nbytes, "seconds": round(time.perf_counter() - start, 3)}
