"""XLA's persistent compilation cache, set up once per process before the first graph compiles.

torch_xla keeps compiled executables in a folder keyed by the graph hash (``torch_xla.runtime.initialize_cache``;
the C++ side is ``runtime::util::PersistentCache`` in torch_xla/csrc/runtime/cache.h). Its rules decide ours:

* the folder is read from ``XLA_PERSISTENT_CACHE_PATH`` when the in-memory computation cache is created, which is
  at the first compile, not when the device is first used: a session can set it up in ``setup_runtime``, after
  ``TrainingArguments`` or accelerate's state have taken the device;
* a writer writes each file in place (no temporary file, no lock) and deletes a file it cannot load; two writers
  on one folder can interleave bytes in the same file. So one process writes: process 0 of the job, and only while
  it holds an exclusive lock on ``.hf_xla_fsdp-writer.lock`` in the folder (another job on the same machine and
  folder reads only); every other process opens the cache read-only;
* a file is loaded with the PJRT client's ``DeserializeExecutable``. torch_xla 2.9's XLA:CPU client does not
  implement it ("UNIMPLEMENTED: Deserializing serialized executable not supported"), and neither does the PJRT C-API
  client TPUs use (pytorch/xla#9094, open; the fix, #9759, calls ``LoadSerializedExecutable`` instead); torch_xla's
  own cache test runs on TPU/NEURON only (test/test_persistent_cache.py). Such a runtime finds every graph on disk
  by its hash, fails to load it and compiles again. :func:`check` notices that from the runtime's counters, says
  so once, and leaves a marker in the folder so the default ("auto") cache stays off for that torch_xla version and
  device type from then on.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

from ..process import process_state

logger = logging.getLogger(__name__)

#: the default folder, or "none" to switch the default cache off (a plugin's explicit setting wins)
ENV_CACHE = "HF_XLA_FSDP_COMPILATION_CACHE"
LOCK_NAME = ".hf_xla_fsdp-writer.lock"
COUNTERS = ("PersistentCacheHit", "PersistentCacheMiss", "PersistentCacheDeserializeFailure")
UPSTREAM_ISSUE = "pytorch/xla#9094"


@dataclass
class CacheState:
    """What this process does with the persistent compilation cache."""

    #: the folder, or None when the cache is off
    path: Optional[str]
    #: True when this process only reads (another process writes)
    readonly: bool = False
    #: why it is on/off, or who writes (for logs and the benchmark)
    reason: str = ""
    #: the plugin named the folder (False: the default folder)
    explicit: bool = False
    #: the runtime could not load a cached graph; reported once
    unloadable: bool = False


# what this module remembers (the cache chosen, the writer lock held, settings reported) is the process state's


def default_dir() -> Optional[str]:
    """``$HF_XLA_FSDP_COMPILATION_CACHE`` (None when it says off), else ``$XDG_CACHE_HOME`` or ``~/.cache``, then
    ``hf_xla_fsdp/xla_cache``."""
    from ..settings import parse_cache_dir

    env = os.environ.get(ENV_CACHE)
    if env is not None:
        found = parse_cache_dir(env, ENV_CACHE)
        if found != "auto":
            return found
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "hf_xla_fsdp", "xla_cache")


def runtime_key() -> str:
    """torch_xla version and device type: what decides whether cached executables can be loaded back."""
    import torch_xla
    import torch_xla.runtime as xr

    return f"torch_xla-{torch_xla.__version__}-{xr.device_type()}"


def _marker(path: str) -> Path:
    return Path(path) / f".unloadable-{runtime_key()}.json"


def _take_writer_lock(path: str) -> Optional[bool]:
    """True: this process now holds the folder's writer lock (for its lifetime); False: another process holds it;
    None: the file system has no locks (then process 0 writes without one)."""
    import fcntl

    fd = os.open(os.path.join(path, LOCK_NAME), os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return False
    except OSError:
        os.close(fd)
        return None
    process_state().compile_cache_lock_fd = fd  # kept open: the lock lasts as long as this process
    return True


def setup(setting: Optional[str], process_index: Callable[[], int]) -> CacheState:
    """Point torch_xla at the cache folder ``setting`` ("auto", a path or None) for this process; idempotent.

    Must run before the process's first compile; ``process_index`` is called only when a folder is in use.
    """
    process = process_state()
    if process.compile_cache is not None:
        chosen: CacheState = process.compile_cache
        wanted = default_dir() if setting == "auto" else setting
        if setting not in (None, "auto") and wanted != chosen.path and wanted not in process.compile_cache_ignored:
            process.compile_cache_ignored.add(wanted)
            logger.warning("compilation_cache_dir=%s not used: this process set up its cache already (%s)", wanted,
                           chosen.path or chosen.reason)
        return chosen
    process.compile_cache = _choose(setting, process_index)
    return process.compile_cache


def _choose(setting: Optional[str], process_index: Callable[[], int]) -> CacheState:
    """What :func:`setup` sets up, the first time."""
    import torch_xla
    import torch_xla.runtime as xr

    explicit = setting not in (None, "auto")
    if os.environ.get("XLA_PERSISTENT_CACHE_PATH"):  # the script (or its launcher) chose already: theirs
        return CacheState(os.environ["XLA_PERSISTENT_CACHE_PATH"],
                          os.environ.get("XLA_PERSISTENT_CACHE_READ_ONLY", "0") == "1", "set by XLA_PERSISTENT_CACHE_PATH",
                          explicit=True)
    path = default_dir() if setting == "auto" else setting
    if path is None:
        return CacheState(None, reason="off")
    from .. import upstream

    upstream.require("compile_cache")
    if torch_xla._XLAC._xla_computation_cache_is_initialized():
        (logger.warning if explicit else logger.debug)(
            "compilation_cache_dir=%s not used: a graph was compiled before hf_xla_fsdp set up the runtime; build the "
            "Trainer/Accelerator (or call XlaFsdpPlugin.build) before running XLA code", path)
        return CacheState(None, reason="too late: a graph was compiled before")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as err:
        (logger.warning if explicit else logger.debug)("compilation_cache_dir=%s cannot be created (%s); compiling "
                                                       "without a persistent cache", path, err.strerror or err)
        return CacheState(None, reason=f"cannot create {path}")
    if not explicit and _marker(path).is_file():
        logger.info("persistent compilation cache off: %s cannot load cached graphs back (%s); see %s",
                    runtime_key(), UPSTREAM_ISSUE, _marker(path))
        return CacheState(None, reason=f"{runtime_key()} cannot load it ({UPSTREAM_ISSUE})")
    if process_index() != 0:
        readonly, reason = True, "reader: process 0 of the job writes"
    else:
        locked = _take_writer_lock(path)
        readonly = locked is False
        reason = {True: "writer (holds the lock)", False: "reader: another process holds the writer lock",
                  None: "writer (process 0; no file locks here)"}[locked]
    xr.initialize_cache(path, readonly=readonly)
    state = CacheState(path, readonly, reason, explicit=explicit)
    logger.info("persistent compilation cache %s (%s)", path, reason)
    return state


def state() -> Optional[CacheState]:
    """This process's cache state once :func:`setup` ran (None before)."""
    return process_state().compile_cache


