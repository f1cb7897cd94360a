"""The 10B-parameter ViT recipe of PyTorch/XLA's FSDP announcement, with meta construction.

The original interleaves building each transformer block with wrapping it in an inner FSDP unit so
the full model never exists on one host. Here the plugin does that for any transformers model:
the skeleton is built on ``meta`` and each ``ViTLayer`` is materialized, initialized, wrapped and
sharded before the next exists.

    # the plan for ViT-10B over 256 ranks (nothing is allocated):
    python examples/build_large_model.py --preset vit-10b --world_size 256
    # really build rank 0 of 8 of a small ViT here and report the peak host memory:
    python examples/build_large_model.py --preset vit-small --world_size 8 --build
    # on a TPU VM, one process per chip, the real thing:
    PJRT_DEVICE=TPU python examples/build_large_model.py --preset vit-10b --build --spawn

Prints JSON: parameters, fp32 bytes, bytes per rank, FSDP units and the largest one, and with
--build the peak RSS, the RSS before building and the bytes of parameters this rank holds.
"""

from __future__ import annotations

import argparse
import json
import resource
import time

PRESETS = {
    # 48 x 201M-parameter blocks (width 4096, MLP 16384) = 9.7B, at 224 px with 14 px patches
    "vit-10b": dict(hidden_size=4096, num_hidden_layers=48, num_attention_heads=32, intermediate_size=16384,
                    image_size=224, patch_size=14),
    "vit-1b": dict(hidden_size=2048, num_hidden_layers=20, num_attention_heads=16, intermediate_size=8192,
                   image_size=224, patch_size=14),
    "vit-small": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12, intermediate_size=3072,
                      image_size=224, patch_size=16),
    "vit-tiny": dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=4, intermediate_size=256,
                     image_size=32, patch_size=4),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Preset, world size, and whether to build."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="vit-10b", choices=sorted(PRESETS))
    p.add_argument("--world_size", type=int, default=None,
                   help="ranks to plan for (default: the XLA world size; with --build on one host it emulates "
                        "rank 0 of this many, exactly as that rank's shard would be)")
    p.add_argument("--num_labels", type=int, default=1000)
    p.add_argument("--build", action="store_true", help="build the sharded model and report peak host RSS")
    p.add_argument("--spawn", action="store_true", help="one process per XLA device (TPU VM)")
    p.add_argument("--use_gradient_checkpointing", action="store_true")
    p.add_argument("--compute_dtype", default="bfloat16", choices=["float32", "bfloat16"])
    return p.parse_args(argv)


def vit_config(args: argparse.Namespace):
    """The ViTForImageClassification config of the preset."""
    from transformers import ViTConfig

    return ViTConfig(num_labels=args.num_labels, architectures=["ViTForImageClassification"], **PRESETS[args.preset])


def peak_rss_mib() -> float:
    """Peak resident set size of this process so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(index: int, args: argparse.Namespace) -> None:
    """Plan (and with --build, construct) the model on this process; rank 0 prints the JSON."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.build.planning import plan

    spawned_world = xr.world_size()
    world = args.world_size or spawned_world
    settings = dict(transformer_layer_cls_to_wrap=["ViTLayer"], activation_checkpointing=args.use_gradient_checkpointing,
                    compute_dtype=args.compute_dtype)
    report = {"preset": args.preset, **{k: v for k, v in plan(vit_config(args), XlaFsdpPlugin(**settings), world).items()
                                        if k != "units"}}
    report["total_gib"] = round(report["total_bytes"] / 2**30, 2)
    report["gib_per_rank"] = round(report["bytes_per_rank"] / 2**30, 3)
    report["largest_unit_mib"] = round(report["largest_unit_bytes"] / 2**20, 1)
    if args.build:
        if world > spawned_world:  # one host emulating rank 0 of `world`: FSDP shards exactly as there
            settings.update(sharding_groups=[list(range(world))], sharding_rank=0, sharding_world_size=world)
        torch.zeros(1, device=torch_xla.device()).cpu()  # the runtime is up before measuring
        before = peak_rss_mib()
        torch.manual_seed(0)
        start = time.perf_counter()
        model = XlaFsdpPlugin(**settings).build(vit_config(args), progress=xr.global_ordinal() == 0)
        torch_xla.sync()
        report.update(
            build_seconds=round(time.perf_counter() - start, 1), rss_before_build_mib=round(before),
            peak_rss_mib=round(peak_rss_mib()),
            rank_param_mib=round(sum(p.numel() * p.element_size() for p in model.parameters()) / 2**20, 1),
            built_world_size=world, model_fp32_mib=round(report["total_bytes"] / 2**20))
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
