"""Graphs XLA compiles in each training step, for the three ways users train: a plain loop through
``XlaFsdpAccelerator.prepare``, the documented plugin loop, and ``XlaFsdpTrainer``.

    python compile_steps.py {accelerate,plugin,trainer} [--v2] [--steps N]

Prints one JSON line: ``{"compiles": [per step], "losses": [...]}``. The model's shape is unusual on purpose
(nothing else in a test process compiles the same graphs).
"""

import argparse
import json
import os
import sys
import tempfile

import torch
import torch_xla
import torch_xla.debug.metrics as met
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers


def compiles() -> int:
    data = met.metric_data("CompileTime")
    return int(data[0]) if data else 0


def config() -> LlamaConfig:
    return LlamaConfig(vocab_size=96, hidden_size=40, intermediate_size=72, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=2, max_position_embeddings=32)


def batches(steps: int) -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 96, (4, 24), generator=g)
        out.append({"input_ids": ids, "labels": ids.clone()})
    return out


def accelerate_loop(args: argparse.Namespace) -> dict:
    from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin

    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(version=2 if args.v2 else 1))
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    rows = [{k: v[i] for k, v in b.items()} for b in batches(args.steps) for i in range(4)]
    loader = torch.utils.data.DataLoader(rows, batch_size=4)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    marks, losses = [], []
    for batch in loader:
        # the device loader runs the previous step's pending graph when it hands out the next batch: count from
        # the start of one step to the start of the next
        marks.append(compiles())
        loss = model(**batch).loss
        accelerator.backward(loss)
        accelerator.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    torch_xla.sync()
    marks.append(compiles())
    return {"compiles": [b - a for a, b in zip(marks, marks[1:])], "losses": losses}


def plugin_loop(args: argparse.Namespace) -> dict:
    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.train import clip_grad_norm

    plugin = XlaFsdpPlugin(version=2 if args.v2 else 1)
    torch.manual_seed(0)
    model = plugin.build(config())
    optimizer = plugin.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    device = next(model.parameters()).device
    per_step, losses = [], []
    for batch in batches(args.steps):
        before = compiles()
        loss = model(**{k: v.to(device) for k, v in batch.items()}).loss
        loss.backward()
        clip_grad_norm(model, 1.0)
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()  # the end of a step in a loop without XLA's device loader
        losses.append(loss.item())
        per_step.append(compiles() - before)
    return {"compiles": per_step, "losses": losses}


def trainer(args: argparse.Namespace) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback, TrainingArguments

    from hf_xla_fsdp import XlaFsdpTrainer

    losses: list[float] = []
    marks: list[int] = []

    class Count(TrainerCallback):
        # a step's graph runs when its loss is read (logging, after on_step_end): count from step start to step start
        def on_step_begin(self, *a, **k):
            marks.append(compiles())

        def on_train_end(self, *a, **k):
            marks.append(compiles())

        def on_log(self, _args, _state, _control, logs=None, **k):
            if logs and "loss" in logs:
                losses.append(logs["loss"])

    rows = [{k: v[i].tolist() for k, v in b.items()} for b in batches(args.steps) for i in range(4)]
    torch.manual_seed(0)
    model = LlamaForCausalLM(config())
    fsdp_config = {"xla": True, "xla_fsdp_v2": bool(args.v2)}
    with tempfile.TemporaryDirectory() as out:
        targs = TrainingArguments(out, per_device_train_batch_size=4, max_steps=args.steps, logging_steps=1,
                                  save_strategy="no", report_to=[], fsdp="full_shard", fsdp_config=fsdp_config,
                                  dataloader_drop_last=True)
        XlaFsdpTrainer(model=model, args=targs, train_dataset=Dataset.from_list(rows), callbacks=[Count()]).train()
    return {"compiles": [b - a for a, b in zip(marks, marks[1:])], "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("loop", choices=["accelerate", "plugin", "trainer"])
    parser.add_argument("--v2", action="store_true")
    parser.add_argument("--steps", type=int, default=4)
    args = parser.parse_args()
    if args.v2:
        import torch_xla.runtime as xr

        xr.use_spmd()
    result = {"accelerate": accelerate_loop, "plugin": plugin_loop, "trainer": trainer}[args.loop](args)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
