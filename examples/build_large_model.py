"""Recipe for models that fit neither one chip nor one host: Llama-2 7B / 13B / 70B and the ViT-10B of
PyTorch/XLA's FSDP announcement.

1. **Plan** from the meta skeleton alone: units, bytes per rank and, with ``--tpu SLICE``, the memory per
   chip against its HBM with a ``fits`` verdict (``hf-xla-fsdp plan`` does the same).
2. **Build** this process's rank: the skeleton on ``meta``, then each block materialized, initialized,
   wrapped and sharded before the next exists. On a TPU slice every process builds its own rank; on one
   host ``--world_size N`` builds exactly what rank ``--rank`` of N would hold (explicit sharding group).
3. **Train one step** where it can run: on the slice (every rank takes part in the collectives) or with
   ``--world_size 1``; an emulated rank of N > 1 cannot (its all-gathers need the other N-1 ranks).
4. **Save sharded**: with every rank present, a committed checkpoint (``hf_xla_fsdp.checkpoint``); an
   emulated rank writes its own rank file into the checkpoint's staging directory.

Here (CPU, XLA:CPU):

    python examples/build_large_model.py --preset llama-2-7b --tpu v5p-8                 # plan only
    python examples/build_large_model.py --preset llama-2-7b --world_size 64 --build     # rank 0 of 64
    python examples/build_large_model.py --preset vit-tiny --world_size 1 --build --train_step \\
        --compute_dtype float32 --save_dir /tmp/vit

On a TPU VM slice (every host runs the same command, one process per chip):

    PJRT_DEVICE=TPU python examples/build_large_model.py --preset llama-2-7b --tpu v5p-8 --build --spawn \\
        --train_step --activation_checkpointing --save_dir gs-fuse-or-nfs/llama7b-step1

Prints JSON: the plan, and with --build the peak RSS (VmHWM of this process), the RSS before building,
the build time and the bytes this rank holds; with --train_step the loss; with --save_dir what was written.
"""

from __future__ import annotations

import argparse
import json
import time


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Preset, slice / world size, and which steps to run."""
    from hf_xla_fsdp.planning.presets import MODEL_PRESETS

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="vit-10b", choices=sorted(MODEL_PRESETS))
    p.add_argument("--tpu", default=None, help="plan for this slice (v4-32, v5p-8, v5e-16, ...): memory per chip, fits")
    p.add_argument("--world_size", type=int, default=None,
                   help="ranks (default: the slice's chips, else the XLA world size); on one host with --build "
                        "it builds exactly what rank --rank of this many holds")
    p.add_argument("--rank", type=int, default=0, help="the rank to build when emulating one rank of --world_size")
    p.add_argument("--build", action="store_true", help="build this process's rank and report peak host RSS")
    p.add_argument("--train_step", action="store_true", help="one AdamW step on a synthetic batch (needs every rank)")
    p.add_argument("--save_dir", default=None, help="save the sharded model (and optimizer) here")
    p.add_argument("--spawn", action="store_true", help="one process per XLA device (TPU VM)")
    p.add_argument("--batch_size", type=int, default=1, help="samples per chip")
    p.add_argument("--seq_len", type=int, default=512, help="tokens per sample (Llama)")
    p.add_argument("--activation_checkpointing", "--use_gradient_checkpointing", action="store_true")
    p.add_argument("--compute_dtype", default="bfloat16", choices=["float32", "bfloat16"])
    return p.parse_args(argv)


def vm_hwm_mib() -> float:
    """Peak resident set size of this process so far (VmHWM: a child's ru_maxrss would include its parent's)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmHWM:")) / 1024


def synthetic_batch(config, args: argparse.Namespace, device) -> dict:
    """A causal-LM batch of arithmetic sequences, or random images with labels for a ViT."""
    import torch

    from hf_xla_fsdp.train import arithmetic_lm_batches, to_device

    if getattr(config, "image_size", None):
        gen = torch.Generator().manual_seed(0)
        size = config.image_size
        batch = {"pixel_values": torch.randn(args.batch_size, config.num_channels, size, size, generator=gen),
                 "labels": torch.randint(0, config.num_labels, (args.batch_size,), generator=gen)}
    else:
        batch = next(arithmetic_lm_batches(config.vocab_size, args.seq_len, args.batch_size))
    return to_device(batch, device)


