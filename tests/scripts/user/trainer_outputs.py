"""A user's Trainer script whose tokenizer reaches the Trainer only through its data collator (no processing_class).

    STOCK=1 python tests/scripts/user/trainer_outputs.py --output_dir OUT --use_cpu true ...       # transformers' Trainer
    python tests/scripts/user/trainer_outputs.py --output_dir OUT --fsdp full_shard \
        --fsdp_config '{"xla": true}' ...                                                           # XlaFsdpTrainer

The same script both ways: only the Trainer import differs (``STOCK=1``), so the files each writes for
``checkpoint-N`` and ``save_model()`` can be compared name by name. ``--lora true`` trains LoRA adapters (peft).
``--record_dir DIR`` (test instrumentation, see recording.py) saves the base model (before the adapters) to DIR/base
and, at every save, the logits of a fixed batch to DIR/step-N.safetensors (after training, with the best model
loaded if asked: DIR/final.safetensors), so a test can check what each checkpoint reloads to.
"""
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
from datasets import Dataset
from recording import RecordLogits
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    DataCollatorForLanguageModeling,
    HfArgumentParser,
    LlamaConfig,
    TrainingArguments,
    set_seed,
)

if os.environ.get("STOCK") == "1":
    from transformers import Trainer
else:
    from hf_xla_fsdp import XlaFsdpTrainer as Trainer

TOKENIZER = Path(__file__).resolve().parents[3] / "examples" / "tiny_tokenizer"


@dataclass
class ScriptArguments:
    lora: bool = field(default=False, metadata={"help": "train LoRA adapters (peft) on q_proj/v_proj"})
    record_dir: str = field(default="", metadata={"help": "where the base model and the logits at every save go"})
    block_size: int = field(default=32)
    num_samples: int = field(default=48)


def main() -> None:
    script, args = HfArgumentParser((ScriptArguments, TrainingArguments)).parse_args_into_dataclasses()
    set_seed(args.seed)
    tokenizer = AutoTokenizer.from_pretrained(TOKENIZER)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                         tie_word_embeddings=False, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.eos_token_id, eos_token_id=tokenizer.eos_token_id)
    model = AutoModelForCausalLM.from_config(config)
    record = Path(script.record_dir) if script.record_dir else None
    if record is not None:
        model.save_pretrained(record / "base")
    if script.lora:
        from peft import LoraConfig, get_peft_model

        # B starts non-zero: the adapters change the logits from the first step on
        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"],
                                                 init_lora_weights=False))
    g = torch.Generator().manual_seed(0)
    # token 0 is the tokenizer's pad (and eos) token, which the collator masks out of the labels: never drawn
    ids = torch.randint(1, len(tokenizer), (script.num_samples, script.block_size), generator=g)
    train = Dataset.from_dict({"input_ids": ids[: -8].tolist()})
    evaluation = Dataset.from_dict({"input_ids": ids[-8:].tolist()})
    recorder = RecordLogits(record, config.vocab_size) if record is not None else None
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=evaluation,
                      data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
                      callbacks=[recorder] if recorder is not None else None)
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    if recorder is not None and args.should_save:
        recorder.record(trainer.model, "final")
    trainer.save_model()
    print(f"[outputs] best={trainer.state.best_model_checkpoint}", file=sys.stderr, flush=True)


if __name__ == "__main__":
    main()
