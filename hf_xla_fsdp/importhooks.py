"""Run a function right after a module is imported, whoever imports it and whenever (standard library only).

The launcher and the start-up hook patch upstream classes (``transformers.Trainer``, ``accelerate.Accelerator``,
``TrainingArguments``) as their modules load, so nothing is imported early and the import order of the script does
not matter. This module imports nothing of ours and nothing outside the standard library: the ``.pth`` start-up hook
loads it by file path (under this same name) before any package is imported.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
import threading
from typing import Any, Callable, Optional

_callbacks: dict[str, list[Callable[[Any], None]]] = {}
_lock = threading.RLock()


class _RunAfter(importlib.abc.Loader):
    """The module's own loader, then the callbacks registered for its name."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> Any:
        return self.loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        self.loader.exec_module(module)
        _run(module.__name__, module)

    def __getattr__(self, name: str) -> Any:  # get_resource_reader, is_package, ...: the real loader's
        return getattr(self.loader, name)


class _Finder(importlib.abc.MetaPathFinder):
    """First on ``sys.meta_path``: finds a watched module with the other finders and wraps its loader."""

    _busy = threading.local()

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Optional[importlib.machinery.ModuleSpec]:
        if fullname not in _callbacks or getattr(self._busy, "name", None) == fullname:
            return None
        self._busy.name = fullname
        try:
            for finder in sys.meta_path:
                if finder is self or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                        spec.loader = _RunAfter(spec.loader)
                    return spec
            return None
        finally:
            self._busy.name = None


_FINDER = _Finder()


def _run(name: str, module: Any) -> None:
    while True:  # a callback may register more for this module (it still counts as initializing for them)
        with _lock:
            callbacks = _callbacks.pop(name, [])
        if not callbacks:
            return
        for callback in callbacks:
            callback(module)


def when_imported(name: str, callback: Callable[[Any], None]) -> None:
    """Call ``callback(module)`` once module ``name`` is imported: now if it already is, else right after its import."""
    with _lock:
        module = sys.modules.get(name)
        # a module still executing (an import cycle reached the code that registers this) runs it when it ends
        if module is None or getattr(getattr(module, "__spec__", None), "_initializing", False):
            _callbacks.setdefault(name, []).append(callback)
            if _FINDER not in sys.meta_path:
                sys.meta_path.insert(0, _FINDER)
            return
    callback(module)


def pending() -> list[str]:
    """The watched modules not imported yet."""
    with _lock:
        return sorted(_callbacks)


def _call(target: str) -> Callable[[Any], None]:
    """``"package.module:function"`` as a callback: imported when the watched module loads, not now."""

    def run(module: Any) -> None:
        import importlib

        name, _, function = target.partition(":")
        getattr(importlib.import_module(name), function)(module)

    return run


#: what the start-up hook runs as each upstream module loads (it imports torch: never at interpreter start)
HOOK_TARGET = "hf_xla_fsdp.integrations.launched:hooked"


def install_startup_hook() -> None:
    """What the ``.pth`` start-up hook does when ``HF_XLA_FSDP`` is set: nothing is imported now; as the upstream
    modules load, :data:`HOOK_TARGET` patches them for the launched script."""
    for name in ("transformers.training_args", "transformers.trainer", "accelerate.accelerator"):
        when_imported(name, _call(HOOK_TARGET))
