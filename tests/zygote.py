"""Test script runs forked from a process that has already imported the upstream stack (a "zygote").

Every Python process a test starts pays ~10 s of CPU before its first line of work: torch, torch_xla (which pulls in
dynamo and inductor), transformers' Trainer (scipy, pandas, datasets, peft), accelerate. Most of the suite's process
starts run a worker script whose subject is what happens after those imports: ``helpers.run_python(...,
preloaded=True)`` runs such a script in a child forked from a server that imported them once per pytest worker.

The child is a process of its own, set up as ``python script args`` would be: its own pid and session, the test's
environment, working directory, ``sys.argv`` and ``sys.path`` (the script's directory first, then the interpreter's),
stdout/stderr to the files the test reads, stdin from /dev/null; the script runs as ``__main__`` and the process ends
the usual way (atexit handlers, non-daemon threads joined; an uncaught exception prints its traceback and exits 1).
What differs from a fresh interpreter, and why each is harmless for the runs that use it:

- the upstream modules were imported before the script ran, by the server. A server imports under the run's own
  environment: runs whose environments differ in anything but variables no preloaded module reads at import
  (``SAFE_KEYS``, ``SAFE_PREFIXES``: the device count, read when the XLA runtime starts in the child, and the test
  scripts' own) are forked from different servers (``USE_TORCH_XLA=0``: one that never imported torch_xla;
  ``HF_XLA_FSDP=1``: one whose start-up hook was installed before the imports, as in a fresh process). What the
  imports set in the environment (torch_xla's ``XLA_FLAGS`` additions and log levels) is set again in the child's.
- hf_xla_fsdp itself is not preloaded: its import and every setting it reads happen in the child as in a fresh
  process (its start-up hook, with ``HF_XLA_FSDP=1``, acts in that run's server before the upstream imports, as it
  acts in a fresh process before the script's).
- torch's and numpy's global generators are seeded from the OS in the child, as in a fresh process (Python's
  ``random`` reseeds itself after a fork).

Tests of start-up itself (what gets imported, import hooks, the launcher, peak memory of a process) start fresh
processes: they never pass ``preloaded=True``.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping, Sequence
from pathlib import Path

#: what the server imports once (every worker script of the suite imports some of these first)
PRELOAD = ("torch", "torch_xla", "torch_xla.core.xla_model", "torch_xla.distributed.spmd", "transformers",
           "transformers.trainer", "accelerate", "peft", "trl", "datasets", "safetensors.torch", "numpy")
#: environment variables a child may set to other values than its server's: none is read by a preloaded module at
#: import (CPU_NUM_DEVICES and PJRT_NPROC are read when the XLA runtime starts, in the child; the rest are pytest's, the
#: test scripts' own, or hf_xla_fsdp's, which is imported in the child). XLA_FLAGS is not one: XLA may parse it once.
SAFE_KEYS = frozenset({"CPU_NUM_DEVICES", "PJRT_NPROC", "PYTEST_CURRENT_TEST", "USE_HF_XLA_FSDP", "SFT_USE_SPMD"})
SAFE_PREFIXES = ("HF_XLA_FSDP_", "TEST_")

#: servers kept at once by one test process (each holds ~1 GB of imported modules, shared with its children)
MAX_SERVERS = 2

_servers: dict[frozenset, tuple[subprocess.Popen, str]] = {}  # the environment it imported under -> (server, socket)
_lock = threading.Lock()
_IMPORT_SET: dict[str, tuple[str | None, str]] = {}


def available() -> bool:
    """Whether servers can run here: they wait on their children through pidfds (Linux 5.3+)."""
    try:
        os.close(os.pidfd_open(os.getpid()))
        return True
    except (AttributeError, OSError):
        return False


def _import_environment(env: Mapping[str, str]) -> frozenset:
    """What of ``env`` a preloaded module may read at import: everything but ``SAFE_KEYS`` / ``SAFE_PREFIXES``."""
    return frozenset((k, v) for k, v in env.items() if k not in SAFE_KEYS and not k.startswith(SAFE_PREFIXES))


def _server_for(env: Mapping[str, str]) -> str:
    """The socket of a server that imported under ``env``'s import environment, started if there is none."""
    key = _import_environment(env)
    with _lock:
        server = _servers.get(key)
        if server is not None and server[0].poll() is None:
            _servers[key] = _servers.pop(key)  # most recently used last
            return server[1]
        while len(_servers) >= MAX_SERVERS:  # the least recently used one ends (its stdin closes)
            old, _ = _servers.pop(next(iter(_servers)))
            old.stdin.close()
            old.wait(timeout=60)
        folder = tempfile.mkdtemp(prefix="zygote-")
        path = os.path.join(folder, "socket")
        # stdin is the server's lifeline: it ends when this process does, and the server with it
        proc = subprocess.Popen([sys.executable, __file__, path], env=dict(key), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, text=True, cwd=folder)
        line = proc.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"the zygote server did not start (it printed {line!r})")
        _servers[key] = (proc, path)
        return path


