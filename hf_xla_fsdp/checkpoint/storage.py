"""Where a checkpoint's files go and what makes a save complete: one backend per storage mode.

========  =====================================================  ============================================
mode      where ranks write                                       commit point
========  =====================================================  ============================================
shared    a hidden staging directory beside the checkpoint         rank 0's marker, then a directory rename
object    in place, under the final name (a gcsfuse mount, or      rank 0's marker, written last (a directory
          an fsspec URL such as ``gs://bucket/run``)               rename there is copy + delete, not atomic)
local     in place, on each host's own disk (same path string)     each host's first process writes a host
                                                                   marker; rank 0's marker lists every host
========  =====================================================  ============================================

``auto`` picks ``object`` for a URL (``scheme://``, other than ``file://``) or a path on a FUSE mount
(``/proc/mounts`` fstype ``fuse.gcsfuse`` or ``fuse``), ``shared`` otherwise (``local`` is never guessed: a
per-host disk looks like any local directory). :func:`open_storage` gives the backend; the save protocol
(:mod:`.save`) is the same for every mode and calls the backend's few hooks. fsspec is imported only for URLs.
"""

from __future__ import annotations

import base64
import json
import os
import shutil
import socket
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..errors import CheckpointError
from .layout import COMPLETE_MARKER, FORMAT, fsync_dir, publish, staging_dir, with_side_digests, write_bytes_atomic
from .schema import SELF_DIGEST, marker_bytes

STORAGE_MODES = ("auto", "shared", "local", "object")
HOST_ENV = "HF_XLA_FSDP_HOST"  # overrides the host name as a rank's host identity (simulated hosts in tests)
CLOUD_HINT = "pip install 'hf_xla_fsdp[cloud]'"
_FUSE_TYPES = ("fuse.gcsfuse", "fuse")


def host_marker_name(index: int) -> str:
    """``checkpoint_host-00001.json``: the marker of the ``index``-th host (hosts numbered by their first rank)."""
    return f"checkpoint_host-{index:05d}.json"


def host_id() -> str:
    """This process's host identity: ``$HF_XLA_FSDP_HOST`` if set, else the host name."""
    return os.environ.get(HOST_ENV) or socket.gethostname()


# --------------------------------------------------------------------------- paths and URLs
def is_url(path: Union[str, os.PathLike]) -> bool:
    """True for an fsspec URL other than ``file://`` (those are plain local paths)."""
    text = os.fspath(path)
    return "://" in text and not text.startswith("file://")


def local_path(path: Union[str, os.PathLike]) -> Path:
    """A local path (``file://`` stripped)."""
    text = os.fspath(path)
    return Path(text[len("file://"):] if text.startswith("file://") else text)


def remote_fs(url: str) -> tuple[Any, str]:
    """The fsspec file system of ``url`` and the path inside it; a missing driver is one line naming the extra."""
    scheme = url.split("://", 1)[0]
    try:
        import fsspec
    except ImportError:
        raise CheckpointError(f"{url}: fsspec is not installed; {CLOUD_HINT}") from None
    try:
        fs, root = fsspec.core.url_to_fs(url)
    except ImportError as err:  # e.g. gs:// without gcsfs
        raise CheckpointError(f"{url}: the {scheme}:// file system needs a package that is not installed "
                              f"({str(err).strip()}); {CLOUD_HINT}") from None
    except ValueError as err:
        raise CheckpointError(f"{url}: {err}; supported here: local paths, file://, memory://, gs:// ({CLOUD_HINT})"
                              ) from None
    return fs, root.rstrip("/")


def upload_directory(local: Path, url: str, *, overwrite: bool, last: str = "config.json") -> None:
    """Upload the files of the finished local directory ``local`` to the directory ``url``, ``last`` last (a
    directory with a config has its weights); a non-empty ``url`` is refused without ``overwrite``, and a failed
    upload removes what it wrote."""
    fs, root = remote_fs(url)
    check_remote_output(url, overwrite)
    if fs.exists(root) and fs.ls(root, detail=False):
        fs.rm(root, recursive=True)
    names = sorted(p.name for p in local.iterdir() if p.is_file())
    names = [n for n in names if n != last] + [n for n in names if n == last]
    try:
        fs.makedirs(root, exist_ok=True)
        for name in names:
            fs.put_file(str(local / name), f"{root}/{name}")
    except BaseException:
        if fs.exists(root):
            fs.rm(root, recursive=True)
        raise


