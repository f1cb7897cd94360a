"""The seam between the library and an FSDP engine: everything that differs between engines, once.

An :class:`Engine` is stateless; one instance per engine is registered in :mod:`hf_xla_fsdp.engines`
and chosen from the settings (:func:`~hf_xla_fsdp.engines.engine_for`) or from a wrapped model
(:func:`~hf_xla_fsdp.engines.engine_of`). Code outside ``engines/`` asks the engine and never
tests which engine runs. torch_xla is imported inside methods only.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import torch
from torch import nn

if TYPE_CHECKING:
    from ..checkpoint.readers import RankFile
    from ..plugin import XlaFsdpPlugin

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


def host_copy(tensor: torch.Tensor) -> torch.Tensor:
    """A host tensor no later training step changes: the device's value, or a clone of a host tensor (an
    optimizer's CPU ``step`` counter is updated in place)."""
    tensor = tensor.detach()
    return tensor.clone() if tensor.device.type == "cpu" else tensor.cpu()


#: bytes of device tensors fetched in one batched transfer by :func:`host_copies`
TRANSFER_GROUP_BYTES = 64 << 20


def host_copies(tensors: Sequence[torch.Tensor], group_bytes: int = TRANSFER_GROUP_BYTES) -> list[torch.Tensor]:
    """:func:`host_copy` of each; the device tensors in batched transfers of about ``group_bytes`` each.

    This is what an async save's step waits for. Batching beats one ``.cpu()`` per tensor, but one transfer of
    the whole rank state allocates it twice at once (the runtime's host buffers, then torch's tensors): for the
    3.6 GiB state of benchmarks/async_save.py that took 8.7-11.6 s on XLA:CPU against 2.0-3.1 s in 64 MiB groups,
    whose transient host memory is one group.
    """
    from ..runtime import fetch_to_host

    out = [host_copy(t) if t.device.type == "cpu" else None for t in tensors]
    groups: list[list[int]] = [[]]
    size = 0
    for i, t in enumerate(tensors):
        if t.device.type == "cpu":
            continue
        if size >= group_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += t.numel() * t.element_size()
    for group in groups:
        for i, fetched in zip(group, fetch_to_host([tensors[i].detach() for i in group])):
            out[i] = fetched
    return out


@dataclass
class RankState:
    """What one rank writes: tensor specs in file order, a producer for each (one at a time), JSON metadata.

    ``produce`` returns a fresh host tensor (:func:`host_copy`), so a save may keep it while training goes on.
    """

    specs: list[TensorSpec]
    produce: Callable[[str], torch.Tensor]
    meta: dict[str, Any] = field(default_factory=dict)
    #: every named tensor at once (same contract as ``produce``), when the engine can batch the transfer
    produce_many: Optional[Callable[[list[str]], list[torch.Tensor]]] = None

    def host_tensors(self, names: list[str]) -> list[torch.Tensor]:
        """Fresh host copies of ``names``, batched when the engine can."""
        return self.produce_many(names) if self.produce_many is not None else [self.produce(n) for n in names]


@dataclass
class Restored:
    """What an engine restored from a checkpoint: the metadata to resume from and the file holding this rank's RNG."""

    meta: dict[str, Any]
    rng_file: "RankFile"
    info: dict[str, Any] = field(default_factory=dict)  # saved_world_size, ... (returned to the caller)


