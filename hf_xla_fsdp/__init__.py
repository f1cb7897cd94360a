"""hf_xla_fsdp: PyTorch/XLA Fully Sharded Data Parallel for the Hugging Face stack."""

from .hub_export import export
from .plugin import ConfigError, XlaFsdpPlugin

__version__ = "0.1.0"
__all__ = ["ConfigError", "XlaFsdpPlugin", "export", "__version__"]
