"""Meta-device construction, layer by layer.

The model skeleton is built with its parameters on ``meta`` (buffers, which are small and often
computed by the constructor, stay real). Then each FSDP block is materialized on the host, filled
(fresh init or its own tensors read from safetensors), wrapped and sharded before the next block
is touched, so the full model never exists in host or device memory (with ``sharding="zero3"``).

Fresh init reproduces eager construction bit for bit: the skeleton is built while a dispatch mode
replays every random op aimed at a meta tensor on a scratch CPU tensor of the same shape, so the
global RNG advances exactly as it would eagerly. Random numbers drawn only to advance the RNG cost
time (a 7B model draws 6.7e9 of them per pass), so the draws of the ``_init_weights`` calls are not
made while the skeleton is built: the skeleton records, in order, a tape of those calls and of any
other random op that follows the first of them. Building walks that tape block by block: a call of
the block being filled draws straight into its tensors; a call of a module filled later (e.g. the
embeddings, initialized before the first block but sharded with the root) is drawn on scratch to
advance the RNG and replayed from its recorded state when its turn comes. The global RNG ends where
eager construction leaves it. This relies on transformers' own contract (the one
``from_pretrained`` also relies on for missing keys): ``_init_weights`` sets every parameter and
buffer a module owns.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import torch
from torch import nn
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from ..checkpoint.safetensors_io import SafetensorsReader
from ..errors import ConfigError
from .wrapping import BlockPlan, plan_blocks, replace_submodule

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin

logger = logging.getLogger(__name__)

SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"


# --------------------------------------------------------------------------- sources
@dataclass
class ModelSource:
    """What to build: a config, and for pretrained weights the safetensors file of every key."""

    config: Any
    directory: Optional[Path] = None
    weight_files: dict[str, Path] = field(default_factory=dict)  # state-dict key -> safetensors file

    @property
    def pretrained(self) -> bool:
        """True when weights are read from a checkpoint instead of freshly initialized."""
        return bool(self.weight_files)


def safetensors_weight_map(directory: Path) -> dict[str, Path]:
    """Map every tensor name of a local safetensors checkpoint (single or sharded) to its file."""
    from safetensors import safe_open

    single, index = directory / SAFE_WEIGHTS_NAME, directory / SAFE_WEIGHTS_INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as err:
            raise ConfigError(f"{index} is not a valid safetensors index (needs a 'weight_map'): {err}") from None
        out = {}
        for key, fname in weight_map.items():
            if not isinstance(fname, str) or Path(fname).name != fname or fname in ("", ".", ".."):
                raise ConfigError(f"{index} names file {fname!r} for {key!r}: "
                                  "only plain file names in the same directory are allowed")
            path = directory / fname
            if not path.is_file():
                raise ConfigError(f"{index} names {fname} for {key!r}, but that file is missing")
            out[key] = path
        return out
    if single.is_file():
        with safe_open(str(single), framework="pt") as fh:
            return {key: single for key in fh.keys()}
    return {}


_REPO_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")


def local_model_dir(name: Any, revision: Optional[str] = None, cache_dir: Any = None,
                    subfolder: str = "") -> Optional[Path]:
    """The local directory ``name`` means: a directory, or a Hub id's snapshot in the local Hugging Face cache
    (nothing is downloaded); None when it is neither."""
    path = Path(str(name))
    if path.is_dir():
        return path / subfolder if subfolder else path
    if path.exists() or not _REPO_ID.match(str(name)):
        return None
    from huggingface_hub import snapshot_download

    try:
        found = Path(snapshot_download(str(name), revision=revision, cache_dir=cache_dir, local_files_only=True))
    except Exception:  # not in the cache (LocalEntryNotFoundError), or not a valid id: the caller decides
        return None
    return found / subfolder if subfolder else found


def check_model_source(model: Any) -> None:
    """One line for a model argument that is none of what the library builds from (or a module)."""
    from transformers import PretrainedConfig

    if not isinstance(model, (nn.Module, PretrainedConfig, str, os.PathLike)):
        raise ConfigError(f"model must be an nn.Module, a PretrainedConfig, a config.json, a local model directory "
                          f"or a Hub id in the local cache, not {type(model).__name__}")


def resolve_source(source: Any) -> ModelSource:
    """Accept a ``PretrainedConfig``, a ``config.json`` path, a local model directory, or a Hub id whose snapshot is
    in the local Hugging Face cache (offline: nothing is downloaded); or a source resolved already, whose config a
    caller may have adjusted."""
    from transformers import AutoConfig, PretrainedConfig

    if isinstance(source, ModelSource):
        return source
    if isinstance(source, PretrainedConfig):
        return ModelSource(config=source)
    path = Path(source)
    if path.is_file() and path.suffix == ".json":
        return ModelSource(config=AutoConfig.from_pretrained(str(path)))
    if not path.is_dir():
        cached = local_model_dir(source)
        if cached is None and _REPO_ID.match(str(source)):
            from huggingface_hub.constants import HF_HUB_CACHE

            raise ConfigError(f"{source!r} is neither a local model directory nor a model in the local Hugging Face "
                              f"cache ({HF_HUB_CACHE}): download it first (`hf download {source}`), or give a local "
                              "directory, a config.json or a PretrainedConfig")
        if cached is None:
            raise ConfigError(f"{source!r} is neither a PretrainedConfig, a config.json file nor a local model directory")
        path = cached
    if not (path / "config.json").is_file():
        if (path / "adapter_config.json").is_file():
            raise ConfigError(f"{path} holds PEFT adapters, not a model: build the base model it names, then attach them "
                              "(PeftModel.from_pretrained(base, adapter_dir))")
        raise ConfigError(f"{path} has no config.json; pass a model directory saved with save_pretrained")
    config = AutoConfig.from_pretrained(str(path))
    weights = safetensors_weight_map(path)
    if not weights and any(path.glob("*.bin")):
        raise ConfigError(f"{path} holds only pickled .bin weights; save it with safe_serialization=True (safetensors)")
    return ModelSource(config=config, directory=path, weight_files=weights)


def model_class(config: Any, model_cls: Any = None) -> Any:
    """The class to build: ``model_cls`` if given, else ``config.architectures[0]``, else AutoModelForCausalLM."""
    import transformers

    if model_cls is not None:
        return model_cls
    for name in getattr(config, "architectures", None) or ():
        if hasattr(transformers, name):
            return getattr(transformers, name)
    if type(config) not in transformers.AutoModelForCausalLM._model_mapping:
        raise ConfigError(f"{type(config).__name__} names no model class and is not a causal LM: set "
                          "config.architectures (e.g. ['ResNetForImageClassification']) or pass model_cls=")
    return transformers.AutoModelForCausalLM


#: True while our own builds construct models: from_pretrained / from_config then load as upstream does (the lazy
#: loading of a launched script, modeling/lazy.py, is for the script's calls)
BYPASS: contextvars.ContextVar[bool] = contextvars.ContextVar("hf_xla_fsdp_lazy_bypass", default=False)


@contextlib.contextmanager
def bypass() -> Iterator[None]:
    """Inside, from_pretrained / from_config load as upstream does (our own builds, eager fallbacks)."""
    token = BYPASS.set(True)
    try:
        yield
    finally:
        BYPASS.reset(token)


def _instantiate(cls: Any, config: Any, dtype: torch.dtype) -> nn.Module:
    from transformers import PreTrainedModel

    with bypass():
        if isinstance(cls, type) and issubclass(cls, PreTrainedModel):
            return cls._from_config(config, dtype=dtype)
        return cls.from_config(config, dtype=dtype)


# --------------------------------------------------------------------------- RNG bookkeeping
class _RngShadow(TorchDispatchMode):
    """Advance the global CPU RNG for random ops on meta tensors exactly as the eager op would.

    The op is re-run on a CPU view of the same size, stride and dtype; the views share one
    scratch buffer per dtype (as large as the largest tensor), because allocating a fresh
    tensor per op left the allocator holding about as much memory as the whole model.

    With a ``tape`` it defers instead, from the first ``_init_weights`` call on (``deferring``): ops
    inside init calls are skipped (the tape holds the call) and other ops are appended to the tape.
    ``broken`` is set when deferring cannot reproduce eager order (a random op on a real tensor, or an
    init call nested in another); the skeleton is then built again without deferring.
    """

    def __init__(self, tape: Optional[list] = None, chunk_uniform: bool = False) -> None:
        super().__init__()
        self._scratch: dict[torch.dtype, torch.Tensor] = {}
        self._chunks: dict[torch.dtype, torch.Tensor] = {}
        self.chunk_uniform = chunk_uniform  # advance uniform_ in chunks instead of on a full-size scratch
        self.tape = tape
        self.deferring = False
        self.in_init = 0
        self.broken = False
        self.start_state: Optional[torch.Tensor] = None  # the RNG state at the first init call

    def _cpu_view(self, t: torch.Tensor) -> torch.Tensor:
        needed = 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride())) if t.numel() else 0
        buf = self._scratch.get(t.dtype)
        if buf is None or buf.numel() < needed:
            buf = self._scratch[t.dtype] = torch.empty(max(needed, 1), dtype=t.dtype)
        return buf.as_strided(t.shape, t.stride())

    def advance(self, func: Any, args: tuple, kwargs: dict) -> None:
        """Run random op ``func`` on CPU stand-ins of its meta operands: the RNG moves as in eager mode."""
        leaves = pytree.tree_leaves((args, kwargs))
        metas = [x for x in leaves if isinstance(x, torch.Tensor) and x.is_meta]
        if (self.chunk_uniform and func is torch.ops.aten.uniform_.default and len(metas) == 1 and args
                and args[0] is metas[0] and metas[0].is_contiguous()):
            # uniform_ draws element by element in order (ATen's serial CPU kernel), so chunks advance the RNG
            # exactly as one call does, with a small buffer (an lm_head's constructor draw replayed while the
            # root unit is materialized would otherwise need a scratch as large as the lm_head)
            meta, rest, chunk = metas[0], args[1:], _UNIFORM_CHUNK
            buf = self._chunks.get(meta.dtype)
            if buf is None:  # one per dtype, reused: a fresh 16 MiB buffer per op stayed on glibc's heap (measured)
                buf = self._chunks[meta.dtype] = torch.empty(chunk, dtype=meta.dtype)
            for start in range(0, meta.numel(), chunk):
                func(buf[:min(chunk, meta.numel() - start)], *rest, **kwargs)
            return
        reuse = len(metas) == 1  # a second meta operand would alias the first view

        def to_cpu(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and x.is_meta:
                if reuse:
                    return self._cpu_view(x)
                return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device="cpu")
            if isinstance(x, torch.device) and x.type == "meta":
                return torch.device("cpu")
            return x

        cpu_args, cpu_kwargs = pytree.tree_map(to_cpu, (args, kwargs))
        func(*cpu_args, **cpu_kwargs)

    def release(self) -> None:
        """Drop the scratch buffers."""
        self._scratch.clear()
        self._chunks.clear()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: D105
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if torch.Tag.nondeterministic_seeded in func.tags and kwargs.get("generator") is None:
            leaves = pytree.tree_leaves((args, kwargs))
            on_meta = any(isinstance(x, torch.Tensor) and x.is_meta for x in leaves) or any(
                isinstance(x, torch.device) and x.type == "meta" for x in leaves)
            if self.deferring:
                if not on_meta:
                    self.broken = True  # it drew from the global RNG now, ahead of the deferred draws
                elif not self.in_init:
                    self.tape.append(_TapedOp(func, args, kwargs))
            elif on_meta:
                self.advance(func, args, kwargs)
        return out


_UNIFORM_CHUNK = 1 << 22  # elements per uniform_ chunk when only advancing the RNG (16 MiB of fp32)


@dataclass
class _TapedOp:
    """A random op aimed at a meta tensor outside any init call, after the first one (e.g. a later constructor)."""

    func: Any
    args: tuple
    kwargs: dict


@dataclass
class _InitCall:
    module: nn.Module
    owner: nn.Module  # the PreTrainedModel whose _init_weights handles `module`
    rng_state: Optional[torch.Tensor]  # None until the build's walk of the tape reaches the call (deferred draws)


@contextlib.contextmanager
def _record_init_calls(calls: list[_InitCall], shadow: _RngShadow) -> Iterator[None]:
    from transformers import PreTrainedModel

    original = PreTrainedModel._initialize_weights

    def recording(self: Any, module: nn.Module, is_custom_code: bool = False) -> None:
        if getattr(module, "_is_hf_initialized", False):
            return original(self, module, is_custom_code)
        if shadow.tape is None:
            calls.append(_InitCall(module, self, torch.get_rng_state()))
            return original(self, module, is_custom_code)
        if shadow.in_init:
            shadow.broken = True  # a nested call: its draws would be replayed twice
        if not shadow.deferring:
            shadow.deferring, shadow.start_state = True, torch.get_rng_state()
        call = _InitCall(module, self, None)
        calls.append(call)
        shadow.tape.append(call)
        shadow.in_init += 1
        try:
            return original(self, module, is_custom_code)
        finally:
            shadow.in_init -= 1

    PreTrainedModel._initialize_weights = recording
    try:
        yield
    finally:
        PreTrainedModel._initialize_weights = original


@contextlib.contextmanager
def _params_on_meta() -> Iterator[None]:
    from accelerate import init_empty_weights

    with init_empty_weights(include_buffers=False):
        yield


# --------------------------------------------------------------------------- skeleton
@dataclass
class Skeleton:
    """A model whose parameters are on ``meta``, plus what is needed to fill them later."""

    model: nn.Module
    source: ModelSource
    init_calls: list[_InitCall]
    final_rng_state: Optional[torch.Tensor]  # None while init draws are deferred (known once the tape is walked)
    tied_keys: set[str]  # parameters that eager construction replaces by another (e.g. lm_head.weight)
    tape: Optional[list] = None  # deferred init calls and random ops, in eager order
    tape_start_state: Optional[torch.Tensor] = None  # the RNG state where the tape starts


def build_skeleton(
    source: ModelSource, model_cls: Any = None, dtype: torch.dtype = torch.float32, record_init: Optional[bool] = None,
    defer_init_draws: bool = False,
) -> Skeleton:
    """Construct the model with parameters on ``meta``.

    ``record_init`` (default: when ``source`` has no weights) records what a fresh init needs;
    it draws as many random numbers as eager construction would, so skip it when only sizing.
    ``defer_init_draws`` leaves the draws of the ``_init_weights`` calls to the build's walk of the
    tape (see the module docstring; a :class:`Materializer` must then fill every module, which
    leaves the RNG where eager construction does); the global RNG meanwhile is not eager's final state.
    """
    from .. import upstream

    upstream.require("modeling")  # transformers' init internals recorded and replayed below
    cls = model_class(source.config, model_cls)
    calls: list[_InitCall] = []
    tape, tape_start = None, None
    if record_init is None:
        record_init = not source.pretrained
    if not record_init:
        from transformers.initialization import no_init_weights

        with _params_on_meta(), no_init_weights():
            model = _instantiate(cls, source.config, dtype)
        final_state = None
    else:
        start = torch.get_rng_state()
        shadow = _RngShadow(tape=[] if defer_init_draws else None)
        with _params_on_meta(), shadow, _record_init_calls(calls, shadow):
            model = _instantiate(cls, source.config, dtype)
        if shadow.broken:
            logger.info("%s: init draws cannot be deferred (random ops outside meta tensors); drawing them now",
                        type(model).__name__)
            torch.set_rng_state(start)
            return build_skeleton(source, model_cls, dtype, record_init, defer_init_draws=False)
        final_state = None if shadow.deferring else torch.get_rng_state()
        if shadow.deferring:
            tape, tape_start = shadow.tape, shadow.start_state
        if not calls:
            raise ConfigError(
                f"{type(model).__name__} initializes its weights without PreTrainedModel._initialize_weights; "
                "build it with meta_init=False"
            )
    # accelerate's init_empty_weights re-creates a parameter on every assignment, which unties
    # what tie_weights tied inside the context; tie again now that parameters keep their identity
    model.tie_weights()
    tied = set(getattr(model, "all_tied_weights_keys", None) or {})
    return Skeleton(model, source, calls, final_state, tied, tape, tape_start)


# --------------------------------------------------------------------------- materialization
def _owners(model: nn.Module) -> dict[nn.Module, nn.Module]:
    """Nearest PreTrainedModel ancestor (or self) of every module, as transformers' smart_apply uses."""
    from transformers import PreTrainedModel

    owners: dict[nn.Module, nn.Module] = {}

    def visit(module: nn.Module, owner: nn.Module) -> None:
        owner = module if isinstance(module, PreTrainedModel) else owner
        owners[module] = owner
        for child in module.children():
            visit(child, owner)

    visit(model, model)
    return owners


