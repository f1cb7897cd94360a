"""FSDP v1: ``XlaFullyShardedDataParallel``, one process (replica) per device.

Each parameter is flattened, padded to a multiple of 128 per rank and cut into equal rank shards;
ZeRO-3 nests a unit per block, ZeRO-2 wraps the root only. Rank files hold the rank's own
state dict (flat shards) with its ``get_shard_metadata()``; a different world size reads only the
rows of each saved shard that the new shard covers.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional

import torch
from torch import nn

from ..checkpoint.layout import MODEL_PREFIX
from ..checkpoint.readers import (
    LAYOUT_FLAT,
    RankFile,
    clean_name,
    encode_shard_metadata,
    gather_rows,
    open_checkpoint,
    open_own,
    same_parameters,
    shard_structure,
)
from ..checkpoint.state import load_optimizer_state, optimizer_meta, optimizer_tensor_key, saved_optimizer
from ..errors import CheckpointError, ConfigError
from .base import Engine, RankState, Restored, host_copies, host_copy

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

class XlaFsdpV1(Engine):
    """``XlaFullyShardedDataParallel`` (ZeRO-2 / ZeRO-3) over the replica processes."""

    version = 1
    name = "xla_fsdp_v1"
    title = "FSDP v1 (XlaFullyShardedDataParallel)"
    checkpoint_layout = LAYOUT_FLAT

    def check_launch(self, distributed_type: str, source: str) -> None:
        if distributed_type not in ("XLA", "TPU"):
            raise ConfigError(f"distributed_type={distributed_type!r} in {source}: XLA FSDP needs distributed_type: XLA")

    def unit_class(self) -> type:
        from torch_xla.distributed.fsdp import XlaFullyShardedDataParallel

        return XlaFullyShardedDataParallel

    def inner_wrappers(self) -> tuple[type, ...]:
        from torch_xla.distributed.fsdp.xla_flatten_params_wrapper import XlaFlattenParamsWrapper

        return (XlaFlattenParamsWrapper,)

    def wrap_block(self, block: nn.Module, plugin: "XlaFsdpPlugin", nested: bool) -> nn.Module:
        block = self.checkpoint_block(block, plugin)
        return self.unit_class()(block, **plugin.fsdp_kwargs()) if nested else block

    def wrap_root(self, model: nn.Module, plugin: "XlaFsdpPlugin") -> nn.Module:
        if getattr(getattr(model, "config", None), "use_cache", False) and plugin.activation_checkpointing:
            model.config.use_cache = False  # a KV cache is incompatible with recomputed activations
        return self.unit_class()(model, **plugin.fsdp_kwargs())

    def reduce_norm(self, model: nn.Module, local: torch.Tensor, norm_type: float) -> torch.Tensor:
        # each rank holds other shards: combine the local p-norms over the sharding group
        if getattr(model, "world_size", 1) <= 1:
            return local
        import torch_xla.core.xla_model as xm

        groups = getattr(model, "sharding_groups", None)
        if norm_type == math.inf:
            return model.all_reduce_op(xm.REDUCE_MAX, local, groups=groups)
        return model.all_reduce_op(xm.REDUCE_SUM, local ** norm_type, groups=groups) ** (1.0 / norm_type)

    def rank_world(self, model: nn.Module) -> tuple[int, int]:
        md = model.get_shard_metadata()
        return int(md["rank"]), int(md["world_size"])

    def _origins(self, model: nn.Module) -> dict[str, tuple[str, list[str]]]:
        """Wrapped name -> (its own name without wrappers, the user's names of every parameter it holds)."""
        md = model.get_shard_metadata()
        shard_info, flatten_info = md["shard_info"], md["flatten_info"]
        out = {}
        for name, _ in model.named_parameters():
            parts = name.split(".")
            idx = next((i for i, p in enumerate(parts) if p.startswith("_fsdp_shard")), None)
            if idx is None:
                out[name] = (clean_name(name), [clean_name(name)])
                continue
            prefix, suffix = ".".join(parts[:idx]), ".".join(parts[idx:])
            # parameter names pass through the flatten wrapper (_fpw_module); shard_info keys do not
            prefix = prefix.replace("_fpw_module.", "").removesuffix("._fpw_module")
            try:
                orig = shard_info[prefix][suffix]["_orig_name"]
            except KeyError:
                raise ConfigError(f"{name} has no entry in the FSDP shard metadata") from None
            full = f"{prefix}.{orig}" if prefix else orig
            if full in flatten_info:
                base = full.rsplit(".", 1)[0]
                members = [clean_name(f"{base}.{member}") for member in flatten_info[full][0]]
            else:
                members = [clean_name(full)]
            out[name] = (clean_name(full), members)
        return out

    def original_names(self, model: nn.Module) -> dict[str, str]:
        return {name: own for name, (own, _) in self._origins(model).items()}

    def parameter_origins(self, model: nn.Module) -> dict[str, list[str]]:
        return {name: members for name, (_, members) in self._origins(model).items()}

    # ----------------------------------------------------------------- checkpoints
    def rank_state(self, model: nn.Module, optimizer: Optional[torch.optim.Optimizer]) -> RankState:
        """The rank's state dict (flat shards) and optimizer state, one tensor at a time from the device."""
        tensors: dict[str, torch.Tensor] = {MODEL_PREFIX + k: v for k, v in model.state_dict().items()}
        optim = None
        if optimizer is not None:
            optim, optim_tensors = optimizer_meta(model, optimizer, self.checkpoint_name)
            tensors.update(optim_tensors)
        specs = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        return RankState(specs, lambda name: host_copy(tensors[name]),
                         {"shard_metadata": encode_shard_metadata(model.get_shard_metadata()), "optimizer": optim},
                         produce_many=lambda names: host_copies([tensors[n] for n in names]))

    def restore(self, ckpt_dir: Path, marker: dict[str, Any], model: nn.Module,
                optimizer: Optional[torch.optim.Optimizer]) -> Restored:
        """This rank's own file when the world size is unchanged, else only the rows its shards cover."""
        saved_world = int(marker["world_size"])
        rank, world = self.rank_world(model)
        current = model.get_shard_metadata()
        if saved_world == world:
            own = open_own(ckpt_dir, marker, rank, world)
            if shard_structure(own.shard_metadata) != shard_structure(current):
                raise CheckpointError(f"{ckpt_dir} was saved from a different model or different FSDP settings "
                                      "(shard layout differs); it cannot be loaded into this model")
            files, first = None, own
        else:
            ranks = open_checkpoint(ckpt_dir)
            if not same_parameters(ranks.shard_metadata, current):
                raise CheckpointError(f"{ckpt_dir} was saved from a different model or different FSDP settings "
                                      "(parameters or flattening differ); it cannot be resharded into this model")
            files, first = ranks.files, ranks.files[0]

        def read(name: str, like: torch.Tensor) -> torch.Tensor:
            if files is None:
                return first.get(name)
            is_buffer = name.startswith(MODEL_PREFIX) and "_fsdp_shard" not in name
            if like.dim() == 0 or is_buffer:
                return first.get(name)  # buffers and scalars are replicated
            rows = like.shape[0]
            return gather_rows(files, name, rank * rows, (rank + 1) * rows).view(like.shape)

        def verified() -> None:  # checksums of the tensors read only in part: before anything is loaded
            for f in files or [first]:
                f.finish_verification()

        state = {k: read(MODEL_PREFIX + k, v) for k, v in model.state_dict().items()}
        verified()
        model.load_state_dict(state)
        if optimizer is not None:
            self._restore_optimizer(optimizer, model, first, read, verified)
        return Restored(first.meta, first, {"saved_world_size": saved_world})

    def _restore_optimizer(self, optimizer: torch.optim.Optimizer, model: nn.Module, first: RankFile, read: Any,
                           verified: Any) -> None:
        saved = saved_optimizer(first.meta, model, optimizer, self.checkpoint_name)
        params = dict(model.named_parameters())
        flat_names = [n for group in saved["param_names"] for n in group]
        state: dict[int, dict[str, Any]] = {}
        for name in first.names():
            key = optimizer_tensor_key(name)
            if key is not None:
                idx, state_name = key
                like = params[flat_names[idx]] if first.shape(name) else torch.empty(())  # 0-d state is replicated
                state.setdefault(idx, {})[state_name] = read(name, like)
        verified()
        load_optimizer_state(optimizer, saved, state)