def check_remote_output(url: str, overwrite: bool) -> None:
    """Refuse a non-empty output directory ``url`` unless ``overwrite`` (before any work is done)."""
    fs, root = remote_fs(url)
    if not overwrite and fs.exists(root) and fs.ls(root, detail=False):
        raise FileExistsError(f"output directory {url} already exists and is not empty; pass --overwrite to replace it")


def mount_type(path: Union[str, os.PathLike]) -> Optional[str]:
    """The file-system type of the mount holding ``path`` (from /proc/mounts; None where it cannot be read)."""
    try:
        lines = Path("/proc/mounts").read_text().splitlines()
    except OSError:
        return None
    target = os.path.realpath(os.path.abspath(os.fspath(path)))
    best, best_type = "", None
    for line in lines:
        parts = line.split()
        if len(parts) < 3:
            continue
        point = parts[1].replace("\\040", " ")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best):
            best, best_type = point, parts[2]
    return best_type


def resolve_mode(path: Union[str, os.PathLike], mode: str = "auto") -> str:
    """The storage mode of a save to ``path``: ``mode`` itself, or for ``auto`` what the path says (see module)."""
    mode = str(mode).strip().lower()
    if mode not in STORAGE_MODES:
        raise CheckpointError(f"checkpoint_storage={mode!r} is not valid; allowed values: {', '.join(STORAGE_MODES)}")
    if is_url(path):
        if mode in ("shared", "local"):
            raise CheckpointError(f"checkpoint_storage={mode!r} cannot write to {os.fspath(path)}: a URL is object "
                                  "storage (use 'auto' or 'object')")
        return "object"
    if mode != "auto":
        return mode
    return "object" if mount_type(local_path(path)) in _FUSE_TYPES else "shared"


# --------------------------------------------------------------------------- one save, as the backends see it
def first_line(err: BaseException) -> str:
    """The first line of an error's message (its type's name when it has none)."""
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def together(ckpt_dir: Union[str, Path], what: str, call: Callable[[], Any]) -> Any:
    """A barrier or gather of the save; whatever it raises (a timeout, a lost peer) becomes one line."""
    try:
        return call()
    except CheckpointError:
        raise
    except Exception as err:
        raise CheckpointError(f"the save of {ckpt_dir} {what}: {first_line(err)}") from None


def host_groups(reports: list[dict[str, Any]]) -> dict[str, list[int]]:
    """The ranks of each host, hosts in the order of their first rank (host 0 holds rank 0)."""
    groups: dict[str, list[int]] = {}
    for report in sorted(reports, key=lambda r: r["rank"]):
        groups.setdefault(str(report.get("host", "")), []).append(report["rank"])
    return groups


@dataclass
class SaveRound:
    """One save as a rank sees it once every rank's report is in: what the storage hooks work with."""

    rank: int
    world: int
    host: str
    reports: list[dict[str, Any]]
    #: every rank's payload on every rank (the save's collective)
    gather: Callable[[str, bytes], list[bytes]]
    #: the completion marker, built from the reports
    marker: Callable[[], dict[str, Any]]

    @property
    def hosts(self) -> dict[str, list[int]]:
        """The ranks of each host (see :func:`host_groups`)."""
        return host_groups(self.reports)


# --------------------------------------------------------------------------- the backends
def _marker_storage(marker: dict[str, Any]) -> str:
    return marker.get("storage", "shared")  # markers of earlier versions: shared, by rename


def _refuse_mixed(where: str, marker: Optional[dict[str, Any]], mode: str) -> None:
    if marker is not None and _marker_storage(marker) != mode:
        raise CheckpointError(f"{where} holds a checkpoint saved with checkpoint_storage={_marker_storage(marker)!r}; "
                              f"refusing to save a {mode!r} one into the same directory (mixed storage modes): "
                              "use another directory or the same mode")


