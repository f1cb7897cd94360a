"""FSDP v2 on a 1D mesh (fsdp 8) against a 2D mesh (fsdp 4 x tensor 2), same Llama, data, init and AdamW, each in
its own child process on 8 XLA:CPU devices (``CPU_NUM_DEVICES=8``), in the same run:

    python benchmarks/mesh2d.py --steps 12 --warmup 4
    python benchmarks/mesh2d.py --smoke      # a tiny Llama, 2 steps per mesh: checks the script runs

Per mesh: the losses, the steady step time (median after warm-up, steps read with ``.item()`` so synchronous), XLA
compilations after warm-up (target 0), parameter bytes per device and the child's peak RSS. Prints ONE JSON with
both and their ratios.

What it does NOT say about TPUs: the 8 "devices" are threads of a 2-core CPU sharing one memory, so collectives are
memcpys and step time measures XLA:CPU's partitioned compute plus its runtime overhead, not ICI bandwidth, overlap
or HBM limits. Whether tensor parallelism pays off on a slice (fewer, larger all-gathers per block against two
all-reduces of activations per block) has to be measured there. The per-device parameter bytes are exact anywhere.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _harness import SMOKE_LLAMA, add_smoke_flag, emit, run_json_child, vm_hwm_bytes  # noqa: E402

DEVICES = 8

MODEL = {"vocab_size": 2048, "hidden_size": 256, "intermediate_size": 688, "num_hidden_layers": 4,
         "num_attention_heads": 4, "num_key_value_heads": 4, "max_position_embeddings": 256,
         "tie_word_embeddings": False}


def compile_count() -> int:
    """Number of XLA compilations so far in this process."""
    import torch_xla.debug.metrics as met

    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def run(tensor: int, steps: int, warmup: int, batch: int, seq: int) -> dict[str, Any]:
    """Train ``steps`` steps on the (1, 8 / tensor, tensor) mesh; its figures."""
    import torch
    import torch_xla
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.engines import v2
    from hf_xla_fsdp.train import arithmetic_lm_batches, train_step

    plugin = XlaFsdpPlugin(version=2, activation_checkpointing=True, tensor_parallel_size=tensor)
    torch.manual_seed(0)
    model = plugin.build(LlamaConfig(**MODEL), progress=False)
    mesh = v2.get_mesh(plugin)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    data = arithmetic_lm_batches(MODEL["vocab_size"], seq, batch, seed=1)
    losses, times, compiled = [], [], 0
    for i in range(steps):
        b = v2.shard_batch({k: v.to(torch_xla.device()) for k, v in next(data).items()}, mesh)
        start = time.perf_counter()
        losses.append(train_step(model, b, optimizer).item())
        times.append(time.perf_counter() - start)
        if i == warmup - 1:
            compiled = compile_count()
    v2.wait_device_ops()
    per_device = v2.device_bytes(model)
    return {"mesh": dict(zip(mesh.axis_names, mesh.mesh_shape)), "losses": losses,
            "steady_step_s": statistics.median(times[warmup:]), "compiles_after_warmup": compile_count() - compiled,
            "param_bytes_per_device": max(per_device.values()),
            "param_bytes_total": sum(p.numel() * p.element_size() for p in model.parameters()),
            "peak_rss_mib": round(vm_hwm_bytes() / 2**20, 1)}


def main() -> None:
    """As a child run one mesh; as the parent run both and print the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)  # tensor_parallel_size of this child
    add_smoke_flag(p)
    args = p.parse_args()
    if args.smoke:
        MODEL.update(SMOKE_LLAMA)
        args.steps, args.warmup, args.batch, args.seq = 2, 1, 8, 16
    if args.child is not None:
        emit(run(args.child, args.steps, args.warmup, args.batch, args.seq))
        return
    one, two = (run_json_child([__file__, "--child", t, "--steps", args.steps, "--warmup", args.warmup, "--batch",
                                args.batch, "--seq", args.seq, *(["--smoke"] if args.smoke else [])],
                               name=f"tensor_parallel_size={t}",
                               env={"CPU_NUM_DEVICES": str(DEVICES)}) for t in (1, 2))
    emit({"smoke": args.smoke, "model": MODEL, "batch": args.batch, "seq": args.seq, "steps": args.steps, "warmup": args.warmup,
          "fsdp8": one, "fsdp4_tensor2": two,
          "compare": {"max_abs_loss_diff": max(abs(a - b) for a, b in zip(one["losses"], two["losses"])),
                      "step_time_2d_over_1d": two["steady_step_s"] / one["steady_step_s"],
                      "param_bytes_per_device_2d_over_1d": two["param_bytes_per_device"] / one["param_bytes_per_device"]},
          "note": "XLA:CPU, 8 virtual devices on 2 cores: step times say nothing about TPU interconnects (see docstring)"})


if __name__ == "__main__":
    main()
