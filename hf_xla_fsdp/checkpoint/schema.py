"""Validation of every metadata structure the checkpoint readers consume, before anything is read from it.

Payload bytes are checksummed (:mod:`.checksums`) and, in checkpoints of this version, every metadata file carries
a SHA-256 digest: the completion marker records its own (``self_sha256``, over its canonical JSON) and those of the
rank JSON files, the rank files' safetensors headers and the side files (tokenizer, configs). A digest says *that* a
file changed; the schema checks here say *what* is wrong, and they are the only protection of checkpoints saved
before digests existed and of torch_xla's / the Trainer's ``.pth``/``.bin`` rank files (their ``shard_metadata``
lives inside the pickle). Every failure is one :class:`~hf_xla_fsdp.errors.CheckpointError` line naming the file,
the entry (``shard_metadata.shard_info['x']['y']._orig_size``) and what is wrong with it.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn, Optional, Union

import torch

from ..errors import CheckpointError
from .safetensors_io import _TORCH_NAMES as SAVED_DTYPES

#: the key of the marker's digest of itself
SELF_DIGEST = "self_sha256"
_HEX64 = re.compile(r"[0-9a-f]{64}")
_HEX8 = re.compile(r"[0-9a-f]{8}")
_RANK_NAME = re.compile(r"rank-(\d{5})-of-(\d{5})\.safetensors")
_ALGORITHMS = ("crc32c", "crc32")
_LAYOUTS = ("xla_fsdp_v1", "spmd")
_STORAGE_MODES = ("shared", "local", "object")
_DTYPE_NAMES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}

Where = str
_MARKER_KEYS = ("format", "engine", "world_size", "step", "run_id", "storage", "files", "hosts", "side_files",
                SELF_DIGEST, "gathered_from")
_RANK_META_KEYS = ("format", "file_id", "tensor_file_bytes", "header_sha256", "checksums", "rank", "world_size",
                   "run_id", "step", "shard_metadata", "engine", "devices", "tensors", "optimizer", "scheduler", "rng",
                   "model_config", "peft", "plugin", "extra", "dtensor", "engine_name", "engine_title")


def canonical_sha256(obj: Any) -> str:
    """SHA-256 of ``obj`` as canonical JSON (sorted keys, no spaces): the same for any indentation it was written with."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def sha256_bytes(data: bytes) -> str:
    """SHA-256 of raw bytes, as hex."""
    return hashlib.sha256(data).hexdigest()


def sealed(marker: dict[str, Any]) -> dict[str, Any]:
    """``marker`` with its own digest (over everything but the digest) under :data:`SELF_DIGEST`."""
    body = {k: v for k, v in marker.items() if k != SELF_DIGEST}
    return {**body, SELF_DIGEST: canonical_sha256(body)}


def marker_bytes(marker: dict[str, Any]) -> bytes:
    """What a completion marker file holds: the marker, sealed with its digest."""
    return json.dumps(sealed(marker), indent=1).encode()