def _read_json(path: Path) -> Optional[dict[str, Any]]:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


class Storage:
    """The shared mode (and the interface): ranks write into a staging directory that rank 0 renames into place."""

    mode = "shared"
    in_place = False  # True: files are written under the final name; the old marker must go before any write

    def __init__(self, ckpt: Union[str, os.PathLike]):
        self.ckpt = local_path(ckpt)
        self.display = os.fspath(ckpt)

    def begin(self) -> None:
        """Every rank, before it writes: refuse a directory holding another mode's checkpoint. In-place modes also
        remove the previous marker: whichever rank writes a file first has removed it, so an old marker is never
        paired with a new file (removing it twice is harmless)."""
        _refuse_mixed(self.display, _read_json(self.ckpt / COMPLETE_MARKER), self.mode)
        # a marker left in the staging directory by a save of the same name killed before publishing is never reused
        (staging_dir(self.ckpt) / COMPLETE_MARKER).unlink(missing_ok=True)

    def write_dir(self) -> Path:
        """The local directory this rank writes its files into (created)."""
        stage = staging_dir(self.ckpt)
        stage.mkdir(parents=True, exist_ok=True)
        return stage

    def written(self, paths: list[Path]) -> None:
        """This rank's files are complete in :meth:`write_dir` (remote storage uploads them here)."""

    def owns(self, rnd: SaveRound) -> bool:
        """Whether this rank removes what a failed save left (and writes the markers it owns)."""
        return rnd.rank == 0

    def prepare_commit(self, rnd: SaveRound) -> None:
        """Every rank, once every rank's files are written and before rank 0 commits."""

    def finish_commit(self, rnd: SaveRound, committed: bool) -> None:
        """Every rank, after rank 0's commit (``committed``: on rank 0, whether it succeeded)."""

    def check_reports(self, reports: list[dict[str, Any]]) -> None:
        """Rank 0, before marking: every reported file is in its directory (ranks of a pod on per-host disks
        would otherwise be published as a checkpoint missing their files)."""
        stage = staging_dir(self.ckpt)
        for report in reports:
            path = stage / report["file"]
            if not path.is_file() or path.stat().st_size != report["entry"]["bytes"]:
                raise CheckpointError(
                    f"cannot commit {self.display}: rank {report['rank']} (host {report.get('host', '?')}) reported "
                    f"{report['file']}, which is not in rank 0's {stage}: the ranks do not share a file system "
                    "(a pod whose hosts write to their own disks?); set checkpoint_storage='local' (then gather), or "
                    "save to shared storage or a gs:// URL")

    def commit(self, marker: dict[str, Any], before_commit: Optional[Callable[[Path], None]]) -> None:
        """Rank 0: write the marker, run ``before_commit``, make the checkpoint visible."""
        stage = staging_dir(self.ckpt)
        remove_stale(stage, marker)
        write_bytes_atomic(stage / COMPLETE_MARKER, marker_bytes(marker))
        if before_commit is not None:
            before_commit(stage)  # reads the marked stage (a consolidated copy), then its side files get digests
            sealed = with_side_digests(marker, stage)
            if sealed is not marker:
                write_bytes_atomic(stage / COMPLETE_MARKER, marker_bytes(sealed))
        publish(stage, self.ckpt)

    def abort(self) -> None:
        """The owner of a directory, after a failed save: nothing of it is left behind."""
        shutil.rmtree(staging_dir(self.ckpt), ignore_errors=True)

    def close(self) -> None:
        """This rank is done with the save (temporary files go)."""


def _listed(marker: dict[str, Any]) -> set[str]:
    """The rank files a marker lists, tensor and JSON files."""
    return set(marker["files"]) | {f"{Path(n).stem}.json" for n in marker["files"]}


def _is_stale(name: str, listed: set[str]) -> bool:
    """A file of an earlier, killed save: an unlisted rank file, or a temporary of one."""
    return (name.startswith("rank-") and name not in listed) or (name.startswith(".rank-") and ".tmp" in name) \
        or name.startswith(f".{COMPLETE_MARKER}.tmp")


