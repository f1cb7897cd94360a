"""Saving: every rank writes its files into a staging directory and reports them to rank 0, which marks the save
complete from the reports and publishes it.

What a rank's tensors are is the engine's business (:meth:`~hf_xla_fsdp.engines.base.Engine.rank_state`);
the file protocol here is the same for every engine: tensors streamed into ``rank-R-of-W.safetensors``,
metadata into ``rank-R-of-W.json`` (both fsync'd, and the directory), then a report per rank (file name,
size, id, digests) gathered to rank 0, which writes ``checkpoint_complete.json`` from the reports alone
(it never opens another rank's files, which may live on another host) and renames the directory into place.
With ``async_save`` the step waits only for the copy of the rank's state to host memory; the rest runs in a
background thread (:mod:`.background`).
"""

from __future__ import annotations

import functools
import hashlib
import json
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from ..errors import CheckpointError
from .checksums import default_algorithm, table_digest
from .codec import CheckpointCodec, Collectives, codec_of
from .layout import (
    COMPLETE_MARKER,
    FORMAT,
    RNG_CPU,
    fsync_dir,
    publish,
    rank_file_stem,
    staging_dir,
    write_bytes_atomic,
)
from .readers import LAYOUT_FLAT
from .safetensors_io import SafetensorsReader, write_safetensors_streaming
from .schema import marker_bytes
from .state import rng_meta
from .storage import (
    SaveRound,
    Storage,
    first_line,
    host_groups,
    host_id,
    is_url,
    local_path,
    open_storage,
    remove_stale,
    together,
)


def rank_world(model: nn.Module) -> tuple[int, int]:
    """``(rank, world size)`` in rank files: FSDP v1 ranks, or SPMD processes for FSDP v2."""
    return codec_of(model).rank_world(model)


def _model_meta(model: nn.Module, codec: CheckpointCodec) -> dict[str, Any]:
    """The transformers config of the model inside the wrappers (under adapters, the base model's) and, for a
    PEFT model, every adapter's peft config (so the checkpoint can become adapter files on its own)."""
    inner = codec.unwrap(model)
    out: dict[str, Any] = {"model_config": None}
    adapters = getattr(inner, "peft_config", None)
    if adapters is not None and hasattr(inner, "get_base_model"):  # a peft.PeftModel (peft itself is not imported)
        def plain(value: Any) -> Any:  # sets (target_modules) as sorted lists, enums and the like as text
            return sorted(value) if isinstance(value, (set, frozenset)) else str(value)

        out["peft"] = {"adapters": {name: json.loads(json.dumps(cfg.to_dict(), default=plain))
                                    for name, cfg in adapters.items()},
                       "active_adapter": getattr(inner, "active_adapter", None)}
        inner = inner.get_base_model()
    config = getattr(inner, "config", None)
    if config is not None:
        out["model_config"] = config.to_dict()
        out["model_config"]["architectures"] = [type(inner).__name__]
    return out


def write_rank_file(
    ckpt_dir: Union[str, Path],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    *,
    step: int = 0,
    run_id: Optional[str] = None,
    plugin: Any = None,
    extra: Optional[dict[str, Any]] = None,
) -> Path:
    """Write the calling rank's files into the staging directory of ``ckpt_dir``; returns the tensor file."""
    snap = _snapshot(model, optimizer, scheduler, step=step, run_id=run_id, plugin=plugin, extra=extra, to_host=False)
    store = Storage(ckpt_dir)  # the shared mode's staging directory, committed by commit_checkpoint
    store.begin()
    path, _ = _write_rank_files(store.write_dir(), snap)
    return path


@dataclass
class _Snapshot:
    """What a rank saves, taken at the step boundary: tensor specs, a producer for each, the JSON metadata."""

    rank: int
    world: int
    specs: list[tuple[str, tuple[int, ...], torch.dtype]]
    produce: Callable[[str], torch.Tensor]
    meta: dict[str, Any]
    nbytes: int = 0


