"""Machines of a torch.distributed run that watch each other, so that a lost machine stops the run in bounded time.

torchrun's agent watches only its own machine's processes: with ``--max-restarts 0`` (the default) it stops them and
exits when one of them fails, and it notices nothing of another machine. What the processes of the other machines see
when one machine is gone depends on how it went: a killed process's sockets are closed by its kernel and gloo raises
("Connection reset by peer") in the peers that talk to it directly, while the others wait; a machine that loses power
or its network closes nothing, and every peer waits in its collective until the process group's timeout (30 minutes
by default for gloo). Neither says which machine was lost.

:class:`NodeWatch` is the smallest mechanism that does: every process adds to its machine's heartbeat counter in the
rendezvous store (the TCPStore torchrun's static rendezvous serves from machine 0, reached over a connection of its
own) and reads every machine's counters in one request; a machine whose counter has not moved for ``timeout``
seconds, and whose processes did not all finish, is lost. Then the process prints one line naming that machine (its
machine rank, host and ranks) and exits with :data:`EXIT_NODE_LOST` at once: its collectives can never complete, and a
checkpoint save in flight can never be committed (rank 0 seals a checkpoint only from every rank's report), so nothing
is left that a resume would take as complete. A store that stops answering means machine 0 (which serves it) is lost.
A process whose main thread fails with a distributed error (gloo's connection errors) first waits up to ``timeout``
for that verdict, so the line is printed on that path too.

Only a counter is exchanged, never a time: the machines' clocks need not agree.
"""

from __future__ import annotations

import atexit
import ctypes
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Optional

logger = logging.getLogger(__name__)

#: seconds without a heartbeat after which a machine counts as lost (``0`` switches the watch off)
ENV_NODE_TIMEOUT = "HF_XLA_FSDP_NODE_TIMEOUT"
DEFAULT_NODE_TIMEOUT = 30.0
#: the exit code of a process that stopped because a machine was lost: sysexits' EX_TEMPFAIL (try again)
EXIT_NODE_LOST = 75
#: set by ``hf-xla-fsdp launch`` for the processes it starts: its own pid (they die with it, see :func:`die_with_launcher`)
ENV_LAUNCHER_PID = "HF_XLA_FSDP_LAUNCHER_PID"
_PREFIX = "hf_xla_fsdp/nodes"


@dataclass(frozen=True)
class Machine:
    """What the line naming a machine says about it."""

    rank: int
    host: str
    first_rank: int
    processes: int

    def describe(self, machines: int) -> str:
        """``machine 1 of 2 (host h, ranks 2-3)``."""
        last = self.first_rank + self.processes - 1
        ranks = f"rank {self.first_rank}" if last == self.first_rank else f"ranks {self.first_rank}-{last}"
        return f"machine {self.rank} of {machines} (host {self.host}, {ranks})"


def node_timeout() -> float:
    """``$HF_XLA_FSDP_NODE_TIMEOUT`` in seconds (default 30; 0 switches the watch off)."""
    from ..settings import env_number

    value = env_number(ENV_NODE_TIMEOUT, "set it to a number of seconds, e.g. 30 (0: no watch)")
    if value is None:
        return DEFAULT_NODE_TIMEOUT
    return max(value, 0.0)


def looks_distributed(error: BaseException) -> bool:
    """True for the errors a lost peer causes in a collective: torch.distributed's own, and gloo's socket errors
    (raised as plain RuntimeErrors naming gloo's sources)."""
    import torch.distributed as dist

    if isinstance(error, dist.DistError):
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and any(word in text for word in ("gloo", "Connection reset",
                                                                            "Connection closed", "Broken pipe"))


