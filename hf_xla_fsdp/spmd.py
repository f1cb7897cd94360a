"""FSDP v2: ``SpmdFullyShardedDataParallel`` over a device mesh, in one process (SPMD).

Under SPMD one Python process drives every local device; a parameter is one logical tensor whose
largest dimension is split over the mesh's ``fsdp`` axis (and replicated over the optional
``replica`` axis for hybrid sharding). This module makes the mesh, wraps blocks and the root,
shards batches, and saves / restores / describes v2 checkpoints, which use the same rank-file
layout as v1 (one ``rank-*.safetensors`` + ``.json`` per process) with, for every tensor, the
slice each local device holds and where it sits in the full tensor.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import torch
from torch import nn

from .plugin import ConfigError, XlaFsdpPlugin

FSDP_AXIS = "fsdp"
REPLICA_AXIS = "replica"
WRAPPER_PREFIX = "_orig_module."


def enable_spmd() -> None:
    """Switch this process to SPMD (idempotent); it must happen before any XLA tensor exists."""
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return
    try:
        xr.use_spmd()
    except Exception as err:  # torch_xla refuses once replicated tensors exist
        raise ConfigError(f"FSDP v2 needs SPMD mode before any XLA tensor is created ({err}); build the "
                          "plugin / trainer / accelerator before touching the XLA device") from None


def spmd_class() -> type:
    """``SpmdFullyShardedDataParallel`` (imported lazily)."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    return SpmdFullyShardedDataParallel


