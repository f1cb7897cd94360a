"""Reading rank checkpoint files lazily: ours, torch_xla's ``.pth`` and transformers Trainer's ``.bin``.

A rank file holds its tensors in one of two layouts, named in its metadata under ``"engine"``:

* ``"xla_fsdp_v1"`` (flat shards): FSDP v1's per-rank state dict, each parameter flattened, padded
  and cut into equal rank shards, described by ``shard_metadata``; also torch_xla's and the
  Trainer's pickled files (a dict with ``"model"`` and ``"shard_metadata"``, parsed without running
  anything in them and read tensor by tensor with positional reads, see :mod:`.torch_zip`);
* ``"spmd"`` (pieces): FSDP v2's slices, every tensor stored as the pieces this process's devices
  held, each with its start/stop offsets in the full tensor (``meta["tensors"]``).

Nothing here imports torch_xla: consolidation runs on any machine with torch.
"""

from __future__ import annotations

import glob
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch

from ..errors import CheckpointError
from . import schema
from .checksums import TensorVerifier, note_unverified, table_digest
from .layout import COMPLETE_MARKER, FORMAT, MODEL_PREFIX, OPTIM_PREFIX, rank_file_stem, read_marker, safe_member
from .safetensors_io import SafetensorsReader, dtype_from_name
from .torch_zip import StoredTensor, TorchZipArchive

LAYOUT_FLAT = "xla_fsdp_v1"
LAYOUT_PIECES = "spmd"


_WRAPPER_NAMES = ("_fsdp_wrapped_module.", "_fpw_module.")


def clean_name(name: str) -> str:
    """The user's parameter name inside FSDP v1 wrappers (``_fsdp_wrapped_module.``/``_fpw_module.`` removed)."""
    for part in _WRAPPER_NAMES:
        name = name.replace(part, "")
    return name


def buffer_dtypes(md: dict[str, Any]) -> dict[str, Any]:
    """``shard_metadata["buffer_info"]`` keyed by state-dict key: buffer name -> the dtype it had before FSDP cast it.

    torch_xla's ``get_shard_metadata()`` names buffers as ``named_buffers()`` does, with the flatten wrapper's
    ``_fpw_module.`` that ``state_dict()`` leaves out, and lists non-persistent buffers (rotary ``inv_freq``), which no
    state dict holds: files written that way (torch_xla's, and ours until the buffer_info fix) are read through this
    mapping too.
    """
    return {name.replace("_fpw_module.", ""): info["_orig_dtype"] for name, info in md.get("buffer_info", {}).items()}


def saved_buffer_info(md: dict[str, Any], state_keys: Any) -> dict[str, Any]:
    """The ``buffer_info`` a rank file records: only the buffers its state dict holds (keys ``state_keys``), under their
    state-dict keys (see :func:`buffer_dtypes`)."""
    keys = set(state_keys)
    return {name: {"_orig_dtype": dtype} for name, dtype in buffer_dtypes(md).items() if name in keys}


def saved_layout(meta: Optional[dict[str, Any]]) -> str:
    """The tensor layout of a rank file from its metadata (files of older saves and torch_xla's are flat)."""
    return (meta or {}).get("engine", LAYOUT_FLAT)


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


def shard_structure(md: dict[str, Any]) -> Any:
    """What every rank of one flat-shard save must agree on (everything but the rank)."""
    return (
        {m: {n: (tuple(i["_orig_size"]), i["_orig_name"]) for n, i in p.items()} for m, p in md["shard_info"].items()},
        {n: (tuple(a), tuple(tuple(s) for s in b), tuple(c)) for n, (a, b, c) in md["flatten_info"].items()},
        md["world_size"],
    )


