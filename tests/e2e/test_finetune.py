"""Fine-tuning a pretrained model as TPU users do: LoRA (peft) on XLA FSDP, saved as peft saves it; TRL's SFTTrainer."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import USER_SCRIPTS, run_python
from safetensors import safe_open
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_xla_fsdp import ConfigError, XlaFsdpAccelerator, XlaFsdpPlugin
from hf_xla_fsdp.cli import main as cli

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

peft = pytest.importorskip("peft")
FAMILIES = {
    # tied input/output embeddings
    "gpt2": lambda: GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64,
                                               bos_token_id=0, eos_token_id=0, resid_pdrop=0.0, embd_pdrop=0.0,
                                               attn_pdrop=0.0)),
    # grouped-query attention, untied head
    "llama": lambda: LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64,
                                                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                                  tie_word_embeddings=False)),
}
TARGETS = {"gpt2": ["c_attn"], "llama": ["q_proj", "v_proj"]}
SAVE = {"gpt2": ["lm_head"], "llama": ["lm_head"]}


def lora(family: str) -> "peft.LoraConfig":
    return peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS[family], modules_to_save=SAVE[family],
                           fan_in_fan_out=family == "gpt2", init_lora_weights=False)  # B != 0: adapters matter at once


def ids(n: int = 3) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, 128, (2, 16), generator=gen) for _ in range(n)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def tuned(request, tmp_path_factory):
    """A pretrained base saved to disk, LoRA attached, trained 3 steps with XlaFsdpAccelerator (v1), saved as adapters."""
    family = request.param
    root = tmp_path_factory.mktemp(f"lora-{family}")
    torch.manual_seed(0)
    FAMILIES[family]().save_pretrained(root / "base")
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    model = peft.get_peft_model(base, lora(family))
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for batch in ids():
        batch = batch.to(accelerator.device)
        accelerator.backward(model(input_ids=batch, labels=batch).loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.unwrap_model(model).save_pretrained(root / "adapters")
    from hf_xla_fsdp.checkpoint import save_checkpoint

    save_checkpoint(root / "ckpt", model, optimizer)
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=ids(1)[0].to(accelerator.device)).logits.cpu()
    state_bytes = sum(v.numel() * v.element_size() for s in optimizer.optimizer.state.values() for v in s.values()
                      if torch.is_tensor(v) and v.dim() > 0)
    return {"family": family, "root": root, "logits": logits, "trainable": trainable, "state_bytes": state_bytes,
            "model": model, "accelerator": accelerator}


def test_only_trainable_parameters_have_optimizer_state(tuned):
    # AdamW keeps exp_avg and exp_avg_sq for the adapters (and modules_to_save) only: 2 x trainable fp32 bytes, exactly
    # for the trainable shards (FSDP pads each to a multiple of 128 elements), within 5 % of the unpadded count
    shards = sum(p.numel() for p in tuned["model"].parameters() if p.requires_grad)
    assert tuned["state_bytes"] == 2 * 4 * shards
    assert 2 * 4 * tuned["trainable"] <= tuned["state_bytes"] <= 1.05 * 2 * 4 * tuned["trainable"]
    frozen = [p for p in tuned["model"].parameters() if not p.requires_grad]
    assert frozen and all(p.grad is None for p in frozen)


def test_saved_adapters_are_peft_format_and_reproduce_the_logits(tuned):
    root, family = tuned["root"], tuned["family"]
    names = sorted(p.name for p in (root / "adapters").iterdir())
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(names)
    # exactly the keys peft writes for the same adapters on one device
    torch.manual_seed(0)
    reference = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base"), lora(family))
    reference.save_pretrained(root / "reference")
    with safe_open(root / "adapters" / "adapter_model.safetensors", "pt") as ours, \
            safe_open(root / "reference" / "adapter_model.safetensors", "pt") as theirs:
        assert sorted(ours.keys()) == sorted(theirs.keys())
        for key in theirs.keys():
            assert ours.get_slice(key).get_shape() == theirs.get_slice(key).get_shape(), key
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), root / "adapters")
    with torch.no_grad():
        got = reloaded.eval()(input_ids=ids(1)[0]).logits
    torch.testing.assert_close(got, tuned["logits"], atol=1e-5, rtol=1e-5)  # fp32 both sides: reduction order only


def test_base_weights_did_not_change(tuned):
    root = tuned["root"]
    trained = tuned["accelerator"].get_state_dict(tuned["model"])
    base = AutoModelForCausalLM.from_pretrained(root / "base").state_dict()
    for name, tensor in trained.items():
        if ".base_layer." in name or ".original_module." in name:
            key = name.removeprefix("base_model.model.").replace(".base_layer.", ".").replace(".original_module.", ".")
            assert torch.equal(tensor, base[key]), name


def test_sharded_checkpoint_consolidates_to_adapters_and_to_a_merged_model(tuned):
    root = tuned["root"]
    assert cli(["consolidate", str(root / "ckpt"), "-o", str(root / "from_ckpt"), "--quiet"]) == 0
    with safe_open(root / "from_ckpt" / "adapter_model.safetensors", "pt") as a, \
            safe_open(root / "adapters" / "adapter_model.safetensors", "pt") as b:
        assert sorted(a.keys()) == sorted(b.keys())
        assert all(torch.equal(a.get_tensor(k), b.get_tensor(k)) for k in a.keys())
    assert cli(["export", str(root / "ckpt"), "-o", str(root / "merged"), "--merge-adapters", "--quiet"]) == 0
    merged, info = AutoModelForCausalLM.from_pretrained(root / "merged", output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert (root / "merged" / "README.md").is_file()
    with torch.no_grad():
        got = merged.eval()(input_ids=ids(1)[0]).logits
    torch.testing.assert_close(got, tuned["logits"], atol=1e-5, rtol=1e-5)


def test_wrong_inputs_are_one_line_and_write_nothing(tuned, tmp_path, capsys):
    root = tuned["root"]
    plain = tmp_path / "plain_ckpt"
    from hf_xla_fsdp.checkpoint import save_checkpoint

    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    save_checkpoint(plain, accelerator.prepare(FAMILIES["llama"]()))
    cases = [
        (["consolidate", str(plain), "-o", str(tmp_path / "o1"), "--merge-adapters"], "needs a checkpoint of a PEFT model"),
        (["export", str(root / "adapters"), "-o", str(tmp_path / "o2")], "holds PEFT adapters, not a model"),
        (["export", str(root / "base"), "-o", str(tmp_path / "o3"), "--merge-adapters"], "already a consolidated model"),
    ]
    for argv, needle in cases:
        assert cli(argv) == 2
        err = capsys.readouterr().err.strip()
        assert needle in err and len(err.splitlines()) == 1, err
        assert not Path(argv[3]).exists()
    with pytest.raises(ConfigError, match="holds PEFT adapters, not a model"):
        XlaFsdpPlugin().build(root / "adapters")
    base = AutoModelForCausalLM.from_pretrained(root / "base")
    with pytest.raises(ValueError, match="not_a_module"):  # peft's own check, before any sharding
        peft.get_peft_model(base, peft.LoraConfig(target_modules=["not_a_module"]))
    with pytest.raises(ConfigError, match="peft_config does not fit .*not_a_module") as err:  # the same, on meta
        XlaFsdpPlugin().build(root / "base", peft_config=peft.LoraConfig(target_modules=["not_a_module"]))
    assert "\n" not in str(err.value)


def test_lora_on_a_base_built_on_meta_block_by_block(tuned, tmp_path):
    """Base from the pretrained dir on meta, LoRA attached on meta, then materialized and sharded block by block."""
    family, root = tuned["family"], tuned["root"]
    config = peft.LoraConfig(r=4, lora_alpha=16, target_modules=TARGETS[family], modules_to_save=SAVE[family],
                             fan_in_fan_out=family == "gpt2")
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    model = accelerator.build_model(root / "base", peft_config=config)
    batch = ids(1)[0]
    base = AutoModelForCausalLM.from_pretrained(root / "base").eval()
    model.eval()
    with torch.no_grad():  # LoRA B starts at zero: the model is the base model
        start = model(input_ids=batch.to(accelerator.device)).logits.cpu()
        torch.testing.assert_close(start, base(input_ids=batch).logits, atol=1e-5, rtol=1e-5)
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    for step in ids(2):
        step = step.to(accelerator.device)
        accelerator.backward(model(input_ids=step, labels=step).loss)
        optimizer.step()
        optimizer.zero_grad()
    accelerator.unwrap_model(model).save_pretrained(tmp_path / "adapters")
    reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), tmp_path / "adapters")
    model.eval()
    with torch.no_grad():
        trained = model(input_ids=batch.to(accelerator.device)).logits.cpu()
        torch.testing.assert_close(reloaded.eval()(input_ids=batch).logits, trained, atol=1e-5, rtol=1e-5)
    assert (trained - start).abs().max() > 1e-3  # the adapters learned something


@pytest.fixture(scope="module")
def pre(tmp_path_factory) -> Path:
    """tests/scripts/user/make_pretrained.py's tiny "pretrained" models and corpus, built once for the module: the
    script builds on the host only (USE_TORCH_XLA=0, seeded), so every test that used to build its own copy got
    the same files; one process start (~8 s) instead of one per test."""
    out = tmp_path_factory.mktemp("pretrained")
    made = subprocess.run([sys.executable, str(USER_SCRIPTS / "make_pretrained.py"), str(out)], capture_output=True,
                          text=True, env=dict(os.environ, TOKENIZERS_PARALLELISM="false"), timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    return out


@pytest.mark.slow
@pytest.mark.parametrize("engine,use_peft", [("v1", False), ("v2", True)])
def test_sft_trainer_with_one_swapped_import(pre, tmp_path, engine, use_peft):
    """v1: full fine-tune in fp32 (--bf16 false); v2 on 4 devices: LoRA with TRL's default bf16=True."""
    pytest.importorskip("trl")
    out = tmp_path / "out"
    cmd = [str(USER_SCRIPTS / "sft.py"), "--model_name_or_path", str(pre / "llama"),
           "--output_dir", str(out), "--fsdp", "full_shard",
           "--fsdp_config", json.dumps({"xla": True, "xla_fsdp_v2": engine == "v2"}),
           "--max_steps", "8", "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--report_to", "none",
           "--logging_steps", "2", "--max_length", "64", "--pad_to_multiple_of", "64", "--seed", "3"]
    # LoRA: checkpoint-4 and checkpoint-8, with the logits at each (see recording.py); full weights: no checkpoints
    cmd += (["--use_peft", "--learning_rate", "1e-2", "--save_steps", "4", "--record_dir", str(tmp_path / "rec")]
            if use_peft else ["--bf16", "false", "--save_strategy", "no"])
    res = run_python(cmd, devices=4 if engine == "v2" else 1, env={"USE_HF_XLA_FSDP": "1"}, timeout=1200,
                     preloaded=True)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    results = json.loads((out / "results.json").read_text())
    assert results["eval_loss"] < results["eval_loss_before"]
    # the saved model (full or adapters) reloads and, evaluated by the stock SFTTrainer on the CPU, gives the
    # trainer's eval loss (fp32 on both sides: TRL's default bf16 autocast breaks CPU SDPA, so it is off there)
    assert (out / "adapter_model.safetensors").is_file() == use_peft and (out / "model.safetensors").is_file() != use_peft
    # stock transformers on the CPU: one device, no SPMD
    check = run_python(cmd[:1] + ["--model_name_or_path", str(pre / "llama"), "--output_dir", str(tmp_path / "eval"),
                                  "--evaluate_saved", str(out), "--use_cpu", "--report_to", "none",
                                  "--max_length", "64", "--pad_to_multiple_of", "64", "--bf16", "false"],
                       devices=1, timeout=600, preloaded=True)
    assert check.returncode == 0, check.stderr[-3000:]
    reloaded = json.loads(check.stdout.strip().splitlines()[-1])["eval_loss"]
    # fp32 training: the same loss up to summation order; bf16 training: the trainer evaluated with bf16 weights
    # and activations, the stock reload in fp32 (the adapters are saved from their fp32 master copies)
    assert abs(reloaded - results["eval_loss"]) < (1e-3 if engine == "v1" else 3e-2), (reloaded, results)
    if use_peft:  # every checkpoint-N is also peft's adapter files: the model of step N (bf16 training, as above)
        sys.path.insert(0, str(USER_SCRIPTS))
        from recording import fixed_batch
        from safetensors.torch import load_file

        batch = fixed_batch(json.loads((pre / "llama" / "config.json").read_text())["vocab_size"])
        logits = {step: load_file(tmp_path / "rec" / f"step-{step}.safetensors")["logits"] for step in (4, 8)}
        assert (logits[4] - logits[8]).abs().max() > 4e-2, "the two checkpoints must differ by more than the tolerance"
        for step in (4, 8):
            ckpt = out / f"checkpoint-{step}"
            assert (ckpt / "rank-00000-of-00001.safetensors").is_file()  # the rank files stay, for resuming
            model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(pre / "llama"), ckpt).eval()
            with torch.no_grad():
                torch.testing.assert_close(model(input_ids=batch).logits, logits[step], atol=1e-2, rtol=0)


