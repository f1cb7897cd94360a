"""Sharded rank checkpoints for saving and exact resuming (FSDP v1).

Each rank writes its own ``rank-RRRRR-of-WWWWW.safetensors`` (model shard, optimizer state, CPU RNG)
and ``.json`` (shard metadata, optimizer groups, scheduler, RNG, step, model config, plugin, extras)
into a hidden staging directory; when every rank is done, rank 0 writes ``checkpoint_complete.json``
and renames the staging directory into place. A directory without the marker is never loaded.
Resuming reads only the calling rank's file, or, when the world size changed, only the rows of
each saved shard that the new shard covers.
"""

from __future__ import annotations

import json
import random
import uuid
from pathlib import Path
from typing import Any, Callable, Optional, Union

import torch
from torch import nn

from .atomic import publish, write_bytes_atomic
from .rank_files import (
    COMPLETE_MARKER, FORMAT, MODEL_PREFIX, OPTIM_PREFIX, CheckpointError, RankFile, SafetensorsRankFile,
    _structure, encode_shard_metadata, gather_rows, open_checkpoint, rank_file_stem, read_marker,
    write_safetensors_streaming,
)

RNG_CPU = "rng/torch_cpu"


def staging_dir(ckpt_dir: Path) -> Path:
    """Where ranks write before the checkpoint is complete (same name on every rank, no coordination)."""
    return ckpt_dir.parent / f".{ckpt_dir.name}.partial"


def rank_world(model: nn.Module) -> tuple[int, int]:
    """``(rank, world size)`` in rank files: FSDP v1 ranks, or SPMD processes for FSDP v2."""
    from .wrapping import is_v2

    if is_v2(model):  # SPMD: one file per process, each holding its devices' slices
        import torch_xla.runtime as xr

        return xr.process_index(), xr.process_count()
    md = model.get_shard_metadata()
    return int(md["rank"]), int(md["world_size"])


def _multi_process() -> bool:
    import torch_xla.runtime as xr

    return xr.world_size() > 1


def _default_barrier(tag: str) -> None:
    if _multi_process():
        import torch_xla.core.xla_model as xm

        xm.rendezvous(tag)


def _param_names(model: nn.Module, optimizer: torch.optim.Optimizer) -> list[list[str]]:
    from .spmd import clean_name

    names = {id(p): clean_name(n) for n, p in model.named_parameters()}
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise CheckpointError("the optimizer holds parameters that are not the FSDP model's; "
                              "create the optimizer after wrapping, from model.parameters()") from None