def counters() -> dict[str, int]:
    """torch_xla's persistent-cache counters of this process (hits, misses, files found but not loadable)."""
    import torch_xla.debug.metrics as met

    return {name: int(met.counter_value(name) or 0) for name in COUNTERS}


def check() -> None:
    """After a compile: when cached graphs were found but none could be loaded, say so once (a warning when the
    folder was chosen, else an info line) and mark the folder so the default cache stays off for this runtime."""
    cache = process_state().compile_cache
    if cache is None or cache.path is None or cache.unloadable:
        return
    found = counters()
    if found["PersistentCacheDeserializeFailure"] == 0 or found["PersistentCacheHit"] > 0:
        return
    cache.unloadable = True
    (logger.warning if cache.explicit else logger.info)(
        "compilation cache %s: %s finds the cached graphs but cannot load them (%s: its PJRT client does not "
        "deserialize executables), so every graph compiles again; set compilation_cache_dir: none to stop writing "
        "the cache", cache.path, runtime_key(), UPSTREAM_ISSUE)
    try:
        marker = _marker(cache.path)
        tmp = marker.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps({"runtime": runtime_key(), "counters": found, "issue": UPSTREAM_ISSUE}))
        os.replace(tmp, marker)
    except OSError:  # a read-only folder: the next run finds out again
        pass


def summary() -> dict[str, Any]:
    """The state and the counters, for benchmarks and tests."""
    cache = process_state().compile_cache
    return {"path": cache.path if cache else None, "readonly": cache.readonly if cache else None,
            "reason": cache.reason if cache else "not set up", **counters()}
