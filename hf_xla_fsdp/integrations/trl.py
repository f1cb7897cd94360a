"""TRL's trainers with XLA FSDP: ``XlaFsdpSFTTrainer``, ``XlaFsdpDPOTrainer``, ``XlaFsdpGRPOTrainer``,
``XlaFsdpRewardTrainer`` (and any other through ``xla_fsdp_trainer``).

Each is TRL's class with :class:`~hf_xla_fsdp.integrations.trainer.XlaFsdpTrainerMixin` first: it takes the TRL
class's own arguments (``DPOTrainer(model, ref_model, args, ...)``, ``GRPOTrainer(model, reward_funcs, args, ...)``)
and a TRL config as ``args``. The models TRL builds in its ``__init__`` (policy, reference, reward models named by
path) are built by the session block by block (:mod:`~hf_xla_fsdp.integrations.trl_hooks`): references and reward
models in evaluation mode. TRL patches the model it is given (its fused LM head replaces ``forward``) and may attach
adapters; the mixin adds the outer FSDP unit only after that, so the patched forward runs inside the unit. Needs the
``finetune`` extra.
"""

from __future__ import annotations

from ..errors import ConfigError
from .trainer import xla_fsdp_trainer

try:
    from trl import DPOTrainer, GRPOTrainer, RewardTrainer, SFTTrainer
except ImportError:
    raise ConfigError("hf_xla_fsdp's TRL trainers need trl, which is not installed: pip install 'hf_xla_fsdp[finetune]'"
                      ) from None

XlaFsdpSFTTrainer = xla_fsdp_trainer(SFTTrainer)
XlaFsdpDPOTrainer = xla_fsdp_trainer(DPOTrainer)
XlaFsdpGRPOTrainer = xla_fsdp_trainer(GRPOTrainer)
XlaFsdpRewardTrainer = xla_fsdp_trainer(RewardTrainer)

__all__ = ["XlaFsdpDPOTrainer", "XlaFsdpGRPOTrainer", "XlaFsdpRewardTrainer", "XlaFsdpSFTTrainer"]
