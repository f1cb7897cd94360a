"""Import paths of release 0.1 that moved in 0.2, kept working for one release.

``import hf_xla_fsdp.wrapping`` (and the like) gives the very module object of its new home,
so attributes read or patched through either name are the same. Each use warns once.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import sys
import warnings
from types import ModuleType
from typing import Optional, Sequence

MOVED = {
    "atomic": "checkpoint.layout",
    "rank_files": "checkpoint.readers",
    "consolidate": "checkpoint.consolidate",
    "spmd": "engines.v2",
    "wrapping": "build.wrapping",
    "meta_init": "build.meta_init",
    "planning": "build.planning",
    "accelerate_glue": "integrations.accelerate",
    "trainer_glue": "integrations.trainer",
    "hub_export": "integrations.hub",
}
_PACKAGE = __name__.rpartition(".")[0]


class _AliasLoader(importlib.abc.Loader):
    def __init__(self, old: str, new: str) -> None:
        self.old, self.new = old, new

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        warnings.warn(f"{self.old} moved to {self.new}; the old name will be removed in the next release",
                      DeprecationWarning, stacklevel=3)
        return importlib.import_module(self.new)

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run: the module is its new home, already imported."""


class _AliasFinder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Optional[Sequence[str]] = None,
                  target: Optional[ModuleType] = None) -> Optional[importlib.machinery.ModuleSpec]:
        package, _, short = fullname.rpartition(".")
        if package != _PACKAGE or short not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, _AliasLoader(fullname, f"{_PACKAGE}.{MOVED[short]}"))


def install() -> None:
    """Make the old import paths resolve (idempotent)."""
    if not any(isinstance(f, _AliasFinder) for f in sys.meta_path):
        sys.meta_path.append(_AliasFinder())
