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
        if any(directory.glob("rank*-of-*-pytorch_model.bin")):
            raise CheckpointError(f"{directory} was written by transformers' own XLA FSDP path, which hf_xla_fsdp cannot "
                                  "resume; consolidate it with `hf-xla-fsdp consolidate` and start from that model")
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


# --------------------------------------------------------------------------- the checkpoints of a run
#: transformers' Trainer: ``<output_dir>/checkpoint-<global step>``
TRAINER_PREFIX = "checkpoint-"
#: accelerate's automatic naming: ``<project_dir>/checkpoints/checkpoint_<iteration>``
ACCELERATE_PREFIX = "checkpoint_"


def is_complete(directory: Union[str, Path]) -> bool:
    """True when ``directory`` holds a completion marker (a save that finished; nothing else is ever loaded)."""
    return (Path(directory) / COMPLETE_MARKER).is_file()


class CheckpointSeries:
    """The numbered checkpoints of one run: how they are named, which one a resume takes, which ones rotation removes.

    One policy for every entry point: the Trainer's ``checkpoint-<step>`` (:data:`TRAINER_PREFIX`) and accelerate's
    ``checkpoint_<iteration>`` (:data:`ACCELERATE_PREFIX`), periodic and preemption saves alike. Only complete
    checkpoints (:func:`is_complete`) count: a directory without a marker (a save killed midway, or one still being
    written in place) is never resumed from, never counted against the limit and never deleted by rotation.
    """

    def __init__(self, root: Union[str, Path], prefix: str = TRAINER_PREFIX) -> None:
        self.root = Path(root)
        self.prefix = prefix

    def __repr__(self) -> str:
        return f"CheckpointSeries({str(self.root)!r}, {self.prefix!r})"

    def path(self, number: int) -> Path:
        """The directory of checkpoint ``number``."""
        return self.root / f"{self.prefix}{number}"

    def number(self, path: Union[str, Path]) -> Optional[int]:
        """The number of a checkpoint directory of this series (None for any other name)."""
        tail = Path(path).name[len(self.prefix):] if Path(path).name.startswith(self.prefix) else ""
        return int(tail) if tail.isdigit() else None

    def numbered(self) -> list[Path]:
        """Every checkpoint directory of the series, complete or not, lowest number first."""
        if not self.root.is_dir():
            return []
        found = [(n, p) for p in self.root.iterdir() if p.is_dir() and (n := self.number(p)) is not None]
        return [p for _, p in sorted(found)]

    def complete(self) -> list[Path]:
        """The complete checkpoints, lowest number first."""
        return [p for p in self.numbered() if is_complete(p)]

    def latest(self) -> Optional[Path]:
        """The complete checkpoint with the highest number: what a resume without a directory takes (None if none)."""
        done = self.complete()
        return done[-1] if done else None

    def next_number(self) -> int:
        """A number no directory of the series has yet (past incomplete ones too, so nothing is written over them)."""
        found = [self.number(p) for p in self.numbered()]
        return max(found) + 1 if found else 0

    def resume_point(self) -> tuple[Path, int]:
        """What a resume without a directory takes, the latest complete checkpoint, and the number the next save
        gets (:meth:`next_number`: never an incomplete directory's); one line when there is nothing to resume from."""
        latest = self.latest()
        if latest is None:
            raise CheckpointError(f"no complete {self.prefix}<i> directory under {self.root} to resume from")
        return latest, self.next_number()

    def to_rotate(self, keep: Optional[int], protect: Any = ()) -> list[Path]:
        """The complete checkpoints to delete so that at most ``keep`` remain (none when ``keep`` is None or < 1).

        Oldest first by the time their marker was written (as the Trainer orders by mtime: a run resumed from an
        earlier step writes newer checkpoints with lower numbers), by number where those times are within a second
        of each other (file systems with coarse or fake times). Never the newest complete one (what a resume needs)
        nor any of ``protect`` (the best model's checkpoint), so ``keep`` grows to cover those; never an incomplete
        directory.
        """
        if keep is None or keep < 1:
            return []
        done = self.complete()
        if len(done) <= keep:
            return []
        times = [(self.root / p.name / COMPLETE_MARKER).stat().st_mtime for p in done]
        if max(times) - min(times) >= 1.0:
            done = [p for _, _, p in sorted(zip(times, (self.number(p) for p in done), done))]
        kept = {done[-1].resolve(), *(Path(p).resolve() for p in protect if p)}
        keep = max(keep, len([p for p in done if p.resolve() in kept]))
        doomed, remaining = [], len(done)
        for p in done:
            if remaining <= keep:
                break
            if p.resolve() not in kept:
                doomed.append(p)
                remaining -= 1
        return doomed

    def rotate(self, keep: Optional[int], protect: Any = ()) -> list[Path]:
        """Delete :meth:`to_rotate`'s checkpoints (call on the main process, once the newest is complete)."""
        doomed = self.to_rotate(keep, protect)
        for p in doomed:
            shutil.rmtree(p, ignore_errors=True)
        return doomed


def latest_checkpoint(run_dir: Union[str, Path], prefix: str = TRAINER_PREFIX) -> Optional[Path]:
    """The complete ``checkpoint-N`` of ``run_dir`` with the highest N (None if none): :meth:`CheckpointSeries.latest`."""
    return CheckpointSeries(run_dir, prefix).latest()
