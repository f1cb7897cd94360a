"""What the tests share: tiny configs of real transformers models, real multi-rank FSDP v1 state made in
one process (see XLA_ON_CPU.md), torch_xla's own consolidation as the reference, and a runner of Python
subprocesses with the XLA environment.

Test modules import it as ``from helpers import ...`` (pytest puts tests/ on sys.path); so do the
scripts the tests start (tests/spmd_worker.py), which cannot import conftest's fixtures.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import torch
from transformers import BertConfig, GPT2Config, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]

# hf_xla_fsdp and torch_xla are imported inside the functions below: conftest imports this module, and
# a test process should load the package only when a test uses it (some tests check what gets imported)


def tiny_llama(**kw) -> LlamaConfig:
    """A 3-layer Llama of a few hundred kB; ``kw`` overrides any field."""
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_gpt2(**kw) -> GPT2Config:
    """A 3-layer GPT-2 (tied embeddings); ``kw`` overrides any field."""
    base = dict(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return GPT2Config(**base)


def tiny_bert(**kw) -> BertConfig:
    """A 3-layer BERT; ``kw`` overrides any field."""
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=64)
    base.update(kw)
    return BertConfig(**base)


def consolidate(models) -> dict[str, torch.Tensor]:
    """Full CPU state dict from the FSDP models of every rank, via torch_xla's own consolidation."""
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    models = models if isinstance(models, (list, tuple)) else [models]
    state_dicts = [{k: v.cpu() for k, v in m.state_dict().items()} for m in models]
    return consolidate_sharded_state_dicts(state_dicts, models[0].get_shard_metadata())


def build_ranks(config, world: int, seed: int = 0, **settings) -> list[torch.nn.Module]:
    """The FSDP models of every rank of a world of ``world`` ranks, same seed."""
    from hf_xla_fsdp import XlaFsdpPlugin

    models = []
    for rank in range(world):
        torch.manual_seed(seed)
        plugin = XlaFsdpPlugin(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world,
                               **settings)
        models.append(plugin.build(config, progress=False))
    return models


def fake_adam_state(models, seed: int = 0) -> list[torch.optim.Optimizer]:
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
    from hf_xla_fsdp.checkpoint import commit_checkpoint, write_rank_file

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


def xla_env(*, devices: int | None = 1, env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment for a child on XLA:CPU with ``devices`` devices.

    ``devices=None`` leaves CPU_NUM_DEVICES as inherited; in ``env`` a value of None removes the variable.
    """
    out = dict(os.environ, PJRT_DEVICE="CPU", TOKENIZERS_PARALLELISM="false")
    if devices is not None:
        # the device count is fixed when the runtime starts: only a fresh process can have another one
        out["CPU_NUM_DEVICES"] = str(devices)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run_python(args: Sequence[str | os.PathLike], *, devices: int | None = 1,
               env: Mapping[str, str | None] | None = None, cwd: Path = ROOT,
               timeout: float = 900) -> subprocess.CompletedProcess[str]:
    """``python *args`` with this interpreter and the XLA environment (see ``xla_env``), output captured.

    A console script of the venv (``accelerate``, ``hf-xla-fsdp``) runs as ``[script, ...]``: the same
    interpreter and the same ``sys.argv`` as when its shebang starts it.
    """
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=xla_env(devices=devices, env=env),
                          capture_output=True, text=True, timeout=timeout)
