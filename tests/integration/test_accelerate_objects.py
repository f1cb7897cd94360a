"""accelerate's gather_object on XLA with XlaFsdpAccelerator (upstream raises NotImplementedError there): objects of
every kind and of different sizes from call to call, reached however user code calls it, in one process on XLA:CPU.

Several replica processes cannot all-gather on XLA:CPU (see docs/troubleshooting.md); under `accelerate launch` the
same code runs accelerate's own test script: tests/e2e/test_accelerate_test_script.py.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import accelerate.utils
import pytest
import torch

# bound before any XlaFsdpAccelerator exists (the module fixture builds it), as at the top of a user's script
from accelerate.utils import gather_object as gather_object_imported_early
from helpers import ROOT, xla_env

from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin, runtime


@pytest.fixture(scope="module")
def accelerator() -> XlaFsdpAccelerator:
    return XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())


def compiles() -> int:
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return data[0] if data else 0


def test_lists_give_their_items_and_other_objects_one_item(accelerator):
    # one process: accelerate's rule for byte-padded gathers (a list adds its items, anything else one item)
    assert gather_object_imported_early([1, "two", (3, 4), None]) == [1, "two", (3, 4), None]
    assert gather_object_imported_early([]) == []
    nested = {"ids": [1, 2], "text": ["a", "bc"], "scores": {"f1": 0.5}}
    assert accelerate.utils.gather_object(nested) == [nested]
    assert accelerate.utils.gather_object("a string") == ["a string"]
    assert accelerate.utils.gather_object(3.5) == [3.5]


def test_tensors_come_back_equal_on_their_device_and_dtype(accelerator):
    host = torch.arange(6, dtype=torch.int64).view(2, 3)
    device = torch.linspace(-1, 1, 5, dtype=torch.bfloat16).to(accelerator.device)  # numpy has no bfloat16
    got = gather_object_imported_early([host, device])
    assert got[0].device.type == "cpu" and torch.equal(got[0], host)
    assert got[1].device.type == "xla" and got[1].dtype == torch.bfloat16
    assert torch.equal(got[1].cpu(), device.cpu())
    alone = accelerate.utils.gather_object(host)
    assert len(alone) == 1 and torch.equal(alone[0], host)


def test_strings_of_every_length_round_trip_and_a_size_class_compiles_once(accelerator):
    gather = accelerate.utils.gather_object
    assert gather(["warm-up"]) == ["warm-up"]  # the lengths gather and the smallest byte gather are compiled
    before = compiles()
    for n in (0, 1, 17, 300, 2000, 3900):  # pickles shorter than runtime.GATHER_MIN_BYTES: one size class
        text = "".join(chr(ord("a") + i % 26) for i in range(n))
        assert gather([text]) == [text]
        assert gather({"text": text, "n": n}) == [{"text": text, "n": n}]
    assert compiles() == before, "payloads of one size class should reuse the compiled gathers"
    big = "x" * 100_000  # several size classes up: one more compiled gather
    assert gather(big) == [big]
    assert compiles() == before + 1


@pytest.mark.parametrize("length", [0, 1, runtime.GATHER_MIN_BYTES, runtime.GATHER_MIN_BYTES + 1])
def test_bytes_at_the_size_class_edges_round_trip(accelerator, length):
    payload = bytes(range(256)) * (length // 256) + bytes(range(length % 256))
    assert runtime.all_gather_bytes(payload) == [payload]
    assert runtime.gather_buffer_size(length) >= max(length, runtime.GATHER_MIN_BYTES)


def test_gather_for_metrics_with_objects(accelerator):
    preds = [{"id": i, "label": "pos" if i % 2 else "neg"} for i in range(5)]
    assert accelerator.gather_for_metrics(preds, use_gather_object=True) == preds
    assert accelerator.gather_for_metrics(["any", "strings"]) == ["any", "strings"]  # not tensors: objects
    tensors = [torch.tensor([1.0, 2.0]), torch.tensor([3.0])]  # different shapes: not concatenable
    got = accelerator.gather_for_metrics(tensors, use_gather_object=True)
    assert [t.tolist() for t in got] == [[1.0, 2.0], [3.0]]


def test_upstream_code_still_runs_for_other_distributed_types(accelerator):
    from hf_xla_fsdp.process import process_state

    # what the patch delegates to off XLA is upstream's own function body, which on XLA still raises
    with pytest.raises(NotImplementedError, match="gather objects in TPU"):
        process_state().upstream_gather_object(["x"])


def test_importing_the_package_changes_nothing_upstream_building_the_accelerator_does():
    code = textwrap.dedent("""
        import accelerate.utils.operations as ops
        original = ops.gather_object.__code__
        import hf_xla_fsdp, hf_xla_fsdp.integrations.accelerate, hf_xla_fsdp.integrations.patches
        assert ops.gather_object.__code__ is original, "import patched gather_object"
        try:
            ops.gather_object(["x"])
        except NotImplementedError:
            pass
        else:
            raise AssertionError("upstream gather_object should still raise on XLA")
        from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin
        XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
        assert ops.gather_object(["x"]) == ["x"]
        print("ok")
    """)
    res = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=xla_env(), capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-3000:]
