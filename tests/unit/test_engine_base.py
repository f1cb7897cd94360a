"""The engine seam is neutral and abstract: ``Engine`` assumes no runtime, ``XlaEngine`` holds torch_xla's defaults,
and what only XLA has (its compilation cache, ``xmp.spawn``) is asked of the engine, not assumed of every one."""

from __future__ import annotations

import inspect
import subprocess
import sys

import pytest
from helpers import ROOT

from hf_xla_fsdp.engines import ENGINES
from hf_xla_fsdp.engines.base import Engine, Machines
from hf_xla_fsdp.engines.fsdp2 import Fsdp2
from hf_xla_fsdp.engines.xla import XlaEngine
from hf_xla_fsdp.errors import ConfigError

#: what every engine implements: its runtime's processes, device and state, its units and its rank files
ABSTRACT = {"device", "multi_process", "process_index", "process_count", "gather_bytes", "collectives", "sync",
            "rng_state", "set_rng_state", "unit_class", "make_unit", "checkpoint_block", "rank_world",
            "original_names", "rank_state", "restore"}


def test_the_base_engine_is_abstract_and_assumes_no_runtime():
    assert Engine.__abstractmethods__ == ABSTRACT
    with pytest.raises(TypeError, match="abstract"):
        Engine()
    assert (Engine.runtime_module, Engine.compiles_graphs, Engine.compilation_cache) == (None, False, False)
    # a subclass that forgets one method is refused when made, naming the method
    partial = type("Partial", (Engine,), {name: lambda self, *a, **k: None for name in ABSTRACT - {"restore"}})
    with pytest.raises(TypeError, match="restore"):
        partial()


def test_the_xla_defaults_live_in_xla_engine_and_fsdp2_inherits_none_of_them():
    assert not XlaEngine.__abstractmethods__ & {"device", "process_index", "gather_bytes", "collectives", "sync",
                                                "rng_state", "set_rng_state", "checkpoint_block"}
    xla = [e for e in ENGINES.values() if isinstance(e, XlaEngine)]
    assert sorted(e.key for e in xla) == ["xla_v1", "xla_v2"]
    assert all(e.runtime_module == "torch_xla" and e.compiles_graphs and e.compilation_cache for e in xla)
    fsdp2 = ENGINES["fsdp2"]
    assert not isinstance(fsdp2, XlaEngine)
    assert (fsdp2.runtime_module, fsdp2.compiles_graphs, fsdp2.compilation_cache) == (None, False, False)
    # fsdp2 no longer undoes XLA defaults: every method it defines is either its implementation of an abstract one
    # or an override of a neutral default, never one of XlaEngine's
    own = {name for name, _ in inspect.getmembers(Fsdp2, inspect.isfunction) if name in vars(Fsdp2)}
    assert own & set(vars(XlaEngine)) <= ABSTRACT | {"start_processes", "check_machines"}


def test_neutral_launch_defaults_refuse_in_one_line():
    class Neutral(Fsdp2):
        title = "Neutral engine"
        start_processes = Engine.start_processes
        check_machines = Engine.check_machines

    engine = Neutral()
    with pytest.raises(ConfigError, match="^num_processes=2: Neutral engine does not start processes; drop num_proc"):
        engine.start_processes(2, [])
    with pytest.raises(ConfigError, match="^--num_machines 2: Neutral engine does not start processes across machines"):
        engine.check_machines(Machines(count=2, main_ip="10.0.0.1", given=("--num_machines 2",)))
    engine.check_machines(Machines())  # one machine: nothing to refuse
    with pytest.raises(ConfigError, match="^--num_machines 2: FSDP v1 .*on a TPU pod run the same"):
        ENGINES["xla_v1"].check_machines(Machines(count=2, main_ip="10.0.0.1", given=("--num_machines 2",)))


def test_importing_the_engines_imports_no_runtime():
    # the XLA base holds torch_xla's defaults but imports torch_xla inside methods only (importing starts its runtime)
    code = ("import sys, hf_xla_fsdp.engines.xla, hf_xla_fsdp.engines; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('torch_xla', 'torch_tpu')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
