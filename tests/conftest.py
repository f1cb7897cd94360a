"""Test environment (XLA on the CPU) and fixtures; the shared helpers live in tests/helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # every test runs on XLA:CPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# tests never write the user's default compilation cache; the cache tests choose their folders
os.environ.setdefault("HF_XLA_FSDP_COMPILATION_CACHE", "none")
# XLA:CPU's LLVM code generation unoptimized, in this process and every process a test starts (they inherit it):
# the suite compiles hundreds of tiny graphs, where LLVM's optimization passes are most of the compile time and
# the compile time most of a test (measured: tests/scripts/scan_worker.py lora 55 -> 23 s of CPU, tp_worker.py
# train 48 -> 20 s). The HLO XLA builds, its sharding and collectives, and what every test checks are the same;
# results can differ from optimized code in the last bits (~1e-7 on a loss), and no test compares an XLA result
# with one produced under other flags. HF_XLA_FSDP_TEST_OPTIMIZED_XLA=1 runs the suite with XLA's defaults.
FAST_XLA_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")
_flags = os.environ.get("XLA_FLAGS", "").split()
_optimized = os.environ.get("HF_XLA_FSDP_TEST_OPTIMIZED_XLA", "") not in ("", "0")
os.environ["XLA_FLAGS"] = " ".join(_flags + [f for f in FAST_XLA_COMPILE if f not in _flags and not _optimized])

import pytest  # noqa: E402  (the environment above is set before anything else is imported)
from helpers import tiny_bert, tiny_gpt2, tiny_llama  # noqa: E402
from transformers import BertConfig, GPT2Config, LlamaConfig  # noqa: E402


@pytest.fixture
def llama_config() -> LlamaConfig:
    return tiny_llama()


@pytest.fixture
def gpt2_config() -> GPT2Config:
    return tiny_gpt2()


@pytest.fixture
def bert_config() -> BertConfig:
    return tiny_bert()
