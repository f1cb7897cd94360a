"""Every checkpoint the project writes verifies, consolidates and resumes: each writer path of
tests/scripts/writer_paths.py (meta and eager models, on the host or already on the device, fp32 and bf16 compute,
tied weights, non-persistent and persistent float buffers, LoRA, sync and async saves, several ranks), on FSDP v1 in
this process and on FSDP v2 in one worker process with 4 XLA:CPU devices.

The bug this guards against: an eager model placed on the device before wrapping (the Trainer and accelerate do
that when bf16 comes from an accelerate YAML, the launcher, ``--bf16`` or ``mixed_precision``) made torch_xla's
``get_shard_metadata()`` list the non-persistent rotary ``inv_freq`` (and every cast buffer under a name with
``_fpw_module.``) in ``buffer_info``; the validator refused every such checkpoint as corrupted. Checkpoints already
written that way must still load (the ``before_buffer_info_fix`` case).
"""

from __future__ import annotations

import gc
import json
import sys
from pathlib import Path

import pytest
import torch
from helpers import SCRIPTS, run_python

sys.path.insert(0, str(SCRIPTS))
import writer_paths  # noqa: E402

V1_CASES = [case for case, engines in writer_paths.CASES.items() if 1 in engines]


@pytest.fixture(scope="module", autouse=True)
def older_objects_frozen():
    """FSDP v1's constructor runs gc.collect() once per unit; with the test session's objects frozen that costs
    nothing (0.8 s a unit otherwise, with transformers and torch_xla loaded)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("case", V1_CASES)
def test_v1_writer_path_verifies_consolidates_and_resumes(tmp_path, case):
    writer_paths.run_case(case, 1, tmp_path)


@pytest.mark.slow
def test_v2_writer_paths_verify_consolidate_and_resume(tmp_path):
    res = run_python([SCRIPTS / "writer_paths.py", "--version", "2", "--out", tmp_path], devices=4,
                     env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=900)
    assert res.returncode == 0, res.stderr[-5000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(results) == {case for case, engines in writer_paths.CASES.items() if 2 in engines}
    failed = {case: why for case, why in results.items() if why != "ok"}
    assert not failed, failed


# --------------------------------------------------------------------------- bf16 from every settings source
# An eager model (from_pretrained) handed to the entry points as a script hands it, with bf16 compute named by each
# source the entry points read in a process; the launcher's (`hf-xla-fsdp launch --config_file examples/xla_fsdp.yaml`
# and `HF_XLA_FSDP=1 accelerate launch`) runs an unmodified run_clm.py: tests/e2e/test_official_scripts.py.
SOURCES = ["trainer_fsdp_config", "trainer_bf16_flag", "accelerator_mixed_precision", "accelerator_yaml"]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    from helpers import tiny_llama
    from transformers import AutoModelForCausalLM

    out = tmp_path_factory.mktemp("pretrained")
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_llama(**writer_paths.LLAMA)).save_pretrained(out)
    return out


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _batch(seed: int) -> dict[str, torch.Tensor]:
    ids = torch.randint(1, writer_paths.LLAMA["vocab_size"], (4, 16), generator=torch.Generator().manual_seed(seed))
    return {"input_ids": ids, "labels": ids}


def _trainer(source: str, pretrained, out, max_steps: int):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, TrainingArguments

    from hf_xla_fsdp import XlaFsdpTrainer

    fsdp_config = {"xla": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]}
    flags = {}
    if source == "trainer_fsdp_config":
        fsdp_config["compute_dtype"] = "bfloat16"
    else:
        flags["bf16"] = True
    rows = [_batch(seed)["input_ids"][i].tolist() for seed in range(2) for i in range(4)]
    data = Dataset.from_dict({"input_ids": rows, "labels": rows})
    args = TrainingArguments(output_dir=str(out), fsdp=True, fsdp_config=fsdp_config, max_steps=max_steps,
                             save_steps=1, logging_steps=1, per_device_train_batch_size=4, report_to=[], seed=0,
                             disable_tqdm=True, **flags)
    return XlaFsdpTrainer(model=AutoModelForCausalLM.from_pretrained(pretrained), args=args, train_dataset=data)


def _accelerator(source: str, pretrained, monkeypatch):
    from transformers import AutoModelForCausalLM

    from hf_xla_fsdp import XlaFsdpAccelerator

    if source == "accelerator_yaml":
        yaml = Path(__file__).resolve().parents[2] / "examples" / "xla_fsdp.yaml"  # compute_dtype: bfloat16
        monkeypatch.setenv("HF_XLA_FSDP_ACCELERATE_CONFIG", str(yaml))
        accelerator = XlaFsdpAccelerator()
    else:
        monkeypatch.delenv("HF_XLA_FSDP_ACCELERATE_CONFIG", raising=False)
        from hf_xla_fsdp import XlaFsdpPlugin

        accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(transformer_layer_cls_to_wrap="LlamaDecoderLayer"),
                                         mixed_precision="bf16")
    model = AutoModelForCausalLM.from_pretrained(pretrained)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    return accelerator, model, optimizer


@pytest.mark.slow  # a training step per source: 15-45 s each on a loaded machine (compiles)
@pytest.mark.parametrize("source", SOURCES)
def test_bf16_from_each_settings_source_writes_checkpoints_that_verify_consolidate_and_resume(
        tmp_path, pretrained, source, fresh_accelerate_state, monkeypatch):
    from hf_xla_fsdp.checkpoint.verify import verify_checkpoint
    from hf_xla_fsdp.export.peft import consolidate_checkpoint

    if source.startswith("trainer"):
        trainer = _trainer(source, pretrained, tmp_path / "run", max_steps=1)
        assert trainer.xla_fsdp_plugin.compute_dtype == torch.bfloat16
        trainer.train()
        ckpt = tmp_path / "run" / "checkpoint-1"
        first_loss = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    else:
        accelerator, model, optimizer = _accelerator(source, pretrained, monkeypatch)
        assert accelerator.xla_fsdp_plugin.compute_dtype == torch.bfloat16
        batch = {k: v.to(accelerator.device) for k, v in _batch(0).items()}
        accelerator.backward(model(**batch).loss)
        optimizer.step()
        optimizer.zero_grad()
        ckpt = Path(accelerator.save_state(str(tmp_path / "state"), step=1))
        saved = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
    assert verify_checkpoint(ckpt)["ok"]
    consolidate_checkpoint(ckpt, tmp_path / "consolidated", progress=False)
    from transformers import AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "consolidated")
    assert reloaded.model.rotary_emb.inv_freq.dtype == torch.float32
    if source.startswith("trainer"):
        # a second run resumes at step 1 (not from scratch: the step-1 loss is not logged again) and goes on to step 2
        resumed = _trainer(source, pretrained, tmp_path / "run", max_steps=2)
        resumed.train(resume_from_checkpoint=str(ckpt))
        logged = [(e["step"], e["loss"]) for e in resumed.state.log_history if "loss" in e]
        assert resumed.state.global_step == 2 and [s for s, _ in logged] == [1, 2] and logged[0][1] == first_loss[0]
        assert verify_checkpoint(tmp_path / "run" / "checkpoint-2")["ok"]
    else:
        accelerator, model, optimizer = _accelerator(source, pretrained, monkeypatch)
        assert accelerator.load_state(str(ckpt))["step"] == 1
        now = {n: p.detach().cpu() for n, p in model.named_parameters()}
        assert now.keys() == saved.keys() and all(torch.equal(now[n], saved[n]) for n in saved)
