"""Small helpers over the XLA runtime: device, graph cuts, process rank/count, barriers and RNG.

torch_xla is imported inside each function: importing it starts its runtime, which config-only
users and consolidation never need. This module imports nothing of ours.
"""

from __future__ import annotations

import torch


def xla_device() -> torch.device:
    """The XLA device of this process."""
    import torch_xla

    return torch_xla.device()


def sync() -> None:
    """Cut the lazy graph here and run it (``xm.mark_step``)."""
    import torch_xla

    torch_xla.sync()


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


def get_xla_rng_state() -> int:
    """The XLA RNG seed state of this process."""
    import torch_xla.core.xla_model as xm

    return int(xm.get_rng_state())


def set_xla_rng_state(state: int) -> None:
    """Restore what :func:`get_xla_rng_state` returned."""
    import torch_xla.core.xla_model as xm

    xm.set_rng_state(state)
