"""``torch.save`` zip archives read without ``torch.load``: a restricted unpickler and positional reads.

``torch.load(mmap=True)`` maps every storage of the file, and every page that consolidation touches
stays in the process's RSS until the map closes: 8 rank files of a 1.2 GB model peaked at ~2 GB.
Here the archive's ``data.pkl`` is parsed by an unpickler that resolves only the names a
``weights_only`` load allows for these files (the tensor rebuild functions, ``torch.Size``, dtypes,
storage types, ``OrderedDict`` and plain containers) and turns every tensor into an inert
:class:`StoredTensor` (its storage record, dtype, offset, shape, strides). Nothing named in the file
is ever called: any other global is refused before it is even looked up. A tensor's bytes are read
only when asked for, with ``os.preadv`` straight from its storage record (``torch.save`` stores them
uncompressed) into a fresh tensor, or into a slice of the caller's.

Archive layout (``torch/serialization.py``): ``<name>/data.pkl`` holds the object; each storage is the
record ``<name>/data/<key>``, referenced in the pickle by the persistent id
``("storage", <XStorage class>, key, location, numel)``; ``<name>/byteorder`` says the byte order.
"""

from __future__ import annotations

import _compat_pickle
import collections
import functools
import inspect
import io
import math
import os
import pickle
import struct
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import CheckpointError

_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")  # zip local file header (30 bytes), APPNOTE 4.3.7
_LOCAL_MAGIC = b"PK\x03\x04"
_MAX_READ = 1 << 30  # Linux returns at most ~2 GiB per read call; loop in 1 GiB steps


class UnsafePickle(CheckpointError):
    """The pickle asks for a global a weights-only load never resolves."""


@dataclass(frozen=True)
class _StorageType:
    """What ``torch.FloatStorage`` & co. stand for in a restricted load: the element dtype."""

    name: str
    dtype: torch.dtype
    untyped: bool = False


@dataclass(frozen=True)
class _Storage:
    """One ``data/<key>`` record: where its bytes start in the file and how many elements it holds."""

    key: str
    dtype: torch.dtype
    numel: int
    offset: int


@dataclass(frozen=True)
class StoredTensor:
    """A tensor of the archive, not read yet: its storage and the view of it (all in elements)."""

    storage: _Storage
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def dtype(self) -> torch.dtype:
        """Element type (the storage's)."""
        return self.storage.dtype

    @property
    def numel(self) -> int:
        """Number of elements."""
        return math.prod(self.shape)

    @property
    def contiguous(self) -> bool:
        """Row-major without gaps, so any row range is one byte range of the storage."""
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


def _storage_types() -> dict[str, _StorageType]:
    """Every storage class name torch pickles, with its dtype (from torch's own table, not from the file)."""
    from torch.storage import _dtype_to_storage_type_map

    types = {name: _StorageType(name, dtype) for dtype, name in _dtype_to_storage_type_map().items()}
    types["UntypedStorage"] = _StorageType("UntypedStorage", torch.uint8, untyped=True)
    return types


_DTYPES = {str(d).removeprefix("torch."): d for d in vars(torch).values() if isinstance(d, torch.dtype)}


def _rebuild_tensor(storage: Any, storage_offset: Any, size: Any, stride: Any, *_: Any) -> StoredTensor:
    """``torch._utils._rebuild_tensor(_v2)``'s arguments, checked and kept; no tensor is made."""
    if not isinstance(storage, _Storage):
        raise pickle.UnpicklingError("a tensor whose storage is not a storage record")
    shape, strides = tuple(size), tuple(stride)
    if not (isinstance(storage_offset, int) and storage_offset >= 0 and len(shape) == len(strides)
            and all(isinstance(v, int) and v >= 0 for v in (*shape, *strides))):
        raise pickle.UnpicklingError(f"a tensor with an invalid view (offset {storage_offset!r}, size {shape}, "
                                     f"stride {strides})")
    if math.prod(shape):
        last = storage_offset + sum((n - 1) * s for n, s in zip(shape, strides))
        if last >= storage.numel:
            raise pickle.UnpicklingError(f"a tensor reaches element {last} of storage {storage.key}, "
                                         f"which has {storage.numel}")
    return StoredTensor(storage, storage_offset, shape, strides)


def _rebuild_parameter(data: Any, *_: Any) -> Any:
    """A parameter is its data here (``requires_grad`` and hooks do not matter to a reader)."""
    return data


def _rebuild_device_tensor(data: Any, *_: Any) -> Any:
    """A tensor saved from a device (XLA, CUDA, ...) is pickled as its CPU copy plus the device name: the copy."""
    if not isinstance(data, StoredTensor):
        raise pickle.UnpicklingError("a device tensor without its CPU data")
    return data