class NodeWatch:
    """The heartbeat and the watch of one process (see the module docstring).

    ``store``: a store client of this process's own (its requests must not wait behind the main thread's);
    ``machine``: this process's machine rank; ``machines``: how many; ``store_address``: where the store is served
    (named when it stops answering). ``report(line)`` and ``stop(code)`` default to stderr and ``os._exit``.
    """

    def __init__(self, store: Any, *, machine: int, machines: int, rank: int, local_rank: int, local_world: int,
                 timeout: float, store_address: str, key: str = "run", report: Optional[Callable[[str], None]] = None,
                 stop: Optional[Callable[[int], None]] = None) -> None:
        self.store, self.machine, self.machines = store, machine, machines
        self.rank, self.local_rank, self.local_world = rank, local_rank, local_world
        self.timeout, self.store_address = timeout, store_address
        self.interval = max(0.2, min(5.0, timeout / 10))
        self.prefix = f"{_PREFIX}/{key}"
        # one write per line: the processes of a machine share the launcher's stderr
        self._report = report or (lambda line: os.write(sys.stderr.fileno(), (line + "\n").encode()))
        self._stop = stop or os._exit
        self.verdict: Optional[str] = None
        #: set once the verdict is given, or once every other machine's processes have all finished
        self.settled = threading.Event()
        self._closed = threading.Event()
        self._marked = False
        self._members: dict[int, Machine] = {}
        self._thread: Optional[threading.Thread] = None

    def _key(self, kind: str, machine: int) -> str:
        return f"{self.prefix}/{kind}/{machine}"

    # ----------------------------------------------------------------- joining
    def start(self) -> "NodeWatch":
        """Publish this machine (its first process), beat once, wait until every machine has (``timeout``: a machine
        that never does is lost), then beat and watch on a daemon thread."""
        if self.local_rank == 0:
            info = {"host": socket.gethostname(), "first_rank": self.rank, "processes": self.local_world}
            self.store.set(self._key("machine", self.machine), json.dumps(info))
        self.store.add(self._key("beat", self.machine), 1)
        self.store.add(self._key("finished", self.machine), 0)
        self._thread = threading.Thread(target=self._run, name="hf_xla_fsdp-node-watch", daemon=True)
        self._thread.start()
        return self

    def _join(self) -> bool:
        """Every machine's description, once all have published one; False (the verdict given) otherwise."""
        keys = [self._key("machine", m) for m in range(self.machines)]
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                present = [self.store.check([k]) for k in keys]
            except Exception as err:
                return self._store_lost(err)
            if all(present):
                break
            if time.monotonic() > deadline:
                missing = [m for m, ok in enumerate(present) if not ok]
                return self._lost(f"machine {missing[0]} of {self.machines} never joined the watch within "
                                  f"{self.timeout:g} s")
            if self._closed.wait(self.interval):
                return False
        try:
            values = self.store.multi_get(keys)
        except Exception as err:
            return self._store_lost(err)
        for m, raw in enumerate(values):
            info = json.loads(bytes(raw).decode())
            self._members[m] = Machine(m, info["host"], info["first_rank"], info["processes"])
        return True

    # ----------------------------------------------------------------- watching
    def _run(self) -> None:
        if not self._join():
            return
        peers = [m for m in range(self.machines) if m != self.machine]
        keys = [self._key(kind, m) for m in peers for kind in ("beat", "finished")]
        last: dict[int, tuple[int, float]] = {}
        while not self._closed.wait(self.interval):
            try:
                self.store.add(self._key("beat", self.machine), 1)
                values = [int(bytes(v).decode()) for v in self.store.multi_get(keys)]
            except Exception as err:
                self._store_lost(err)
                return
            now = time.monotonic()
            if all(values[2 * i + 1] >= self._members[m].processes for i, m in enumerate(peers)):
                self.settled.set()  # nobody is left to lose
            for i, m in enumerate(peers):
                beat, finished = values[2 * i], values[2 * i + 1]
                if m not in last or last[m][0] != beat:
                    last[m] = (beat, now)
                elif finished < self._members[m].processes and now - last[m][1] >= self.timeout:
                    self._lost(f"{self._members[m].describe(self.machines)} sent no heartbeat for "
                               f"{now - last[m][1]:.0f} s")
                    return

    def _store_lost(self, err: BaseException) -> bool:
        if self._closed.is_set():
            return False
        holder = self._members.get(0)
        where = holder.describe(self.machines) if holder else f"machine 0 of {self.machines}"
        return self._lost(f"{where}, which serves the rendezvous store at {self.store_address}, stopped answering "
                          f"({type(err).__name__})")

    def _lost(self, what: str) -> bool:
        """Give the verdict: one line, then stop this process (unless the watch was closed meanwhile)."""
        if self._closed.is_set():
            return False
        self.verdict = (f"hf-xla-fsdp: error: rank {self.rank} on machine {self.machine} stops: {what} (its processes "
                        "were killed, crashed or cannot be reached); find out why there, then start the same command "
                        "on every machine again (a Trainer resumes from the latest complete checkpoint with "
                        "resume_from_checkpoint)")
        self.settled.set()
        self._report(self.verdict)
        self._stop(EXIT_NODE_LOST)
        return False

    # ----------------------------------------------------------------- leaving
    def mark_finished(self) -> None:
        """Count this process as finished (once): its machine is not lost when all its processes are."""
        if self._marked:
            return
        self._marked = True
        try:
            self.store.add(self._key("finished", self.machine), 1)
        except Exception:  # the store's machine is gone: nobody is left to tell
            pass

    def finish(self) -> None:
        """This process is done (at exit): counted as finished, and the watch stops."""
        if not self._closed.is_set():
            self.mark_finished()
            self._closed.set()

    def wait_for_verdict(self, seconds: float) -> Optional[str]:
        """The verdict, if the watch gives one within ``seconds`` (for a process whose collective just failed); None
        at once when every other machine's processes have finished."""
        self.mark_finished()
        self.settled.wait(seconds)
        return self.verdict


