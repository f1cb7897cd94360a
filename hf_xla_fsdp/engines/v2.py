"""FSDP v2: ``SpmdFullyShardedDataParallel`` over a device mesh, in one process (SPMD).

Under SPMD one Python process drives every local device; a parameter is one logical tensor whose
largest dimension is split over the mesh's ``fsdp`` axis (and replicated over the optional
``replica`` axis for hybrid sharding). This engine makes the mesh, wraps blocks and the root,
shards batches, and saves / restores rank files in the pieces layout: one file per process with,
for every tensor, the slice each local device holds and where it sits in the full tensor.
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from ..checkpoint.codec import RankState, Restored
from ..checkpoint.layout import MODEL_PREFIX
from ..checkpoint.readers import LAYOUT_PIECES, RankFile, merge_pieces, open_listed, read_pieces
from ..checkpoint.safetensors_io import dtype_name
from ..checkpoint.state import load_optimizer_state, optimizer_meta, optimizer_tensor_key, saved_optimizer
from ..errors import CheckpointError, ConfigError
from ..runtime import device_count, process_count, process_index, wait_device_ops
from .base import NO_FLOAT16, EngineSettings, host_copy
from .master_weights import _same_sharding, attach, cast_parameters, master_weights
from .xla import XLA_COMPILES, XlaEngine

FSDP_AXIS = "fsdp"
TENSOR_AXIS = "tensor"
REPLICA_AXIS = "replica"
BATCH_AXES = (REPLICA_AXIS, FSDP_AXIS)  # the batch is split over every device
WRAPPER_PREFIX = "_orig_module."


#: the one line a script needs when the XLA device was used before SPMD could start
SPMD_TOO_LATE = ("FSDP v2 needs SPMD before the XLA device is first used, but {what} already used it: add "
                 "`import hf_xla_fsdp; hf_xla_fsdp.enable_spmd()` at the top of the script, before TrainingArguments, "
                 "Accelerator or any XLA tensor")


def spmd_too_late() -> bool:
    """True when this process used the XLA device in replica mode, so SPMD can no longer start cleanly.

    ``torch_xla.device()`` (accelerate's ``PartialState``, built by ``TrainingArguments``), an XLA tensor
    or ``xm.set_rng_state`` lock the runtime's SPMD setting. ``xr.use_spmd()`` would still force SPMD
    then, but torch_xla 2.9 later crashes (SIGSEGV in ``PjRtComputationClient::ExecuteReplicated``,
    pytorch/xla#9735), so it must not be called.
    """
    import torch_xla
    import torch_xla.runtime as xr

    from .. import upstream

    upstream.require("engine_v2")  # every process of this engine asks here first; the _XLAC calls below and beyond
    if xr.is_spmd():
        return False
    locked = getattr(torch_xla._XLAC, "_xla_get_spmd_config_is_locked", None)
    return bool(locked is not None and locked())


def enable_spmd(what: str = "this process") -> None:
    """Switch this process to SPMD (idempotent); it must happen before the XLA device is first used."""
    import torch_xla.runtime as xr

    if xr.is_spmd():
        return
    if spmd_too_late():  # never force it: a forced switch segfaults later instead of failing here
        raise ConfigError(SPMD_TOO_LATE.format(what=what))
    xr.use_spmd()


def spmd_class() -> type:
    """``SpmdFullyShardedDataParallel`` (imported lazily)."""
    from torch_xla.experimental.spmd_fully_sharded_data_parallel import SpmdFullyShardedDataParallel

    from .. import upstream

    upstream.require("engine_v2")  # wrapping: the sharding reads and writes of torch_xla._XLAC it relies on
    return SpmdFullyShardedDataParallel


def mesh_layout(devices: int, replicas: int, tensor: int = 1, noun: str = "devices",
                ) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Shape and axis names of the mesh over ``devices``: ``(replica, fsdp)``, plus ``tensor`` when ``tensor`` > 1."""
    if devices % (replicas * tensor):
        what = f"replica_size={replicas}" + (f" x tensor_parallel_size={tensor} = {replicas * tensor}" if tensor > 1 else "")
        raise ConfigError(f"{what} does not divide the {devices} {noun}; choose sizes whose product divides {devices}")
    shape: tuple[int, ...] = (replicas, devices // (replicas * tensor))
    axes: tuple[str, ...] = (REPLICA_AXIS, FSDP_AXIS)
    if tensor > 1:
        shape, axes = shape + (tensor,), axes + (TENSOR_AXIS,)
    return shape, axes


def get_mesh(plugin: EngineSettings) -> Any:
    """The device mesh over every device, made once per process and set as the global mesh (with
    ``tensor_parallel_size: auto``, the mesh the model was built on).

    ``(replica, fsdp)``; with ``tensor_parallel_size`` T > 1, ``(replica, fsdp, tensor)``, the tensor axis innermost
    so that each tensor-parallel group is neighbouring devices (the closest chips on a TPU slice).
    """
    import numpy as np
    import torch_xla.distributed.spmd as xs

    enable_spmd()
    if plugin.tensor_parallel_size == "auto":  # the session chose the size (its own copy of the plugin) and set it
        if xs.get_global_mesh() is None:
            raise ConfigError("tensor_parallel_size=auto is chosen when the model is built: build or wrap the model "
                              "with this plugin before asking for its mesh")
        return xs.get_global_mesh()
    devices = device_count()
    shape, axes = mesh_layout(devices, plugin.replica_size, plugin.tensor_parallel_size)
    mesh = xs.get_global_mesh()
    if mesh is None or tuple(mesh.mesh_shape) != shape or tuple(mesh.axis_names) != axes:
        mesh = xs.Mesh(np.arange(devices), shape, axes)
        xs.set_global_mesh(mesh)
    return mesh


def tensor_parallel(module: nn.Module, plugin: EngineSettings, mesh: Any) -> nn.Module:
    """``module`` on the XLA device with the weights its family's plan (or ``tensor_parallel_plan``) names split
    over the ``tensor`` axis and every other parameter sharded as plain FSDP (see ``modeling.tensor_parallel``), so
    ``SpmdFullyShardedDataParallel``, which skips sharded parameters, only adds its hooks and output annotation."""
    from ..modeling.tensor_parallel import apply_plan, find_config, resolve_plan
    from ..runtime import xla_device

    config = find_config(module)
    if plugin.tensor_parallel_plan is None and config is None:
        raise ConfigError(f"tensor_parallel_size={plugin.tensor_parallel_size}: {type(module).__name__} carries no "
                          "transformers config to pick a plan from; give tensor_parallel_plan {param-name glob: axes}")
    plan = resolve_plan(config, plugin.tensor_parallel_size, plugin.tensor_parallel_plan)
    module.to(xla_device())
    apply_plan(module, plan, mesh, BATCH_AXES)
    return module


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
        return [host_copy(tensor)]
    shards = torch_xla._XLAC._get_local_shards([tensor])[0]
    # shards of uneven splits are padded: keep only the slice's own rows/columns
    return [shards[position][0][tuple(slice(0, b - a) for a, b in zip(start, stop))].contiguous()
            for position, start, stop in _replica0_placements(tensor)]


def _materialize(tensors: list[torch.Tensor]) -> None:
    """Compute the XLA tensors among ``tensors`` in one graph."""
    import torch_xla

    xla = [t for t in tensors if t.device.type == "xla"]
    if xla:
        torch_xla._XLAC._xla_sync_multi(xla, devices=[], wait=True)


def _unique_state(model: nn.Module, names_only: bool = False) -> dict[str, torch.Tensor]:
    """Saved name -> tensor of the model's state; a tied weight appears once, under its first name (as v1 does).

    A low-precision parameter with an fp32 master copy is saved as that copy (exact resume). ``names_only``: the
    slices of ``scan_layers``' stacked weights stay lazy views (nothing copied), for a caller that needs the names.
    """
    from ..modeling.scan import names_only as lazy_slices

    masters = master_weights(model)
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    with lazy_slices() if names_only else contextlib.nullcontext():
        state = model.state_dict(keep_vars=True)
    for name, t in state.items():
        if id(t) not in seen:
            seen.add(id(t))
            master = masters.master(t) if masters is not None else None
            out[MODEL_PREFIX + clean_name(name)] = t if master is None else master
    if masters is not None and not names_only:
        _stacked_masters(model, masters, out)
    return out


def _stacked_masters(model: nn.Module, masters: Any, out: dict[str, torch.Tensor]) -> None:
    """``scan_layers``: the state dict gives each layer's low-precision slice; save its fp32 copy's slice instead."""
    from ..modeling.scan import stacked_weights

    slices = []
    for param, names in stacked_weights(model):
        master = masters.master(param)
        if master is None:
            continue
        for i, name in enumerate(names):
            key = MODEL_PREFIX + clean_name(name)
            piece = master[i].clone()
            _same_sharding(piece, out[key])
            out[key] = piece
            slices.append(piece)
    _materialize(slices)


def _stand_ins(model: nn.Module) -> Any:
    """What optimizers update in a parameter's place (its fp32 copy), for optimizer metadata."""
    masters = master_weights(model)
    return masters.master if masters is not None else None


class XlaFsdpV2(XlaEngine):
    """``SpmdFullyShardedDataParallel`` over a ``(replica, fsdp)`` mesh of every device, one process."""

    key = "xla_v2"
    aliases = ("xla", "xla_fsdp_v2")  # `engine: xla` with `version: 2`; transformers' `xla_fsdp_v2: true` is version 2
    version = 2
    name = "xla_fsdp_v2"
    title = "FSDP v2 (SPMD, SpmdFullyShardedDataParallel)"
    # accelerate's XLA launcher starts one process per device (xmp.spawn); SPMD needs exactly one
    launchers = ("NO",)
    launcher_fix = ("FSDP v2 (SPMD) drives every device from one process; set distributed_type: NO and "
                    "num_processes: 1 (see examples/xla_fsdp_v2.yaml)")
    honours = frozenset({"replica_size", "tensor_parallel_size", "tensor_parallel_plan"})
    refuses = {
        "compute_dtype": ((torch.float16,), f"FSDP v2 {NO_FLOAT16}"),
        "buffer_dtype": ((torch.float16,), f"FSDP v2 {NO_FLOAT16}"),
        "compile": ((True,), XLA_COMPILES),
    }
    checkpoint_layout = LAYOUT_PIECES
    spmd = True

    def setup_runtime(self, plugin: EngineSettings, what: str = "this process") -> None:
        enable_spmd(what=what)

    def runtime_ready(self, counted_processes: int) -> bool:
        from ..runtime import is_spmd

        # SPMD on before accelerate counted processes (1), or not on yet and still possible to start cleanly
        return counted_processes <= 1 if is_spmd() else not spmd_too_late()

    def runtime_too_late(self, what: str) -> str:
        return SPMD_TOO_LATE.format(what=what)

    def plan_shards(self, units: Any, config: Any, devices: int, plugin: EngineSettings,
                    ) -> tuple[list[list[tuple[int, ...]]], list[int]]:
        # the rules of the wrap (make_unit / tensor_parallel, modeling.tensor_parallel.apply_plan); XLA pads an uneven
        # split, so every device allocates ceil(dim / split) of each split dim
        from ..modeling.tensor_parallel import resolve_plan

        tensor = plugin.tensor_parallel_size
        shape_of, _ = mesh_layout(devices, plugin.replica_size, tensor, noun="chips")  # the planner's devices
        sizes = {REPLICA_AXIS: plugin.replica_size, FSDP_AXIS: shape_of[1], TENSOR_AXIS: tensor}
        plan = resolve_plan(config, tensor, plugin.tensor_parallel_plan) if tensor > 1 else None
        shards: list[list[tuple[int, ...]]] = []
        gathered: list[int] = []
        for unit in units:
            pieces, held = [], 0
            for (numel, shape), name in zip(unit.params, unit.names):
                axes = plan.axes_for(name) if plan is not None else None
                if axes is None or len(axes) != len(shape):
                    # not planned: dim 0 over fsdp; with a tensor axis the largest dim over fsdp x tensor (1-D ones
                    # over fsdp only), as the wrap does
                    axes = [None] * len(shape)
                    if shape and plan is None:
                        axes[0] = FSDP_AXIS
                    elif shape:
                        axes[list(shape).index(max(shape))] = (FSDP_AXIS, TENSOR_AXIS) if len(shape) > 1 else FSDP_AXIS
                    held += numel
                else:  # a planned weight stays split over the tensor axis while its unit is gathered over fsdp
                    split = any(a == TENSOR_AXIS or (isinstance(a, tuple) and TENSOR_AXIS in a) for a in axes)
                    held += numel // tensor if split else numel
                pieces.append(tuple(math.ceil(d / math.prod(sizes[a] for a in ((ax,) if isinstance(ax, str) else ax or ())))
                                    for d, ax in zip(shape, axes)))
            shards.append(pieces)
            gathered.append(held)
        return shards, gathered

    def plan_mesh(self, plugin: EngineSettings, devices: int) -> Optional[dict[str, int]]:
        tensor = plugin.tensor_parallel_size
        return {REPLICA_AXIS: plugin.replica_size, FSDP_AXIS: devices // (plugin.replica_size * tensor),
                TENSOR_AXIS: tensor}

    def devices_per_sample(self, plugin: EngineSettings) -> int:
        return plugin.tensor_parallel_size

    def splits_tensors(self) -> bool:
        return True

    def processes_per_host(self, requested: Any) -> Optional[int]:
        if requested not in (None, 1, "1"):
            raise ConfigError(f"num_processes={requested}: FSDP v2 (SPMD) drives every device of a host from one "
                              "process; drop num_processes (or set it to 1)")
        return None

    def unit_class(self) -> type:
        return spmd_class()

    def make_unit(self, block: nn.Module, plugin: EngineSettings) -> nn.Module:
        mesh = get_mesh(plugin)
        if plugin.tensor_parallel_size > 1:
            block = tensor_parallel(block, plugin, mesh)
        return spmd_class()(block, mesh=mesh, shard_output=shard_output)

    def make_root(self, model: nn.Module, plugin: EngineSettings) -> nn.Module:
        from ..runtime import xla_device

        # FSDPv2 moves the module with .to(), which makes new Parameters and unties lm_head from the
        # embeddings; move and re-tie first, so the tie survives (and is sharded once)
        model.to(xla_device())
        if hasattr(model, "tie_weights"):
            model.tie_weights()
        mesh = get_mesh(plugin)
        if plugin.tensor_parallel_size > 1:  # embeddings / LM head (and blocks of a root-only wrap)
            tensor_parallel(model, plugin, mesh)
        wrapped = spmd_class()(model, mesh=mesh, shard_output=shard_output)
        if plugin.compute_dtype not in (None, torch.float32):
            cast_parameters(wrapped, plugin.compute_dtype)
            # SDPA's math path (the one XLA runs) would otherwise upcast q/k/v and its attention matrix
            # to fp32; with it, attention computes in bf16 as transformers' eager attention does
            torch.backends.cuda.allow_fp16_bf16_reduction_math_sdp(True)
        if plugin.buffer_dtype not in (None, torch.float32):
            with torch.no_grad():
                for buf in wrapped.buffers():
                    if buf.is_floating_point():
                        buf.data = buf.data.to(plugin.buffer_dtype)
        return wrapped

    def scan_annotations(self, plugin: EngineSettings, model: nn.Module) -> Any:
        from ..modeling.scan import ScanAnnotations

        mesh = get_mesh(plugin)
        masters = master_weights(model)

        class Annotations(ScanAnnotations):
            def spec(self, tensor: torch.Tensor) -> Optional[tuple]:
                from torch_xla.experimental.spmd_fully_sharded_data_parallel import _prepare_spmd_partition_spec

                if tensor.device.type != "xla" or not sharding_spec(tensor):
                    return None
                return tuple(_prepare_spmd_partition_spec(tensor, shard_maximal=True))

            def mark(self, tensor: torch.Tensor, spec: tuple) -> None:
                import torch_xla.distributed.spmd as xs

                xs.mark_sharding(tensor, mesh, spec)

            def output(self, tensor: torch.Tensor) -> None:
                shard_output(tensor, mesh)

            def materialize(self, tensors: list[torch.Tensor]) -> None:
                _materialize(tensors)

            def restacked(self, layers: list[torch.Tensor], stacked: nn.Parameter) -> None:
                if masters is not None:
                    masters.restack(layers, stacked)
                    if masters.master(stacked) is not None:
                        self.materialize([masters.master(stacked)])

        return Annotations()

    def like_step_output(self, tensor: torch.Tensor, plugin: EngineSettings) -> None:
        import torch_xla.distributed.spmd as xs

        # an SPMD step's outputs come back annotated (a scalar: replicated); a carried tensor created unannotated
        # would make step 2's graph differ from step 1's and compile again
        if tensor.device.type == "xla" and not sharding_spec(tensor):
            xs.mark_sharding(tensor, get_mesh(plugin), (None,) * tensor.dim())

    def whole(self, tensor: torch.Tensor, plugin: EngineSettings) -> torch.Tensor:
        import torch_xla.distributed.spmd as xs

        if tensor.device.type != "xla" or sharding_spec(tensor) == "{replicated}":
            return tensor
        # torch_xla compiles a replication program for every host read of a sharded tensor and never caches it; a
        # copy annotated replicated is gathered inside a graph, compiled once and then found in the graph cache. (A
        # pending result shows no annotation until it runs, so only a known replicated one is left as it is.)
        whole = tensor.clone()
        xs.annotate_custom_sharding(whole, get_mesh(plugin), (None,) * tensor.dim())
        return whole

    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        attach(model, optimizer)

    def zeros_like(self, param: torch.Tensor) -> torch.Tensor:
        zeros = torch.zeros_like(param, memory_format=torch.preserve_format)
        _same_sharding(zeros, param)  # a replicated state would hold the whole tensor on every device
        return zeros

    def optimizer_targets(self, model: nn.Module) -> list[torch.Tensor]:
        masters = master_weights(model)  # low-precision parameters are updated through their fp32 copies
        return [*model.parameters(), *(master for _, master in (masters.pairs if masters is not None else []))]

    def prepare_loader(self, loader: Any, plugin: EngineSettings) -> Any:
        return shard_loader_inputs(loader, get_mesh(plugin))

    def rank_world(self, model: nn.Module) -> tuple[int, int]:
        return process_index(), process_count()  # one file per process, each holding its devices' slices

    def checkpoint_name(self, name: str) -> str:
        return clean_name(name)

    def original_names(self, model: nn.Module) -> dict[str, str]:
        return {name: clean_name(name) for name, _ in model.named_parameters()}

    def parameter_origins(self, model: nn.Module) -> dict[str, list[str]]:
        from ..modeling.scan import stacked_origins

        stacked = stacked_origins(model)  # scan_layers: one stacked parameter holds every layer's weight
        return {name: [clean_name(n) for n in stacked[name]] if name in stacked else [orig]
                for name, orig in self.original_names(model).items()}

    # ----------------------------------------------------------------- checkpoints
    def rank_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> RankState:
        """For every tensor, the slices this process's devices hold (replica 0), with their offsets."""
        wait_device_ops()  # shard placements can only be read once no computation is in flight
        named = {name: t.detach() for name, t in _unique_state(model).items()}
        optim = None
        if optimizer is not None:
            masters = master_weights(model)
            if masters is not None and masters.pairs and not masters.attached(optimizer):
                raise CheckpointError("the optimizer updates the low-precision parameters instead of their fp32 copies: "
                                      "prepare it with accelerate's prepare or plugin.prepare_optimizer(model, optimizer)")
            optim, optim_tensors = optimizer_meta(model, optimizer, self.checkpoint_name, _stand_ins(model))
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
            entries[name] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "pieces": pieces}
        cache: dict[str, list[torch.Tensor]] = {}

        def produce(key: str) -> torch.Tensor:
            name, k = owner[key]
            if name not in cache:  # one tensor's slices on the host at a time
                cache.clear()
                cache[name] = fetch_pieces(named[name])
            return cache[name][k]

        return RankState(specs, produce, {"engine": self.checkpoint_layout, "devices": device_count(),
                                          "tensors": entries, "optimizer": optim})

    def restore(self, ckpt_dir: Path, marker: dict[str, Any], model: nn.Module,
                optimizer: Optional[torch.optim.Optimizer]) -> Restored:
        """Each tensor is assembled on the host, one at a time, and copied into its sharded parameter.

        Works for any saved device count: the pieces carry their offsets in the full tensor.
        """
        files = [open_listed(ckpt_dir, marker, name) for name in sorted(marker["files"])]
        entries = merge_pieces(files)
        wanted = _unique_state(model, names_only=True)  # written below; the stacked ones into their stacks
        missing = [n for n in wanted if n not in entries]
        saved_model = {n for n in entries if n.startswith(MODEL_PREFIX)}
        if missing or len(wanted) != len(saved_model):
            extra = sorted(saved_model - set(wanted))
            raise CheckpointError(f"{ckpt_dir} was saved from a different model: missing {missing[:3]}, unexpected {extra[:3]}")
        from ..modeling.scan import stacked_weights

        # scan_layers: the per-layer slices are views of a stacked parameter; the saved layers are stacked into it
        stacked = [(param, [MODEL_PREFIX + clean_name(n) for n in names]) for param, names in stacked_weights(model)]
        in_stacks = {n for _, names in stacked for n in names}
        with torch.no_grad():
            for name, t in wanted.items():
                if name in in_stacks:
                    continue
                full = read_pieces(entries[name])
                if tuple(full.shape) != tuple(t.shape):
                    raise CheckpointError(f"{name} is {list(full.shape)} in {ckpt_dir} but {list(t.shape)} in the model")
                t.copy_(full)  # keeps the tensor's sharding: each device receives its slice
            masters = master_weights(model)
            for param, names in stacked:
                full = torch.stack([read_pieces(entries[n]) for n in names])
                if tuple(full.shape) != tuple(param.shape):
                    raise CheckpointError(f"{names[0]} and the other layers are {list(full.shape[1:])} in {ckpt_dir} but "
                                          f"{list(param.shape[1:])} in the model")
                master = masters.master(param) if masters is not None else None
                (param if master is None else master).copy_(full)  # a master is copied into the parameter below
        if master_weights(model) is not None:
            master_weights(model).sync_params()
        meta = files[0].meta
        if optimizer is not None:
            self._restore_optimizer(optimizer, model, meta, entries, files[0].path.with_suffix(".json"))
        rank, _ = self.rank_world(model)
        own: RankFile = files[rank % len(files)]
        return Restored(meta, own, {"saved_world_size": len(files), "saved_devices": meta.get("devices")})

    def _restore_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, meta: dict[str, Any],
                           entries: dict[str, dict[str, Any]], source: Path) -> None:
        import torch_xla

        attach(model, optimizer)
        saved = saved_optimizer(meta, model, optimizer, self.checkpoint_name, _stand_ins(model),
                                source=source)
        state: dict[int, dict[str, Any]] = {}
        for name, entry in entries.items():
            key = optimizer_tensor_key(name)
            if key is not None:
                state.setdefault(key[0], {})[key[1]] = read_pieces(entry)
        load_optimizer_state(optimizer, saved, state)
        for param, values in optimizer.state.items():  # each state tensor gets its parameter's sharding
            if not sharding_spec(param):
                continue
            for value in values.values():
                if isinstance(value, torch.Tensor) and value.device.type == "xla" and value.shape == param.shape:
                    torch_xla._XLAC._xla_mark_sharding(value, torch_xla._XLAC._get_xla_op_sharding(param))
