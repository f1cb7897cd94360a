"""Low-precision parameters with fp32 master copies that the optimizer updates (FSDP v2's ``compute_dtype``).

``SpmdFullyShardedDataParallel`` has no mixed precision of its own, and XLA autocast breaks SDPA
attention on torch_xla 2.9 (query/key stay fp32, value becomes bf16). So with ``compute_dtype``
the engine stores the parameters themselves in that dtype (half the parameter and activation
bytes on every device) and keeps an fp32 copy of each *trainable* one, sharded the same way:

* the optimizer is re-pointed at the fp32 copies (:func:`attach`); a step pre-hook moves the
  low-precision gradients into them, a post-hook copies the updated values back;
* frozen parameters (a LoRA base) have no copy: they simply live in the low precision;
* checkpoints save the fp32 copies under the parameters' names, so resuming is exact and the
  optimizer state lines up with them.
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch import nn

from ..errors import ConfigError

_ATTR = "_hf_xla_fsdp_master_weights"


def _same_sharding(target: torch.Tensor, like: torch.Tensor) -> None:
    """Give ``target`` the SPMD sharding of ``like`` (nothing when ``like`` has none)."""
    import torch_xla

    if like.device.type != "xla" or not torch_xla._XLAC._get_xla_sharding_spec(like):
        return
    torch_xla._XLAC._xla_mark_sharding(target, torch_xla._XLAC._get_xla_op_sharding(like))


class MasterWeights:
    """The fp32 copies of a model's trainable low-precision parameters, and the optimizers that update them."""

    def __init__(self, dtype: torch.dtype) -> None:
        self.dtype = dtype
        self.pairs: list[tuple[nn.Parameter, torch.Tensor]] = []
        self._by_param: dict[int, torch.Tensor] = {}
        self._optimizers: "weakref.WeakSet[torch.optim.Optimizer]" = weakref.WeakSet()

    def master(self, param: torch.Tensor) -> Optional[torch.Tensor]:
        """The fp32 copy of ``param`` (None for a frozen or full-precision parameter)."""
        return self._by_param.get(id(param))

    def attached(self, optimizer: torch.optim.Optimizer) -> bool:
        """True once ``optimizer`` updates the fp32 copies."""
        return optimizer in self._optimizers

    @torch.no_grad()
    def restack(self, layers: list[torch.Tensor], stacked: nn.Parameter) -> None:
        """``scan_layers`` moved the parameters ``layers`` into ``stacked``: their fp32 copies become one stacked
        copy, sharded like ``stacked`` (nothing when they had none: frozen)."""
        copies = [self._by_param.pop(id(p), None) for p in layers]
        if any(c is None for c in copies):
            return
        master = torch.stack(copies)
        _same_sharding(master, stacked)
        gone = {id(p) for p in layers}
        self.pairs = [(p, m) for p, m in self.pairs if id(p) not in gone] + [(stacked, master)]
        self._by_param[id(stacked)] = master

    @torch.no_grad()
    def sync_params(self) -> None:
        """Copy every fp32 value into its low-precision parameter (after a step or a restore)."""
        for param, master in self.pairs:
            # a new tensor, not param.copy_(master): an in-place write makes functionalization regenerate the
            # parameter's views in the next forward, in another order than in step 1, so step 2's graphs hash
            # differently from step 1's and XLA compiles them again (issue 46 item 5)
            low = master.to(self.dtype)
            _same_sharding(low, param)
            param.data = low

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        for param, master in self.pairs:
            master.grad = None if param.grad is None else param.grad.to(master.dtype)
            param.grad = None  # consumed: the next backward starts from zero, whoever zeroes what

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        self.sync_params()
        for _, master in self.pairs:
            master.grad = None


def cast_parameters(model: nn.Module, dtype: torch.dtype) -> MasterWeights:
    """Store ``model``'s floating-point parameters in ``dtype``, keeping fp32 copies of the trainable ones.

    Ties survive (each parameter object is cast once, in place) and so does every SPMD sharding.
    """
    masters = MasterWeights(dtype)
    seen: set[int] = set()
    with torch.no_grad():
        for param in model.parameters():  # each tied parameter once
            if id(param) in seen or not param.is_floating_point() or param.dtype == dtype:
                continue
            seen.add(id(param))
            if param.requires_grad:
                # requires_grad: it is what the optimizer trains (create_state makes state only for such tensors)
                master = param.detach().clone().requires_grad_(True)
                _same_sharding(master, param)
                masters.pairs.append((param, master))
                masters._by_param[id(param)] = master
            low = param.data.to(dtype)
            _same_sharding(low, param)
            param.data = low
    setattr(model, _ATTR, masters)
    return masters


def master_weights(model: nn.Module) -> Optional[MasterWeights]:
    """The :class:`MasterWeights` of a wrapped model (None when its parameters are full precision)."""
    return getattr(model, _ATTR, None)


def attach(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """Make ``optimizer`` update the fp32 copies of ``model``'s parameters (idempotent; no-op without copies)."""
    masters = master_weights(model)
    if masters is None or masters.attached(optimizer):
        return
    if any(masters.master(p) is not None for p in optimizer.state):
        raise ConfigError("the optimizer already stepped on the low-precision parameters; prepare it (accelerate's "
                          "prepare, or plugin.prepare_optimizer) before its first step")
    for group in optimizer.param_groups:
        group["params"] = [masters.master(p) if masters.master(p) is not None else p for p in group["params"]]
    optimizer.register_step_pre_hook(masters._before_step)
    optimizer.register_step_post_hook(masters._after_step)
    masters._optimizers.add(optimizer)