def remove_stale(directory: Path, marker: dict[str, Any]) -> None:
    """Files of an earlier killed save in ``directory`` that ``marker`` does not list (e.g. of another world size)."""
    listed = _listed(marker)
    for path in directory.iterdir():
        if path.is_file() and _is_stale(path.name, listed):
            path.unlink(missing_ok=True)


class InPlaceStorage(Storage):
    """The object mode on a mounted path (gcsfuse): files in place, the marker written last is the commit."""

    mode = "object"
    in_place = True

    def begin(self) -> None:
        marker_path = self.ckpt / COMPLETE_MARKER
        _refuse_mixed(self.display, _read_json(marker_path), self.mode)
        marker_path.unlink(missing_ok=True)

    def write_dir(self) -> Path:
        self.ckpt.mkdir(parents=True, exist_ok=True)
        return self.ckpt

    def check_reports(self, reports: list[dict[str, Any]]) -> None:
        pass  # rank 0 never opens other ranks' files: their reports (ids, sizes, digests) are the truth

    def commit(self, marker: dict[str, Any], before_commit: Optional[Callable[[Path], None]]) -> None:
        if before_commit is not None:
            before_commit(self.ckpt)
        fsync_dir(self.ckpt)
        write_bytes_atomic(self.ckpt / COMPLETE_MARKER, marker_bytes(with_side_digests(marker, self.ckpt)))
        self.clean(marker)

    def clean(self, marker: dict[str, Any]) -> None:
        """Files of an earlier killed save to this directory that the marker does not list go (ignored anyway)."""
        remove_stale(self.ckpt, marker)

    def abort(self) -> None:
        if not (self.ckpt / COMPLETE_MARKER).is_file():  # never marked: nothing in it can be trusted
            shutil.rmtree(self.ckpt, ignore_errors=True)


