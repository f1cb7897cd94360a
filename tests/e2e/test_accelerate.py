"""`accelerate launch --config_file examples/xla_fsdp.yaml examples/train_clm_accelerate.py`, for real."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml
from helpers import ROOT, consolidate, run_python, tiny_llama

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin
from hf_xla_fsdp.config.sources import ENV_CONFIG, _config_from_cmdline, find_accelerate_config

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

plugin_from_accelerate_launch = XlaFsdpPlugin.from_accelerate_launch

YAML = ROOT / "examples" / "xla_fsdp.yaml"
SCRIPT = ROOT / "examples" / "train_clm_accelerate.py"
ACCELERATE = Path(sys.executable).parent / "accelerate"


def launch(config: Path, out: Path, *args, timeout: int = 900, devices: int = 1) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file config`` of the example script; the YAML is found from the command line."""
    return run_python([ACCELERATE, "launch", "--config_file", config, SCRIPT, "--output_dir", out, *args],
                      devices=devices, env={ENV_CONFIG: None}, timeout=timeout)


def load_script():
    sys.path.insert(0, str(SCRIPT.parent))  # the script imports its sibling clm_data
    spec = importlib.util.spec_from_file_location("train_clm_accelerate", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    # trains end to end in a subprocess: every test that uses it is marked slow
    out = tmp_path_factory.mktemp("acc") / "run"
    res = launch(YAML, out, "--max_train_steps", "30", "--checkpointing_steps", "10")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out, res


@pytest.mark.slow
def test_end_to_end_and_from_pretrained_eval_loss(trained):
    out, res = trained
    results = json.loads((out / "results.json").read_text())
    assert "eval loss" in res.stdout and "consolidated model" in res.stdout
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(out / "final", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokenizer = AutoTokenizer.from_pretrained(out / "final")
    script = load_script()
    args = script.parse_args(["--output_dir", str(out)])
    _, eval_ds = script.build_datasets(args.train_file, tokenizer, block_size=args.block_size,
                                       validation_split_percentage=args.validation_split_percentage, seed=args.seed)
    loader = torch.utils.data.DataLoader(eval_ds, batch_size=results["eval_batch_size"],
                                         collate_fn=script.default_data_collator, drop_last=True)
    loss = script.evaluate(model, loader, results["max_eval_batches"])
    assert loss == pytest.approx(results["final_eval_loss"], abs=1e-5)
    # the FSDP model computed in bf16, the reloaded one in fp32: same weights, nearly the same loss
    assert loss == pytest.approx(results["eval_loss"], abs=0.03)
    assert loss < results["initial_eval_loss"] - 2.0


@pytest.mark.slow
def test_export_of_the_trained_model_carries_its_numbers(trained, tmp_path):
    from huggingface_hub import ModelCard

    from hf_xla_fsdp.cli import main

    out, _ = trained
    results = json.loads((out / "results.json").read_text())
    assert main(["export", str(out / "final"), "-o", str(tmp_path / "hub"), "--repo-id", "me/clm", "--quiet"]) == 0
    card = ModelCard.load(tmp_path / "hub" / "README.md")
    values = {r.metric_type: r.metric_value for r in card.data.eval_results}
    assert values["loss"] == round(results["eval_loss"], 4)
    assert "| optimizer steps | 30 |" in card.text and "| activation checkpointing | yes |" in card.text
    assert (tmp_path / "hub" / "tokenizer.json").is_file()


@pytest.mark.slow
def test_yaml_settings_reach_the_training_process(trained, tmp_path):
    out, _ = trained
    nested = json.loads((out / "fsdp_structure.json").read_text())
    assert nested["num_units"] == 5 and nested["checkpointed_blocks"] == 4
    assert nested["compute_dtype"] == "torch.bfloat16"
    cfg = yaml.safe_load(YAML.read_text())
    cfg["fsdp_config"].update(fsdp_sharding_strategy="zero2", fsdp_activation_checkpointing=False, compute_dtype="fp32")
    changed = tmp_path / "zero2.yaml"
    changed.write_text(yaml.safe_dump(cfg))
    res = launch(changed, tmp_path / "run", "--max_train_steps", "2", "--max_eval_batches", "1")
    assert res.returncode == 0, res.stderr[-3000:]
    root_only = json.loads((tmp_path / "run" / "fsdp_structure.json").read_text())
    assert root_only["units"] == [""] and root_only["checkpointed_blocks"] == 0
    assert root_only["compute_dtype"] == "torch.float32"


@pytest.mark.slow
def test_resume_continues_the_same_loss_curve(trained, tmp_path):
    out, _ = trained
    full = json.loads((out / "results.json").read_text())["losses"]
    # from the last checkpoint before the end (step_20): the same check as from step_10 at half the steps to train
    res = launch(YAML, tmp_path / "resumed", "--max_train_steps", "30", "--resume_from_checkpoint", out / "step_20")
    assert res.returncode == 0, res.stderr[-3000:]
    # the script's own line after load_state, with the step it read back: a run that ignored the checkpoint and
    # started from scratch would train steps 1-20 again, deterministically, to the very losses compared below
    assert f"resumed from {out / 'step_20'} at step 20" in res.stdout
    resumed = json.loads((tmp_path / "resumed" / "results.json").read_text())["losses"]
    for step in range(21, 31):
        assert resumed[str(step)] == pytest.approx(full[str(step)], abs=1e-6), step


BAD_SETTINGS = [({"fsdp_offload_params": True}, "fsdp_offload_params=true in fsdp_config"),
                ({"fsdp_offload_parameters": True}, "unknown key 'fsdp_offload_parameters'"),
                ({"fsdp_sharding_strategy": "zero9"}, "sharding='zero9' is not valid")]


def bad_yaml(tmp_path: Path, setting: dict) -> Path:
    cfg = yaml.safe_load(YAML.read_text())
    cfg["fsdp_config"].update(setting)
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump(cfg))
    return bad


def test_invalid_fsdp_config_fails_before_training(tmp_path):
    """Under `accelerate launch` once (a launch costs ~15 s); every bad setting through the same YAML reader."""
    res = launch(bad_yaml(tmp_path, BAD_SETTINGS[0][0]), tmp_path / "run", "--max_train_steps", "2")
    assert res.returncode != 0
    assert BAD_SETTINGS[0][1] in res.stderr
    assert not (tmp_path / "run").exists()  # nothing started: no output directory
    for setting, needle in BAD_SETTINGS:
        with pytest.raises(ConfigError, match=re.escape(needle)) as err:
            XlaFsdpPlugin.from_accelerate_config(bad_yaml(tmp_path, setting))
        assert "\n" not in str(err.value)


def test_config_discovery(tmp_path, monkeypatch):
    assert _config_from_cmdline(["/x/bin/accelerate", "launch", "--config_file", "a.yaml", "t.py"]) == "a.yaml"
    assert _config_from_cmdline(["python", "-m", "accelerate.commands.launch", "--config-file=b.yaml", "t.py"]) == "b.yaml"
    assert _config_from_cmdline(["/x/bin/accelerate", "launch", "t.py"]) == ""
    assert _config_from_cmdline(["python", "train.py", "--config_file", "c.yaml"]) is None
    monkeypatch.setenv(ENV_CONFIG, str(YAML))
    assert find_accelerate_config() == YAML
    assert plugin_from_accelerate_launch().activation_checkpointing
    other = tmp_path / "gpu.yaml"
    other.write_text("distributed_type: MULTI_GPU\nfsdp_config: {}\n")
    monkeypatch.setenv(ENV_CONFIG, str(other))
    with pytest.raises(ConfigError, match="XLA FSDP needs distributed_type: XLA"):
        plugin_from_accelerate_launch()


def test_gradient_accumulation_clip_and_step_match_plain_fsdp():
    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.integrations.accelerate import XlaFsdpAccelerator
    from hf_xla_fsdp.train import sync, xla_device

    config = tiny_llama()
    device = xla_device()
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, config.vocab_size, (2, 16), generator=gen) for _ in range(2)]
    batches = [{"input_ids": b.to(device), "labels": b.to(device)} for b in batches]

    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(), gradient_accumulation_steps=2)
    torch.manual_seed(0)
    model = accelerator.build_model(config)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    model, optimizer = accelerator.prepare(model, optimizer)
    for batch in batches:
        with accelerator.accumulate(model):
            accelerator.backward(model(**batch).loss)
            # FSDP reduce-scattered in backward: accelerate's extra XLA all-reduce is marked done
            assert accelerator.gradient_state.is_xla_gradients_synced
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            optimizer.zero_grad()
    sync()
    got = consolidate(model)

    torch.manual_seed(0)
    ref = XlaFsdpPlugin().build(config, progress=False)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for batch in batches:
        (ref(**batch).loss / 2).backward()
    ref.clip_grad_norm_(0.5)
    ref_opt.step()
    sync()
    expected = consolidate(ref)
    for key in expected:
        torch.testing.assert_close(got[key], expected[key], atol=1e-6, rtol=1e-5, msg=key)
    with pytest.raises(ConfigError, match="create it after the model is wrapped"):
        accelerator.prepare(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1))


