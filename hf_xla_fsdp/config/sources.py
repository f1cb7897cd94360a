"""Where a process's accelerate YAML is when nobody hands it over: under stock ``accelerate launch``.

``hf-xla-fsdp launch`` hands its settings to the script's processes explicitly (``HF_XLA_FSDP_LAUNCH``, see
:mod:`.resolve`). Stock ``accelerate launch`` exports none of the YAML's ``fsdp_config:`` (nor its path) to the
training process, so only there (``HF_XLA_FSDP=1`` through the start-up hook, or ``XlaFsdpAccelerator()`` without
settings) is the YAML looked for, in this order:

1. ``HF_XLA_FSDP_ACCELERATE_CONFIG`` (a path), when set;
2. the ``--config_file`` of the ``accelerate launch`` command line that started this process or one of its
   parents (read from the OS, so ``xmp.spawn`` workers and threads find it too: nothing else names it there);
3. accelerate's default config file, when it exists.

This returns a path; :mod:`.resolve` reads and checks what it holds.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

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


def launched_yaml() -> Path:
    """:func:`find_accelerate_config`, or the one line saying how to give the settings when there is none."""
    path = find_accelerate_config()
    if path is None:
        from ..errors import ConfigError

        raise ConfigError("no accelerate config found: run under `accelerate launch --config_file xla_fsdp.yaml`, set "
                          f"{ENV_CONFIG}, or pass fsdp_plugin=XlaFsdpPlugin(...)")
    return path
