"""Shared fixtures: tiny configs of real transformers models, and a consolidation helper."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # every test runs on XLA:CPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest
import torch
from transformers import BertConfig, GPT2Config, LlamaConfig


def tiny_llama(**kw) -> LlamaConfig:
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_gpt2(**kw) -> GPT2Config:
    base = dict(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return GPT2Config(**base)


def tiny_bert(**kw) -> BertConfig:
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=64)
    base.update(kw)
    return BertConfig(**base)


def consolidate(models) -> dict[str, torch.Tensor]:
    """Full CPU state dict from the FSDP models of every rank, via torch_xla's own consolidation."""
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    models = models if isinstance(models, (list, tuple)) else [models]
    state_dicts = [{k: v.cpu() for k, v in m.state_dict().items()} for m in models]
    return consolidate_sharded_state_dicts(state_dicts, models[0].get_shard_metadata())


@pytest.fixture
def llama_config() -> LlamaConfig:
    return tiny_llama()


@pytest.fixture
def gpt2_config() -> GPT2Config:
    return tiny_gpt2()


@pytest.fixture
def bert_config() -> BertConfig:
    return tiny_bert()