class LocalStorage(InPlaceStorage):
    """Per-host disks: every host has its own directory of the same name; each host's first process writes a
    host marker (the ranks it holds), rank 0 the global marker, and then every host gets a copy of it (with rank
    0's small side files, so a resume on any host reads them from its own disk)."""

    mode = "local"
    #: side files sent to the other hosts with the marker copy (larger ones, e.g. a consolidated copy of the model,
    #: reach them only through ``hf-xla-fsdp gather``)
    side_file_limit = 64 << 20

    def begin(self) -> None:
        super().begin()
        if self.ckpt.is_dir():
            for old in self.ckpt.glob("checkpoint_host-*.json"):
                old.unlink(missing_ok=True)

    def owns(self, rnd: SaveRound) -> bool:
        return rnd.rank == 0 or rnd.hosts.get(rnd.host, [rnd.rank])[0] == rnd.rank  # each host's first rank

    def write_host_marker(self, index: int, data: dict[str, Any]) -> None:
        """This host's marker: the ranks and files it holds."""
        write_bytes_atomic(self.ckpt / host_marker_name(index), json.dumps(data, indent=1).encode())

    def copy_marker(self, marker: dict[str, Any]) -> None:
        """A host other than rank 0's, once rank 0 committed: the global marker, so resume finds it here."""
        write_bytes_atomic(self.ckpt / COMPLETE_MARKER, marker_bytes(marker))
        self.clean(marker)

    def prepare_commit(self, rnd: SaveRound) -> None:
        """Each host's first rank writes its host marker (the ranks and files it holds); every rank hears whether
        all did before rank 0 commits."""
        error = None
        if self.owns(rnd):
            hosts = rnd.hosts
            mine = [r for r in sorted(rnd.reports, key=lambda r: r["rank"]) if r["rank"] in hosts[rnd.host]]
            data = {"format": FORMAT, "host": rnd.host, "host_index": list(hosts).index(rnd.host), "hosts": len(hosts),
                    "world_size": rnd.world, "step": rnd.reports[0]["step"], "run_id": rnd.reports[0]["run_id"],
                    "ranks": hosts[rnd.host], "files": {r["file"]: r["entry"] for r in mine}}
            try:
                self.write_host_marker(data["host_index"], data)
            except OSError as err:
                error = first_line(err)
        statuses = [json.loads(p) for p in together(
            self.display, "did not complete (ranks lost while writing the host markers)",
            lambda: rnd.gather("hf_xla_fsdp.save.hosts", json.dumps({"rank": rnd.rank, "error": error}).encode()))]
        bad = [s for s in statuses if s.get("error")]
        if bad:
            if self.owns(rnd):
                self.abort()
            raise CheckpointError(f"the save of {self.display} failed on rank {bad[0]['rank']} writing its host marker: "
                                  f"{bad[0]['error']} (nothing was published; earlier checkpoints are untouched)")

    def _side_files(self) -> dict[str, str]:
        """The small files rank 0 added beside the rank files (``before_commit``), base64 by name."""
        out: dict[str, str] = {}
        total = 0
        for path in sorted(self.ckpt.iterdir()):
            name = path.name
            if not path.is_file() or name.startswith((".", "rank-", "checkpoint_host-")) or name == COMPLETE_MARKER:
                continue
            size = path.stat().st_size
            if total + size > self.side_file_limit:
                continue
            total += size
            out[name] = base64.b64encode(path.read_bytes()).decode()
        return out

    def finish_commit(self, rnd: SaveRound, committed: bool) -> None:
        """After rank 0's commit, every other host gets a copy of the global marker, so a resume on that host
        (which reads only its own disk) finds it. Rank 0's marker is the commit point; a host killed before its copy
        has a complete host marker but no copy, and is resumed from an earlier checkpoint or after gathering."""
        status = {"ok": committed, "side_files": self._side_files() if committed else {},
                  "marker": _read_json(self.ckpt / COMPLETE_MARKER) if committed else None} if rnd.rank == 0 else {}
        statuses = [json.loads(p) for p in together(
            self.display, "lost ranks after every rank had written (its completion marker, if any, is the truth)",
            lambda: rnd.gather("hf_xla_fsdp.save.marked", json.dumps(status).encode()))]
        owner = self.owns(rnd)
        if not statuses[0].get("ok", False):
            if owner and rnd.rank != 0:
                self.abort()
            if rnd.rank != 0:
                raise CheckpointError(f"the save of {self.display} failed on rank 0 while committing (nothing was "
                                      "published; earlier checkpoints are untouched)")
            return
        if owner and rnd.rank != 0:
            # rank 0's side files (a Trainer's trainer_state.json, config, tokenizer) first: a resume on this host
            # reads them from its own disk, and the marker copy comes last
            sent = statuses[0].get("side_files", {})
            for name, data in sent.items():
                write_bytes_atomic(self.ckpt / name, base64.b64decode(data))
            # rank 0's marker, so every copy is the same; digests only of the side files this host received
            marker = statuses[0].get("marker") or rnd.marker()
            digests = {n: d for n, d in (marker.get("side_files") or {}).items() if n in sent}
            marker = {k: v for k, v in marker.items() if k not in ("side_files", SELF_DIGEST)}
            self.copy_marker({**marker, "side_files": digests} if digests else marker)