def _rng_meta() -> dict[str, Any]:
    import numpy as np
    import torch_xla.core.xla_model as xm

    np_state = np.random.get_state()
    return {
        "python": [random.getstate()[0], list(random.getstate()[1]), random.getstate()[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "xla": int(xm.get_rng_state()),
    }


def _restore_rng(meta: dict[str, Any], cpu_state: Optional[torch.Tensor]) -> None:
    import numpy as np
    import torch_xla.core.xla_model as xm

    rng = meta.get("rng") or {}
    if "python" in rng:
        v, state, gauss = rng["python"]
        random.setstate((v, tuple(state), gauss))
    if "numpy" in rng:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if "xla" in rng:
        xm.set_rng_state(rng["xla"])
    if cpu_state is not None:
        torch.set_rng_state(cpu_state)


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
    from .train import sync
    from .wrapping import is_v2, unwrap

    ckpt_dir = Path(ckpt_dir)
    rank, world = rank_world(model)
    stage = staging_dir(ckpt_dir)
    stage.mkdir(parents=True, exist_ok=True)
    sync()  # pending updates land before reading values
    if is_v2(model):
        import torch_xla.core.xla_model as xm

        xm.wait_device_ops()  # shard placements can only be read once no computation is in flight
        specs, produce, engine_meta = _spmd_tensors(model, optimizer)
    else:
        specs, produce, engine_meta = _v1_tensors(model, optimizer)
    inner = unwrap(model)
    config = getattr(inner, "config", None)
    config_dict = None
    if config is not None:
        config_dict = config.to_dict()
        config_dict["architectures"] = [type(inner).__name__]
    stem = rank_file_stem(rank, world)
    tensor_path = stage / f"{stem}.safetensors"
    tmp = stage / f".{stem}.safetensors.tmp"
    write_safetensors_streaming(tmp, specs, produce, {"format": "pt"})
    tmp.replace(tensor_path)
    meta = {
        "format": FORMAT, "file_id": uuid.uuid4().hex, "tensor_file_bytes": tensor_path.stat().st_size,
        "rank": rank, "world_size": world, "run_id": run_id, "step": int(step), **engine_meta,
        "scheduler": scheduler.state_dict() if scheduler is not None else None,
        "rng": _rng_meta(), "model_config": config_dict,
        "plugin": plugin.to_dict() if plugin is not None else None,
        "extra": extra or {},
    }
    try:
        data = json.dumps(meta, indent=1).encode()
    except TypeError as err:
        raise CheckpointError(f"checkpoint metadata is not JSON-serialisable ({err}); keep `extra` and the scheduler state plain") from None
    write_bytes_atomic(stage / f"{stem}.json", data)
    return tensor_path


def _optimizer_meta(model: nn.Module, optimizer: torch.optim.Optimizer) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Optimizer groups, non-tensor state and parameter names, and its tensor state keyed ``optim/IDX/NAME``."""
    state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for idx, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM_PREFIX}{idx}/{name}"] = value
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return ({"param_groups": state["param_groups"], "scalar_state": scalars,
             "param_names": _param_names(model, optimizer)}, tensors)


def _v1_tensors(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[list, Callable, dict[str, Any]]:
    """FSDP v1: the rank's state dict (flat shards) and optimizer state, one tensor at a time from the device."""
    tensors: dict[str, torch.Tensor] = {MODEL_PREFIX + k: v for k, v in model.state_dict().items()}
    optim_meta = None
    if optimizer is not None:
        optim_meta, optim_tensors = _optimizer_meta(model, optimizer)
        tensors.update(optim_tensors)
    tensors[RNG_CPU] = torch.get_rng_state()
    specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
    return specs, (lambda name: tensors[name].detach().cpu()), {
        "shard_metadata": encode_shard_metadata(model.get_shard_metadata()), "optimizer": optim_meta}


def _spmd_tensors(model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> tuple[list, Callable, dict[str, Any]]:
    """FSDP v2: for every tensor, the slices this process's devices hold (replica 0), with their offsets."""
    import torch_xla.runtime as xr

    from .spmd import clean_name, fetch_pieces, local_pieces

    seen: set[int] = set()
    named: dict[str, torch.Tensor] = {}
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:  # a tied weight is stored once, under its first name (as v1 does)
            seen.add(id(t))
            named[MODEL_PREFIX + clean_name(name)] = t.detach()
    optim_meta = None
    if optimizer is not None:
        optim_meta, optim_tensors = _optimizer_meta(model, optimizer)
        named.update(optim_tensors)
    entries: dict[str, dict[str, Any]] = {}
    specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
    owner: dict[str, tuple[str, int]] = {}
    for name, t in named.items():
        pieces = []
        for k, (start, stop) in enumerate(local_pieces(t)):
            key = f"{name}#{k}"
            pieces.append({"key": key, "start": start, "stop": stop})
            specs.append((key, tuple(b - a for a, b in zip(start, stop)), t.dtype))
            owner[key] = (name, k)
        entries[name] = {"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch."), "pieces": pieces}
    specs.append((RNG_CPU, tuple(torch.get_rng_state().shape), torch.uint8))
    cache: dict[str, list[torch.Tensor]] = {}

    def produce(key: str) -> torch.Tensor:
        if key == RNG_CPU:
            return torch.get_rng_state()
        name, k = owner[key]
        if name not in cache:  # one tensor's slices on the host at a time
            cache.clear()
            cache[name] = fetch_pieces(named[name])
        return cache[name][k]

    return specs, produce, {"engine": "spmd", "devices": xr.global_runtime_device_count(), "tensors": entries,
                            "optimizer": optim_meta}


def mark_complete(ckpt_dir: Union[str, Path], world_size: int) -> Path:
    """Rank 0, after every rank wrote its files: write the completion marker into the staging directory.

    The checkpoint is then readable at :func:`staging_dir` (e.g. to consolidate it in place) but not
    yet visible under its name; :func:`commit_checkpoint` publishes it.
    """
    ckpt_dir = Path(ckpt_dir)
    stage = staging_dir(ckpt_dir)
    files, first = {}, None
    for rank in range(world_size):
        stem = rank_file_stem(rank, world_size)
        meta_path, tensor_path = stage / f"{stem}.json", stage / f"{stem}.safetensors"
        if not meta_path.is_file() or not tensor_path.is_file():
            raise CheckpointError(f"cannot commit {ckpt_dir}: rank {rank} has not written {stem}.safetensors/.json")
        meta = json.loads(meta_path.read_text())
        first = first or meta
        files[tensor_path.name] = {"file_id": meta["file_id"], "bytes": meta["tensor_file_bytes"]}
    rank_files = set(files) | {f"{Path(n).stem}.json" for n in files}
    for stray in stage.iterdir():  # leftovers of an earlier save that was killed (e.g. another world size)
        if stray.is_file() and stray.name.startswith("rank-") and stray.name not in rank_files:
            stray.unlink()
    marker = {"format": FORMAT, "engine": first.get("engine", "xla_fsdp_v1"), "world_size": world_size,
              "step": first["step"], "run_id": first["run_id"], "files": files}
    write_bytes_atomic(stage / COMPLETE_MARKER, json.dumps(marker, indent=1).encode())
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
) -> Path:
    """Save the calling rank's shard and, once every rank has, publish ``ckpt_dir`` atomically.

    Call it on every rank. ``barrier`` defaults to ``xm.rendezvous`` when several processes run.
    """
    barrier = barrier or _default_barrier
    write_rank_file(ckpt_dir, model, optimizer, scheduler, step=step, run_id=run_id, plugin=plugin, extra=extra)
    barrier("hf_xla_fsdp.save.written")
    rank, world = rank_world(model)
    if rank == 0:
        commit_checkpoint(ckpt_dir, world)
    barrier("hf_xla_fsdp.save.committed")
    return Path(ckpt_dir)


# --------------------------------------------------------------------------- loading
def _same_layout(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """Same parameters and flattening, whatever the world size."""
    def names(md: dict[str, Any]) -> Any:
        return ({m: {n: i["_orig_name"] for n, i in p.items()} for m, p in md["shard_info"].items()},
                {n: tuple(v[0]) for n, v in md["flatten_info"].items()})
    return names(a) == names(b)


def _saved_engine(ckpt_dir: Path, marker: dict[str, Any]) -> str:
    """``"spmd"`` or ``"xla_fsdp_v1"``, from the marker or else the first rank file's JSON (no tensor file opened)."""
    if "engine" in marker:
        return marker["engine"]
    first = ckpt_dir / Path(sorted(marker["files"])[0]).with_suffix(".json").name
    try:
        return json.loads(first.read_text()).get("engine", "xla_fsdp_v1")
    except (OSError, json.JSONDecodeError, UnicodeDecodeError):
        return "xla_fsdp_v1"  # the v1 reader reports the damage precisely


def _read_listed(ckpt_dir: Path, marker: dict[str, Any], name: str) -> RankFile:
    f = SafetensorsRankFile(ckpt_dir / name)
    if f.meta.get("file_id") != marker["files"][name]["file_id"]:
        raise CheckpointError(f"{name} does not belong to this checkpoint: it was written by a different save or run")
    return f


def _read_own(ckpt_dir: Path, marker: dict[str, Any], rank: int, world: int) -> RankFile:
    name = f"{rank_file_stem(rank, world)}.safetensors"
    if name not in marker["files"]:
        raise CheckpointError(f"{ckpt_dir / COMPLETE_MARKER} does not list {name}")
    f = SafetensorsRankFile(ckpt_dir / name)
    if f.meta.get("file_id") != marker["files"][name]["file_id"]:
        raise CheckpointError(f"{name} does not belong to this checkpoint: it was written by a different save or run")
    return f


def load_checkpoint(
    ckpt_dir: Union[str, Path],
    model: nn.Module,
    optimizer: Optional[torch.optim.Optimizer] = None,
    scheduler: Any = None,
    *,
    restore_rng: bool = True,
) -> dict[str, Any]:
    """Restore the calling rank's model shard, optimizer, scheduler and RNG from ``ckpt_dir``.

    A checkpoint saved with another world size is resharded on the fly: each saved file is read
    only for the rows this rank's shards cover. Returns ``step``, ``extra``, ``run_id``, ``saved_world_size``.
    """
    from .wrapping import is_v2

    ckpt_dir = Path(ckpt_dir)
    marker = read_marker(ckpt_dir)
    saved_world = int(marker["world_size"])
    saved_v2 = _saved_engine(ckpt_dir, marker) == "spmd"
    if saved_v2 != is_v2(model):
        engines = ("FSDP v2 (SPMD)", "FSDP v1") if saved_v2 else ("FSDP v1", "FSDP v2 (SPMD)")
        raise CheckpointError(f"{ckpt_dir} was saved by {engines[0]} and cannot be resumed into an {engines[1]} model; "
                              "consolidate it (hf-xla-fsdp consolidate) and build the model from that directory")
    if saved_v2:
        files = [_read_listed(ckpt_dir, marker, name) for name in sorted(marker["files"])]
        return _load_spmd(ckpt_dir, files, model, optimizer, scheduler, restore_rng)
    rank, world = rank_world(model)
    current = model.get_shard_metadata()
    if saved_world == world:
        own = _read_own(ckpt_dir, marker, rank, world)
        if _structure(own.shard_metadata) != _structure(current):
            raise CheckpointError(f"{ckpt_dir} was saved from a different model or different FSDP settings "
                                  "(shard layout differs); it cannot be loaded into this model")
        files, first = None, own
    else:
        ranks = open_checkpoint(ckpt_dir)
        if not _same_layout(ranks.shard_metadata, current):
            raise CheckpointError(f"{ckpt_dir} was saved from a different model or different FSDP settings "
                                  "(parameters or flattening differ); it cannot be resharded into this model")
        files, first = ranks.files, ranks.files[0]

    def read(name: str, like: torch.Tensor) -> torch.Tensor:
        if files is None:
            return first.get(name)
        is_buffer = name.startswith(MODEL_PREFIX) and "_fsdp_shard" not in name
        if like.dim() == 0 or is_buffer:
            return first.get(name)  # buffers and scalars are replicated
        rows = like.shape[0]
        return gather_rows(files, name, rank * rows, (rank + 1) * rows).view(like.shape)

    model_state = {k: read(MODEL_PREFIX + k, v) for k, v in model.state_dict().items()}
    model.load_state_dict(model_state)
    meta = first.meta
    if optimizer is not None:
        _load_optimizer(optimizer, model, meta, read, first)
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if restore_rng:
        _restore_rng(meta, first.get(RNG_CPU) if RNG_CPU in first.names() else None)
    return {"step": meta.get("step", 0), "extra": meta.get("extra", {}), "run_id": meta.get("run_id"),
            "saved_world_size": saved_world}


def spmd_entries(files: list[RankFile], section: str = "tensors") -> dict[str, dict[str, Any]]:
    """Every tensor of an FSDP v2 checkpoint with the pieces of all files (each piece knows its file)."""
    merged: dict[str, dict[str, Any]] = {}
    for f in files:
        saved = f.meta.get(section) or {}
        for name, entry in saved.items():
            target = merged.setdefault(name, {"shape": entry["shape"], "dtype": entry["dtype"], "pieces": []})
            if target["shape"] != entry["shape"]:
                raise CheckpointError(f"{f.path.name} and another rank file disagree on the shape of {name}")
            target["pieces"].extend({**piece, "file": f} for piece in entry["pieces"])
    return merged


def read_spmd_tensor(entry: dict[str, Any]) -> torch.Tensor:
    """The full tensor of a merged v2 entry, assembled on the host from its pieces."""
    from .spmd import assemble

    by_key = {p["key"]: p["file"] for p in entry["pieces"]}
    return assemble(entry, lambda key: by_key[key].get(key))


def _load_spmd(ckpt_dir: Path, files: list[RankFile], model: nn.Module, optimizer: Optional[torch.optim.Optimizer],
               scheduler: Any, restore_rng: bool) -> dict[str, Any]:
    """FSDP v2: each tensor is assembled on the host, one at a time, and copied into its sharded parameter.

    Works for any saved device count: the pieces carry their offsets in the full tensor.
    """
    import torch_xla

    from .spmd import clean_name, sharding_spec

    entries = spmd_entries(files)
    seen: set[int] = set()
    wanted: list[tuple[str, torch.Tensor]] = []
    for name, t in model.state_dict(keep_vars=True).items():
        if id(t) not in seen:
            seen.add(id(t))
            wanted.append((MODEL_PREFIX + clean_name(name), t))
    missing = [n for n, _ in wanted if n not in entries]
    saved_model = {n for n in entries if n.startswith(MODEL_PREFIX)}
    if missing or len(wanted) != len(saved_model):
        extra = sorted(saved_model - {n for n, _ in wanted})
        raise CheckpointError(f"{ckpt_dir} was saved from a different model: missing {missing[:3]}, unexpected {extra[:3]}")
    with torch.no_grad():
        for name, t in wanted:
            full = read_spmd_tensor(entries[name])
            if tuple(full.shape) != tuple(t.shape):
                raise CheckpointError(f"{name} is {list(full.shape)} in {ckpt_dir} but {list(t.shape)} in the model")
            t.copy_(full)  # keeps the tensor's sharding: each device receives its slice
    meta = files[0].meta
    if optimizer is not None:
        saved = meta.get("optimizer")
        if not saved:
            raise CheckpointError("the checkpoint has no optimizer state; load it without an optimizer")
        if saved["param_names"] != _param_names(model, optimizer):
            raise CheckpointError("the optimizer's parameters (or their groups) differ from the checkpoint's")
        state: dict[int, dict[str, Any]] = {}
        for name, entry in entries.items():
            if name.startswith(OPTIM_PREFIX):
                idx, key = name[len(OPTIM_PREFIX):].split("/", 1)
                state.setdefault(int(idx), {})[key] = read_spmd_tensor(entry)
        for idx, scalars in (saved.get("scalar_state") or {}).items():
            state.setdefault(int(idx), {}).update(scalars)
        _load_optimizer_state(optimizer, saved, state)
        for param, values in optimizer.state.items():  # each state tensor gets its parameter's sharding
            if not sharding_spec(param):
                continue
            for value in values.values():
                if isinstance(value, torch.Tensor) and value.device.type == "xla" and value.shape == param.shape:
                    torch_xla._XLAC._xla_mark_sharding(value, torch_xla._XLAC._get_xla_op_sharding(param))
    if scheduler is not None and meta.get("scheduler") is not None:
        scheduler.load_state_dict(meta["scheduler"])
    if restore_rng:
        rank, _ = rank_world(model)
        own = files[rank % len(files)]
        _restore_rng(own.meta, own.get(RNG_CPU) if RNG_CPU in own.names() else None)
    return {"step": meta.get("step", 0), "extra": meta.get("extra", {}), "run_id": meta.get("run_id"),
            "saved_world_size": len(files), "saved_devices": meta.get("devices")}


def _load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], state: dict[int, dict[str, Any]]) -> None:
    """``optimizer.load_state_dict`` from the saved groups (JSON lists turned back into tuples) and ``state``."""
    groups = []
    for group, current in zip(saved["param_groups"], optimizer.param_groups):
        group = dict(group)
        for key, value in current.items():  # JSON turned tuples (e.g. betas) into lists
            if isinstance(value, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def restore_rng_state(ckpt_dir: Union[str, Path], model: nn.Module) -> None:
    """Restore the Python, NumPy, torch CPU and XLA RNG states the calling rank saved in ``ckpt_dir``.

    After a world-size change rank r takes the state of saved rank ``r % saved_world_size``.
    """
    ckpt_dir = Path(ckpt_dir)
    marker = read_marker(ckpt_dir)
    saved_world = int(marker["world_size"])
    rank, _ = rank_world(model)
    own = _read_own(ckpt_dir, marker, rank % saved_world, saved_world)
    _restore_rng(own.meta, own.get(RNG_CPU) if RNG_CPU in own.names() else None)


def _load_optimizer(optimizer: torch.optim.Optimizer, model: nn.Module, meta: dict[str, Any],
                    read: Callable[[str, torch.Tensor], torch.Tensor], first: RankFile) -> None:
    saved = meta.get("optimizer")
    if not saved:
        raise CheckpointError("the checkpoint has no optimizer state; load it without an optimizer")
    names_now = _param_names(model, optimizer)
    if saved["param_names"] != names_now:
        raise CheckpointError("the optimizer's parameters (or their groups) differ from the checkpoint's")
    params = dict(model.named_parameters())
    flat_names = [n for group in names_now for n in group]
    by_idx: dict[int, dict[str, Any]] = {}
    for name in first.names():
        if name.startswith(OPTIM_PREFIX):
            idx, key = name[len(OPTIM_PREFIX):].split("/", 1)
            param = params[flat_names[int(idx)]]
            like = param if first.shape(name) else torch.empty(())  # 0-d state (e.g. step) is replicated
            by_idx.setdefault(int(idx), {})[key] = read(name, like)
    for idx, scalars in (saved.get("scalar_state") or {}).items():
        by_idx.setdefault(int(idx), {}).update(scalars)
    _load_optimizer_state(optimizer, saved, by_idx)
