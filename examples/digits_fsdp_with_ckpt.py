"""PyTorch/XLA's MNIST FSDP example (test_train_mp_mnist_fsdp_with_ckpt.py), Hugging Face style.

A small ResNet from transformers (``ResNetForImageClassification``) is built on meta and sharded
block by block with nested XLA FSDP, trained on handwritten digits, saved as sharded rank
checkpoints, consolidated into a safetensors model, reloaded with ``from_pretrained`` and checked
to give the same test accuracy as the sharded model.

    # XLA:CPU, scikit-learn's 8x8 digits (shipped with the package), about a minute:
    python examples/digits_fsdp_with_ckpt.py --batch_size 64 --drop_last --num_epochs 5 \\
        --use_nested_fsdp --use_gradient_checkpointing --ckpt_prefix /tmp/digits-fsdp/final_ckpt
    # TPU VM, MNIST from a local copy of its idx files, one process per chip:
    PJRT_DEVICE=TPU python examples/digits_fsdp_with_ckpt.py --datadir /data/mnist --batch_size 128 \\
        --drop_last --num_epochs 2 --use_nested_fsdp --use_gradient_checkpointing --compute_dtype bfloat16

Differences from the original: AdamW instead of SGD (the ResNet's BatchNorm trains best with it),
a ResNet from transformers instead of a hand-written CNN (so the consolidated model loads with
``from_pretrained``), and the checkpoint is a directory of per-rank safetensors files.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The original example's flags (plus --seed, --image_size, --output_json)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datadir", default=None, help="MNIST idx files; default: scikit-learn's digits")
    p.add_argument("--batch_size", type=int, default=64)
    p.add_argument("--test_set_batch_size", type=int, default=None, help="default: --batch_size")
    p.add_argument("--drop_last", action="store_true", help="drop the last incomplete training batch (no recompiles)")
    p.add_argument("--num_epochs", type=int, default=5)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--weight_decay", type=float, default=0.01)
    p.add_argument("--log_steps", type=int, default=20)
    p.add_argument("--use_nested_fsdp", action="store_true", help="one FSDP unit per block (ZeRO-3), else root only")
    p.add_argument("--use_gradient_checkpointing", action="store_true", help="activation checkpointing per block")
    p.add_argument("--compute_dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--fp32_reduce_scatter", action="store_true")
    p.add_argument("--shard_param_on_dim_0", action="store_true")
    p.add_argument("--flatten_parameters", action="store_true")
    p.add_argument("--ckpt_prefix", default="/tmp/digits-fsdp/final_ckpt",
                   help="sharded checkpoint directory; the consolidated model goes to <prefix>_consolidated")
    p.add_argument("--no_ckpt_consolidation", dest="ckpt_consolidation", action="store_false")
    p.add_argument("--image_size", type=int, default=16, help="digits are resized from 8x8 (MNIST keeps 28)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_json", default=None, help="also write the results here")
    return p.parse_args(argv)


def model_config(num_channels: int):
    """A ResNet small enough for XLA:CPU: 2 stages of basic blocks (74k parameters)."""
    from transformers import ResNetConfig

    return ResNetConfig(num_channels=num_channels, embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1],
                        layer_type="basic", downsample_in_first_stage=False, num_labels=10,
                        architectures=["ResNetForImageClassification"])


def batches(x: torch.Tensor, y: torch.Tensor, batch_size: int, shuffle: bool, drop_last: bool,
            generator: torch.Generator | None = None) -> list[dict[str, torch.Tensor]]:
    """This rank's share of ``(x, y)`` as batches of ``pixel_values`` / ``labels``."""
    import torch_xla.runtime as xr

    order = torch.randperm(len(x), generator=generator) if shuffle else torch.arange(len(x))
    order = order[xr.global_ordinal()::xr.world_size()]
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [{"pixel_values": x[order[i:i + batch_size]], "labels": y[order[i:i + batch_size]]}
            for i in range(0, stop, batch_size)]


def reduce_accuracy(acc: float, count: int) -> float:
    """The accuracy over every rank's test share."""
    import torch_xla.core.xla_model as xm

    correct, total = xm.mesh_reduce("test_accuracy", (acc * count, count), lambda v: tuple(map(sum, zip(*v))))
    return correct / total


