"""Optimizers built before wrapping: pointed at the sharded parameters that now hold their originals.

Scripts written for plain accelerate build the optimizer from the unwrapped model (any number of groups: weight
decay / no decay ...) and prepare both; wrapping replaces every parameter by its shard (a flat parameter may hold
several, a tied weight is kept once). These helpers carry each group over, keeping its hyperparameters.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..engines import engine_of
from ..errors import ConfigError


def prepare_optimizer(model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """Ready ``optimizer`` (built from the wrapped ``model``'s parameters) for the model's engine; returns it.

    Needed only in a hand-written loop: accelerate's ``prepare`` and the Trainer call it. With FSDP v2 and
    ``compute_dtype`` it makes the optimizer update the fp32 master copies of the parameters.
    """
    engine_of(model).prepare_optimizer(model, optimizer)
    return optimizer


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
