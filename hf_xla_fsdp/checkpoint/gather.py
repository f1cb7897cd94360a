"""``hf-xla-fsdp gather``: the host directories of a local-mode checkpoint (per-host disks) brought together.

Each host of a pod wrote its ranks' files into its own disk's directory of the same name, with a host marker;
rank 0's host (and, once it committed, every host) holds the global ``checkpoint_complete.json`` listing every
file and its id. Gathering copies every listed file, checked by id and size, from whichever source holds it into
one directory, writes the marker last, and publishes it (a rename locally, the marker's upload for a URL); the
result reads, verifies, consolidates and reshards like any other checkpoint.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any, Union

from ..errors import CheckpointError
from .layout import COMPLETE_MARKER, prepare_output, publish, write_bytes_atomic
from .schema import marker_bytes, validate_marker
from .storage import is_url, local_path, remote_fs


class _Source:
    """One host's directory (a local path or a URL): listing, reading and copying its files."""

    def __init__(self, where: Union[str, os.PathLike]):
        self.display = os.fspath(where)
        self.fs, self.root = remote_fs(self.display) if is_url(where) else (None, str(local_path(where)))

    def names(self) -> set[str]:
        if self.fs is not None:
            if not self.fs.isdir(self.root):
                return set()
            return {p.rstrip("/").rsplit("/", 1)[-1] for p in self.fs.ls(self.root, detail=False)}
        root = Path(self.root)
        return {p.name for p in root.iterdir() if p.is_file()} if root.is_dir() else set()

    def read(self, name: str) -> bytes:
        if self.fs is not None:
            return self.fs.cat_file(f"{self.root}/{name}")
        return (Path(self.root) / name).read_bytes()

    def size(self, name: str) -> int:
        if self.fs is not None:
            return int(self.fs.size(f"{self.root}/{name}"))
        return (Path(self.root) / name).stat().st_size

    def copy_to(self, name: str, dest: Path) -> None:
        if self.fs is not None:
            self.fs.get_file(f"{self.root}/{name}", str(dest))
        else:
            shutil.copyfile(Path(self.root) / name, dest)


def _global_marker(sources: list[_Source]) -> tuple[dict[str, Any], _Source]:
    found: list[tuple[dict[str, Any], _Source]] = []
    for src in sources:
        if COMPLETE_MARKER in src.names():
            try:
                found.append((validate_marker(json.loads(src.read(COMPLETE_MARKER)), f"{src.display}/{COMPLETE_MARKER}"),
                              src))
            except CheckpointError:
                raise
            except (ValueError, RecursionError):
                raise CheckpointError(f"{src.display}/{COMPLETE_MARKER} is truncated or corrupted") from None
    if not found:
        raise CheckpointError(f"none of {', '.join(s.display for s in sources)} holds {COMPLETE_MARKER}: include rank "
                              "0's host directory (or the save did not finish, and there is nothing to gather)")
    marker, src = found[0]
    for other, where in found[1:]:
        if other.get("files") != marker.get("files"):
            raise CheckpointError(f"{where.display} and {src.display} hold the markers of different saves "
                                  f"(step {other.get('step')} and {marker.get('step')}): gather one checkpoint at a time")
    if not isinstance(marker.get("files"), dict):
        raise CheckpointError(f"{src.display}/{COMPLETE_MARKER} is corrupted: 'files' must map file names to their ids")
    return marker, src