def train_digits(rank: int, args: argparse.Namespace) -> dict:
    """Train, checkpoint, consolidate and compare; returns the results (the same on every rank)."""
    import torch_xla.runtime as xr
    from image_data import load_digits_split, load_mnist_split
    from transformers import ResNetForImageClassification

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.checkpoint import save_checkpoint
    from hf_xla_fsdp.checkpoint.consolidate import consolidate
    from hf_xla_fsdp.train import accuracy, train_step, xla_device

    torch.manual_seed(args.seed)
    data = load_mnist_split(args.datadir) if args.datadir else load_digits_split(args.image_size, seed=args.seed)
    master = xr.global_ordinal() == 0
    plugin = XlaFsdpPlugin(
        sharding="zero3" if args.use_nested_fsdp else "zero2", activation_checkpointing=args.use_gradient_checkpointing,
        compute_dtype=args.compute_dtype, fp32_reduce_scatter=args.fp32_reduce_scatter,
        shard_param_on_dim_0=args.shard_param_on_dim_0, flatten_parameters=args.flatten_parameters)
    device = xla_device()
    model = plugin.build(model_config(data["train_x"].shape[1]), progress=False)  # meta, block by block
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
    per_epoch = len(data["train_y"]) // xr.world_size() // args.batch_size + (0 if args.drop_last else 1)
    # linear decay to zero: the last epochs settle instead of hopping between minima
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: max(0.0, 1.0 - s / max(1, per_epoch * args.num_epochs)))
    test = batches(data["test_x"], data["test_y"], args.test_set_batch_size or args.batch_size, False, False)
    gen = torch.Generator().manual_seed(args.seed)
    start, step, history = time.perf_counter(), 0, []
    for epoch in range(1, args.num_epochs + 1):
        for batch in batches(data["train_x"], data["train_y"], args.batch_size, True, args.drop_last, gen):
            loss = train_step(model, {k: v.to(device) for k, v in batch.items()}, optimizer, max_grad_norm=None,
                              scheduler=scheduler)
            step += 1
            if master and step % args.log_steps == 0:
                print(f"epoch {epoch} step {step} loss {loss.item():.4f}", flush=True)
        acc = reduce_accuracy(accuracy(model, test, device)[0], sum(len(b["labels"]) for b in test))
        history.append(acc)
        if master:
            print(f"epoch {epoch} test accuracy {acc:.4f} ({time.perf_counter() - start:.0f} s)", flush=True)
    train_seconds = time.perf_counter() - start

    ckpt = Path(args.ckpt_prefix)
    save_checkpoint(ckpt, model, optimizer, step=step, plugin=plugin, extra={"test_accuracy": history[-1]})
    results = {"dataset": "mnist" if args.datadir else "sklearn_digits", "world_size": xr.world_size(),
               "epochs": args.num_epochs, "steps": step, "train_seconds": round(train_seconds, 1),
               "sharded_test_accuracy": history[-1], "accuracy_per_epoch": history, "checkpoint": str(ckpt),
               "plugin": plugin.to_dict()}
    if args.ckpt_consolidation and master:
        out = Path(f"{args.ckpt_prefix}_consolidated")
        consolidate(ckpt, out, overwrite=True, progress=False)
        full = ResNetForImageClassification.from_pretrained(out)  # fp32, on the host: no FSDP, no XLA
        x, y = data["test_x"], data["test_y"]
        full_acc, _ = accuracy(full, [{"pixel_values": x[i:i + 256], "labels": y[i:i + 256]}
                                      for i in range(0, len(y), 256)], torch.device("cpu"))
        results.update(consolidated=str(out), consolidated_test_accuracy=full_acc,
                       accuracies_match=abs(full_acc - history[-1]) < 0.5 / len(data["test_y"]))
        print(f"checkpoint consolidated into {out}: test accuracy {full_acc:.4f} "
              f"(sharded {history[-1]:.4f})", flush=True)
    return results


def main() -> None:
    """One process per XLA device (one on XLA:CPU), as the original; rank 0 prints the results as JSON."""
    from image_data import spawn_and_report

    spawn_and_report(train_digits, parse_args())


if __name__ == "__main__":
    main()