class ForkedProcess:
    """A run forked by a server, as much of ``subprocess.Popen`` as the tests use: ``pid``, ``returncode``,
    ``poll``, ``wait``, ``kill`` (its whole process group), ``send_signal``."""

    def __init__(self, args: Sequence[str], env: Mapping[str, str], cwd: os.PathLike | str, stdout: os.PathLike | str,
                 stderr: os.PathLike | str):
        self.args = ["python", *map(str, args)]
        request = {"argv": [str(a) for a in args], "env": dict(env), "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr)}
        self._conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn.connect(_server_for(env))
        self._conn.sendall(json.dumps(request).encode() + b"\n")
        self._reply = self._conn.makefile("r")
        self.pid = int(self._reply.readline())
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code if the run has ended, else None."""
        if self.returncode is None and select.select([self._conn], [], [], 0)[0]:
            self._finish()
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Wait for the end (``subprocess.TimeoutExpired`` after ``timeout`` seconds); the exit code."""
        if self.returncode is None:
            if not select.select([self._conn], [], [], timeout)[0]:
                raise subprocess.TimeoutExpired(self.args, timeout)
            self._finish()
        return self.returncode

    def _finish(self) -> None:
        line = self._reply.readline()
        if not line:
            raise RuntimeError("the zygote server ended before the run did")
        self.returncode = int(line)
        self._conn.close()

    def send_signal(self, sig: int) -> None:
        """``sig`` to the run's process (not to what it started), as Popen.send_signal."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL to the run and every process it started (its process group)."""
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.pid, signal.SIGKILL)


def start(args: Sequence[str], *, env: Mapping[str, str], cwd: os.PathLike | str, stdout: os.PathLike | str,
          stderr: os.PathLike | str) -> ForkedProcess:
    """``python *args`` (a script path, ``-m module`` or ``-c code``) with environment ``env``, its output written to
    the files ``stdout`` and ``stderr``, forked from a server that imported the stack under the same environment
    (variables read after import aside), started on first use."""
    return ForkedProcess(args, env, cwd, stdout, stderr)


def run(args: Sequence[str], *, env: Mapping[str, str], cwd: os.PathLike | str,
        timeout: float) -> subprocess.CompletedProcess[str]:
    """:func:`start`, then wait, like ``subprocess.run`` with ``capture_output=True, text=True``: the exit code,
    stdout and stderr; on ``timeout`` the run's process group is killed and ``subprocess.TimeoutExpired`` raised."""
    if not available():  # a fresh process: the same run, with its imports
        return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=dict(env), capture_output=True,
                              text=True, timeout=timeout)
    with tempfile.TemporaryDirectory(prefix="zygote-run-") as folder:
        out, err = Path(folder, "stdout"), Path(folder, "stderr")
        proc = start(args, env=env, cwd=cwd, stdout=out, stderr=err)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise subprocess.TimeoutExpired(proc.args, timeout, output=out.read_text(errors="replace"),
                                            stderr=err.read_text(errors="replace")) from None
        return subprocess.CompletedProcess(proc.args, proc.returncode, out.read_text(errors="replace"),
                                           err.read_text(errors="replace"))