def _snapshot(model: nn.Module, optimizer: Optional[torch.optim.Optimizer], scheduler: Any, *, step: int,
              run_id: Optional[str], plugin: Any, extra: Optional[dict[str, Any]], to_host: bool) -> _Snapshot:
    """The rank's state; with ``to_host`` every tensor is copied to host memory now (for a background write),
    otherwise each is fetched from the device when written (one at a time: bounded host memory)."""
    codec = codec_of(model)
    rank, world = codec.rank_world(model)
    codec.sync()  # pending updates land before reading values
    state = codec.rank_state(model, optimizer)
    cpu_rng = torch.get_rng_state()
    specs = [*state.specs, (RNG_CPU, tuple(cpu_rng.shape), cpu_rng.dtype)]
    meta = {"rank": rank, "world_size": world, "run_id": run_id, "step": int(step), **state.meta,
            "scheduler": scheduler.state_dict() if scheduler is not None else None,
            "rng": rng_meta(codec.rng_state()), **_model_meta(model, codec),
            "engine_name": codec.name, "engine_title": codec.title,
            "plugin": plugin.to_dict() if plugin is not None else None,
            "extra": extra or {}}
    try:
        text = json.dumps(meta)
    except TypeError as err:
        raise CheckpointError(f"checkpoint metadata is not JSON-serialisable ({err}); "
                              "keep `extra` and the scheduler state plain") from None
    if not to_host:
        return _Snapshot(rank, world, specs, lambda name: cpu_rng if name == RNG_CPU else state.produce(name), meta)
    names = [name for name, _, _ in state.specs]
    host = dict(zip(names, state.host_tensors(names)))  # fresh host copies (RankState's contract), batched
    host[RNG_CPU] = cpu_rng
    return _Snapshot(rank, world, specs, host.__getitem__, json.loads(text),  # a copy later steps cannot change
                     sum(t.numel() * t.element_size() for t in host.values()))


