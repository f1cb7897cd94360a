"""Parsers for setting values written as text (JSON, YAML, command lines): dtypes, booleans, integers, sizes.

Each turns a bad value into one ``ConfigError`` line naming the setting and what it accepts.
"""

from __future__ import annotations

import math
import os
from typing import Any, Optional, Union

import torch

from .errors import ConfigError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}


def parse_dtype(value: Union[str, torch.dtype, None], field_name: str) -> Optional[torch.dtype]:
    """Turn a dtype string such as ``"bf16"`` or ``"bfloat16"`` into a ``torch.dtype``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in DTYPES:
            return DTYPES[key]
    raise ConfigError(f"{field_name}={value!r} is not a valid dtype; use one of: {', '.join(sorted(set(DTYPES)))}")


def parse_bool(value: Any, field_name: str) -> bool:
    """``true``/``false`` in any of the spellings JSON, YAML and command lines use."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{field_name}={value!r} must be a boolean (true or false)")


def parse_int(value: Any, field_name: str, minimum: int = 0) -> int:
    """An integer ``>= minimum`` (a float only when whole; never a boolean)."""
    try:
        if isinstance(value, bool):
            raise ValueError
        out = int(value)
        if isinstance(value, float) and out != value:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{field_name}={value!r} must be an integer >= {minimum}") from None
    if out < minimum:
        raise ConfigError(f"{field_name}={value!r} must be an integer >= {minimum}")
    return out


def check_size(value: Any, field_name: str) -> None:
    """Refuse anything that is not a positive byte count or a size string such as ``"5GB"``."""
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if isinstance(value, bool) or (value if isinstance(value, int) else parse_size_to_int(value)) <= 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{field_name}={value!r} is not a size; use bytes or a string such as '5GB' or '500MB'") from None


_OFF = ("", "false", "no", "off", "none", "0", "null")
_ON = ("true", "yes", "on", "1", "auto", "pow2")
#: shortest bucket of ``pad_to_buckets: true`` (powers of two from here up to the model's longest sequence)
MIN_BUCKET = 64


def parse_buckets(value: Any, field_name: str = "pad_to_buckets") -> Union[bool, int, list[int]]:
    """``pad_to_buckets``: True (powers of two), False (off), a multiple (int >= 8) or a list of lengths.

    Text spellings (JSON, YAML, command lines) are accepted: ``"true"``, ``"false"``, ``"64"``, ``"128,256,512"``.
    """
    fix = "use true (powers of two), false, a multiple such as 64, or a list of lengths such as [128, 256, 512]"
    if isinstance(value, bool) or value is None:
        return bool(value)
    if isinstance(value, str):
        text = value.strip().lower()
        if text in _OFF or text in _ON:
            return text in _ON
        parts = [p.strip() for p in text.strip("[]()").split(",") if p.strip()]
        value = parts[0] if len(parts) == 1 else parts
    try:
        if isinstance(value, (list, tuple)):
            lengths = sorted({parse_int(v, field_name, 1) for v in value})
            if not lengths:
                raise ConfigError
            return lengths
        multiple = parse_int(value, field_name, 0)
    except ConfigError:
        raise ConfigError(f"{field_name}={value!r} is not valid; {fix}") from None
    if multiple == 0:
        return False
    if multiple < 8:
        raise ConfigError(f"{field_name}={value!r} is too small a multiple; {fix}")
    return multiple


def parse_cache_dir(value: Any, field_name: str = "compilation_cache_dir") -> Optional[str]:
    """``compilation_cache_dir``: a folder, ``"auto"`` (the default folder), or off (None, "", false, "none")."""
    if value is None or value is False:
        return None
    if value is True:
        return "auto"
    if isinstance(value, (str, bytes)) or hasattr(value, "__fspath__"):
        import os

        text = os.fsdecode(value).strip()
        if text.lower() in _OFF:
            return None
        if text.lower() in ("auto", "true", "yes", "on"):
            return "auto"
        if "://" in text:  # torch_xla reads and writes the folder with local file calls
            raise ConfigError(f"{field_name}={text!r}: the compilation cache needs a local or mounted folder, not a URL")
        return os.path.abspath(os.path.expanduser(text))
    raise ConfigError(f"{field_name}={value!r} must be a folder path, 'auto' or false")


def env_number(name: str, fix: str, *, positive: bool = False) -> Optional[float]:
    """The finite number in environment variable ``name`` (``positive``: above 0), None when unset or blank; one
    ``ConfigError`` line naming it and ``fix`` otherwise."""
    raw = os.environ.get(name, "").strip()
    if not raw:
        return None
    try:
        value = float(raw)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or (positive and value <= 0):
        raise ConfigError(f"${name}={raw!r} is not a {'positive ' if positive else ''}number; {fix}")
    return value

