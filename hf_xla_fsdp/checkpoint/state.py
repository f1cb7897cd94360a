"""The parts of a rank's state every engine saves the same way: optimizer metadata, RNG states.

Engines call these from ``rank_state`` / ``restore``; the device (XLA) RNG state is the engine's, passed in.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional

import torch
from torch import nn

from ..errors import CheckpointError
from .layout import OPTIM_PREFIX
from .schema import check_like


def param_names(model: nn.Module, optimizer: torch.optim.Optimizer, clean: Callable[[str], str],
                stand_ins: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None) -> list[list[str]]:
    """The saved names of every optimizer group's parameters (``clean`` maps wrapped names to saved ones).

    ``stand_ins(param)`` is the tensor an optimizer may update in the parameter's place (its fp32
    master copy), which is saved under the parameter's name.
    """
    names = {}
    for n, p in model.named_parameters():
        names[id(p)] = clean(n)
        other = stand_ins(p) if stand_ins is not None else None
        if other is not None:
            names[id(other)] = clean(n)
    try:
        return [[names[id(p)] for p in group["params"]] for group in optimizer.param_groups]
    except KeyError:
        raise CheckpointError("the optimizer holds parameters that are not the FSDP model's; "
                              "create the optimizer after wrapping, from model.parameters()") from None


def optimizer_meta(model: nn.Module, optimizer: torch.optim.Optimizer, clean: Callable[[str], str],
                   stand_ins: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None
                   ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
    """Optimizer groups, non-tensor state and parameter names, and its tensor state keyed ``optim/IDX/NAME``."""
    state = optimizer.state_dict()
    scalars: dict[str, dict[str, Any]] = {}
    tensors: dict[str, torch.Tensor] = {}
    for idx, entries in state["state"].items():
        for name, value in entries.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{OPTIM_PREFIX}{idx}/{name}"] = value
            else:
                scalars.setdefault(str(idx), {})[name] = value
    return ({"param_groups": state["param_groups"], "scalar_state": scalars,
             "param_names": param_names(model, optimizer, clean, stand_ins)}, tensors)


def saved_optimizer(meta: dict[str, Any], model: nn.Module, optimizer: torch.optim.Optimizer,
                    clean: Callable[[str], str],
                    stand_ins: Optional[Callable[[torch.Tensor], Optional[torch.Tensor]]] = None,
                    source: Any = "the checkpoint") -> dict[str, Any]:
    """The saved optimizer metadata, once it matches ``optimizer``'s parameters and groups (``source``: the file it
    comes from, for messages)."""
    saved = meta.get("optimizer")
    if not saved:
        raise CheckpointError(f"{source} has no optimizer state; load it without an optimizer")
    live = param_names(model, optimizer, clean, stand_ins)
    if saved["param_names"] != live:
        # scan_layers stores a stack of layers as one parameter named <list>_scanned.<weight>
        scanned = [any("_scanned." in str(n) for group in names for n in group) for names in (saved["param_names"], live)]
        if scanned[0] != scanned[1]:
            raise CheckpointError(
                f"{source} was saved with scan_layers={str(scanned[0]).lower()} and this run has "
                f"scan_layers={str(scanned[1]).lower()}: the optimizer state of scanned layers is kept per stacked weight; "
                "resume with the same scan_layers, or load the model weights only (without the optimizer)")
        raise CheckpointError(f"the optimizer's parameters (or their groups) differ from those of {source}")
    for i, (group, live) in enumerate(zip(saved["param_groups"], optimizer.param_groups)):
        # initial_lr is added by a scheduler, which may be created after the save's optimizer was
        check_like(group, live, f"optimizer.param_groups[{i}]", source, "optimizer", skip=("params", "initial_lr"))
    return saved


def load_optimizer_state(optimizer: torch.optim.Optimizer, saved: dict[str, Any], state: dict[int, dict[str, Any]]) -> None:
    """``optimizer.load_state_dict`` from the saved groups (JSON lists turned back into tuples), ``state`` and scalars."""
    for idx, scalars in (saved.get("scalar_state") or {}).items():
        state.setdefault(int(idx), {}).update(scalars)
    groups = []
    for group, current in zip(saved["param_groups"], optimizer.param_groups):
        group = dict(group)
        for key, value in current.items():  # JSON turned tuples (e.g. betas) into lists
            if isinstance(value, tuple) and isinstance(group.get(key), list):
                group[key] = tuple(group[key])
        groups.append(group)
    optimizer.load_state_dict({"state": state, "param_groups": groups})


def optimizer_tensor_key(name: str) -> Optional[tuple[int, str]]:
    """``optim/3/exp_avg`` -> ``(3, "exp_avg")``; None for other tensors."""
    if not name.startswith(OPTIM_PREFIX):
        return None
    idx, key = name[len(OPTIM_PREFIX):].split("/", 1)
    return int(idx), key


# --------------------------------------------------------------------------- RNG
def rng_meta(device_state: Any) -> dict[str, Any]:
    """Python, NumPy and the device's (XLA) RNG states as JSON (the torch CPU state is a tensor of the rank file)."""
    import numpy as np

    np_state = np.random.get_state()
    py = random.getstate()
    return {
        "python": [py[0], list(py[1]), py[2]],
        "numpy": [np_state[0], np_state[1].tolist(), int(np_state[2]), int(np_state[3]), float(np_state[4])],
        "xla": device_state,
    }


def restore_rng(meta: dict[str, Any], cpu_state: Optional[torch.Tensor], set_device_state: Callable[[Any], None]) -> None:
    """Restore what :func:`rng_meta` recorded (the device state through ``set_device_state``), and the torch CPU
    state when given."""
    import numpy as np

    rng = meta.get("rng") or {}
    if "python" in rng:
        v, state, gauss = rng["python"]
        random.setstate((v, tuple(state), gauss))
    if "numpy" in rng:
        name, keys, pos, has_gauss, cached = rng["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    if rng.get("xla") is not None:  # None: saved by an engine without an XLA RNG (fsdp2)
        set_device_state(rng["xla"])
    if cpu_state is not None:
        torch.set_rng_state(cpu_state)
