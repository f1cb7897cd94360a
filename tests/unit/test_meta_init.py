"""Layer-by-layer meta construction equals eager construction: fresh init (same seed, same
weights and RNG state afterwards) and pretrained safetensors (single file and sharded index)."""

from __future__ import annotations

import functools
import json

import pytest
import torch
from helpers import consolidate, tiny_bert, tiny_gpt2, tiny_llama
from transformers import BertForMaskedLM, GPT2LMHeadModel, LlamaForCausalLM

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin
from hf_xla_fsdp.engines import unwrap
from hf_xla_fsdp.engines.v1 import XlaFsdpV1
from hf_xla_fsdp.modeling import meta_init
from hf_xla_fsdp.modeling.meta_init import build_eager

CASES = [(tiny_llama, LlamaForCausalLM), (tiny_gpt2, GPT2LMHeadModel), (tiny_bert, BertForMaskedLM),
         (lambda: tiny_llama(tie_word_embeddings=True), LlamaForCausalLM)]


def _eager_state(config, cls, seed=0):
    torch.manual_seed(seed)
    model = build_eager(config, model_cls=cls)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    return model, state, torch.get_rng_state()


def _attr(model, key):
    """``model.a.b.c`` for ``key="a.b.c"`` (FSDP units forward attributes to the module they wrap)."""
    return functools.reduce(getattr, key.split("."), model)


def _assert_equal_to_eager(got: dict, eager_model, eager_state):
    # torch_xla keeps a tied weight once: the consolidated dict lacks the tied copy's name
    tied = set(getattr(eager_model, "all_tied_weights_keys", {}) or {})
    persistent = {k for k in eager_state if k not in tied}
    assert persistent <= set(got), sorted(persistent - set(got))
    for key in persistent:
        assert torch.equal(got[key], eager_state[key]), key


def _build_equal_to_eager(config, cls):
    """Build ``config`` on meta after the eager model's seed: same weights, and the RNG continues exactly where
    eager construction leaves it (dropout etc. stay reproducible). Returns the wrapped model and the eager one."""
    eager, state, eager_rng = _eager_state(config, cls)
    torch.manual_seed(0)
    model = XlaFsdpPlugin().build(config, model_cls=cls, progress=False)
    assert torch.equal(torch.get_rng_state(), eager_rng)
    _assert_equal_to_eager(consolidate(model), eager, state)
    return model, eager


@pytest.mark.parametrize("make,cls", CASES)
def test_fresh_meta_init_equals_eager(make, cls):
    model, eager = _build_equal_to_eager(make(), cls)
    inner = unwrap(model)
    for key, value in eager.named_buffers():  # non-persistent buffers too (rotary inv_freq, position_ids)
        assert torch.equal(_attr(inner, key).cpu(), value), key


def test_tied_weights_stay_tied(gpt2_config):
    model = XlaFsdpPlugin().build(gpt2_config, model_cls=GPT2LMHeadModel, progress=False)
    inner = unwrap(model)
    assert inner.lm_head.weight is inner.transformer.wte.weight


def test_emulated_ranks_shard_and_reassemble(llama_config):
    eager, state, _ = _eager_state(llama_config, LlamaForCausalLM)
    world = 3
    ranks = []
    for rank in range(world):
        torch.manual_seed(0)
        plugin = XlaFsdpPlugin(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world)
        ranks.append(plugin.build(llama_config, progress=False))
    assert ranks[0].get_shard_metadata()["world_size"] == world
    shard = dict(ranks[1].named_parameters())
    key = next(k for k in shard if "q_proj" in k)
    assert shard[key].numel() * world >= llama_config.hidden_size ** 2 > shard[key].numel()
    _assert_equal_to_eager(consolidate(ranks), eager, state)


