"""PyTorch/XLA's ImageNet FSDP example (test_train_mp_imagenet_fsdp.py), Hugging Face style.

transformers' ``ResNetForImageClassification`` (ResNet-50 by default) or ``ViTForImageClassification``
is built on meta and sharded block by block with XLA FSDP; the data is an ``imagefolder`` tree
(``DATADIR/train/<class>/*.png``, ``DATADIR/validation/<class>/*.png``) read with ``datasets``.
The learning-rate schedule is the original's: linear warm-up, then divide by ``--lr_scheduler_divisor``
every ``--lr_scheduler_divide_every_n_epochs`` epochs; top-1 accuracy every ``--eval_interval`` epochs.

    # XLA:CPU, a small image folder made from the digits, a tiny ResNet, a few steps:
    python examples/image_data.py --make_imagefolder /tmp/digits_imagefolder
    python examples/image_classification_fsdp.py --datadir /tmp/digits_imagefolder --model resnet-tiny \\
        --image_size 32 --batch_size 16 --num_epochs 1 --max_steps 20 \\
        --use_nested_fsdp --use_gradient_checkpointing --compute_dtype bfloat16
    # TPU VM, ImageNet in imagefolder layout, ResNet-50 as in the original:
    PJRT_DEVICE=TPU python examples/image_classification_fsdp.py --datadir /data/imagenet --model resnet50 \\
        --batch_size 128 --test_set_batch_size 64 --num_epochs 100 --lr 0.4 --momentum 0.9 \\
        --num_warmup_epochs 5 --lr_scheduler_divide_every_n_epochs 30 --lr_scheduler_divisor 10 \\
        --eval_interval 10 --use_nested_fsdp --use_gradient_checkpointing --compute_dtype bfloat16
"""

from __future__ import annotations

import argparse
import time

import torch

IMAGENET_MEAN, IMAGENET_STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The original example's flags (plus --model choices from transformers, --max_steps, --seed)."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--datadir", required=True, help="imagefolder tree with train/ and validation/ splits")
    p.add_argument("--model", default="resnet50", choices=["resnet50", "vit-base", "resnet-tiny", "vit-tiny"])
    p.add_argument("--config_name", default=None, help="a config.json to use instead of --model")
    p.add_argument("--image_size", type=int, default=224)
    p.add_argument("--batch_size", type=int, default=128)
    p.add_argument("--test_set_batch_size", type=int, default=64)
    p.add_argument("--num_epochs", type=int, default=100)
    p.add_argument("--max_steps", type=int, default=None, help="stop after this many optimizer steps")
    p.add_argument("--lr", type=float, default=0.4)
    p.add_argument("--momentum", type=float, default=0.9)
    p.add_argument("--weight_decay", type=float, default=1e-4)
    p.add_argument("--num_warmup_epochs", type=float, default=5)
    p.add_argument("--lr_scheduler_divide_every_n_epochs", type=int, default=30)
    p.add_argument("--lr_scheduler_divisor", type=float, default=10)
    p.add_argument("--eval_interval", type=int, default=1, help="evaluate every N epochs (and after the last)")
    p.add_argument("--log_steps", type=int, default=20)
    p.add_argument("--num_workers", type=int, default=0)
    p.add_argument("--use_nested_fsdp", action="store_true")
    p.add_argument("--use_gradient_checkpointing", action="store_true")
    p.add_argument("--compute_dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--fp32_reduce_scatter", action="store_true")
    p.add_argument("--flatten_parameters", action="store_true")
    p.add_argument("--shard_param_on_dim_0", action="store_true")
    p.add_argument("--ckpt_prefix", default=None, help="save a sharded checkpoint here at the end")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--output_json", default=None)
    return p.parse_args(argv)


def model_config(args: argparse.Namespace, labels: list[str]):
    """The transformers config for ``--model`` (or ``--config_name``) with this data set's labels."""
    from transformers import AutoConfig, ResNetConfig, ViTConfig

    common = dict(num_labels=len(labels), id2label=dict(enumerate(labels)), label2id={name: i for i, name in enumerate(labels)})
    if args.config_name:
        return AutoConfig.from_pretrained(args.config_name, **common)
    if args.model == "resnet50":  # transformers' defaults are ResNet-50
        return ResNetConfig(architectures=["ResNetForImageClassification"], **common)
    if args.model == "resnet-tiny":
        return ResNetConfig(embedding_size=16, hidden_sizes=[32, 64], depths=[1, 1], layer_type="basic",
                            downsample_in_first_stage=False, architectures=["ResNetForImageClassification"], **common)
    if args.model == "vit-base":  # transformers' defaults are ViT-B/16
        return ViTConfig(image_size=args.image_size, architectures=["ViTForImageClassification"], **common)
    return ViTConfig(image_size=args.image_size, patch_size=4, hidden_size=64, num_hidden_layers=2,
                     num_attention_heads=4, intermediate_size=128, architectures=["ViTForImageClassification"], **common)


