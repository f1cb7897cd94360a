"""A user's stock transformers run_clm-style script: only the Trainer import is swapped.

HfArgumentParser(... TrainingArguments) parses the command line, the model is built with
AutoModelForCausalLM.from_config (as transformers' run_clm does), then Trainer(...).train(), save_model.
No hf_xla_fsdp call before TrainingArguments. With LATE_IMPORT=1 the TrainingArguments are built before the
import (what cannot work with FSDP v2: the test expects one line saying what to add). Writes OUT/results.json.
"""
import json
import os
import sys
from dataclasses import dataclass, field

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, HfArgumentParser, LlamaConfig, TrainingArguments, default_data_collator, set_seed

if os.environ.get("LATE_IMPORT") != "1":
    from hf_xla_fsdp import XlaFsdpTrainer as Trainer  # noqa: F401  <- the only change to the stock script


@dataclass
class DataArguments:
    block_size: int = field(default=32)
    num_samples: int = field(default=64)
    lora: bool = field(default=False, metadata={"help": "train LoRA adapters (peft) on q_proj/v_proj"})


def main():
    parser = HfArgumentParser((DataArguments, TrainingArguments))
    if len(sys.argv) == 2 and sys.argv[1].endswith(".json"):   # as transformers' run_clm.py
        data_args, training_args = parser.parse_json_file(json_file=os.path.abspath(sys.argv[1]))
    else:
        data_args, training_args = parser.parse_args_into_dataclasses()
    if os.environ.get("LATE_IMPORT") == "1":
        print(training_args.device)  # the device is taken before hf_xla_fsdp is imported
        global Trainer
        from hf_xla_fsdp import XlaFsdpTrainer as Trainer
    set_seed(training_args.seed)
    print(f"[stock] world_size={training_args.world_size} process_index={training_args.process_index} "
          f"device={training_args.device}", flush=True)
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    model = AutoModelForCausalLM.from_config(config)
    if data_args.lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=16, target_modules=["q_proj", "v_proj"]))
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, 256, (data_args.num_samples, data_args.block_size), generator=g)
    ds = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    if os.environ.get("STOCK_NO_MPF") != "1":   # transformers' run_clm maps its datasets under main_process_first
        with training_args.main_process_first(desc="dataset map"):
            ds = ds.map(lambda b: b, batched=True)
    trainer = Trainer(model=model, args=training_args, train_dataset=ds, data_collator=default_data_collator)
    trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    losses = [(e["step"], round(e["loss"], 4)) for e in trainer.state.log_history if "loss" in e]
    print(f"[stock] losses={losses}", flush=True)
    trainer.save_model()

    import torch_xla.runtime as xr

    with open(os.path.join(training_args.output_dir, "results.json"), "w") as fh:
        json.dump({"losses": losses, "spmd": xr.is_spmd(), "devices": xr.global_runtime_device_count(),
                   "world_size": training_args.world_size}, fh)


if __name__ == "__main__":
    main()
