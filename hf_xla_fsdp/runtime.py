"""Small helpers over the XLA runtime: device, graph cuts, process rank/count, barriers, byte gathers and RNG.

torch_xla is imported inside each function: importing it starts its runtime, which config-only
users and consolidation never need. Of ours, this module imports only :mod:`hf_xla_fsdp.errors` and
:mod:`hf_xla_fsdp.process` (the process state keeps the background saves' collectives group).
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Any, Callable, Optional

import torch

from .errors import ConfigError


def xla_device() -> torch.device:
    """The XLA device of this process."""
    import torch_xla

    return torch_xla.device()


def sync() -> None:
    """Cut the lazy graph here and run it (``xm.mark_step``)."""
    import torch_xla

    torch_xla.sync()


def fetch_to_host(tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    """New host tensors with the values of XLA ``tensors``, in one batched transfer (pending work synced first)."""
    import torch_xla

    if not tensors:
        return []
    fetch = getattr(torch_xla._XLAC, "_xla_get_cpu_tensors", None)  # what xm._maybe_convert_to_cpu uses
    return list(fetch(tensors)) if fetch is not None else [t.cpu() for t in tensors]


def wait_device_ops() -> None:
    """Block until every computation in flight on the devices has finished."""
    import torch_xla.core.xla_model as xm

    xm.wait_device_ops()


def process_index() -> int:
    """This process's index among the runtime's processes."""
    import torch_xla.runtime as xr

    return xr.process_index()


def process_count() -> int:
    """Number of processes of the runtime."""
    import torch_xla.runtime as xr

    return xr.process_count()


def device_count() -> int:
    """Number of devices every process of the runtime addresses together."""
    import torch_xla.runtime as xr

    return xr.global_runtime_device_count()


def device_memory_bytes() -> Optional[int]:
    """Memory of one XLA device as the runtime reports it (``bytes_limit``), None when it reports none (XLA:CPU)."""
    import torch_xla
    import torch_xla.core.xla_model as xm

    try:
        limit = xm.get_memory_info(torch_xla.device()).get("bytes_limit")
    except RuntimeError:  # "GetAllocatorStats is not supported" on XLA:CPU
        return None
    return int(limit) if limit else None


def is_spmd() -> bool:
    """True once this process runs in SPMD mode (one process drives every local device)."""
    import torch_xla.runtime as xr

    return xr.is_spmd()


def multi_process() -> bool:
    """True when several replica processes take part (FSDP v1 over more than one process)."""
    import torch_xla.runtime as xr

    return xr.world_size() > 1


def default_barrier(tag: str) -> None:
    """``xm.rendezvous(tag)`` when several processes run; nothing otherwise."""
    if multi_process():
        import torch_xla.core.xla_model as xm

        xm.rendezvous(tag)


def default_gather(tag: str, payload: bytes) -> list[bytes]:
    """Every process's ``payload`` on every process, in process order: ``xm.rendezvous(tag, payload)`` when several
    processes run, ``[payload]`` otherwise."""
    if multi_process():
        import torch_xla.core.xla_model as xm

        return list(xm.rendezvous(tag, payload))
    return [payload]


#: the smallest all-gather buffer of :func:`all_gather_bytes`; payloads are padded to a power of two from here, so a
#: run compiles one gather graph per size class rather than one per payload length
GATHER_MIN_BYTES = 1 << 12


def gather_buffer_size(length: int) -> int:
    """The padded length all replicas send for a longest payload of ``length`` bytes: a power of two, at least
    :data:`GATHER_MIN_BYTES`."""
    size = GATHER_MIN_BYTES
    while size < length:
        size <<= 1
    return size


def all_gather_bytes(payload: bytes, tag: str = "hf_xla_fsdp.all_gather_bytes") -> list[bytes]:
    """Every process's ``payload`` on every process, in process order.

    Replica processes (FSDP v1, one device each): two XLA all-gathers on the training thread, the lengths and then
    the bytes padded to :func:`gather_buffer_size` of the longest, so payloads of any length reuse a few compiled
    graphs (``xm.rendezvous`` pads to the exact longest length: one new graph per length, and it copies the bytes
    through a Python list). In one replica process it is the same collective over one replica. Under SPMD one
    process drives every device: its payload alone, or, with several SPMD processes, torch.distributed's
    gather (:func:`dist_gather`), which must be initialized.
    """
    if is_spmd():
        if process_count() == 1:
            return [payload]
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()):
            raise ConfigError(f"{tag}: gathering objects over {process_count()} SPMD processes needs torch.distributed; "
                              "call torch.distributed.init_process_group('gloo') in every process first")
        return dist_gather()(tag, payload)
    import torch_xla.core.xla_model as xm

    device = xla_device()
    sync()  # pending work stays its own graph
    lengths = fetch_to_host([xm.all_gather(torch.tensor([len(payload)], dtype=torch.int64, device=device))])[0]
    lengths = [int(n) for n in lengths.tolist()]
    padded = gather_buffer_size(max(lengths))
    buffer = torch.zeros(padded, dtype=torch.uint8)
    if payload:
        buffer[:len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    gathered = fetch_to_host([xm.all_gather(buffer.to(device))])[0].numpy()
    return [gathered[i * padded:i * padded + n].tobytes() for i, n in enumerate(lengths)]


def _to_xla_device(tensor: torch.Tensor) -> torch.Tensor:
    """A gathered tensor that was on an XLA device goes to this process's XLA device (as CUDA tensors do in
    torch.distributed's ``all_gather_object``)."""
    return tensor.to(xla_device())


