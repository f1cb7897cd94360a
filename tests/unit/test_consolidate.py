"""Consolidation of real multi-rank FSDP state into a from_pretrained-ready safetensors directory."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import build_ranks, run_python, save_ranks, save_torch_xla_style, save_trainer_style, tiny_gpt2, tiny_llama
from helpers import consolidate as xla_consolidate
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM

from hf_xla_fsdp.checkpoint.consolidate import consolidate
from hf_xla_fsdp.modeling.meta_init import build_eager

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

IDS = torch.tensor([[1, 5, 9, 13, 17, 21, 25, 29]])


def _reference(config, cls=LlamaForCausalLM):
    torch.manual_seed(0)
    return build_eager(config, model_cls=cls)


def _load(path):
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    return model.eval()


def _assert_same_model(loaded, ref):
    ref_state = ref.state_dict()
    got = loaded.state_dict()
    assert got.keys() == ref_state.keys()
    for key, value in ref_state.items():
        assert torch.equal(got[key], value), key
    with torch.no_grad():
        assert torch.equal(loaded(IDS).logits, ref.eval()(IDS).logits)


@pytest.mark.parametrize("world", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("flatten", [False, True])
def test_multi_rank_consolidation_is_bit_exact(tmp_path, world, flatten):
    config = tiny_llama()
    models = build_ranks(config, world, flatten_parameters=flatten)
    save_ranks(tmp_path / "ckpt", models, step=7)
    summary = consolidate(tmp_path / "ckpt", tmp_path / "out", progress=False)
    assert summary["world_size"] == world
    _assert_same_model(_load(tmp_path / "out"), _reference(config))


@pytest.mark.parametrize("world", [3, 8])
def test_shard_param_on_dim_0(tmp_path, world):
    config = tiny_llama()
    save_ranks(tmp_path / "ckpt", build_ranks(config, world, shard_param_on_dim_0=True))
    consolidate(tmp_path / "ckpt", tmp_path / "out", progress=False)
    _assert_same_model(_load(tmp_path / "out"), _reference(config))


def test_tied_weights_and_sharded_output_with_index(tmp_path):
    config = tiny_gpt2()
    save_ranks(tmp_path / "ckpt", build_ranks(config, 4))
    summary = consolidate(tmp_path / "ckpt", tmp_path / "out", max_shard_size="60KB", progress=False)
    assert len(summary["files"]) > 1
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == set(summary["files"])
    assert "lm_head.weight" not in index["weight_map"]  # tied: stored once, tied again on load
    for name in summary["files"]:
        with safe_open(str(tmp_path / "out" / name), framework="pt") as fh:
            assert fh.metadata() == {"format": "pt"}
    loaded = _load(tmp_path / "out")
    assert loaded.lm_head.weight is loaded.transformer.wte.weight
    _assert_same_model(loaded, _reference(config, GPT2LMHeadModel))


def test_bf16_output(tmp_path):
    config = tiny_llama()
    save_ranks(tmp_path / "ckpt", build_ranks(config, 2))
    consolidate(tmp_path / "ckpt", tmp_path / "out", dtype="bfloat16", progress=False)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["dtype"] == "bfloat16"
    loaded = _load(tmp_path / "out")
    ref = _reference(config)
    for key, value in ref.state_dict().items():
        got = loaded.state_dict()[key]
        assert got.dtype == torch.bfloat16 and torch.equal(got, value.to(torch.bfloat16)), key


def test_trained_model_logits_reproduced(tmp_path):
    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.checkpoint import save_checkpoint
    from hf_xla_fsdp.train import arithmetic_lm_batches, to_device, train_step, xla_device

    config = tiny_llama()
    model = XlaFsdpPlugin(activation_checkpointing=True).build(config, progress=False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = arithmetic_lm_batches(config.vocab_size, 16, 4)
    for _ in range(3):
        train_step(model, to_device(next(data), xla_device()), opt)
    save_checkpoint(tmp_path / "ckpt", model, opt, step=3)
    consolidate(tmp_path / "ckpt", tmp_path / "out", progress=False)
    loaded = _load(tmp_path / "out")
    model.eval()
    with torch.no_grad():
        fsdp_logits = model(input_ids=IDS.to(xla_device())).logits.cpu()
        hf_logits = loaded(IDS).logits
    # same fp32 weights; XLA:CPU and eager CPU kernels differ only in summation order
    torch.testing.assert_close(hf_logits, fsdp_logits, atol=1e-4, rtol=1e-4)


def test_torch_xla_prefix_format_matches_torch_xla_consolidation(tmp_path):
    config = tiny_llama()
    models = build_ranks(config, 4, flatten_parameters=True)
    expected = xla_consolidate(models)
    (tmp_path / "run").mkdir()
    save_torch_xla_style(str(tmp_path / "run" / "final_ckpt"), models)
    config.save_pretrained(tmp_path / "cfg")
    consolidate(str(tmp_path / "run" / "final_ckpt"), tmp_path / "out", ckpt_suffix="_rank-*-of-*.pth",
                config=tmp_path / "cfg", progress=False)
    loaded = _load(tmp_path / "out")
    for key, value in expected.items():
        assert torch.equal(loaded.state_dict()[key], value), key


def test_trainer_format_directory(tmp_path):
    config = tiny_llama()
    save_trainer_style(tmp_path / "checkpoint-10", build_ranks(config, 2))
    config.save_pretrained(tmp_path / "checkpoint-10")  # Trainer saves the config next to the rank files
    consolidate(tmp_path / "checkpoint-10", tmp_path / "out", config=tmp_path / "checkpoint-10", progress=False)
    _assert_same_model(_load(tmp_path / "out"), _reference(config))


def test_side_files_are_copied(tmp_path):
    config = tiny_llama()
    save_ranks(tmp_path / "run" / "checkpoint-1", build_ranks(config, 2))
    (tmp_path / "run" / "tokenizer_config.json").write_text("{}")
    (tmp_path / "run" / "checkpoint-1" / "generation_config.json").write_text('{"max_new_tokens": 4}')
    summary = consolidate(tmp_path / "run" / "checkpoint-1", tmp_path / "out", progress=False)
    assert sorted(summary["side_files"]) == ["generation_config.json", "tokenizer_config.json"]
    assert (tmp_path / "out" / "tokenizer_config.json").is_file()


def test_consolidation_cli_never_imports_torch_xla_nor_transformers_for_our_checkpoints(tmp_path):
    """Our rank files carry their model's config: writing it back needs no transformers import (whose config
    classes pull in torch._dynamo, ~190 MiB); a foreign config (--config) is still checked with transformers."""
    config = tiny_llama()
    save_ranks(tmp_path / "ckpt", build_ranks(config, 2))
    code = ("import sys; from hf_xla_fsdp.cli import main; "
            f"rc = main(['consolidate', {str(tmp_path / 'ckpt')!r}, '-o', {str(tmp_path / 'out')!r}, '--quiet']); "
            "assert rc == 0; print(sorted(m for m in ('torch_xla', 'transformers', 'torch._dynamo') if m in sys.modules))")
    res = run_python(["-c", code], timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]", res.stdout
    saved = json.loads((tmp_path / "out" / "config.json").read_text())
    assert saved["dtype"] == "float32" and "_name_or_path" not in saved
    _assert_same_model(_load(tmp_path / "out"), _reference(config))
    # the same checkpoint with its config given explicitly: checked against the model and saved by transformers
    consolidate(tmp_path / "ckpt", tmp_path / "out2", config=tmp_path / "out", progress=False)
    _assert_same_model(_load(tmp_path / "out2"), _reference(config))
