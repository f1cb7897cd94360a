"""hf_xla_fsdp: PyTorch/XLA Fully Sharded Data Parallel for the Hugging Face stack."""

from typing import Any

from .errors import CheckpointError, ConfigError, PushError, XlaFsdpError

__version__ = "0.3.0"
__all__ = ["CheckpointError", "ConfigError", "PushError", "XlaFsdpAccelerator", "XlaFsdpDPOTrainer", "XlaFsdpError",
           "XlaFsdpGRPOTrainer", "XlaFsdpPlugin", "XlaFsdpRewardTrainer", "XlaFsdpSFTTrainer", "XlaFsdpSession",
           "XlaFsdpTrainer", "XlaFsdpTrainerMixin", "enable_spmd", "export", "xla_fsdp_trainer", "__version__"]

# one warning line when an installed package lies outside the range the tests ran with (metadata only: cheap)
from .upstream import check_versions as _check_versions  # noqa: E402

_check_versions(__version__)


# every public name but the errors is imported on first use: torch (and transformers, accelerate, torch_xla) cost
# seconds, which `hf-xla-fsdp --help` and config-only users should not pay; importing the package patches nothing
_LAZY = {"XlaFsdpPlugin": "plugin", "enable_spmd": "engines.v2", "XlaFsdpSession": "session",
         "XlaFsdpTrainer": "integrations.trainer", "XlaFsdpTrainerMixin": "integrations.trainer",
         "xla_fsdp_trainer": "integrations.trainer", "XlaFsdpAccelerator": "integrations.accelerate",
         "XlaFsdpSFTTrainer": "integrations.trl", "XlaFsdpDPOTrainer": "integrations.trl",
         "XlaFsdpGRPOTrainer": "integrations.trl", "XlaFsdpRewardTrainer": "integrations.trl"}


def __getattr__(name: str) -> Any:
    import importlib

    if name == "export":  # the subpackage, callable as export.hub.export (see hf_xla_fsdp/export/__init__.py)
        return importlib.import_module(f"{__name__}.export")
    if name in _LAZY:
        return getattr(importlib.import_module(f"{__name__}.{_LAZY[name]}"), name)
    raise AttributeError(f"module 'hf_xla_fsdp' has no attribute {name!r}")
