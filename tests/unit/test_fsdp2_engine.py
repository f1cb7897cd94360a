"""Engine fsdp2's parts that need no process group: the device and backend choice (TorchTPU's included, through a
stand-in package, since no TPU is here), the mesh layout, the engine registry and the readers of its rank files."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from helpers import ROOT, SCRIPTS, fsdp2_env

from hf_xla_fsdp.checkpoint.readers import read_pieces, read_rows_of_pieces
from hf_xla_fsdp.errors import CheckpointError, ConfigError

FAKE_TPU = SCRIPTS / "fake_torch_tpu"

PROBE = """
import json, sys
from hf_xla_fsdp import XlaFsdpPlugin
from hf_xla_fsdp.engines import engine_for
from hf_xla_fsdp.engines.fsdp2 import compile_options, resolve_device
out = {"device": resolve_device(), "compile": compile_options(), "default_engine": XlaFsdpPlugin().engine,
       "engine": engine_for(XlaFsdpPlugin()).name}
try:
    engine_for(XlaFsdpPlugin(engine="xla"))
except Exception as err:
    out["xla_error"] = f"{type(err).__name__}: {err}"
out["torch_xla_imported"] = "torch_xla" in sys.modules
print(json.dumps(out))
"""


def probe(pythonpath: list, env: dict | None = None) -> dict:
    """What a fresh process with torch_xla unimportable picks, and whether it imported torch_xla."""
    full = fsdp2_env({"PYTHONPATH": ":".join(map(str, [*pythonpath, SCRIPTS / "no_torch_xla"])), **(env or {})},
                     block_xla=False)
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=full, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_torch_tpu_device_and_backend_are_chosen_without_torch_xla():
    # torch_tpu 0.2.0 renames PrivateUse1 to "tpu" and registers backend tpu_dist for it (its _loader.load); the
    # stand-in registers the same, so the choice is what a TPU VM with TorchTPU gets
    found = probe([FAKE_TPU])
    assert found["device"] == ["tpu", "tpu_dist"]
    # compile: true on TPUs: TorchTPU's own torch.compile backend, static shapes (the only ones it compiles)
    assert found["compile"] == {"backend": "tpu", "dynamic": False}
    assert found["default_engine"] == "fsdp2" and found["engine"] == "fsdp2"
    assert not found["torch_xla_imported"]
    # the XLA engines need torch_xla: one line naming the fix
    assert found["xla_error"] == ("ConfigError: FSDP v1 (XlaFullyShardedDataParallel) needs torch_xla, which is not "
                                  "installed: pip install 'hf_xla_fsdp[xla]', or use engine='fsdp2' (torch's own "
                                  "FSDP2, no torch_xla)")


def test_the_device_can_be_forced():
    # (with nothing forced and no accelerator, cpu/gloo: what every torchrun test here runs on)
    forced = probe([FAKE_TPU], {"HF_XLA_FSDP_DEVICE": "cpu"})
    assert forced["device"] == ["cpu", "gloo"] and not forced["torch_xla_imported"]
    assert forced["compile"] == {"backend": "inductor", "dynamic": None}  # automatic dynamic shapes


def test_compile_is_engine_fsdp2s_and_refused_on_the_xla_engines_in_one_line():
    from hf_xla_fsdp import XlaFsdpPlugin

    assert XlaFsdpPlugin(engine="fsdp2", compile="true").compile is True
    assert XlaFsdpPlugin.from_fsdp_config({"engine": "fsdp2", "compile": True}).compile is True  # benchmarks/peers.py
    for version in (1, 2):
        with pytest.raises(ConfigError, match=r"^compile=True is not available with .*the XLA engines compile every "
                                              r"step into XLA graphs already .*remove compile, or use engine=fsdp2$"):
            XlaFsdpPlugin(engine="xla", version=version, compile=True)


def test_mesh_layout():
    from hf_xla_fsdp.engines.fsdp2 import mesh_layout

    assert mesh_layout(4, 1) == ((4,), ("fsdp",))
    assert mesh_layout(8, 2) == ((2, 4), ("replica", "fsdp"))  # HSDP: shards within a group, replicas across
    with pytest.raises(ConfigError, match="replica_size=3 does not divide the 4 processes"):
        mesh_layout(4, 3)


def test_the_engine_is_registered_under_its_key_and_imports_no_runtime():
    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.engines import ENGINES, engine_for

    engine = engine_for(XlaFsdpPlugin(engine="fsdp2"))
    assert ENGINES["fsdp2"] is engine and engine.runtime_module is None and not engine.compiles_graphs
    assert engine.checkpoint_layout == ENGINES["xla_v2"].checkpoint_layout  # the pieces layout: XLA v2 <-> fsdp2 resumes


class _File:
    """A rank file holding named tensors (piece keys are unique within a file only)."""

    def __init__(self, tensors: dict[str, torch.Tensor]) -> None:
        self.tensors = tensors

    def get(self, key: str) -> torch.Tensor:
        return self.tensors[key]

    def get_rows(self, key: str, start: int, stop: int) -> torch.Tensor:
        return self.tensors[key][start:stop]


def test_pieces_of_several_files_with_the_same_keys_assemble():
    full = torch.arange(48, dtype=torch.float32).reshape(6, 8)
    # two processes each named their piece "#0"; XLA FSDP v2 also splits some tensors on dim 1
    entry = {"shape": [6, 8], "dtype": "float32", "pieces": [
        {"key": "w#0", "start": [0, 0], "stop": [6, 4], "file": _File({"w#0": full[:, :4].clone()})},
        {"key": "w#0", "start": [0, 4], "stop": [6, 8], "file": _File({"w#0": full[:, 4:].clone()})}]}
    assert torch.equal(read_pieces(entry), full)
    assert torch.equal(read_rows_of_pieces(entry, 2, 5), full[2:5])  # only the rows a process of 2 holds
    assert read_rows_of_pieces(entry, 6, 6).shape == (0, 8)  # a process holding no rows (uneven split)
    entry["pieces"].pop()
    with pytest.raises(CheckpointError, match="cover 12 of the 24 elements of its rows 1:4"):
        read_rows_of_pieces(entry, 1, 4)


def test_the_planner_sizes_fsdp2_shards_as_dim0_rows(llama_config):
    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.planning.tpu import chip_memory
    from hf_xla_fsdp.planning.units import plan

    ours, v1 = XlaFsdpPlugin(engine="fsdp2"), XlaFsdpPlugin(engine="xla")
    report = plan(llama_config, ours, world_size=3)
    # fully_shard gives each of 3 ranks at most ceil(rows / 3) rows of every parameter (torch.chunk), no flat padding
    expected = 0
    for name, rows, cols in [("embed", 128, 64), ("lm_head", 128, 64), ("norm", 64, 1)]:
        expected += -(-rows // 3) * cols * 4
    per_layer = [(64, 64), (32, 64), (32, 64), (64, 64), (128, 64), (128, 64), (64, 128), (64, 1), (64, 1)]
    expected += llama_config.num_hidden_layers * sum(-(-rows // 3) * cols * 4 for rows, cols in per_layer)
    assert report["engine"] == "fsdp2" and report["bytes_per_rank"] == expected
    assert plan(llama_config, v1, world_size=3)["bytes_per_rank"] > expected  # v1 pads to multiples of 3 * 128
    chip = chip_memory(llama_config, ours, 4)
    assert chip["mesh"] == {"replica": 1, "fsdp": 4, "tensor": 1}


MAPPED_PROBE = """
import ctypes, json, sys, torch
from hf_xla_fsdp.engines.fsdp2 import map_large_host_allocations
FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"
class Info(ctypes.Structure):  # glibc's struct mallinfo2 (glibc >= 2.33)
    _fields_ = [(n, ctypes.c_size_t) for n in FIELDS.split()]