@pytest.mark.slow
def test_v2_spmd_on_four_devices(tmp_path):
    out = tmp_path / "v2"
    res = launch(ROOT / "examples" / "xla_fsdp_v2.yaml", out, "--max_train_steps", "20", "--checkpointing_steps", "10",
                 devices=4)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    structure = json.loads((out / "fsdp_structure.json").read_text())
    assert structure["num_units"] == 5 and structure["checkpointed_blocks"] == 4
    results = json.loads((out / "results.json").read_text())
    assert results["eval_loss"] < results["initial_eval_loss"] - 1.0
    # fp32 on 4 sharded devices vs fp32 on the host after consolidation
    assert abs(results["final_eval_loss"] - results["eval_loss"]) < 1e-4
    meta = json.loads((out / "step_10" / "rank-00000-of-00001.json").read_text())
    assert meta["engine"] == "spmd" and meta["devices"] == 4


def test_v2_yaml_must_not_use_the_xla_launcher(tmp_path, monkeypatch):
    cfg = yaml.safe_load((ROOT / "examples" / "xla_fsdp_v2.yaml").read_text())
    cfg["distributed_type"] = "XLA"
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(cfg))
    monkeypatch.setenv(ENV_CONFIG, str(path))
    with pytest.raises(ConfigError, match="FSDP v2 \\(SPMD\\) drives every device from one process"):
        plugin_from_accelerate_launch()