def test_blocks_are_materialized_one_at_a_time(llama_config, monkeypatch):
    seen = []
    real = XlaFsdpV1.wrap_block

    def spy(self, block, plugin, nested, **kwargs):
        model_meta = sum(p.is_meta for p in spy.model.parameters())
        block_meta = sum(p.is_meta for p in block.parameters())
        seen.append((block_meta, model_meta))
        return real(self, block, plugin, nested, **kwargs)

    real_skeleton = meta_init.build_skeleton

    def capture(*a, **kw):
        sk = real_skeleton(*a, **kw)
        spy.model = sk.model
        return sk

    monkeypatch.setattr(XlaFsdpV1, "wrap_block", spy)
    monkeypatch.setattr(meta_init, "build_skeleton", capture)
    XlaFsdpPlugin().build(llama_config, progress=False)
    per_block = 9  # q,k,v,o,gate,up,down + two norms
    assert [b for b, _ in seen] == [0, 0, 0]  # the block being wrapped is fully materialized...
    # ...while every later block and the root (embeddings, norm, lm_head: 3 tensors) are still on meta
    assert [m for _, m in seen] == [2 * per_block + 3, per_block + 3, 3]


def _save(model, path, max_shard_size):
    model.save_pretrained(path, max_shard_size=max_shard_size)


@pytest.mark.parametrize("make,cls", CASES)
@pytest.mark.parametrize("max_shard_size", ["10GB", "40KB"])
def test_pretrained_meta_load_is_bit_exact(tmp_path, make, cls, max_shard_size):
    torch.manual_seed(3)
    source = build_eager(make(), model_cls=cls)
    with torch.no_grad():  # weights no fresh init would give
        for p in source.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    _save(source, tmp_path, max_shard_size)
    sharded = (tmp_path / "model.safetensors.index.json").exists()
    assert sharded == (max_shard_size == "40KB")
    model = XlaFsdpPlugin().build(tmp_path, progress=False)
    assert type(unwrap(model)) is cls
    _assert_equal_to_eager(consolidate(model), source, source.state_dict())
    for key, value in source.named_buffers():
        assert torch.equal(_attr(unwrap(model), key).cpu(), value), key


