"""FSDP v1 (XlaFullyShardedDataParallel) against v2 (SpmdFullyShardedDataParallel) on the same
Llama model, data, init (meta, seed 0), AdamW and global batch, each run in its own process:
v1 on 1 device, v2 on 1 device, v2 on 4 devices in fp32 and in bf16 (compute_dtype: bf16 parameters,
fp32 master copies in the optimizer) (CPU_NUM_DEVICES=1 / 1 / 4 / 4).

    python benchmarks/engines.py --steps 20 --warmup 5
    python benchmarks/engines.py --smoke      # a tiny Llama, 2 steps per run: checks the script runs

Per run: the loss of every step (read with ``.item()``, so steps are synchronous), per-step wall
time and the steady step time (median after warm-up), XLA compilations after warm-up (target 0),
parameter bytes per device and in total, the sharding of a few parameters and the process's peak RSS
(its own VmHWM, see _harness.py). Prints ONE JSON with the runs and a comparison: max |loss - v1 loss|
(fp32, same init: expected ~1e-5 or less), per-device bytes of 4 devices / 1 device (expected ~0.25),
compilations after warm-up and the peak RSS of each run; and v2 bf16 against v2 fp32 on 4 devices:
parameter + activation bytes per device (activations = what autograd saves for backward in one step,
split over the devices with the batch; target ratio <= 0.6), optimizer + master bytes, step time and
the loss curves (max |difference|).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

from _harness import SMOKE_LLAMA, add_smoke_flag, emit, mib, run_json_child, vm_hwm_bytes

MODEL = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}
# name -> (version, CPU_NUM_DEVICES, compute_dtype)
RUNS = {"v1_1dev": (1, 1, None), "v2_1dev": (2, 1, None), "v2_4dev": (2, 4, None), "v2_4dev_bf16": (2, 4, "bfloat16")}
SPEC_PARAMS = ("embed_tokens.weight", "self_attn.q_proj.weight", "lm_head.weight")


def compile_count() -> int:
    """Number of XLA compilations so far in this process."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def param_specs(model: Any, version: int) -> dict[str, str]:
    """Shape and sharding of the parameters whose (unwrapped) name ends with one of SPEC_PARAMS."""
    from hf_xla_fsdp.engines import v2 as spmd

    out = {}
    for name, p in model.named_parameters():
        clean = spmd.clean_name(name).replace("_FSDP_SHARD_SEPARATOR_", ".")  # v1 flattens names of shards
        for want in SPEC_PARAMS:
            if clean.endswith(want) and want not in out:
                out[want] = (f"{list(p.shape)} {spmd.sharding_spec(p)}" if version == 2
                             else f"v1 shard {list(p.shape)} of {list(p._orig_size)}")
    return out


def logical_bytes(model: Any, version: int) -> int:
    """Bytes of the full (unsharded, unpadded) parameters."""
    return sum((p._orig_size.numel() if version == 1 else p.numel()) * p.element_size() for p in model.parameters())


def saved_activation_bytes(model: Any, batch: dict[str, Any]) -> int:
    """Bytes of the tensors autograd saves for backward in one forward (parameters excluded), whole batch."""
    import torch

    params = {id(p) for p in model.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in params:
            seen[id(t)] = t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(**batch).loss
    loss.backward()
    model.zero_grad(set_to_none=True)
    return sum(seen.values())


def child(version: int, steps: int, warmup: int, batch_size: int, seq_len: int, lr: float,
          compute_dtype: Any = None) -> dict[str, Any]:
    """Build, train and measure one engine in this process (CPU_NUM_DEVICES already set)."""
    import torch
    import torch_xla
    import torch_xla.runtime as xr
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.engines import v2 as spmd
    from hf_xla_fsdp.train import arithmetic_lm_batches, train_step

    plugin = XlaFsdpPlugin(version=version, transformer_layer_cls_to_wrap=["LlamaDecoderLayer"],
                           compute_dtype=compute_dtype)
    torch.manual_seed(0)
    start = time.perf_counter()
    model = plugin.build(LlamaConfig(**MODEL), progress=False)
    torch_xla.sync()
    build_seconds = time.perf_counter() - start
    mesh = spmd.get_mesh(plugin) if version == 2 else None
    if version == 2:
        per_device = spmd.device_bytes(model)
    else:
        per_device = {str(torch_xla.device()): sum(p.numel() * p.element_size() for p in model.parameters())}
    optimizer = plugin.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=lr))
    data = arithmetic_lm_batches(MODEL["vocab_size"], seq_len, batch_size, seed=0)
    device = torch_xla.device()
    devices = xr.global_runtime_device_count()
    probe = {k: v.to(device) for k, v in next(arithmetic_lm_batches(MODEL["vocab_size"], seq_len, batch_size,
                                                                      seed=99)).items()}
    # every saved activation is split over the devices on the batch dimension (v2); v1 runs on one device here
    activations = saved_activation_bytes(model, spmd.shard_batch(probe, mesh) if mesh is not None else probe)
    activation_bytes_per_device = activations // devices if version == 2 else activations
    losses, times, compiles_at_warmup = [], [], None
    for step in range(steps):
        t0 = time.perf_counter()
        batch = {k: v.to(device) for k, v in next(data).items()}
        if mesh is not None:
            batch = spmd.shard_batch(batch, mesh)
        losses.append(train_step(model, batch, optimizer).item())
        times.append(time.perf_counter() - t0)
        if step + 1 == warmup:
            compiles_at_warmup = compile_count()
    compiles_end = compile_count()
    from hf_xla_fsdp.engines.master_weights import master_weights

    share = devices if version == 2 else 1  # v2 tensors are logical (split over the devices), v1's are the shard
    optimizer_bytes = sum(v.numel() * v.element_size() for st in optimizer.state.values() for v in st.values()
                          if torch.is_tensor(v) and v.dim() > 0) // share
    masters = master_weights(model)
    master_bytes = sum(m.numel() * m.element_size() for _, m in (masters.pairs if masters else [])) // share
    return {
        "compute_dtype": compute_dtype or "float32", "activation_bytes_per_device": activation_bytes_per_device,
        "optimizer_state_bytes_per_device": optimizer_bytes, "master_copy_bytes_per_device": master_bytes,
        "params_plus_activations_per_device": max(per_device.values()) + activation_bytes_per_device,
        "version": version, "devices": xr.global_runtime_device_count(), "build_seconds": round(build_seconds, 2),
        "compiles_at_warmup": compiles_at_warmup, "compiles_end": compiles_end,
        "compiles_after_warmup": None if compiles_at_warmup is None else compiles_end - compiles_at_warmup,
        "steady_step_seconds": round(statistics.median(times[warmup:]), 4) if steps > warmup else None,
        "step_seconds": [round(t, 4) for t in times],
        "per_device_param_bytes": per_device, "total_param_bytes": sum(per_device.values()),
        "logical_param_bytes": logical_bytes(model, version),
        "param_specs": param_specs(model, version), "peak_rss_mib": mib(vm_hwm_bytes()), "losses": losses,
    }


