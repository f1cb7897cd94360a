"""TRL's trainers with XLA FSDP: ``XlaFsdpSFTTrainer`` (and any other through ``xla_fsdp_trainer``).

TRL patches the model it is given (its fused LM head replaces ``forward`` to score tokens without
building the logits) and may attach adapters; :class:`~hf_xla_fsdp.integrations.trainer.XlaFsdpTrainerMixin`
adds the outer FSDP unit only after that, so the patched forward runs inside the unit. Needs the
``finetune`` extra.
"""

from __future__ import annotations

from ..errors import ConfigError
from .trainer import xla_fsdp_trainer

try:
    from trl import SFTTrainer
except ImportError:
    raise ConfigError("XlaFsdpSFTTrainer needs trl, which is not installed: pip install 'hf_xla_fsdp[finetune]'") from None

XlaFsdpSFTTrainer = xla_fsdp_trainer(SFTTrainer)

__all__ = ["XlaFsdpSFTTrainer"]
