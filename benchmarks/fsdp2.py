"""Engine fsdp2 on the CPU: peak host RSS of building rank 0 of N (against XLA FSDP v1's rank 0 of N), and the
Trainer's step time against a plain hand-written ``fully_shard`` loop over the same model and data.

    python benchmarks/fsdp2.py [--world-size 4] [--steps 30] [--smoke]

Every measurement runs in a child of its own; the report is one JSON object, printed last.

memory: the ~325M-parameter Llama of benchmarks/meta_init.py, built on meta block by block as rank 0 of
``--world-size``: fsdp2 under ``torchrun --nproc_per_node N`` (N real processes; rank 0's own VmHWM), XLA FSDP v1
with an explicit sharding group in one process (what rank 0 of N builds). Target for both: peak <= model bytes / N +
2 x largest block + baseline (the RSS after the imports and the runtime start).

step: a small Llama trained for ``--steps`` optimizer steps on 2 processes (torchrun) by ``XlaFsdpTrainer`` with
``fsdp_config={"engine": "fsdp2"}``, and by a hand-written loop of plain torch (``fully_shard`` per decoder layer
and the root, fused AdamW, ``clip_grad_norm_`` 1.0, the same per-process batches); the median step time after
``--warmup`` steps, same run. Target: Trainer / loop <= 1.05. The same Trainer with ``"compile": true``
(each block compiled, inductor's cache empty): its median step against eager, and both start-ups (from making the
Trainer to the end of step 1: the build, and the compilation). The machine is shared: ratios, not absolute times.
Like with like: the loop's loss is each process's mean, so the Trainer runs with ``average_tokens_across_devices=False``
(transformers' default, True, weights the loss by the tokens of every process: one more collective per step, which
measured 1.108 against 1.008 on a quiet machine; RESULTS.md).
``--smoke``: tiny models and a few steps, no compiled run (checks that it runs, not the figures; the compiled path
has its test, tests/e2e/test_fsdp2_trainer.py).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _harness import emit, mib, run_json_child, vm_hwm_bytes

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from meta_init import MODEL as MEMORY_MODEL  # noqa: E402  (the ~325M Llama: one model definition)

SMOKE_MEMORY_MODEL = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128,
                          tie_word_embeddings=False)
STEP_MODEL = dict(vocab_size=8192, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                  num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=512, tie_word_embeddings=False)
SMOKE_STEP_MODEL = dict(SMOKE_MEMORY_MODEL)
#: engine fsdp2's processes: transformers and accelerate stay off torch_xla, one OpenMP thread each
FSDP2_ENV = {"USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_XLA_FSDP_COMPILATION_CACHE": "none"}


def torchrun(n: int, *args: object) -> list[object]:
    return ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", __file__, *args]


# --------------------------------------------------------------------------- memory
def child_build_fsdp2(model: dict) -> None:
    """One of N torchrun processes builds its rank; rank 0 reports its own peak."""
    import torch
    import torch.distributed as dist
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,  # noqa: F401 - the model class's import (~50 MiB) is not the build's
    )

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.session import XlaFsdpSession

    plugin = XlaFsdpPlugin(engine="fsdp2", transformer_layer_cls_to_wrap=["LlamaDecoderLayer"])
    session = XlaFsdpSession(plugin)
    session.setup_runtime()  # the process group and the mesh: the baseline includes them
    baseline = vm_hwm_bytes()
    torch.manual_seed(0)
    start = time.perf_counter()
    built = session.build_model(LlamaConfig(**model), progress=False)
    seconds = time.perf_counter() - start
    peak = vm_hwm_bytes()
    local = sum(p.to_local().numel() * p.element_size() for p in built.parameters())
    dist.barrier()
    if dist.get_rank() == 0:
        emit({"engine": "fsdp2", "world_size": dist.get_world_size(), "baseline_rss": baseline, "peak_rss": peak,
              "build_seconds": round(seconds, 2), "rank_param_bytes": local})


def child_build_v1(model: dict, world: int) -> None:
    """XLA FSDP v1's rank 0 of ``world`` in one process (an explicit sharding group: no collectives in a build)."""
    import torch
    import torch_xla
    from transformers import LlamaConfig, LlamaForCausalLM  # noqa: F401 - imports before the baseline, as above

    from hf_xla_fsdp import XlaFsdpPlugin

    torch.zeros(1, device=torch_xla.device()).cpu()  # the runtime started: part of the baseline
    baseline = vm_hwm_bytes()
    plugin = XlaFsdpPlugin(engine="xla", version=1, transformer_layer_cls_to_wrap=["LlamaDecoderLayer"],
                           sharding_groups=[list(range(world))], sharding_rank=0, sharding_world_size=world)
    torch.manual_seed(0)
    start = time.perf_counter()
    built = plugin.build(LlamaConfig(**model), progress=False)
    torch_xla.sync()
    seconds = time.perf_counter() - start
    emit({"engine": "xla v1", "world_size": world, "baseline_rss": baseline, "peak_rss": vm_hwm_bytes(),
          "build_seconds": round(seconds, 2),
          "rank_param_bytes": sum(p.numel() * p.element_size() for p in built.parameters())})


