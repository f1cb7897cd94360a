"""Wrapping structure (Llama, GPT-2, BERT), zero2 vs zero3, activation checkpointing, and a training
step of the wrapped model against the unwrapped one."""

from __future__ import annotations

import pytest
import torch
from helpers import consolidate, tiny_bert, tiny_gpt2, tiny_llama
from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin
from hf_xla_fsdp.engines import fsdp_units, unwrap
from hf_xla_fsdp.modeling.meta_init import build_eager
from hf_xla_fsdp.modeling.wrapping import select_blocks
from hf_xla_fsdp.train import sync, train_step, xla_device

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


def _wrapped_class_names(model):
    return sorted({type(unwrap(u)).__name__ for name, u in fsdp_units(model) if name})


@pytest.mark.parametrize(
    "make,cls,expected_units,expected_classes",
    [
        (tiny_llama, LlamaForCausalLM, 3, ["LlamaDecoderLayer"]),
        (tiny_gpt2, GPT2LMHeadModel, 3, ["GPT2Block"]),
        (tiny_bert, BertForMaskedLM, 4, ["BertEmbeddings", "BertLayer"]),
    ],
)
def test_zero3_wraps_each_no_split_module_then_root(make, cls, expected_units, expected_classes):
    model = build_eager(make(), model_cls=cls)
    wrapped = XlaFsdpPlugin().wrap(model)
    units = list(fsdp_units(wrapped))
    assert units[0][0] == ""  # the root is an FSDP unit
    assert len(units) - 1 == expected_units
    assert _wrapped_class_names(wrapped) == expected_classes
    # every parameter left is a shard owned by exactly one unit
    assert all("_fsdp_shard" in n for n, _ in wrapped.named_parameters())


def test_zero2_wraps_only_the_root():
    wrapped = XlaFsdpPlugin(sharding="zero2").wrap(build_eager(tiny_llama()))
    assert [name for name, _ in fsdp_units(wrapped)] == [""]


def test_explicit_class_and_min_num_params_policies(llama_config):
    model = build_eager(llama_config)
    assert select_blocks(model, XlaFsdpPlugin(transformer_layer_cls_to_wrap=["LlamaMLP"])) == [
        "model.layers.0.mlp", "model.layers.1.mlp", "model.layers.2.mlp"]
    # size-based, as torch_xla's size_based_auto_wrap_policy decides
    by_size = select_blocks(model, XlaFsdpPlugin(min_num_params=20_000))
    assert by_size and all(model.get_submodule(n) is not None for n in by_size)
    assert all(sum(p.numel() for p in model.get_submodule(n).parameters()) >= 20_000 for n in by_size)


def test_unknown_class_lists_the_models_classes(llama_config):
    with pytest.raises(ConfigError) as err:
        XlaFsdpPlugin(transformer_layer_cls_to_wrap=["GPT2Block"]).wrap(build_eager(llama_config))
    msg = str(err.value)
    assert "['GPT2Block'] not found in LlamaForCausalLM" in msg and "LlamaDecoderLayer" in msg


def test_wrapping_twice_is_a_clear_error(llama_config):
    wrapped = XlaFsdpPlugin().wrap(build_eager(llama_config))
    with pytest.raises(ConfigError, match="already wrapped with XlaFullyShardedDataParallel"):
        XlaFsdpPlugin().wrap(wrapped)
    with pytest.raises(ConfigError, match="already wrapped"):
        XlaFsdpPlugin().wrap(unwrap(wrapped))  # inner units are still FSDP


def test_activation_checkpointing_wraps_each_block(llama_config):
    wrapped = XlaFsdpPlugin(activation_checkpointing=True).wrap(build_eager(llama_config))
    blocks = [unwrap(u) for n, u in fsdp_units(wrapped) if n]
    blocks = [getattr(b, "_fpw_module", b) for b in blocks]
    assert blocks and all(hasattr(b, "_xla_checkpointed_forward_original") for b in blocks)
    plain = XlaFsdpPlugin().wrap(build_eager(llama_config))
    assert not any(hasattr(m, "_xla_checkpointed_forward_original") for m in plain.modules())


def _sgd_update(model, batch, wrapped):
    """Loss and per-parameter update (== gradient, lr=1) of one SGD step."""
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    if wrapped:
        before = consolidate(model)
        loss = train_step(model, batch, opt, max_grad_norm=None)
        after = consolidate(model)
    else:
        before = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        loss = model(**batch).loss
        loss.backward()
        opt.step()
        sync()
        after = {k: v.cpu() for k, v in model.state_dict().items()}
    return loss.item(), {k: before[k] - after[k] for k in after}


@pytest.mark.parametrize("settings", [dict(), dict(activation_checkpointing=True, flatten_parameters=True),
                                      dict(sharding="zero2")])
def test_training_step_matches_unwrapped_model(llama_config, settings):
    # fp32 on XLA:CPU: FSDP must not change the maths; tolerance covers reduction-order noise only
    device = xla_device()
    ids = torch.randint(0, llama_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(1))
    batch = {"input_ids": ids.to(device), "labels": ids.to(device)}
    torch.manual_seed(0)
    ref = build_eager(llama_config).to(device)
    torch.manual_seed(0)
    wrapped = XlaFsdpPlugin(**settings).wrap(build_eager(llama_config))
    ref_loss, ref_grad = _sgd_update(ref, batch, wrapped=False)
    loss, grad = _sgd_update(wrapped, batch, wrapped=True)
    assert abs(loss - ref_loss) < 1e-5
    assert grad.keys() == ref_grad.keys()
    for k in ref_grad:
        torch.testing.assert_close(grad[k], ref_grad[k], atol=1e-6, rtol=1e-4, msg=k)
    assert any(g.abs().sum() > 0 for g in grad.values())


def test_clip_grad_norm_equals_xla_fsdp_clip(llama_config):
    import torch_xla

    from hf_xla_fsdp.train import clip_grad_norm

    plugin = XlaFsdpPlugin(transformer_layer_cls_to_wrap=["LlamaDecoderLayer"])
    ids = torch.randint(0, llama_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    results = []
    for clip in ("fsdp", "ours"):
        torch.manual_seed(0)
        model = plugin.build(llama_config, progress=False)
        batch = ids.to(torch_xla.device())
        model(input_ids=batch, labels=batch).loss.backward()
        norm = model.clip_grad_norm_(0.1) if clip == "fsdp" else clip_grad_norm(model, 0.1)
        torch_xla.sync()
        results.append((float(norm), [p.grad.cpu() for p in model.parameters()]))
    (norm_a, grads_a), (norm_b, grads_b) = results
    assert norm_a > 0.1  # clipping really scales
    assert abs(norm_a - norm_b) <= 1e-6 * norm_a
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-8)
