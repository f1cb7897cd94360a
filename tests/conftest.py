"""Test environment (XLA on the CPU) and fixtures; the shared helpers live in tests/helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # every test runs on XLA:CPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests never write the user's default compilation cache; the cache tests choose their folders
os.environ.setdefault("HF_XLA_FSDP_COMPILATION_CACHE", "none")

import importlib.util

import pytest
from helpers import tiny_bert, tiny_gpt2, tiny_llama
from transformers import BertConfig, GPT2Config, LlamaConfig


def _torch_xla_installed() -> bool:
    try:
        return importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):
        return False


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The one place tests needing torch_xla are skipped where it is not installed (the no-xla leg): every test marked
    ``xla`` (per test, or per module with ``pytestmark``)."""
    if _torch_xla_installed():
        return
    skip = pytest.mark.skip(reason="needs torch_xla, which is not installed here (the no-xla leg runs the "
                                   "engine-independent and engine-fsdp2 tests)")
    for item in items:
        if "xla" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def llama_config() -> LlamaConfig:
    return tiny_llama()


@pytest.fixture
def gpt2_config() -> GPT2Config:
    return tiny_gpt2()


@pytest.fixture
def bert_config() -> BertConfig:
    return tiny_bert()