def _materialize_tensors(modules: list[nn.Module], memo: dict[int, Optional[torch.Tensor]], in_place: bool = False,
                         ) -> None:
    """Replace meta parameters of ``modules`` (non-recursively) by uninitialized CPU tensors.

    ``memo`` has a key for every parameter that stands under two names (tied): it keeps them one
    object. Nothing else is remembered, so FSDP can free a block's full tensors once it is sharded.
    ``in_place``: each parameter object takes the CPU tensor itself (``torch.utils.swap_tensors``), so whoever holds
    it (an optimizer, the script) sees the values.
    """
    for module in modules:
        for name, param in list(module._parameters.items()):
            if param is None or not param.is_meta:
                continue
            new = memo.get(id(param))
            if new is None:
                new = nn.Parameter(torch.empty_like(param, device="cpu"), requires_grad=param.requires_grad)
                if in_place:
                    torch.utils.swap_tensors(param, new)
                    new = param
                if id(param) in memo:
                    memo[id(param)] = new
            module._parameters[name] = new


@contextlib.contextmanager
def _hidden(module: nn.Module, names: list[str]) -> Iterator[None]:
    """Point ``module.<names>`` at throwaway meta tensors: eager init wrote there before tying."""
    saved = {n: module._parameters[n] for n in names}
    for n, p in saved.items():
        module._parameters[n] = nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=p.requires_grad)
    try:
        yield
    finally:
        module._parameters.update(saved)


