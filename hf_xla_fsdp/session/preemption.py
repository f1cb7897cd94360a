"""SIGTERM noted instead of obeyed at once, so that the training loop saves at the next step boundary.

Preemptible / spot TPU VMs send SIGTERM shortly before they stop. :class:`PreemptionGuard` replaces the
SIGTERM handler (only the main thread can) with one that records the signal; the Trainer and accelerate
glue check it after each optimizer step, save a checkpoint and stop. A second SIGTERM gets the previous
behaviour (by default the process ends at once), and :meth:`PreemptionGuard.restore` puts the previous
handler back.
"""

from __future__ import annotations

import logging
import signal
import threading
from typing import Any, Optional

logger = logging.getLogger(__name__)


class PreemptionGuard:
    """Records SIGTERM (``received``) while installed; see the module docstring."""

    def __init__(self, signum: int = signal.SIGTERM):
        self.signum = signum
        self.received = False
        self.installed = False
        self._previous: Any = None

    @property
    def signal_name(self) -> str:
        """``"SIGTERM"``."""
        return signal.Signals(self.signum).name

    def install(self) -> bool:
        """Take over the signal; False (and nothing changed) outside the main thread, where Python cannot."""
        if self.installed:
            return True
        if threading.current_thread() is not threading.main_thread():
            logger.warning("save_on_preemption: not in the main thread, so %s keeps its usual effect", self.signal_name)
            return False
        self._previous = signal.signal(self.signum, self._handle)
        self.installed = True
        return True

    def _handle(self, signum: int, frame: Optional[Any]) -> None:
        if self.received:  # asked twice: do what would have happened without us
            self.restore()
            signal.raise_signal(signum)
            return
        self.received = True  # nothing else here: the main thread may be anywhere, the loop acts at a step boundary

    def restore(self) -> None:
        """Put the previous handler back (the default one when it was not set from Python)."""
        if self.installed:
            signal.signal(self.signum, self._previous if self._previous is not None else signal.SIG_DFL)
            self.installed = False