def same_parameters(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same parameters and flattening in two shard metadata, whatever their world sizes."""
    def names(md: dict[str, Any]) -> Any:
        return ({m: {n: i["_orig_name"] for n, i in p.items()} for m, p in md["shard_info"].items()},
                {n: tuple(v[0]) for n, v in md["flatten_info"].items()})
    return names(a) == names(b)


# --------------------------------------------------------------------------- one rank file
class RankFile:
    """One rank's tensors, read lazily, under names ``model/<state-dict key>`` and
    ``optim/<param index>/<state name>``; ``meta`` holds everything else of the save."""

    def __init__(self, path: Path, rank: int, world_size: int, shard_metadata: dict[str, Any], meta: dict[str, Any]):
        self.path, self.rank, self.world_size = path, rank, world_size
        self.shard_metadata, self.meta = shard_metadata, meta

    @property
    def layout(self) -> str:
        """``"xla_fsdp_v1"`` (flat shards) or ``"spmd"`` (pieces)."""
        return saved_layout(self.meta)

    def names(self) -> list[str]:
        """Every tensor name, in saved order."""
        raise NotImplementedError

    def get(self, name: str) -> torch.Tensor:
        """One whole tensor."""
        raise NotImplementedError

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        """Rows ``start:stop`` (dim 0) of one tensor, reading no more than those rows."""
        return self.get(name)[start:stop]

    def read_rows_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        """Rows ``start:stop`` (dim 0) of one tensor copied into ``out`` (a contiguous tensor of their shape)."""
        rows = self.get_rows(name, start, stop)
        if tuple(rows.shape) != tuple(out.shape):
            raise CheckpointError(f"{self.path}: rows {start}:{stop} of {name} have shape {tuple(rows.shape)}, "
                                  f"{tuple(out.shape)} expected")
        out.copy_(rows)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape of one tensor without reading it."""
        return tuple(self.get(name).shape)

    def dtype(self, name: str) -> torch.dtype:
        """Dtype of one tensor without reading it."""
        return self.get(name).dtype

    def model_keys(self) -> list[str]:
        """The FSDP state-dict keys of this rank's model shard."""
        return [n[len(MODEL_PREFIX):] for n in self.names() if n.startswith(MODEL_PREFIX)]

    @property
    def checksummed(self) -> bool:
        """True when this file records a checksum of every tensor (and reads are checked against it)."""
        return False

    def finish_verification(self, prefix: Optional[str] = None) -> None:
        """Check every tensor read so far whose checksum could not be checked while it was read (partial reads),
        and with ``prefix`` every tensor whose name starts with it, read or not (e.g. shards that are all padding)."""

    def verify_all(self) -> int:
        """Read every tensor and check it against its checksum; returns the bytes read."""
        total = 0
        for name in self.names():
            tensor = self.get(name)
            total += tensor.numel() * tensor.element_size()
        return total


class SafetensorsRankFile(RankFile):
    """Our format: ``rank-*.safetensors`` + ``rank-*.json``.

    ``listed`` is the completion marker's entry for the file: its JSON's SHA-256 is checked against it before the
    JSON is parsed, and its id after; every structure of the JSON is then validated (:mod:`.schema`) and cross-checked
    with the tensor file's header, so a damaged file is one line naming the file and the entry, never a traceback.
    """

    def __init__(self, path: Path, listed: Optional[dict[str, Any]] = None):
        meta_path = path.with_suffix(".json")
        try:
            raw = meta_path.read_bytes()
        except FileNotFoundError:
            raise CheckpointError(f"{meta_path} is missing: the rank file {path.name} has no metadata") from None
        self.meta_sha256 = schema.sha256_bytes(raw)
        want = (listed or {}).get("meta_sha256")
        digest_error = None
        if want is not None and self.meta_sha256 != want:
            digest_error = CheckpointError(f"{meta_path} is corrupted: its SHA-256 differs from the one "
                                           f"{COMPLETE_MARKER} records; use an earlier checkpoint")
        try:
            meta = json.loads(raw)
        except (json.JSONDecodeError, UnicodeDecodeError, RecursionError) as err:
            raise digest_error or CheckpointError(
                f"{meta_path} is truncated or corrupted ({str(err).splitlines()[0][:200]})") from None
        if listed is not None and isinstance(meta, dict) and isinstance(meta.get("file_id"), str) \
                and meta["file_id"] != listed.get("file_id"):
            raise CheckpointError(f"{path.name} does not belong to this checkpoint: its file_id is not the one "
                                  f"{COMPLETE_MARKER} lists (written by a different save or run, or damaged)")
        if digest_error is not None:
            raise digest_error
        if not isinstance(meta, dict) or meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path} is not an hf_xla_fsdp rank file (format {FORMAT} expected)")
        schema.validate_rank_meta(meta, meta_path, path.name)
        if listed is not None and meta.get("file_id") != listed.get("file_id"):
            raise CheckpointError(f"{path.name} does not belong to this checkpoint: its file_id is not the one "
                                  f"{COMPLETE_MARKER} lists")
        pieces = saved_layout(meta) == LAYOUT_PIECES
        expected_size = meta.get("tensor_file_bytes")
        if (listed or {}).get("bytes") is not None and path.stat().st_size != listed["bytes"]:
            raise CheckpointError(f"{path} is truncated or corrupted: {path.stat().st_size} bytes, {listed['bytes']} "
                                  f"as {COMPLETE_MARKER} records")
        if expected_size is not None and path.stat().st_size != expected_size:
            raise CheckpointError(f"{path} is truncated or corrupted: {path.stat().st_size} bytes, {expected_size} expected")
        try:
            self._reader = SafetensorsReader(path)
        except (ValueError, KeyError, TypeError, AttributeError, IndexError, UnicodeDecodeError, RecursionError,
                OverflowError) as err:
            raise CheckpointError(f"{path} is truncated or corrupted: its header cannot be read "
                                  f"({type(err).__name__}: {str(err).splitlines()[0][:200] if str(err) else ''})") from None
        if "header_sha256" in meta and self._reader.header_sha256() != meta["header_sha256"]:
            raise CheckpointError(f"{path} is corrupted: its safetensors header differs from the one {meta_path.name} "
                                  "records (header_sha256); use an earlier checkpoint")
        self._verifier: Optional[TensorVerifier] = None
        checksums = meta.get("checksums")
        if checksums:
            listed_sums = (listed or {}).get("checksums")
            if listed_sums is not None and table_digest(checksums) != listed_sums:
                raise CheckpointError(f"{meta_path} is corrupted: its checksum table differs from the one "
                                      f"{COMPLETE_MARKER} records; use an earlier checkpoint")
            unlisted = sorted(set(self._reader.entries) ^ set(checksums["tensors"]))
            if unlisted:
                raise CheckpointError(f"{path} or {meta_path.name} is corrupted: tensor {unlisted[0]} is in only one of "
                                      "the tensor file's header and the checksum table; use an earlier checkpoint")
            sizes = {name: self._reader.nbytes(name) for name in self._reader.entries}
            self._verifier = TensorVerifier(path, checksums, sizes, self._read_bytes)
        else:
            note_unverified(path.parent)
        self._check_tensors(meta, meta_path)
        if pieces:  # per-tensor pieces in meta["tensors"], no flat-shard layout
            md = {"rank": int(meta["rank"]), "world_size": int(meta["world_size"]), "engine": LAYOUT_PIECES}
        else:
            md = decode_shard_metadata(meta["shard_metadata"])
        super().__init__(path, md["rank"], md["world_size"], md, meta)

    def _check_tensors(self, meta: dict[str, Any], meta_path: Path) -> None:
        """The JSON's description of the tensors agrees with the tensor file's header."""
        entries = self._reader.entries
        count = schema.optimizer_count(meta)
        for name in entries:
            if name.startswith(OPTIM_PREFIX):
                idx, _, rest = name[len(OPTIM_PREFIX):].partition("/")
                if not idx.isdigit() or not rest or (count is not None and int(idx) >= count):
                    raise CheckpointError(f"{self.path} is corrupted: its optimizer tensor {name} names no parameter "
                                          f"of the {count} in {meta_path.name}; use an earlier checkpoint")
        if saved_layout(meta) == LAYOUT_PIECES:
            for tname, entry in meta["tensors"].items():
                dtype = dtype_from_name(entry["dtype"])
                for i, piece in enumerate(entry["pieces"]):
                    found = entries.get(piece["key"])
                    shape = tuple(b - a for a, b in zip(piece["start"], piece["stop"]))
                    if found is None or found[0] != dtype or tuple(found[1]) != shape:
                        have = "is not in the tensor file" if found is None else \
                            f"is {list(found[1])} {found[0]} in the tensor file"
                        raise CheckpointError(f"{meta_path} is corrupted: tensors[{tname!r}].pieces[{i}] "
                                              f"({piece['key']}, {list(shape)} {dtype}) {have}; use an earlier checkpoint")
        else:
            shapes = {n[len(MODEL_PREFIX):]: e[1] for n, e in entries.items() if n.startswith(MODEL_PREFIX)}
            schema.check_flat_shards(meta["shard_metadata"], shapes, meta_path)

    def names(self) -> list[str]:
        return list(self._reader.entries)

    def _read(self, name: str, start: Optional[int] = None, stop: Optional[int] = None) -> torch.Tensor:
        check = self._verifier.on_read if self._verifier is not None else None
        try:
            return self._reader.read(name, start, stop, check)
        except CheckpointError:
            raise
        except (ValueError, OSError) as err:
            raise CheckpointError(f"{self.path} is truncated or corrupted: cannot read {name} ({err})") from None

    def _read_bytes(self, name: str, start: int, stop: int) -> bytearray:
        try:
            return self._reader.read_bytes(name, start, stop)
        except (ValueError, OSError) as err:
            raise CheckpointError(f"{self.path} is truncated or corrupted: cannot read {name} ({err})") from None

    @property
    def checksummed(self) -> bool:
        return self._verifier is not None

    def finish_verification(self, prefix: Optional[str] = None) -> None:
        if self._verifier is not None:
            self._verifier.finish([n for n in self.names() if n.startswith(prefix)] if prefix is not None else ())

    def verify_all(self) -> int:
        total = 0
        for name in self.names():
            if self._verifier is not None and name not in self._verifier.verified:
                self._verifier.verify(name)
            elif self._verifier is None:
                for lo in range(0, self._reader.nbytes(name), 16 << 20):  # no checksums: at least every byte is readable
                    self._read_bytes(name, lo, lo + (16 << 20))
            total += self._reader.nbytes(name)
        return total

    def get(self, name: str) -> torch.Tensor:
        return self._read(name)

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._read(name, start, stop)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._reader.entries[name][1]

    def dtype(self, name: str) -> torch.dtype:
        return self._reader.entries[name][0]


