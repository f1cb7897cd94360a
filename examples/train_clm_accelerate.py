"""Causal-LM training with accelerate and XLA FSDP, in the style of accelerate's run_clm_no_trainer.

    accelerate launch --config_file examples/xla_fsdp.yaml examples/train_clm_accelerate.py --output_dir OUT

The FSDP settings come from the YAML's fsdp_config (read by XlaFsdpAccelerator); with no model or
data arguments the bundled tiny Llama config, tokenizer and corpus are used. Writes sharded
checkpoints (OUT/step_N), a consolidated model (OUT/final) and OUT/results.json.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

import torch
from accelerate.utils import set_seed
from clm_data import build_datasets
from torch.utils.data import DataLoader
from tqdm.auto import tqdm
from transformers import AutoTokenizer, default_data_collator, get_scheduler

from hf_xla_fsdp import XlaFsdpAccelerator
from hf_xla_fsdp.engines import fsdp_units, unwrap

HERE = Path(__file__).resolve().parent


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config_name", default=str(HERE / "configs" / "tiny_llama_clm.json"),
                   help="model config.json, or a local model dir (then its weights are loaded)")
    p.add_argument("--tokenizer_name", default=str(HERE / "tiny_tokenizer"))
    p.add_argument("--train_file", default=str(HERE / "data" / "tiny_corpus.txt"))
    p.add_argument("--validation_split_percentage", type=int, default=5)
    p.add_argument("--block_size", type=int, default=64)
    p.add_argument("--per_device_train_batch_size", type=int, default=8)
    p.add_argument("--per_device_eval_batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--max_train_steps", type=int, default=100)
    p.add_argument("--gradient_accumulation_steps", type=int, default=1)
    p.add_argument("--lr_scheduler_type", default="linear")
    p.add_argument("--num_warmup_steps", type=int, default=10)
    p.add_argument("--max_grad_norm", type=float, default=1.0)
    p.add_argument("--checkpointing_steps", type=int, default=None, help="save a sharded checkpoint every N steps")
    p.add_argument("--resume_from_checkpoint", default=None)
    p.add_argument("--max_eval_batches", type=int, default=8)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--push_to_hub", action="store_true", help="export OUT/final with a model card and push it")
    p.add_argument("--hub_model_id", default=None, help="ORG/NAME for --push_to_hub")
    return p.parse_args(argv)


@torch.no_grad()
def evaluate(model, dataloader, max_batches: int) -> float:
    """Mean eval loss over the first ``max_batches`` batches."""
    model.eval()
    losses = [model(**batch).loss for i, batch in zip(range(max_batches), dataloader)]
    model.train()
    return float(torch.stack([loss.detach().cpu() for loss in losses]).mean())


def evaluate_consolidated(path: Path, eval_ds, args: argparse.Namespace) -> float:
    """Eval loss of the consolidated model loaded with from_pretrained, on the host, same batches."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path)
    loader = DataLoader(eval_ds, batch_size=args.per_device_eval_batch_size, collate_fn=default_data_collator,
                        drop_last=True)
    return evaluate(model, loader, args.max_eval_batches)


def describe(model) -> dict:
    """The FSDP structure inside this process (what the YAML asked for)."""
    units = {name: unit for name, unit in fsdp_units(model)}
    return {"units": list(units), "num_units": len(units),
            # FSDP forwards attribute lookups to the module it wraps: look in each module's own __dict__
            "checkpointed_blocks": sum("_xla_checkpointed_forward_original" in m.__dict__ for m in model.modules()),
            "compute_dtype": str(getattr(next(iter(units.values())), "compute_dtype", None) or torch.float32),
            "model": type(unwrap(model)).__name__}


def log(accelerator, message: str) -> None:
    """Print on the main process (accelerate's own print keys on the local ordinal, which XLA:CPU leaves unset)."""
    if accelerator.is_main_process:
        print(message, flush=True)


