"""A wrapped model's inner module, called on its own, runs through its root FSDP unit.

``accelerator.unwrap_model(model)`` gives the transformers model inside the FSDP units, and code calls it directly:
``generate`` (TRL's GRPO rollouts, evaluation scripts), TRL's reference forward of a LoRA policy, a script's own
forward. Its blocks are units and gather their shards themselves, but the root unit's own parameters (embeddings,
final norm, LM head) are gathered only by the root's forward: called directly, FSDP v1's inner module meets its
freed full-parameter handles (XLA: ``Check failed: weight->shape().get().dimensions_size() == 2 (1 vs. 2)``), and
FSDP v2's skips the root's output annotation.

:func:`route_through_root` gives each of those inner modules an instance ``forward`` that, when called from outside
the root, calls the root unit with the same arguments instead (the root's forward calls back in, and then the module
runs its own forward). Whatever ``forward`` the instance had before (TRL's fused LM head) is what runs inside. The
signature stays the class's (``generate`` checks its keyword arguments against it).
"""

from __future__ import annotations

import functools
import types
from typing import Any, Sequence

from torch import nn

#: set on a routed module: the root unit it runs through
ROUTED_ATTR = "_hf_xla_fsdp_root"


def inner_modules(root: nn.Module, inner: nn.Module) -> list[nn.Module]:
    """The modules code reaches with ``unwrap_model``: the root's own module and, for a peft model, its base model
    (what ``PeftModel.generate`` calls)."""
    out = [inner]
    base = getattr(inner, "get_base_model", None)
    if callable(base) and hasattr(inner, "peft_config"):
        model = base()
        if model is not inner:
            out.append(model)
    return out


def route_through_root(root: nn.Module, modules: Sequence[nn.Module]) -> None:
    """Make every module of ``modules`` (inside ``root``) run through ``root`` when called from outside it."""
    depth = [0]  # > 0 while the root's forward runs (hooks: always called, an exception included)

    def enter(*_: Any) -> None:
        depth[0] += 1

    def leave(*_: Any) -> None:
        depth[0] -= 1

    root.register_forward_pre_hook(enter)
    root.register_forward_hook(leave, always_call=True)
    for module in modules:
        if module.__dict__.get(ROUTED_ATTR) is not None:
            continue
        own = module.__dict__.get("forward")  # an instance forward (TRL's fused LM head), else the class's

        @functools.wraps(type(module).forward)
        def forward(self: nn.Module, *args: Any, __own: Any = own, **kwargs: Any) -> Any:
            if depth[0]:
                return __own(*args, **kwargs) if __own is not None else type(self).forward(self, *args, **kwargs)
            return root(*args, **kwargs)

        module.forward = types.MethodType(forward, module)
        module.__dict__[ROUTED_ATTR] = root
