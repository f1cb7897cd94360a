"""Models loaded lazily: under the launch settings, ``from_pretrained`` / ``from_config`` return a meta skeleton that
remembers its source, and wrapping reads the weights block by block (as ``XlaFsdpTrainer(model=dir)`` does), so an
unmodified script never holds the whole model on the host.

What a script does between loading and wrapping, and what happens to it:

* asking for shapes, dtypes, the config, the parameter count; editing the config; ``tie_weights``;
  ``gradient_checkpointing_enable``; ``requires_grad_``; ``.train()`` / ``.eval()``; ``.to(dtype)`` (the skeleton takes
  the dtype, the weights are cast as they are read, as an eager ``.to`` would); building an optimizer on the
  parameters (accelerate re-points it): all stay lazy;
* anything that needs the weights' values (reading or writing a weight, ``.to(device)``, ``state_dict()``,
  ``resize_token_embeddings``, wrapping with peft's ``get_peft_model``): the whole model is loaded first, in place
  (every parameter object the script holds gets its values), exactly as eager ``from_pretrained`` would have loaded
  it, with one warning naming what needed it; the rest of the script then runs on an eager model;
* a parameter added on the meta device after loading (no source for its values) is refused when the model is wrapped,
  with one line naming it.

Loading stays eager (the original ``from_pretrained``) for what this cannot reproduce exactly: keyword arguments other
than the plain loading ones, weights other than safetensors, checkpoints that lack some of the model's parameters
(their random init would be drawn at another time than eager loading draws it). ``HF_XLA_FSDP_LAZY_LOAD=0`` or
``meta_init: false`` in the launch settings turn it off.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import ConfigError
from .meta_init import BYPASS, bypass

logger = logging.getLogger(__name__)

#: set to 0 to load from_pretrained / from_config eagerly under the launch settings too
LAZY_ENV = "HF_XLA_FSDP_LAZY_LOAD"
LAZY_ATTR = "_hf_xla_fsdp_lazy"

# from_pretrained keywords a lazy load honours (the rest loads eagerly): where the files are, the dtype, the
# attention kernel; device placement is the wrap's (device_map None/"auto"/a single device is accepted and unused)
_HUB_KWARGS = ("revision", "cache_dir", "local_files_only", "token", "subfolder", "force_download", "proxies")
_LOAD_KWARGS = ("config", "dtype", "torch_dtype", "attn_implementation", "device_map", "low_cpu_mem_usage",
                "use_safetensors", "trust_remote_code", "_from_auto", "_from_pipeline", "_commit_hash", "weights_only",
                *_HUB_KWARGS)


# --------------------------------------------------------------------------- the lazy parameter
def _metadata_functions() -> frozenset:
    t = torch.Tensor
    getters = ("shape", "dtype", "device", "requires_grad", "is_leaf", "grad_fn", "grad", "layout", "ndim", "is_meta",
               "is_cuda", "is_cpu", "is_sparse", "is_quantized", "is_nested", "itemsize", "nbytes", "output_nr",
               "names", "_version", "is_mkldnn", "is_xla", "_base")
    methods = ("size", "dim", "numel", "nelement", "element_size", "is_floating_point", "is_complex", "stride",
               "is_contiguous", "requires_grad_", "__len__", "__hash__", "get_device", "_is_view", "is_inference",
               "has_names")
    found = {getattr(t, name).__get__ for name in getters if hasattr(t, name)}
    found |= {getattr(t, name).__set__ for name in ("requires_grad", "data", "grad") if hasattr(t, name)}
    found |= {getattr(t, name) for name in methods if hasattr(t, name)}
    found.add(torch._has_compatible_shallow_copy_type)
    return frozenset(found)


_METADATA = _metadata_functions()
_CASTS = frozenset({torch.Tensor.to, torch.Tensor.float, torch.Tensor.half, torch.Tensor.bfloat16,
                    torch.Tensor.double, torch.Tensor.type_as})


def _stays_meta(func: Any, args: tuple, kwargs: dict) -> bool:
    """A cast that only changes the dtype (``model.to(torch.bfloat16)``): it stays on meta, the weights are cast as
    they are read (what an eager cast does after loading)."""
    if func is torch.Tensor.type_as or func not in _CASTS:
        return False
    rest = list(args[1:]) + list(kwargs.values())
    return all(isinstance(a, (torch.dtype, bool, torch.memory_format)) or a is None for a in rest) and set(kwargs) <= {
        "dtype", "non_blocking", "copy", "memory_format"}


class LazyParameter(nn.Parameter):
    """A parameter of a model loaded lazily, on meta until the model is wrapped (see the module docstring): anything
    but asking for its metadata loads the whole model in place first."""

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: tuple = (), kwargs: Optional[dict] = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA and not _stays_meta(func, args, kwargs):
            for leaf in pytree.tree_leaves((args, kwargs)):
                state = getattr(leaf, LAZY_ATTR, None) if isinstance(leaf, LazyParameter) else None
                if state is not None:
                    state.materialize(f"torch {getattr(func, '__name__', func)} on a weight")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **kwargs)


# --------------------------------------------------------------------------- the state of one lazy model
@dataclass
class LazyModel:
    """What a lazily loaded model remembers: its skeleton (the model itself, its config and weight files, the init
    it records) and how it was loaded (for messages)."""

    skeleton: Any  # modeling.meta_init.Skeleton, whose model is the user's object
    what: str
    done: bool = False

    def parameters(self) -> list[nn.Parameter]:
        """The model's lazy parameters still on meta (each once)."""
        seen: dict[int, nn.Parameter] = {}
        for _, p in self.skeleton.model.named_parameters(remove_duplicate=False):
            if isinstance(p, LazyParameter):
                seen.setdefault(id(p), p)
        return list(seen.values())

    def release(self) -> None:
        """The model is no longer lazy: its parameters become plain parameters again (the build replaced them, or
        :meth:`materialize` filled them)."""
        for p in self.parameters():
            p.__dict__.pop(LAZY_ATTR, None)
            p.__class__ = nn.Parameter
        self.skeleton.model.__dict__.pop(LAZY_ATTR, None)
        self.done = True

    def materialize(self, why: str) -> None:
        """Load the whole model in place, as eager loading would have: every parameter object keeps its identity and
        gets its values (the checkpoint's, or the recorded init)."""
        if self.done:
            return
        from .meta_init import Materializer, _post_order

        logger.warning("%s: %s needs the weights, so the whole model is loaded now (not block by block when it is "
                       "wrapped): host memory holds all of it once", self.what, why)
        self.release()
        with torch._C.DisableTorchFunctionSubclass():
            filler = Materializer(self.skeleton, in_place=True)
            filler.fill(_post_order(self.skeleton.model, stop=set()))
            filler.finish()
            filler.close()


