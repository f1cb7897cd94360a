"""What saving and loading ask of the engine that wrapped a model: its checkpoint codec.

The file protocol (:mod:`.save`, :mod:`.load`) is the same for every engine; what a rank's tensors are, how they
go back onto the devices, how processes meet and where the XLA RNG lives differ per engine. An engine implements
:class:`CheckpointCodec` and tags every FSDP unit it makes with itself (:data:`CODEC_ATTR`), so this package finds
it on the model and never imports an engine (nor torch_xla): consolidation and inspection run with torch alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, Protocol

import torch
from torch import nn

from ..errors import ConfigError

if TYPE_CHECKING:
    from .readers import RankFile

#: attribute of every FSDP unit an engine makes: the engine itself
CODEC_ATTR = "_hf_xla_fsdp_engine"

TensorSpec = tuple[str, tuple[int, ...], torch.dtype]


@dataclass
class RankState:
    """What one rank writes: tensor specs in file order, a producer for each (one at a time), JSON metadata.

    ``produce`` returns a fresh host tensor, so a save may keep it while training goes on.
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


@dataclass(frozen=True)
class Collectives:
    """How the ranks of a save meet: ``barrier(tag)`` and ``gather(tag, payload) -> every rank's payload``."""

    barrier: Callable[[str], None]
    gather: Callable[[str, bytes], list[bytes]]


#: one process: nobody to wait for, its own payload is every payload
SINGLE_PROCESS = Collectives(barrier=lambda tag: None, gather=lambda tag, payload: [payload])


class CheckpointCodec(Protocol):
    """The engine side of a checkpoint (implemented by :class:`hf_xla_fsdp.engines.base.Engine`)."""

    #: the tensor layout of its rank files (``readers.LAYOUT_*``)
    checkpoint_layout: str
    #: name in training records, and human title for messages and model cards (rank files record both, so a
    #: checkpoint names the engine that wrote it without this package knowing any engine)
    name: str
    title: str

    def rank_world(self, model: nn.Module) -> tuple[int, int]:
        """``(rank, world size)`` as rank files count them."""

    def rank_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> RankState:
        """The tensors (and their metadata) this rank saves."""

    def restore(self, ckpt_dir: Path, marker: dict[str, Any], model: nn.Module,
                optimizer: Optional[torch.optim.Optimizer]) -> Restored:
        """Load model (and optimizer) state saved by this engine, for any saved world size."""

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the FSDP units."""

    def sync(self) -> None:
        """Let pending device updates land before values are read."""

    def rng_state(self) -> Any:
        """The device RNG state of this process (JSON-serialisable)."""

    def set_rng_state(self, state: Any) -> None:
        """Restore what :meth:`rng_state` returned."""

    def collectives(self, thread_safe: bool = False) -> Optional[Collectives]:
        """How this process layout's ranks meet; ``thread_safe``: usable outside the training thread (None if
        there is no such way)."""


def codec_of(model: nn.Module) -> CheckpointCodec:
    """The codec of the engine whose units wrap ``model``."""
    for module in model.modules():
        codec = module.__dict__.get(CODEC_ATTR)
        if codec is not None:
            return codec
    raise ConfigError(f"{type(model).__name__} is not wrapped with XLA FSDP; wrap it with XlaFsdpPlugin.wrap or build it "
                      "with XlaFsdpPlugin.build first")


def tag(unit: nn.Module, codec: CheckpointCodec) -> nn.Module:
    """Mark ``unit`` as made by ``codec``'s engine (found again by :func:`codec_of`); returns ``unit``."""
    unit.__dict__[CODEC_ATTR] = codec
    return unit
