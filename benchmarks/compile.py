"""Compile time a user pays at the start of a run: depth with and without ``scan_layers``, graphs per step, and (by
running benchmarks/compile_shapes.py) the persistent cache and bucketed batch lengths.

    python benchmarks/compile.py [--depths 4 16 32] [--steps 3] [--parts depth steps shapes]
    python benchmarks/compile.py --smoke     # depth 2 (split only), one loop, compile_shapes --smoke --only buckets

Every figure comes from a fresh process (empty compile caches):

* ``depth``: a tiny-width Llama (hidden 64, 4 heads, 2 KV heads) at each depth, FSDP v2 on 4 XLA:CPU devices, the
  plugin's loop (``prepare_optimizer``: AdamW's state exists before step 1), ``--steps`` AdamW steps on the same
  batches, unrolled (the reference) and with ``scan_layers``: compile seconds of those steps (torch_xla's
  ``CompileTime``), graphs, and the losses. ``split`` does the same with a sync after ``backward``, so the
  forward+backward graph (where the layers are) and the optimizer graph are timed apart.
* ``steps``: graphs compiled in each step for the plain accelerate loop, the plugin loop and ``XlaFsdpTrainer``
  (v1 and v2), from tests/scripts/compile_steps.py.
* ``shapes``: benchmarks/compile_shapes.py (bucketing, cold vs warm cache).

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from _harness import add_smoke_flag, emit, run_json_child

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent


def depth_child(args: argparse.Namespace) -> dict[str, Any]:
    """One run at one depth: compile seconds and graphs of the first ``args.steps`` steps, and the losses."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    import torch_xla.runtime as xr

    xr.use_spmd()
    from transformers import LlamaConfig, LlamaForCausalLM

    from hf_xla_fsdp import XlaFsdpPlugin, XlaFsdpSession

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128,
                                         num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                                         max_position_embeddings=64))
    session = XlaFsdpSession(XlaFsdpPlugin(version=2, scan_layers=args.scan))
    model = session.wrap_model(model)
    optimizer = session.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    g = torch.Generator().manual_seed(0)
    data = [torch.randint(0, 96, (4, 32), generator=g) for _ in range(args.steps)]

    def compile_seconds() -> tuple[int, float]:
        data = met.metric_data("CompileTime")
        return (int(data[0]), data[1] / 1e9) if data else (0, 0.0)

    n0, s0 = compile_seconds()
    losses, forward_backward, per_step = [], 0.0, []
    start = time.perf_counter()
    for ids in data:
        ids = ids.to(torch_xla.device())
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        if args.split:
            before = compile_seconds()[1]
            torch_xla.sync()
            forward_backward += compile_seconds()[1] - before
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
        per_step.append(compile_seconds()[0] - n0 - sum(per_step))
    n1, s1 = compile_seconds()
    samples = met.metric_data("CompileTime")[2] if n1 else []
    out = {"graph_seconds": [round(v / 1e9, 2) for _, v in samples[-(n1 - n0):]] if n1 > n0 else [],
           "layers": args.layers, "scan": args.scan, "compile_s": round(s1 - s0, 2), "graphs": n1 - n0,
           "graphs_per_step": per_step,
           "losses": losses, "wall_s": round(time.perf_counter() - start, 2)}
    if args.split:
        out["forward_backward_compile_s"] = round(forward_backward, 2)
    return out


def run_depth(args: argparse.Namespace) -> dict[str, Any]:
    rows = []
    # smoke: the split runs only, which go through everything the unsplit ones do and time the two graphs apart
    for split in (True,) if args.smoke else (False, True):
        for layers in args.depths:
            pair = {}
            for scan in (False, True):
                flags = ["--child", "depth", "--layers", layers, "--steps", args.steps] + (["--scan"] if scan else []) \
                    + (["--split"] if split else [])
                pair[scan] = run_json_child([__file__, *flags], name=f"depth {layers} scan={scan} split={split}",
                                            env={"CPU_NUM_DEVICES": "4"})
            unrolled, scanned = pair[False], pair[True]
            row = {"layers": layers, "split": split, "unrolled": unrolled, "scanned": scanned,
                   "compile_ratio": round(scanned["compile_s"] / unrolled["compile_s"], 3),
                   "loss_max_diff": max(abs(a - b) for a, b in zip(unrolled["losses"], scanned["losses"]))}
            if split:
                row["forward_backward_ratio"] = round(scanned["forward_backward_compile_s"]
                                                      / unrolled["forward_backward_compile_s"], 3)
            rows.append(row)
            print(json.dumps({k: v for k, v in row.items() if k not in ("unrolled", "scanned")}), file=sys.stderr)
    return {"depth": rows}


def run_steps(args: argparse.Namespace) -> dict[str, Any]:
    worker = ROOT / "tests" / "scripts" / "compile_steps.py"
    out = {}
    loops = [("accelerate", []), ("plugin", []), ("trainer", []), ("trainer_v2", ["--v2"]), ("accelerate_v2", ["--v2"])]
    for how, flags in loops[1:2] if args.smoke else loops:
        out[how] = run_json_child([worker, how.split("_")[0], *flags, "--steps", 2 if args.smoke else 4],
                                  name=f"steps {how}",
                                  env={"CPU_NUM_DEVICES": "4"} if flags else None)["compiles"]
    return {"graphs_per_step": out}


def run_shapes(args: argparse.Namespace) -> dict[str, Any]:
    """benchmarks/compile_shapes.py's report (its last stdout line: one line of JSON)."""
    flags = ["--smoke", "--only", "buckets"] if args.smoke else []
    return {"shapes": run_json_child([HERE / "compile_shapes.py", *flags], name="compile_shapes.py")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--depths", type=int, nargs="+", default=[4, 16, 32])
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--parts", nargs="+", choices=["depth", "steps", "shapes"], default=["depth", "steps", "shapes"])
    parser.add_argument("--child", choices=["depth"], help=argparse.SUPPRESS)
    parser.add_argument("--layers", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scan", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--split", action="store_true", help=argparse.SUPPRESS)
    add_smoke_flag(parser)
    args = parser.parse_args()
    if args.child:
        emit(depth_child(args))
        return
    if args.smoke:
        args.depths, args.steps = [2], 2
    os.environ.setdefault("PYTHONPATH", str(ROOT))
    result: dict[str, Any] = {"smoke": args.smoke, "date": time.strftime("%Y-%m-%d"),
                              "command": " ".join(["benchmarks/compile.py", *sys.argv[1:]])}
    for part in args.parts:
        result.update({"depth": run_depth, "steps": run_steps, "shapes": run_shapes}[part](args))
    emit(result)


if __name__ == "__main__":
    main()
