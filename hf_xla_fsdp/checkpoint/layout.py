"""On-disk layout of a checkpoint and the write-then-rename publish that makes it visible only when complete.

One directory per checkpoint::

    rank-00000-of-00004.safetensors   model shard ("model/<key>"), optimizer state ("optim/<i>/<name>"), RNG
    rank-00000-of-00004.json          engine metadata, optimizer groups, scheduler, RNG, step, config, ...
    checkpoint_complete.json          written last, when every rank has finished: lists every rank file

Ranks write into a hidden staging directory beside the checkpoint; rank 0 writes the marker there
and renames the directory into place.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any, Optional, Union

from ..errors import CheckpointError

FORMAT = "hf_xla_fsdp.rank/1"
COMPLETE_MARKER = "checkpoint_complete.json"
# files that make a consolidated directory usable as it is (tokenizer, generation settings)
SIDE_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "added_tokens.json",
              "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model", "chat_template.jinja",
              "chat_template.json", "generation_config.json", "preprocessor_config.json")
#: side files whose SHA-256 the completion marker records (``side_files``): those consolidation copies, the
#: model config and our training record. Not ``trainer_state.json``: transformers reads it (not us), and users edit
#: it by hand (log history, best metric) as they may with the stock Trainer; a digest would refuse such a checkpoint
DIGESTED_SIDE_FILES = (*SIDE_FILES, "config.json", "xla_fsdp_training.json")
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
RNG_CPU = "rng/torch_cpu"


def rank_file_stem(rank: int, world_size: int) -> str:
    """``rank-00003-of-00008``: the name of one rank's files without extension."""
    return f"rank-{rank:05d}-of-{world_size:05d}"


def staging_dir(ckpt_dir: Union[str, Path]) -> Path:
    """Where ranks write before the checkpoint is complete (same name on every rank, no coordination)."""
    ckpt_dir = Path(ckpt_dir)
    return ckpt_dir.parent / f".{ckpt_dir.name}.partial"


# --------------------------------------------------------------------------- atomic files and directories
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


# --------------------------------------------------------------------------- the completion marker
def safe_member(directory: Path, name: Any, source: Path) -> Path:
    """``directory / name`` for a plain file name listed in ``source``; anything path-like is refused."""
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise CheckpointError(f"{source} names file {name!r}: only plain file names inside the checkpoint are allowed")
    return directory / name


def read_marker(directory: Path) -> dict[str, Any]:
    """The completion marker of one of our checkpoint directories: its own digest and its structure checked."""
    from .schema import validate_marker

    path = directory / COMPLETE_MARKER
    if not path.is_file():
        if any(directory.glob("rank-*.safetensors")):
            raise CheckpointError(f"{directory} is incomplete (no {COMPLETE_MARKER}): its save did not finish")
        raise CheckpointError(f"{directory} is not an hf_xla_fsdp checkpoint (no {COMPLETE_MARKER})")
    try:
        marker = json.loads(path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
        raise CheckpointError(f"{path} is truncated or corrupted ({str(err).splitlines()[0][:200]})") from None
    marker = validate_marker(marker, path)
    for name in marker["files"]:
        safe_member(directory, name, path)
    return marker


def file_sha256(path: Path) -> str:
    """SHA-256 of a file, read in bounded chunks."""
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def with_side_digests(marker: dict[str, Any], directory: Path) -> dict[str, Any]:
    """``marker`` recording the SHA-256 of every side file of :data:`DIGESTED_SIDE_FILES` in ``directory``."""
    digests = {n: file_sha256(directory / n) for n in DIGESTED_SIDE_FILES if (directory / n).is_file()}
    return {**marker, "side_files": digests} if digests else marker


def check_side_files(directory: Path, marker: dict[str, Any], names: Optional[Any] = None) -> None:
    """The side files ``marker`` records a digest of (those of ``names`` only, if given) are intact."""
    for name, want in sorted((marker.get("side_files") or {}).items()):
        if names is not None and name not in names:
            continue
        path = directory / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing, but {COMPLETE_MARKER} lists it; use an earlier checkpoint")
        if file_sha256(path) != want:
            raise CheckpointError(f"{path} is corrupted: its SHA-256 differs from the one {COMPLETE_MARKER} records; "
                                  "use an earlier checkpoint")


def latest_checkpoint(run_dir: Union[str, Path]) -> Optional[Path]:
    """The ``checkpoint-N`` directory of ``run_dir`` with the highest N that has a completion marker (None if none).

    Directories without one (an object-storage save killed midway, written in place) are never picked."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        return None
    marked = [p for p in run_dir.iterdir() if p.name.startswith("checkpoint-") and p.name[11:].isdigit()
              and (p / COMPLETE_MARKER).is_file()]
    return max(marked, key=lambda p: int(p.name[11:]), default=None)
