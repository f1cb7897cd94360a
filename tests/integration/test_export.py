"""`hf-xla-fsdp export`: consolidated model + generated model card, and a clean failure to push."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
from helpers import ROOT, build_ranks, tiny_llama
from huggingface_hub import ModelCard
from huggingface_hub.repocard_data import model_index_to_eval_results
from transformers import AutoModelForCausalLM, AutoTokenizer

from hf_xla_fsdp import XlaFsdpPlugin
from hf_xla_fsdp.checkpoint import commit_checkpoint, write_rank_file
from hf_xla_fsdp.checkpoint.consolidate import consolidate
from hf_xla_fsdp.cli import main

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

LOSSES = {"1": 5.1, "2": 4.7, "3": 4.25}


@pytest.fixture
def sharded(tmp_path):
    """A 2-rank checkpoint saved by a zero3 + activation-checkpointing + bf16 plugin, tokenizer beside it."""
    settings = dict(activation_checkpointing=True, compute_dtype="bfloat16",
                    transformer_layer_cls_to_wrap=["LlamaDecoderLayer"])
    models = build_ranks(tiny_llama(vocab_size=512), 2, **settings)
    run = tmp_path / "run"
    for model in models:
        write_rank_file(run / "checkpoint-3", model, step=3, plugin=XlaFsdpPlugin(**settings),
                        extra={"losses": LOSSES, "eval_loss": 4.5, "eval_dataset": "tiny_corpus"})
    commit_checkpoint(run / "checkpoint-3", 2)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(ROOT / "examples" / "tiny_tokenizer" / name, run / name)
    return run / "checkpoint-3"


def _check_card(out: Path, model_name: str):
    card = ModelCard.load(out / "README.md")
    data = card.data.to_dict()
    assert data["library_name"] == "transformers" and data["pipeline_tag"] == "text-generation"
    assert {"xla", "fsdp", "tpu"} <= set(data["tags"])
    name, results = model_index_to_eval_results(data["model-index"])  # the Hub's model-index form parses
    assert name == model_name
    values = {r.metric_type: r.metric_value for r in results}
    assert values == {"loss": 4.5, "perplexity": round(math.exp(4.5), 4)}
    text = card.text
    n_params = sum(p.numel() for p in AutoModelForCausalLM.from_pretrained(out).parameters())
    for needle in ("FSDP v1 (XlaFullyShardedDataParallel)", "ZeRO-3", "| world size (ranks) | 2 |",
                   "| compute dtype | bfloat16 |", "| activation checkpointing | yes |", "| optimizer steps | 3 |",
                   "| final training loss | 4.2500 |", "| evaluation loss | 4.5000 |",
                   f"({n_params})", "AutoModelForCausalLM.from_pretrained"):
        assert needle in text, needle


def test_export_from_sharded_checkpoint(tmp_path, sharded, capsys):
    out = tmp_path / "export"
    assert main(["export", str(sharded), "--output", str(out), "--repo-id", "me/tiny-llama", "--license",
                 "apache-2.0", "--quiet"]) == 0
    _check_card(out, "me/tiny-llama")
    assert ModelCard.load(out / "README.md").data.license == "apache-2.0"
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert AutoTokenizer.from_pretrained(out)("The cat")["input_ids"]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]


def test_export_from_consolidated_directory(tmp_path, sharded):
    consolidate(sharded, tmp_path / "final", progress=False)
    out = tmp_path / "export"
    assert main(["export", str(tmp_path / "final"), "-o", str(out), "--quiet"]) == 0
    _check_card(out, "export")
    a = AutoModelForCausalLM.from_pretrained(out).state_dict()
    b = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_push_without_network_fails_cleanly_and_keeps_dir(tmp_path, sharded, monkeypatch, capsys):
    out = tmp_path / "export"
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_test")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    rc = main(["export", str(sharded), "-o", str(out), "--repo-id", "me/tiny", "--push", "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 3 and len(err.splitlines()) == 1
    assert "pushing to me/tiny failed" in err and "is complete, push it later" in err
    # "is complete": the kept directory loads as the whole model (from_pretrained never returns None: ask its report)
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert (out / "README.md").is_file() and not info["missing_keys"] and not info["unexpected_keys"]
    monkeypatch.delenv("HF_TOKEN")
    monkeypatch.setenv("HF_HUB_DISABLE_IMPLICIT_TOKEN", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf_home"))  # no stored token either
    rc = main(["export", str(sharded), "-o", str(tmp_path / "e2"), "--repo-id", "me/tiny", "--push", "--quiet"])
    assert rc == 3 and "no Hugging Face token" in capsys.readouterr().err
    assert (tmp_path / "e2" / "README.md").is_file()


def test_existing_output_refused_unless_overwrite(tmp_path, sharded, capsys):
    out = tmp_path / "export"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    assert main(["export", str(sharded), "-o", str(out), "--quiet"]) == 2
    assert "already exists and is not empty; pass --overwrite" in capsys.readouterr().err
    assert (out / "keep.txt").read_text() == "mine"
    assert main(["export", str(sharded), "-o", str(out), "--quiet", "--overwrite"]) == 0
    assert (out / "README.md").is_file() and not (out / "keep.txt").exists()
    assert main(["export", str(sharded), "-o", str(tmp_path / "x"), "--push"]) == 2
    assert "--push needs --repo-id" in capsys.readouterr().err


def test_python_api(tmp_path, sharded):
    from hf_xla_fsdp import export

    result = export(sharded, tmp_path / "api", repo_id="org/name", progress=False)
    assert result == {"output": str(tmp_path / "api"), "model_name": "org/name", "pushed": None}


def test_trainer_model_card_of_a_consolidated_directory(tmp_path, sharded):
    """What XlaFsdpTrainer.create_model_card writes: the card of output_dir, named after the Hub id."""
    from hf_xla_fsdp import ConfigError
    from hf_xla_fsdp.export.hub import write_card

    with pytest.raises(ConfigError, match="has no consolidated model yet; call trainer.save_model"):
        write_card(tmp_path)
    consolidate(sharded, tmp_path / "final", progress=False)
    write_card(tmp_path / "final", load_path="me/tiny-llama", license="mit")
    _check_card(tmp_path / "final", "tiny-llama")
    assert ModelCard.load(tmp_path / "final" / "README.md").data.license == "mit"