def _latin1_encode(text: Any, encoding: Any = "utf-8") -> bytes:
    """``_codecs.encode`` as protocol-2 pickles use it for ``bytes`` (latin-1 only: no codec lookup by name)."""
    if not isinstance(text, str) or encoding not in ("latin1", "latin-1"):
        raise pickle.UnpicklingError("_codecs.encode is allowed only to rebuild bytes (latin-1)")
    return text.encode("latin1")


# the only callables a file may name; each one builds plain data from plain data
_CALLABLES: dict[tuple[str, str], Any] = {
    ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor,
    ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
    ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
    ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
    ("torch._utils", "_rebuild_device_tensor_from_cpu_tensor"): _rebuild_device_tensor,
    ("collections", "OrderedDict"): collections.OrderedDict,
    ("builtins", "set"): set,
    ("builtins", "frozenset"): frozenset,
    ("builtins", "complex"): complex,
    ("builtins", "bytearray"): bytearray,
    ("_codecs", "encode"): _latin1_encode,
    ("torch", "Size"): torch.Size,
    ("torch", "device"): torch.device,
}


class _RestrictedUnpickler(pickle.Unpickler):
    """Resolves only :data:`_CALLABLES`, dtypes and storage classes; storages become :class:`_Storage` records."""

    def __init__(self, data: bytes, archive: TorchZipArchive):
        super().__init__(io.BytesIO(data))
        self._archive = archive
        self._storage_types = _storage_types()

    def find_class(self, module: str, name: str) -> Any:
        # protocol-2 pickles (torch.save's default) spell Python 2 names (__builtin__.set); pickle maps them the same way
        module, name = _compat_pickle.NAME_MAPPING.get((module, name), (module, name))
        module = _compat_pickle.IMPORT_MAPPING.get(module, module)
        if (module, name) in _CALLABLES:
            found = _CALLABLES[(module, name)]
            # our own functions go out as a fresh partial: a BUILD opcode aimed at one can change only that copy
            return functools.partial(found) if inspect.isfunction(found) else found
        if module == "torch" and name in _DTYPES:
            return _DTYPES[name]
        if module == "torch" and name in self._storage_types:
            return self._storage_types[name]
        raise UnsafePickle(f"{self._archive.path} is not a safe torch file: its pickle asks for {module}.{name}, "
                           "which a weights-only load never runs (nothing of it was executed); only tensors, "
                           "torch.Size, dtypes and plain containers are read; re-save it with plain tensors or as "
                           "safetensors if you trust it")

    def persistent_load(self, pid: Any) -> _Storage:
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage"
                and isinstance(pid[1], _StorageType) and isinstance(pid[2], str) and isinstance(pid[4], int)):
            raise pickle.UnpicklingError(f"unknown persistent id {str(pid)[:80]}")
        return self._archive.storage(pid[2], pid[1], pid[4])


