"""One call readies this process's XLA runtime for a plugin: :func:`ready_runtime`, exactly once per process.

What has to happen before the script's first XLA work is decided here and nowhere else: the engine's runtime set-up
(FSDP v2: SPMD, before the device is first used) and the persistent compilation cache (before the first compile).
The launcher, the start-up hook, ``TrainingArguments`` (patched), ``XlaFsdpTrainer``, ``XlaFsdpAccelerator`` and
every session call it; the first call does the work and records it in the process state
(:func:`hf_xla_fsdp.process.process_state`), every later one only checks that the runtime still suits its plugin.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

from ..engines import engine_for
from ..errors import ConfigError
from ..process import process_state
from . import compile_cache

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin


def ready_runtime(plugin: "XlaFsdpPlugin", *, what: str = "this process", counted_processes: Optional[int] = None,
                  ) -> None:
    """Ready the XLA runtime for ``plugin``'s engine and the compilation cache for its ``compilation_cache_dir``,
    once per process (later calls check, and set up nothing again).

    ``what`` names whoever may have used the XLA device first, for the one line said when the engine's set-up can no
    longer happen (FSDP v2: SPMD after the device was used); ``counted_processes``: how many processes a launcher
    (accelerate's state) has counted already.
    """
    engine = engine_for(plugin)
    state = process_state()
    if counted_processes is not None and not engine.runtime_ready(counted_processes):
        raise ConfigError(engine.runtime_too_late(what))
    with state.lock:
        if engine.name not in state.runtime_ready:
            engine.setup_runtime(plugin, what=what)
            state.runtime_ready.add(engine.name)
            state.runtime_setups += 1
        # before the first compile; the first plugin's folder stands (a later plugin's other folder is said once);
        # only XLA's runtime keeps such a cache (an engine without one: nothing to set up)
        if engine.compilation_cache:
            compile_cache.setup(plugin.compilation_cache_dir, engine.process_index)


def runtime_setups() -> int:
    """How many runtime set-ups ran in this process (one per engine kind at most)."""
    return process_state().runtime_setups