def _write_rank_files(out_dir: Path, snap: _Snapshot) -> tuple[Path, dict[str, Any]]:
    """The rank's tensor and JSON files, written, fsync'd and renamed into ``out_dir``; and its report.

    Touches no device: it may run in a background thread while training goes on."""
    stem = rank_file_stem(snap.rank, snap.world)
    tensor_path = out_dir / f"{stem}.safetensors"
    tmp = out_dir / f".{stem}.safetensors.tmp"
    algorithm = default_algorithm()
    try:
        sums = write_safetensors_streaming(tmp, snap.specs, snap.produce, {"format": "pt"}, checksum=algorithm)
        tmp.replace(tensor_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    meta = {"format": FORMAT, "file_id": uuid.uuid4().hex, "tensor_file_bytes": tensor_path.stat().st_size,
            "header_sha256": SafetensorsReader(tensor_path).header_sha256(),
            "checksums": {"algorithm": algorithm, "tensors": sums}, **snap.meta}
    data = json.dumps(meta, indent=1).encode()
    write_bytes_atomic(out_dir / f"{stem}.json", data)
    fsync_dir(out_dir)  # both renames are durable before the rank reports its files
    return tensor_path, _report(meta, tensor_path.name, data)


def _report(meta: dict[str, Any], tensor_name: str, meta_bytes: bytes) -> dict[str, Any]:
    """What a rank tells rank 0 about its written files: all the completion marker needs."""
    return {"rank": int(meta["rank"]), "world_size": int(meta["world_size"]), "step": meta["step"],
            "run_id": meta["run_id"], "engine": meta.get("engine", LAYOUT_FLAT), "file": tensor_name,
            "entry": {"file_id": meta["file_id"], "bytes": meta["tensor_file_bytes"],
                      "checksums": table_digest(meta.get("checksums")),
                      "meta_sha256": hashlib.sha256(meta_bytes).hexdigest()}}


def report_from_disk(ckpt_dir: Union[str, Path], rank: int, world_size: int) -> dict[str, Any]:
    """Rank ``rank``'s report read back from its files in the staging directory (all ranks in one directory)."""
    stage = staging_dir(ckpt_dir)
    stem = rank_file_stem(rank, world_size)
    meta_path, tensor_path = stage / f"{stem}.json", stage / f"{stem}.safetensors"
    if not meta_path.is_file() or not tensor_path.is_file():
        raise CheckpointError(f"cannot commit {ckpt_dir}: rank {rank} has not written {stem}.safetensors/.json")
    data = meta_path.read_bytes()
    return _report(json.loads(data), tensor_path.name, data)


def build_marker(ckpt_dir: Union[str, Path], world_size: int, reports: list[dict[str, Any]],
                 storage: str = "shared") -> dict[str, Any]:
    """The completion marker of a save from its ranks' reports alone (rank 0 never opens another rank's files).

    A missing, duplicated or inconsistent report is refused with one line. The marker records the storage
    mode and, for per-host disks (``local``), which host holds which files."""
    by_rank: dict[int, dict[str, Any]] = {}
    for report in reports:
        if report.get("world_size") != world_size:
            raise CheckpointError(f"cannot commit {ckpt_dir}: rank {report.get('rank')} saved for a world of "
                                  f"{report.get('world_size')} ranks, not {world_size}")
        if report["rank"] in by_rank:
            raise CheckpointError(f"cannot commit {ckpt_dir}: rank {report['rank']} reported twice")
        by_rank[report["rank"]] = report
    missing = [rank for rank in range(world_size) if rank not in by_rank]
    if missing:
        raise CheckpointError(f"cannot commit {ckpt_dir}: rank(s) {missing} of {world_size} did not report their files")
    first = by_rank[0]
    for rank, report in by_rank.items():
        if report["file"] != f"{rank_file_stem(rank, world_size)}.safetensors":
            raise CheckpointError(f"cannot commit {ckpt_dir}: rank {rank} reported a file named {report['file']!r}")
        if (report["step"], report["run_id"], report["engine"]) != (first["step"], first["run_id"], first["engine"]):
            raise CheckpointError(f"cannot commit {ckpt_dir}: rank {rank} saved step {report['step']} of run "
                                  f"{report['run_id']}, rank 0 step {first['step']} of run {first['run_id']}")
    files = {by_rank[rank]["file"]: {k: v for k, v in by_rank[rank]["entry"].items() if v is not None}
             for rank in range(world_size)}
    marker = {"format": FORMAT, "engine": first["engine"], "world_size": world_size,
              "step": first["step"], "run_id": first["run_id"], "storage": storage, "files": files}
    if storage == "local":
        marker["hosts"] = [{"host": host, "files": [by_rank[r]["file"] for r in ranks]}
                           for host, ranks in host_groups(reports).items()]
    return marker


def mark_complete(ckpt_dir: Union[str, Path], world_size: int,
                  reports: Optional[list[dict[str, Any]]] = None) -> Path:
    """Rank 0 of a shared-storage save, after every rank wrote its files: the completion marker in the staging dir.

    Without ``reports`` they are read back from the staging directory (every rank's files in one directory).
    The checkpoint is then readable at :func:`staging_dir` but not yet visible under its name;
    :func:`commit_checkpoint` publishes it.
    """
    ckpt_dir = Path(ckpt_dir)
    stage = staging_dir(ckpt_dir)
    if reports is None:
        reports = [report_from_disk(ckpt_dir, rank, world_size) for rank in range(world_size)]
    marker = build_marker(ckpt_dir, world_size, reports)
    remove_stale(stage, marker)
    write_bytes_atomic(stage / COMPLETE_MARKER, marker_bytes(marker))
    return stage


def commit_checkpoint(ckpt_dir: Union[str, Path], world_size: int, *, marked: bool = False) -> Path:
    """Rank 0, after every rank wrote its files: write the completion marker and publish the directory.

    ``marked=True`` when :func:`mark_complete` already ran for this save (a marker left in the
    staging directory by a killed save is never trusted otherwise).
    """
    ckpt_dir = Path(ckpt_dir)
    stage = staging_dir(ckpt_dir)
    if not marked:
        mark_complete(ckpt_dir, world_size)
    publish(stage, ckpt_dir)
    return ckpt_dir


def save_checkpoint(
    ckpt_dir: Union[str, Path],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    *,
    step: int = 0,
    run_id: Optional[str] = None,
    plugin: Any = None,
    extra: Optional[dict[str, Any]] = None,
    barrier: Optional[Callable[[str], None]] = None,
    gather: Optional[Callable[[str, bytes], list[bytes]]] = None,
    before_commit: Optional[Callable[[Path], None]] = None,
    async_save: bool = False,
    after_commit: Optional[Callable[[Path], None]] = None,
    storage: str = "auto",
) -> Path:
    """Save the calling rank's shard and, once every rank has, publish ``ckpt_dir`` atomically.

    Call it on every rank. Each rank writes and fsyncs its files, then sends a small report (file
    name, size, id, checksum digests) through ``gather(tag, payload)``, which returns every rank's
    payload in rank order (default ``xm.rendezvous(tag, payload)`` when several processes run); rank 0
    writes the completion marker from the reports alone and publishes the directory; ``barrier(tag)``
    (default ``xm.rendezvous``) then holds every rank until it has. A rank whose write failed reports
    the failure: the save ends on every rank with the same line, and its staging directory is removed.
    A failure of rank 0's own commit (after every write succeeded) is raised on rank 0.
    ``before_commit(stage)`` runs on rank 0 once the save is marked complete in its staging directory
    and before it is published (to add side files, or a consolidated copy, atomically).

    ``async_save=True``: the call returns once the rank's state is copied to host memory; writing, fsync,
    the report and the commit run in a background thread (``before_commit`` too), while training goes on.
    The next save, :func:`~hf_xla_fsdp.checkpoint.load_checkpoint` and
    :func:`~hf_xla_fsdp.checkpoint.background.wait_for_pending_save` wait for it and raise its failure.
    With several processes, ``gather`` and ``barrier`` then run in that thread, so they must not be XLA
    collectives: the defaults are torch.distributed's over a gloo group of their own (torch.distributed
    must be initialized). ``after_commit(ckpt_dir)`` runs on the calling thread once the checkpoint is
    published: at once for a synchronous save, when it is waited for otherwise.

    ``storage`` (``"auto"``, ``"shared"``, ``"local"``, ``"object"``; see :mod:`.storage`) says where the files go
    and what commits the save: a staging directory renamed into place (shared), files in place with the marker
    written last (object: a gcsfuse mount or an fsspec URL such as ``gs://bucket/run/checkpoint-100``), or each
    host's own disk with a marker per host (local). ``ckpt_dir`` may be such a URL (then a ``str`` is returned).
    """
    from . import background

    store = open_storage(ckpt_dir, storage)  # a bad mode or a URL without its driver: one line, before any write
    ckpt_dir = str(ckpt_dir) if is_url(ckpt_dir) else local_path(ckpt_dir)  # file:// is a plain path
    background.wait_for_pending_save()  # one save in flight at most, and an earlier failure is raised here
    codec = codec_of(model)
    rank, world = codec.rank_world(model)

    def take(to_host: bool) -> _Snapshot:
        return _snapshot(model, optimizer, scheduler, step=step, run_id=run_id, plugin=plugin, extra=extra,
                         to_host=to_host)

    if not async_save:
        meet = codec.collectives()
        _write_and_commit(store, rank, world, lambda: take(False), Collectives(barrier or meet.barrier,
                                                                              gather or meet.gather), before_commit)
        if after_commit is not None:
            after_commit(ckpt_dir)
        return ckpt_dir
    if world > 1 and (gather is None or barrier is None):
        safe = codec.collectives(thread_safe=True)
        if safe is None:
            raise CheckpointError(f"async_save with {world} processes needs torch.distributed for its background "
                                  "commit (XLA collectives must stay on the training thread): call torch.distributed."
                                  "init_process_group('gloo', init_method='xla://') before training, or save "
                                  "synchronously")
        barrier, gather = barrier or safe.barrier, gather or safe.gather
    meet = Collectives(barrier or (lambda tag: None), gather or (lambda tag, payload: [payload]))
    try:
        snap = take(True)
        snapshot: Callable[[], _Snapshot] = lambda: snap  # noqa: E731
    except Exception as err:
        if world == 1:
            raise
        snapshot = functools.partial(_reraise, err)  # the other ranks hear of it through the report, as for a write
    background.start(ckpt_dir, lambda: _write_and_commit(store, rank, world, snapshot, meet, before_commit), after_commit)
    return ckpt_dir


def _reraise(err: BaseException) -> _Snapshot:
    raise err


def _write_and_commit(store: Storage, rank: int, world: int, snapshot: Callable[[], _Snapshot], meet: Collectives,
                      before_commit: Optional[Callable[[Path], None]]) -> None:
    """The rank's files, the reports gathered to rank 0, its marker and publication, and the final barrier.

    One protocol for every storage mode; ``store`` says where files go, what commits them and what else the
    ranks do around the commit (its hooks)."""
    shown = store.display
    failure: Optional[BaseException] = None
    try:
        try:
            store.begin()
            tensor_path, report = _write_rank_files(store.write_dir(), snapshot())
            store.written([tensor_path, tensor_path.with_suffix(".json")])
        except Exception as err:  # the others hear about it: nobody waits for files that will not come
            failure, report = err, {"rank": rank, "world_size": world, "error": first_line(err)}
        report.update(host=host_id(), storage=store.mode)
        payloads = together(shown, "did not complete (ranks lost while reporting their files)",
                             lambda: meet.gather("hf_xla_fsdp.save.reports", json.dumps(report).encode()))
        reports = [json.loads(p) for p in payloads]
        rnd = SaveRound(rank, world, host_id(), reports, meet.gather,
                        marker=lambda: build_marker(shown, world, reports, store.mode))
        owner = store.owns(rnd)  # who cleans up after a failure (and, on per-host disks, writes a host marker)
        failed = sorted((r for r in reports if "error" in r), key=lambda r: r["rank"])
        if failed:
            if owner:  # every rank has stopped writing into it
                store.abort()
            if failure is not None and not isinstance(failure, (OSError, CheckpointError)):
                raise failure  # not a storage problem: the full traceback is what helps
            raise CheckpointError(f"the save of {shown} failed on rank {failed[0]['rank']}: {failed[0]['error']} "
                                  "(nothing was published; earlier checkpoints are untouched)")
        modes = {r["storage"] for r in reports}
        if len(modes) > 1:  # e.g. "auto" saw a gcsfuse mount on one host and a plain disk on another
            if owner:
                store.abort()
            odd = ", ".join(f"rank {r['rank']}: {r['storage']}" for r in reports if r["storage"] != reports[0]["storage"])
            raise CheckpointError(f"the save of {shown} mixes storage modes across ranks ({odd}; rank 0: "
                                  f"{reports[0]['storage']}): set checkpoint_storage explicitly")
        store.prepare_commit(rnd)
        committed = False
        try:
            if rank == 0:
                try:
                    store.check_reports(reports)
                    store.commit(rnd.marker(), before_commit)
                except (OSError, CheckpointError) as err:  # e.g. no space for the marker: nothing half-published
                    store.abort()  # gone already if it was published
                    raise CheckpointError(f"the save of {shown} failed on rank 0: {first_line(err)} "
                                          "(nothing was published; earlier checkpoints are untouched)") from None
            committed = True
        finally:  # the other ranks are released even if the commit failed (rank 0 raises it)
            store.finish_commit(rnd, committed=committed)
            together(shown, "lost ranks after every rank had written (its completion marker, if any, is the truth)",
                      lambda: meet.barrier("hf_xla_fsdp.save.committed"))
    finally:
        store.close()
