"""Compile time across runs and shapes: the persistent compilation cache, and bucketed batch lengths.

    python benchmarks/compile_shapes.py --steps 16
    python benchmarks/compile_shapes.py --smoke      # 4 steps: checks the script runs

Every figure comes from a fresh process (the compile caches start empty) running ``XlaFsdpTrainer`` on a tiny
Llama (hidden 64, 2 layers, max 256 positions) with transformers' stock ``DataCollatorForLanguageModeling`` and
texts of 40 different lengths (8 to 200 tokens), batch 4:

* ``buckets``: graphs compiled from step 4 on, with ``pad_to_buckets: false`` (the reference: each batch padded
  to its own longest text) and with the default buckets (powers of two from 64: at most 64, 128, 256);
* ``cache``: the same bucketed run without a persistent cache (reference: the ``buckets`` run with buckets, when
  both halves run), then twice on one fresh ``compilation_cache_dir`` (cold, then warm): compile seconds
  (torch_xla's ``CompileTime``), the graphs compiled, and the cache counters. On a runtime that loads cached
  executables the warm run has hits and compiles nothing; on one that cannot (torch_xla 2.9 on XLA:CPU and TPU,
  pytorch/xla#9094) every warm lookup finds its graph by hash (``misses == 0``, the graph hashes are stable across
  processes) and fails to load it.

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path
from typing import Any

from _harness import add_smoke_flag, emit, run_json_child

LENGTHS = [8 + 5 * i for i in range(40)]  # 8 .. 203 tokens, 40 distinct lengths
MODEL = {"vocab_size": 128, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256}


def word_tokenizer() -> Any:
    """A word-level tokenizer over ``w0 .. w125`` with a pad token (built in memory: no download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(MODEL["vocab_size"] - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>")


def varied_texts(n: int, seed: int = 0) -> list[dict[str, list[int]]]:
    """``n`` tokenized texts whose lengths cycle through LENGTHS in a shuffled order."""
    rng = random.Random(seed)
    tok = word_tokenizer()
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(n)]
    rng.shuffle(lengths)
    texts = [" ".join(f"w{rng.randrange(MODEL['vocab_size'] - 2)}" for _ in range(k)) for k in lengths]
    return [{"input_ids": tok(t)["input_ids"]} for t in texts]


def train_child(args: argparse.Namespace) -> dict[str, Any]:
    """One XlaFsdpTrainer run; graphs and compile seconds, from step 4 on and in total."""
    import torch_xla.debug.metrics as met
    from transformers import DataCollatorForLanguageModeling, LlamaConfig, TrainerCallback, TrainingArguments

    from hf_xla_fsdp.integrations.trainer import XlaFsdpTrainer
    from hf_xla_fsdp.session import compile_cache, shapes

    marks: dict[int, int] = {}

    class Marks(TrainerCallback):
        def on_step_begin(self, a: Any, state: Any, control: Any, **kw: Any) -> None:
            marks[state.global_step + 1] = shapes.compile_count()

    tok = word_tokenizer()
    fsdp_config = {"xla": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                   "pad_to_buckets": args.buckets, "compilation_cache_dir": args.cache}
    targs = TrainingArguments(args.out, per_device_train_batch_size=4, max_steps=args.steps, learning_rate=1e-3,
                              fsdp="full_shard", fsdp_config=fsdp_config, report_to=[], save_strategy="no",
                              logging_steps=args.steps, seed=0, disable_tqdm=True, dataloader_drop_last=True)
    trainer = XlaFsdpTrainer(LlamaConfig(**MODEL), targs, train_dataset=varied_texts(4 * args.steps),
                             data_collator=DataCollatorForLanguageModeling(tok, mlm=False), callbacks=[Marks()])
    trainer.train()
    import torch_xla

    torch_xla.sync()
    total = shapes.compile_count()
    compile_time = met.metric_data("CompileTime")
    return {"graphs_total": total, "graphs_after_step_3": total - marks.get(4, total),
            # the last step's batch, then the Trainer's first logging and end-of-training graphs (no input shapes)
            "graphs_from_last_step_on": total - marks.get(args.steps, total),
            "graphs_before_each_step": marks,
            "compile_seconds": round(compile_time[1] / 1e9, 2) if compile_time else 0.0,
            "cache": compile_cache.summary()}


def child(args: argparse.Namespace) -> None:
    """Run in a fresh process; print one JSON line."""
    with tempfile.TemporaryDirectory() as out:
        args.out = out
        emit(train_child(args))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--buckets", default="true", help=argparse.SUPPRESS)
    parser.add_argument("--cache", default="none", help=argparse.SUPPRESS)
    parser.add_argument("--only", choices=("buckets", "cache"), default=None, help="run one half only")
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.smoke:
        args.steps = 4  # the fewest with a step 4, from which graphs are counted
    if args.child:
        child(args)
        return
    me = Path(__file__).resolve()

    def run(name: str, buckets: str, cache: str) -> dict[str, Any]:
        return run_json_child([me, "--child", "--steps", args.steps, "--buckets", buckets, "--cache", cache],
                              name=name, env={"CPU_NUM_DEVICES": "1", "TOKENIZERS_PARALLELISM": "false"})

    result: dict[str, Any] = {"smoke": args.smoke, "steps": args.steps, "batch": 4, "text_lengths": len(LENGTHS), "model": MODEL,
                              "python": sys.version.split()[0]}
    if args.only in (None, "buckets"):
        off = run("buckets off", "false", "none")
        on = run("buckets on", "true", "none")
        result["buckets"] = {"off": off, "on": on}
    if args.only in (None, "cache"):
        with tempfile.TemporaryDirectory() as cache_dir:
            # the same run as "buckets on" (same data, buckets, no cache): not paid twice
            ref = result["buckets"]["on"] if "buckets" in result else run("no cache", "true", "none")
            cold = run("cold cache", "true", cache_dir)
            warm = run("warm cache", "true", cache_dir)
            files = sorted(os.listdir(cache_dir))
        result["cache"] = {"no_cache": ref, "cold": cold, "warm": warm, "files": len([f for f in files if f.isdigit()]),
                           "warm_found_every_graph": warm["cache"]["PersistentCacheMiss"] == 0}
    emit(result)


if __name__ == "__main__":
    main()
