"""FSDP2: torch's own ``fully_shard`` over a ``DeviceMesh``, one process per device; torch_xla is never imported.

Every parameter becomes a ``DTensor`` sharded on dim 0 over the mesh's ``fsdp`` axis (and replicated over a
``replica`` axis for hybrid sharding, HSDP). One code path serves every device: the device type and the
torch.distributed backend are chosen in one place (:func:`resolve_device`: CPU/gloo, CUDA/NCCL, TorchTPU's ``tpu``
device and its backend, any other torch accelerator), so this engine runs where torch runs (CPU included), and on
TPUs through TorchTPU once PyTorch/XLA is gone.

Blocks are sharded without a full tensor on the device: the meta build hands each block over filled on the host
(one block at a time), its parameters are swapped for ``meta`` tensors, ``fully_shard`` makes their sharded
``DTensor`` skeletons, and only this rank's rows are copied into freshly allocated local shards
(:func:`shard_module`). Rank files use the pieces layout of FSDP v2 (``checkpoint.readers.LAYOUT_PIECES``): every
tensor as the rows this rank holds, with their offsets, so consolidation, ``verify``, ``gather``, resharding to another
world size and resuming across XLA FSDP v2 and this engine need nothing engine-specific.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import logging
import math
import os
import sys
import types
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..checkpoint.codec import Collectives, RankState, Restored
from ..checkpoint.layout import MODEL_PREFIX
from ..checkpoint.readers import LAYOUT_PIECES, merge_pieces, open_listed, read_pieces, read_rows_of_pieces
from ..checkpoint.safetensors_io import dtype_name
from ..checkpoint.state import load_optimizer_state, optimizer_meta, optimizer_tensor_key, saved_optimizer
from ..errors import CheckpointError, ConfigError
from .base import NO_FLOAT16, Engine, EngineSettings, Machines, host_copy

logger = logging.getLogger(__name__)

#: force the device type (``cpu``, ``cuda``, ``tpu``, ...) instead of detecting it
ENV_DEVICE = "HF_XLA_FSDP_DEVICE"
FSDP_AXIS = "fsdp"
REPLICA_AXIS = "replica"
#: TorchTPU's Python package (it renames torch's PrivateUse1 device to ``tpu`` and registers its backend)
TORCH_TPU = "torch_tpu"
#: glibc's environment setting for the size from which ``malloc`` maps memory (and returns it to the system on free)
ENV_MMAP_THRESHOLD = "MALLOC_MMAP_THRESHOLD_"
#: what this engine sets it to on the CPU (unless the environment says otherwise): 1 MiB
HOST_MMAP_THRESHOLD = 1 << 20


# --------------------------------------------------------------------------- device and backend: the one place
def _torch_tpu_available() -> bool:
    """True when TorchTPU is installed and sees a TPU. torch loads it itself (its ``torch.backends`` entry point);
    the import here covers a process that switched that autoload off, and does nothing when it already ran."""
    try:
        if importlib.util.find_spec(TORCH_TPU) is None:
            return False
        importlib.import_module(TORCH_TPU)
    except Exception as err:  # a broken installation (e.g. no libtpu) is "no TPU", said once
        logger.warning("%s is installed but could not be imported (%s); not using TPUs", TORCH_TPU, err)
        return False
    module = getattr(torch, "tpu", None)
    try:
        return bool(module is not None and module.is_available())
    except Exception:
        return False


def resolve_device() -> tuple[str, str]:
    """``(device type, torch.distributed backend)`` of this process, decided here and nowhere else.

    ``$HF_XLA_FSDP_DEVICE`` wins when set; else TorchTPU's ``tpu`` when it sees a TPU; else torch's current
    accelerator when one is available (``cuda``, ``xpu``, ...); else ``cpu``. The backend is the one torch.distributed
    registers for that device (gloo for cpu, nccl for cuda, TorchTPU's for tpu).
    """
    import torch.distributed as dist

    forced = os.environ.get(ENV_DEVICE, "").strip().lower()
    if forced:
        device_type = forced
        if device_type == "tpu":
            _torch_tpu_available()  # registers the device and its backend
    elif _torch_tpu_available():
        device_type = "tpu"
    else:
        accelerator = torch.accelerator.current_accelerator(check_available=True)
        device_type = accelerator.type if accelerator is not None else "cpu"
    try:
        backend = dist.get_default_backend_for_device(device_type)
    except (ValueError, RuntimeError, KeyError):
        raise ConfigError(f"torch.distributed has no backend for device type {device_type!r}"
                          + (f" (from ${ENV_DEVICE})" if forced else "") + "; install the package that provides it "
                          "(TorchTPU for tpu) or set " + ENV_DEVICE + "=cpu") from None
    return device_type, str(backend)


def compile_options(device_type: Optional[str] = None) -> dict[str, Any]:
    """``torch.compile``'s ``backend`` and ``dynamic`` for blocks on ``device_type`` (this process's by default),
    decided beside :func:`resolve_device` and nowhere else.

    TorchTPU's own backend ``tpu`` with static shapes on TPUs (its only mode: a graph with symbolic sizes is refused);
    elsewhere inductor with automatic dynamic shapes (``dynamic=None``): a block compiles for the first shapes it sees,
    and when a size changes once more with that dimension symbolic, so varied sequence lengths cost two graphs, not one
    per length, and no batch is padded.
    """
    if (device_type or current_device_type()) == "tpu":
        return {"backend": "tpu", "dynamic": False}
    return {"backend": "inductor", "dynamic": None}


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


def device() -> torch.device:
    """This process's device (its ``LOCAL_RANK``-th accelerator, or the CPU)."""
    device_type = current_device_type()
    return torch.device("cpu") if device_type == "cpu" else torch.device(device_type, _local_rank())


