"""TRL's GRPO and reward trainers with XLA FSDP, end to end in user scripts (tests/scripts/user/grpo.py, reward.py):
reward models against stock TRL on the CPU step by step, GRPO's rollouts compiling nothing after warm-up. DPO and the
shared settings: tests/e2e/test_post_training.py (two files: --dist loadfile gives each a worker)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from helpers import USER_SCRIPTS, run_in_turn, run_python
from test_post_training import COMMON, FP32_LOSS, STEPS, XLA_V1, XLA_V2, _logits, _series
from trl_helpers import WORDS, save_tiny_model

pytest.importorskip("trl")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return save_tiny_model(tmp_path_factory.mktemp("pretrained") / "llama")


REWARD_VARIANTS = {"full": ["--learning_rate", "1e-3"], "lora": ["--learning_rate", "1e-3", "--use_peft"]}


def _reward_argv(llama: Path, out: Path, variant: str, *flags: str) -> list:
    return [USER_SCRIPTS / "reward.py", "--model_name_or_path", llama, "--output_dir", out, *COMMON,
            *REWARD_VARIANTS[variant], *flags]


_stock: dict[str, dict] = {}


def stock_reward(llama: Path, tmp: Path, variant: str) -> dict:
    """Stock TRL's run of ``variant`` on the CPU, once per module: every variant's at the first call, one after the
    other in one process (helpers.run_in_turn: one start-up instead of one per variant; each run seeds itself, and
    the 1e-6 comparisons against runs in fresh processes hold, so nothing carries over from the run before)."""
    if not _stock:
        outs = {variant: tmp / f"stock-reward-{variant}" for variant in REWARD_VARIANTS}
        res = run_in_turn([_reward_argv(llama, out, variant, "--use_cpu", "--save_strategy", "no")
                           for variant, out in outs.items()], env={"USE_TORCH_XLA": "0"}, timeout=1200)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
        _stock.update({variant: json.loads((out / "results.json").read_text()) for variant, out in outs.items()})
    return _stock[variant]


@pytest.mark.parametrize("variant", sorted(REWARD_VARIANTS))
def test_reward_model_on_v1_equals_stock_and_saves_its_score_head(llama, tmp_path_factory, variant):
    """RewardTrainer builds AutoModelForSequenceClassification (one label) from the causal LM's path: on meta, block
    by block, with a fresh ``score`` head. The losses follow stock TRL on the CPU step by step; the saved model (the
    whole classifier, or the adapters with the trained head as peft's modules_to_save) loads with from_pretrained and
    scores like the trainer's model at its last step."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from transformers import AutoModelForSequenceClassification

    tmp = tmp_path_factory.mktemp(f"reward-{variant}")
    stock = stock_reward(llama, tmp_path_factory.getbasetemp(), variant)
    res = run_python(_reward_argv(llama, tmp / "ours", variant, *XLA_V1, "--save_steps", str(STEPS), "--record_dir",
                                  tmp / "rec"), env={"USE_HF_XLA_FSDP": "1"}, timeout=1200, preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
    ours = json.loads((tmp / "ours" / "results.json").read_text())
    diff = max(abs(a - b) for a, b in zip(_series(ours, "loss"), _series(stock, "loss")))
    assert diff <= FP32_LOSS, (diff, _series(ours, "loss"), _series(stock, "loss"))
    if variant == "lora":
        base = AutoModelForSequenceClassification.from_pretrained(llama, num_labels=1)
        saved = PeftModel.from_pretrained(base, tmp / "ours")
        assert any("score" in k for k in load_file(tmp / "ours" / "adapter_model.safetensors"))  # the trained head
    else:
        config = json.loads((tmp / "ours" / "config.json").read_text())
        assert config["architectures"] == ["LlamaForSequenceClassification"] and len(config["id2label"]) == 1
        saved = AutoModelForSequenceClassification.from_pretrained(tmp / "ours")
        assert "score.weight" in load_file(tmp / "ours" / "model.safetensors")
    recorded = load_file(tmp / "rec" / f"step-{STEPS}.safetensors")["logits"]
    assert recorded.shape == (2, 1)  # one reward per sequence
    torch.testing.assert_close(_logits(saved, len(WORDS)), recorded, atol=1e-5, rtol=0)


GRPO_VARIANTS = {  # engine, devices, extra flags
    # full fine-tuning with a KL term: TRL builds the reference from the policy's path (evaluation mode, sharded)
    "v1-full-beta": (XLA_V1, 1, ["--beta", "0.04"]),
    # LoRA on 4 devices, TRL's default bf16 and beta=0 (no reference at all)
    "v2-lora": (XLA_V2, 4, ["--use_peft", "--beta", "0.0", "--bf16", "true"]),
}


# A new user's run: TRL 1.16's GRPOConfig defaults (per-device batch 8, num_generations 8, bf16, beta 0, lr 1e-6,
# logging every 10 steps, gradient checkpointing) with LoRA on v2 over 4 devices, 4 steps; one change,
# max_completion_length 8 (the default 512 did not finish step 1's rollout in 14 min on 4 XLA:CPU devices)
TRL_DEFAULTS = [*XLA_V2, "--use_peft", "--max_steps", "4", "--max_completion_length", "8", "--report_to", "none",
                "--save_strategy", "no", "--disable_tqdm", "true"]


def test_grpo_trl_defaults_on_v2_compile_no_graph_after_step_two(llama, tmp_path_factory):
    """TRL's defaults as a user starts from them (TRL_DEFAULTS): no step after the second compiles anything, counted
    from the end of the step before (a step's optimizer update compiles at the next batch fetch, between steps)."""
    out = tmp_path_factory.mktemp("grpo-trl-defaults") / "out"
    res = run_python([USER_SCRIPTS / "grpo.py", "--model_name_or_path", llama, "--output_dir", out, *TRL_DEFAULTS,
                      "--record_dir", str(out)], devices=4, env={"USE_HF_XLA_FSDP": "1"}, timeout=1500,
                     preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
    results = json.loads((out / "results.json").read_text())
    compiles, graphs = results["compiles"], results["graphs"]
    assert len(compiles) == 4 and compiles[0] > 0, compiles
    assert compiles[2:] == [0, 0], (compiles, graphs)


@pytest.mark.parametrize("variant", sorted(GRPO_VARIANTS))
def test_grpo_six_steps_compile_no_graph_after_step_two(llama, tmp_path_factory, variant):
    """GRPO with a Python reward function, rollouts by model.generate on the sharded policy (static KV cache, prompts
    left-padded to a bucket, completions to max_completion_length): every step after the second compiles nothing
    (torch_xla's CompileTime, counted per step in a callback), rewards and generation tokens/s are logged, and the
    saved model loads."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    fsdp, devices, extra = GRPO_VARIANTS[variant]
    out = tmp_path_factory.mktemp(f"grpo-{variant}") / "out"
    common = [a for i, a in enumerate(COMMON) if "--max_length" not in COMMON[max(i - 1, 0):i + 1]]  # not GRPO's
    res = run_python([USER_SCRIPTS / "grpo.py", "--model_name_or_path", llama, "--output_dir", out, *common, *fsdp,
                      "--max_steps", "6", "--num_generations", "4", "--max_completion_length", "8",
                      "--learning_rate", "1e-3", "--save_strategy", "no", "--record_dir", str(out), *extra],
                     devices=devices, env={"USE_HF_XLA_FSDP": "1"}, timeout=1500, preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
    results = json.loads((out / "results.json").read_text())
    compiles, graphs, steps = results["compiles"], results["graphs"], results["steps"]
    # no step after the second compiles a graph of the computation (rollout, scoring, training step), nor anything
    # else: under SPMD the host reads of the completions and of what TRL gathers would each compile an uncached
    # replication program (11 per step here before rollout.py and accelerator.gather read them whole)
    assert len(graphs) == 6 and graphs[0] > 0 and graphs[2:] == [0, 0, 0, 0], (graphs, compiles)
    assert compiles[2:] == [0, 0, 0, 0], compiles
    assert len(steps) == 6 and all("reward" in e and e["generation/tokens_per_second"] > 0 for e in steps)
    assert len({round(e["reward"], 6) for e in steps}) > 1 and any(abs(e["loss"]) > 1e-3 for e in steps)  # learned
    if "lora" in variant:
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(llama), out)
    else:
        model = AutoModelForCausalLM.from_pretrained(out)
    with torch.no_grad():
        assert torch.isfinite(_logits(model, len(WORDS))).all()


def test_trl_grpo_script_unmodified_under_the_launcher(llama, tmp_path):
    """TRL's own grpo.py (the installed package's trl/scripts/grpo.py, what `trl grpo` runs) under `hf-xla-fsdp
    launch` on FSDP v1, with a Python reward function named by its import path as the script takes it: 2 steps log
    their loss and reward, and the saved model loads with from_pretrained."""
    import re

    import trl
    from transformers import AutoModelForCausalLM
    from trl_helpers import prompt_rows

    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text("".join(json.dumps(row) + "\n" for row in prompt_rows(16)))
    out = tmp_path / "out"
    script = Path(trl.__file__).parent / "scripts" / "grpo.py"
    env = {"HF_XLA_FSDP": None, "USE_HF_XLA_FSDP": None, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
    # the script imports a dotted --reward_funcs from its working directory: tests/, where trl_helpers lives
    res = run_python(["-m", "hf_xla_fsdp.cli", "launch", "--fsdp_config", '{"xla": true}', script,
                      "--model_name_or_path", llama, "--dataset_name", data, "--reward_funcs",
                      "trl_helpers.counting_reward", "--output_dir", out, "--max_steps", "2",
                      "--per_device_train_batch_size", "4", "--num_generations", "4", "--max_completion_length", "8",
                      "--learning_rate", "1e-3", "--logging_steps", "1", "--report_to", "none", "--dtype", "float32",
                      "--bf16", "false", "--save_strategy", "no", "--seed", "1"],
                     env=env, cwd=Path(__file__).resolve().parents[1], timeout=900)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-5000:]
    logs = res.stdout + res.stderr
    assert len(re.findall(r"'loss': ", logs)) == 2 and len(re.findall(r"'reward': ", logs)) == 2, logs[-3000:]
    assert json.loads((out / "xla_fsdp_training.json").read_text())["engine"] == "xla_fsdp_v1"
    with torch.no_grad():
        assert torch.isfinite(_logits(AutoModelForCausalLM.from_pretrained(out), len(WORDS))).all()
