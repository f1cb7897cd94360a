"""TRL's DPO trainer with XLA FSDP, end to end in user scripts, against stock
TRL on the CPU (same seed, same data, fp32 unless said): step by step, the saved model reloaded, resumed exactly.

GRPO and reward models: tests/e2e/test_grpo_and_reward.py (two files: --dist loadfile gives each a worker).
The user scripts live in tests/scripts/user/ (dpo.py, grpo.py, reward.py); tiny models and datasets come from
tests/trl_helpers.py. Stock runs set USE_TORCH_XLA=0: with torch_xla imported, torch's activation checkpointing on
the CPU looks for a ``torch.xla`` module and fails (TRL turns checkpointing on by default; trl #4182).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, USER_SCRIPTS, fsdp2_env, run_in_turn, run_python
from trl_helpers import WORDS, save_tiny_model

pytest.importorskip("trl")
pytestmark = pytest.mark.slow

STEPS = 4
# the same settings for stock and ours: fp32 (bf16 is TRL's default), logging every step, checkpoints at 2 and 4
COMMON = ["--max_steps", str(STEPS), "--per_device_train_batch_size", "4", "--report_to", "none", "--logging_steps",
          "1", "--seed", "1", "--max_length", "16", "--disable_tqdm", "true", "--bf16", "false"]
OFFICIAL_DPO = ROOT / "tests" / "official" / "dpo.py"  # TRL 1.16.0's trl/scripts/dpo.py, as published
XLA_V1 = ["--fsdp", "full_shard", "--fsdp_config", json.dumps({"xla": True})]
XLA_V2 = ["--fsdp", "full_shard", "--fsdp_config", json.dumps({"xla": True, "xla_fsdp_v2": True})]
VARIANTS = {  # full fine-tuning against an explicit reference; LoRA with reference log-probs precomputed
    "full": ["--explicit_ref", "--learning_rate", "1e-3"],
    "lora": ["--use_peft", "--precompute_ref_log_probs", "true", "--learning_rate", "1e-2"],
}
# fp32 on XLA:CPU against eager CPU: the same operations summed in another order. The DPO loss (~0.69) and the
# reward margins came out equal to 5e-8 over 4 steps (Llama); 1e-6 is ~16 fp32 ulps of 0.69 and two orders of
# magnitude below a step's change of the loss (~3e-3)
FP32_LOSS = 1e-6
# bf16 on 4 devices against fp32: log-probs summed over ~8 tokens of bf16 activations (2**-8 relative each) move the
# sequence log-probs by ~1e-2 and the loss, through beta=0.1, by ~1e-3; a step changes it by ~3e-3 here
BF16_LOSS = 2e-3
BF16_LOGITS = 1e-2  # the reloaded model against the bf16 trainer's last logits (reasoned where it is used)


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("pretrained") / "llama")


STOCK_ENV = {"USE_TORCH_XLA": "0"}


def _dpo_argv(model: Path, out: Path, *extra: str, stock: bool = False) -> list:
    flags = ["--use_cpu"] if stock else ["--pass_path", "--record_dir", str(out.parent / f"{out.name}-rec")]
    return [USER_SCRIPTS / "dpo.py", "--model_name_or_path", model, "--output_dir", out, *COMMON, *flags, *extra]


def _dpo(model: Path, out: Path, *extra: str, devices: int = 1) -> dict:
    res = run_python(_dpo_argv(model, out, *extra), devices=devices, env={"USE_HF_XLA_FSDP": "1"}, timeout=1200,
                     preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
    return json.loads((out / "results.json").read_text())


_stock: dict[str, dict] = {}


def stock_dpo(llama: Path, tmp: Path, variant: str) -> dict:
    """The stock CPU run of ``variant``, once per module: every variant's at the first call, one after the other in
    one process (helpers.run_in_turn: one start-up instead of one per variant; each run seeds itself, and the fp32
    comparisons against runs in fresh processes hold to 1e-6, so nothing carries over from the run before)."""
    if not _stock:
        outs = {name: tmp / f"stock-{name}" for name in sorted(VARIANTS)}
        res = run_in_turn([_dpo_argv(llama, out, *VARIANTS[name], "--save_strategy", "no", stock=True)
                           for name, out in outs.items()], env=STOCK_ENV, timeout=1200)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
        _stock.update({name: json.loads((out / "results.json").read_text()) for name, out in outs.items()})
    return _stock[variant]


def _series(results: dict, key: str) -> list[float]:
    return [e[key] for e in results["steps"]]


def _logits(model: torch.nn.Module, vocab: int) -> torch.Tensor:
    """``model``'s logits on recording.py's fixed batch (``vocab``: the tokenizer's length, as the script records)."""
    sys.path.insert(0, str(USER_SCRIPTS))
    from recording import fixed_batch

    with torch.no_grad():
        return model.eval()(input_ids=fixed_batch(vocab)).logits.float()


def _reloaded(base: Path, out: Path, variant: str) -> torch.nn.Module:
    """The run's saved output as a user loads it: ``from_pretrained`` (full) or peft's adapters on the base (LoRA)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    if variant == "lora":
        return PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    return AutoModelForCausalLM.from_pretrained(out)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dpo_on_v1_equals_stock_step_by_step_saves_and_resumes(llama, tmp_path_factory, variant):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    tmp = tmp_path_factory.mktemp(f"dpo-{variant}")
    stock = stock_dpo(llama, tmp_path_factory.getbasetemp(), variant)
    out = tmp / "ours"
    ours = _dpo(llama, out, *VARIANTS[variant], *XLA_V1, "--save_steps", "2")
    assert [e["step"] for e in ours["steps"]] == list(range(1, STEPS + 1)) and ours["steps_run"] == [[1, 2, 3, 4]]
    for key in ("loss", "rewards/margins", "rewards/chosen"):
        diff = max(abs(a - b) for a, b in zip(_series(ours, key), _series(stock, key)))
        assert diff <= FP32_LOSS, (key, diff, _series(ours, key), _series(stock, key))
    losses = _series(ours, "loss")
    assert max(losses) - min(losses) > 100 * FP32_LOSS  # the steps differ by far more than the tolerance

    # the saved model is what the trainer held at its last step: from_pretrained (full) / PeftModel (adapters)
    untrained = _logits(AutoModelForCausalLM.from_pretrained(llama), len(WORDS))
    if variant == "lora":
        assert (out / "adapter_model.safetensors").is_file() and not (out / "model.safetensors").exists()
    recorded = load_file(tmp / "ours-rec" / f"step-{STEPS}.safetensors")["logits"]
    saved = _logits(_reloaded(llama, out, variant), len(WORDS))
    torch.testing.assert_close(saved, recorded, atol=1e-5, rtol=0)  # XLA:CPU vs CPU, fp32
    assert (recorded - untrained).abs().max() > 1e-3  # it trained

    # resumed from checkpoint-2: only steps 3 and 4 run, with the uninterrupted run's losses, and end with the same
    # weights bit for bit (LoRA: the adapters; its reference log-probs are recomputed by the resumed run's __init__)
    resumed = _dpo(llama, tmp / "resumed", *VARIANTS[variant], *XLA_V1, "--save_steps", "2",
                   "--resume_from_checkpoint", str(out / "checkpoint-2"))
    assert resumed["steps_run"] == [[3, 4]]  # not a silent rerun from scratch
    assert _series(resumed, "loss")[2:] == losses[2:]
    weights = "adapter_model.safetensors" if variant == "lora" else "model.safetensors"
    final, again = load_file(out / weights), load_file(tmp / "resumed" / weights)
    assert again.keys() == final.keys()
    for name, tensor in again.items():
        assert torch.equal(tensor, final[name]), name


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_dpo_on_v2_four_devices_in_bf16_follows_stock_fp32(llama, tmp_path_factory, variant):
    """TRL's default precision (bf16) on 4 devices: the reference (built by TRL's own call, from the policy's path,
    for "full"; no --explicit_ref) and the policy compute in bf16; the losses follow the stock fp32 run; a resume from
    checkpoint-2 on the 4 devices repeats steps 3-4 exactly."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_xla_fsdp.checkpoint import read_marker

    stock = stock_dpo(llama, tmp_path_factory.getbasetemp(), variant)
    out = tmp_path_factory.mktemp(f"dpo-v2-{variant}") / "ours"
    extra = [a for a in VARIANTS[variant] if a != "--explicit_ref"]
    v2 = [*extra, *XLA_V2, "--bf16", "true", "--save_steps", "2"]
    ours = _dpo(llama, out, *v2, devices=4)
    for key in ("loss", "rewards/margins"):
        diff = max(abs(a - b) for a, b in zip(_series(ours, key), _series(stock, key)))
        assert diff <= BF16_LOSS, (key, diff, _series(ours, key), _series(stock, key))
    marker = read_marker(out / "checkpoint-4")
    weights = "adapter_model.safetensors" if variant == "lora" else "model.safetensors"
    assert marker["world_size"] == 1 and (out / weights).is_file()
    # the saved model (fp32 masters) reloaded on the CPU gives the logits the bf16 trainer recorded at its last step:
    # those are bf16 outputs (|logit| < 1 here, where a bf16 ulp is 2**-8 ~ 4e-3; measured 4.1e-3 full, 3.1e-3
    # LoRA), so 1e-2 (~2.5 ulps); the 4 steps moved them by 0.37 (LoRA) to 0.65 (full), far beyond it
    recorded = load_file(out.parent / "ours-rec" / f"step-{STEPS}.safetensors")["logits"]
    assert (_logits(_reloaded(llama, out, variant), len(WORDS)) - recorded).abs().max() < BF16_LOGITS
    untrained = _logits(AutoModelForCausalLM.from_pretrained(llama), len(WORDS))
    assert (untrained - recorded).abs().max() > 10 * BF16_LOGITS
    # resumed from checkpoint-2 on the 4 devices: steps 3 and 4 as the uninterrupted run, the same weights bit for bit
    resumed = _dpo(llama, out.parent / "resumed", *v2, "--resume_from_checkpoint", str(out / "checkpoint-2"), devices=4)
    assert resumed["steps_run"] == [[3, 4]]
    assert _series(resumed, "loss")[2:] == _series(ours, "loss")[2:]
    final, again = load_file(out / weights), load_file(out.parent / "resumed" / weights)
    assert again.keys() == final.keys() and all(torch.equal(again[k], final[k]) for k in final)