class Materializer:
    """Fills the meta tensors of one part of a skeleton at a time."""

    def __init__(self, skeleton: Skeleton, key_of: Optional[Callable[[str], Optional[str]]] = None,
                 in_place: bool = False) -> None:
        self.sk = skeleton
        self.in_place = in_place  # parameters keep their identity (see _materialize_tensors)
        # skeleton tensor name -> pretrained key (None: not stored there, e.g. a freshly added adapter)
        self.key_of = key_of or (lambda name: name)
        self.names = {m: n for n, m in skeleton.model.named_modules(remove_duplicate=False)}
        self.owners = _owners(skeleton.model)
        seen: set[int] = set()
        self.memo: dict[int, Optional[torch.Tensor]] = {}
        for _, p in skeleton.model.named_parameters(remove_duplicate=False):
            if id(p) in seen:
                self.memo[id(p)] = None
            seen.add(id(p))
        self._files: dict[Path, Any] = {}
        self.missing: list[str] = []
        self.fresh: dict[str, torch.Tensor] = {}  # checkpoint key the checkpoint lacks -> the tensor initialized for it
        self.filled: set[nn.Module] = set()
        self.cursor = 0  # next tape entry (deferred init draws)
        self.cursor_state = skeleton.tape_start_state

    def _handle(self, path: Path) -> Any:
        # plain reads rather than safe_open's memory map: mapped pages of a checkpoint larger than
        # host memory would count against the process until the map is closed
        if path not in self._files:
            try:
                self._files[path] = SafetensorsReader(path)
            except (ValueError, KeyError, TypeError, UnicodeDecodeError) as err:
                raise ConfigError(f"{path} is not a valid safetensors file ({err})") from None
        return self._files[path]

    def _tied_here(self, module: nn.Module) -> list[str]:
        prefix = self.names[module]
        prefix = f"{prefix}." if prefix else ""
        return [n for n in module._parameters if f"{prefix}{n}" in self.sk.tied_keys]

    def fill(self, modules: list[nn.Module]) -> None:
        """Materialize and initialize the direct tensors of ``modules`` (given in post-order; each once)."""
        modules = [m for m in modules if m not in self.filled]
        self.filled.update(modules)
        _materialize_tensors(modules, self.memo, self.in_place)
        if self.sk.source.pretrained:
            self._load(modules)
        else:
            self._replay(modules)

    def _replay(self, modules: list[nn.Module]) -> None:
        from transformers.initialization import guard_torch_init_functions

        wanted = set(modules)
        with torch.no_grad(), guard_torch_init_functions():
            done = self._walk_tape(wanted) if self.sk.tape is not None else set()
            for call in self.sk.init_calls:
                if call.module not in wanted or id(call) in done:
                    continue
                torch.set_rng_state(call.rng_state)
                self._init(call)
        if self.sk.tape is None:
            torch.set_rng_state(self.sk.final_rng_state)
        else:
            torch.set_rng_state(self.cursor_state)
            if self.cursor == len(self.sk.tape):
                self.sk.final_rng_state = self.cursor_state

    def _init(self, call: _InitCall, shadow: Optional[_RngShadow] = None) -> None:
        """Run ``call`` on the module's real tensors; the draws aimed at hidden (tied) ones advance the RNG only
        under ``shadow`` (needed when the next call continues from here rather than from its own state)."""
        with _hidden(call.module, self._tied_here(call.module)), shadow or contextlib.nullcontext():
            call.owner._init_weights(call.module)

    def _walk_tape(self, wanted: set[nn.Module], to_end: bool = False) -> set[int]:
        """Run the tape up to the last init call of ``wanted`` (or to its end): those draw into their tensors.

        Returns the ids of the calls run for real. Calls of modules filled later are drawn on scratch (their
        RNG state kept for their turn), and so are taped ops.
        """
        tape = self.sk.tape
        last = len(tape) - 1 if to_end else max(
            (i for i in range(self.cursor, len(tape)) if isinstance(tape[i], _InitCall) and tape[i].module in wanted),
            default=-1)
        done: set[int] = set()
        if last < self.cursor:
            return done
        torch.set_rng_state(self.cursor_state)
        shadow = _RngShadow(chunk_uniform=True)
        try:
            while self.cursor <= last:
                entry = tape[self.cursor]
                self.cursor += 1
                if isinstance(entry, _TapedOp):
                    shadow.advance(entry.func, entry.args, entry.kwargs)
                    continue
                entry.rng_state = torch.get_rng_state()
                if entry.module in wanted:
                    self._init(entry, shadow)
                    done.add(id(entry))
                else:
                    # still on meta (a tied tensor filled already is hidden): the shadow draws what it would
                    real = [n for n, p in entry.module._parameters.items() if p is not None and not p.is_meta]
                    with _hidden(entry.module, real), shadow:
                        entry.owner._init_weights(entry.module)
        finally:
            shadow.release()
        self.cursor_state = torch.get_rng_state()
        return done

    def finish(self) -> None:
        """Walk what is left of the tape (calls of modules no fill held) and leave the RNG where eager does."""
        if self.sk.tape is None:
            return
        from transformers.initialization import guard_torch_init_functions

        with torch.no_grad(), guard_torch_init_functions():
            self._walk_tape(set(), to_end=True)
        self.sk.final_rng_state = self.cursor_state
        torch.set_rng_state(self.cursor_state)

    def _load(self, modules: list[nn.Module]) -> None:
        from transformers.initialization import guard_torch_init_functions

        weights = self.sk.source.weight_files
        tied_sources = dict(getattr(self.sk.model, "all_tied_weights_keys", None) or {})
        copies: list[tuple[torch.Tensor, torch.Tensor]] = []
        with torch.no_grad():
            for module in modules:
                prefix = self.names[module]
                prefix = f"{prefix}." if prefix else ""
                tied = set(self._tied_here(module))
                tensors = [(n, t) for n, t in module._parameters.items() if t is not None and n not in tied]
                tensors += [(n, t) for n, t in module._buffers.items()
                            if t is not None and n not in module._non_persistent_buffers_set]
                for name, tensor in tensors:
                    key = self.key_of(f"{prefix}{name}")
                    if key is None:
                        # an adapter's own tensor: peft's init fills it after this (init_adapters), as get_peft_model
                        # does after from_pretrained; the model's _init_weights below must not draw for it
                        tensor._is_hf_initialized = True
                        continue
                    # a separate copy of a tied weight (e.g. peft's modules_to_save of a tied lm_head) reads its source
                    key = key if key in weights else tied_sources.get(key, key)
                    if key not in weights:
                        if key in self.fresh:  # a second copy of a fresh tensor (peft's modules_to_save): copied,
                            tensor._is_hf_initialized = True  # as get_peft_model copies it, not drawn again
                            copies.append((tensor, self.fresh[key]))
                        else:
                            self.missing.append(key)
                            self.fresh[key] = tensor
                        continue
                    stored = self._handle(weights[key]).read(key)
                    if stored.shape != tensor.shape:
                        raise ConfigError(
                            f"{key} has shape {tuple(stored.shape)} in {weights[key]} but the model expects {tuple(tensor.shape)}"
                        )
                    tensor.copy_(stored)
                    tensor._is_hf_initialized = True
            # the model's own init fills what the checkpoint lacks (missing keys, non-persistent buffers);
            # the guard skips every tensor flagged as loaded, exactly as from_pretrained does
            with guard_torch_init_functions():
                for module in modules:
                    self.owners[module]._init_weights(module)
            for tensor, source in copies:
                tensor.copy_(source)

    def close(self) -> None:
        """Release safetensors handles and report keys the checkpoint did not have."""
        self._files.clear()
        if self.missing:
            logger.warning("keys missing from the checkpoint, freshly initialized: %s", ", ".join(self.missing))