_WATCH: dict[str, Optional[NodeWatch]] = {"watch": None}


def die_with_launcher() -> bool:
    """In a process ``hf-xla-fsdp launch`` started (``$HF_XLA_FSDP_LAUNCHER_PID``, its parent): be killed when the
    launcher dies (Linux ``PR_SET_PDEATHSIG``). torchrun starts every worker in a session of its own, so killing a
    machine's launcher (its process group) would otherwise leave its workers training; with this, a killed launcher
    is a lost machine. True when set."""
    expected = os.environ.pop(ENV_LAUNCHER_PID, None)  # not for this process's own children
    if expected is None or not sys.platform.startswith("linux") or str(os.getppid()) != expected:
        return False
    prctl = getattr(ctypes.CDLL(None), "prctl", None)
    pr_set_pdeathsig = 1  # linux/prctl.h
    return prctl is not None and prctl(pr_set_pdeathsig, signal.SIGKILL, 0, 0, 0) == 0


def watch_machines() -> Optional[NodeWatch]:
    """Start this process's :class:`NodeWatch` when torchrun started it on one of several machines
    (``GROUP_WORLD_SIZE`` > 1) and the process group exists; once per process. None when there is nothing to watch
    or ``$HF_XLA_FSDP_NODE_TIMEOUT`` is 0."""
    import torch.distributed as dist

    if _WATCH["watch"] is not None:
        return _WATCH["watch"]
    machines = int(os.environ.get("GROUP_WORLD_SIZE", "1"))
    timeout = node_timeout()
    if machines <= 1 or timeout <= 0 or not dist.is_initialized() or "MASTER_ADDR" not in os.environ:
        return None
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])
    store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=timeout), wait_for_workers=False)
    key = f"{os.environ.get('TORCHELASTIC_RUN_ID', 'run')}/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
    watch = NodeWatch(store, machine=int(os.environ["GROUP_RANK"]), machines=machines, rank=dist.get_rank(),
                      local_rank=int(os.environ.get("LOCAL_RANK", "0")),
                      local_world=int(os.environ.get("LOCAL_WORLD_SIZE", "1")), timeout=timeout,
                      store_address=f"{host}:{port}", key=key).start()
    _WATCH["watch"] = watch
    atexit.register(watch.finish)
    previous = sys.excepthook

    def excepthook(kind: type, error: BaseException, tb: Any) -> None:
        previous(kind, error, tb)
        if watch.verdict is None and not watch._closed.is_set() and looks_distributed(error):
            # a peer's sockets closed: the heartbeats say whether (and which) machine is gone; when it is, the watch
            # prints its line and ends the process from its thread
            watch.wait_for_verdict(timeout + 2 * watch.interval)
        watch.finish()

    sys.excepthook = excepthook
    logger.info("watching %d machines (timeout %g s, store %s:%d)", machines, timeout, host, port)
    return watch
