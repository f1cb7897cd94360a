"""The one save that may be in flight in a background thread (``save_checkpoint(..., async_save=True)``).

The training thread only waits for the copy of the rank's state to host memory; writing, fsync and the
commit run in a thread. At most one save is pending: the next save, a load and the end of training wait
for it, and its failure is raised there (or, if nobody waits, reported when the process exits, which then
exits with code 1), never lost.
"""

from __future__ import annotations

import atexit
import logging
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional, Union

from ..errors import CheckpointError

logger = logging.getLogger(__name__)


class PendingSave:
    """A save running in a background thread; :meth:`wait` joins it and raises its failure."""

    def __init__(self, ckpt_dir: Union[str, Path], job: Callable[[], Any],
                 after: Optional[Callable[[Any], None]] = None) -> None:
        self.ckpt_dir = ckpt_dir  # a Path, or an fsspec URL kept as text (Path would fold its "//")
        self.error: Optional[BaseException] = None
        self._after = after
        #: wall time of the background work (write, fsync, report, commit), once it has ended
        self.seconds: Optional[float] = None
        name = str(ckpt_dir).rstrip("/").rsplit("/", 1)[-1]
        self._thread = threading.Thread(target=self._run, args=(job,), name=f"hf_xla_fsdp-save-{name}")
        self._thread.start()  # not a daemon: the interpreter finishes the save before it exits

    def _run(self, job: Callable[[], Any]) -> None:
        start = time.perf_counter()
        try:
            job()
        except BaseException as err:  # kept for the training thread: a thread's exception is otherwise only printed
            self.error = err
        finally:
            self.seconds = time.perf_counter() - start

    def done(self) -> bool:
        """True once the background work has ended (successfully or not)."""
        return not self._thread.is_alive()

    def wait(self) -> Union[str, Path]:
        """Block until the save has ended; raise its failure as one line, else run ``after`` and return the path."""
        self._thread.join()
        if self.error is not None:
            err = self.error
            if isinstance(err, CheckpointError):
                raise err
            text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise CheckpointError(f"the background save of {self.ckpt_dir} failed: {text} (nothing was published; "
                                  "earlier checkpoints are untouched)") from err
        if self._after is not None:
            self._after(self.ckpt_dir)
        return self.ckpt_dir


_lock = threading.Lock()
_pending: Optional[PendingSave] = None
_registered = False


def start(ckpt_dir: Union[str, Path], job: Callable[[], Any],
          after: Optional[Callable[[Any], None]] = None) -> PendingSave:
    """Run ``job`` (the rank's write and the commit) in a background thread; ``after(ckpt_dir)`` runs on the thread
    that waits for it, once it succeeded. Call :func:`wait_for_pending_save` first."""
    global _pending, _registered
    with _lock:
        if not _registered:
            atexit.register(_at_exit)
            _registered = True
        if _pending is not None:
            raise CheckpointError("a checkpoint save is still pending; call wait_for_pending_save() first")
        _pending = PendingSave(ckpt_dir, job, after)
        return _pending


def wait_for_pending_save() -> Union[str, Path, None]:
    """Wait for the background save in flight (if any) and raise its failure; returns its directory, or None.

    Saves, loads, ``XlaFsdpTrainer.train`` and ``XlaFsdpAccelerator.end_training`` call it; call it yourself
    before reading a checkpoint saved with ``async_save=True`` in a custom loop.
    """
    global _pending
    with _lock:
        pending, _pending = _pending, None
    return pending.wait() if pending is not None else None


def pending_save() -> Optional[PendingSave]:
    """The save in flight, if any (without waiting for it)."""
    return _pending


def _at_exit() -> None:  # non-daemon threads are joined before atexit runs: the save has ended by now
    try:
        wait_for_pending_save()
    except Exception as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        print(f"hf_xla_fsdp: {first}", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(1)  # an atexit hook cannot change the exit status otherwise; a lost checkpoint must not exit 0
