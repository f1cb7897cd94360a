"""``scan_layers``: the decoder stack as one scanned layer (FSDP v2 on 4 XLA:CPU devices) against the unrolled model;
the refusals, in one line each."""

from __future__ import annotations

import json

import pytest
from helpers import SCRIPTS, run_python, tiny_llama

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

WORKER = SCRIPTS / "scan_worker.py"


def worker(mode: str, *args: str) -> dict:
    res = run_python([WORKER, mode, *args], devices=4, timeout=900, preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def slow_reports(tmp_path_factory) -> dict:
    """The ``equal`` and ``bf16`` reports of one worker process (one start of a 4-device SPMD process, not two)."""
    return worker("equal", "bf16", "--out", str(tmp_path_factory.mktemp("scan")))


@pytest.mark.slow
def test_scanned_training_equals_unrolled_for_llama_remat_and_gpt2(slow_reports):
    report = slow_reports["equal"]
    for family, run in report.items():
        unrolled, scanned = run["losses"]
        assert scanned == pytest.approx(unrolled, abs=1e-5), family
        # the unrolled graph holds every layer; the scanned one loops over one (forward: one while loop)
        assert run["while_loops"] == [0, 1], family
        assert run["grad_diff"] <= 1e-6 * max(1.0, run["grad_max"]), family
        # 2 AdamW steps at lr 1e-2: Adam's normalization turns float-rounding gradient differences of ~1e-8 into
        # parameter differences of up to ~1e-5 on near-zero gradients
        assert run["param_diff"] < 1e-4, family
    assert report["llama"]["n_grads"] == 30 and report["gpt2"]["n_grads"] == 40  # every parameter got a gradient


def test_lora_under_scan_trains_the_adapters_like_unrolled():
    run = worker("lora")
    unrolled, scanned = run["losses"]
    assert scanned == pytest.approx(unrolled, abs=1e-5)
    assert run["while_loops"] == [0, 1]
    assert run["n_grads"] == 12  # lora_A and lora_B of q_proj and v_proj, 3 layers: only the adapters train
    assert run["grad_diff"] <= 1e-6 * max(1.0, run["grad_max"]) and run["param_diff"] < 1e-5


def test_checkpoints_cross_the_setting_and_consolidate(tmp_path):
    run = worker("resume", "--out", str(tmp_path))
    assert run["scanned"]  # built on meta from a pretrained dir, block by block, then scanned
    # rank files hold the unrolled model's names: model weights resume bit-exact in both directions
    assert run["to_unrolled"] == 0.0 and run["to_scanned"] == 0.0
    # the optimizer state of stacked weights resumes with the same setting: the next step is bit-identical
    assert run["next_step_diff"] == 0.0
    # ... and across the setting it is refused in one line that says what to do
    assert "saved with scan_layers=true and this run has scan_layers=false" in run["optimizer_error"]
    assert "load the model weights only" in run["optimizer_error"] and "\n" not in run["optimizer_error"]
    assert run["names_equal"]  # the consolidated dir has the unrolled model's parameter names
    assert run["logits_diff"] < 1e-4  # from_pretrained(consolidated) vs the scanned model (eval scans too)


@pytest.mark.slow
def test_bf16_parameters_with_fp32_copies_under_scan(slow_reports):
    run = slow_reports["bf16"]
    unrolled, scanned = run["losses"]
    assert run["dtypes"] == ["torch.bfloat16"] and run["n_copies"] == 30  # every weight has its (stacked) fp32 copy
    assert scanned[0] == unrolled[0] and scanned == pytest.approx(unrolled, abs=1e-3)  # bf16 compute, fp32 updates
    # a scanned checkpoint holds the fp32 copies under the layers' names: an unrolled run loads them bit-exact
    assert run["resumed_diff"] == 0.0 and run["bf16_diff"] == 0.0


def test_scan_layers_on_fsdp_v1_is_refused_in_one_line():
    with pytest.raises(ConfigError, match="scan_layers.*engine=xla_v2") as err:
        XlaFsdpPlugin(version=1, scan_layers=True)
    assert "\n" not in str(err.value)


def test_layers_that_differ_are_refused_in_one_line():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from hf_xla_fsdp.modeling.scan import check_homogeneous

    config = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, use_sliding_window=True, sliding_window=8,
                         max_window_layers=1, layer_types=["full_attention", "sliding_attention"])
    layers = Qwen2ForCausalLM(config).model.layers
    differ = r"layers of Qwen2.layers differ \(.*layer_type.*sliding_attention.* in layer 1.*scan_layers=false"
    with pytest.raises(ConfigError, match=differ) as err:
        check_homogeneous(list(layers), "Qwen2.layers")
    assert "\n" not in str(err.value)
    # identical layers pass
    from transformers import LlamaForCausalLM

    check_homogeneous(list(LlamaForCausalLM(tiny_llama(num_hidden_layers=3)).model.layers), "Llama.layers")