def all_gather_objects(obj: Any) -> list[Any]:
    """Every process's picklable ``obj``, gathered on every process in process order: accelerate's ``gather_object``
    on XLA.

    As accelerate does for byte-padded gathers: a list contributes its items, anything else (dict, tensor, string,
    number, tuple) one item, so one process gives ``obj`` itself for a list and ``[obj]`` otherwise. XLA tensors come
    back on this process's XLA device, CPU tensors on the CPU. Every process must call it (on the training thread):
    the pickled bytes go through :func:`all_gather_bytes`.
    """
    import io
    import pickle

    class _ObjectPickler(pickle.Pickler):
        # XLA tensors through a host copy (plain pickling goes through numpy, which has no bfloat16)
        def reducer_override(self, obj: Any) -> Any:
            if isinstance(obj, torch.Tensor) and obj.device.type == "xla":
                return _to_xla_device, (obj.detach().cpu(),)
            return NotImplemented

    buffer = io.BytesIO()
    _ObjectPickler(buffer, protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
    gathered: list[Any] = []
    for payload in all_gather_bytes(buffer.getvalue(), tag="gather_object"):
        # our own processes' pickles, as torch.distributed.all_gather_object unpickles them
        part = pickle.loads(payload)  # noqa: S301
        if isinstance(part, list):
            gathered.extend(part)
        else:
            gathered.append(part)
    return gathered


# --------------------------------------------------------------------------- torch.distributed stand-ins
# For processes coordinated by torch.distributed (e.g. gloo over TCP) rather than the XLA runtime: a barrier and
# an all-gather for save_checkpoint(barrier=..., gather=...). Both end after ``timeout`` seconds, and on
# rank 0 the error names the ranks that never arrived (monitored_barrier with wait_all_ranks).
_MISSING = re.compile(r"Ranks? ([\d, ]+) failed to pass monitoredBarrier")


def _monitored_barrier(tag: str, timeout: float, group: Any = None) -> None:
    import torch.distributed as dist

    try:
        dist.monitored_barrier(group=group, timeout=timedelta(seconds=timeout), wait_all_ranks=True)
    except RuntimeError as err:
        found = _MISSING.search(str(err))
        if found:
            missing = [int(r) for r in found.group(1).replace(" ", "").split(",") if r]
            raise TimeoutError(f"rank(s) {missing} did not reach {tag} within {timeout:g} s") from None
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise TimeoutError(f"{tag} failed on rank {dist.get_rank()}: {first}") from None


def dist_barrier(timeout: float = 600.0, group: Any = None) -> Callable[[str], None]:
    """A barrier over a torch.distributed process group (default: the default group) that ends after ``timeout``
    seconds."""
    return lambda tag: _monitored_barrier(tag, timeout, group)


def dist_gather(timeout: float = 600.0, group: Any = None) -> Callable[[str, bytes], list[bytes]]:
    """Every rank's bytes on every rank, in rank order, over a torch.distributed process group (default: the
    default group), as ``xm.rendezvous``; after ``timeout`` seconds without every rank it ends, naming the missing
    ranks on rank 0."""
    def gather(tag: str, payload: bytes) -> list[bytes]:
        import torch.distributed as dist

        _monitored_barrier(tag, timeout, group)  # every rank has arrived, or the missing ones are named
        out: list[Optional[bytes]] = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, payload, group=group)
        return [b if b is not None else b"" for b in out]

    return gather


def thread_safe_collectives(timeout: float = 600.0
                            ) -> Optional[tuple[Callable[[str], None], Callable[[str, bytes], list[bytes]]]]:
    """A barrier and a gather that may run outside the training thread (a background save): torch.distributed's
    over a gloo group of their own, created on first use (every rank must call this at the same point). None when
    torch.distributed is not initialized."""
    import torch.distributed as dist

    from .process import process_state

    if not (dist.is_available() and dist.is_initialized()):
        return None
    state = process_state()
    if state.save_group is None:  # its own group: the training thread's collectives never interleave with the save's
        state.save_group = dist.new_group(backend="gloo")
    return dist_barrier(timeout, state.save_group), dist_gather(timeout, state.save_group)


def get_xla_rng_state() -> int:
    """The XLA RNG seed state of this process."""
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_xla_rng_state(state: int) -> None:
    """Restore what :func:`get_xla_rng_state` returned."""
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(state)