class Engine:
    """What an FSDP engine does; the library's one seam between its two engines (and any later one)."""

    #: ``plugin.version`` that selects this engine
    version: int = 0
    #: name in training records and model cards
    name: str = ""
    #: human title for messages and cards
    title: str = ""
    #: tensor layout its rank files use (``checkpoint.readers.LAYOUT_*``)
    checkpoint_layout: str = ""
    #: one process drives every device (SPMD) instead of one process per device
    spmd: bool = False

    # ----------------------------------------------------------------- settings and runtime
    def check_settings(self, plugin: "XlaFsdpPlugin") -> None:
        """Refuse settings this engine cannot honour (called when the plugin is validated)."""

    def check_launch(self, distributed_type: str, source: str) -> None:
        """Refuse an accelerate ``distributed_type`` this engine cannot run under."""

    def setup_runtime(self, plugin: "XlaFsdpPlugin") -> None:
        """Prepare the XLA runtime before any XLA tensor exists (idempotent)."""

    def runtime_ready(self, counted_processes: int) -> bool:
        """False when the process layout was fixed before :meth:`setup_runtime` could run (e.g. SPMD too late)."""
        return True

    # ----------------------------------------------------------------- wrapping
    def unit_class(self) -> type:
        """The engine's FSDP unit class."""
        raise NotImplementedError

    def inner_wrappers(self) -> tuple[type, ...]:
        """Wrapper classes between a unit and the user's module (removed by ``unwrap``)."""
        return ()

    def wrap_block(self, block: nn.Module, plugin: "XlaFsdpPlugin", nested: bool) -> nn.Module:
        """Activation-checkpoint ``block`` if asked, and make it an FSDP unit when ``nested``."""
        raise NotImplementedError

    def wrap_root(self, model: nn.Module, plugin: "XlaFsdpPlugin") -> nn.Module:
        """The outer FSDP unit: shards every parameter no inner unit owns."""
        raise NotImplementedError

    def checkpoint_block(self, block: nn.Module, plugin: "XlaFsdpPlugin") -> nn.Module:
        """``checkpoint_module(block)`` when the plugin asks for activation checkpointing."""
        if not plugin.activation_checkpointing:
            return block
        from torch_xla.distributed.fsdp import checkpoint_module

        return checkpoint_module(block)

    # ----------------------------------------------------------------- training
    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
        """Adjust an optimizer built from the wrapped model's parameters (e.g. to update fp32 master copies)."""

    def prepare_loader(self, loader: Any, plugin: "XlaFsdpPlugin") -> Any:
        """An XLA device loader adjusted for this engine (e.g. inputs split over every device)."""
        return loader

    def clip_grad_norm(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the model's gradients to ``max_norm`` over every shard of every rank; returns the total norm."""
        params = [p for p in model.parameters() if p.grad is not None]
        # in fp32 whatever the gradients' dtype: a bf16 sum of squares loses the small contributions
        local = torch.linalg.vector_norm(
            torch.stack([torch.linalg.vector_norm(p.grad, float(norm_type), dtype=torch.float32) for p in params]),
            float(norm_type)) if params else torch.zeros(())
        total = self.reduce_norm(model, local, float(norm_type))
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return total

    def reduce_norm(self, model: nn.Module, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        """The total norm from this rank's norm of its local gradients."""
        return local

    # ----------------------------------------------------------------- names and ranks
    def rank_world(self, model: nn.Module) -> tuple[int, int]:
        """``(rank, world size)`` as rank files count them."""
        raise NotImplementedError

    def checkpoint_name(self, name: str) -> str:
        """The name a parameter of the wrapped model is saved under in optimizer metadata."""
        return name

    def original_names(self, model: nn.Module) -> dict[str, str]:
        """Wrapped parameter name -> the user's parameter name (a flattened group maps to its flat name)."""
        raise NotImplementedError

    def parameter_origins(self, model: nn.Module) -> dict[str, list[str]]:
        """Wrapped parameter name -> the user's names of every parameter it holds (several for a flat group)."""
        return {name: [orig] for name, orig in self.original_names(model).items()}

    # ----------------------------------------------------------------- checkpoints
    def rank_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> RankState:
        """The tensors (and their metadata) this rank saves for ``model`` and ``optimizer``."""
        raise NotImplementedError

    def restore(self, ckpt_dir: Any, marker: dict[str, Any], model: nn.Module,
                optimizer: Optional[torch.optim.Optimizer]) -> Restored:
        """Load model (and optimizer) state saved by this engine, for any saved world size."""
        raise NotImplementedError