def release_host_memory() -> None:
    """Hand freed heap memory back to the OS (glibc ``malloc_trim``; a no-op elsewhere).

    Blocks of a few MB are allocated and freed again and again; glibc keeps them on its heap,
    where fragmentation made the RSS of a 24-block build grow by ~30 MB a block instead of by
    the ~6 MB shard it keeps.
    """
    global _malloc_trim
    if _malloc_trim is None:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim: Any = None


@contextlib.contextmanager
def _older_objects_frozen() -> Iterator[None]:
    """``gc.freeze()`` for the duration: FSDP's constructor runs ``gc.collect()`` once per unit, and with
    transformers and torch_xla imported each collection walked ~0.5 M objects (0.2-0.5 s here, a unit).
    Only objects that exist now are frozen (the imports, the meta skeleton); the tensors of each block are made
    later and stay collectable. Left alone if the caller already froze objects (unfreezing would undo theirs)."""
    import gc

    if gc.get_freeze_count():
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def _post_order(module: nn.Module, stop: set[nn.Module]) -> list[nn.Module]:
    """Modules of the subtree in post-order (children first), not descending into ``stop``."""
    out: list[nn.Module] = []

    def visit(m: nn.Module) -> None:
        for child in m.children():
            if child not in stop:
                visit(child)
        out.append(m)

    visit(module)
    return out


