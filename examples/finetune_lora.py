"""LoRA fine-tuning of a pretrained causal LM with TRL's SFTTrainer on XLA FSDP (v2, bf16), as TPU users run it.

On a TPU VM / pod slice (every host runs the same command; download the model to local disk first):

    huggingface-cli download meta-llama/Llama-2-7b-hf --local-dir /mnt/disks/models/llama-2-7b
    python examples/finetune_lora.py --model_name_or_path /mnt/disks/models/llama-2-7b \\
        --train_file my_corpus.txt --output_dir out --fsdp full_shard \\
        --fsdp_config examples/xla_fsdp_v2_config.json --max_length 1024 --pad_to_multiple_of 1024 \\
        --per_device_train_batch_size 8 --max_steps 1000 --save_steps 200 --learning_rate 2e-4

Here, on XLA:CPU (4 simulated devices; with no --model_name_or_path a tiny Llama is made and saved first):

    CPU_NUM_DEVICES=4 python examples/finetune_lora.py --output_dir out --fsdp full_shard \\
        --fsdp_config examples/xla_fsdp_v2_config.json --max_length 64 --pad_to_multiple_of 64 --max_steps 20

What happens: the base model is built on ``meta`` with the LoRA adapters attached there, then
materialized block by block from its safetensors files and sharded over every device (the base is
never whole in host memory); ``bf16`` (TRL's default) stores the parameters in bfloat16 and the
optimizer updates fp32 master copies of the adapters. ``OUT/checkpoint-N`` are sharded checkpoints
(resume with ``--resume_from_checkpoint OUT/checkpoint-N``); ``OUT`` ends with peft's
``adapter_config.json`` + ``adapter_model.safetensors``; ``hf-xla-fsdp export OUT/checkpoint-N -o merged
--merge-adapters`` writes the merged full model.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from datasets import load_dataset
from peft import LoraConfig
from transformers import AutoTokenizer, HfArgumentParser, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast, set_seed
from trl import SFTConfig

from hf_xla_fsdp import XlaFsdpSFTTrainer as SFTTrainer

HERE = Path(__file__).resolve().parent


@dataclass
class ScriptArguments:
    """The model, the data and the adapters."""

    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "a local pretrained model directory (default: a tiny Llama made under OUT/base)"})
    train_file: str = field(default=str(HERE / "data" / "tiny_corpus.txt"), metadata={"help": "a text file, one sample per line"})
    lora_r: int = field(default=8, metadata={"help": "LoRA rank"})
    lora_alpha: int = field(default=16, metadata={"help": "LoRA alpha"})
    lora_target_modules: str = field(default="q_proj,k_proj,v_proj,o_proj",
                                     metadata={"help": "comma-separated module names that get adapters"})


def tiny_pretrained(directory: Path) -> Path:
    """A small Llama saved with save_pretrained (the stand-in for a downloaded checkpoint) and its tokenizer."""
    if not (directory / "config.json").is_file():
        set_seed(0)
        config = LlamaConfig(**json.loads((HERE / "configs" / "tiny_llama.json").read_text()))
        LlamaForCausalLM(config).save_pretrained(directory)
        tokenizer = PreTrainedTokenizerFast.from_pretrained(HERE / "tiny_tokenizer")
        tokenizer.save_pretrained(directory)
    return directory


def main() -> None:
    """Parse the arguments, fine-tune, save the adapters."""
    script, args = HfArgumentParser((ScriptArguments, SFTConfig)).parse_args_into_dataclasses()
    model_dir = Path(script.model_name_or_path or tiny_pretrained(Path(args.output_dir) / "base"))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    data = load_dataset("text", data_files={"train": script.train_file})["train"].filter(lambda row: row["text"].strip())
    split = data.train_test_split(test_size=0.05, seed=args.seed)
    peft_config = LoraConfig(r=script.lora_r, lora_alpha=script.lora_alpha, task_type="CAUSAL_LM",
                             target_modules=[m.strip() for m in script.lora_target_modules.split(",") if m.strip()])
    # the model as a path: built on meta with the adapters, block by block (never whole in host memory)
    trainer = SFTTrainer(model=str(model_dir), args=args, train_dataset=split["train"], eval_dataset=split["test"],
                         processing_class=tokenizer, peft_config=peft_config)
    before = trainer.evaluate()["eval_loss"]
    trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    after = trainer.evaluate()["eval_loss"]
    trainer.save_model()  # adapter_config.json + adapter_model.safetensors, peft's names
    if trainer.is_world_process_zero():
        print(json.dumps({"eval_loss_before": before, "eval_loss": after, "adapters": args.output_dir}))


if __name__ == "__main__":
    main()
