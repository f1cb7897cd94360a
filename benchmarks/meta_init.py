"""Peak host RSS of building one rank of an N-rank FSDP model: layer-by-layer meta construction
against eager construction (whole model on the host, then wrapped), each in its own process.

    python benchmarks/meta_init.py --world-size 8
    python benchmarks/meta_init.py --smoke          # a tiny model, rank 0 of 2: checks the script runs

Prints JSON. Target: meta peak <= model_bytes / N + 2 x largest block + baseline,
where baseline is the RSS of a process that has imported everything and started the XLA runtime.
Peaks are each child's own VmHWM (see _harness.py: a child's ru_maxrss includes this parent's peak).
"""

from __future__ import annotations

import argparse
import time

from _harness import SMOKE_LLAMA, add_smoke_flag, emit, mib, run_json_child, vm_hwm_bytes

# ~325M parameters (1.2 GB fp32): 24 decoder layers of 12.8M; embeddings + lm_head (the root unit)
# are 1.3 blocks, the proportion of Llama-2-7B. --vocab-size 32000 makes the root 5 blocks.
MODEL = dict(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=24,
             num_attention_heads=16, num_key_value_heads=16, max_position_embeddings=2048,
             tie_word_embeddings=False)


def child(mode: str, world_size: int, rank: int, wrap_embeddings: bool) -> None:
    """Build rank ``rank`` of ``world_size`` the ``mode`` way in this process; print its JSON line."""
    import torch
    import torch_xla
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin

    torch_xla.device()
    torch.zeros(1, device=torch_xla.device()).cpu()  # start the runtime before measuring the baseline
    baseline = vm_hwm_bytes()
    classes = ["LlamaDecoderLayer"] + (["Embedding"] if wrap_embeddings else [])
    plugin = XlaFsdpPlugin(
        transformer_layer_cls_to_wrap=classes, meta_init=(mode == "meta"),
        sharding_groups=[list(range(world_size))], sharding_rank=rank, sharding_world_size=world_size,
    )
    torch.manual_seed(0)
    start = time.perf_counter()
    model = plugin.build(LlamaConfig(**MODEL), progress=False)
    torch_xla.sync()
    seconds = time.perf_counter() - start
    shard_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    emit({"mode": mode, "baseline_rss": baseline, "peak_rss": vm_hwm_bytes(), "build_seconds": round(seconds, 2),
          "rank_param_bytes": shard_bytes})


def main() -> None:
    """As a child build one rank; as the parent run both builds and print the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--wrap-embeddings", action="store_true", help="make embed_tokens its own FSDP unit too")
    p.add_argument("--vocab-size", type=int, default=MODEL["vocab_size"])
    p.add_argument("--child", choices=["meta", "eager"], help=argparse.SUPPRESS)
    add_smoke_flag(p)
    args = p.parse_args()
    if args.smoke:
        MODEL.clear()
        MODEL.update(SMOKE_LLAMA)
        args.world_size, args.vocab_size = 2, SMOKE_LLAMA["vocab_size"]
    MODEL["vocab_size"] = args.vocab_size
    if args.child:
        return child(args.child, args.world_size, args.rank, args.wrap_embeddings)

    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.planning.units import plan

    classes = ["LlamaDecoderLayer"] + (["Embedding"] if args.wrap_embeddings else [])
    cfg = LlamaConfig(**MODEL)
    sizing = plan(cfg, XlaFsdpPlugin(transformer_layer_cls_to_wrap=classes), world_size=args.world_size)
    largest_block = max(u["bytes"] for u in sizing["units"] if u["unit"] != "<root>")
    results = {}
    for mode in ("meta", "eager"):
        cmd = [__file__, "--child", mode, "--world-size", args.world_size, "--rank", args.rank,
               "--vocab-size", args.vocab_size]
        cmd += ["--wrap-embeddings"] if args.wrap_embeddings else []
        cmd += ["--smoke"] if args.smoke else []
        results[mode] = run_json_child(cmd, name=f"{mode} build")
    model_bytes = sizing["total_bytes"]
    baseline = results["meta"]["baseline_rss"]
    target = model_bytes / args.world_size + 2 * largest_block + baseline
    report = {
        "smoke": args.smoke, "model_params": sizing["total_params"], "model_mib": mib(model_bytes), "world_size": args.world_size,
        "largest_block_mib": mib(largest_block), "root_unit_mib": mib(sizing["units"][-1]["bytes"]),
        "baseline_rss_mib": mib(baseline),
        "meta_peak_rss_mib": mib(results["meta"]["peak_rss"]), "eager_peak_rss_mib": mib(results["eager"]["peak_rss"]),
        "meta_above_baseline_mib": mib(results["meta"]["peak_rss"] - baseline),
        "eager_above_baseline_mib": mib(results["eager"]["peak_rss"] - results["eager"]["baseline_rss"]),
        "target_mib": mib(target), "meta_within_target": results["meta"]["peak_rss"] <= target,
        "meta_build_seconds": results["meta"]["build_seconds"], "eager_build_seconds": results["eager"]["build_seconds"],
        "rank_param_mib": mib(results["meta"]["rank_param_bytes"]),
    }
    emit(report)


if __name__ == "__main__":
    main()
