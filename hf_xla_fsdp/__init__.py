"""hf_xla_fsdp: PyTorch/XLA Fully Sharded Data Parallel for the Hugging Face stack."""

from typing import Any

from .hub_export import export
from .plugin import ConfigError, XlaFsdpPlugin

__version__ = "0.1.0"
__all__ = ["ConfigError", "XlaFsdpPlugin", "XlaFsdpTrainer", "export", "__version__"]


def __getattr__(name: str) -> Any:
    # the Trainer pulls in transformers (and torch_xla); config-only users and the CLI should not pay for it
    if name == "XlaFsdpTrainer":
        from .trainer_glue import XlaFsdpTrainer

        return XlaFsdpTrainer
    raise AttributeError(f"module 'hf_xla_fsdp' has no attribute {name!r}")