class RemoteStorage(Storage):
    """The object mode on an fsspec URL: each rank writes into a local spool and uploads its files under the
    final name; rank 0 uploads the marker last, with one put (an object appears whole or not at all)."""

    mode = "object"
    in_place = True

    def __init__(self, ckpt: Union[str, os.PathLike]):
        self.display = os.fspath(ckpt)
        self.fs, self.root = remote_fs(self.display)
        self.ckpt = Path(self.root)  # for messages only
        self._spool: Optional[Path] = None

    def _remote(self, name: str) -> str:
        return f"{self.root}/{name}"

    def _marker(self) -> Optional[dict[str, Any]]:
        try:
            return json.loads(self.fs.cat_file(self._remote(COMPLETE_MARKER)))
        except (FileNotFoundError, ValueError):
            return None

    def begin(self) -> None:
        _refuse_mixed(self.display, self._marker(), self.mode)
        try:
            self.fs.rm_file(self._remote(COMPLETE_MARKER))
        except FileNotFoundError:  # none, or another rank removed it first
            pass

    def write_dir(self) -> Path:
        if self._spool is None:
            base = os.environ.get("HF_XLA_FSDP_SPOOL") or None  # where rank files wait for their upload
            self._spool = Path(tempfile.mkdtemp(prefix="hf_xla_fsdp-spool-", dir=base))
        return self._spool

    def written(self, paths: list[Path]) -> None:
        self.fs.makedirs(self.root, exist_ok=True)
        for path in paths:  # the JSON last: a tensor file without its metadata is never mistaken for complete
            self.fs.put_file(str(path), self._remote(path.name))

    def check_reports(self, reports: list[dict[str, Any]]) -> None:
        pass

    def commit(self, marker: dict[str, Any], before_commit: Optional[Callable[[Path], None]]) -> None:
        spool = self.write_dir()
        if before_commit is not None:
            before_commit(spool)
        for path in spool.iterdir():  # what before_commit added (rank 0's own rank files are uploaded already)
            if not path.name.startswith(("rank-", ".")):
                self.fs.put(str(path), self._remote(path.name), recursive=path.is_dir())
        listed = _listed(marker)
        self.fs.pipe_file(self._remote(COMPLETE_MARKER), marker_bytes(with_side_digests(marker, spool)))
        for path in self.fs.ls(self.root, detail=False):
            name = path.rstrip("/").rsplit("/", 1)[-1]
            if _is_stale(name, listed):
                self.fs.rm_file(path)

    def abort(self) -> None:
        if self._marker() is None and self.fs.exists(self.root):
            self.fs.rm(self.root, recursive=True)

    def close(self) -> None:
        if self._spool is not None:
            shutil.rmtree(self._spool, ignore_errors=True)
            self._spool = None


def open_storage(ckpt: Union[str, os.PathLike], mode: str = "auto") -> Storage:
    """The backend of a save of ``ckpt`` in storage ``mode`` (``auto``: see :func:`resolve_mode`)."""
    resolved = resolve_mode(ckpt, mode)
    if is_url(ckpt):
        return RemoteStorage(ckpt)
    return {"shared": Storage, "object": InPlaceStorage, "local": LocalStorage}[resolved](ckpt)


# --------------------------------------------------------------------------- reading from a URL
class Fetched:
    """A local copy of the files of a checkpoint at a URL that a reader needs (removed with this object)."""

    def __init__(self, url: str, names: Optional[list[str]] = None):
        fs, root = remote_fs(url)
        self._tmp = tempfile.TemporaryDirectory(prefix="hf_xla_fsdp-fetch-", dir=os.environ.get("HF_XLA_FSDP_SPOOL"))
        self.path = Path(self._tmp.name)
        try:
            raw = fs.cat_file(f"{root}/{COMPLETE_MARKER}")
        except FileNotFoundError:
            exists = fs.exists(root) and any(p.rsplit("/", 1)[-1].startswith("rank-") for p in fs.ls(root, detail=False))
            raise CheckpointError(f"{url} is {'incomplete' if exists else 'not an hf_xla_fsdp checkpoint'} (no "
                                  f"{COMPLETE_MARKER}){': its save did not finish' if exists else ''}") from None
        (self.path / COMPLETE_MARKER).write_bytes(raw)
        try:
            marker = json.loads(raw)
            listed = sorted(_listed(marker))
        except (ValueError, KeyError, TypeError, AttributeError):
            return  # read_marker reports the damage
        keep = None if names is None else set(names) | {f"{Path(n).stem}.json" for n in names}
        wanted = listed if keep is None else [n for n in listed if n in keep]
        present = {p.rstrip("/").rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)}
        if names is None:  # a whole read (consolidation): the small side files too (config, tokenizer, state)
            wanted += [n for n in present if not n.startswith(("rank-", ".")) and n not in listed
                       and n != COMPLETE_MARKER and fs.isfile(f"{root}/{n}")]
        for name in wanted:
            if name in present:  # a missing one is reported by the reader, naming it
                fs.get_file(f"{root}/{name}", str(self.path / name))

    def cleanup(self) -> None:
        """Remove the local copy now."""
        self._tmp.cleanup()