_STATE: dict[str, Any] = {"device_type": None, "meshes": {}}


def current_device_type() -> str:
    """The device type this process runs on (resolved once)."""
    if _STATE["device_type"] is None:
        _STATE["device_type"] = resolve_device()[0]
    return _STATE["device_type"]


def init_distributed() -> None:
    """torch.distributed with the backend of :func:`resolve_device`, once (a launcher's process group is kept).

    Under ``torchrun`` / ``accelerate launch`` / ``hf-xla-fsdp launch`` the group comes from the environment
    (``env://``); a lone process without ``MASTER_ADDR`` gets a group of one in memory.
    """
    import torch.distributed as dist

    device_type, backend = resolve_device()
    _STATE["device_type"] = device_type
    if device_type != "cpu":
        torch.get_device_module(device_type).set_device(_local_rank())
    if dist.is_initialized():
        return
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world == 1 and "MASTER_ADDR" not in os.environ:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


def map_large_host_allocations() -> bool:
    """On the CPU device, have glibc map every allocation of 1 MiB or more, so that it is returned on free.

    Here a unit's gathered parameters and gradients are host memory, allocated and freed at every forward and backward.
    glibc's default mmap threshold grows to the size of the first large block freed (up to 32 MiB), after which such
    blocks come from the heap and fragment it: a rank's peak RSS then drifts by hundreds of MiB between ranks and runs
    (benchmarks/dpo_memory.py, RESULTS.md). A fixed threshold (``mallopt(M_MMAP_THRESHOLD)``, which also stops glibc's
    adjustment) keeps the peak at what is live. ``MALLOC_MMAP_THRESHOLD_`` in the environment is glibc's own setting
    and wins; elsewhere than glibc nothing changes. True when the threshold was set here.
    """
    if ENV_MMAP_THRESHOLD in os.environ or not sys.platform.startswith("linux"):
        return False
    import ctypes

    # the symbols already loaded into this process (the C library's among them): no library search, which on Linux
    # would start ldconfig in a subprocess
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None)
    if mallopt is None:
        return False
    m_mmap_threshold = -3  # glibc's malloc.h
    return bool(mallopt(ctypes.c_int(m_mmap_threshold), ctypes.c_int(HOST_MMAP_THRESHOLD)))


