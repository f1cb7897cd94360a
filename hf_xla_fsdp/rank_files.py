"""Reading FSDP v1 rank checkpoint files lazily, in our format and in torch_xla's.

Nothing here imports torch_xla: consolidation runs on any machine with torch.

Our format, one directory per checkpoint::

    rank-00000-of-00004.safetensors   model shard ("model/<key>"), optimizer state ("optim/<i>/<name>"), RNG
    rank-00000-of-00004.json          shard metadata, optimizer groups, scheduler, RNG, step, config, ...
    checkpoint_complete.json          written last, when every rank has finished: lists every rank file

torch_xla's formats (read with ``torch.load(weights_only=True, mmap=True)``): the MNIST example's
``<prefix>_rank-00000000-of-00000004.pth`` and transformers Trainer's ``rank0-of-4-pytorch_model.bin``,
each a dict with ``"model"`` and ``"shard_metadata"`` (and maybe ``"optimizer"``).
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
import struct
import sys
from pathlib import Path
from typing import Any, Optional

import torch

from .plugin import ConfigError

FORMAT = "hf_xla_fsdp.rank/1"
COMPLETE_MARKER = "checkpoint_complete.json"
MODEL_PREFIX = "model/"
OPTIM_PREFIX = "optim/"
_OURS = re.compile(r"^rank-(\d+)-of-(\d+)\.safetensors$")


class CheckpointError(ConfigError):
    """A checkpoint is missing, incomplete, inconsistent or unreadable; the message says which file."""


def rank_file_stem(rank: int, world_size: int) -> str:
    """``rank-00003-of-00008``: the name of one rank's files without extension."""
    return f"rank-{rank:05d}-of-{world_size:05d}"


# --------------------------------------------------------------------------- shard metadata <-> JSON
def encode_shard_metadata(md: dict[str, Any]) -> dict[str, Any]:
    """``get_shard_metadata()`` as plain JSON (sizes as lists, dtypes as strings)."""
    return {
        "shard_info": {
            mod: {name: {"_orig_size": list(info["_orig_size"]), "_orig_name": info["_orig_name"]}
                  for name, info in params.items()}
            for mod, params in md["shard_info"].items()
        },
        "flatten_info": {
            name: [list(names), [list(s) for s in shapes], list(numels)]
            for name, (names, shapes, numels) in md["flatten_info"].items()
        },
        "buffer_info": {name: {"_orig_dtype": str(info["_orig_dtype"]).removeprefix("torch.")}
                        for name, info in md.get("buffer_info", {}).items()},
        "world_size": int(md["world_size"]),
        "rank": int(md["rank"]),
    }


def decode_shard_metadata(obj: dict[str, Any]) -> dict[str, Any]:
    """Inverse of :func:`encode_shard_metadata` (torch.Size and torch.dtype restored)."""
    return {
        "shard_info": {
            mod: {name: {"_orig_size": torch.Size(info["_orig_size"]), "_orig_name": info["_orig_name"]}
                  for name, info in params.items()}
            for mod, params in obj["shard_info"].items()
        },
        "flatten_info": {
            name: (list(names), [torch.Size(s) for s in shapes], list(numels))
            for name, (names, shapes, numels) in obj["flatten_info"].items()
        },
        "buffer_info": {name: {"_orig_dtype": getattr(torch, info["_orig_dtype"])}
                        for name, info in obj.get("buffer_info", {}).items()},
        "world_size": int(obj["world_size"]),
        "rank": int(obj["rank"]),
    }


def _structure(md: dict[str, Any]) -> Any:
    """What every rank of one save must agree on (everything but the rank)."""
    return (
        {m: {n: (tuple(i["_orig_size"]), i["_orig_name"]) for n, i in p.items()} for m, p in md["shard_info"].items()},
        {n: (tuple(a), tuple(tuple(s) for s in b), tuple(c)) for n, (a, b, c) in md["flatten_info"].items()},
        md["world_size"],
    )