V2_LORA = '''
import sys, torch
from pathlib import Path
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM
from peft import LoraConfig, PeftModel, get_peft_model
from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin

root = Path(sys.argv[1])
torch.manual_seed(0)
LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2)).save_pretrained(root / "base")
model = get_peft_model(AutoModelForCausalLM.from_pretrained(root / "base"),
                       LoraConfig(r=4, target_modules=["q_proj", "v_proj"], modules_to_save=["lm_head"]))
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(version=2))
model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
ids = torch.randint(0, 128, (4, 16), generator=torch.Generator().manual_seed(1)).to(accelerator.device)
for _ in range(3):
    accelerator.backward(model(input_ids=ids, labels=ids).loss); optimizer.step(); optimizer.zero_grad()
state = sum(v.numel() for s in optimizer.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.dim())
assert state == 2 * trainable, (state, trainable)
accelerator.unwrap_model(model).save_pretrained(root / "adapters")
reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(root / "base"), root / "adapters").eval()
model.eval()
with torch.no_grad():
    diff = (model(input_ids=ids).logits.cpu() - reloaded(input_ids=ids.cpu()).logits).abs().max().item()
assert diff < 1e-5, diff
print("ok", state, trainable, diff)
'''


@pytest.mark.slow
def test_lora_on_fsdp_v2_over_four_devices(tmp_path):

    script = tmp_path / "v2_lora.py"
    script.write_text(V2_LORA)
    res = run_python([script, tmp_path], devices=4, timeout=900, preloaded=True)
    assert res.returncode == 0 and res.stdout.strip().splitlines()[-1].startswith("ok"), res.stderr[-3000:]


