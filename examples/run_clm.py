"""Causal-LM training with transformers' Trainer flags and XLA FSDP, in the style of transformers' run_clm.py.

    python examples/run_clm.py --fsdp --fsdp_config examples/xla_fsdp_config.json \\
        --output_dir OUT --max_steps 20 --save_steps 10
    python examples/run_clm.py ... --resume_from_checkpoint OUT/checkpoint-10

Every TrainingArguments flag works as in transformers; the XLA FSDP settings come from the
--fsdp_config JSON (transformers' keys plus ours: meta_init, sharding, checkpoint_format,
consolidate_dtype, consolidate_max_shard_size). With no model or data arguments the bundled tiny
Llama config, tokenizer and corpus are used. OUT/checkpoint-N are sharded checkpoints; OUT itself
ends up holding a from_pretrained-ready safetensors model, its tokenizer and a model card.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from transformers import AutoConfig, AutoTokenizer, HfArgumentParser, TrainingArguments, default_data_collator, set_seed

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from clm_data import build_datasets  # noqa: E402

# importing the trainer makes TrainingArguments ready the runtime for their settings (FSDP v2: SPMD) before they
# take the device, so nothing else has to run first
from hf_xla_fsdp import XlaFsdpTrainer  # noqa: E402


@dataclass
class ModelArguments:
    """Which model to train."""

    model_name_or_path: Optional[str] = field(
        default=None, metadata={"help": "A local model directory: its safetensors weights are loaded block by block."})
    config_name: Optional[str] = field(
        default=None, metadata={"help": "A config.json or model directory to train from scratch "
                                        "(default: the bundled tiny Llama)."})
    tokenizer_name: Optional[str] = field(
        default=None, metadata={"help": "Tokenizer directory (default: the model's, else the bundled tiny one)."})


@dataclass
class DataTrainingArguments:
    """What data to train and evaluate on."""

    train_file: Optional[str] = field(default=None, metadata={"help": "A local text file (default: bundled corpus)."})
    validation_file: Optional[str] = field(default=None, metadata={"help": "A local text file for evaluation."})
    validation_split_percentage: int = field(
        default=5, metadata={"help": "Percent of train_file held out for evaluation when there is no validation_file."})
    block_size: int = field(default=64, metadata={"help": "Tokens per training sequence."})
    max_train_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the training set."})
    max_eval_samples: Optional[int] = field(default=None, metadata={"help": "Truncate the evaluation set."})


def parse_args(argv: Optional[list[str]] = None) -> tuple[ModelArguments, DataTrainingArguments, TrainingArguments]:
    """Model, data and training arguments from the command line (or one JSON file), with bundled defaults."""
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, TrainingArguments))
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) == 1 and argv[0].endswith(".json"):
        model_args, data_args, training_args = parser.parse_json_file(json_file=argv[0])
    else:
        model_args, data_args, training_args = parser.parse_args_into_dataclasses(args=argv)
    if model_args.model_name_or_path is None and model_args.config_name is None:
        model_args.config_name = str(HERE / "configs" / "tiny_llama_clm.json")
    if model_args.tokenizer_name is None:
        model_args.tokenizer_name = model_args.model_name_or_path or str(HERE / "tiny_tokenizer")
    if data_args.train_file is None:
        data_args.train_file = str(HERE / "data" / "tiny_corpus.txt")
    return model_args, data_args, training_args


def model_source(model_args: ModelArguments) -> object:
    """What the trainer builds: a local model dir (weights loaded) or a config (fresh init)."""
    if model_args.model_name_or_path:
        return model_args.model_name_or_path
    return AutoConfig.from_pretrained(model_args.config_name)


def load_data(data_args: DataTrainingArguments, tokenizer, seed: int) -> tuple:
    """Train / eval datasets of ``block_size`` token blocks, truncated as asked."""
    train, evaluation = build_datasets(data_args.train_file, tokenizer, block_size=data_args.block_size,
                                       validation_split_percentage=data_args.validation_split_percentage, seed=seed,
                                       validation_file=data_args.validation_file)
    if data_args.max_train_samples is not None:
        train = train.select(range(min(len(train), data_args.max_train_samples)))
    if data_args.max_eval_samples is not None:
        evaluation = evaluation.select(range(min(len(evaluation), data_args.max_eval_samples)))
    return train, evaluation


def main(argv: Optional[list[str]] = None) -> dict:
    """Train, save the consolidated model, evaluate; returns the metrics."""
    model_args, data_args, training_args = parse_args(argv)
    set_seed(training_args.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_args.tokenizer_name)
    with training_args.main_process_first(desc="dataset map"):
        train_ds, eval_ds = load_data(data_args, tokenizer, training_args.seed)

    trainer = XlaFsdpTrainer(
        model=model_source(model_args), args=training_args, train_dataset=train_ds, eval_dataset=eval_ds,
        processing_class=tokenizer, data_collator=default_data_collator)

    result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
    metrics = dict(result.metrics, train_samples=len(train_ds))
    trainer.log_metrics("train", metrics)
    trainer.save_metrics("train", metrics)

    eval_metrics = trainer.evaluate()
    eval_metrics["eval_samples"] = len(eval_ds)
    eval_metrics["perplexity"] = math.exp(min(eval_metrics["eval_loss"], 100.0))
    trainer.log_metrics("eval", eval_metrics)
    trainer.save_metrics("eval", eval_metrics)

    trainer.save_model()  # every rank's shard streamed into one safetensors model in output_dir
    trainer.save_state()
    card = {"dataset": Path(data_args.train_file).stem, "finetuned_from": model_args.model_name_or_path}
    if training_args.push_to_hub:
        trainer.push_to_hub(**card)
    else:
        trainer.create_model_card(**card)
    return {**metrics, **eval_metrics}


if __name__ == "__main__":
    main()
