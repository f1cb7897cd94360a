"""A script written for plain `accelerate.Accelerator` (run_clm_no_trainer style), only the import swapped, under the
stock `accelerate launch --config_file`: a minimal XLA YAML and a YAML as `accelerate config` writes it for torch FSDP
(v1), and FSDP v2 on 4 devices. It trains from a pretrained model, saves state, resumes exactly, and its
`save_pretrained` output reloads with `from_pretrained`.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, USER_SCRIPTS

SCRIPTS = USER_SCRIPTS
ACCELERATE = Path(sys.executable).parent / "accelerate"

pytestmark = [pytest.mark.slow, pytest.mark.xla]  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


@pytest.fixture(scope="module")
def pre(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("pretrained")
    res = subprocess.run([sys.executable, str(SCRIPTS / "make_pretrained.py"), str(out)], capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


def launch(config: Path, pre: Path, family: str, out: Path, *extra: str, devices: int = 1) -> dict:
    env = dict(os.environ, PJRT_DEVICE="CPU", TOKENIZERS_PARALLELISM="false", USE_HF_XLA_FSDP="1",
               CPU_NUM_DEVICES=str(devices), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("HF_XLA_FSDP_ACCELERATE_CONFIG", None)
    cmd = [str(ACCELERATE), "launch", "--config_file", str(config), str(SCRIPTS / "clm_no_trainer.py"),
           "--model_name_or_path", str(pre / family), "--train_file", str(pre / "train.txt"),
           "--validation_file", str(pre / "validation.txt"), "--per_device_train_batch_size", "4",
           "--per_device_eval_batch_size", "4", "--block_size", "32", "--learning_rate", "1e-3", "--seed", "0",
           "--max_train_steps", "8", "--checkpointing_steps", "4", "--output_dir", str(out), *extra]
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-5000:]
    return json.loads((out / "all_results.json").read_text())


def cpu_eval_loss(model_dir: Path, pre: Path) -> float:
    """The script's eval loss on XLA, recomputed on the CPU from the saved model.

    The same data: the validation text tokenized line by line with its line breaks (run_clm_no_trainer's default
    ``keep_linebreaks``: the datasets text loader keeps each line's newline, 80 tokens here), cut into 32-token
    blocks (71 here), in batches of 4. The same weighting: the script repeats each batch's mean loss 4 times
    (``loss.repeat(per_device_eval_batch_size)``) and gather_for_metrics keeps all 4 copies of the last, 3-block
    batch on XLA (stock accelerate too): the device loader's preloading thread finishes the DataLoaderShard's
    iteration before the script gathers that batch, which resets accelerate's ``end_of_dataloader``, so the
    remainder is never cut. Measured: the script's 5.968253 against 5.968253 so (5.969003 weighting the last batch
    by its 3 blocks, 5.971383 without it).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    lines = (pre / "validation.txt").read_text().splitlines(keepends=True)
    ids = [t for line in lines for t in tokenizer(line)["input_ids"]]
    blocks = torch.tensor(ids[: len(ids) // 32 * 32]).view(-1, 32)
    with torch.no_grad():
        losses = [model(input_ids=batch, labels=batch).loss for batch in blocks.split(4)]
    return float(torch.stack(losses).mean())


CASES = [
    ("xla_minimal.yaml", "llama", 1, ()),
    # also the script's other save (`--save_with_state_dict`: save_pretrained(state_dict=accelerator.get_state_dict))
    # and gradient accumulation
    ("torch_fsdp_from_accelerate_config.yaml", "gpt2", 1, ("--save_with_state_dict", "--gradient_accumulation_steps",
                                                           "2")),
    ("xla_v2_minimal.yaml", "gpt2", 4, ()),
]


@pytest.mark.parametrize("config,family,devices,extra", CASES, ids=[f"{c[0].split('.')[0]}-{c[1]}" for c in CASES])
def test_swapped_import_trains_resumes_and_saves(pre, tmp_path, config, family, devices, extra):
    yaml = SCRIPTS / "configs" / config
    if family == "gpt2" and "torch_fsdp" in config:  # what `accelerate config` writes for a GPT-2 user
        text = yaml.read_text().replace("LlamaDecoderLayer", "GPT2Block")
        yaml = tmp_path / config
        yaml.write_text(text)
    full = launch(yaml, pre, family, tmp_path / "full", *extra, devices=devices)
    losses = {int(k): v for k, v in full["losses"].items()}
    assert sorted(losses) == list(range(1, 9)) and losses[8] < losses[1]
    assert sorted(p.name for p in (tmp_path / "full" / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]

    # resume from the first automatic checkpoint in a new project directory: steps 5-8 as uninterrupted (the YAML
    # written by `accelerate config` differs from the minimal one only in how the plugin is configured: its training
    # and save are what that case checks; its resume path is the same as the minimal YAML's)
    if "torch_fsdp" not in config:
        resumed_dir = tmp_path / "resumed"
        (resumed_dir / "checkpoints").mkdir(parents=True)
        shutil.copytree(tmp_path / "full" / "checkpoints" / "checkpoint_0", resumed_dir / "checkpoints" / "checkpoint_0")
        resumed = launch(yaml, pre, family, resumed_dir, "--resume_from_checkpoint", devices=devices)
        # a run that ignored the checkpoint would retrain steps 1-4, deterministically, to the very losses compared
        # below: but its automatic-naming counter (restored from the checkpoint's registered progress) would be 0
        # and its step-4 save into the copied checkpoint_0 refused ("already exists"), so launch() would have failed.
        # The run's own save (at step 8) is checkpoint_1. (The script's "Resumed at step" line is accelerator.print,
        # which prints nothing under accelerate launch on XLA:CPU: is_local_main_process is False there.)
        assert sorted(p.name for p in (resumed_dir / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
        again = {int(k): v for k, v in resumed["losses"].items()}
        for step in range(5, 9):
            assert math.isclose(again[step], losses[step], rel_tol=0, abs_tol=1e-6), (step, again[step], losses[step])

    # the official example's final save: unwrap_model(model).save_pretrained(out, save_function=accelerator.save)
    from transformers import AutoModelForCausalLM

    saved, info = AutoModelForCausalLM.from_pretrained(tmp_path / "full", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    # the saved weights are the trained ones, bit for bit: the last automatic checkpoint (step 8) consolidated
    from hf_xla_fsdp.cli import main as cli

    assert cli(["consolidate", str(tmp_path / "full" / "checkpoints" / "checkpoint_1"), "-o", str(tmp_path / "final"),
                "--quiet"]) == 0
    final = AutoModelForCausalLM.from_pretrained(tmp_path / "final").state_dict()
    assert all(torch.equal(t, final[k]) for k, t in saved.state_dict().items())
    if family == "llama":
        # fp32 both sides, the same blocks, batches and weighting (cpu_eval_loss): XLA's and the CPU's summation
        # orders only (~1e-6 per batch measured), while 4 training steps move it by 0.26 (test_launch_scripts.py)
        assert abs(cpu_eval_loss(tmp_path / "full", pre) - full["eval_loss"]) < 1e-4