class TorchZipArchive:
    """A ``torch.save`` file: its object with :class:`StoredTensor` placeholders, and reads of their bytes.

    Raises :class:`CheckpointError` (one line, naming the file) for anything that is not a complete,
    uncompressed, little-endian torch archive, and :class:`UnsafePickle` for a pickle that names
    anything else than tensors and plain data.
    """

    def __init__(self, path: Path):
        self.path = Path(path)
        self._size = self.path.stat().st_size
        self._storages: dict[str, _Storage] = {}
        try:
            self._zip = zipfile.ZipFile(self.path)
        except (zipfile.BadZipFile, OSError, ValueError, EOFError) as err:
            raise CheckpointError(f"{self.path} is truncated, corrupted or not a safe torch file (not a complete "
                                  f"torch.save zip archive: {err})") from None
        self._fd = os.open(self.path, os.O_RDONLY)
        try:
            names = self._zip.namelist()
            pkl = next((n for n in names if n.endswith("/data.pkl") and n.count("/") == 1), None)
            if pkl is None:
                raise CheckpointError(f"{self.path} is not a torch.save archive (it has no <name>/data.pkl); "
                                      "legacy (pre-1.6) torch files are not supported, re-save it with a current torch")
            self._prefix = pkl[: -len("data.pkl")]
            self._entries = {n: self._zip.getinfo(n) for n in names if n.startswith(self._prefix)}
            order = self._entries.get(self._prefix + "byteorder")
            if order is not None and self._zip.read(order).strip() != b"little":
                raise CheckpointError(f"{self.path} was saved on a big-endian machine; load it there and re-save it")
            if sys.byteorder != "little":
                raise CheckpointError("reading torch archives needs a little-endian host")
            data = self._zip.read(pkl)
            try:
                self.obj = _RestrictedUnpickler(data, self).load()
            except CheckpointError:
                raise
            except RecursionError:
                raise CheckpointError(f"{self.path} is corrupted: its pickle nests too deeply") from None
            except Exception as err:  # noqa: BLE001 - any failure of a damaged pickle is the same finding
                first = (str(err).splitlines() or [""])[0][:200]
                raise CheckpointError(f"{self.path} is truncated or corrupted: its pickle cannot be read "
                                      f"({type(err).__name__}: {first})") from None
        except CheckpointError:
            self.close()
            raise
        except (zipfile.BadZipFile, OSError, ValueError, EOFError, KeyError, RuntimeError) as err:
            self.close()
            raise CheckpointError(f"{self.path} is truncated or corrupted ({type(err).__name__}: {err})") from None
        self._zip.close()  # the central directory is read; tensors are read with os.preadv from here on
        self._zip = None

    # ----------------------------------------------------------------- storages
    def storage(self, key: str, kind: _StorageType, numel: int) -> _Storage:
        """The record of storage ``key`` (checked once: stored uncompressed, inside the file, of the size the pickle says)."""
        if key in self._storages:
            return self._storages[key]
        info = self._entries.get(f"{self._prefix}data/{key}")
        if info is None:
            raise CheckpointError(f"{self.path} is truncated or corrupted: storage data/{key} is missing")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CheckpointError(f"{self.path}: storage data/{key} is compressed; re-save it with torch.save")
        itemsize = 1 if kind.untyped else kind.dtype.itemsize
        if numel < 0 or info.file_size != numel * itemsize:
            raise CheckpointError(f"{self.path} is corrupted: storage data/{key} holds {info.file_size} bytes, "
                                  f"the pickle says {numel} x {itemsize}")
        header = os.pread(self._fd, _LOCAL_HEADER.size, info.header_offset)
        if len(header) != _LOCAL_HEADER.size or header[:4] != _LOCAL_MAGIC:
            raise CheckpointError(f"{self.path} is truncated or corrupted: bad zip header for storage data/{key}")
        name_len, extra_len = _LOCAL_HEADER.unpack(header)[-2:]
        offset = info.header_offset + _LOCAL_HEADER.size + name_len + extra_len
        if offset + info.file_size > self._size:
            raise CheckpointError(f"{self.path} is truncated: storage data/{key} ends at byte "
                                  f"{offset + info.file_size}, the file has {self._size}")
        storage = _Storage(key, kind.dtype, info.file_size // kind.dtype.itemsize, offset)
        self._storages[key] = storage
        return storage

    def _pread_into(self, buf: memoryview, offset: int, what: str) -> None:
        done = 0
        while done < len(buf):
            n = os.preadv(self._fd, [buf[done: done + _MAX_READ]], offset + done)
            if n <= 0:
                raise CheckpointError(f"{self.path} is truncated: short read of {what}")
            done += n

    # ----------------------------------------------------------------- tensors
    def read(self, t: StoredTensor, start: Optional[int] = None, stop: Optional[int] = None,
             out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Tensor ``t`` (or its rows ``start:stop``), read from disk into a fresh tensor or into ``out``.

        ``out`` must be contiguous with the rows' shape and ``t``'s dtype; it is returned filled.
        """
        shape = t.shape
        lo, hi = 0, shape[0] if shape else 1
        if start is not None:
            lo, hi = max(0, min(start, hi)), max(0, min(stop if stop is not None else hi, hi))
            hi = max(hi, lo)
            shape = (hi - lo, *shape[1:])
        if out is None:
            out = torch.empty(shape, dtype=t.dtype)
        elif tuple(out.shape) != tuple(shape) or out.dtype != t.dtype or not out.is_contiguous():
            raise ValueError(f"read into a {tuple(out.shape)} {out.dtype} tensor, need {shape} {t.dtype} contiguous")
        if not out.numel():
            return out
        itemsize = t.dtype.itemsize
        what = f"storage data/{t.storage.key}"
        if t.contiguous:
            row = math.prod(t.shape[1:]) if t.shape else 1
            first = t.storage_offset + lo * row
            self._pread_into(memoryview(out.view(-1).view(torch.uint8).numpy()), t.storage.offset + first * itemsize, what)
            return out
        # a strided view (rare in state dicts): read the span it covers, then copy the view out of it
        span = 1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride))
        raw = torch.empty(span, dtype=t.dtype)
        self._pread_into(memoryview(raw.view(torch.uint8).numpy()), t.storage.offset + t.storage_offset * itemsize, what)
        out.copy_(raw.as_strided(t.shape, t.stride)[lo:hi] if t.shape else raw.as_strided((), ()))
        return out

    def close(self) -> None:
        """Release the file."""
        fd, self._fd = getattr(self, "_fd", None), None
        if fd is not None:
            os.close(fd)
        zf = getattr(self, "_zip", None)
        if zf is not None:
            zf.close()

    def __del__(self) -> None:
        self.close()


def load_restricted(path: Path) -> TorchZipArchive:
    """Open ``path`` as a torch archive (see :class:`TorchZipArchive`)."""
    return TorchZipArchive(path)