def _locate(marker: dict[str, Any], sources: list[_Source]) -> dict[str, _Source]:
    """Which source holds each listed rank file with the id and size the marker records."""
    where: dict[str, _Source] = {}
    names = [src.names() for src in sources]
    for name, entry in sorted(marker["files"].items()):
        meta_name = f"{Path(name).stem}.json"
        for src, present in zip(sources, names):
            if name not in present or meta_name not in present:
                continue
            try:
                file_id = json.loads(src.read(meta_name)).get("file_id")
            except (ValueError, AttributeError):
                continue
            if file_id == entry.get("file_id") and src.size(name) == entry.get("bytes", src.size(name)):
                where[name] = src
                break
    missing = [n for n in sorted(marker["files"]) if n not in where]
    if missing:
        by_host = []
        for index, host in enumerate(marker.get("hosts") or []):
            gone = [n for n in host.get("files", []) if n in missing]
            if gone:
                by_host.append(f"host {index} ({host.get('host')}): {', '.join(gone)}")
        what = "; ".join(by_host) if by_host else ", ".join(missing)
        raise CheckpointError(f"cannot gather: no source holds {what} with the id {COMPLETE_MARKER} lists; pass every "
                              "host's directory of this checkpoint")
    return where


def gather_checkpoint(sources: list[Union[str, os.PathLike]], output: Union[str, os.PathLike], *,
                      overwrite: bool = False) -> dict[str, Any]:
    """Copy the files of one local-mode checkpoint from every host's directory in ``sources`` into ``output``.

    Every file the global marker lists is checked by id and size before anything is written; the marker is written
    last. ``output`` (a path or URL) must not exist or be empty unless ``overwrite``. Returns a summary.
    """
    if not sources:
        raise CheckpointError("gather needs at least one source directory")
    srcs = [_Source(s) for s in sources]
    marker, marker_src = _global_marker(srcs)
    where = _locate(marker, srcs)
    side = sorted(n for n in marker_src.names()
                  if not n.startswith(("rank-", ".")) and n != COMPLETE_MARKER)  # trainer state, config, host markers
    for src in srcs:  # the other hosts' markers too: the gathered directory says where each part came from
        side += sorted(n for n in src.names() if n.startswith("checkpoint_host-") and n not in side)
    copies = [(name, src) for name, src in sorted(where.items())]
    copies += [(f"{Path(name).stem}.json", src) for name, src in sorted(where.items())]
    final = {**marker, "gathered_from": [s.display for s in srcs]}
    data = marker_bytes(final)
    if is_url(output):
        _gather_to_url(str(output), copies, side, srcs, marker_src, data, overwrite)
    else:
        out = local_path(output)
        stage = prepare_output(out, overwrite)
        try:
            for name, src in copies:
                src.copy_to(name, stage / name)
            for name in side:
                _first_holder(name, marker_src, srcs).copy_to(name, stage / name)
            write_bytes_atomic(stage / COMPLETE_MARKER, data)
            publish(stage, out)
        except BaseException:
            shutil.rmtree(stage, ignore_errors=True)
            raise
    return {"output": os.fspath(output), "world_size": marker.get("world_size"), "step": marker.get("step"),
            "files": len(marker["files"]), "sources": {name: src.display for name, src in sorted(where.items())}}


def _first_holder(name: str, first: _Source, sources: list[_Source]) -> _Source:
    return first if name in first.names() else next(s for s in sources if name in s.names())


def _gather_to_url(output: str, copies: list[tuple[str, _Source]], side: list[str], sources: list[_Source],
                   marker_src: _Source, data: bytes, overwrite: bool) -> None:
    """Object storage: every file uploaded under the final name, the marker last (the commit point)."""
    import tempfile

    fs, root = remote_fs(output)
    if fs.exists(root) and fs.ls(root, detail=False):
        if not overwrite:
            raise FileExistsError(f"output directory {output} already exists and is not empty; pass --overwrite")
        fs.rm(root, recursive=True)
    fs.makedirs(root, exist_ok=True)
    try:
        with tempfile.TemporaryDirectory(prefix="hf_xla_fsdp-gather-", dir=os.environ.get("HF_XLA_FSDP_SPOOL")) as tmp:
            for name, src in copies + [(n, _first_holder(n, marker_src, sources)) for n in side]:
                src.copy_to(name, Path(tmp) / name)
                fs.put_file(str(Path(tmp) / name), f"{root}/{name}")
                (Path(tmp) / name).unlink()
        fs.pipe_file(f"{root}/{COMPLETE_MARKER}", data)
    except BaseException:
        fs.rm(root, recursive=True)
        raise