libc = ctypes.CDLL("libc.so.6")
libc.mallinfo2.restype = Info
out = {"set": map_large_host_allocations() if sys.argv[1] == "engine" else None}
freed = torch.empty(12 << 20, dtype=torch.uint8)  # the first large block freed (a gathered unit's, in training)
del freed
before = libc.mallinfo2().hblks
kept = torch.empty(2 << 20, dtype=torch.uint8)
out["mapped"] = libc.mallinfo2().hblks - before
print(json.dumps(out))
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
@pytest.mark.parametrize("case", ["glibc default", "engine", "environment wins"])
def test_on_the_cpu_large_host_blocks_stay_mapped_after_a_larger_one_is_freed(case):
    # glibc's default raises its mmap threshold to the 12 MiB block freed, so the 2 MiB block comes from the heap
    # (hblks unchanged): the heap fragmentation that moved dpo_memory's peaks by +-100 MiB; the engine's fixed 1 MiB
    # threshold maps it (one more mapped block); MALLOC_MMAP_THRESHOLD_ in the environment is glibc's and is left alone
    env = dict(fsdp2_env({}, block_xla=False))
    env.pop("MALLOC_MMAP_THRESHOLD_", None)
    if case == "environment wins":
        env["MALLOC_MMAP_THRESHOLD_"] = str(32 << 20)
    done = subprocess.run([sys.executable, "-c", MAPPED_PROBE, "default" if case == "glibc default" else "engine"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out == {"glibc default": {"set": None, "mapped": 0}, "engine": {"set": True, "mapped": 1},
                   "environment wins": {"set": False, "mapped": 0}}[case]
