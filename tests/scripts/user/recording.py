"""Test instrumentation for the user scripts beside it: the logits of the model at every save.

Not part of what a user writes: a callback the scripts add when given a record directory, so a test can check
that each ``checkpoint-N`` reloads (e.g. with ``PeftModel.from_pretrained``) to the model as it was at step N.
"""
from pathlib import Path

import torch
from transformers import TrainerCallback


def fixed_batch(vocab: int) -> torch.Tensor:
    """The batch whose logits are recorded (ids 1..vocab-1: 0 is the pad token of the scripts' tokenizers)."""
    return torch.randint(1, vocab, (2, 16), generator=torch.Generator().manual_seed(123))


class RecordLogits(TrainerCallback):
    """After every checkpoint, DIR/step-N.safetensors: the logits of the model as trained so far, on a fixed batch."""

    def __init__(self, directory: Path, vocab: int) -> None:
        self.directory, self.batch = Path(directory), fixed_batch(vocab)
        self.directory.mkdir(parents=True, exist_ok=True)

    def record(self, model: torch.nn.Module, name: str) -> None:
        """DIR/<name>.safetensors: ``model``'s fp32 logits on the fixed batch (eval mode, then back)."""
        from safetensors.torch import save_file

        was_training = model.training
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=self.batch.to(next(model.parameters()).device)).logits.float().cpu()
        model.train(was_training)
        save_file({"logits": logits.contiguous()}, str(self.directory / f"{name}.safetensors"))

    def on_save(self, args, state, control, model=None, **kwargs):
        if args.should_save:
            self.record(model, f"step-{state.global_step}")


class StepsRun(TrainerCallback):
    """The optimizer steps this process ran (a resumed run runs only those after its checkpoint)."""

    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)