class TorchRankFile(RankFile):
    """torch_xla's ``.pth`` and the Trainer's ``.bin`` rank files (``torch.save`` zip archives).

    The pickle is parsed by a restricted unpickler (only tensors, ``torch.Size``, dtypes and plain
    containers; nothing in the file is executed) and each tensor is read with positional reads of
    exactly its bytes when asked for, so memory holds only the tensors being assembled (see
    :mod:`.torch_zip`; ``torch.load(mmap=True)`` kept every touched page of every file resident).
    """

    def __init__(self, path: Path):
        self._archive = TorchZipArchive(path)
        ckpt = self._archive.obj
        if not isinstance(ckpt, dict) or "shard_metadata" not in ckpt or not isinstance(ckpt.get("model"), dict):
            raise CheckpointError(f"{path} is not an FSDP rank checkpoint (no 'model' and 'shard_metadata' entries)")
        md = ckpt["shard_metadata"]
        schema.validate_shard_metadata(md, path)  # no marker, no digest: the schema is what protects these files
        self._tensors: dict[str, StoredTensor] = {}
        for key, value in ckpt["model"].items():
            if not isinstance(value, StoredTensor):
                raise CheckpointError(f"{path} is not an FSDP rank checkpoint: its model entry {key!r} is not a tensor")
            self._tensors[MODEL_PREFIX + str(key)] = value
        optimizer = ckpt.get("optimizer") or {}
        if not isinstance(optimizer, dict):
            raise CheckpointError(f"{path} has an 'optimizer' entry that is not an optimizer state dict")
        for idx, state in (optimizer.get("state") or {}).items():
            for key, value in (state.items() if isinstance(state, dict) else ()):
                if isinstance(value, StoredTensor):
                    self._tensors[f"{OPTIM_PREFIX}{idx}/{key}"] = value
        meta = {"optimizer": {"param_groups": optimizer.get("param_groups")}} if optimizer else {}
        shapes = {name[len(MODEL_PREFIX):]: t.shape for name, t in self._tensors.items() if name.startswith(MODEL_PREFIX)}
        schema.check_flat_shards(md, shapes, path)
        rank, world = md["rank"], md["world_size"]
        super().__init__(path, rank, world, md, meta)

    def names(self) -> list[str]:
        return list(self._tensors)

    def _stored(self, name: str) -> StoredTensor:
        try:
            return self._tensors[name]
        except KeyError:
            raise CheckpointError(f"{self.path} has no tensor {name}") from None

    def get(self, name: str) -> torch.Tensor:
        return self._archive.read(self._stored(name))

    def get_rows(self, name: str, start: int, stop: int) -> torch.Tensor:
        return self._archive.read(self._stored(name), start, stop)

    def read_rows_into(self, name: str, start: int, stop: int, out: torch.Tensor) -> None:
        self._archive.read(self._stored(name), start, stop, out=out)

    def shape(self, name: str) -> tuple[int, ...]:
        return self._stored(name).shape

    def dtype(self, name: str) -> torch.dtype:
        return self._stored(name).dtype