# --------------------------------------------------------------------------- one rank file
class RankFile:
    """One rank's tensors, read lazily, under names ``model/<state-dict key>`` and
    ``optim/<param index>/<state name>``; ``meta`` holds everything else of the save."""

    def __init__(self, path: Path, rank: int, world_size: int, shard_metadata: dict[str, Any], meta: dict[str, Any]):
        self.path, self.rank, self.world_size = path, rank, world_size
        self.shard_metadata, self.meta = shard_metadata, meta

    def names(self) -> list[str]:
        """Every tensor name, in saved order."""
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        """One whole tensor."""
        raise NotImplementedError

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of one tensor, reading no more than those rows."""
        return self.get(name)[start:stop]

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of one tensor without reading it."""
        return tuple(self.get(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        """Dtype of one tensor without reading it."""
        return self.get(name).dtype

    def model_keys(self) -> list[str]:
        """The FSDP state-dict keys of this rank's model shard."""
        return [n[len(MODEL_PREFIX):] for n in self.names() if n.startswith(MODEL_PREFIX)]


_ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
              "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
              "BOOL": torch.bool}


class SafetensorsReader:
    """Reads tensors, or row ranges of them, from a safetensors file with ``pread``.

    ``safe_open`` memory-maps the whole file, and every page it touches counts in the process's
    RSS until the map closes; consolidation touches every byte of every rank file, so plain
    reads of exactly the bytes needed keep memory at the tensors being assembled.
    """

    def __init__(self, path: Path):
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header size {n} exceeds the file")
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize or end > size - 8 - n:
                raise ValueError(f"entry {name} lies outside the file or has a wrong size")
            self.entries[name] = (dtype, shape, 8 + n + begin, 8 + n + end)
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, name: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        """Tensor ``name``, or only its rows ``start:stop``."""
        dtype, shape, begin, end = self.entries[name]
        if start is not None:
            rows = shape[0]
            start, stop = max(0, min(start, rows)), max(0, min(stop, rows))
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            begin, end = begin + start * row_bytes, begin + max(stop, start) * row_bytes
            shape = (max(stop - start, 0), *shape[1:])
        buf = bytearray(end - begin)
        if buf and os.preadv(self._fd, [buf], begin) != len(buf):
            raise ValueError(f"short read of {name}")
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


_ST_DTYPE_NAMES = {dtype: name for name, dtype in _ST_DTYPES.items()}


def write_safetensors_streaming(path: Path, specs: list[tuple[str, tuple[int, ...], torch.dtype]], produce: Any,
                                metadata: dict[str, str], on_tensor: Any = None) -> None:
    """Write a safetensors file one tensor at a time, then fsync it.

    ``specs`` gives every (name, shape, dtype) up front, so the header goes first and each tensor
    is produced by ``produce(name)``, written and dropped in turn: memory stays at one tensor
    however large the file. The layout is the safetensors format (little-endian u64 header size,
    JSON header padded to 8 bytes, raw little-endian data); ``safe_open`` reads it back in the tests.
    """
    if sys.byteorder != "little":
        raise RuntimeError("streaming safetensors writing needs a little-endian host")
    header: dict[str, Any] = {"__metadata__": metadata}
    offset = 0
    for name, shape, dtype in specs:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _ST_DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for name, shape, dtype in specs:
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(shape)} {dtype}")
            fh.write(tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data)
            if on_tensor is not None:
                on_tensor(name)
        fh.flush()
        os.fsync(fh.fileno())