# --------------------------------------------------------------------------- the server (python tests/zygote.py SOCKET)
def _serve(path: str) -> dict:
    """Preload, then fork one child per request; returns (in the child only) the request to run."""
    import importlib

    global _IMPORT_SET
    before = dict(os.environ)
    no_xla = os.environ.get("USE_TORCH_XLA", "1").lower() in ("0", "false", "no", "off")
    for name in PRELOAD:
        if name.startswith("torch_xla") and no_xla:
            continue  # transformers and accelerate leave it unimported then, and so does the server
        try:
            importlib.import_module(name)
        except ImportError:  # not importable here (the fsdp2 tests block torch_xla): the child fails alike if it tries
            pass
    # what the imports set in the environment (torch_xla: XLA_FLAGS additions, log levels, PJRT_DYNAMIC_PLUGINS)
    _IMPORT_SET = {k: (before.get(k), v) for k, v in os.environ.items() if before.get(k) != v}
    # a fork copies only the forking thread: a preload must start no Python thread. The native threads the imports
    # start (OpenBLAS's pool, pyarrow's jemalloc background thread) have fork handlers, as DataLoader's fork workers
    # rely on; OpenMP's pool, which has none, starts only with the first parallel region, never run here
    if threading.active_count() != 1:
        raise RuntimeError(f"preloading started threads: {threading.enumerate()}")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    children: dict[int, tuple[int, socket.socket]] = {}  # pidfd -> (pid, connection)
    while True:
        ready, _, _ = select.select([listener, sys.stdin, *children], [], [])
        if sys.stdin in ready and not sys.stdin.read(1):  # the pytest worker is gone
            for pid, _ in children.values():
                try:
                    os.killpg(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            os._exit(0)
        for pidfd in [fd for fd in ready if isinstance(fd, int)]:
            pid, conn = children.pop(pidfd)
            _, status = os.waitpid(pid, 0)
            os.close(pidfd)
            try:
                conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            except OSError:
                pass
            conn.close()
        if listener in ready:
            conn, _ = listener.accept()
            request = json.loads(conn.makefile("r").readline())
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                listener.close()
                conn.close()
                for pidfd, (_, other) in children.items():
                    os.close(pidfd)
                    other.close()
                return request
            children[os.pidfd_open(pid)] = (pid, conn)
            conn.sendall(f"{pid}\n".encode())


def _become(request: dict) -> None:
    """In the forked child: the process ``python *argv`` would be, up to the script's first line."""
    os.setsid()  # its own process group: a timeout kills the script and whatever it started
    for fd, name, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC),
                            (2, request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)):
        opened = os.open(name, flags)
        os.dup2(opened, fd)
        os.close(opened)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, (before, after) in _IMPORT_SET.items():  # as the imports would have set it in this environment
        if os.environ.get(key) == before:
            os.environ[key] = after
    import numpy
    import torch

    numpy.random.seed()  # from the OS, as in a fresh process
    torch.seed()  # likewise: a fresh process's torch generator starts from a random seed
    argv = request["argv"]
    sys.path[:] = _FRESH_PATH
    if argv[0] == "-c":
        sys.argv = ["-c", *argv[2:]]
        sys.path.insert(0, "")
    elif argv[0] == "-m":
        sys.argv = [argv[1], *argv[2:]]
        sys.path.insert(0, os.getcwd())
    else:
        sys.argv = list(argv)
        sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))


if __name__ == "__main__":
    # the interpreter's own path, without this file's folder (a script's folder replaces it in each child)
    _FRESH_PATH = sys.path[1:]
    _request = _serve(sys.argv[1])
    del _serve
    _become(_request)
    import runpy

    if _request["argv"][0] == "-c":
        import types

        _code = _request["argv"][1]
        del _request
        _main = types.ModuleType("__main__")  # a module of its own, as python -c has (pickle finds its functions)
        sys.modules["__main__"] = _main
        exec(compile(_code, "<string>", "exec"), _main.__dict__)
    elif _request["argv"][0] == "-m":
        _module = _request["argv"][1]
        del _request
        runpy.run_module(_module, run_name="__main__", alter_sys=True)
    else:
        _script = _request["argv"][0]
        del _request
        runpy.run_path(_script, run_name="__main__")
