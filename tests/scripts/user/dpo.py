"""Preference tuning (DPO) the way TRL's docs write it, with one swapped import when USE_HF_XLA_FSDP=1.

    python tests/scripts/user/dpo.py --model_name_or_path DIR --output_dir OUT [--explicit_ref] [--use_peft]
        [--pass_path] [DPOConfig flags: --fsdp full_shard --fsdp_config '{"xla": true}', --max_steps, ...]

Data: counting preferences (tests/trl_helpers.py). ``--explicit_ref`` passes the reference model as the second
positional argument, as ``DPOTrainer(model, ref_model, args, ...)`` takes it; ``--pass_path`` gives the trainer the
model (and reference) paths instead of models. Writes OUT/results.json: the log history of every step.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # tests/, for trl_helpers
sys.path.insert(0, str(Path(__file__).resolve().parent))  # recording (test instrumentation)

from datasets import Dataset  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer, HfArgumentParser  # noqa: E402
from trl import DPOConfig  # noqa: E402
from trl_helpers import preference_rows  # noqa: E402

if os.environ.get("USE_HF_XLA_FSDP") == "1":
    from hf_xla_fsdp import XlaFsdpDPOTrainer as DPOTrainer
else:
    from trl import DPOTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local pretrained model directory"})
    explicit_ref: bool = field(default=False, metadata={"help": "pass the reference model, positionally"})
    use_peft: bool = field(default=False, metadata={"help": "train LoRA adapters (the reference: adapters disabled)"})
    pass_path: bool = field(default=False, metadata={"help": "give the trainer paths, not models"})
    rows: int = field(default=64, metadata={"help": "preference pairs to train on"})
    record_dir: str = field(default="", metadata={"help": "test instrumentation: the logits at every save go here"})


def main() -> None:
    ns, args = HfArgumentParser((ScriptArguments, DPOConfig)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(ns.model_name_or_path)
    train = Dataset.from_list(preference_rows(ns.rows))

    def load(path: str):
        return path if ns.pass_path else AutoModelForCausalLM.from_pretrained(path)

    model = load(ns.model_name_or_path)
    peft_config = None
    if ns.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    callbacks = []
    if ns.record_dir:  # not what a user writes: see recording.py
        from recording import RecordLogits, StepsRun

        callbacks = [RecordLogits(Path(ns.record_dir), len(tokenizer)), StepsRun()]
    if ns.explicit_ref:
        trainer = DPOTrainer(model, load(ns.model_name_or_path), args, train_dataset=train, processing_class=tokenizer,
                             peft_config=peft_config, callbacks=callbacks)
    else:
        trainer = DPOTrainer(model=model, args=args, train_dataset=train, processing_class=tokenizer,
                             peft_config=peft_config, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        steps = [e for e in trainer.state.log_history if "loss" in e]
        run = [c.steps for c in callbacks if hasattr(c, "steps")]
        Path(args.output_dir, "results.json").write_text(json.dumps({"steps": steps, "steps_run": run}))


if __name__ == "__main__":
    main()
