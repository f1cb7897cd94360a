"""FSDP v2 x tensor parallelism on 8 XLA:CPU devices beyond Llama: GPT-2, Qwen2, Gemma and Mistral train like the
1D mesh and consolidate; LoRA in bf16 on split linears. (Split from test_tensor_parallel.py so the two files run on
separate pytest-xdist workers.)"""

from __future__ import annotations

import re

import pytest
import torch
from test_tensor_parallel import consolidated_logits_diff, tiles, worker

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

FAMILIES = ("gpt2", "qwen2", "gemma", "mistral")


@pytest.fixture(scope="module")
def families(tmp_path_factory):
    """GPT-2 (Conv1D, packed c_attn, tied embeddings), Qwen2 (GQA, q/k/v biases), Gemma (tied, scaled embeddings)
    and Mistral (sliding-window mask through the head-local attention) on both meshes."""
    root = tmp_path_factory.mktemp("tp_families")
    out = {}
    for t in (2, 1):  # one process per mesh trains the four families in turn (one start-up instead of four)
        reports = worker("train", "--family", ",".join(FAMILIES), "--tensor", str(t), "--out", str(root / f"t{t}"))
        out.update({(f, t): reports[f] for f in FAMILIES})
    out["root"] = root
    return out


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_other_families_train_like_1d_and_consolidate(families, family):
    one, two = families[(family, 1)], families[(family, 2)]
    both = one["losses"] + one["continued"], two["losses"] + two["continued"]
    assert max(abs(a - b) for a, b in zip(*both)) < 1e-4, both
    assert all(one["device_bytes"][d] <= b < one["device_bytes"][d] * 1.05 for d, b in two["device_bytes"].items())
    specs = two["specs"]
    if family == "gpt2":  # Conv1D is [in, out]: c_fc column = dim 1 over tensor, c_proj row = dim 0 over tensor
        assert tiles(specs["transformer.h.0.mlp.c_fc.weight"]) == [4, 2]
        assert tiles(specs["transformer.h.0.mlp.c_proj.weight"]) == [2, 4]
        assert tiles(specs["transformer.wte.weight"]) == [2, 4]  # vocab over tensor (lm_head is the same tensor)
        # c_attn packs q, k, v: not split over tensor (plain FSDP over all 8 devices)
        assert tiles(specs["transformer.h.0.attn.c_attn.weight"]) == [1, 8]
    else:
        assert tiles(specs["model.layers.0.self_attn.k_proj.weight"]) == [2, 4]
        assert tiles(specs["model.layers.0.mlp.down_proj.weight"]) == [4, 2]
        assert tiles(specs["model.embed_tokens.weight"]) == [2, 4]
    if family == "qwen2":
        assert tiles(specs["model.layers.0.self_attn.k_proj.bias"]) == [8]  # follows its weight's split
    assert consolidated_logits_diff(families["root"] / "t2" / family) < 1e-4


@pytest.mark.slow
def test_lora_in_bf16_on_the_2d_mesh(tmp_path):
    """LoRA on split linears (q_proj, v_proj column, down_proj row), bf16 parameters with fp32 masters."""
    flags = ("--lora", "--dtype", "bfloat16")
    one = worker("train", *flags, "--tensor", "1", "--out", str(tmp_path / "t1"))
    two = worker("train", *flags, "--tensor", "2", "--out", str(tmp_path / "t2"))
    assert two["dtypes"] == ["torch.bfloat16"]
    assert all(one["device_bytes"][d] <= b < one["device_bytes"][d] * 1.05 for d, b in two["device_bytes"].items())
    specs = {k.removeprefix("base_model.model."): v for k, v in two["specs"].items()}
    assert tiles(specs["model.layers.0.self_attn.q_proj.base_layer.weight"]) == [2, 4]  # the base weight keeps the plan
    assert tiles(specs["model.layers.0.mlp.down_proj.base_layer.weight"]) == [4, 2]
    # the adapters: plain FSDP over all 8 devices (correct; XLA inserts what their products need)
    assert tiles(specs["model.layers.0.self_attn.q_proj.lora_A.default.weight"]) == [1, 8]
    assert tiles(specs["model.layers.0.self_attn.q_proj.lora_B.default.weight"]) == [8, 1]
    both = one["losses"] + one["continued"], two["losses"] + two["continued"]
    # bf16 compute: the two meshes sum in another order; 1e-3 is far below a real difference (lr 1e-2 moves ~1e-2)
    assert max(abs(a - b) for a, b in zip(*both)) < 1e-3, both
    back = worker("resume", *flags, "--tensor", "1", "--ckpt", str(tmp_path / "t2" / "ckpt"),
                  "--ref", str(tmp_path / "t2" / "ref.safetensors"))
    assert back["differ"] == [] and back["missing"] == []  # fp32 masters restored, bf16 parameters bit-equal
    # the CLI writes peft's adapter files from the 2D checkpoint: the fp32 masters, which round to the trained weights
    from safetensors.torch import load_file

    from hf_xla_fsdp.cli import main

    assert main(["consolidate", str(tmp_path / "t2" / "ckpt"), "--output", str(tmp_path / "adapter"), "--quiet"]) == 0
    adapter, trained = load_file(str(tmp_path / "adapter" / "adapter_model.safetensors")), load_file(
        str(tmp_path / "t2" / "ref.safetensors"))
    assert len(adapter) == 12  # A and B of q_proj, v_proj, down_proj in 2 layers
    for name, value in adapter.items():
        assert torch.equal(value.to(torch.bfloat16), trained[re.sub(r"(lora_[AB])\.weight", r"\1.default.weight", name)])