def run(name: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run one engine in a fresh subprocess and return its JSON result."""
    version, devices, dtype = RUNS[name]
    cmd = [__file__, "--child", version, "--steps", args.steps, "--warmup", args.warmup, "--batch-size",
           args.batch_size, "--seq-len", args.seq_len, "--lr", args.lr, "--model", json.dumps(MODEL)]
    if dtype:
        cmd += ["--compute-dtype", dtype]
    # the device count is fixed when the XLA runtime starts: one process per device count
    return run_json_child(cmd, name=name, env={"CPU_NUM_DEVICES": str(devices)})


def max_diff(a: list[float], b: list[float]) -> float:
    """Largest absolute element-wise difference of two loss curves."""
    return max(abs(x - y) for x, y in zip(a, b))


def main() -> None:
    """Parse arguments; as a child run one engine, as the parent run all three and print the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch-size", type=int, default=8, help="global batch (sequences per step)")
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--model", type=json.loads, default={}, help="JSON overrides of the LlamaConfig fields")
    p.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    p.add_argument("--child", type=int, choices=[1, 2], help=argparse.SUPPRESS)
    p.add_argument("--compute-dtype", default=None, help=argparse.SUPPRESS)
    add_smoke_flag(p)
    args = p.parse_args()
    if args.smoke:  # children get the model through --model
        MODEL.update(SMOKE_LLAMA)
        args.steps, args.warmup, args.batch_size, args.seq_len = 2, 1, 4, 16
    MODEL.update(args.model)
    if args.child:
        emit(child(args.child, args.steps, args.warmup, args.batch_size, args.seq_len, args.lr, args.compute_dtype))
        return
    start = time.perf_counter()
    runs = {name: run(name, args) for name in args.runs}
    comparison: dict[str, Any] = {
        "compiles_after_warmup": {n: r["compiles_after_warmup"] for n, r in runs.items()},
        "steady_step_seconds": {n: r["steady_step_seconds"] for n, r in runs.items()},
        "peak_rss_mib": {n: r["peak_rss_mib"] for n, r in runs.items()},
    }
    if "v1_1dev" in runs:
        ref = runs["v1_1dev"]["losses"]
        comparison["max_abs_loss_diff_vs_v1"] = {n: max_diff(r["losses"], ref)
                                                 for n, r in runs.items() if n != "v1_1dev"}
    if {"v2_1dev", "v2_4dev"} <= runs.keys():
        one, four = (max(runs[n]["per_device_param_bytes"].values()) for n in ("v2_1dev", "v2_4dev"))
        comparison["per_device_bytes_ratio_4dev_vs_1dev"] = round(four / one, 4)
        comparison["max_abs_loss_diff_v2_4dev_vs_v2_1dev"] = max_diff(runs["v2_4dev"]["losses"],
                                                                      runs["v2_1dev"]["losses"])
    if {"v2_4dev", "v2_4dev_bf16"} <= runs.keys():
        fp32, bf16 = runs["v2_4dev"], runs["v2_4dev_bf16"]
        comparison["v2_bf16_vs_fp32"] = {
            # target <= 0.6: bf16 parameters + bf16 activations against fp32 ones, per device
            "params_plus_activations_ratio": round(bf16["params_plus_activations_per_device"]
                                                   / fp32["params_plus_activations_per_device"], 4),
            "param_bytes_ratio": round(max(bf16["per_device_param_bytes"].values())
                                       / max(fp32["per_device_param_bytes"].values()), 4),
            "activation_bytes_ratio": round(bf16["activation_bytes_per_device"] / fp32["activation_bytes_per_device"], 4),
            "optimizer_plus_master_bytes_ratio": round(
                (bf16["optimizer_state_bytes_per_device"] + bf16["master_copy_bytes_per_device"])
                / fp32["optimizer_state_bytes_per_device"], 4),
            "steady_step_seconds": [fp32["steady_step_seconds"], bf16["steady_step_seconds"]],
            "final_loss": [fp32["losses"][-1], bf16["losses"][-1]],
            "max_abs_loss_diff": max_diff(bf16["losses"], fp32["losses"]),
        }
    report = {"smoke": args.smoke, "model": MODEL, "steps": args.steps, "warmup": args.warmup,
              "global_batch": [args.batch_size, args.seq_len], "lr": args.lr, "runs": runs, "comparison": comparison,
              "total_seconds": round(time.perf_counter() - start, 1)}
    emit(report)


if __name__ == "__main__":
    main()