@pytest.mark.slow
def test_lora_bf16_on_v2_checkpoints_are_adapters_and_resume(tmp_path):
    """A user's Trainer script with peft LoRA, bf16=True and FSDP v2 on 4 devices: every checkpoint-N loads with
    PeftModel.from_pretrained at step N's logits, and checkpoint-3 resumes exactly."""

    script = USER_SCRIPTS / "trainer_outputs.py"
    cfg = tmp_path / "v2.json"
    cfg.write_text(json.dumps({"xla": True, "xla_fsdp_v2": True}))

    def run(out: Path, *extra: str) -> dict[int, float]:
        res = run_python([script, "--lora", "true", "--bf16", "true", "--fsdp", "full_shard", "--fsdp_config", cfg,
                          "--output_dir", out, "--max_steps", "6", "--save_steps", "3", "--logging_steps", "1",
                          "--learning_rate", "1e-2", "--per_device_train_batch_size", "8", "--report_to", "none",
                          "--disable_tqdm", "true", "--record_dir", out.parent / f"{out.name}-rec", *extra],
                         devices=4, timeout=1200, preloaded=True)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        history = json.loads((out / "checkpoint-6" / "trainer_state.json").read_text())["log_history"]
        return {e["step"]: e["loss"] for e in history if "loss" in e}

    full = run(tmp_path / "full")
    assert sorted(full) == [1, 2, 3, 4, 5, 6]
    ckpt = tmp_path / "full" / "checkpoint-3"
    meta = json.loads(next(ckpt.glob("rank-*.json")).read_text())
    assert meta["peft"]["adapters"]["default"]["r"] == 4  # adapters, their optimizer state, RNG: all in the rank file
    assert meta["engine"] == "spmd" and meta["devices"] == 4
    # every checkpoint-N is also peft's adapter files: the model of step N, reloaded on the CPU in fp32. The trainer
    # computed in bf16 (the adapters are saved from their fp32 masters): 1e-2 on logits of magnitude ~0.5, while
    # steps 3 and 6 differ by ~9e-2
    sys.path.insert(0, str(USER_SCRIPTS))
    from recording import fixed_batch
    from safetensors.torch import load_file

    rec = tmp_path / "full-rec"
    batch = fixed_batch(json.loads((rec / "base" / "config.json").read_text())["vocab_size"])
    logits = {step: load_file(rec / f"step-{step}.safetensors")["logits"] for step in (3, 6)}
    assert (logits[3] - logits[6]).abs().max() > 4e-2
    for step in (3, 6):
        reloaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(rec / "base"),
                                                  tmp_path / "full" / f"checkpoint-{step}").eval()
        with torch.no_grad():
            torch.testing.assert_close(reloaded(input_ids=batch).logits, logits[step], atol=1e-2, rtol=0)
    from helpers import marked_copy

    resumed = run(tmp_path / "resumed", "--resume_from_checkpoint", str(marked_copy(ckpt, tmp_path / "marked-3")))
    # steps 1-3 come back with checkpoint-3's trainer state (marked: a silent restart from scratch would log real
    # losses there), 4-6 are trained again: bf16 parameters, fp32 masters saved, so the uninterrupted run's losses
    assert sorted(resumed) == [1, 2, 3, 4, 5, 6] and {resumed[s] for s in (1, 2, 3)} == {-1.0}
    assert all(resumed[s] == pytest.approx(full[s], abs=1e-6) for s in range(4, 7)), (resumed, full)
    saved = tmp_path / "full"
    assert (saved / "adapter_model.safetensors").is_file() and not (saved / "model.safetensors").exists()
    with safe_open(saved / "adapter_model.safetensors", "pt") as fh:
        assert all("lora_" in k for k in fh.keys()) and fh.get_tensor(next(iter(fh.keys()))).dtype == torch.float32