def memory(model: dict, world: int) -> dict:
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.planning.units import plan

    sizing = plan(LlamaConfig(**model), XlaFsdpPlugin(engine="fsdp2", transformer_layer_cls_to_wrap=["LlamaDecoderLayer"]),
                  world_size=world)
    largest = max(u["bytes"] for u in sizing["units"] if u["unit"] != "<root>")
    spec = json.dumps(model)
    runs = {"fsdp2": run_json_child(torchrun(world, "--child", "build-fsdp2", "--model", spec), name="fsdp2 build",
                                    env=FSDP2_ENV),
            "xla_v1": run_json_child([__file__, "--child", "build-v1", "--model", spec, "--world-size", world],
                                     name="xla v1 build")}
    out = {"model_params": sizing["total_params"], "model_mib": mib(sizing["total_bytes"]), "world_size": world,
           "largest_block_mib": mib(largest)}
    for name, r in runs.items():
        target = sizing["total_bytes"] / world + 2 * largest + r["baseline_rss"]
        out[name] = {"baseline_rss_mib": mib(r["baseline_rss"]), "peak_rss_mib": mib(r["peak_rss"]),
                     "above_baseline_mib": mib(r["peak_rss"] - r["baseline_rss"]), "target_mib": mib(target),
                     "within_target": r["peak_rss"] <= target, "rank_param_mib": mib(r["rank_param_bytes"]),
                     "build_seconds": r["build_seconds"], "process_seconds": r["process_seconds"]}
    return out


# --------------------------------------------------------------------------- step time
def _data(model: dict, rows: int, seq: int) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(0)
    return torch.randint(0, model["vocab_size"], (rows, seq), generator=g).tolist()


