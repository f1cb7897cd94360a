"""Per-tensor checksums of rank files: computed while a tensor's bytes are written, checked as they are read.

A rank file's JSON records ``{"algorithm": "crc32c", "tensors": {name: "1a2b3c4d"}}``. CRC-32C comes
from google-crc32c (the SSE4.2 instruction: ~4 GB/s here, where zlib's CRC-32 does ~0.9 GB/s and would
cost a quarter of a consolidation); zlib's ``crc32`` is the fallback and is still verified when a file
records it. Readers often read only part of a tensor (rows of a flat shard, the rows a new rank covers
after resharding), so :class:`TensorVerifier` extends a tensor's checksum while reads go forward through
it and checks it when the last byte has been read; whatever was read out of order, or not to the end
(a shard's padding), is completed by :meth:`TensorVerifier.finish`, streamed in bounded chunks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any, Callable, Optional

from ..errors import CheckpointError

logger = logging.getLogger(__name__)

CRC32C = "crc32c"
CRC32 = "crc32"
# google-crc32c takes only buffers without a release hook (bytes): feed it copies of this size
_COPY_CHUNK = 1 << 20
# bytes read at a time when a tensor is checked from the file (bounded memory however large the tensor)
VERIFY_CHUNK = 16 << 20

try:
    import google_crc32c as _gcrc

    _HAVE_CRC32C = _gcrc.implementation == "c"
except ImportError:  # the dependency is pinned; without it files are written with zlib's CRC-32
    _gcrc, _HAVE_CRC32C = None, False


def default_algorithm() -> str:
    """The checksum new rank files record: CRC-32C when its native implementation is installed, else CRC-32."""
    return CRC32C if _HAVE_CRC32C else CRC32


def update(algorithm: str, crc: int, data: Any) -> int:
    """``crc`` extended over the bytes of ``data`` (any buffer: bytes, bytearray, memoryview)."""
    if algorithm == CRC32:
        return zlib.crc32(data, crc)
    if algorithm == CRC32C:
        if _gcrc is None:
            raise CheckpointError("this checkpoint's checksums are CRC-32C: pip install google-crc32c to read it")
        view = memoryview(data).cast("B")
        for start in range(0, len(view), _COPY_CHUNK):
            crc = _gcrc.extend(crc, bytes(view[start:start + _COPY_CHUNK]))
        return crc
    raise CheckpointError(f"unknown checksum algorithm {algorithm!r} in checkpoint metadata")


def hexdigest(crc: int) -> str:
    """A checksum as it is stored: 8 hex digits."""
    return f"{crc:08x}"


def table_digest(checksums: Optional[dict[str, Any]]) -> Optional[str]:
    """SHA-256 of a rank file's checksum table, for the completion marker (catches a damaged table)."""
    if not checksums:
        return None
    return hashlib.sha256(json.dumps(checksums, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


class TensorVerifier:
    """Checks the tensors of one rank file as their bytes are read.

    ``sizes`` maps every tensor to its byte size; ``read_bytes(name, start, stop)`` reads bytes of a
    tensor from the file (used by :meth:`finish` only).
    """

    def __init__(self, path: Path, checksums: dict[str, Any], sizes: dict[str, int],
                 read_bytes: Callable[[str, int, int], Any]):
        self.path, self.algorithm = path, checksums["algorithm"]
        self.expected: dict[str, str] = checksums["tensors"]
        self.sizes, self._read_bytes = sizes, read_bytes
        self._progress: dict[str, list[Any]] = {}  # name -> [crc so far, next byte offset or None if out of order]
        self.verified: set[str] = set()

    def _check(self, name: str, crc: int) -> None:
        want = self.expected.get(name)
        if want is None:
            raise CheckpointError(f"{self.path}: tensor {name} has no recorded checksum: the file's metadata is damaged; "
                                  "use an earlier checkpoint")
        if hexdigest(crc) != want:
            raise CheckpointError(
                f"{self.path}: tensor {name} fails its {self.algorithm} checksum ({hexdigest(crc)}, saved {want}): "
                "the file is corrupted; resume from or consolidate an earlier checkpoint")
        self.verified.add(name)
        self._progress.pop(name, None)

    def on_read(self, name: str, offset: int, data: Any) -> None:
        """Bytes ``offset:offset+len(data)`` of tensor ``name`` were just read."""
        if name in self.verified:
            return
        progress = self._progress.setdefault(name, [0, 0])
        if progress[1] == offset:
            progress[0] = update(self.algorithm, progress[0], data)
            progress[1] += memoryview(data).nbytes
            if progress[1] >= self.sizes[name]:
                self._check(name, progress[0])
        else:
            progress[1] = None  # a jump: the whole tensor is checked in finish()

    def verify(self, name: str, start: int = 0, crc: int = 0) -> None:
        """Check tensor ``name`` from the file, continuing a checksum ``crc`` of its first ``start`` bytes."""
        size = self.sizes[name]
        for lo in range(start, size, VERIFY_CHUNK):
            crc = update(self.algorithm, crc, self._read_bytes(name, lo, min(lo + VERIFY_CHUNK, size)))
        self._check(name, crc)

    def finish(self, also: Iterable[str] = ()) -> None:
        """Check every tensor read so far, and those in ``also``, that is not checked yet: the rest of it is read now."""
        todo = list(self._progress) + [n for n in also if n not in self.verified and n not in self._progress]
        for name in todo:
            crc, pos = self._progress.get(name, [0, 0])
            if pos is None:
                self.verify(name)
            else:
                self.verify(name, pos, crc)


_NOTED: set[str] = set()


def note_unverified(directory: Path) -> None:
    """Log once per checkpoint directory that its rank files carry no checksums (saved by an earlier version)."""
    key = str(directory.resolve())
    if key not in _NOTED:
        _NOTED.add(key)
        logger.warning("%s was saved without checksums (an earlier hf_xla_fsdp): its tensors are read unverified",
                       directory)
