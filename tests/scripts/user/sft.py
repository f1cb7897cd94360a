"""Supervised fine-tuning the way TRL's docs write it, with one swapped import when USE_HF_XLA_FSDP=1.

    python tests/scripts/user/sft.py --model_name_or_path DIR --output_dir OUT --fsdp full_shard \
        --fsdp_config '{"xla": true}' [--use_peft] [--packing] [--completion_only_loss]

Data: prompt/completion pairs made from the lines of DIR/../train.txt (the first words are the prompt).
Writes OUT/results.json with the trainer's eval loss before and after training. With SFT_USE_SPMD=1 it starts
with ``xr.use_spmd()``, as TPU FSDP v2 scripts written for the stock stack do.
"""

from __future__ import annotations

import json
import os
import sys

if os.environ.get("SFT_USE_SPMD") == "1":  # first thing, as accelerate's TPU FSDP v2 + TRL example does
    import torch_xla.runtime as xr

    xr.use_spmd()
from dataclasses import dataclass, field
from pathlib import Path

from datasets import Dataset
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser
from trl import SFTConfig

if os.environ.get("USE_HF_XLA_FSDP") == "1":
    from hf_xla_fsdp import XlaFsdpSFTTrainer as SFTTrainer
else:
    from trl import SFTTrainer


def pairs(path: Path, limit: int) -> Dataset:
    """prompt/completion rows: the first three words of each line, then the rest."""
    rows = []
    for line in path.read_text().splitlines()[:limit]:
        words = line.split()
        if len(words) > 4:
            rows.append({"prompt": " ".join(words[:3]) + " ", "completion": " ".join(words[3:])})
    return Dataset.from_list(rows)


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local pretrained model directory"})
    use_peft: bool = field(default=False, metadata={"help": "train LoRA adapters (peft) instead of all weights"})
    pass_path: bool = field(default=False, metadata={"help": "give the trainer the model path, not the model"})
    evaluate_saved: str = field(default="", metadata={"help": "only evaluate this saved output (model or adapters)"})
    record_dir: str = field(default="", metadata={"help": "test instrumentation: the logits at every save go here"})


def main() -> None:
    ns, args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    data_dir = Path(ns.model_name_or_path).parent
    train, evaluation = pairs(data_dir / "train.txt", 256), pairs(data_dir / "validation.txt", 32)
    tokenizer = AutoTokenizer.from_pretrained(ns.model_name_or_path)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    if ns.evaluate_saved:  # what a user does with the result: load it and evaluate it the stock way
        saved = Path(ns.evaluate_saved)
        if (saved / "adapter_config.json").is_file():
            from peft import PeftModel

            model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(ns.model_name_or_path), saved)
        else:
            model = AutoModelForCausalLM.from_pretrained(saved)
        trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                             processing_class=tokenizer)
        print(json.dumps({"eval_loss": trainer.evaluate()["eval_loss"]}))
        return
    model = ns.model_name_or_path if ns.pass_path else AutoModelForCausalLM.from_pretrained(ns.model_name_or_path)
    peft_config = None
    if ns.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    callbacks = None
    if ns.record_dir:  # not what a user writes: see recording.py
        from recording import RecordLogits

        callbacks = [RecordLogits(Path(ns.record_dir), len(tokenizer))]
    trainer = SFTTrainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                         processing_class=tokenizer, peft_config=peft_config, callbacks=callbacks)
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model()
    if trainer.is_world_process_zero():
        Path(args.output_dir, "results.json").write_text(json.dumps({"eval_loss_before": before, "eval_loss": after}))
    print(json.dumps({"eval_loss_before": before, "eval_loss": after}), file=sys.stderr)


if __name__ == "__main__":
    main()
