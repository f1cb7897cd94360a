"""Quick start: build a tiny Llama layer by layer on meta, wrap it with nested XLA FSDP from a
transformers-style fsdp_config JSON, train it, and report the loss.

    python examples/quickstart.py --output_dir runs/quickstart
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_xla_fsdp import XlaFsdpPlugin
from hf_xla_fsdp.train import arithmetic_lm_batches, evaluate, perplexity, to_device, train_step, xla_device

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_config", default=str(HERE / "configs" / "tiny_llama.json"))
    p.add_argument("--fsdp_config", default=str(HERE / "xla_fsdp_config.json"))
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_train_steps", type=int, default=60)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args()


def main() -> None:
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    plugin = XlaFsdpPlugin.from_fsdp_config(args.fsdp_config)
    model = plugin.build(args.model_config)  # meta skeleton -> block by block: init, wrap, shard
    device = xla_device()
    vocab = model.module.config.vocab_size
    data = arithmetic_lm_batches(vocab, args.seq_len, args.batch_size, seed=args.seed)
    eval_batches = [next(arithmetic_lm_batches(vocab, args.seq_len, args.batch_size, seed=10_000 + i)) for i in range(4)]
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)

    initial = evaluate(model, eval_batches, device)
    print(f"eval loss before training: {initial:.4f} (perplexity {perplexity(initial):.1f})", flush=True)
    start = time.perf_counter()
    for step in range(1, args.max_train_steps + 1):
        loss = train_step(model, to_device(next(data), device), optimizer)
        if step % 10 == 0 or step == args.max_train_steps:
            print(f"step {step:4d}  loss {loss.item():.4f}", flush=True)
    seconds = time.perf_counter() - start
    final = evaluate(model, eval_batches, device)
    print(f"eval loss after {args.max_train_steps} steps: {final:.4f} (perplexity {perplexity(final):.2f})", flush=True)
    summary = {"eval_loss_before": initial, "eval_loss_after": final, "train_seconds": round(seconds, 2),
               "steps": args.max_train_steps, "plugin": plugin.to_dict()}
    (out / "quickstart_results.json").write_text(json.dumps(summary, indent=2))
    if not final < initial:
        raise SystemExit("training did not lower the eval loss")


if __name__ == "__main__":
    main()
