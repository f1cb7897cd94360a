"""Reward modelling (TRL's RewardTrainer on AutoModelForSequenceClassification) the way TRL's docs write it, with
one swapped import when USE_HF_XLA_FSDP=1.

    python tests/scripts/user/reward.py --model_name_or_path DIR --output_dir OUT [--use_peft]
        [RewardConfig flags: --fsdp full_shard --fsdp_config '{"xla": true}', --max_steps, ...]

Data: counting preferences (tests/trl_helpers.py). The model is given as its path: RewardTrainer builds
``AutoModelForSequenceClassification`` with one label from it (a fresh ``score`` head on the pretrained causal LM).
Writes OUT/results.json: the log history of every step.
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
from transformers import AutoTokenizer, HfArgumentParser  # noqa: E402
from trl import RewardConfig  # noqa: E402
from trl_helpers import preference_rows  # noqa: E402

if os.environ.get("USE_HF_XLA_FSDP") == "1":
    from hf_xla_fsdp import XlaFsdpRewardTrainer as RewardTrainer
else:
    from trl import RewardTrainer


@dataclass
class ScriptArguments:
    model_name_or_path: str = field(metadata={"help": "a local pretrained model directory"})
    use_peft: bool = field(default=False, metadata={"help": "train LoRA adapters (and the score head)"})
    record_dir: str = field(default="", metadata={"help": "test instrumentation: the rewards at every save go here"})


def main() -> None:
    ns, args = HfArgumentParser((ScriptArguments, RewardConfig)).parse_args_into_dataclasses()
    tokenizer = AutoTokenizer.from_pretrained(ns.model_name_or_path)
    train = Dataset.from_list(preference_rows(64))
    peft_config = None
    if ns.use_peft:
        from peft import LoraConfig

        peft_config = LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"], task_type="SEQ_CLS")
    callbacks = []
    if ns.record_dir:  # not what a user writes: see recording.py
        from recording import RecordLogits, StepsRun

        callbacks = [RecordLogits(Path(ns.record_dir), len(tokenizer)), StepsRun()]
    trainer = RewardTrainer(model=ns.model_name_or_path, args=args, train_dataset=train, processing_class=tokenizer,
                            peft_config=peft_config, callbacks=callbacks)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    trainer.save_model()
    if trainer.is_world_process_zero():
        steps = [e for e in trainer.state.log_history if "loss" in e]
        Path(args.output_dir, "results.json").write_text(json.dumps({"steps": steps}))


if __name__ == "__main__":
    main()
