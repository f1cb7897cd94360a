"""Helpers that make real multi-rank FSDP v1 state in one process (see XLA_ON_CPU.md)."""

from __future__ import annotations

from pathlib import Path

import torch

from hf_xla_fsdp import XlaFsdpPlugin
from hf_xla_fsdp.checkpoint import commit_checkpoint, write_rank_file


def build_ranks(config, world: int, seed: int = 0, **settings):
    """The FSDP models of every rank of a world of ``world`` ranks, same seed."""
    models = []
    for rank in range(world):
        torch.manual_seed(seed)
        plugin = XlaFsdpPlugin(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world,
                               **settings)
        models.append(plugin.build(config, progress=False))
    return models


def fake_adam_state(models, seed: int = 0):
    """Real AdamW state on every rank without collectives: a step on random gradients of the shards."""
    gen = torch.Generator().manual_seed(seed)
    optimizers = []
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()
        optimizers.append(opt)
    return optimizers


def save_ranks(path: Path, models, optimizers=None, step: int = 0) -> Path:
    """Save every rank's files, then commit, exactly as N processes would."""
    optimizers = optimizers or [None] * len(models)
    for model, opt in zip(models, optimizers):
        write_rank_file(path, model, opt, step=step)
    return commit_checkpoint(path, len(models))


def save_torch_xla_style(prefix: str, models, optimizers=None) -> list[Path]:
    """torch_xla's MNIST example format: ``<prefix>_rank-00000000-of-00000004.pth``."""
    paths = []
    for rank, model in enumerate(models):
        ckpt = {"model": {k: v.cpu() for k, v in model.state_dict().items()},
                "shard_metadata": model.get_shard_metadata()}
        if optimizers:
            ckpt["optimizer"] = optimizers[rank].state_dict()
        path = Path(f"{prefix}_rank-{rank:08d}-of-{len(models):08d}.pth")
        torch.save(ckpt, path)
        paths.append(path)
    return paths


def save_trainer_style(directory: Path, models) -> list[Path]:
    """transformers Trainer's XLA FSDP format: ``rank{i}-of-{N}-pytorch_model.bin``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, model in enumerate(models):
        path = directory / f"rank{rank}-of-{len(models)}-pytorch_model.bin"
        torch.save({"model": {k: v.cpu() for k, v in model.state_dict().items()},
                    "shard_metadata": model.get_shard_metadata()}, path)
        paths.append(path)
    return paths
