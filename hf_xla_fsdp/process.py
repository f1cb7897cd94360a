"""What hf_xla_fsdp keeps per process, in one object: :func:`process_state`.

A process is started once (the launcher, the start-up hook, a script's first XlaFsdpTrainer / XlaFsdpAccelerator /
``XlaFsdpPlugin.build``), and several things must then hold for the rest of its life: the XLA runtime readied once
for the engine (FSDP v2: SPMD), the persistent compilation cache chosen once, the launch settings handed over by the
launcher, which upstream classes are patched and with what. They are fields of :class:`ProcessState`, not module
globals scattered over the package, so one place says what a process remembers and a test can start from a fresh one
(:func:`reset_process_state`).

This module imports nothing (not torch, nothing of ours): every layer may read the state.
"""

from __future__ import annotations

import contextvars
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Optional


@dataclass
class ProcessState:
    """Everything hf_xla_fsdp remembers for the life of this process (see the module docstring)."""

    # ---- launch settings (config/resolve.py reads and fills these)
    #: the settings sources the launcher handed over (``None``: not launched; ``[]``: launched with none)
    launch_sources: Optional[list] = None
    #: how to find them on first use (the start-up hook under a stock launcher: the script's argv is known later)
    launch_resolver: Optional[Callable[[], Optional[list]]] = None

    # ---- the runtime (session/bootstrap.py)
    #: engine names whose runtime set-up ran in this process (FSDP v2: SPMD started)
    runtime_ready: set = field(default_factory=set)
    #: how many times a runtime set-up really ran (once per engine kind; tests count it)
    runtime_setups: int = 0
    #: the persistent compilation cache of this process (``session.compile_cache.CacheState``), once chosen
    compile_cache: Any = None
    #: the cache folder's writer lock, held open for the life of the process
    compile_cache_lock_fd: Optional[int] = None
    #: compilation_cache_dir values a later session asked for and did not get (reported once each)
    compile_cache_ignored: set = field(default_factory=set)
    #: torch.distributed group of the background saves' collectives (runtime.thread_safe_collectives)
    save_group: Any = None

    # ---- upstream patches (integrations/patches.py): which are installed, and what they call
    #: names of the patches installed ("TrainingArguments", "Trainer.__new__", "Accelerator.__new__", ...)
    patched: set = field(default_factory=set)
    #: accelerate's own gather_object body, kept to run off XLA once the function is patched
    upstream_gather_object: Optional[Callable[[Any], Any]] = None
    #: what the patched gather_object runs on XLA
    gather_object_on_xla: Optional[Callable[[Any], list]] = None
    #: accelerate's own extract_model_from_parallel body, run on the module inside our units once patched
    upstream_extract_model: Optional[Callable[..., Any]] = None
    #: a Trainer class -> the same class with the XLA FSDP mixin first (integrations.trainer.xla_fsdp_trainer)
    trainer_classes: dict = field(default_factory=dict)

    lock: Any = field(default_factory=threading.RLock, repr=False)


#: True while a Trainer builds its base class's own accelerator (it stays stock: ours replaces it on the session)
STOCK_ACCELERATOR: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_xla_fsdp_stock_accelerator",
                                                                         default=False)

_STATE = ProcessState()


def process_state() -> ProcessState:
    """This process's :class:`ProcessState`."""
    return _STATE


def reset_process_state() -> ProcessState:
    """A fresh state for tests (the XLA runtime itself cannot be reset: what it did stays done)."""
    global _STATE
    _STATE = ProcessState()
    return _STATE
