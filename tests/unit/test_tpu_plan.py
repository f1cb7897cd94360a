"""The TPU memory planner: slice names, the verdict for real model sizes, bad input, and its exact parts
(parameter, gradient, optimizer-state bytes, gathered unit) against the tensors of really wrapped models."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, run_python, tiny_llama

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin
from hf_xla_fsdp.planning.tpu import TPU_GENERATIONS, chip_memory, format_plan, parse_slice, plan_tpu

BIN = Path(sys.executable).parent
WORKER = SCRIPTS / "tpu_plan_worker.py"
# vocab 130 and odd widths: no parameter divides evenly, so every padding rule is exercised
CONFIG = dict(vocab_size=130, hidden_size=72, intermediate_size=136, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2)


def test_slice_names_count_chips_as_google_does():
    assert parse_slice("v5p-8").chips == 4 and parse_slice("v4-32").chips == 16  # TensorCores, 2 per chip
    assert parse_slice("v5e-4").chips == 4 and parse_slice("v5litepod-16").chips == 16 and parse_slice("v6e-8").chips == 8
    assert parse_slice("v5e-4").hbm_bytes == 16 * 2**30 and parse_slice("v5p-8").hbm_bytes == 95 * 2**30
    assert {g: TPU_GENERATIONS[g].hbm_bytes // 2**30 for g in TPU_GENERATIONS} == {"v4": 32, "v5e": 16, "v5p": 95, "v6e": 32}
    for bad in ("v9-8", "v5e-3", "v4-4", "tpu"):
        with pytest.raises(ConfigError, match=r"unknown TPU slice .*known slices: v4-8, v4-16"):
            parse_slice(bad)


def _plan(*args, expect_rc=0):
    res = run_python([BIN / "hf-xla-fsdp", "plan", *args], timeout=600, preloaded=True)
    assert res.returncode == expect_rc, res.stderr
    return res


def test_llama_7b_fits_v5p_8_but_not_v5e_4():
    small = plan_tpu("llama-2-7b", XlaFsdpPlugin(), "v5e-4")
    assert small["fits"] is False and small["tpu"]["chips"] == 4
    assert 6.7e9 < small["total_params"] < 6.8e9
    pc = small["per_chip"]
    # fp32 parameters, fp32 gradient shards and two AdamW moments: 16 bytes a parameter, over 4 chips
    assert pc["parameters"] == pc["gradients"] and pc["optimizer_state"] == 2 * pc["parameters"]
    assert small["total_params"] * 4 / 4 <= pc["parameters"] < small["total_params"] * 4 / 4 * 1.001
    assert pc["total"] > 16 * 2**30
    changes = [s["change"] for s in small["suggestions"]]
    assert "--activation-checkpointing" in changes and "--compute-dtype bfloat16" in changes
    # all changes together, on the smallest v5e slice that then fits
    together = small["suggestions"][-1]
    assert together["fits"] and together["total"] <= 16 * 2**30
    assert together["change"].startswith("--activation-checkpointing --compute-dtype bfloat16 --tpu v5e-")
    text = format_plan(small)  # the human-readable form labels its estimates
    assert "fits: false" in text and "activations (ESTIMATE)" in text and "parameters (exact)" in text
    # the command line, as a user runs it
    big = json.loads(_plan("llama-2-7b", "--tpu", "v5p-8", "--json").stdout)
    assert big["fits"] is True and big["tpu"]["chips"] == 4 and big["suggestions"] == []
    assert big["per_chip"]["parameters"] == pc["parameters"] and big["per_chip"]["total"] <= 95 * 2**30


def test_plan_bad_input_is_one_line(tmp_path):
    res = _plan("llama-2-7b", "--tpu", "v9-8", expect_rc=2)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "unknown TPU slice 'v9-8'" in lines[0] and "v5p-8" in lines[0] and "v5e-4" in lines[0]
    res = _plan(tmp_path, "--tpu", "v5p-8", expect_rc=2)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "has no config.json" in lines[0]


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


V1_SETTINGS = [{}, {"flatten_parameters": True}, {"shard_param_on_dim_0": True}, {"sharding": "zero2"},
               {"compute_dtype": "bfloat16"}]


@pytest.mark.parametrize("settings", V1_SETTINGS, ids=lambda s: ",".join(s) or "default")
@pytest.mark.xla
def test_v1_exact_parts_equal_the_wrapped_rank(settings):
    from hf_xla_fsdp.engines import fsdp_units

    world, rank = 3, 1
    plugin = XlaFsdpPlugin(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world, **settings)
    torch.manual_seed(0)
    model = plugin.build(tiny_llama(**CONFIG), progress=False)
    planned = chip_memory(tiny_llama(**CONFIG), XlaFsdpPlugin(**settings), world, seq_len=8)
    assert planned["parameters"] == _param_bytes(model)
    # an FSDP unit all-gathers world x its shards, in the compute dtype
    elem = 2 if settings.get("compute_dtype") else 4
    gathered = max(sum(p.numel() for p in unit.sharded_params) * world * elem for _, unit in fsdp_units(model))
    assert planned["largest_unit"]["gathered_bytes"] == gathered
    # real optimizer state over the rank's shards (gradients of the shards' shape, as FSDP's reduce-scatter gives)
    from transformers.optimization import Adafactor

    for name, make in {"adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3), "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-3),
                       "adafactor": lambda ps: Adafactor(ps, lr=1e-3, relative_step=False)}.items():
        opt = make(list(model.parameters()))
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        opt.step()
        on_device = sum(t.numel() * t.element_size() for state in opt.state.values() for t in state.values()
                        if isinstance(t, torch.Tensor) and t.device.type == "xla")
        assert chip_memory(tiny_llama(**CONFIG), XlaFsdpPlugin(**settings), world, optimizer=name,
                           seq_len=8)["optimizer_state"] == on_device, name


@pytest.mark.xla
def test_v1_gradients_are_the_shards_after_a_real_backward():
    import torch_xla

    torch.manual_seed(0)
    model = XlaFsdpPlugin().build(tiny_llama(**CONFIG), progress=False)  # world 1: a real backward runs here
    ids = torch.randint(0, 130, (2, 8)).to(torch_xla.device())
    model(input_ids=ids, labels=ids).loss.backward()
    torch_xla.sync()
    grads = sum(p.grad.numel() * p.grad.element_size() for p in model.parameters())
    planned = chip_memory(tiny_llama(**CONFIG), XlaFsdpPlugin(), 1, seq_len=8)
    assert planned["gradients"] == grads == _param_bytes(model)


@pytest.mark.slow
@pytest.mark.parametrize("devices,tensor", [(4, 1), (8, 2)])
def test_v2_exact_parts_equal_the_spmd_shards(devices, tensor):
    res = run_python([WORKER, json.dumps(CONFIG), str(tensor)], devices=devices, timeout=600, preloaded=True)
    assert res.returncode == 0, res.stderr[-3000:]
    real = json.loads(res.stdout.strip().splitlines()[-1])
    planned = chip_memory(tiny_llama(**CONFIG), XlaFsdpPlugin(version=2, tensor_parallel_size=tensor), devices, seq_len=8)
    assert set(real["param_bytes_per_device"].values()) == {planned["parameters"]}
    assert set(real["grad_bytes_per_device"].values()) == {planned["gradients"]}
    assert set(real["adamw_bytes_per_device"].values()) == {planned["optimizer_state"]}