def lazy_state(model: Any) -> Optional[LazyModel]:
    """The :class:`LazyModel` of ``model`` (a PEFT model's base included), or None when it is not lazy (any more)."""
    if not isinstance(model, nn.Module):
        return None
    for module in (model, getattr(model, "base_model", None), getattr(getattr(model, "base_model", None), "model", None)):
        state = module.__dict__.get(LAZY_ATTR) if isinstance(module, nn.Module) else None
        if state is not None and not state.done:
            return state
    return None


def make_lazy(skeleton: Any, what: str) -> nn.Module:
    """Mark ``skeleton.model``'s meta parameters lazy (their identity kept: ties stay ties) and return the model."""
    state = LazyModel(skeleton, what)
    for _, p in skeleton.model.named_parameters(remove_duplicate=False):
        if p.is_meta and not isinstance(p, LazyParameter):
            p.__class__ = LazyParameter
            p.__dict__[LAZY_ATTR] = state
    skeleton.model.__dict__[LAZY_ATTR] = state
    return skeleton.model


def check_no_foreign_meta(model: nn.Module, state: LazyModel) -> None:
    """Refuse a lazy model holding a meta parameter that neither the checkpoint nor the recorded init fills (added to
    the model after loading, on the meta device): its values are unknown."""
    lazy = {id(p) for p in state.parameters()}
    for name, p in model.named_parameters():
        if p.is_meta and id(p) not in lazy:
            raise ConfigError(f"{name} was added to {state.what}'s model after it was loaded lazily, on the meta device "
                              "(its values are unknown): add it after the model is wrapped (trainer or "
                              "accelerator.prepare), give the trainer peft_config= for adapters, or load eagerly with "
                              f"{LAZY_ENV}=0")


# --------------------------------------------------------------------------- from_pretrained / from_config
def _checkpoint_dtype(weight_files: dict[str, Path]) -> Optional[torch.dtype]:
    """The first floating dtype stored in the checkpoint (what ``dtype="auto"`` falls back to)."""
    from safetensors import safe_open

    for path in dict.fromkeys(weight_files.values()):
        with safe_open(str(path), framework="pt", device="meta") as fh:
            for key in fh.keys():
                dtype = fh.get_slice(key).get_dtype()
                mapped = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "F64": torch.float64}
                if dtype in mapped:
                    return mapped[dtype]
    return None


def _dtype(requested: Any, config: Any, weight_files: dict[str, Path]) -> torch.dtype:
    """The dtype eager from_pretrained loads with: ``"auto"`` (its default) is the config's dtype, else the
    checkpoint's, else torch's default."""
    if requested is None or requested == "auto":
        found = getattr(config, "dtype", None) or _checkpoint_dtype(weight_files) or torch.get_default_dtype()
    else:
        found = requested
    return getattr(torch, found) if isinstance(found, str) else found


