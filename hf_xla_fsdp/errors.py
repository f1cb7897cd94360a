"""Every exception hf_xla_fsdp raises on purpose; each message is one line naming the problem and the fix.

This module imports nothing, so any part of the package can raise these without an import cycle.
"""

from __future__ import annotations


class XlaFsdpError(Exception):
    """Base class of the library's own errors."""


class ConfigError(XlaFsdpError, ValueError):
    """A setting or an input is invalid; the message names the field (or file) and the allowed values."""


class CheckpointError(ConfigError):
    """A checkpoint is missing, incomplete, inconsistent or unreadable; the message says which file."""


class PushError(XlaFsdpError, RuntimeError):
    """Uploading to the Hub failed; the exported directory is complete and can be pushed later."""


__all__ = ["XlaFsdpError", "ConfigError", "CheckpointError", "PushError"]
