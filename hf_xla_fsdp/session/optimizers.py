"""Optimizers built before wrapping: pointed at the sharded parameters that now hold their originals.

Scripts written for plain accelerate build the optimizer from the unwrapped model (any number of groups: weight
decay / no decay ...) and prepare both; wrapping replaces every parameter by its shard (a flat parameter may hold
several, a tied weight is kept once). These helpers carry each group over, keeping its hyperparameters.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import torch
from torch import nn

from ..engines import engine_of
from ..errors import ConfigError

logger = logging.getLogger(__name__)


def prepare_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Ready ``optimizer`` (built from the wrapped ``model``'s parameters) for the model's engine; returns it.

    Needed only in a hand-written loop: accelerate's ``prepare`` and the Trainer call it. With FSDP v2 and
    ``compute_dtype`` it makes the optimizer update the fp32 master copies of the parameters. It creates the
    optimizer's state on the devices (:func:`create_state`), so the first step compiles the same graph as the next.
    """
    engine = engine_of(model)
    engine.prepare_optimizer(model, optimizer)
    if create_state(optimizer, engine.zeros_like):
        engine.sync()  # the state becomes device data now, not part of the first step's graph
    return optimizer


def _adam_state(param: torch.Tensor, group: dict[str, Any], zeros_like: Callable[[torch.Tensor], torch.Tensor]
                ) -> dict[str, torch.Tensor]:
    from torch.optim.optimizer import _get_scalar_dtype

    # the same tensors Adam._init_group makes (step on the host unless capturable or fused)
    step = (torch.zeros((), dtype=_get_scalar_dtype(is_fused=group.get("fused")), device=param.device)
            if group.get("capturable") or group.get("fused") else torch.tensor(0.0, dtype=_get_scalar_dtype()))
    state = {"step": step, "exp_avg": zeros_like(param), "exp_avg_sq": zeros_like(param)}
    if group.get("amsgrad"):
        state["max_exp_avg_sq"] = zeros_like(param)
    return state


def _sgd_state(param: torch.Tensor, group: dict[str, Any], zeros_like: Callable[[torch.Tensor], torch.Tensor]
               ) -> dict[str, torch.Tensor]:
    # SGD's first step sets buf = grad; a zero buffer gives momentum * 0 + grad, the same, only without dampening
    return {"momentum_buffer": zeros_like(param)}


def _state_maker(optimizer: torch.optim.Optimizer) -> Any:
    if isinstance(optimizer, torch.optim.Adam):  # AdamW included: it subclasses Adam
        return _adam_state
    if isinstance(optimizer, torch.optim.SGD) and all(
            g.get("momentum", 0) and not g.get("dampening", 0) for g in optimizer.param_groups):
        return _sgd_state
    return None


def create_state(optimizer: torch.optim.Optimizer,
                 zeros_like: Callable[[torch.Tensor], torch.Tensor] = torch.zeros_like) -> bool:
    """Create now the state ``optimizer`` would create lazily in its first step; True when it made any.

    An optimizer that makes its state inside step 1 traces a different graph in step 1 (state created) than in
    step 2 (state read), so XLA compiles the whole training step twice. With the state on the devices first, step 1
    is step 2's graph. ``zeros_like`` makes a tensor shaped and placed (sharded) like a parameter. Adam, AdamW and
    SGD with momentum (no dampening) are known; other optimizers keep their lazy state (step 2 compiles once more).
    """
    maker = _state_maker(optimizer)
    if maker is None:
        logger.info("%s creates its state in its first step: the second step compiles its graph once more",
                    type(optimizer).__name__)
        return False
    made = False
    with torch.no_grad():
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.requires_grad and not optimizer.state.get(param):
                    optimizer.state[param] = maker(param, group, zeros_like)
                    made = True
    return made


def original_parameters(model: nn.Module) -> dict[str, int]:
    """The user's parameter name -> ``id`` of the parameter, before wrapping (tied names included)."""
    originals: dict[str, int] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        originals.setdefault(name, id(param))
    return originals


def moved_parameters(originals: dict[str, int], wrapped: nn.Module) -> dict[int, nn.Parameter]:
    """``id(original parameter)`` -> the sharded parameter of ``wrapped`` that now holds it."""
    params = dict(wrapped.named_parameters())
    moved: dict[int, nn.Parameter] = {}
    for name, members in engine_of(wrapped).parameter_origins(wrapped).items():
        for member in members:
            if member in originals:
                moved[originals[member]] = params[name]
    return moved


def _hyperparameters(group: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in group.items() if k != "params"}


def repoint_optimizer(optimizer: torch.optim.Optimizer, moved: dict[int, nn.Parameter],
                      sharded: set[int]) -> list[nn.Parameter]:
    """Point every group of ``optimizer`` at the sharded parameters; returns the parameters it could not place.

    ``moved`` maps ``id(original parameter)`` to the sharded parameter that now holds it; ``sharded``
    holds the ids of every prepared model's parameters. A flat parameter (``flatten_parameters``)
    holds several originals: they must all sit in groups with the same hyperparameters.
    """
    unknown: list[nn.Parameter] = []
    owner: dict[int, int] = {}
    new_groups: list[list[nn.Parameter]] = []
    for index, group in enumerate(optimizer.param_groups):
        params: list[nn.Parameter] = []
        for p in group["params"]:
            new = p if id(p) in sharded else moved.get(id(p))
            if new is None:
                unknown.append(p)
                params.append(p)
                continue
            if id(new) in owner:
                first = optimizer.param_groups[owner[id(new)]]
                if owner[id(new)] != index and _hyperparameters(first) != _hyperparameters(group):
                    raise ConfigError(
                        f"flatten_parameters puts parameters of optimizer groups {owner[id(new)]} and {index} (different "
                        "hyperparameters, e.g. weight decay) into one flat parameter; set flatten_parameters: false, or "
                        "give those parameters the same group settings")
                continue  # already in the optimizer through another member of its flat group (or a tied name)
            owner[id(new)] = index
            params.append(new)
        new_groups.append(params)
    if optimizer.state and any(id(p) in moved for group in optimizer.param_groups for p in group["params"]):
        raise ConfigError("the optimizer already holds state (it has stepped) for the unwrapped model's parameters; "
                          "prepare it before its first step")
    for group, params in zip(optimizer.param_groups, new_groups):
        group["params"] = params
    return unknown


def updated_parameter_ids(models: list[nn.Module]) -> set[int]:
    """Ids of what a prepared optimizer may update for ``models`` (their parameters, or what the engine updates
    in their place, e.g. fp32 master copies)."""
    return {id(t) for m in models for t in engine_of(m).optimizer_targets(m)}


def check_optimizer_parameters(unknown: list[nn.Parameter]) -> None:
    """One line when a prepared optimizer holds parameters of no prepared model."""
    if unknown:
        shapes = ", ".join(str(list(p.shape)) for p in unknown[:3])
        raise ConfigError(
            f"the optimizer holds {len(unknown)} parameter(s) of no prepared model (shapes {shapes}): build it "
            "from model.parameters() of the model you prepare (before or after prepare); to create it after the "
            "model is wrapped, use the prepared model's parameters")