def lazy_from_pretrained(cls: type, original: Callable[..., Any], name: Any, *model_args: Any, **kwargs: Any) -> Any:
    """``cls.from_pretrained(name, ...)`` as a lazy skeleton when it can be reproduced exactly (see the module
    docstring), else ``original``'s eager load."""
    from .meta_init import ModelSource, build_skeleton, local_model_dir, safetensors_weight_map

    def eager(why: str) -> Any:
        logger.info("%s.from_pretrained(%r) loads eagerly: %s", cls.__name__, name, why)
        with bypass():
            return original(name, *model_args, **kwargs)

    if _inside_module_init():  # a model building its parts in its own __init__: that model is what may be lazy
        with bypass():
            return original(name, *model_args, **kwargs)
    # the Auto classes always pass adapter_kwargs (revision, token); an adapter to load names its path there
    unknown = sorted(k for k in set(kwargs) - set(_LOAD_KWARGS)
                     if not (k == "adapter_kwargs" and "_adapter_model_path" not in (kwargs[k] or {})))
    if model_args or unknown:
        return eager(f"arguments {', '.join(unknown) or 'positional'} are not lazy loading's")
    device_map = kwargs.get("device_map")
    if isinstance(device_map, dict) or kwargs.get("use_safetensors") is False:
        return eager("a device_map dict or use_safetensors=False")
    directory = local_model_dir(name, kwargs.get("revision"), kwargs.get("cache_dir"), kwargs.get("subfolder") or "")
    if directory is None or not (directory / "config.json").is_file():
        return eager("not a local model directory nor a snapshot in the local Hugging Face cache")
    weights = safetensors_weight_map(directory)
    if not weights:
        return eager("no safetensors weights")
    config = kwargs.get("config")
    if config is None:
        from transformers import AutoConfig

        reader = getattr(cls, "config_class", None) or AutoConfig
        config = reader.from_pretrained(str(directory), trust_remote_code=kwargs.get("trust_remote_code"))
    else:
        import copy

        config = copy.deepcopy(config)  # as from_pretrained: the caller's config object is not changed
    if "attn_implementation" in kwargs:
        config._attn_implementation = kwargs["attn_implementation"]
    dtype = _dtype(kwargs.get("dtype", kwargs.get("torch_dtype")), config, weights)
    config.dtype = dtype
    config.name_or_path = str(name)
    with bypass():
        sk = build_skeleton(ModelSource(config, directory, weights), model_cls=cls, dtype=dtype, record_init=False)
    expected = {k for k in sk.model.state_dict() if k not in sk.tied_keys}
    missing = sorted(k for k in expected if k not in weights and not _non_persistent(sk.model, k))
    if missing:
        return eager(f"the checkpoint lacks {missing[0]}" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    model = make_lazy(sk, f"{cls.__name__}.from_pretrained({str(name)!r})")
    model.eval()  # as from_pretrained
    _generation_config(model, directory)
    return model


def _non_persistent(model: nn.Module, key: str) -> bool:
    owner, _, leaf = key.rpartition(".")
    module = model.get_submodule(owner) if owner else model
    return leaf in getattr(module, "_non_persistent_buffers_set", ())


def _generation_config(model: nn.Module, directory: Path) -> None:
    """``generation_config.json`` as from_pretrained reads it for models that generate."""
    if (directory / "generation_config.json").is_file() and getattr(model, "can_generate", lambda: False)():
        from transformers import GenerationConfig

        model.generation_config = GenerationConfig.from_pretrained(str(directory))


def lazy_from_config(cls: type, original: Callable[..., Any], config: Any, **kwargs: Any) -> Any:
    """``cls._from_config(config, ...)`` (what ``AutoModel*.from_config`` calls) as a lazy skeleton: every init draw
    is made now on scratch tensors, so the global RNG moves as eager construction moves it, and replayed into each
    block when it is wrapped."""
    from .meta_init import ModelSource, build_skeleton

    if set(kwargs) - {"dtype", "torch_dtype", "attn_implementation"}:
        with bypass():
            return original(config, **kwargs)
    if _inside_module_init():
        with bypass():
            return original(config, **kwargs)
    if "attn_implementation" in kwargs:
        config._attn_implementation = kwargs["attn_implementation"]
    dtype = kwargs.get("dtype", kwargs.get("torch_dtype", getattr(config, "dtype", None))) or torch.get_default_dtype()
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    with bypass():
        sk = build_skeleton(ModelSource(config), model_cls=cls, dtype=dtype, record_init=True, defer_init_draws=False)
    return make_lazy(sk, f"{cls.__name__}.from_config")


def _inside_module_init() -> bool:
    """True while an ``nn.Module``'s ``__init__`` runs further up the stack (a composite model building its parts)."""
    import sys

    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "__init__" and isinstance(frame.f_locals.get("self"), nn.Module):
            return True
        frame = frame.f_back
    return False


def enabled(launch_meta_init: Callable[[], Optional[bool]]) -> bool:
    """Whether a load goes lazy now: not inside our own builds, not switched off, and the launch settings ask for
    meta construction (``launch_meta_init()``: None outside a launch)."""
    if BYPASS.get() or os.environ.get(LAZY_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return False
    if torch.get_default_device().type == "meta":  # the caller builds on meta itself (e.g. to list a model's tensors)
        return False
    return bool(launch_meta_init())