def test_pretrained_errors(tmp_path, llama_config):
    with pytest.raises(ConfigError, match="neither a PretrainedConfig"):
        XlaFsdpPlugin().build(tmp_path / "missing")
    with pytest.raises(ConfigError, match="has no config.json"):
        XlaFsdpPlugin().build(tmp_path)
    llama_config.save_pretrained(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(ConfigError, match="only pickled .bin weights"):
        XlaFsdpPlugin().build(tmp_path)
    (tmp_path / "pytorch_model.bin").unlink()
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(ConfigError, match="only plain file names"):
        XlaFsdpPlugin().build(tmp_path)


def test_meta_init_false_is_the_eager_reference(llama_config):
    torch.manual_seed(0)
    a = consolidate(XlaFsdpPlugin(meta_init=False).build(llama_config, progress=False))
    torch.manual_seed(0)
    b = consolidate(XlaFsdpPlugin().build(llama_config, progress=False))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_init_draws_wait_on_the_tape_until_the_build(llama_config):
    """The skeleton draws only what construction draws; every init call is drawn once, by the build."""
    src = meta_init.resolve_source(llama_config)
    torch.manual_seed(0)
    sk = meta_init.build_skeleton(src, defer_init_draws=True)
    assert sk.tape is not None and sk.final_rng_state is None
    assert all(call.rng_state is None for call in sk.init_calls)
    # lm_head is constructed after the decoder's init calls: its constructor draw is taped between them
    taped = [e for e in sk.tape if isinstance(e, meta_init._TapedOp)]
    assert [tuple(e.args[0].shape) for e in taped] == [(llama_config.vocab_size, llama_config.hidden_size)]
    torch.manual_seed(0)
    assert meta_init.build_skeleton(src).tape is None  # the default draws them now (sizing, adapters)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_chunked_uniform_advances_the_rng_like_one_draw(monkeypatch, dtype):
    monkeypatch.setattr(meta_init, "_UNIFORM_CHUNK", 7)
    torch.manual_seed(0)
    torch.empty(5, 9, dtype=dtype).uniform_(-0.3, 0.3)
    expected = torch.get_rng_state()
    torch.manual_seed(0)
    meta_init._RngShadow(chunk_uniform=True).advance(torch.ops.aten.uniform_.default,
                                   (torch.empty(5, 9, dtype=dtype, device="meta"), -0.3, 0.3), {})
    assert torch.equal(torch.get_rng_state(), expected)


@pytest.mark.parametrize("make,cls", [CASES[0], CASES[1]])
def test_fresh_meta_init_with_chunked_taped_draws_equals_eager(monkeypatch, make, cls):
    """The taped lm_head constructor draw advanced in chunks of 7 elements: same weights and RNG as eager."""
    monkeypatch.setattr(meta_init, "_UNIFORM_CHUNK", 7)
    _build_equal_to_eager(make(), cls)


def test_random_init_of_a_real_tensor_is_drawn_in_eager_order():
    """A model whose init draws into a real buffer (buffers are not on meta) cannot defer its init draws:
    the skeleton notices and draws them at once; the build still equals eager construction."""
    from torch import nn
    from transformers import PretrainedConfig, PreTrainedModel

    class NoisyConfig(PretrainedConfig):
        model_type = "noisy_meta_init_test"

    class Noisy(PreTrainedModel):
        config_class = NoisyConfig

        def __init__(self, config):
            super().__init__(config)
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
            self.register_buffer("noise", torch.zeros(3))
            self.post_init()

        def _init_weights(self, module):
            if isinstance(module, nn.Linear):
                module.weight.normal_()
                module.bias.zero_()
            if isinstance(module, Noisy):
                module.noise.uniform_()

        def forward(self, x):
            return self.b(self.a(x)) + self.noise.sum()

    config = NoisyConfig()
    torch.manual_seed(0)
    sk = meta_init.build_skeleton(meta_init.ModelSource(config), model_cls=Noisy, defer_init_draws=True)
    assert sk.tape is None and sk.final_rng_state is not None
    eager, state, eager_rng = _eager_state(config, Noisy)
    torch.manual_seed(0)
    model = XlaFsdpPlugin().build(config, model_cls=Noisy, progress=False)
    assert torch.equal(torch.get_rng_state(), eager_rng)
    _assert_equal_to_eager(consolidate(model), eager, state)
    assert torch.equal(unwrap(model).noise.cpu(), eager.noise)


@pytest.mark.parametrize("init_lora_weights,pretrained", [(True, False), (False, False), (True, True)])
def test_lora_adapters_built_on_meta_equal_eager_peft(init_lora_weights, pretrained, tmp_path):
    """LoRA attached on meta gets what peft's eager construction draws (nn.Linear's own init of A then B, then peft's
    reset), one sequence across blocks: bit-equal to an eager build. With init_lora_weights=False that construction
    is the only init (it used to leave uninitialized memory: values of 1e13 and NaN losses). On a pretrained base
    the model's own init must not draw for the adapters (it did: DPO with LoRA then left stock TRL at step 2)."""
    from peft import LoraConfig
    from transformers import LlamaForCausalLM

    source = tiny_llama(num_hidden_layers=2)
    if pretrained:
        LlamaForCausalLM(source).save_pretrained(tmp_path)
        source = tmp_path

    def lora(meta: bool) -> dict[str, torch.Tensor]:
        torch.manual_seed(0)
        model = XlaFsdpPlugin(meta_init=meta).build(
            source, progress=False,
            peft_config=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=init_lora_weights))
        return {n: p.detach().cpu() for n, p in model.named_parameters() if "lora_" in n}

    on_meta, eager = lora(True), lora(False)
    assert sorted(on_meta) == sorted(eager) and len(on_meta) == 8
    for name, tensor in eager.items():
        assert torch.equal(on_meta[name], tensor), name
        assert tensor.isfinite().all() and tensor.abs().max() < 1, name
    a = [t for n, t in on_meta.items() if "lora_A" in n and "q_proj" in n]
    assert not torch.equal(a[0], a[1])  # each layer's adapters draw their own values
