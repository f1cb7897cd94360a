"""What every benchmark does: measure in a fresh child process (this script again, with a child flag), which
prints its result as one JSON line; the parent reads that line. And the child's own peak RSS.

Peak RSS of a child is VmHWM from /proc/self/status, read by the child. ``resource.getrusage(RUSAGE_SELF)
.ru_maxrss`` does not work there: Linux carries the parent's peak across subprocess's vfork + execve into
the child's ru_maxrss (measured here: a child of an 813 MiB parent reports 813 MiB, its VmHWM 13 MiB). The
parent cannot get it either: the rusage ``os.wait4(pid)`` returns for that child carries the same 813 MiB.
VmHWM belongs to the address space execve made, so it counts only the child's own pages.

Every benchmark takes ``--smoke`` (``add_smoke_flag``): the same code paths and report on tiny sizes
(``SMOKE_LLAMA``, a few steps), so tests/e2e/test_benchmarks.py can run each one in seconds and a script that
no longer runs on today's code fails the suite. A smoke report measures nothing worth quoting; it says
``"smoke": true``. Every benchmark prints its report last, as ONE JSON line (``emit``): pipe it through
``python -m json.tool`` to read it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from argparse import ArgumentParser
from collections.abc import Mapping, Sequence
from typing import Any

MIB = 2**20

#: the model of every ``--smoke`` run: a 2-layer Llama of ~0.1 M parameters (4 heads and 2 KV heads, so a tensor
#: parallel size of 2 divides both; 64 wide, so XLA FSDP v1's 128-element shard padding is exercised)
SMOKE_LLAMA: dict[str, Any] = {
    "vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128, "tie_word_embeddings": False}


def add_smoke_flag(parser: ArgumentParser) -> None:
    """Add ``--smoke``: tiny sizes and the fewest runs that still go through every part of the script."""
    parser.add_argument("--smoke", action="store_true",
                        help="tiny model and sizes, seconds per child process: checks that the script runs and "
                             "reports on today's code (the suite runs it); its figures mean nothing")


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


#: set by benchmarks/_smoke.py: children are forked from this (already imported) process instead of started afresh
FORK_ENV = "HF_XLA_FSDP_BENCH_FORK"


def run_json_child(args: Sequence[object], *, name: str, env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Run ``python *args`` (each made a ``str``) with ``child_env(env)``; the JSON of its last stdout line.

    Adds ``process_seconds``: the wall time of the whole child, imports and runtime start included.
    Exits with the child's stderr if it fails or prints no JSON; ``name`` says which child it was.
    Under benchmarks/_smoke.py (``FORK_ENV`` set) the child is a fork of this process running the script's
    ``__main__`` (see ``run_forked``): the same code on the same arguments, without paying the imports again.
    """
    start = time.perf_counter()
    argv, full_env = [str(a) for a in args], child_env(env)
    # only a script runs as a fork's __main__; ``-c``/``-m`` children start an interpreter as users would
    if os.environ.get(FORK_ENV) == "1" and not argv[0].startswith("-") and not _xla_runtime_started():
        returncode, stdout, stderr = run_forked(argv, full_env, new_group=False)
    else:
        res = subprocess.run([sys.executable, *argv], capture_output=True, text=True, env=full_env, check=False)
        returncode, stdout, stderr = res.returncode, res.stdout, res.stderr
    seconds = time.perf_counter() - start
    if returncode != 0:
        raise SystemExit(f"{name} failed (exit code {returncode}):\n{stderr[-4000:]}")
    lines = stdout.strip().splitlines()
    try:
        result = json.loads(lines[-1])
    except (IndexError, json.JSONDecodeError):
        raise SystemExit(f"{name} printed no JSON line:\n{stdout[-2000:]}\n{stderr[-2000:]}") from None
    result["process_seconds"] = round(seconds, 2)
    return result


def _xla_runtime_started() -> bool:
    """Whether this process runs an XLA runtime (a fork of it would inherit a client whose threads are gone)."""
    xlac = sys.modules.get("torch_xla._XLAC")
    return bool(xlac is not None and xlac._xla_runtime_is_initialized())


def run_forked(argv: Sequence[str], env: Mapping[str, str], timeout: float | None = None,
               new_group: bool = True) -> tuple[int, str, str]:
    """Run script ``argv[0]`` with arguments ``argv[1:]`` as ``__main__`` in a fork of this process.

    The fork takes ``env`` as its whole environment before any of the script runs, so what the XLA runtime reads
    when it starts (``CPU_NUM_DEVICES``, ``PJRT_DEVICE``) applies: this process must not have started one. Returns
    the exit code (``-signal`` if killed, also after ``timeout`` seconds), stdout and stderr. With ``new_group``
    the fork leads a new process group, which a timeout kills whole (the forks and processes it started itself
    stay in that group).
    """
    import runpy
    import signal
    import tempfile
    import traceback

    script = str(argv[0])
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:  # the child: never returns into the caller's code
            code = 1
            try:
                os.dup2(out.fileno(), 1)
                os.dup2(err.fileno(), 2)
                if new_group:
                    os.setpgid(0, 0)
                os.environ.clear()
                os.environ.update(env)
                sys.argv = [script, *argv[1:]]
                sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
                runpy.run_path(script, run_name="__main__")
                code = 0
            except SystemExit as exc:
                if isinstance(exc.code, int) or exc.code is None:
                    code = exc.code or 0
                else:
                    print(exc.code, file=sys.stderr)
            except BaseException:  # noqa: BLE001  (reported as the child's stderr, as an interpreter would)
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if deadline is not None and time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    (os.killpg if new_group else os.kill)(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                break
            time.sleep(0.05)
        out.seek(0)
        err.seek(0)
        code = os.waitstatus_to_exitcode(status)
        return code, out.read().decode(errors="replace"), err.read().decode(errors="replace")