def load_data(args: argparse.Namespace):
    """The imagefolder splits as tensors-on-the-fly: RGB, resized, ImageNet-normalized."""
    import numpy as np
    from datasets import load_dataset
    from PIL import Image

    ds = load_dataset("imagefolder", data_dir=args.datadir)
    if "train" not in ds or "validation" not in ds:
        raise SystemExit(f"{args.datadir} needs train/ and validation/ sub-folders (found: {', '.join(ds)})")
    mean, std = torch.tensor(IMAGENET_MEAN)[:, None, None], torch.tensor(IMAGENET_STD)[:, None, None]

    def transform(batch: dict) -> dict:
        pixels = [torch.from_numpy(np.asarray(img.convert("RGB").resize((args.image_size, args.image_size),
                                                                           Image.BILINEAR), dtype=np.float32))
                  for img in batch["image"]]
        x = torch.stack(pixels).permute(0, 3, 1, 2) / 255.0
        return {"pixel_values": (x - mean) / std, "labels": torch.tensor(batch["label"])}

    return ds["train"].with_transform(transform), ds["validation"].with_transform(transform), \
        ds["train"].features["label"].names


def lr_lambda(args: argparse.Namespace, steps_per_epoch: int):
    """Linear warm-up, then divide by the divisor every n epochs (the original's WarmupAndExponentialDecay)."""
    warmup = args.num_warmup_epochs * steps_per_epoch

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return args.lr_scheduler_divisor ** -((step // steps_per_epoch) // args.lr_scheduler_divide_every_n_epochs)
    return factor


def train_imagenet(index: int, args: argparse.Namespace) -> dict:
    """Train with periodic evaluation; returns losses, accuracies and timings (rank 0's view)."""
    import torch_xla.core.xla_model as xm
    import torch_xla.distributed.parallel_loader as pl
    import torch_xla.runtime as xr
    from torch.utils.data import DataLoader, DistributedSampler

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.checkpoint import save_checkpoint
    from hf_xla_fsdp.train import xla_device

    torch.manual_seed(args.seed)
    train_ds, val_ds, labels = load_data(args)
    world, rank = xr.world_size(), xr.global_ordinal()
    loaders = {}
    for name, ds, bs, shuffle in (("train", train_ds, args.batch_size, True), ("val", val_ds, args.test_set_batch_size, False)):
        sampler = DistributedSampler(ds, num_replicas=world, rank=rank, shuffle=shuffle, seed=args.seed, drop_last=True)
        loaders[name] = DataLoader(ds, batch_size=bs, sampler=sampler, drop_last=True, num_workers=args.num_workers)
    device = xla_device()
    plugin = XlaFsdpPlugin(
        sharding="zero3" if args.use_nested_fsdp else "zero2", activation_checkpointing=args.use_gradient_checkpointing,
        compute_dtype=args.compute_dtype, fp32_reduce_scatter=args.fp32_reduce_scatter,
        flatten_parameters=args.flatten_parameters, shard_param_on_dim_0=args.shard_param_on_dim_0)
    model = plugin.build(model_config(args, labels), progress=rank == 0)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum, weight_decay=args.weight_decay,
                                nesterov=args.momentum > 0)
    steps_per_epoch = max(1, len(loaders["train"]))
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda(args, steps_per_epoch))
    results = {"model": args.config_name or args.model, "world_size": world, "losses": {}, "accuracy": {},
               "plugin": plugin.to_dict()}
    step, start = 0, time.perf_counter()

    def evaluate(epoch: int) -> None:
        model.eval()
        correct, total = torch.zeros((), device=device), 0
        with torch.no_grad():
            for batch in pl.MpDeviceLoader(loaders["val"], device):
                correct += (model(pixel_values=batch["pixel_values"]).logits.argmax(-1) == batch["labels"]).sum()
                total += batch["labels"].shape[0]
        acc = xm.mesh_reduce("top1", (correct.item(), total), lambda v: tuple(map(sum, zip(*v))))
        results["accuracy"][epoch] = acc[0] / max(1, acc[1])
        if rank == 0:
            print(f"epoch {epoch} top-1 accuracy {results['accuracy'][epoch]:.4f}", flush=True)
        model.train()

    for epoch in range(1, args.num_epochs + 1):
        loaders["train"].sampler.set_epoch(epoch)
        for batch in pl.MpDeviceLoader(loaders["train"], device):  # marks a step after each batch
            loss = model(**batch).loss
            loss.backward()
            optimizer.step()  # FSDP reduce-scattered the gradients already: no xm.optimizer_step
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            if step % args.log_steps == 0 or step == args.max_steps:
                results["losses"][step] = loss.item()
                if rank == 0:
                    print(f"epoch {epoch} step {step} loss {results['losses'][step]:.4f} "
                          f"lr {scheduler.get_last_lr()[0]:.4g}", flush=True)
            if args.max_steps and step >= args.max_steps:
                break
        last = epoch == args.num_epochs or (args.max_steps and step >= args.max_steps)
        if epoch % args.eval_interval == 0 or last:
            evaluate(epoch)
        if last:
            break
    results.update(steps=step, train_seconds=round(time.perf_counter() - start, 1))
    if args.ckpt_prefix:
        save_checkpoint(args.ckpt_prefix, model, optimizer, scheduler, step=step, plugin=plugin,
                        extra={"top1": results["accuracy"]})
        results["checkpoint"] = args.ckpt_prefix
    return results


def main() -> None:
    """One process per XLA device (one on XLA:CPU), as the original; rank 0 prints the results as JSON."""
    from image_data import spawn_and_report

    spawn_and_report(train_imagenet, parse_args())


if __name__ == "__main__":
    main()