class _Check:
    """Checks of one file's structure; every failure names the file and the entry."""

    def __init__(self, path: Union[str, Path]):
        self.path = path

    def fail(self, where: Where, what: str) -> NoReturn:
        at = f"{where} " if where else ""
        raise CheckpointError(f"{self.path} is corrupted: {at}{what}; use an earlier checkpoint (or re-save this one)")

    # ------------------------------------------------------------------ primitives
    def mapping(self, value: Any, where: Where) -> Mapping[Any, Any]:
        if not isinstance(value, Mapping):
            self.fail(where, f"must be a mapping, not {_kind(value)}")
        return value

    def seq(self, value: Any, where: Where, length: Optional[int] = None) -> Sequence[Any]:
        if not isinstance(value, (list, tuple)):
            self.fail(where, f"must be a list, not {_kind(value)}")
        if length is not None and len(value) != length:
            self.fail(where, f"must have {length} entries, not {len(value)}")
        return value

    def key(self, obj: Mapping[Any, Any], name: str, where: Where) -> Any:
        if name not in obj:
            near = [k for k in obj if isinstance(k, str) and _close(k, name)]
            hint = f" (it has {near[0]!r} instead)" if near else ""
            self.fail(where, f"lacks the entry {name!r}{hint}")
        return obj[name]

    def known(self, obj: Mapping[Any, Any], where: Where, keys: Sequence[str]) -> None:
        """No key of ``obj`` is one of ``keys`` with a character or two damaged (newer versions may add keys; a key
        that differs from a known one by a flipped byte is damage)."""
        for k in obj:
            if isinstance(k, str) and k not in keys:
                near = [n for n in keys if _close(k, n)]
                if near:
                    self.fail(where, f"has an entry {k!r} where {near[0]!r} belongs")

    def integer(self, value: Any, where: Where, low: int = 0, high: Optional[int] = None) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            self.fail(where, f"must be an integer, not {_kind(value)}")
        if value < low or (high is not None and value >= high):
            bound = f"{low} <= n < {high}" if high is not None else f"n >= {low}"
            self.fail(where, f"is {value}, outside {bound}")
        return value

    def string(self, value: Any, where: Where, allow_none: bool = False) -> Optional[str]:
        if value is None and allow_none:
            return None
        if not isinstance(value, str):
            self.fail(where, f"must be a string, not {_kind(value)}")
        return value

    def number(self, value: Any, where: Where) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            self.fail(where, f"must be a number, not {_kind(value)}")
        return value

    def one_of(self, value: Any, allowed: Sequence[Any], where: Where) -> Any:
        if value not in allowed:
            self.fail(where, f"is {value!r}, not one of {', '.join(map(repr, allowed))}")
        return value

    def hexdigest(self, value: Any, where: Where, pattern: re.Pattern[str] = _HEX64) -> str:
        if not isinstance(value, str) or not pattern.fullmatch(value):
            self.fail(where, f"must be a hex digest, not {_short(value)}")
        return value

    def shape(self, value: Any, where: Where) -> tuple[int, ...]:
        items = self.seq(value, where)
        return tuple(self.integer(v, f"{where}[{i}]") for i, v in enumerate(items))

    def dtype_name(self, value: Any, where: Where) -> torch.dtype:
        if isinstance(value, torch.dtype):
            return value
        if not isinstance(value, str) or value not in _DTYPE_NAMES:
            self.fail(where, f"must name a torch dtype, not {_short(value)}")
        return _DTYPE_NAMES[value]


def _close(a: str, b: str) -> bool:
    """Same length and at most two differing characters: a key renamed by a damaged byte or two."""
    return len(a) == len(b) and sum(x != y for x, y in zip(a, b)) <= 2


def _kind(value: Any) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


# --------------------------------------------------------------------------- the completion marker
def validate_marker(marker: Any, path: Union[str, Path]) -> dict[str, Any]:
    """The completion marker, digest and structure checked; its file names are plain ``rank-R-of-W.safetensors``."""
    c = _Check(path)
    c.mapping(marker, "its top level")
    c.known(marker, "its top level", _MARKER_KEYS)
    if SELF_DIGEST in marker:
        recorded = marker[SELF_DIGEST]
        if canonical_sha256({k: v for k, v in marker.items() if k != SELF_DIGEST}) != recorded:
            raise CheckpointError(f"{path} is corrupted: its content does not match its own SHA-256 "
                                  f"({SELF_DIGEST}); use an earlier checkpoint")
    if "format" in marker:
        c.one_of(marker["format"], ("hf_xla_fsdp.rank/1",), "'format'")
    world = c.integer(c.key(marker, "world_size", "its top level"), "'world_size'", low=1)
    files = c.mapping(c.key(marker, "files", "its top level"), "'files'")
    if len(files) != world:
        c.fail("'files'", f"lists {len(files)} rank files for a world of {world}")
    seen = set()
    for name, entry in files.items():
        where = f"files[{name!r}]"
        if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
            c.fail(where, "names a path: only plain file names inside the checkpoint are allowed")
        match = _RANK_NAME.fullmatch(name)
        if match is None:
            c.fail(where, "is not a rank file name (rank-RRRRR-of-WWWWW.safetensors)")
        rank, of = int(match.group(1)), int(match.group(2))
        if of != world or rank >= world:
            c.fail(where, f"names rank {rank} of {of}, in a checkpoint of {world} ranks")
        seen.add(rank)
        c.mapping(entry, where)
        c.known(entry, where, ("file_id", "bytes", "checksums", "meta_sha256", "header_sha256"))
        c.string(c.key(entry, "file_id", where), f"{where}.file_id")
        if "bytes" in entry:
            c.integer(entry["bytes"], f"{where}.bytes")
        for digest in ("checksums", "meta_sha256", "header_sha256"):
            if digest in entry:
                c.hexdigest(entry[digest], f"{where}.{digest}")
    if "engine" in marker:
        c.one_of(marker["engine"], _LAYOUTS, "'engine'")
    if "step" in marker:
        c.integer(marker["step"], "'step'")
    if "run_id" in marker:
        c.string(marker["run_id"], "'run_id'", allow_none=True)
    if "storage" in marker:
        c.one_of(marker["storage"], _STORAGE_MODES, "'storage'")
    if "hosts" in marker:
        for i, host in enumerate(c.seq(marker["hosts"], "'hosts'")):
            c.mapping(host, f"hosts[{i}]")
            c.string(host.get("host"), f"hosts[{i}].host", allow_none=True)
            for name in c.seq(c.key(host, "files", f"hosts[{i}]"), f"hosts[{i}].files"):
                if name not in files:
                    c.fail(f"hosts[{i}].files", f"names {_short(name)}, which 'files' does not list")
    if "side_files" in marker:
        for name, digest in c.mapping(marker["side_files"], "'side_files'").items():
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                c.fail("'side_files'", f"names {_short(name)}: only plain file names are allowed")
            c.hexdigest(digest, f"side_files[{name!r}]")
    return dict(marker)


