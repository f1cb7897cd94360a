"""Quick start, end to end on the CPU: build a tiny Llama layer by layer on meta, wrap it with
nested FSDP from a transformers-style fsdp_config JSON, train it, save sharded rank
checkpoints, consolidate them into a safetensors model, load that with from_pretrained, and
check it evaluates and generates exactly like the trained FSDP model.

    python examples/quickstart.py --output_dir runs/quickstart          # XLA FSDP v1 on XLA:CPU
    python examples/quickstart.py --output_dir runs/quickstart --resume_from_checkpoint runs/quickstart/checkpoint-100
    # engine fsdp2 (torch's FSDP2, no torch_xla needed) on 2 processes: `make quickstart-fsdp2`, i.e.
    hf-xla-fsdp launch --num_processes 2 examples/quickstart.py --output_dir runs/quickstart-fsdp2 \
        --fsdp_config examples/fsdp2_config.json

Each process of an engine with one process per device (fsdp2) trains on its rows of every batch.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from hf_xla_fsdp import XlaFsdpPlugin
from hf_xla_fsdp.checkpoint import load_checkpoint, save_checkpoint
from hf_xla_fsdp.checkpoint.consolidate import consolidate
from hf_xla_fsdp.engines import unwrap
from hf_xla_fsdp.train import (
    arithmetic_lm_batches,
    device_of,
    evaluate,
    is_main_process,
    perplexity,
    process_rows,
    to_device,
    train_step,
)

HERE = Path(__file__).resolve().parent


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model_config", default=str(HERE / "configs" / "tiny_llama.json"))
    p.add_argument("--fsdp_config", default=str(HERE / "xla_fsdp_config.json"))
    p.add_argument("--output_dir", required=True)
    p.add_argument("--max_train_steps", type=int, default=200)
    p.add_argument("--save_steps", type=int, default=100, help="save a sharded checkpoint every N steps")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--seq_len", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=1e-2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--skip_consolidation", action="store_true")
    return p.parse_args()


def eval_batches(vocab: int, args: argparse.Namespace) -> list[dict[str, torch.Tensor]]:
    return [next(arithmetic_lm_batches(vocab, args.seq_len, args.batch_size, seed=10_000 + i)) for i in range(4)]


def main() -> None:
    args = parse_args()
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(args.seed)
    plugin = XlaFsdpPlugin.from_fsdp_config(args.fsdp_config)
    model = plugin.build(args.model_config)  # meta skeleton -> block by block: init, wrap, shard
    device = device_of(model)
    main_process = is_main_process(model)
    say = print if main_process else (lambda *a, **k: None)  # one process speaks for all
    vocab = unwrap(model).config.vocab_size
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: min(1.0, (s + 1) / 10))
    evals = eval_batches(vocab, args)
    losses: dict[int, float] = {}
    start_step = 0
    if args.resume_from_checkpoint:
        state = load_checkpoint(args.resume_from_checkpoint, model, optimizer, scheduler)
        start_step, losses = state["step"], {int(k): v for k, v in state["extra"].get("losses", {}).items()}
        say(f"resumed from {args.resume_from_checkpoint} at step {start_step}", flush=True)
    data = arithmetic_lm_batches(vocab, args.seq_len, args.batch_size, seed=args.seed)
    for _ in range(start_step):  # the same batches in the same order as an uninterrupted run
        next(data)

    initial = evaluate(model, evals, device)
    say(f"eval loss at step {start_step}: {initial:.4f} (perplexity {perplexity(initial):.1f})", flush=True)
    start = time.perf_counter()
    for step in range(start_step + 1, args.max_train_steps + 1):
        loss = train_step(model, to_device(process_rows(next(data), model), device), optimizer, scheduler=scheduler)
        losses[step] = loss.item()
        if step % 10 == 0 or step == args.max_train_steps:
            say(f"step {step:4d}  loss {losses[step]:.4f}", flush=True)
        if step % args.save_steps == 0 or step == args.max_train_steps:
            ckpt = save_checkpoint(out / f"checkpoint-{step}", model, optimizer, scheduler, step=step,
                                   plugin=plugin, extra={"losses": losses})
            say(f"saved sharded checkpoint {ckpt}", flush=True)
    seconds = time.perf_counter() - start
    final = evaluate(model, evals, device)
    say(f"eval loss after {args.max_train_steps} steps: {final:.4f} (perplexity {perplexity(final):.2f})", flush=True)
    summary = {"eval_loss_start": initial, "eval_loss_final": final, "train_seconds": round(seconds, 2),
               "steps": args.max_train_steps, "losses": losses, "plugin": plugin.to_dict()}

    if not args.skip_consolidation and main_process:  # the files are every process's; one process consolidates
        from transformers import AutoModelForCausalLM

        last = out / f"checkpoint-{args.max_train_steps}"
        info = consolidate(last, out / "final", overwrite=True)
        say(f"consolidated {last} into {info['output']} ({len(info['files'])} file(s))", flush=True)
        hf_model, loading = AutoModelForCausalLM.from_pretrained(out / "final", output_loading_info=True)
        problems = {k: v for k, v in loading.items() if v and k != "error_msgs"}
        if problems:
            raise SystemExit(f"from_pretrained reported {problems}")
        hf_loss = evaluate(hf_model.to(device), evals, device)
        prompt = torch.tensor([[5, 8, 11, 14]])
        generated = hf_model.generate(prompt.to(device), max_new_tokens=6, do_sample=False, pad_token_id=0)
        say(f"from_pretrained(final): eval loss {hf_loss:.4f}; greedy continuation of 5 8 11 14: "
              f"{generated[0, 4:].tolist()}", flush=True)
        summary.update(consolidated_eval_loss=hf_loss, generated=generated[0].tolist())
    if main_process:
        (out / "quickstart_results.json").write_text(json.dumps(summary, indent=2))
    if not final < initial and start_step == 0:
        raise SystemExit("training did not lower the eval loss")


if __name__ == "__main__":
    main()