def build_sharded(
    source: ModelSource,
    plugin: "XlaFsdpPlugin",
    *,
    wrap_block: Callable[[nn.Module, bool], nn.Module],
    wrap_root: Optional[Callable[[nn.Module], nn.Module]],
    model_cls: Any = None,
    dtype: torch.dtype = torch.float32,
    progress: bool = True,
    peft_config: Any = None,
    skeleton: Optional[Skeleton] = None,
    sync: Optional[Callable[[], None]] = None,
) -> nn.Module:
    """Build ``source`` on ``meta``, then materialize, initialize and shard it block by block.

    ``wrap_block(block, nested)`` makes a block a unit (the engine's); ``wrap_root(model)`` adds the outer unit, or
    with ``None`` the model is returned with its blocks sharded and the root's own tensors on the host (for code
    that must see the model itself first, e.g. a Trainer subclass patching its forward).

    ``peft_config`` (e.g. a ``peft.LoraConfig``) attaches adapters to the skeleton before anything is
    materialized and returns the wrapped ``PeftModel``: the order is base on meta, adapters on meta,
    then block by block: base tensors read (or initialized), adapters initialized, shard.

    ``skeleton``: one built already (a model loaded lazily, :mod:`.lazy`), used as it is.

    ``sync()`` (the engine's) runs each block's sharding before the next block is filled, so the block's full tensors
    are freed first (default: the XLA runtime's graph cut).
    """
    if skeleton is None:
        # adapters are initialized between fills from the global RNG, which must then already be eager's final state
        sk = build_skeleton(source, model_cls=model_cls, dtype=dtype, defer_init_draws=peft_config is None)
        release_host_memory()  # the skeleton's scratch draws leave freed heap behind
    else:
        sk = skeleton
    model, key_of, init_adapters = sk.model, None, None
    if peft_config is not None:
        from . import adapters

        model = adapters.attach_adapters(sk.model, peft_config)  # injects into sk.model, all still on meta
        key_of = adapters.checkpoint_key

        stream: list[torch.Tensor] = []

        def init_adapters(modules: list[nn.Module]) -> None:
            layers = adapters.adapter_layers(modules)
            if not layers:
                return
            # the adapters draw one sequence across blocks, as eager get_peft_model does after the base's init (a
            # fill leaves the RNG where the base's init stands, which would give every block the same draws)
            outer = torch.get_rng_state()
            if stream:
                torch.set_rng_state(stream[-1])
            adapters.init_adapters(layers, model)
            stream[:] = [torch.get_rng_state()]
            torch.set_rng_state(outer)
    with _older_objects_frozen():
        if sync is None:
            from ..runtime import sync
        return _fill_and_wrap(sk, model, plan_blocks(model, plugin), key_of, init_adapters, wrap_block=wrap_block,
                              wrap_root=wrap_root, progress=progress, sync=sync)