# --------------------------------------------------------------------------- shard metadata (FSDP v1)
def validate_shard_metadata(md: Any, path: Union[str, Path], where: Where = "shard_metadata") -> None:
    """``get_shard_metadata()`` as saved: in our JSON (lists, dtype names) or in a torch pickle (torch.Size, dtypes)."""
    c = _Check(path)
    c.mapping(md, where)
    c.known(md, where, ("shard_info", "flatten_info", "buffer_info", "world_size", "rank"))
    world = c.integer(c.key(md, "world_size", where), f"{where}.world_size", low=1)
    c.integer(c.key(md, "rank", where), f"{where}.rank", high=world)
    shard_info = c.mapping(c.key(md, "shard_info", where), f"{where}.shard_info")
    for module, params in shard_info.items():
        at = f"{where}.shard_info[{module!r}]"
        c.string(module, at)
        for name, info in c.mapping(params, at).items():
            pat = f"{at}[{name!r}]"
            c.string(name, pat)
            c.mapping(info, pat)
            c.known(info, pat, ("_orig_size", "_orig_name"))
            c.shape(c.key(info, "_orig_size", pat), f"{pat}._orig_size")
            if not c.string(c.key(info, "_orig_name", pat), f"{pat}._orig_name"):
                c.fail(f"{pat}._orig_name", "is empty")
    flatten_info = c.mapping(c.key(md, "flatten_info", where), f"{where}.flatten_info")
    for name, entry in flatten_info.items():
        at = f"{where}.flatten_info[{name!r}]"
        c.string(name, at)
        names, shapes, numels = c.seq(entry, at, 3)
        c.seq(names, f"{at}[0]")
        c.seq(shapes, f"{at}[1]", len(names))
        c.seq(numels, f"{at}[2]", len(names))
        for i, (member, shape, numel) in enumerate(zip(names, shapes, numels)):
            c.string(member, f"{at}[0][{i}]")
            dims = c.shape(shape, f"{at}[1][{i}]")
            c.integer(numel, f"{at}[2][{i}]")
            if math.prod(dims) != numel:
                c.fail(f"{at}[2][{i}]", f"is {numel}, but its shape {list(dims)} holds {math.prod(dims)} elements")
    if "buffer_info" in md:
        for name, info in c.mapping(md["buffer_info"], f"{where}.buffer_info").items():
            at = f"{where}.buffer_info[{name!r}]"
            c.string(name, at)
            c.dtype_name(c.key(c.mapping(info, at), "_orig_dtype", at), f"{at}._orig_dtype")


