"""Compile-time worker (tests/integration/test_compile_time.py): a fresh process, so the compile caches start empty.

    python shapes_worker.py trainer --buckets true|false --steps N [--eval]   # XlaFsdpTrainer, stock LM collator
    python shapes_worker.py step --cache DIR|auto|none                        # two train steps of a built model

Prints one JSON line: graphs compiled (from step 4 on, and in total), the log lines about new graphs, and the
persistent compilation cache's state and counters with the files in its folder.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import sys
import tempfile

os.environ.setdefault("PJRT_DEVICE", "CPU")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

LENGTHS = [8 + 5 * i for i in range(40)]  # 40 distinct text lengths, 8 .. 203 tokens
VOCAB = 128


class Lines(logging.Handler):
    """Keeps the messages of hf_xla_fsdp's loggers."""

    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(f"{record.levelname} {record.getMessage()}")


def word_tokenizer(padding_side: str = "right"):
    """A word-level tokenizer over ``w0 .. w125`` with a pad token, built in memory."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<unk>": 1, **{f"w{i}": i + 2 for i in range(VOCAB - 2)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", padding_side=padding_side)


def varied_texts(n: int, seed: int = 0) -> list[dict]:
    """``n`` tokenized texts, lengths cycling through LENGTHS in a shuffled order."""
    rng = random.Random(seed)
    tok = word_tokenizer()
    lengths = [LENGTHS[i % len(LENGTHS)] for i in range(n)]
    rng.shuffle(lengths)
    return [{"input_ids": tok(" ".join(f"w{rng.randrange(VOCAB - 2)}" for _ in range(k)))["input_ids"]}
            for k in lengths]


def trainer(args: argparse.Namespace, out: str) -> dict:
    import torch_xla
    from transformers import DataCollatorForLanguageModeling, LlamaConfig, TrainerCallback, TrainingArguments

    from hf_xla_fsdp.integrations.trainer import XlaFsdpTrainer
    from hf_xla_fsdp.session import shapes

    marks: dict[int, int] = {}

    class Marks(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            marks[state.global_step + 1] = shapes.compile_count()

    config = LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=256)
    targs = TrainingArguments(out, per_device_train_batch_size=2, per_device_eval_batch_size=2, max_steps=args.steps,
                              learning_rate=1e-3, fsdp="full_shard", report_to=[], save_strategy="no",
                              fsdp_config={"xla": True, "pad_to_buckets": args.buckets, "compilation_cache_dir": "none"},
                              logging_steps=args.steps, seed=0, disable_tqdm=True, dataloader_drop_last=True)
    data = varied_texts(2 * args.steps)
    run = XlaFsdpTrainer(config, targs, train_dataset=data, eval_dataset=data[:2 * args.eval_batches] or None,
                         data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False), callbacks=[Marks()])
    lengths: dict[str, set] = {"train": set(), "eval": set()}
    phase = ["train"]

    def seen(module, args, kwargs):  # the token lengths the model is called with
        if kwargs.get("input_ids") is not None:
            lengths[phase[0]].add(int(kwargs["input_ids"].shape[1]))

    run.model.register_forward_pre_hook(seen, with_kwargs=True)
    run.train()
    torch_xla.sync()
    after_train = shapes.compile_count()
    result = {"graphs_total": after_train, "graphs_after_step_3": after_train - marks.get(4, after_train),
              "marks": marks}
    if args.eval_batches:
        phase[0] = "eval"
        result["eval_loss"] = run.evaluate()["eval_loss"]
        result["graphs_in_eval"] = shapes.compile_count() - after_train
        run.predict(data[-2 * args.eval_batches:])
        second = shapes.compile_count()
        result["eval_loss_again"] = run.evaluate()["eval_loss"]
        result["graphs_in_second_eval"] = shapes.compile_count() - second
    result["lengths"] = {k: sorted(v) for k, v in lengths.items()}
    return result


def step(args: argparse.Namespace, out: str) -> dict:
    """Two AdamW steps of a tiny Llama built and wrapped by a session (the cache is set up in setup_runtime)."""
    import torch
    import torch_xla
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.session import XlaFsdpSession, compile_cache

    session = XlaFsdpSession(XlaFsdpPlugin(compilation_cache_dir=args.cache))
    torch.manual_seed(0)
    model = session.build_model(LlamaConfig(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                            num_attention_heads=2, num_key_value_heads=1), progress=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    ids = torch.arange(32).reshape(2, 16).to(torch_xla.device())
    for _ in range(2):
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        compile_cache.check()
    state = compile_cache.summary()
    folder = state["path"]
    state["files"] = sorted(f for f in os.listdir(folder) if f.isdigit()) if folder else []
    state["loss"] = float(loss.item())
    return state


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("mode", choices=("trainer", "step"))
    parser.add_argument("--buckets", default="true")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--eval-batches", type=int, default=0)
    parser.add_argument("--cache", default="none")
    args = parser.parse_args()
    lines = Lines()
    logging.getLogger("hf_xla_fsdp").addHandler(lines)
    logging.getLogger("hf_xla_fsdp").setLevel(logging.INFO)
    with tempfile.TemporaryDirectory() as out:
        result = trainer(args, out) if args.mode == "trainer" else step(args, out)
    result["log"] = lines.lines
    print(json.dumps(result), flush=True)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
