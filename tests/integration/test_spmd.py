"""FSDP v2 (SPMD) on several XLA:CPU devices: sharding, equality with one device, save/resume/consolidate."""

from __future__ import annotations

import json
import re

import pytest
import torch
from helpers import SCRIPTS, run_python

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

WORKER = SCRIPTS / "spmd_worker.py"


def worker(mode: str, devices: int, *args: str, timeout: int = 600) -> dict:
    """Run one spmd_worker.py scenario on ``devices`` XLA:CPU devices; its JSON report."""
    res = run_python([WORKER, mode, *args], devices=devices, timeout=timeout, preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def many(devices: int, *scenarios: list[str], timeout: int = 900) -> list[dict]:
    """Several spmd_worker.py scenarios on the same ``devices`` in one process (one start-up instead of several); their
    reports, in order."""
    res = run_python([WORKER, "--many", json.dumps(scenarios)], devices=devices, timeout=timeout, preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def sharded_on_four() -> dict[str, dict]:
    """The shard reports on 4 devices, plain FSDP and with 2 replicas."""
    plain, hybrid = many(4, ["shard"], ["shard", "--replicas", "2"])
    return {"plain": plain, "hybrid": hybrid}


@pytest.fixture(scope="module")
def trained_on_four(tmp_path_factory) -> dict[str, dict]:
    """The training scenarios on 4 devices (the slow tests'), in one process."""
    out = tmp_path_factory.mktemp("spmd")
    names = ["train", "train-hybrid", "roundtrip", "fp32", "bf16"]
    reports = many(4, ["train"], ["train", "--replicas", "2"], ["roundtrip", "--out", str(out / "roundtrip")],
                   ["precision", "--out", str(out / "fp32")],
                   ["precision", "--out", str(out / "bf16"), "--dtype", "bfloat16"])
    return {"out": out, **dict(zip(names, reports))}


def tile_devices(spec: str) -> int:
    """Devices a sharding annotation splits a tensor over (replication tiles excluded)."""
    dims = [int(d) for d in re.search(r"devices=\[([\d,]+)\]", spec).group(1).split(",")]
    count = 1
    for d in dims[:-1] if "last_tile_dim_replicate" in spec else dims:
        count *= d
    return count


@pytest.mark.parametrize("devices", [4, 8])
def test_every_parameter_is_sharded_over_all_devices(devices, request):
    report = request.getfixturevalue("sharded_on_four")["plain"] if devices == 4 else worker("shard", devices)
    assert report["devices"] == devices and report["units"] == 4  # 3 decoder layers + root
    # layer by layer: when layer i is sharded, layers i+1.. have not been materialized yet
    assert report["build_order"] == [[f"model.layers.{i}", list(range(i + 1, 3))] for i in range(3)]
    for name, spec in report["specs"].items():
        assert tile_devices(spec) == devices, (name, spec)
    per_device = report["device_bytes"]
    assert len(per_device) == devices
    # each device holds 1/N of the parameters (uneven dimensions are padded, at most a row each)
    for nbytes in per_device.values():
        assert report["total_bytes"] / devices <= nbytes * 1.0001 and nbytes < report["total_bytes"] / devices * 1.05


def test_hybrid_mesh_replicates_over_the_replica_axis(sharded_on_four):
    report = sharded_on_four["hybrid"]
    assert report["mesh"] == [2, 2]
    for name, spec in report["specs"].items():
        assert "last_tile_dim_replicate" in spec and tile_devices(spec) == 2, (name, spec)


@pytest.mark.slow
def test_losses_on_four_devices_equal_one_device(trained_on_four):
    one = worker("train", 1)["losses"]
    four = trained_on_four["train"]["losses"]
    hybrid = trained_on_four["train-hybrid"]["losses"]
    assert one[-1] < one[0] - 0.05  # it trains
    assert abs(one[0] - four[0]) < 1e-6 and abs(one[0] - hybrid[0]) < 1e-6  # same init, same first forward
    # fp32: sharded reductions sum in another order (~1e-6 relative in the gradients) and AdamW's
    # division by sqrt(v) amplifies that on near-zero entries; it stays far below any real difference
    assert max(abs(a - b) for a, b in zip(one, four)) < 1e-4, (one, four)
    assert max(abs(a - b) for a, b in zip(one, hybrid)) < 1e-4, (one, hybrid)


@pytest.mark.slow
def test_save_resume_consolidate_from_pretrained(trained_on_four):
    report = trained_on_four["roundtrip"]
    assert report["step"] == 3 and report["state_specs_sharded"]
    assert report["resumed"] == report["continued"]  # bit-exact resume
    assert report["loading_info"] == {"missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    assert report["logits_max_diff"] < 1e-5
    assert (trained_on_four["out"] / "roundtrip" / "ckpt" / "checkpoint_complete.json").is_file()


def test_v2_settings_are_validated():
    with pytest.raises(ConfigError, match="compute_dtype=float16 is not available with engine=xla_v2: .* use bfloat16"):
        XlaFsdpPlugin(version=2, compute_dtype="fp16")
    assert XlaFsdpPlugin(version=2, compute_dtype="bf16").compute_dtype is torch.bfloat16


@pytest.mark.slow
def test_bf16_on_four_devices_trains_like_fp32_and_resumes_exactly(trained_on_four):
    fp32, bf16 = trained_on_four["fp32"], trained_on_four["bf16"]
    # parameters are stored in bf16, sharded like the fp32 run's; their fp32 master copies too
    assert set(bf16["param_dtypes"]) == {"torch.bfloat16"} and set(fp32["param_dtypes"]) == {"torch.float32"}
    assert bf16["specs"] == fp32["specs"] and bf16["master_specs"] == fp32["specs"]
    assert all(tile_devices(spec) == 4 for spec in bf16["specs"].values())
    for device, nbytes in bf16["device_bytes"].items():
        assert nbytes * 2 == fp32["device_bytes"][device]
    # AdamW state stays fp32, one pair per trainable parameter: the same bytes as in fp32
    assert bf16["optimizer_state_bytes"] == fp32["optimizer_state_bytes"] > 0
    # same data and init, AdamW at 1e-3: bf16 rounding moves the loss by < 0.02 over 12 steps
    assert max(abs(a - b) for a, b in zip(bf16["losses"], fp32["losses"])) < 2e-2, (bf16["losses"], fp32["losses"])
    assert bf16["losses"][-1] < bf16["losses"][0] - 0.1  # it trains
    # the checkpoint holds the fp32 masters: resuming reproduces the uninterrupted run bit for bit
    assert bf16["resumed"] == bf16["losses"][6:] and fp32["resumed"] == fp32["losses"][6:]
    assert bf16["saved_dtypes"] == ["float32"]
    with pytest.raises(ConfigError, match="flatten_parameters applies to engine=xla_v1"):
        XlaFsdpPlugin(version=2, flatten_parameters=True)
    assert XlaFsdpPlugin.from_fsdp_config({"xla": True, "xla_fsdp_v2": True}).version == 2
    with pytest.raises(ConfigError, match="replica_size=0 must be an integer >= 1"):
        XlaFsdpPlugin(version=2, replica_size=0)