# --------------------------------------------------------------------------- pieces (FSDP v2)
def validate_pieces(tensors: Any, path: Union[str, Path], where: Where = "tensors") -> None:
    """A pieces-layout ``tensors`` (or optimizer) section: shapes, dtypes, and pieces inside their tensor."""
    c = _Check(path)
    for name, entry in c.mapping(tensors, where).items():
        at = f"{where}[{name!r}]"
        c.string(name, at)
        c.mapping(entry, at)
        c.known(entry, at, ("shape", "dtype", "pieces"))
        shape = c.shape(c.key(entry, "shape", at), f"{at}.shape")
        c.one_of(c.key(entry, "dtype", at), sorted(SAVED_DTYPES), f"{at}.dtype")
        boxes = []
        for i, piece in enumerate(c.seq(c.key(entry, "pieces", at), f"{at}.pieces")):
            pat = f"{at}.pieces[{i}]"
            c.mapping(piece, pat)
            c.known(piece, pat, ("key", "start", "stop"))
            c.string(c.key(piece, "key", pat), f"{pat}.key")
            start = c.shape(c.key(piece, "start", pat), f"{pat}.start")
            stop = c.shape(c.key(piece, "stop", pat), f"{pat}.stop")
            if len(start) != len(shape) or len(stop) != len(shape):
                c.fail(pat, f"has {len(start)}/{len(stop)} start/stop offsets for a tensor of {len(shape)} dimensions")
            if any(not a <= b <= n for a, b, n in zip(start, stop, shape)):
                c.fail(pat, f"spans {list(start)}:{list(stop)}, outside the tensor's shape {list(shape)}")
            for j, (s0, s1) in enumerate(boxes):
                if all(max(a, x) < min(b, y) for a, b, x, y in zip(start, stop, s0, s1)):
                    c.fail(pat, f"overlaps piece {j}")
            boxes.append((start, stop))


# --------------------------------------------------------------------------- a rank file's JSON
def validate_rank_meta(meta: Any, path: Union[str, Path], file_name: Optional[str] = None) -> dict[str, Any]:
    """A ``rank-R-of-W.json``: every entry a reader (consolidation, verify, resume) uses, by type and range."""
    c = _Check(path)
    c.mapping(meta, "its top level")
    c.known(meta, "its top level", _RANK_META_KEYS)
    world = c.integer(c.key(meta, "world_size", "its top level"), "'world_size'", low=1)
    rank = c.integer(c.key(meta, "rank", "its top level"), "'rank'", high=world)
    if file_name is not None:
        match = _RANK_NAME.fullmatch(file_name)
        if match and (int(match.group(1)), int(match.group(2))) != (rank, world):
            c.fail("'rank'/'world_size'", f"say rank {rank} of {world}, its file name {file_name}")
    if "file_id" in meta:
        c.string(meta["file_id"], "'file_id'")
    for key in ("engine_name", "engine_title"):  # the engine that wrote it (absent in files from before 2026-12)
        if key in meta:
            c.string(meta[key], f"'{key}'")
    if meta.get("tensor_file_bytes") is not None:
        c.integer(meta["tensor_file_bytes"], "'tensor_file_bytes'")
    if "header_sha256" in meta:
        c.hexdigest(meta["header_sha256"], "'header_sha256'")
    if meta.get("checksums"):
        sums = c.mapping(meta["checksums"], "'checksums'")
        c.known(sums, "'checksums'", ("algorithm", "tensors"))
        c.one_of(c.key(sums, "algorithm", "'checksums'"), _ALGORITHMS, "checksums.algorithm")
        for name, value in c.mapping(c.key(sums, "tensors", "'checksums'"), "checksums.tensors").items():
            c.hexdigest(value, f"checksums.tensors[{name!r}]", _HEX8)
    layout = c.one_of(meta.get("engine", "xla_fsdp_v1"), _LAYOUTS, "'engine'")
    if layout == "spmd":
        if "devices" in meta:
            c.integer(meta["devices"], "'devices'", low=1)
        validate_pieces(c.key(meta, "tensors", "its top level"), path, "tensors")
        if meta.get("dtensor") is not None:  # torch FSDP2's mesh and placements (informational: pieces carry offsets)
            dtensor = c.mapping(meta["dtensor"], "'dtensor'")
            c.known(dtensor, "'dtensor'", ("device_type", "placements", "mesh_shape", "mesh_dim_names"))
            for name, placements in c.mapping(dtensor.get("placements") or {}, "dtensor.placements").items():
                for i, placement in enumerate(c.seq(placements, f"dtensor.placements[{name!r}]")):
                    c.string(placement, f"dtensor.placements[{name!r}][{i}]")
    else:
        md = c.key(meta, "shard_metadata", "its top level")
        validate_shard_metadata(md, path)
        if (md["rank"], md["world_size"]) != (rank, world):
            c.fail("shard_metadata.rank/world_size", f"say rank {md['rank']} of {md['world_size']}, the file rank "
                   f"{rank} of {world}")
    if "step" in meta:
        c.integer(meta["step"], "'step'")
    if "run_id" in meta:
        c.string(meta["run_id"], "'run_id'", allow_none=True)
    if meta.get("optimizer") is not None:
        validate_optimizer_meta(meta["optimizer"], path)
    for key in ("scheduler", "plugin", "extra", "peft"):
        if meta.get(key) is not None:
            c.mapping(meta[key], f"'{key}'")
    if meta.get("model_config") is not None:
        config = c.mapping(meta["model_config"], "'model_config'")
        c.string(c.key(config, "model_type", "model_config"), "model_config.model_type")
    if meta.get("peft") is not None:
        adapters = c.mapping(c.key(meta["peft"], "adapters", "'peft'"), "peft.adapters")
        for name, cfg in adapters.items():
            c.mapping(cfg, f"peft.adapters[{name!r}]")
    if meta.get("rng") is not None:
        validate_rng(meta["rng"], path)
    return dict(meta)