def gather_rows(files: list[RankFile], name: str, start: int, stop: int) -> torch.Tensor:
    """Rows ``start:stop`` of the concatenation (dim 0) of tensor ``name`` over ``files`` in rank order.

    Reads only the overlapping rows of each file, each straight into its place in the result (one
    allocation: no pieces held beside a concatenated copy); rows past the end of the concatenation
    (the padding of a larger world) come back as zeros.
    """
    shape, dtype = files[0].shape(name), files[0].dtype(name)
    per_rank = shape[0]
    out = torch.empty((stop - start, *shape[1:]), dtype=dtype)
    pos = 0
    for k, f in enumerate(files):
        lo, hi = max(start, k * per_rank), min(stop, (k + 1) * per_rank)
        if lo < hi:
            f.read_rows_into(name, lo - k * per_rank, hi - k * per_rank, out[pos: pos + hi - lo])
            pos += hi - lo
    if pos < stop - start:
        out[pos:].zero_()
    return out


def open_rank_file(path: Path, listed: Optional[dict[str, Any]] = None) -> RankFile:
    """Open one rank file of any supported format (``listed``: its completion-marker entry, checked before use)."""
    if not path.is_file():
        raise CheckpointError(f"rank file {path} is missing")
    if path.suffix == ".safetensors":
        return SafetensorsRankFile(path, listed)
    return TorchRankFile(path)


