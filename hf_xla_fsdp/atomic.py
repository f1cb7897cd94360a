"""Write-then-rename helpers: a file or directory becomes visible only when it is complete."""

from __future__ import annotations

import os
import shutil
import uuid
from pathlib import Path


def fsync_dir(path: Path) -> None:
    """Persist the entries of directory ``path`` (the renames into it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_bytes_atomic(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` through a temporary file, fsync'd, then renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def check_output(output: Path, overwrite: bool) -> None:
    """Refuse an existing non-empty ``output`` unless ``overwrite``."""
    if output.exists() and not output.is_dir():
        raise FileExistsError(f"output {output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise FileExistsError(f"output directory {output} already exists and is not empty; pass --overwrite to replace it")


def prepare_output(output: Path, overwrite: bool) -> Path:
    """Refuse an existing non-empty ``output`` unless ``overwrite``; return a new staging directory beside it."""
    check_output(output, overwrite)
    output.parent.mkdir(parents=True, exist_ok=True)
    stage = output.parent / f".{output.name}.tmp-{uuid.uuid4().hex[:8]}"
    stage.mkdir()
    return stage


def publish(stage: Path, output: Path) -> None:
    """Make the complete directory ``stage`` visible as ``output``; an old ``output`` goes only at the end."""
    fsync_dir(stage)
    old = None
    if output.exists():
        old = output.parent / f".{output.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(output, old)
    os.replace(stage, output)
    fsync_dir(output.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


# weight files of an earlier save that the new one may not overwrite by name (e.g. 1 file -> 3 shards)
_WEIGHT_PATTERNS = ("model*.safetensors", "model.safetensors.index.json", "pytorch_model*.bin",
                    "pytorch_model.bin.index.json")


def merge_into(stage: Path, output: Path) -> None:
    """Move the complete files of ``stage`` into ``output``, which may hold other things (checkpoint-* dirs).

    Every new file is renamed over its old namesake (weights first, config last); weight files of
    an earlier save that the new one does not replace are removed afterwards, so ``output`` never
    mixes two saves' weights once this returns. ``output`` is created (by rename) when missing.
    """
    if not output.exists():
        publish(stage, output)
        return
    fsync_dir(stage)
    new = sorted(p.name for p in stage.iterdir())
    last = [n for n in new if n.endswith(".json")]
    for name in [n for n in new if n not in last] + last:
        os.replace(stage / name, output / name)
    for pattern in _WEIGHT_PATTERNS:
        for stale in output.glob(pattern):
            if stale.name not in new and stale.is_file():
                stale.unlink()
    fsync_dir(output)
    shutil.rmtree(stage, ignore_errors=True)
