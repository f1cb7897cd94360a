"""Test environment (XLA on the CPU) and fixtures; the shared helpers live in tests/helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # every test runs on XLA:CPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests never write the user's default compilation cache; the cache tests choose their folders
os.environ.setdefault("HF_XLA_FSDP_COMPILATION_CACHE", "none")

import pytest
from helpers import tiny_bert, tiny_gpt2, tiny_llama
from transformers import BertConfig, GPT2Config, LlamaConfig


@pytest.fixture
def llama_config() -> LlamaConfig:
    return tiny_llama()


@pytest.fixture
def gpt2_config() -> GPT2Config:
    return tiny_gpt2()


@pytest.fixture
def bert_config() -> BertConfig:
    return tiny_bert()
