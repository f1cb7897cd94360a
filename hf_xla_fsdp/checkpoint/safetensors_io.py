"""Safetensors read and written with plain file I/O, one tensor (or a row range of one) at a time.

``safe_open`` memory-maps the whole file, and every page it touches counts in the process's RSS
until the map closes; consolidation touches every byte of every rank file, so positional reads of
exactly the bytes needed keep memory at the tensors being assembled. The writer takes every
tensor's name, shape and dtype up front, writes the header first and then each tensor as it is
produced, so memory stays at one tensor however large the file.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import sys
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..errors import CheckpointError

ST_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
             "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
             "BOOL": torch.bool}
_ST_DTYPE_NAMES = {dtype: name for name, dtype in ST_DTYPES.items()}
_TORCH_NAMES = {str(d).removeprefix("torch."): d for d in ST_DTYPES.values()}

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32`` (the dtypes a checkpoint can hold)."""
    try:
        return _TORCH_NAMES[name]
    except KeyError:
        raise CheckpointError(f"unsupported tensor dtype {name!r} in checkpoint metadata") from None


def dtype_name(dtype: torch.dtype) -> str:
    """``torch.float32`` -> ``"float32"``."""
    return str(dtype).removeprefix("torch.")


class SafetensorsReader:
    """Reads tensors, or row ranges of them, from a safetensors file with ``pread``."""

    def __init__(self, path: Path):
        size = path.stat().st_size
        with open(path, "rb") as fh:
            raw = fh.read(8)
            if len(raw) != 8:
                raise ValueError("file shorter than a safetensors header")
            (n,) = struct.unpack("<Q", raw)
            if n > size - 8:
                raise ValueError(f"header size {n} exceeds the file")
            head = fh.read(n)
            header = json.loads(head)
        self._header_digest = hashlib.sha256(raw + head).hexdigest()
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        self.entries: dict[str, tuple[torch.dtype, tuple[int, ...], int, int]] = {}
        for name, info in header.items():
            dtype = ST_DTYPES[info["dtype"]]
            shape = tuple(int(d) for d in info["shape"])
            begin, end = (int(x) for x in info["data_offsets"])
            if end - begin != math.prod(shape) * dtype.itemsize or end > size - 8 - n:
                raise ValueError(f"entry {name} lies outside the file or has a wrong size")
            self.entries[name] = (dtype, shape, 8 + n + begin, 8 + n + end)
        self.path = path
        self._fd = os.open(path, os.O_RDONLY)

    def read(self, name: str, start: Optional[int] = None, stop: Optional[int] = None,
             on_bytes: Optional[Callable[[str, int, bytearray], Any]] = None) -> torch.Tensor:
        """Tensor ``name``, or only its rows ``start:stop``; ``on_bytes(name, offset, data)`` sees the bytes read."""
        dtype, shape, begin, end = self.entries[name]
        offset = 0
        if start is not None:
            rows = shape[0]
            start, stop = max(0, min(start, rows)), max(0, min(stop, rows))
            row_bytes = math.prod(shape[1:]) * dtype.itemsize
            offset, end = start * row_bytes, begin + max(stop, start) * row_bytes
            begin += offset
            shape = (max(stop - start, 0), *shape[1:])
        buf = bytearray(end - begin)
        if buf and os.preadv(self._fd, [buf], begin) != len(buf):
            raise ValueError(f"short read of {name}")
        if on_bytes is not None:
            on_bytes(name, offset, buf)
        if not buf:
            return torch.empty(shape, dtype=dtype)
        return torch.frombuffer(buf, dtype=dtype).reshape(shape)

    def header_sha256(self) -> str:
        """SHA-256 of the file's first bytes up to its tensor data (size field and JSON header)."""
        return self._header_digest

    def nbytes(self, name: str) -> int:
        """Size of tensor ``name``'s data in bytes."""
        _, _, begin, end = self.entries[name]
        return end - begin

    def read_bytes(self, name: str, start: int, stop: int) -> bytearray:
        """Bytes ``start:stop`` of tensor ``name``'s data."""
        _, _, begin, end = self.entries[name]
        stop = min(stop, end - begin)
        buf = bytearray(max(stop - start, 0))
        if buf and os.preadv(self._fd, [buf], begin + start) != len(buf):
            raise ValueError(f"short read of {name}")
        return buf

    def __del__(self) -> None:
        fd = getattr(self, "_fd", None)
        if fd is not None:
            os.close(fd)


def write_safetensors_streaming(path: Path, specs: list[TensorSpec], produce: Callable[[str], torch.Tensor],
                                metadata: dict[str, str], on_tensor: Optional[Callable[[str], Any]] = None,
                                checksum: Optional[str] = None) -> dict[str, str]:
    """Write a safetensors file one tensor at a time, then fsync it; returns each tensor's checksum.

    ``specs`` gives every (name, shape, dtype) up front, so the header goes first and each tensor
    is produced by ``produce(name)``, written and dropped in turn. The layout is the safetensors
    format (little-endian u64 header size, JSON header padded to 8 bytes, raw little-endian data).
    With ``checksum`` (an algorithm of :mod:`.checksums`) every tensor's bytes are checksummed as
    they are written: ``{name: hex}``; empty without.
    """
    from .checksums import hexdigest, update

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
    sums: dict[str, str] = {}
    with open(path, "wb") as fh:
        fh.write(struct.pack("<Q", len(head)))
        fh.write(head)
        for name, shape, dtype in specs:
            tensor = produce(name)
            if tuple(tensor.shape) != tuple(shape) or tensor.dtype != dtype:
                raise CheckpointError(f"{name}: produced {tuple(tensor.shape)} {tensor.dtype}, expected {tuple(shape)} {dtype}")
            data = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data
            fh.write(data)
            if checksum is not None:
                sums[name] = hexdigest(update(checksum, 0, data))
            if on_tensor is not None:
                on_tensor(name)
        fh.flush()
        os.fsync(fh.fileno())
    return sums
