"""A stock transformers Trainer script for CPU, with the one-import swap to engine fsdp2.

    torchrun --nproc_per_node 4 tests/scripts/user/fsdp2_trainer.py --model DIR --output_dir OUT [--optim sgd adamw_torch+bf16]
    python tests/scripts/user/fsdp2_trainer.py --stock ...       # the same script on the stock Trainer, one process

The hf_xla_fsdp version differs from the stock one in the import below, in passing the model as its directory
(``XlaFsdpTrainer(model=DIR)``: built block by block, never whole in memory) and in ``fsdp_config={"engine":
"fsdp2"}``. Each run trains each optimizer named by ``--optim`` (one after the other, a fresh trainer each, in
OUT/<name>; ``NAME+bf16`` trains in bf16), logs every step's loss, saves ``checkpoint-N`` every ``--save_steps`` and
the final model; rank 0 writes OUT/<name>/losses.json (with the graphs compiled in each step). ``--resume CKPT``
continues a run from its checkpoint. ``--max_steps`` takes one count for every run or one per run; every process
writes OUT/process-<RANK>.json (its pid, parent pid and torchrun's placement variables) before training.
``--compile`` adds ``"compile": true`` (each block compiled by torch.compile).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
from datasets import Dataset
from transformers import AutoModelForCausalLM, TrainingArguments

STOCK = "--stock" in sys.argv
if STOCK:
    from transformers import Trainer
else:
    from hf_xla_fsdp import XlaFsdpTrainer as Trainer  # <- the swap


def data(samples: int = 96, length: int = 32, vocab: int = 128) -> Dataset:
    """Arithmetic sequences (learnable, every example the same length: the same tokens per process)."""
    g = torch.Generator().manual_seed(0)
    start = torch.randint(0, vocab, (samples, 1), generator=g)
    step = torch.randint(1, 8, (samples, 1), generator=g)
    ids = ((start + step * torch.arange(length)) % vocab).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--output_dir", required=True)
    p.add_argument("--optim", nargs="+", default=["adamw_torch"])
    p.add_argument("--per_device_train_batch_size", type=int, default=2)
    p.add_argument("--max_steps", type=int, nargs="+", default=[6])
    p.add_argument("--save_steps", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--stock", action="store_true")
    p.add_argument("--compile", action="store_true", help='fsdp_config {"engine": "fsdp2", "compile": true}')
    a = p.parse_args()
    steps = a.max_steps * len(a.optim) if len(a.max_steps) == 1 else a.max_steps
    os.makedirs(a.output_dir, exist_ok=True)
    with open(os.path.join(a.output_dir, f"process-{os.environ.get('RANK', '0')}.json"), "w") as fh:
        json.dump({"pid": os.getpid(), "ppid": os.getppid(), **{k: os.environ.get(k) for k in (
            "RANK", "LOCAL_RANK", "GROUP_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE")}}, fh)
    for run, max_steps in zip(a.optim, steps):
        optim, _, precision = run.partition("+")
        args = TrainingArguments(
            output_dir=os.path.join(a.output_dir, run), optim=optim, learning_rate=1e-2 if optim == "sgd" else 1e-3,
            per_device_train_batch_size=a.per_device_train_batch_size, max_steps=max_steps, logging_steps=1,
            save_strategy="steps" if a.save_steps else "no", save_steps=a.save_steps or 500, report_to=[], seed=0,
            bf16=precision == "bf16", use_cpu=True, disable_tqdm=True, lr_scheduler_type="constant",
            **({} if a.stock else {"fsdp_config": {"engine": "fsdp2", **({"compile": True} if a.compile else {})}}))
        model = AutoModelForCausalLM.from_pretrained(a.model) if a.stock else a.model
        trainer = Trainer(model=model, args=args, train_dataset=data())
        trainer.train(resume_from_checkpoint=a.resume)
        trainer.save_model()
        if trainer.is_world_process_zero():
            losses = {e["step"]: e["loss"] for e in trainer.state.log_history if "loss" in e}
            graphs = {e["step"]: e["graphs_compiled"] for e in trainer.state.log_history if "graphs_compiled" in e}
            with open(os.path.join(args.output_dir, "losses.json"), "w") as fh:
                json.dump({"losses": losses, "graphs_compiled": graphs, "torch_xla_imported": "torch_xla" in sys.modules,
                           "world_size": args.world_size}, fh)


if __name__ == "__main__":
    main()