def run(index: int, args: argparse.Namespace) -> None:
    """Plan, then build / train / save as asked; the first process prints the JSON."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.planning.presets import preset_config
    from hf_xla_fsdp.planning.tpu import parse_slice, plan_tpu
    from hf_xla_fsdp.planning.units import plan

    spawned = xr.world_size()
    world = args.world_size or (parse_slice(args.tpu).chips if args.tpu else spawned)
    config = preset_config(args.preset)
    settings = dict(activation_checkpointing=args.activation_checkpointing,
                    compute_dtype=None if args.compute_dtype == "float32" else args.compute_dtype)
    if getattr(config, "image_size", None):  # the ViT recipe wraps the transformer blocks only (not the embeddings)
        settings["transformer_layer_cls_to_wrap"] = ["ViTLayer"]
    sizing = plan(config, XlaFsdpPlugin(**settings), world)
    report = {"preset": args.preset, **{k: v for k, v in sizing.items() if k != "units"},
              "total_gib": round(sizing["total_bytes"] / 2**30, 2), "gib_per_rank": round(sizing["bytes_per_rank"] / 2**30, 3),
              "largest_unit_mib": round(sizing["largest_unit_bytes"] / 2**20, 1)}
    if args.tpu:
        tpu = plan_tpu(config, XlaFsdpPlugin(**settings), args.tpu, batch_size=args.batch_size,
                       seq_len=None if getattr(config, "image_size", None) else args.seq_len)
        report["tpu_plan"] = {"fits": tpu["fits"], "slice": tpu["tpu"]["slice"],
                              "total_gib_per_chip": round(tpu["per_chip"]["total"] / 2**30, 2),
                              "suggestions": tpu["suggestions"]}
    emulated = world > spawned
    if args.build:
        if emulated:  # one host standing in for rank --rank of `world`: FSDP shards exactly as there
            settings.update(sharding_groups=[list(range(world))], sharding_rank=args.rank, sharding_world_size=world)
        plugin = XlaFsdpPlugin(**settings)
        device = torch_xla.device()
        torch.zeros(1, device=device).cpu()  # the runtime is up before measuring
        before = vm_hwm_mib()
        torch.manual_seed(0)  # every rank builds the same model: each keeps its own shard of it
        start = time.perf_counter()
        model = plugin.build(config, progress=xr.global_ordinal() == 0)
        torch_xla.sync()
        report.update(build_seconds=round(time.perf_counter() - start, 1), rss_before_build_mib=round(before),
                      peak_rss_mib=round(vm_hwm_mib()), built_rank=args.rank if emulated else xr.global_ordinal(),
                      built_world_size=world,
                      rank_param_mib=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 1))
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5)
        if args.train_step and emulated:
            report["train_step"] = (f"skipped: rank {args.rank} of {world} emulated on one host cannot run the "
                                    f"all-gathers of the other {world - 1} ranks; run it on the slice or with --world_size 1")
        elif args.train_step:
            from hf_xla_fsdp.train import train_step

            start = time.perf_counter()
            loss = train_step(model, synthetic_batch(config, args, device), optimizer)
            report.update(train_step_loss=round(loss.item(), 4), train_step_seconds=round(time.perf_counter() - start, 1),
                          peak_rss_after_step_mib=round(vm_hwm_mib()))
        if args.save_dir:
            from hf_xla_fsdp.checkpoint import save_checkpoint, write_rank_file

            if emulated:
                path = write_rank_file(args.save_dir, model, optimizer, plugin=plugin)
                report["saved"] = {"rank_file": str(path), "complete": False,
                                   "note": f"the checkpoint is committed once all {world} ranks wrote theirs"}
            else:
                save_checkpoint(args.save_dir, model, optimizer, step=1 if args.train_step else 0, plugin=plugin)
                report["saved"] = {"checkpoint": args.save_dir, "complete": True}
    if xr.global_ordinal() == 0:
        print(json.dumps(report, indent=2), flush=True)


def main() -> None:
    """Plan, and build when asked (spawning one process per device with --spawn)."""
    args = parse_args()
    if args.spawn:
        import torch_xla.distributed.xla_multiprocessing as xmp

        xmp.spawn(run, args=(args,))
    else:
        run(0, args)


if __name__ == "__main__":
    main()
