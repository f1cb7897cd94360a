"""One training run of the tiny Llama on engine fsdp2 (under torchrun) or on XLA FSDP v2 (one SPMD process).

    torchrun --nproc_per_node N tests/scripts/fsdp2_worker.py fsdp2 --out DIR [--steps S] [--save-at K] [--resume CKPT]
    CPU_NUM_DEVICES=4 python tests/scripts/fsdp2_worker.py v2 --out DIR [...]

Both engines train on the same global batches (:func:`batch`): fsdp2 processes take their rows of each, SPMD splits
it over its devices. Rank 0 writes ``DIR/result.json``: the loss of every step (the mean over the whole global batch),
and with ``--save-at K`` the checkpoint ``DIR/ckpt`` of the state after step K, plus ``DIR/state-K.safetensors`` (the
full model then, gathered) to compare consolidations with. ``--resume CKPT`` loads a checkpoint (either engine's) and
continues from its step.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("USE_TORCH_XLA", "0")  # fsdp2: transformers and accelerate stay off torch_xla
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import torch  # noqa: E402
from helpers import tiny_llama  # noqa: E402

from hf_xla_fsdp import XlaFsdpPlugin  # noqa: E402
from hf_xla_fsdp.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from hf_xla_fsdp.train import arithmetic_lm_batches, train_step  # noqa: E402

GLOBAL_BATCH = 8
SEQ = 16
SEED = 0


def batch(step: int) -> dict[str, torch.Tensor]:
    """The global batch of step ``step`` (1-based), the same in every process and engine."""
    batches = arithmetic_lm_batches(128, SEQ, GLOBAL_BATCH, seed=SEED)
    for _ in range(step - 1):
        next(batches)
    return next(batches)


def run_fsdp2(args: argparse.Namespace, plugin: XlaFsdpPlugin) -> tuple[list[float], torch.nn.Module]:
    import torch.distributed as dist
    from safetensors.torch import save_file

    torch.manual_seed(SEED)
    model = plugin.build(tiny_llama(), progress=False)
    rank, world = dist.get_rank(), dist.get_world_size()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    first = 1
    if args.resume:
        first = load_checkpoint(args.resume, model, optimizer)["step"] + 1
    rows = GLOBAL_BATCH // world
    losses = []
    for step in range(first, first + args.steps):
        mine = {k: v[rank * rows:(rank + 1) * rows] for k, v in batch(step).items()}
        loss = train_step(model, mine, optimizer).detach()
        dist.all_reduce(loss)  # equal token counts per rank: the mean of the means is the global batch's mean
        losses.append(loss.item() / world)
        if step == args.save_at:
            save_checkpoint(Path(args.out) / "ckpt", model, optimizer, step=step, async_save=args.async_save)
            full = {n: p.full_tensor() for n, p in model.state_dict().items()}  # every rank takes part in the gathers
            if rank == 0:
                save_file({n: t.contiguous() for n, t in full.items()}, str(Path(args.out) / f"state-{step}.safetensors"))
    from hf_xla_fsdp.checkpoint import wait_for_pending_save

    wait_for_pending_save()
    if args.evaluation_check:
        args.evaluation = evaluation_check(plugin, rank, world)
    if rank == 0:
        assert "torch_xla" not in sys.modules, "engine fsdp2 imported torch_xla"
    return losses, model


def evaluation_check(plugin: XlaFsdpPlugin, rank: int, world: int) -> dict:
    """A model built in evaluation mode (a reference model: frozen, no optimizer state): what it holds, and its loss on
    step 1's global batch (the freshly initialized model's, as eager training's first loss)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    from hf_xla_fsdp.engines import in_evaluation_mode
    from hf_xla_fsdp.session import XlaFsdpSession

    torch.manual_seed(SEED)
    frozen = XlaFsdpSession(plugin).build_model(tiny_llama(), evaluation_mode=True, progress=False)
    rows = GLOBAL_BATCH // world
    loss = frozen(**{k: v[rank * rows:(rank + 1) * rows] for k, v in batch(1).items()}).loss.detach()
    dist.all_reduce(loss)
    return {"evaluation_mode": in_evaluation_mode(frozen), "training": frozen.training,
            "trainable": sum(p.requires_grad for p in frozen.parameters()),
            "sharded": all(isinstance(p, DTensor) for p in frozen.parameters()),
            "loss_has_graph": loss.requires_grad, "loss": loss.item() / world,
            # untied embeddings and LM head: units of their own, so a forward gathers one at a time
            "ends_are_units": [isinstance(m, FSDPModule) for m in (frozen.get_input_embeddings(),
                                                                   frozen.get_output_embeddings())]}


def run_v2(args: argparse.Namespace, plugin: XlaFsdpPlugin) -> list[float]:
    import torch_xla

    from hf_xla_fsdp.engines import v2 as spmd

    torch.manual_seed(SEED)
    model = plugin.build(tiny_llama(), progress=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    plugin.prepare_optimizer(model, optimizer)
    first = 1
    if args.resume:
        first = load_checkpoint(args.resume, model, optimizer)["step"] + 1
    mesh = spmd.get_mesh(plugin)
    losses = []
    for step in range(first, first + args.steps):
        on_device = spmd.shard_batch({k: v.to(torch_xla.device()) for k, v in batch(step).items()}, mesh)
        losses.append(train_step(model, on_device, optimizer).item())
        if step == args.save_at:
            save_checkpoint(Path(args.out) / "ckpt", model, optimizer, step=step)
    return losses


def main() -> None:
    """Run one training (see the module docstring)."""
    p = argparse.ArgumentParser()
    p.add_argument("engine", choices=["fsdp2", "v2"])
    p.add_argument("--out", required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--resume", default=None)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--async-save", action="store_true")
    p.add_argument("--evaluation-check", action="store_true", help="fsdp2: also build a model in evaluation mode")
    p.add_argument("--settings", default="{}", help="plugin settings (JSON)")
    args = p.parse_args()
    settings = json.loads(args.settings)
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.engine == "fsdp2":
        losses, _ = run_fsdp2(args, XlaFsdpPlugin(engine="fsdp2", **settings))
        import torch.distributed as dist

        write = dist.get_rank() == 0
    else:
        losses, write = run_v2(args, XlaFsdpPlugin(engine="xla", version=2, **settings)), True
    if write:
        (Path(args.out) / "result.json").write_text(json.dumps({"losses": losses,
                                                                **({"evaluation": args.evaluation}
                                                                   if getattr(args, "evaluation", None) else {})}))


if __name__ == "__main__":
    main()