def _fill_and_wrap(sk: Skeleton, model: nn.Module, plan: BlockPlan, key_of: Any, init_adapters: Any, *,
                   wrap_block: Callable[[nn.Module, bool], nn.Module], wrap_root: Optional[Callable[[nn.Module], nn.Module]],
                   progress: bool, sync: Callable[[], None]) -> nn.Module:
    """Materialize, initialize and shard ``model`` block by block, then the root (see :func:`build_sharded`)."""
    from tqdm.auto import tqdm

    blocks = [model.get_submodule(n) for n in plan.names]
    done: set[nn.Module] = set()
    filler = Materializer(sk, key_of)
    if init_adapters is not None and sk.source.pretrained:
        # eager from_pretrained initializes what the checkpoint lacks (e.g. a new classification head) before
        # get_peft_model draws the adapters: the root's own tensors (kept on the host until the root unit anyway) first
        filler.fill(_post_order(sk.model, stop=set(blocks)))
    for name, block in tqdm(list(zip(plan.names, blocks)), desc="materialize+shard blocks", disable=not progress,
                            unit="block"):
        modules = _post_order(block, stop=done)
        filler.fill(modules)
        if init_adapters is not None:
            init_adapters(modules)
        wrapped = wrap_block(block, plan.nested)
        replace_submodule(model, name, wrapped)
        done.add(wrapped)
        done.add(block)
        sync()  # run the sharding now, so the block's full tensors are freed before the next block
        release_host_memory()
    rest = _post_order(sk.model, stop=done)  # the base's own tree (peft's wrappers hold no tensors of their own)
    filler.fill(rest)
    filler.finish()
    if init_adapters is not None:
        init_adapters(rest)
    filler.close()
    if wrap_root is None:
        return model
    root = wrap_root(model)
    sync()
    release_host_memory()
    return root


def build_eager(source: Any, model_cls: Any = None, dtype: torch.dtype = torch.float32) -> nn.Module:
    """The reference path: the whole model built on the host (fresh init or ``from_pretrained``)."""
    src = source if isinstance(source, ModelSource) else resolve_source(source)
    cls = model_class(src.config, model_cls)
    if src.pretrained:
        with bypass():
            return cls.from_pretrained(str(src.directory), config=src.config, dtype=dtype)
    return _instantiate(cls, src.config, dtype)