def main() -> None:
    sys.stdout.reconfigure(line_buffering=True)  # xmp.spawn workers may exit without flushing
    args = parse_args()
    accelerator = XlaFsdpAccelerator(gradient_accumulation_steps=args.gradient_accumulation_steps)
    set_seed(args.seed)
    out = Path(args.output_dir)
    if accelerator.is_main_process:
        out.mkdir(parents=True, exist_ok=True)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_name)
    with accelerator.main_process_first():
        train_ds, eval_ds = build_datasets(args.train_file, tokenizer, block_size=args.block_size,
                                           validation_split_percentage=args.validation_split_percentage, seed=args.seed)
    train_dl = DataLoader(train_ds, batch_size=args.per_device_train_batch_size, collate_fn=default_data_collator,
                          drop_last=True)
    eval_dl = DataLoader(eval_ds, batch_size=args.per_device_eval_batch_size, collate_fn=default_data_collator,
                         drop_last=True)

    model = accelerator.build_model(args.config_name)  # meta skeleton, block by block, per the YAML
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.learning_rate, weight_decay=args.weight_decay)
    scheduler = get_scheduler(args.lr_scheduler_type, optimizer, num_warmup_steps=args.num_warmup_steps,
                              num_training_steps=args.max_train_steps)
    model, optimizer, train_dl, eval_dl, scheduler = accelerator.prepare(model, optimizer, train_dl, eval_dl, scheduler)
    if accelerator.is_main_process:
        (out / "fsdp_structure.json").write_text(json.dumps(describe(model), indent=2))

    completed, losses = 0, {}
    if args.resume_from_checkpoint:
        info = accelerator.load_state(args.resume_from_checkpoint)
        completed, losses = info["step"], {int(k): v for k, v in info["extra"].get("losses", {}).items()}
        log(accelerator, f"resumed from {args.resume_from_checkpoint} at step {completed}")
    steps_per_epoch = len(train_dl) // args.gradient_accumulation_steps
    initial_eval = evaluate(model, eval_dl, args.max_eval_batches) if completed == 0 else None

    bar = tqdm(total=args.max_train_steps, initial=completed, desc="train", disable=not accelerator.is_main_process)
    while completed < args.max_train_steps:
        epoch, skip = divmod(completed, steps_per_epoch)
        loader = accelerator.skip_first_batches(train_dl, skip * args.gradient_accumulation_steps) if skip else train_dl
        for batch in loader:
            with accelerator.accumulate(model):
                loss = model(**batch).loss
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.max_grad_norm)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if not accelerator.sync_gradients:
                continue
            completed += 1
            losses[completed] = loss.item()
            bar.update(1)
            bar.set_postfix(loss=f"{losses[completed]:.3f}", epoch=epoch)
            if args.checkpointing_steps and completed % args.checkpointing_steps == 0:
                accelerator.save_state(out / f"step_{completed}", step=completed, extra={"losses": losses})
            if completed >= args.max_train_steps:
                break
    bar.close()

    eval_loss = evaluate(model, eval_dl, args.max_eval_batches)
    log(accelerator, f"eval loss {eval_loss:.4f}  perplexity {math.exp(eval_loss):.2f}")
    accelerator.save_model(model, out / "final", extra={"losses": losses, "eval_loss": eval_loss,
                                                        "eval_dataset": Path(args.train_file).stem}, step=completed)
    if accelerator.is_main_process:
        tokenizer.save_pretrained(out / "final")
        final_eval_loss = evaluate_consolidated(out / "final", eval_ds, args)
        log(accelerator, f"consolidated model ({out / 'final'}): eval loss {final_eval_loss:.4f} (fp32, CPU)")
        (out / "results.json").write_text(json.dumps({
            "initial_eval_loss": initial_eval, "eval_loss": eval_loss, "perplexity": math.exp(eval_loss),
            "final_eval_loss": final_eval_loss,
            "losses": losses, "steps": completed, "max_eval_batches": args.max_eval_batches,
            "eval_batch_size": args.per_device_eval_batch_size, "block_size": args.block_size}, indent=2))
    if args.push_to_hub and accelerator.is_main_process:
        from hf_xla_fsdp import PushError, export

        try:
            result = export(out / "final", out / "hub", repo_id=args.hub_model_id, push=True, overwrite=True)
            log(accelerator, f"pushed to {result['pushed']}")
        except PushError as err:
            log(accelerator, f"push failed: {err}")
            raise SystemExit(3) from None
    accelerator.end_training()


if __name__ == "__main__":
    main()
