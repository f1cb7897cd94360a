"""Test environment (XLA on the CPU) and fixtures; the shared helpers live in tests/helpers.py."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # every test runs on XLA:CPU
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# XLA:CPU runs each device's part of a program as a task of one client thread pool of max(cores, devices) threads
# (xla/pjrt/cpu/cpu_client.cc), and a collective holds its threads until every device's task has joined. On 2 cores
# with 4 devices that pool is 4 threads: when a second program is dispatched before the first has finished (an SPMD
# step is two: the backward's sync, the optimizer's), its tasks can take the threads the first one's last device
# still needs, and XLA aborts the process after its fixed 10 s rendezvous timeout (seen in CI under load: device 0
# in two programs' rendezvous at once, "only 3 of 4 arrived"). PJRT_NPROC sizes that pool (and the intra-op pool):
# 8 holds two programs of 4 devices, the most any test uses. Not for figures: 8 intra-op threads on 2 cores make a
# 1024x1024 matmul about 15% slower (measured), so the benchmarks' own runs keep XLA's default.
os.environ.setdefault("PJRT_NPROC", "8")
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
# One temporary folder for the whole run, inherited by the xdist workers and every process a test starts: what
# lands in the system's temporary folder (torchrun's torchelastic_* logs, the spool of a rank a test SIGKILLs, the
# rank logs and fork servers of tests/helpers.py, pytest's own tmp_path) goes there, and the run that made it removes
# it when every test passed (a failed run keeps it and names it, for a look). CI runs on a machine later sessions get
# back: a suite that left ~200 MB a run behind would fill its disk.
import shutil  # noqa: E402
import tempfile  # noqa: E402

_TMP_OWNER = "HF_XLA_FSDP_TEST_TMP" not in os.environ
if _TMP_OWNER:
    os.environ["HF_XLA_FSDP_TEST_TMP"] = os.environ["TMPDIR"] = tempfile.mkdtemp(prefix="hf_xla_fsdp-tests-")
    tempfile.tempdir = None  # gettempdir() reads TMPDIR again

import importlib.util  # noqa: E402

import pytest  # noqa: E402  (the environment above is set before anything else is imported)
from helpers import tiny_bert, tiny_gpt2, tiny_llama  # noqa: E402
from transformers import BertConfig, GPT2Config, LlamaConfig  # noqa: E402


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


def _passed(exitstatus: int) -> bool:
    return exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """The run's temporary folder (above) goes when the run that made it passed; a failed one keeps it."""
    if _TMP_OWNER and _passed(exitstatus):
        shutil.rmtree(os.environ["HF_XLA_FSDP_TEST_TMP"], ignore_errors=True)


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, exitstatus: int) -> None:
    """Where a failed run's temporary files are, for a look."""
    if _TMP_OWNER and not _passed(exitstatus):
        terminalreporter.write_sep("-", f"temporary files of this run kept in {os.environ['HF_XLA_FSDP_TEST_TMP']}")


@pytest.fixture
def llama_config() -> LlamaConfig:
    return tiny_llama()


@pytest.fixture
def gpt2_config() -> GPT2Config:
    return tiny_gpt2()


@pytest.fixture
def bert_config() -> BertConfig:
    return tiny_bert()
