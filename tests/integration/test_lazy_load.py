"""`from_pretrained` / `from_config` in an unmodified script under the launch settings (modeling/lazy.py): the model
is a meta skeleton until it is wrapped, then built block by block from its files, equal to the eager load bit for bit;
what a script does in between either stays lazy, or loads the whole model first with eager's result, or is refused
in one line. Hub ids resolve in the local Hugging Face cache, offline. One launched process: tests/scripts/lazy_worker.py.
The peak memory of this path against the documented one is benchmarks/lazy_load.py's."""

from __future__ import annotations

import json

import pytest
import torch
from helpers import ROOT, run_python, tiny_llama
from transformers import LlamaForCausalLM

pytestmark = pytest.mark.slow  # one launched process that loads, wraps and compares a dozen models: about a minute

WORKER = ROOT / "tests" / "scripts" / "lazy_worker.py"


def fake_hub_cache(home, repo: str, model) -> None:
    """``home``/hub as huggingface_hub lays a download out: models--org--name/snapshots/<rev>/ and refs/main."""
    revision = "0123456789abcdef0123456789abcdef01234567"
    root = home / "hub" / f"models--{repo.replace('/', '--')}"
    model.save_pretrained(root / "snapshots" / revision)
    (root / "refs").mkdir(parents=True)
    (root / "refs" / "main").write_text(revision)


@pytest.fixture(scope="module")
def report(tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("lazy")
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama(tie_word_embeddings=False))
    model.save_pretrained(tmp / "pre")
    fake_hub_cache(tmp / "hf_home", "tiny-org/tiny-llama", model)
    res = run_python([WORKER, tmp / "pre", tmp / "report.json"], devices=1, timeout=900,
                     env={"HF_HOME": str(tmp / "hf_home"), "HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": None,
                          "HF_XLA_FSDP_LAUNCH": None, "HF_XLA_FSDP_LAZY_LOAD": None})
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return json.loads((tmp / "report.json").read_text())


def test_from_pretrained_is_a_skeleton_until_wrapped_then_equal_to_eager(report):
    assert report["lazy"] and report["eval_mode"]
    assert report["wrapped_weights_equal"] and report["weights_equal_eager_load"]
    assert report["wrapped_logits_equal"]  # the same engine and graph on both sides: equal bit for bit


def test_a_stock_trainer_builds_it_block_by_block_keeping_the_scripts_edits(report):
    name, released, same_object, use_cache = report["trainer"]
    assert name == "XlaFsdpTrainer" and released and same_object and use_cache is False


def test_what_needs_the_values_gets_the_eager_model(report):
    assert report["value_read"] == [True, True, True, True, True]
    assert report["cast_stays_lazy"] and report["cast_equal"]
    assert report["resize_equal"] == [True, True]  # the same new rows, and the RNG left where eager leaves it
    assert report["peft_equal"]


def test_a_parameter_with_no_values_is_refused_in_one_line(report):
    message = report["foreign_meta"]
    assert message.startswith("extra_head.weight was added to LlamaForCausalLM.from_pretrained(") and "\n" not in message
    assert "HF_XLA_FSDP_LAZY_LOAD=0" in message


def test_from_config_moves_the_rng_as_eager_and_builds_eagers_weights(report):
    assert report["from_config_lazy"] and report["from_config_rng"] and report["from_config_equal"]


def test_hub_ids_resolve_in_the_local_cache_offline(report):
    assert report["hub_lazy"] and report["hub_build"] == "XlaFullyShardedDataParallel"
    message = report["hub_missing"]
    assert "'tiny-org/not-downloaded'" in message and "hf download tiny-org/not-downloaded" in message
    assert "\n" not in message