def validate_optimizer_meta(optim: Any, path: Union[str, Path]) -> None:
    """Saved optimizer groups, parameter names and scalar state: one name per parameter index, each index once."""
    c = _Check(path)
    c.mapping(optim, "'optimizer'")
    c.known(optim, "'optimizer'", ("param_groups", "scalar_state", "param_names"))
    groups = c.seq(c.key(optim, "param_groups", "'optimizer'"), "optimizer.param_groups")
    names = c.seq(c.key(optim, "param_names", "'optimizer'"), "optimizer.param_names", len(groups))
    indices: list[int] = []
    for g, (group, group_names) in enumerate(zip(groups, names)):
        at = f"optimizer.param_groups[{g}]"
        c.mapping(group, at)
        params = c.seq(c.key(group, "params", at), f"{at}.params")
        c.seq(group_names, f"optimizer.param_names[{g}]", len(params))
        for i, name in enumerate(group_names):
            c.string(name, f"optimizer.param_names[{g}][{i}]")
        indices += [c.integer(p, f"{at}.params[{i}]") for i, p in enumerate(params)]
    if sorted(indices) != list(range(len(indices))):
        c.fail("optimizer.param_groups", f"number their parameters {sorted(indices)[:6]}..., not 0..{len(indices) - 1} "
               "once each")
    for idx, state in c.mapping(optim.get("scalar_state") or {}, "optimizer.scalar_state").items():
        if not (isinstance(idx, str) and idx.isdigit() and int(idx) < len(indices)):
            c.fail("optimizer.scalar_state", f"has an entry for parameter {_short(idx)} of {len(indices)}")
        c.mapping(state, f"optimizer.scalar_state[{idx!r}]")


def optimizer_count(meta: dict[str, Any]) -> Optional[int]:
    """How many parameters the saved optimizer has (None without optimizer metadata)."""
    optim = meta.get("optimizer")
    return sum(len(g) for g in optim["param_names"]) if optim else None


def validate_rng(rng: Any, path: Union[str, Path]) -> None:
    """The Python, NumPy and XLA RNG states as :func:`.state.rng_meta` records them."""
    c = _Check(path)
    c.mapping(rng, "'rng'")
    c.known(rng, "'rng'", ("python", "numpy", "xla"))
    if "python" in rng:
        version, state, gauss = c.seq(rng["python"], "rng.python", 3)
        c.one_of(version, (3,), "rng.python[0]")  # random.getstate()'s version since Python 3.2
        words = c.seq(state, "rng.python[1]", 625)
        for i, w in enumerate(words):
            c.integer(w, f"rng.python[1][{i}]", high=1 << 32)
        if gauss is not None:
            c.number(gauss, "rng.python[2]")
    if "numpy" in rng:
        name, keys, pos, has_gauss, cached = c.seq(rng["numpy"], "rng.numpy", 5)
        c.one_of(name, ("MT19937",), "rng.numpy[0]")
        for i, k in enumerate(c.seq(keys, "rng.numpy[1]", 624)):
            c.integer(k, f"rng.numpy[1][{i}]", high=1 << 32)
        c.integer(pos, "rng.numpy[2]", high=625)
        c.integer(has_gauss, "rng.numpy[3]", high=2)
        c.number(cached, "rng.numpy[4]")
    if rng.get("xla") is not None:
        c.integer(rng["xla"], "rng.xla", high=1 << 64)