class SafetensorsRankFile(RankFile):
    """Our format: ``rank-*.safetensors`` + ``rank-*.json``."""

    def __init__(self, path: Path):
        meta_path = path.with_suffix(".json")
        try:
            meta = json.loads(meta_path.read_text())
        except FileNotFoundError:
            raise CheckpointError(f"{meta_path} is missing: the rank file {path.name} has no metadata") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{meta_path} is truncated or corrupted ({err})") from None
        if not isinstance(meta, dict) or meta.get("format") != FORMAT or (
                "shard_metadata" not in meta and meta.get("engine") != "spmd"):
            raise CheckpointError(f"{meta_path} is not an hf_xla_fsdp rank file (format {FORMAT} expected)")
        expected_size = meta.get("tensor_file_bytes")
        if expected_size is not None and path.stat().st_size != expected_size:
            raise CheckpointError(f"{path} is truncated or corrupted: {path.stat().st_size} bytes, {expected_size} expected")
        try:
            self._reader = SafetensorsReader(path)
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
            raise CheckpointError(f"{path} is truncated or corrupted ({err})") from None
        if meta.get("engine") == "spmd":  # FSDP v2: per-tensor pieces in meta["tensors"], no FSDP v1 layout
            md = {"rank": int(meta["rank"]), "world_size": int(meta["world_size"]), "engine": "spmd"}
        else:
            md = decode_shard_metadata(meta["shard_metadata"])
        super().__init__(path, md["rank"], md["world_size"], md, meta)

    def names(self) -> list[str]:
        return list(self._reader.entries)

    def _read(self, name: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        try:
            return self._reader.read(name, start, stop)
        except (ValueError, OSError) as err:
            raise CheckpointError(f"{self.path} is truncated or corrupted: cannot read {name} ({err})") from None

    def get(self, name: str) -> torch.Tensor:
        return self._read(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, start, stop)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._reader.entries[name][0]


class TorchRankFile(RankFile):
    """torch_xla's pickled formats, loaded with ``weights_only=True`` (memory-mapped)."""

    def __init__(self, path: Path):
        try:
            ckpt = torch.load(str(path), map_location="cpu", weights_only=True, mmap=True)
        except Exception as err:
            first = str(err).splitlines()[0] if str(err) else ""
            raise CheckpointError(
                f"{path} is truncated, corrupted or not a safe torch file ({type(err).__name__}: {first})") from None
        if not isinstance(ckpt, dict) or "shard_metadata" not in ckpt or "model" not in ckpt:
            raise CheckpointError(f"{path} is not an FSDP rank checkpoint (no 'model' and 'shard_metadata' entries)")
        md = ckpt["shard_metadata"]
        if not isinstance(md, dict) or not all(k in md for k in ("shard_info", "flatten_info", "world_size", "rank")):
            raise CheckpointError(f"{path} has an incomplete shard_metadata (needs shard_info, flatten_info, world_size, rank)")
        self._tensors = {MODEL_PREFIX + k: v for k, v in ckpt["model"].items()}
        optimizer = ckpt.get("optimizer") or {}
        for idx, state in (optimizer.get("state") or {}).items():
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    self._tensors[f"{OPTIM_PREFIX}{idx}/{key}"] = value
        meta = {"optimizer": {"param_groups": optimizer.get("param_groups")}} if optimizer else {}
        super().__init__(path, int(md["rank"]), int(md["world_size"]), md, meta)

    def names(self) -> list[str]:
        return list(self._tensors)

    def get(self, name: str) -> torch.Tensor:
        return self._tensors[name]


def gather_rows(files: list[RankFile], name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of the concatenation (dim 0) of tensor ``name`` over ``files`` in rank order.

    Reads only the overlapping rows of each file; rows past the end of the concatenation (the
    padding of a larger world) come back as zeros.
    """
    per_rank = files[0].shape(name)[0]
    pieces = []
    for k, f in enumerate(files):
        lo, hi = max(start, k * per_rank), min(stop, (k + 1) * per_rank)
        if lo < hi:
            pieces.append(f.get_rows(name, lo - k * per_rank, hi - k * per_rank))
    have = sum(p.shape[0] for p in pieces)
    if have < stop - start:
        shape = (stop - start - have, *files[0].shape(name)[1:])
        pieces.append(torch.zeros(shape, dtype=files[0].dtype(name)))
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def open_rank_file(path: Path) -> RankFile:
    """Open one rank file of any supported format."""
    if not path.is_file():
        raise CheckpointError(f"rank file {path} is missing")
    if path.suffix == ".safetensors":
        return SafetensorsRankFile(path)
    return TorchRankFile(path)


# --------------------------------------------------------------------------- a whole checkpoint
class RankSet:
    """The rank files of one save, checked for completeness and consistency, sorted by rank."""

    def __init__(self, files: list[RankFile], source: str, marker: Optional[dict[str, Any]] = None):
        if not files:
            raise CheckpointError(f"no rank files found for {source}")
        by_rank: dict[int, RankFile] = {}
        world = files[0].world_size
        for f in files:
            if f.world_size != world:
                raise CheckpointError(
                    f"world-size mismatch: {f.path.name} says {f.world_size} ranks, {files[0].path.name} says {world}")
            if f.rank in by_rank:
                raise CheckpointError(f"duplicate rank {f.rank}: {by_rank[f.rank].path.name} and {f.path.name}")
            if not 0 <= f.rank < world:
                raise CheckpointError(f"{f.path.name} claims rank {f.rank} of a world of {world}")
            by_rank[f.rank] = f
        missing = [r for r in range(world) if r not in by_rank]
        if missing:
            raise CheckpointError(f"missing rank file(s) for rank(s) {missing} of {world} in {source}")
        self.files = [by_rank[r] for r in range(world)]
        self.world_size = world
        self.source = source
        self.marker = marker or {}
        self.engine = self.files[0].meta.get("engine", "xla_fsdp_v1") if self.files[0].meta else "xla_fsdp_v1"
        if any((f.meta or {}).get("engine", "xla_fsdp_v1") != self.engine for f in self.files):
            raise CheckpointError(f"the rank files of {source} come from different FSDP engines")
        ref = _structure(self.files[0].shard_metadata) if self.engine != "spmd" else None
        for f in self.files[1:] if ref is not None else []:
            if _structure(f.shard_metadata) != ref:
                raise CheckpointError(
                    f"{f.path.name} and {self.files[0].path.name} come from different runs (their shard layouts differ)")
        if marker:
            for f in self.files:
                want = marker["files"].get(f.path.name, {}).get("file_id")
                if f.meta.get("file_id") != want:
                    raise CheckpointError(
                        f"{f.path.name} does not belong to this checkpoint: it was written by a different save or run")

    @property
    def shard_metadata(self) -> dict[str, Any]:
        """Rank 0's shard metadata (the layout all ranks share)."""
        return self.files[0].shard_metadata

    @property
    def meta(self) -> dict[str, Any]:
        """Rank 0's metadata (step, config, plugin settings, ...); empty for torch_xla formats."""
        return self.files[0].meta


def _safe_member(directory: Path, name: Any, source: Path) -> Path:
    if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
        raise CheckpointError(f"{source} names file {name!r}: only plain file names inside the checkpoint are allowed")
    return directory / name


def read_marker(directory: Path) -> dict[str, Any]:
    """The completion marker of one of our checkpoint directories, validated."""
    path = directory / COMPLETE_MARKER
    if not path.is_file():
        if any(directory.glob("rank-*.safetensors")):
            raise CheckpointError(f"{directory} is incomplete (no {COMPLETE_MARKER}): its save did not finish")
        raise CheckpointError(f"{directory} is not an hf_xla_fsdp checkpoint (no {COMPLETE_MARKER})")
    try:
        marker = json.loads(path.read_text())
        files = marker["files"]
        world = int(marker["world_size"])
    except (json.JSONDecodeError, KeyError, TypeError, ValueError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{path} is truncated or corrupted ({err})") from None
    if not isinstance(files, dict):
        raise CheckpointError(f"{path} is corrupted: 'files' must map file names to their ids")
    for name in files:
        _safe_member(directory, name, path)
    if len(files) != world:
        raise CheckpointError(f"{path} lists {len(files)} rank files for a world of {world}")
    return marker


def open_checkpoint(ckpt: str | Path, suffix: Optional[str] = None) -> RankSet:
    """Open every rank file of a checkpoint.

    ``ckpt`` is one of our checkpoint directories, a directory of Trainer ``rank*-of-*-pytorch_model.bin``
    files, or a torch_xla-style prefix whose files are ``glob(ckpt + suffix)`` (suffix default ``*.pth``).
    """
    path = Path(ckpt)
    if path.is_dir() and suffix is None:
        if (path / COMPLETE_MARKER).is_file() or any(path.glob("rank-*.safetensors")):
            marker = read_marker(path)
            files = [open_rank_file(_safe_member(path, name, path / COMPLETE_MARKER)) for name in sorted(marker["files"])]
            return RankSet(files, str(path), marker)
        trainer = sorted(path.glob("rank*-of-*-pytorch_model.bin"))
        if trainer:
            return RankSet([open_rank_file(p) for p in trainer], str(path))
        raise CheckpointError(
            f"{path} holds no FSDP rank files (expected {COMPLETE_MARKER}, rank-*.safetensors or "
            "rank*-of-*-pytorch_model.bin); for torch_xla-style files pass their prefix and --ckpt-suffix")
    pattern = str(ckpt) + (suffix if suffix is not None else "*.pth")
    paths = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
    if not paths:
        raise CheckpointError(f"no rank files match {pattern}")
    return RankSet([open_rank_file(p) for p in paths], pattern)