def check_file_id(f: RankFile, marker: dict[str, Any]) -> RankFile:
    """``f`` itself, once its id is the one the completion marker lists for it (not a stale file of another save)."""
    listed = marker["files"].get(f.path.name)
    if listed is None:
        raise CheckpointError(f"{f.path.name} is not listed in {COMPLETE_MARKER}")
    if f.meta.get("file_id") != listed.get("file_id"):
        raise CheckpointError(f"{f.path.name} does not belong to this checkpoint: it was written by a different save or run")
    digest = listed.get("checksums")
    if digest is not None and table_digest(f.meta.get("checksums")) != digest:
        raise CheckpointError(f"{f.path.with_suffix('.json')} is corrupted: its checksum table differs from the one "
                              f"{COMPLETE_MARKER} records; use an earlier checkpoint")
    want = listed.get("meta_sha256")
    if want is not None and getattr(f, "meta_sha256", want) != want:
        raise CheckpointError(f"{f.path.with_suffix('.json')} is corrupted: its SHA-256 differs from the one "
                              f"{COMPLETE_MARKER} records; use an earlier checkpoint")
    return f


def open_listed(ckpt_dir: Path, marker: dict[str, Any], name: str) -> RankFile:
    """The rank file ``name`` that ``marker`` lists, checked to belong to this save."""
    if name not in marker["files"]:
        raise CheckpointError(f"{ckpt_dir / COMPLETE_MARKER} does not list {name}")
    path = safe_member(ckpt_dir, name, ckpt_dir / COMPLETE_MARKER)
    return check_file_id(SafetensorsRankFile(path, marker["files"][name]), marker)


