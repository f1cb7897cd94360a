"""The Trainer and accelerate follow one checkpoint policy (checkpoint/layout.py CheckpointSeries): a newer checkpoint
without a completion marker (a save killed midway, written in place as object storage does) is skipped by
``trainer.train(resume_from_checkpoint=True)`` and by ``accelerator.load_state()``; rotation counts and deletes
complete checkpoints only, and the next automatic name never lands on an incomplete directory."""

from __future__ import annotations

import shutil

import pytest
import torch
from helpers import tiny_llama

from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin
from hf_xla_fsdp.checkpoint.layout import COMPLETE_MARKER

LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)


@pytest.fixture
def fresh_accelerate_state():
    from accelerate.state import AcceleratorState, GradientState

    yield
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def killed_midway(complete, target):
    """``target``: the files of ``complete`` without its marker, as a save killed before its commit leaves them."""
    shutil.copytree(complete, target)
    (target / COMPLETE_MARKER).unlink()


def _prepared(tmp_path, total_limit):
    from accelerate.utils import ProjectConfiguration
    from transformers import LlamaForCausalLM

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=total_limit)
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(), project_config=project)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama(**LLAMA))
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    return accelerator, model


def test_accelerate_load_state_skips_an_incomplete_newer_checkpoint(tmp_path, fresh_accelerate_state):
    accelerator, model = _prepared(tmp_path, total_limit=2)
    weight = next(model.parameters())
    for step in range(3):
        with torch.no_grad():
            weight.fill_(float(step))  # each checkpoint tells which one was loaded
        accelerator.save_state(step=step)
    root = tmp_path / "checkpoints"
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_1", "checkpoint_2"]
    killed_midway(root / "checkpoint_2", root / "checkpoint_3")

    info = accelerator.load_state()  # accelerate's own rule (highest number) would take checkpoint_3
    assert info["step"] == 2 and float(weight.detach().cpu().flatten()[0]) == 2.0
    assert accelerator.save_iteration == 4  # past the incomplete directory, not onto it
    accelerator.save_state(step=4)
    # total_limit=2 counts complete checkpoints: checkpoint_1 goes, the incomplete one is neither counted nor removed
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint_2", "checkpoint_3", "checkpoint_4"]


def test_accelerate_load_state_without_a_complete_checkpoint_is_one_line(tmp_path, fresh_accelerate_state):
    from hf_xla_fsdp import ConfigError

    accelerator, _ = _prepared(tmp_path, total_limit=None)
    accelerator.save_state(step=0)
    root = tmp_path / "checkpoints"
    (root / "checkpoint_0" / COMPLETE_MARKER).unlink()
    with pytest.raises(ConfigError, match="no complete checkpoint_<i> directory under .* to resume from"):
        accelerator.load_state()


@pytest.mark.slow  # two short training runs (compiles): about 40 s on a loaded machine
def test_trainer_resume_true_skips_an_incomplete_newer_checkpoint_and_rotation_keeps_complete_ones(tmp_path):
    from datasets import Dataset
    from transformers import LlamaForCausalLM, TrainerCallback, TrainingArguments

    from hf_xla_fsdp import XlaFsdpTrainer

    ids = torch.randint(1, LLAMA["vocab_size"], (16, 16), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})

    def trainer(max_steps):
        args = TrainingArguments(output_dir=str(tmp_path), fsdp=True, fsdp_config={"xla": True}, max_steps=max_steps,
                                 save_steps=1, save_total_limit=2, logging_steps=1, per_device_train_batch_size=4,
                                 report_to=[], seed=0, disable_tqdm=True)
        torch.manual_seed(0)
        return XlaFsdpTrainer(model=LlamaForCausalLM(tiny_llama(**LLAMA)), args=args, train_dataset=data)

    first = trainer(3)
    first.train()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-2", "checkpoint-3"]
    killed_midway(tmp_path / "checkpoint-3", tmp_path / "checkpoint-4")

    class Steps(TrainerCallback):
        ran: list[int] = []

        def on_step_end(self, args, state, control, **kwargs):
            self.ran.append(state.global_step)

    second = trainer(4)
    second.add_callback(Steps())
    second.train(resume_from_checkpoint=True)  # transformers' own rule (highest number) would take checkpoint-4
    # resumed at step 3 and trained step 4 only (from scratch: steps 1-4; from checkpoint-4: nothing, or a load error)
    assert Steps.ran == [4] and second.state.global_step == 4
    # the new checkpoint-4 was written over the incomplete one, and save_total_limit=2 kept complete ones
    assert (tmp_path / "checkpoint-4" / COMPLETE_MARKER).is_file()
    assert sorted(p.name for p in tmp_path.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