def mesh_layout(world: int, replicas: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """Shape and axis names of the mesh over ``world`` processes: ``(fsdp,)``, or ``(replica, fsdp)`` (HSDP)."""
    if replicas < 1 or world % replicas:
        raise ConfigError(f"replica_size={replicas} does not divide the {world} processes; choose a divisor of {world}")
    if replicas == 1:
        return (world,), (FSDP_AXIS,)
    return (replicas, world // replicas), (REPLICA_AXIS, FSDP_AXIS)


def get_mesh(plugin: EngineSettings) -> Any:
    """The ``DeviceMesh`` of every process (made once per layout; every process must ask for it at the same point)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    init_distributed()
    shape, names = mesh_layout(dist.get_world_size(), plugin.replica_size)
    key = (current_device_type(), shape, names)
    if key not in _STATE["meshes"]:
        _STATE["meshes"][key] = init_device_mesh(current_device_type(), shape, mesh_dim_names=names)
    return _STATE["meshes"][key]


def _refuse_xla_runtime(what: str) -> None:
    """One line when accelerate (and so the Trainer) has taken torch_xla's runtime in this process: transformers and
    accelerate use torch_xla whenever it is installed unless ``USE_TORCH_XLA=0`` is set before they are imported."""
    state = sys.modules.get("accelerate.state")
    if state is None or not getattr(state.PartialState, "_shared_state", None):
        return
    if str(getattr(state.PartialState(), "distributed_type", "")).endswith("XLA"):
        raise ConfigError(f"engine fsdp2 runs torch.distributed processes, but {what} already set up torch_xla's "
                          "runtime (torch_xla is installed): set USE_TORCH_XLA=0 in the environment before starting "
                          "(hf-xla-fsdp launch does it for engine fsdp2)")


# --------------------------------------------------------------------------- sharding
def _rows(tensor: Any) -> Optional[tuple[int, int]]:
    """``(start, stop)`` of the dim-0 rows this process holds of a DTensor sharded ``Shard(0)`` over the fsdp axis
    (``Replicate`` over any replica axis); None for a replica that does not save (not the first), or for a plain
    tensor."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(tensor, DTensor):
        return None
    mesh = tensor.device_mesh
    n = tensor.shape[0]
    start, stop = 0, n
    for dim, placement in enumerate(tensor.placements):
        if isinstance(placement, Shard) and placement.dim == 0:
            count, index = mesh.size(dim), mesh.get_local_rank(dim)
            chunk = -(-n // count) if n else 0  # torch.chunk's split, as DTensor's Shard uses
            start, stop = min(index * chunk, n), min((index + 1) * chunk, n)
        elif not isinstance(placement, Replicate):
            raise CheckpointError(f"a {list(tensor.shape)} parameter is placed {tensor.placements}; engine fsdp2 saves "
                                  "Shard(0) and Replicate placements only")
    local = tensor.to_local()
    if local.shape[:1] != (stop - start,):
        raise CheckpointError(f"a {list(tensor.shape)} DTensor holds {list(local.shape)} locally, not rows {start}:{stop}")
    return start, stop


def _first_replica(tensor: Any) -> bool:
    """True on the processes whose copy of a DTensor is saved: coordinate 0 on every Replicate axis."""
    from torch.distributed.tensor import Replicate

    mesh = tensor.device_mesh
    return all(mesh.get_local_rank(dim) == 0 for dim, p in enumerate(tensor.placements) if isinstance(p, Replicate))


def _untied_ends(model: nn.Module) -> list[nn.Module]:
    """The input embeddings and the output layer of a transformers model, where neither shares a parameter with the
    other (a tied pair stays in the root unit: one parameter cannot be in two units) and no unit holds them yet."""
    from torch.distributed.fsdp import FSDPModule

    ends = [getter() for getter in (getattr(model, "get_input_embeddings", None),
                                    getattr(model, "get_output_embeddings", None)) if getter is not None]
    ends = [m for m in ends if isinstance(m, nn.Module) and not isinstance(m, FSDPModule)
            and any(True for _ in m.parameters())]
    if len(ends) == 2 and {id(p) for p in ends[0].parameters()} & {id(p) for p in ends[1].parameters()}:
        return []
    return ends


@torch.no_grad()
def shard_module(module: nn.Module, plugin: EngineSettings, reshard_after_forward: Optional[bool]) -> nn.Module:
    """``fully_shard(module)`` without ever placing a full parameter on the device.

    The parameters ``module`` owns that no inner unit has sharded yet (host tensors: one block, or the root's own)
    are swapped for ``meta`` tensors; ``fully_shard`` makes their sharded ``DTensor`` skeletons; each is then given a
    local shard on this process's device holding only its rows of the host tensor. Tied parameters stay one
    parameter. Floating buffers become ``buffer_dtype`` when it is set.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    mesh = get_mesh(plugin)
    host: dict[tuple[int, str], tuple[nn.Module, torch.Tensor]] = {}
    stand_ins: dict[int, nn.Parameter] = {}
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is None or isinstance(param, DTensor):
                continue
            if param.is_meta:
                raise ConfigError(f"{type(module).__name__}.{name} is still on the meta device; build the model with "
                                  "XlaFsdpPlugin.build (it fills each block before sharding it)")
            host[(id(sub), name)] = (sub, param.detach())
            if id(param) not in stand_ins:  # a tied parameter gets one stand-in under both names
                stand_ins[id(param)] = nn.Parameter(torch.empty_like(param, device="meta"),
                                                    requires_grad=param.requires_grad)
            sub._parameters[name] = stand_ins[id(param)]
    if plugin.buffer_dtype not in (None, torch.float32):
        for sub in module.modules():
            for name, buf in sub._buffers.items():
                if buf is not None and buf.is_floating_point():
                    sub._buffers[name] = buf.to(plugin.buffer_dtype)
    mp = MixedPrecisionPolicy(param_dtype=plugin.compute_dtype, reduce_dtype=torch.float32) \
        if plugin.compute_dtype not in (None, torch.float32) else MixedPrecisionPolicy()
    fully_shard(module, mesh=mesh, reshard_after_forward=reshard_after_forward, mp_policy=mp)
    target = device()
    done: set[int] = set()
    for sub, name in ((sub, name) for (_, name), (sub, _) in host.items()):
        param = sub._parameters[name]
        if id(param) in done:  # the second name of a tied parameter
            continue
        full = host[(id(sub), name)][1]
        start, stop = _rows(param) or (0, param.shape[0])
        local = torch.empty(param.to_local().shape, dtype=param.dtype, device=target)
        local.copy_(full[start:stop])
        real = nn.Parameter(DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                               stride=param.stride(), run_check=False), requires_grad=param.requires_grad)
        torch.utils.swap_tensors(param, real)  # the same object: FSDP's bookkeeping and the ties keep it
        done.add(id(param))
    return module


def _checkpointed(block: nn.Module) -> nn.Module:
    """Recompute ``block``'s activations in backward (``torch.utils.checkpoint``, non-reentrant) without renaming its
    parameters (a ``checkpoint_wrapper`` would put ``_checkpoint_wrapped_module.`` into every name)."""
    if "forward" not in block.__dict__:
        # one function for every block, bound to each: torch.compile then traces one code object whose block is an
        # input, so one graph serves every layer (a closure over each block's own forward is guarded by its identity:
        # a graph per layer, and past torch._dynamo's recompile limit of 8 the other layers silently run eagerly)
        block.forward = types.MethodType(_recomputed_forward, block)
        return block
    from torch.utils.checkpoint import checkpoint

    forward = block.forward  # an instance's own forward (set by someone else): kept, recomputed

    @functools.wraps(forward)
    def recomputed(*args: Any, **kwargs: Any) -> Any:
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    block.forward = recomputed
    return block


def _recomputed_forward(block: nn.Module, *args: Any, **kwargs: Any) -> Any:
    """``block``'s class forward under ``torch.utils.checkpoint`` (non-reentrant)."""
    from torch.utils.checkpoint import checkpoint

    return checkpoint(type(block).forward, block, *args, use_reentrant=False, **kwargs)


def _compiled(block: nn.Module) -> nn.Module:
    """``block``'s forward (its activation checkpointing included) compiled in place, so its parameter names stay
    (``torch.compile(block)`` would put ``_orig_mod.`` into every name). Only the forward: the FSDP hooks that
    ``fully_shard`` adds around it (all-gather, reshard) stay eager, as in torchtitan, where each compiled block is
    sharded. ``fullgraph``: a decoder layer is one graph (a break would mean a silent eager fallback in the middle of
    every layer); every block runs the same code, so one compiled graph serves all layers of a model."""
    block.forward = torch.compile(block.forward, fullgraph=True, **compile_options())
    return block


def _unique_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """Saved name -> tensor of the model's state; a tied weight appears once, under its first name (as v1 and v2)."""
    seen: set[int] = set()
    out: dict[str, torch.Tensor] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) not in seen:
            seen.add(id(tensor))
            out[MODEL_PREFIX + name] = tensor
    return out


def _placement_names(tensor: Any) -> Optional[list[str]]:
    from torch.distributed.tensor import DTensor

    return [str(p) for p in tensor.placements] if isinstance(tensor, DTensor) else None


def _read_local(entry: dict[str, Any], like: torch.Tensor) -> torch.Tensor:
    """This process's part of a saved tensor: the rows a DTensor holds (read from the saved pieces that cover them,
    whatever layout wrote them), or the whole tensor for a plain one."""
    rows = _rows(like)
    if rows is None:
        return read_pieces(entry)
    return read_rows_of_pieces(entry, *rows)


def torchrun_placement(count: int, machines: Optional[Machines] = None) -> list[str]:
    """torchrun's arguments that place ``count`` processes on this machine of ``machines``."""
    if machines is None or (machines.count == 1 and machines.main_port is None):
        return ["--standalone", f"--nproc_per_node={count}"]
    port = machines.main_port or 29500  # torchrun's default, accelerate's
    return [f"--nnodes={machines.count}", f"--node_rank={machines.rank}", "--rdzv_backend=static",
            f"--master_addr={machines.main_ip or '127.0.0.1'}", f"--master_port={port}", f"--nproc_per_node={count}"]


class Fsdp2(Engine):
    """torch's FSDP2 (``fully_shard``) over a ``(fsdp,)`` or ``(replica, fsdp)`` DeviceMesh, one process per device."""

    key = "fsdp2"
    name = "fsdp2"
    title = "FSDP2 (torch fully_shard, DTensor)"
    # torch.distributed processes (accelerate launch / torchrun / hf-xla-fsdp launch start one per device)
    launchers = ("FSDP", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "NO")
    launcher_fix = ("engine fsdp2 runs torch.distributed processes, not torch_xla's; set distributed_type: FSDP (or "
                    "MULTI_CPU / MULTI_GPU, or NO for one process)")
    honours = frozenset({"reshard_after_forward", "replica_size", "compile"})
    refuses = {
        "compute_dtype": ((torch.float16,), f"engine fsdp2 {NO_FLOAT16}"),
        "buffer_dtype": ((torch.float16,), f"engine fsdp2 {NO_FLOAT16}"),
        "scan_layers": ((True,), "scan_layers is torch_xla's scan (one compiled layer), not available on engine "
                                 "fsdp2; remove it (compile=true compiles each block once for all layers)"),
    }
    torch_fsdp2 = True
    checkpoint_layout = LAYOUT_PIECES
    fused_optimizers = True

    # ----------------------------------------------------------------- planning
    def plan_shards(self, units: Any, config: Any, devices: int, plugin: EngineSettings,
                    ) -> tuple[list[list[tuple[int, ...]]], list[int]]:
        # fully_shard's rule: dim 0 of every parameter split over the fsdp axis as torch.chunk splits it (the fullest
        # rank holds ceil(rows / fsdp) rows), nothing flattened; a gathered unit holds all its parameters
        fsdp = mesh_layout(devices, plugin.replica_size)[0][-1]
        shards = [[(-(-shape[0] // fsdp), *shape[1:]) if shape else () for _, shape in unit.params] for unit in units]
        return shards, [sum(numel for numel, _ in unit.params) for unit in units]

    def plan_mesh(self, plugin: EngineSettings, devices: int) -> Optional[dict[str, int]]:
        shape, _ = mesh_layout(devices, plugin.replica_size)
        return {REPLICA_AXIS: plugin.replica_size, FSDP_AXIS: shape[-1], "tensor": 1}

    def root_stays_gathered(self, plugin: EngineSettings) -> bool:
        return True  # fully_shard keeps the root's parameters from forward to backward (reshard_after_forward=None)

    def compute_dtype_saves_memory(self, plugin: EngineSettings) -> bool:
        return True  # shards stay fp32; gathered units, gradients before reduction and activations take the dtype

    # ----------------------------------------------------------------- runtime
    def setup_runtime(self, plugin: EngineSettings, what: str = "this process") -> None:
        from .nodes import die_with_launcher, watch_machines

        _refuse_xla_runtime(what)
        die_with_launcher()  # before the rendezvous, which waits for every machine
        get_mesh(plugin)  # the process group, the device, and the mesh, before any model exists
        watch_machines()  # several machines: a lost one stops every process with one line naming it
        if current_device_type() == "cpu":
            # accelerate counts CPU processes (MULTI_CPU: every process its own batches) only when told it runs on
            # the CPU; its state is built later (by TrainingArguments or the Accelerator) and reads this
            os.environ.setdefault("ACCELERATE_USE_CPU", "true")
            map_large_host_allocations()

    def device(self) -> torch.device:
        return device()

    def multi_process(self) -> bool:
        import torch.distributed as dist

        return dist.is_initialized() and dist.get_world_size() > 1

    def process_index(self) -> int:
        import torch.distributed as dist

        return dist.get_rank() if dist.is_initialized() else 0

    def process_count(self) -> int:
        import torch.distributed as dist

        if dist.is_initialized():
            return dist.get_world_size()
        return int(os.environ.get("WORLD_SIZE", "1"))

    def gather_bytes(self, payload: bytes, tag: str) -> list[bytes]:
        collectives = self.collectives()
        assert collectives is not None  # (a group of one without torch.distributed)
        return collectives.gather(tag, payload)

    # ----------------------------------------------------------------- launching
    def started_by_launcher(self) -> bool:
        return "TORCHELASTIC_RUN_ID" in os.environ or ("LOCAL_RANK" in os.environ and "WORLD_SIZE" in os.environ)

    def processes_per_host(self, requested: Any) -> Optional[int]:
        # one of the processes torchrun (or this launcher through it) started runs the script; it starts none
        return None if self.started_by_launcher() else super().processes_per_host(requested)

    def check_machines(self, machines: Machines) -> None:
        flags = [g for g in machines.given if g.startswith("--")]  # a YAML's keys serve the outer launcher
        if self.started_by_launcher() and flags:
            raise ConfigError(f"{', '.join(flags)}: this process was started by torchrun (or accelerate launch), which "
                              "placed it on its machine already; give the machine flags to one launcher only")

    def start_processes(self, count: int, launcher_arguments: list[str], machines: Optional[Machines] = None,
                        process_main: Optional[Callable[[], None]] = None) -> int:
        """``count`` processes on this host as torchrun starts them, each ``python -m hf_xla_fsdp.launch`` with the
        same settings: ``torchrun --standalone --nproc_per_node count`` on one machine; on several, ``torchrun --nnodes
        N --node_rank R --master_addr IP --master_port PORT --nproc_per_node count`` (the static rendezvous, as
        accelerate starts it: ranks numbered machine by machine, ``R * count`` to ``R * count + count - 1`` here).
        transformers and accelerate are told to leave torch_xla alone (``USE_TORCH_XLA=0``) where it is installed; on a
        TPU VM TorchTPU's launch environment is set first (its ``set_tpu_launch_env``: the slice's addresses and
        topology, decided in this process). The processes die with this one (:func:`.nodes.die_with_launcher`)."""
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run

        from .nodes import ENV_LAUNCHER_PID

        os.environ.setdefault("USE_TORCH_XLA", "0")
        os.environ[ENV_LAUNCHER_PID] = str(os.getpid())
        tpu = getattr(getattr(torch, "tpu", None), "distributed", None)
        if tpu is not None and hasattr(tpu, "set_tpu_launch_env"):
            tpu.set_tpu_launch_env(nproc_per_node=count)
        args = get_args_parser().parse_args([*torchrun_placement(count, machines), "-m", "hf_xla_fsdp.launch",
                                             *launcher_arguments])
        try:
            run(args)
        except ChildFailedError as err:  # torchrun printed which process failed and how
            codes = [failure.exitcode for failure in err.failures.values()]
            return next((c for c in codes if c > 0), 1)
        return 0

    # ----------------------------------------------------------------- wrapping
    def unit_class(self) -> type:
        from torch.distributed.fsdp import FSDPModule

        return FSDPModule

    def unwrap(self, model: nn.Module) -> nn.Module:
        return model  # fully_shard works in place: the unit is the user's module

    def wrap_block(self, block: nn.Module, plugin: EngineSettings, nested: bool, *,
                   evaluation_mode: bool = False) -> nn.Module:
        from ..checkpoint.codec import tag

        if evaluation_mode:  # forward only: frozen, every block a unit that frees its gathered parameters at once
            block.requires_grad_(False)
            return self._for_inference(tag(shard_module(block, plugin, reshard_after_forward=True), self), plugin)
        # zero2 keeps every block a unit too, with its gathered parameters kept from forward to backward (FSDP2's
        # ZeRO-2); zero3 frees them after each block's forward unless reshard_after_forward is off
        # torchtitan's order: activation checkpointing, then compile (the recomputation inside the compiled graph),
        # then fully_shard (its hooks around the compiled forward)
        block = self.checkpoint_block(block, plugin)
        if plugin.compile:
            block = _compiled(block)
        return tag(shard_module(block, plugin, reshard_after_forward=nested and plugin.reshard_after_forward), self)

    def wrap_root(self, model: nn.Module, plugin: EngineSettings, *, evaluation_mode: bool = False) -> nn.Module:
        if evaluation_mode:  # no backward will come to free the root's gathered parameters: free them after forward
            from ..checkpoint.codec import tag

            model.requires_grad_(False)
            # the embeddings and the LM head as units of their own: a forward gathers one of them at a time, not both
            # (as one root unit they are gathered together for the whole forward: a third of a 168M Llama)
            for part in _untied_ends(model):
                tag(shard_module(part, plugin, reshard_after_forward=True), self)
            return self._for_inference(tag(shard_module(model, plugin, reshard_after_forward=True), self), plugin).eval()
        return super().wrap_root(model, plugin)

    def make_unit(self, block: nn.Module, plugin: EngineSettings) -> nn.Module:
        return shard_module(block, plugin, reshard_after_forward=plugin.sharding == "zero3"
                            and plugin.reshard_after_forward)

    def make_root(self, model: nn.Module, plugin: EngineSettings) -> nn.Module:
        return shard_module(model, plugin, reshard_after_forward=None)  # FSDP2 keeps the root gathered for backward

    def checkpoint_block(self, block: nn.Module, plugin: EngineSettings) -> nn.Module:
        return _checkpointed(block) if plugin.activation_checkpointing else block

    # ----------------------------------------------------------------- training
    def clip_grad_norm(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """The norm over every process's shards (each replica group holds the same gradients: summed over the
        ``fsdp`` axis only), then each local gradient scaled, as ``torch.nn.utils.clip_grad_norm_`` does."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        norm_type = float(norm_type)
        grads = [p.grad for p in model.parameters() if p.grad is not None]
        local = [g.to_local() if isinstance(g, DTensor) else g for g in grads]
        dev = local[0].device if local else device()
        if local:
            # in fp32 whatever the gradients' dtype: a bf16 sum of squares loses the small contributions
            norms = torch.stack([torch.linalg.vector_norm(g, norm_type, dtype=torch.float32) for g in local])
            total = norms.max() if norm_type == math.inf else (norms ** norm_type).sum()
        else:
            total = torch.zeros((), device=dev)
        sharded = [g for g in grads if isinstance(g, DTensor)]
        if sharded and dist.is_initialized():
            group = sharded[0].device_mesh.get_group(FSDP_AXIS)
            dist.all_reduce(total, op=dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM, group=group)
        total = total if norm_type == math.inf else total ** (1.0 / norm_type)
        # torch.nn.utils.clip_grads_with_norm_'s arithmetic, on the local shards (it takes parameters, not gradients)
        coefficient = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        if local:
            torch._foreach_mul_(local, coefficient.to(local[0].device))
        return total

    # ----------------------------------------------------------------- names and ranks
    def rank_world(self, model: nn.Module) -> tuple[int, int]:
        import torch.distributed as dist

        return dist.get_rank(), dist.get_world_size()

    def original_names(self, model: nn.Module) -> dict[str, str]:
        return {name: name for name, _ in model.named_parameters()}

    # ----------------------------------------------------------------- checkpoints
    def rank_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> RankState:
        """For every tensor, the rows this process holds (the first replica's only), with their offsets; plain
        tensors (buffers, the optimizer's step counters) from rank 0 alone."""
        rank, _ = self.rank_world(model)
        named = {name: t.detach() for name, t in _unique_state(model).items()}
        optim = None
        if optimizer is not None:
            optim, optim_tensors = optimizer_meta(model, optimizer, self.checkpoint_name)
            named.update(optim_tensors)
        entries: dict[str, dict[str, Any]] = {}
        specs: list[tuple[str, tuple[int, ...], torch.dtype]] = []
        sources: dict[str, torch.Tensor] = {}
        placements: dict[str, list[str]] = {}
        for name, t in named.items():
            rows = _rows(t)
            pieces = []
            if rows is not None and _first_replica(t):
                start = [rows[0]] + [0] * (t.dim() - 1)
                stop = [rows[1]] + list(t.shape[1:])
                local = t.to_local()
            elif rows is None and rank == 0:
                start, stop, local = [0] * t.dim(), list(t.shape), t
            else:
                local = None
            if local is not None:
                key = f"{name}#{rank}"  # unique in the whole checkpoint, not only in this file
                pieces.append({"key": key, "start": start, "stop": stop})
                specs.append((key, tuple(local.shape), t.dtype))
                sources[key] = local
            entries[name] = {"shape": list(t.shape), "dtype": dtype_name(t.dtype), "pieces": pieces}
            names = _placement_names(t)
            if names is not None:
                placements[name] = names
        mesh = next((t.device_mesh for t in named.values() if _placement_names(t) is not None), None)
        dtensor = {"device_type": current_device_type(), "placements": placements,
                   "mesh_shape": list(mesh.shape) if mesh is not None else [],
                   "mesh_dim_names": list(mesh.mesh_dim_names or ()) if mesh is not None else []}
        return RankState(specs, lambda key: host_copy(sources[key]),
                         {"engine": self.checkpoint_layout, "devices": self.rank_world(model)[1], "tensors": entries,
                          "optimizer": optim, "dtensor": dtensor})

    def restore(self, ckpt_dir: Path, marker: dict[str, Any], model: nn.Module,
                optimizer: Optional[torch.optim.Optimizer]) -> Restored:
        """Each tensor's rows this process holds, read from the saved pieces that cover them (any saved world size,
        this engine's or XLA FSDP v2's files)."""
        files = [open_listed(ckpt_dir, marker, name) for name in sorted(marker["files"])]
        entries = merge_pieces(files)
        wanted = _unique_state(model)
        missing = [n for n in wanted if n not in entries]
        saved_model = {n for n in entries if n.startswith(MODEL_PREFIX)}
        if missing or len(wanted) != len(saved_model):
            extra = sorted(saved_model - set(wanted))
            raise CheckpointError(f"{ckpt_dir} was saved from a different model: missing {missing[:3]}, unexpected {extra[:3]}")
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            for name, t in wanted.items():
                if tuple(entries[name]["shape"]) != tuple(t.shape):
                    raise CheckpointError(f"{name} is {entries[name]['shape']} in {ckpt_dir} but {list(t.shape)} in the "
                                          "model")
                local = t.to_local() if isinstance(t, DTensor) else t
                local.copy_(_read_local(entries[name], t))
            if optimizer is not None:
                self._restore_optimizer(optimizer, model, files[0].meta, entries, files[0].path.with_suffix(".json"))
        for f in files:  # the checksums of the tensors read only in part
            f.finish_verification()
        rank, _ = self.rank_world(model)
        meta = files[0].meta
        return Restored(meta, files[rank % len(files)],
                        {"saved_world_size": len(files), "saved_devices": meta.get("devices")})

    def _restore_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, meta: dict[str, Any],
                           entries: dict[str, dict[str, Any]], source: Path) -> None:
        from torch.distributed.tensor import DTensor

        saved = saved_optimizer(meta, model, optimizer, self.checkpoint_name, source=source)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        state: dict[int, dict[str, Any]] = {}
        for name, entry in entries.items():
            key = optimizer_tensor_key(name)
            if key is None:
                continue
            param = params[key[0]]
            if isinstance(param, DTensor) and tuple(entry["shape"]) == tuple(param.shape):
                local = _read_local(entry, param).to(param.to_local().device)
                value: Any = DTensor.from_local(local, param.device_mesh, param.placements, shape=param.shape,
                                                stride=param.stride(), run_check=False)
            else:  # a step counter: the same on every process
                value = read_pieces(entry)
            state.setdefault(key[0], {})[key[1]] = value
        load_optimizer_state(optimizer, saved, state)

    def sync(self) -> None:
        if current_device_type() != "cpu":
            torch.get_device_module(current_device_type()).synchronize()

    def rng_state(self) -> Any:
        return None  # the torch CPU state is saved by every engine; an accelerator's generator is not (yet)

    def set_rng_state(self, state: Any) -> None:
        """Nothing: an XLA RNG state (from a v2 checkpoint) means nothing here."""

    def collectives(self, thread_safe: bool = False) -> Optional[Collectives]:
        from ..checkpoint.codec import SINGLE_PROCESS
        from ..runtime import thread_safe_collectives

        # a gloo group of its own, whatever the training backend (monitored barriers and object gathers need gloo)
        safe = thread_safe_collectives()
        if safe is None:
            return None if thread_safe else SINGLE_PROCESS
        return Collectives(*safe)