def child_trainer(model_dir: str, model: dict, steps: int, batch: int, seq: int, warmup: int,
                  compiled: bool = False) -> None:
    """XlaFsdpTrainer on engine fsdp2 (``compiled``: ``"compile": true``); rank 0 reports the median on_step_end
    interval after the warm-up, and the start-up: from before the Trainer is made to the end of step 1 (the build,
    and with compile the first step's compilation)."""
    begin = time.perf_counter()
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from hf_xla_fsdp import XlaFsdpTrainer

    ends: list[float] = []

    class Clock(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001, ANN201
            ends.append(time.perf_counter())

    world = int(os.environ["WORLD_SIZE"])
    ids = _data(model, batch * world * steps, seq)
    with tempfile.TemporaryDirectory(prefix="fsdp2-bench-") as out:  # save_strategy 'no': nothing to keep
        args = TrainingArguments(output_dir=out, per_device_train_batch_size=batch, max_steps=steps,
                                 learning_rate=1e-4, logging_steps=10**6, save_strategy="no", report_to=[], use_cpu=True,
                                 disable_tqdm=True, dataloader_drop_last=True,
                                 fsdp_config={"engine": "fsdp2", "compile": compiled},
                                 average_tokens_across_devices=False)  # the loop's loss: each process's mean
        trainer = XlaFsdpTrainer(model=model_dir, args=args, train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
                                 callbacks=[Clock()])
        trainer.train()
    intervals = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    if dist.get_rank() == 0:
        emit({"path": "trainer-compiled" if compiled else "trainer", "median_step_seconds": statistics.median(intervals),
              "steps_timed": len(intervals), "startup_seconds": ends[0] - begin})


def child_loop(model_dir: str, model: dict, steps: int, batch: int, seq: int, warmup: int) -> None:
    """The plain loop: torch and transformers only, as a user would write it for FSDP2."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from transformers import AutoModelForCausalLM

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    net = AutoModelForCausalLM.from_pretrained(model_dir)
    for layer in net.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(net, mesh=mesh)
    optimizer = torch.optim.AdamW(net.parameters(), lr=1e-4, fused=True)  # the Trainer's default optim on CPU
    ids = torch.tensor(_data(model, batch * world * steps, seq))
    ends = []
    for step in range(steps):
        rows = ids[(step * world + rank) * batch:(step * world + rank + 1) * batch]
        loss = net(input_ids=rows, labels=rows).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        ends.append(time.perf_counter())
    intervals = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    if rank == 0:
        emit({"path": "loop", "median_step_seconds": statistics.median(intervals), "steps_timed": len(intervals)})


def step_time(model: dict, steps: int, warmup: int, batch: int, seq: int, world: int, compiled: bool = True) -> dict:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with tempfile.TemporaryDirectory() as tmp:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(LlamaConfig(**model)).save_pretrained(tmp)
        common = ["--model-dir", tmp, "--model", json.dumps(model), "--steps", steps, "--warmup", warmup,
                  "--batch", batch, "--seq", seq]
        # compiled: inductor's cache in a folder of its own, empty: the start-up of a first run (a cache filled by an
        # earlier run of the same shapes skips inductor's code generation)
        with tempfile.TemporaryDirectory() as cache:
            runs = {path: run_json_child(torchrun(world, "--child", path, *common), name=f"{path} steps",
                                         env={**FSDP2_ENV, "TORCHINDUCTOR_CACHE_DIR": cache})
                    for path in ("loop", "trainer", "trainer-compiled")[:3 if compiled else 2]}
    ratio = runs["trainer"]["median_step_seconds"] / runs["loop"]["median_step_seconds"]
    out = {"processes": world, "batch_per_process": batch, "seq_len": seq, "steps": steps, "warmup": warmup,
           "loop_median_step_seconds": round(runs["loop"]["median_step_seconds"], 4),
           "trainer_median_step_seconds": round(runs["trainer"]["median_step_seconds"], 4),
           "trainer_over_loop": round(ratio, 3), "within_target": ratio <= 1.05,
           "eager_startup_seconds": round(runs["trainer"]["startup_seconds"], 2)}
    if compiled:  # compile: true, same run: steady step time and start-up (build to the end of step 1) against eager
        c = runs["trainer-compiled"]
        out.update(compiled_median_step_seconds=round(c["median_step_seconds"], 4),
                   compiled_over_eager=round(c["median_step_seconds"] / runs["trainer"]["median_step_seconds"], 3),
                   compiled_startup_seconds=round(c["startup_seconds"], 2))
    return out


def main() -> None:
    """As a child run one measurement; as the parent run them all and print the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=4, help="memory: the ranks rank 0 is one of")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--batch", type=int, default=4, help="step: rows per process and step")
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--part", choices=["all", "memory", "step"], default="all")
    p.add_argument("--smoke", action="store_true", help="tiny models and a few steps: checks that it runs")
    p.add_argument("--child", choices=["build-fsdp2", "build-v1", "trainer", "trainer-compiled", "loop"],
                   help=argparse.SUPPRESS)
    p.add_argument("--model", help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        model = json.loads(args.model)
        if args.child == "build-fsdp2":
            return child_build_fsdp2(model)
        if args.child == "build-v1":
            return child_build_v1(model, args.world_size)
        if args.child == "loop":
            return child_loop(args.model_dir, model, args.steps, args.batch, args.seq, args.warmup)
        return child_trainer(args.model_dir, model, args.steps, args.batch, args.seq, args.warmup,
                             compiled=args.child == "trainer-compiled")
    if args.smoke:  # 2 ranks: the same paths at the fewest processes (the suite runs it)
        args.steps, args.warmup, args.seq, args.world_size = 6, 2, 32, 2
    report: dict = {"smoke": args.smoke}
    if args.part in ("all", "memory"):
        report["memory_rank0"] = memory(SMOKE_MEMORY_MODEL if args.smoke else MEMORY_MODEL, args.world_size)
    if args.part in ("all", "step"):
        report["step_time"] = step_time(SMOKE_STEP_MODEL if args.smoke else STEP_MODEL, args.steps, args.warmup,
                                        args.batch, args.seq, 2, compiled=not args.smoke)
    emit(report)  # one JSON line, last (python -m json.tool reads it)


if __name__ == "__main__":
    main()