# --------------------------------------------------------------------------- saved state against the live objects
class _Fits(_Check):
    def __init__(self, path: Union[str, Path], what: str):
        super().__init__(path)
        self.what = what

    def fail(self, where: Where, what: str) -> NoReturn:
        raise CheckpointError(f"{self.path} does not fit this {self.what}: {where} {what}; the file is corrupted or was "
                              f"saved with a different {self.what} (use an earlier checkpoint, or the same {self.what})")


def check_like(saved: Any, live: Any, where: Where, path: Union[str, Path], what: str = "object",
               skip: Sequence[str] = ()) -> None:
    """``saved`` (JSON) has every entry of ``live`` (a state dict of the ``what`` it will be loaded into, keys in
    ``skip`` aside), with values of the same kind: a renamed key or a value turned into another type is found here,
    not at the next step."""
    c = _Fits(path, what)
    if live is None:
        return
    if isinstance(live, Mapping):
        c.mapping(saved, where)
        for key, value in live.items():
            if isinstance(key, str) and key not in skip:
                check_like(c.key(saved, key, where), value, f"{where}[{key!r}]", path, what)
        return
    if isinstance(live, (list, tuple)):
        c.seq(saved, where, len(live))
        for i, (s, v) in enumerate(zip(saved, live)):
            check_like(s, v, f"{where}[{i}]", path, what)
        return
    if isinstance(live, bool):
        if not isinstance(saved, bool):
            c.fail(where, f"must be true or false, not {_kind(saved)}")
    elif isinstance(live, (int, float)):
        c.number(saved, where)
    elif isinstance(live, str) and not isinstance(saved, str):
        c.fail(where, f"must be a string, not {_kind(saved)}")


# --------------------------------------------------------------------------- cross-checks with the tensors
def check_flat_shards(md: dict[str, Any], shapes: dict[str, tuple[int, ...]], path: Union[str, Path]) -> None:
    """Every sharded tensor of a flat-shard rank file has its shard_info entry, and the original sizes fit in the
    shards of the whole world (``shapes``: model state-dict key -> shape in the file).

    ``buffer_info`` is not checked against the tensors: torch_xla's ``get_shard_metadata()`` lists non-persistent
    buffers (no state dict holds them) under ``named_buffers()`` names (with ``_fpw_module.``, which state-dict keys
    lack), and our own writer stored it that way until it kept only saved buffers. An entry naming no tensor is a
    buffer that was never saved; readers use the entries that name one (:func:`.readers.buffer_dtypes`), and each
    entry's form is checked by :func:`validate_shard_metadata`.
    """
    c = _Check(path)
    world = int(md["world_size"])
    for key, shape in shapes.items():
        parts = key.split(".")
        idx = next((i for i, p in enumerate(parts) if p.startswith("_fsdp_shard")), None)
        if idx is None:
            continue
        prefix, suffix = ".".join(parts[:idx]), ".".join(parts[idx:])
        info = md["shard_info"].get(prefix, {}).get(suffix)
        if info is None:
            c.fail("shard_metadata.shard_info", f"has no entry for its tensor {key}")
        full = f"{prefix}.{info['_orig_name']}" if prefix else info["_orig_name"]
        capacity = math.prod(shape) * world
        if "_fsdp_wrapped_module.flat_param_" in full:
            if full not in md["flatten_info"]:
                c.fail("shard_metadata.flatten_info", f"has no entry for {full}")
            need = sum(md["flatten_info"][full][2])
            what = f"shard_metadata.flatten_info[{full!r}]"
        elif len(shape) > 1:  # sharded on dim 0: rows are split, other dims kept
            orig = tuple(info["_orig_size"])
            if tuple(shape[1:]) != orig[1:] or shape[0] * world < (orig[0] if orig else 0):
                c.fail(f"shard_metadata.shard_info[{prefix!r}][{suffix!r}]._orig_size",
                       f"is {list(orig)}, which {world} dim-0 shards of {list(shape)} cannot hold")
            continue
        else:
            need = math.prod(info["_orig_size"])
            what = f"shard_metadata.shard_info[{prefix!r}][{suffix!r}]._orig_size"
        if need > capacity:
            c.fail(what, f"needs {need} elements, {world} shards of {list(shape)} hold {capacity}")
