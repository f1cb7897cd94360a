"""``from_pretrained`` in an unmodified script under ``hf-xla-fsdp launch``, against the documented meta path, each in
its own child process: peak host memory above the imports for the same model and the same training steps.

    PJRT_DEVICE=CPU python benchmarks/lazy_load.py [--smoke] [--hidden 1024] [--layers 16] [--steps 3] [--workdir DIR]

Every child is ``hf-xla-fsdp launch --fsdp_config '{"xla": true}' benchmarks/lazy_load.py --child PATH ...`` (FSDP
v1, one process: the launcher runs the script in its own process), the script a stock one (``transformers.Trainer``):

* ``meta``: ``Trainer(model=DIR, ...)``, the documented path (``XlaFsdpTrainer(model=dir)``: built on meta, weights read
  block by block);
* ``from_pretrained``: ``Trainer(model=AutoModelForCausalLM.from_pretrained(DIR), ...)``, loaded lazily by the launch
  (hf_xla_fsdp/modeling/lazy.py) and built block by block when the Trainer wraps it;
* ``eager``: the same script with ``HF_XLA_FSDP_LAZY_LOAD=0``: from_pretrained loads the whole model on the host
  first (what the launch did before the lazy load).

Each child reads its baseline RSS once the imports are done and the XLA runtime has started, builds the Trainer
(VmHWM then: the model ready), trains ``--steps`` steps, and reports VmHWM (benchmarks/_harness.py) and the losses.
The parent prints one JSON object (MiB, seconds):
per path the peak above the baseline, the ratios to the meta path, and whether the three paths' losses are equal
(the same model and work). Target: from_pretrained within 1.15x of meta. ``--smoke``: a tiny model, 2 steps, meta
and from_pretrained only, for the suite (ratios of a few MiB mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _harness import emit, mib, run_json_child, vm_hwm_bytes

HERE = Path(__file__).resolve()
PATHS = ("meta", "from_pretrained", "eager")


def vm_rss_bytes() -> int:
    """Resident set size of this process now (VmRSS)."""
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) * 1024


def make_model(directory: Path, hidden: int, layers: int) -> dict:
    """A Llama of the given width and depth, seeded, saved with save_pretrained (safetensors)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=max(1, hidden // 64),
                         num_key_value_heads=max(1, hidden // 64), max_position_embeddings=256,
                         tie_word_embeddings=False)
    model = LlamaForCausalLM(config)
    model.save_pretrained(directory)
    return {"parameters": sum(p.numel() for p in model.parameters()),
            "model_mib": mib(sum(p.numel() * p.element_size() for p in model.parameters()))}


def child(path: str, directory: str, steps: int, out: str) -> None:
    """One launched process: imports and runtime, baseline, build, train, report."""
    import torch
    import torch_xla
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    torch_xla.device()  # the runtime started: part of the baseline, as the imports
    baseline = vm_rss_bytes()
    start = time.perf_counter()
    ids = torch.randint(1, 32000, (4 * steps, 64), generator=torch.Generator().manual_seed(1))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    args = TrainingArguments(output_dir=out, max_steps=steps, per_device_train_batch_size=2, logging_steps=1,
                             save_strategy="no", report_to="none", learning_rate=1e-4, seed=0, disable_tqdm=True)
    model = directory if path == "meta" else AutoModelForCausalLM.from_pretrained(directory)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    ready, ready_peak = time.perf_counter() - start, vm_hwm_bytes()  # the model loaded and sharded, nothing trained
    trainer.train()
    losses = [round(e["loss"], 6) for e in trainer.state.log_history if "loss" in e]
    emit({"path": path, "class": type(trainer).__name__, "baseline_mib": mib(baseline), "peak_mib": mib(vm_hwm_bytes()),
          "above_mib": mib(vm_hwm_bytes() - baseline), "ready_above_mib": mib(ready_peak - baseline),
          "ready_seconds": round(ready, 2),
          "seconds": round(time.perf_counter() - start, 2), "losses": losses})


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--smoke", action="store_true", help="a tiny model, 2 steps (the suite runs this)")
    p.add_argument("--hidden", type=int, default=1024, help="hidden size of the Llama (default: 1024)")
    p.add_argument("--layers", type=int, default=16, help="decoder layers (default: 16; ~790 MiB in fp32 with 1024)")
    p.add_argument("--steps", type=int, default=3, help="training steps per path (default: 3)")
    p.add_argument("--workdir", default=None, help="where the model is saved and kept (default: a temporary folder, removed)")
    p.add_argument("--child", choices=PATHS, default=None, help=argparse.SUPPRESS)
    p.add_argument("--model-dir", default=None, help=argparse.SUPPRESS)
    p.add_argument("--out", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args.child, args.model_dir, args.steps, args.out)
        return
    if args.smoke:
        args.hidden, args.layers, args.steps = 64, 2, 2
    if args.workdir:
        measure(args, Path(args.workdir))
    else:  # the model is ~790 MiB at the default size: none of it stays behind
        with tempfile.TemporaryDirectory(prefix="lazy_load_") as work:
            measure(args, Path(work))


def measure(args: argparse.Namespace, work: Path) -> None:
    """Save the model under ``work``, train it along each path in its own child and print the JSON report."""
    directory = work / "model"
    made = run_json_child(["-c", f"import sys, json; sys.path.insert(0, {str(HERE.parent)!r}); import lazy_load; "
                                 f"print(json.dumps(lazy_load.make_model(__import__('pathlib').Path({str(directory)!r}), "
                                 f"{args.hidden}, {args.layers})))"], name="make_model")
    results = {}
    for path in PATHS[:2] if args.smoke else PATHS:
        launch = ["-m", "hf_xla_fsdp.launch", "--fsdp_config", '{"xla": true}', str(HERE), "--child", path,
                  "--model-dir", str(directory), "--steps", str(args.steps), "--out", str(work / f"out-{path}")]
        env = {"HF_XLA_FSDP_LAZY_LOAD": "0" if path == "eager" else "1", "CPU_NUM_DEVICES": "1"}
        results[path] = run_json_child(launch, name=path, env=env)
    meta = results["meta"]["above_mib"]
    print(json.dumps({
        "model": {"hidden": args.hidden, "layers": args.layers, **{k: v for k, v in made.items()
                                                                   if k != "process_seconds"}},
        "steps": args.steps, "smoke": args.smoke, "paths": results,
        "ratio_from_pretrained_to_meta": round(results["from_pretrained"]["above_mib"] / meta, 3) if meta else None,
        "ready_ratio_from_pretrained_to_meta": round(results["from_pretrained"]["ready_above_mib"]
                                                     / results["meta"]["ready_above_mib"], 3),
        "ratio_eager_to_meta": round(results["eager"]["above_mib"] / meta, 3) if meta and "eager" in results else None,
        "losses_equal": len({json.dumps(r["losses"]) for r in results.values()}) == 1,
        "pid": os.getpid(),
    }))


if __name__ == "__main__":
    sys.exit(main())