def open_own(ckpt_dir: Path, marker: dict[str, Any], rank: int, world: int) -> RankFile:
    """Rank ``rank``'s file of a save of ``world`` ranks."""
    return open_listed(ckpt_dir, marker, f"{rank_file_stem(rank, world)}.safetensors")


def marker_layout(ckpt_dir: Path, marker: dict[str, Any]) -> str:
    """The checkpoint's tensor layout from the marker, else from the first rank file's JSON (no tensor file opened)."""
    if "engine" in marker:
        return marker["engine"]
    first = ckpt_dir / Path(sorted(marker["files"])[0]).with_suffix(".json").name
    try:
        return saved_layout(json.loads(first.read_text()))
    except (OSError, json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return LAYOUT_FLAT  # the flat-shard reader reports the damage precisely


def check_present(ckpt_dir: Path, marker: dict[str, Any], names: Optional[list[str]] = None) -> None:
    """Every rank file the marker lists (or those of ``names``) is present, tensor and JSON, before anything is read.

    A local-mode checkpoint (per-host disks) not yet gathered gets one line naming the missing hosts' files."""
    wanted = sorted(marker["files"]) if names is None else names
    missing = [n for n in wanted if not (ckpt_dir / n).is_file() or not (ckpt_dir / n).with_suffix(".json").is_file()]
    if not missing:
        return
    hosts = marker.get("hosts") if marker.get("storage") == "local" else None
    if hosts:
        parts = []
        for index, entry in enumerate(hosts):
            gone = [n for n in entry.get("files", []) if n in missing]
            if gone:
                parts.append(f"host {index} ({entry.get('host')}): {', '.join(gone)}")
        raise CheckpointError(f"{ckpt_dir} is a local-mode checkpoint (per-host disks) that was not gathered: missing "
                              f"{'; '.join(parts)}; bring every host's directory together first with "
                              "`hf-xla-fsdp gather HOST_DIR... --output DIR`")
    more = f" (and {len(missing) - 3} more)" if len(missing) > 3 else ""
    raise CheckpointError(f"{ckpt_dir} is missing rank file(s) its {COMPLETE_MARKER} lists: "
                          f"{', '.join(missing[:3])}{more}")


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
        self.layout = self.files[0].layout
        if any(f.layout != self.layout for f in self.files):
            raise CheckpointError(f"the rank files of {source} come from different FSDP engines")
        if self.layout == LAYOUT_FLAT:
            ref = shard_structure(self.files[0].shard_metadata)
            for f in self.files[1:]:
                if shard_structure(f.shard_metadata) != ref:
                    raise CheckpointError(
                        f"{f.path.name} and {self.files[0].path.name} come from different runs (their shard layouts differ)")
        if marker:
            for f in self.files:
                check_file_id(f, marker)

    def finish_verification(self, prefix: Optional[str] = None) -> None:
        """Check the checksum of every tensor read from these files so far (see :meth:`RankFile.finish_verification`)."""
        for f in self.files:
            f.finish_verification(prefix)

    @property
    def engine(self) -> str:
        """The saved layout name (kept for callers of earlier releases)."""
        return self.layout

    @property
    def shard_metadata(self) -> dict[str, Any]:
        """Rank 0's shard metadata (the layout all ranks share)."""
        return self.files[0].shard_metadata

    @property
    def meta(self) -> dict[str, Any]:
        """Rank 0's metadata (step, config, plugin settings, ...); empty for torch_xla formats."""
        return self.files[0].meta


def open_checkpoint(ckpt: Union[str, Path], suffix: Optional[str] = None) -> RankSet:
    """Open every rank file of a checkpoint.

    ``ckpt`` is one of our checkpoint directories, a directory of Trainer ``rank*-of-*-pytorch_model.bin``
    files, or a torch_xla-style prefix whose files are ``glob(ckpt + suffix)`` (suffix default ``*.pth``), the two
    joined as plain strings exactly as torch_xla's ``consolidate_sharded_model_checkpoints`` does (so a directory
    prefix needs its trailing slash: ``out/checkpoint-100/`` + ``rank*-of-*-pytorch_model.bin``).
    A URL (``memory://``, ``gs://``, ...) is fetched to a local temporary copy first: its marker, then only the
    files it lists (the copy lives as long as the returned set).
    """
    from .storage import Fetched, is_url, local_path

    if is_url(ckpt) and suffix is None:
        fetched = Fetched(str(ckpt))
        ranks = open_checkpoint(fetched.path)
        ranks.source, ranks.fetched = str(ckpt), fetched
        return ranks
    path = local_path(ckpt)
    if path.is_dir() and suffix is None:
        if (path / COMPLETE_MARKER).is_file() or any(path.glob("rank-*.safetensors")):
            marker = read_marker(path)
            check_present(path, marker)
            files = [open_rank_file(safe_member(path, name, path / COMPLETE_MARKER), marker["files"][name])
                     for name in sorted(marker["files"])]
            return RankSet(files, str(path), marker)
        trainer = sorted(path.glob("rank*-of-*-pytorch_model.bin"))
        if trainer:
            return RankSet([open_rank_file(p) for p in trainer], str(path))
        raise CheckpointError(
            f"{path} holds no FSDP rank files (expected {COMPLETE_MARKER}, rank-*.safetensors or "
            "rank*-of-*-pytorch_model.bin); for torch_xla-style files pass their prefix and --ckpt-suffix")
    prefix = os.fspath(ckpt)
    prefix = prefix[len("file://"):] if prefix.startswith("file://") else prefix
    suffix = suffix if suffix is not None else "*.pth"
    pattern = prefix + suffix  # joined as plain strings, exactly as torch_xla and the Trainer do
    paths = sorted(Path(p) for p in glob.glob(pattern) if Path(p).is_file())
    if not paths:
        if prefix and not prefix.endswith(os.sep) and os.path.isdir(prefix) and glob.glob(os.path.join(prefix, suffix)):
            raise CheckpointError(
                f"no rank files match {pattern}: the prefix and the suffix are joined as plain strings (as torch_xla "
                f"does), and {prefix} is a directory; add the trailing slash: --ckpt-prefix {prefix}{os.sep}")
        raise CheckpointError(f"no rank files match {pattern} (the prefix and the suffix are joined as plain strings, as "
                              "torch_xla does: a directory prefix needs its trailing slash)")
    return RankSet([open_rank_file(p) for p in paths], pattern)


# --------------------------------------------------------------------------- pieces (FSDP v2 layout)
def merge_pieces(files: list[RankFile], section: str = "tensors") -> dict[str, dict[str, Any]]:
    """Every tensor of a pieces-layout checkpoint with the pieces of all files (each piece knows its file)."""
    merged: dict[str, dict[str, Any]] = {}
    for f in files:
        saved = f.meta.get(section) or {}
        for name, entry in saved.items():
            target = merged.setdefault(name, {"shape": entry["shape"], "dtype": entry["dtype"], "pieces": []})
            if target["shape"] != entry["shape"]:
                raise CheckpointError(f"{f.path.name} and another rank file disagree on the shape of {name}")
            target["pieces"].extend({**piece, "file": f} for piece in entry["pieces"])
    return merged


def assemble(entry: dict[str, Any], read: Callable[[str], torch.Tensor]) -> torch.Tensor:
    """The full tensor described by a saved ``entry`` (shape, dtype, pieces), each piece read with ``read(key)``."""
    full = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
    covered = 0
    for piece in entry["pieces"]:
        region = tuple(slice(a, b) for a, b in zip(piece["start"], piece["stop"]))
        full[region] = read(piece["key"])
        covered += math.prod(b - a for a, b in zip(piece["start"], piece["stop"]))
    if covered != full.numel():
        raise CheckpointError(f"the saved pieces of a {list(full.shape)} tensor cover {covered} of {full.numel()} elements")
    return full


def read_pieces(entry: dict[str, Any]) -> torch.Tensor:
    """The full tensor of a merged pieces entry, assembled on the host from its pieces."""
    by_key = {p["key"]: p["file"] for p in entry["pieces"]}
    return assemble(entry, lambda key: by_key[key].get(key))