def get_mesh(plugin: XlaFsdpPlugin) -> Any:
    """The ``(replica, fsdp)`` mesh over every device, made once per process and set as the global mesh."""
    import numpy as np
    import torch_xla.distributed.spmd as xs
    import torch_xla.runtime as xr

    enable_spmd()
    devices = xr.global_runtime_device_count()
    replicas = plugin.replica_size
    if devices % replicas:
        raise ConfigError(f"replica_size={replicas} does not divide the {devices} devices")
    shape = (replicas, devices // replicas)
    mesh = xs.get_global_mesh()
    if mesh is None or tuple(mesh.mesh_shape) != shape or tuple(mesh.axis_names) != (REPLICA_AXIS, FSDP_AXIS):
        mesh = xs.Mesh(np.arange(devices), shape, (REPLICA_AXIS, FSDP_AXIS))
        xs.set_global_mesh(mesh)
    return mesh


BATCH_AXES = (REPLICA_AXIS, FSDP_AXIS)  # the batch is split over every device


def input_sharding(mesh: Any) -> Any:
    """``ShardingSpec`` that splits dim 0 of every batch tensor over all devices (for ``MpDeviceLoader``)."""
    import torch_xla.distributed.spmd as xs

    return xs.ShardingSpec(mesh, (BATCH_AXES, None))


def shard_loader_inputs(loader: Any, mesh: Any) -> Any:
    """Make an XLA device loader (``MpDeviceLoader``, accelerate's wrapper) split every batch over all devices."""
    if not hasattr(loader, "_parallel_loader_kwargs"):
        raise ConfigError(f"FSDP v2 needs an XLA device loader to split batches over the devices, got {type(loader).__name__}")
    loader._parallel_loader_kwargs["input_sharding"] = input_sharding(mesh)
    return loader


def shard_batch(batch: dict[str, torch.Tensor], mesh: Any) -> dict[str, torch.Tensor]:
    """Mark dim 0 of every XLA tensor of ``batch`` as split over all devices."""
    import torch_xla.distributed.spmd as xs

    for tensor in batch.values():
        if isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
            xs.mark_sharding(tensor, mesh, (BATCH_AXES,) + (None,) * (tensor.dim() - 1))
    return batch


def shard_output(output: Any, mesh: Any) -> None:
    """Split the batch dimension of a block's or model's main output (logits, hidden states) over all devices."""
    import torch_xla.distributed.spmd as xs

    real = getattr(output, "logits", None)
    if real is None:
        real = getattr(output, "last_hidden_state", None)
    if real is None and isinstance(output, (tuple, list)):
        real = next((t for t in output if isinstance(t, torch.Tensor) and t.dim() > 0), None)
    if real is None and isinstance(output, torch.Tensor):
        real = output
    if isinstance(real, torch.Tensor) and real.dim() > 0:
        xs.mark_sharding(real, mesh, (BATCH_AXES,) + (None,) * (real.dim() - 1))


def wrap_block(block: nn.Module, plugin: XlaFsdpPlugin, nested: bool) -> nn.Module:
    """Activation-checkpoint ``block`` if asked and make it an FSDP v2 unit when ``nested``."""
    if plugin.activation_checkpointing:
        from torch_xla.distributed.fsdp import checkpoint_module

        block = checkpoint_module(block)
    if nested:
        block = spmd_class()(block, mesh=get_mesh(plugin), shard_output=shard_output)
    return block


def wrap_root(model: nn.Module, plugin: XlaFsdpPlugin) -> nn.Module:
    """The outer FSDP v2 unit: shards every parameter no inner unit owns, keeping tied weights tied."""
    import torch_xla

    if getattr(getattr(model, "config", None), "use_cache", False) and plugin.activation_checkpointing:
        model.config.use_cache = False
    # FSDPv2 moves the module with .to(), which makes new Parameters and unties lm_head from the
    # embeddings; move and re-tie first, so the tie survives (and is sharded once)
    model.to(torch_xla.device())
    if hasattr(model, "tie_weights"):
        model.tie_weights()
    return spmd_class()(model, mesh=get_mesh(plugin), shard_output=shard_output)


def clean_name(name: str) -> str:
    """The user's name of a parameter inside FSDP v2 wrappers."""
    return name.replace(WRAPPER_PREFIX, "")


def sharding_spec(tensor: torch.Tensor) -> str:
    """XLA's sharding annotation of ``tensor`` (``""`` when it has none)."""
    import torch_xla

    return torch_xla._XLAC._get_xla_sharding_spec(tensor)


def device_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of parameters each device holds (shards counted where they live, padding excluded)."""
    import torch_xla

    out: dict[str, int] = {}
    for p in model.parameters():
        devices = [device for _, device in torch_xla._XLAC._get_local_shards([p])[0]]
        for device, (_, index) in zip(devices, torch_xla._XLAC._get_local_shard_replica_and_indices([p])[0]):
            shape = p.shape if index is Ellipsis else [s.stop - s.start for s in index]
            out[device] = out.get(device, 0) + math.prod(shape) * p.element_size()
    return dict(sorted(out.items()))


# --------------------------------------------------------------------------- checkpoint pieces
def _replica0_placements(tensor: torch.Tensor) -> list[tuple[int, list[int], list[int]]]:
    """``(shard position, start, stop)`` of each distinct slice held on this process's devices (replica 0 only).

    Reads only placement metadata: nothing is transferred.
    """
    import torch_xla

    out: list[tuple[int, list[int], list[int]]] = []
    for position, (replica, index) in enumerate(torch_xla._XLAC._get_local_shard_replica_and_indices([tensor])[0]):
        if index is Ellipsis:
            start, stop = [0] * tensor.dim(), list(tensor.shape)
        else:
            start, stop = [s.start for s in index], [s.stop for s in index]
        if replica == 0 and all((start, stop) != (a, b) for _, a, b in out):
            out.append((position, start, stop))
    return out


def local_pieces(tensor: torch.Tensor) -> list[tuple[list[int], list[int]]]:
    """``(start, stop)`` per dimension of each distinct slice this process's devices hold (replica 0 only)."""
    if tensor.device.type != "xla":
        return [([0] * tensor.dim(), list(tensor.shape))]
    return [(start, stop) for _, start, stop in _replica0_placements(tensor)]


def fetch_pieces(tensor: torch.Tensor) -> list[torch.Tensor]:
    """The host copies of :func:`local_pieces`, in the same order (one tensor's shards at a time)."""
    import torch_xla

    if tensor.device.type != "xla":
        return [tensor.detach()]
    shards = torch_xla._XLAC._get_local_shards([tensor])[0]
    # shards of uneven splits are padded: keep only the slice's own rows/columns
    return [shards[position][0][tuple(slice(0, b - a) for a, b in zip(start, stop))].contiguous()
            for position, start, stop in _replica0_placements(tensor)]


@functools.lru_cache(maxsize=1)
def _dtype_names() -> dict[str, torch.dtype]:
    return {str(d).removeprefix("torch."): d for d in (torch.float32, torch.bfloat16, torch.float16, torch.float64,
                                                       torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}


def dtype_from_name(name: str) -> torch.dtype:
    """``"float32"`` -> ``torch.float32``."""
    return _dtype_names()[name]


def assemble(entry: dict[str, Any], read: Any) -> torch.Tensor:
    """The full tensor described by a saved ``entry`` (shape, dtype, pieces), each piece read with ``read(key)``."""
    full = torch.empty(entry["shape"], dtype=dtype_from_name(entry["dtype"]))
    covered = 0
    for piece in entry["pieces"]:
        region = tuple(slice(a, b) for a, b in zip(piece["start"], piece["stop"]))
        full[region] = read(piece["key"])
        covered += math.prod(b - a for a, b in zip(piece["start"], piece["stop"]))
    if covered != full.numel():
        raise ConfigError(f"the saved pieces of a {list(full.shape)} tensor cover {covered} of {full.numel()} elements")
    return full
