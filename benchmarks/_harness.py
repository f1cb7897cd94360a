"""What every benchmark does: measure in a fresh child process (this script again, with a child flag), which
prints its result as one JSON line; the parent reads that line. And the child's own peak RSS.

Peak RSS of a child is VmHWM from /proc/self/status, read by the child. ``resource.getrusage(RUSAGE_SELF)
.ru_maxrss`` does not work there: Linux carries the parent's peak across subprocess's vfork + execve into
the child's ru_maxrss (measured here: a child of an 813 MiB parent reports 813 MiB, its VmHWM 13 MiB). The
parent cannot get it either: the rusage ``os.wait4(pid)`` returns for that child carries the same 813 MiB.
VmHWM belongs to the address space execve made, so it counts only the child's own pages.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from typing import Any

MIB = 2**20


def vm_hwm_bytes() -> int:
    """Peak resident set size of this process so far (VmHWM), in bytes."""
    with open("/proc/self/status", encoding="ascii") as fh:
        kib = next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:"))
    return kib * 1024


def mib(nbytes: float) -> float:
    """``nbytes`` in MiB, rounded to 0.1."""
    return round(nbytes / MIB, 1)


def emit(result: Mapping[str, Any]) -> None:
    """Print ``result`` as the JSON line ``run_json_child`` reads (the last line of stdout)."""
    print(json.dumps(result), flush=True)


def child_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment with XLA on the CPU, plus ``env``."""
    return {**os.environ, "PJRT_DEVICE": "CPU", **(env or {})}


def run_json_child(args: Sequence[object], *, name: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``python *args`` (each made a ``str``) with ``child_env(env)``; the JSON of its last stdout line.

    Adds ``process_seconds``: the wall time of the whole child, imports and runtime start included.
    Exits with the child's stderr if it fails or prints no JSON; ``name`` says which child it was.
    """
    start = time.perf_counter()
    res = subprocess.run([sys.executable, *map(str, args)], capture_output=True, text=True, env=child_env(env),
                         check=False)
    seconds = time.perf_counter() - start
    if res.returncode != 0:
        raise SystemExit(f"{name} failed (exit code {res.returncode}):\n{res.stderr[-4000:]}")
    lines = res.stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"{name} printed no JSON line:\n{res.stdout[-2000:]}\n{res.stderr[-2000:]}") from None
    result["process_seconds"] = round(seconds, 2)
    return result
