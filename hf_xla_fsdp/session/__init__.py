"""One session under every entry point: :class:`XlaFsdpSession` (engine resolved once; runtime, models,
optimizers, loaders, preemption) and its :class:`CheckpointManager` (sync or background saves, rotation, the
final ``from_pretrained``-ready save)."""

from .checkpoints import AsyncMode, CheckpointManager
from .optimizers import prepare_optimizer
from .preemption import PreemptionGuard
from .session import XlaFsdpSession

__all__ = ["AsyncMode", "CheckpointManager", "PreemptionGuard", "XlaFsdpSession", "prepare_optimizer"]
