"""Where a process's XLA FSDP settings come from when nobody hands them over: the accelerate YAML it was launched
with, and the ``--fsdp_config`` of its command line (for ``HfArgumentParser`` scripts).

With ``distributed_type: XLA`` accelerate runs the script's ``main()`` through ``xmp.spawn`` and passes none of the
YAML's ``fsdp_config:`` settings on, so :func:`find_accelerate_config` finds the YAML itself, in this order:

1. ``HF_XLA_FSDP_ACCELERATE_CONFIG`` (a path), when set;
2. the ``--config_file`` of the ``accelerate launch`` command line that started this process or one of its
   parents (read from the OS, so ``xmp.spawn`` workers and threads find it too);
3. accelerate's default config file, when it exists.

These return paths and raw values; :class:`~hf_xla_fsdp.plugin.XlaFsdpPlugin` validates them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Optional, Sequence

ENV_CONFIG = "HF_XLA_FSDP_ACCELERATE_CONFIG"


def _config_from_cmdline(cmd: Sequence[str]) -> Optional[str]:
    """The ``--config_file`` value of an ``accelerate launch`` command line, if ``cmd`` is one."""
    names = [Path(c).name for c in cmd[:3]]
    launched = ("accelerate" in names and "launch" in cmd) or "accelerate-launch" in names or any(
        "accelerate.commands.launch" in c or "accelerate.commands.accelerate_cli" in c for c in cmd[:4])
    if not launched:
        return None
    for i, arg in enumerate(cmd):
        if arg in ("--config_file", "--config-file") and i + 1 < len(cmd):
            return cmd[i + 1]
        for flag in ("--config_file=", "--config-file="):
            if arg.startswith(flag):
                return arg[len(flag):]
    return ""  # launched without --config_file: accelerate used its default file


def find_accelerate_config() -> Optional[Path]:
    """The accelerate YAML this process was launched with (see the module docstring for the order)."""
    explicit = os.environ.get(ENV_CONFIG)
    if explicit:
        return Path(explicit)
    import psutil

    proc: Optional[psutil.Process] = psutil.Process()
    while proc is not None:
        try:
            found = _config_from_cmdline(proc.cmdline())
            if found:
                path = Path(found)
                return path if path.is_absolute() else Path(proc.cwd()) / path
            if found == "":
                break
            proc = proc.parent()
        except psutil.Error:
            break
    from accelerate.commands.config import default_config_file

    return Path(default_config_file) if Path(default_config_file).is_file() else None


def fsdp_config_from_argv(argv: Optional[list[str]] = None) -> Any:
    """The ``--fsdp_config`` value a ``HfArgumentParser`` script will read from ``argv`` (default ``sys.argv[1:]``).

    A path or a parsed inline JSON object; also the ``fsdp_config`` of a lone ``args.json`` / ``.yaml`` file
    (``parser.parse_json_file``). ``None`` when there is none.
    """
    import sys

    argv = sys.argv[1:] if argv is None else list(argv)
    value: Any = None
    for i, arg in enumerate(argv):
        if arg in ("--fsdp_config", "--fsdp-config") and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(("--fsdp_config=", "--fsdp-config=")):
            value = arg.split("=", 1)[1]
    if (value is None and len(argv) == 1 and argv[0].endswith((".json", ".yaml", ".yml")) and os.path.isfile(argv[0])
            and os.path.getsize(argv[0]) < 1 << 20):  # an arguments file, not a data set
        with open(argv[0], encoding="utf-8") as f:
            if argv[0].endswith(".json"):
                data = json.load(f)
            else:
                import yaml

                data = yaml.safe_load(f)
        value = data.get("fsdp_config") if isinstance(data, dict) else None
    if isinstance(value, str) and value.lstrip().startswith("{"):
        value = json.loads(value)
    return value or None