@pytest.mark.parametrize("engine", ["v1", "fsdp2"])
def test_trl_dpo_script_unmodified_under_the_launcher(llama, tmp_path, engine):
    """TRL's own trl/scripts/dpo.py (tests/official/dpo.py, byte for byte) under `hf-xla-fsdp launch` on FSDP v1 and on
    engine fsdp2 (torch's fully_shard in 2 real processes, CPU/gloo, torch_xla unimportable): the script gives
    DPOTrainer the model's path (TRL builds policy and reference, here on meta and sharded); 2 steps log their losses
    and the saved model loads with from_pretrained."""
    from transformers import AutoModelForCausalLM
    from trl_helpers import preference_rows

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in preference_rows(16)))
    out = tmp_path / "out"
    env = {"HF_XLA_FSDP": None, "USE_HF_XLA_FSDP": None, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    launch = ["--fsdp_config", '{"xla": true}'] if engine == "v1" else \
        ["--num_processes", "2", "--fsdp_config", '{"engine": "fsdp2"}']
    args = ["-m", "hf_xla_fsdp.cli", "launch", *launch, OFFICIAL_DPO, "--model_name_or_path", llama, "--dataset_name",
            data, "--output_dir", out, "--max_steps", "2", "--per_device_train_batch_size", "4", "--learning_rate",
            "1e-3", "--logging_steps", "1", "--report_to", "none", "--max_length", "16", "--dtype", "float32", "--bf16",
            "false", "--save_strategy", "no", "--seed", "1"]
    if engine == "v1":
        res = run_python(args, env=env, timeout=900)
    else:
        res = subprocess.run([sys.executable, *map(str, args)], cwd=ROOT, env=fsdp2_env(env), capture_output=True,
                             text=True, timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
    # logged every step (by the main process only)
    assert len(re.findall(r"'loss': ", res.stdout + res.stderr)) == 2, res.stdout[-2000:]
    record = json.loads((out / "xla_fsdp_training.json").read_text())
    assert record["engine"] == {"v1": "xla_fsdp_v1", "fsdp2": "fsdp2"}[engine], record
    with torch.no_grad():
        assert torch.isfinite(_logits(AutoModelForCausalLM.from_pretrained(out), len(WORDS))).all()
