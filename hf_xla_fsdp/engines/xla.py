"""What the engines on torch_xla share: :class:`XlaEngine`, the torch_xla defaults of :class:`~.base.Engine`.

The XLA runtime (PJRT) owns the device, the processes, their rendezvous and the RNG; every step is traced into XLA
graphs, which its persistent cache keeps. Processes on a host are started with ``xmp.spawn``, one per device; hosts of
a pod are joined by the runtime itself (the same command on every host), not by a launcher's rendezvous.
torch_xla is imported inside methods only: importing this module starts no runtime.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..checkpoint.codec import Collectives
from ..errors import ConfigError
from .base import Engine, EngineSettings, Machines

__all__ = ["XLA_COMPILES", "XlaEngine"]

#: why the XLA engines refuse ``compile``
XLA_COMPILES = ("the XLA engines compile every step into XLA graphs already (torch_xla traces them); remove compile, or "
                "use engine=fsdp2")


def _spawned(index: int, process_main: Callable[[], None]) -> None:
    """One process of ``xmp.spawn``, which passes its local index first (the runtime knows it too)."""
    process_main()


class XlaEngine(Engine):
    """An engine on torch_xla: its device, processes, collectives, RNG, activation checkpointing and process start."""

    runtime_module = "torch_xla"
    runtime_extra = "xla"
    runtime_alternative = ", or use engine='fsdp2' (torch's own FSDP2, no torch_xla)"
    compiles_graphs = True
    compilation_cache = True

    # ----------------------------------------------------------------- the runtime's processes
    def device(self) -> torch.device:
        from ..runtime import xla_device

        return xla_device()

    def multi_process(self) -> bool:
        from ..runtime import multi_process

        return multi_process()

    def process_index(self) -> int:
        from ..runtime import process_index

        return process_index()

    def process_count(self) -> int:
        from ..runtime import process_count

        return process_count()

    def gather_bytes(self, payload: bytes, tag: str) -> list[bytes]:
        from ..runtime import all_gather_bytes

        return all_gather_bytes(payload, tag=tag)

    def runtime_too_late(self, what: str) -> str:
        return f"{what} started the XLA runtime before {self.title} could set it up"

    # ----------------------------------------------------------------- launching
    def start_processes(self, count: int, launcher_arguments: list[str], machines: Optional[Machines] = None,
                        process_main: Optional[Callable[[], None]] = None) -> int:
        """``count`` processes with ``xmp.spawn`` (PJRT), one per local device, each running ``process_main``; on
        XLA:CPU the device count is the process count. An error in a process ends the launch with its exception."""
        if process_main is None:
            raise TypeError("XLA engines start processes with xmp.spawn, which runs process_main; pass it")
        if os.environ.get("PJRT_DEVICE", "CPU").upper() == "CPU":
            os.environ["CPU_NUM_DEVICES"] = str(count)
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(_spawned, args=(process_main,))
        return 0

    def check_machines(self, machines: Machines) -> None:
        """The XLA engines span hosts through the XLA runtime (the same command on every host of a pod), not through a
        launcher's rendezvous: machine flags are refused."""
        if machines.several or any("main_process_" in g for g in machines.given):
            what = ", ".join(machines.given) or f"num_machines={machines.count}"
            raise ConfigError(f"{what}: {self.title} does not start processes across machines; on a TPU pod run the "
                              "same hf-xla-fsdp launch command on every host without machine flags (the XLA runtime "
                              "connects them), or choose engine fsdp2 (--fsdp_config '{\"engine\": \"fsdp2\"}') to "
                              "run torch.distributed across machines")

    # ----------------------------------------------------------------- wrapping
    def checkpoint_block(self, block: nn.Module, plugin: EngineSettings) -> nn.Module:
        """``checkpoint_module(block)`` (torch_xla's, whose recomputation the XLA compiler cannot merge away)."""
        if not plugin.activation_checkpointing:
            return block
        from torch_xla.distributed.fsdp import checkpoint_module

        return checkpoint_module(block)

    # ----------------------------------------------------------------- state
    def sync(self) -> None:
        """Cut the lazy graph and run it, so pending updates land before values are read."""
        from ..runtime import sync

        sync()

    def rng_state(self) -> Any:
        """This process's XLA RNG state."""
        from ..runtime import get_xla_rng_state

        return get_xla_rng_state()

    def set_rng_state(self, state: Any) -> None:
        from ..runtime import set_xla_rng_state

        set_xla_rng_state(state)

    def collectives(self, thread_safe: bool = False) -> Optional[Collectives]:
        """The XLA runtime's rendezvous between processes (a no-op in one process). XLA collectives belong to the
        training thread: ``thread_safe`` gives torch.distributed's over a gloo group of their own instead, or None
        when torch.distributed is not initialized."""
        from ..runtime import default_barrier, default_gather, thread_safe_collectives

        if not thread_safe:
            return Collectives(default_barrier, default_gather)
        safe = thread_safe_collectives()
        return None if safe is None else Collectives(*safe)