def test_scan_layers_reaches_the_plugin_from_fsdp_config_and_the_yaml(tmp_path):
    plugin = XlaFsdpPlugin.from_fsdp_config({"xla": True, "xla_fsdp_v2": True, "scan_layers": True})
    assert plugin.scan_layers and plugin.version == 2
    yaml = tmp_path / "xla_fsdp.yaml"
    yaml.write_text("distributed_type: 'NO'\nnum_processes: 1\nfsdp_config:\n  version: 2\n  scan_layers: true\n")
    plugin = XlaFsdpPlugin.from_accelerate_config(yaml)
    assert plugin.scan_layers and plugin.version == 2


@pytest.mark.slow
def test_stock_trainer_script_with_lora_and_checkpointing_trains_like_unrolled(tmp_path):
    """A run_clm-style Trainer script (one import swapped) with LoRA, activation checkpointing and scan_layers from
    ``--fsdp_config``: the same losses as without scan_layers; its checkpoint holds peft's adapter files."""
    import peft
    import torch
    from helpers import USER_SCRIPTS

    results = {}
    for scan in (False, True):
        out = tmp_path / f"scan{int(scan)}"
        cfg = tmp_path / f"scan{int(scan)}.json"
        cfg.write_text(json.dumps({"xla": True, "xla_fsdp_v2": True, "xla_fsdp_grad_ckpt": True, "scan_layers": scan}))
        res = run_python([USER_SCRIPTS / "stock_trainer.py", "--lora", "true", "--fsdp", "full_shard", "--fsdp_config",
                          cfg, "--output_dir", out, "--max_steps", "4", "--save_steps", "4", "--logging_steps", "1",
                          "--per_device_train_batch_size", "8", "--learning_rate", "1e-3", "--report_to", "none",
                          "--disable_tqdm", "true"], devices=4, timeout=900, preloaded=True)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        results[scan] = json.loads((out / "results.json").read_text())["losses"]
        # the optimizer state of a scanned run is the stacked weights' (rank file metadata names them)
        assert ("layers_scanned." in (out / "checkpoint-4" / "rank-00000-of-00001.json").read_text()) == scan
    assert [loss for _, loss in results[True]] == pytest.approx([loss for _, loss in results[False]], abs=1e-4)
    # the scanned run's checkpoint and final save hold peft's adapter files, named and valued as the unrolled run's
    for where in ("checkpoint-4", "."):
        loaded = {scan: peft.load_peft_weights(str(tmp_path / f"scan{int(scan)}" / where)) for scan in (False, True)}
        assert sorted(loaded[True]) == sorted(loaded[False]) and len(loaded[True]) == 8  # lora_A/B of q/v, 2 layers
        for key in loaded[False]:
            torch.testing.assert_close(loaded[True][key], loaded[False][key], atol=1e-4, rtol=0)
