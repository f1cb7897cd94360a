"""``XlaFsdpSession``: one XLA FSDP run, under every entry point.

A session is built once from an :class:`~hf_xla_fsdp.plugin.XlaFsdpPlugin`. It resolves the engine once and
owns everything the entry points share: the runtime set-up, building and wrapping models, readying optimizers
and data loaders, clipping, preemption and checkpointing (:class:`~.checkpoints.CheckpointManager`).
``XlaFsdpAccelerator`` owns one; ``XlaFsdpTrainer`` uses its accelerator's; ``XlaFsdpPlugin.build`` and
``.wrap`` make a short-lived one. The engine never changes during a session. The plugin a session is given is
never changed (it is frozen); what the session derives from it (``tensor_parallel_size: auto``'s value, once the
model is known) is the session's own :attr:`XlaFsdpSession.plugin`, a copy. The runtime is readied once per process,
whichever session asks first (:mod:`.bootstrap`).
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import re
from typing import TYPE_CHECKING, Any, Callable, Optional, Union

import torch
from torch import nn

from ..engines import engine_for, in_evaluation_mode, is_wrapped, unit_classes
from ..errors import ConfigError
from . import compile_cache, shapes
from .bootstrap import ready_runtime
from .checkpoints import CheckpointManager
from .preemption import PreemptionGuard

logger = logging.getLogger(__name__)

# transformers' own decay rule (Trainer.get_decay_parameter_names), applied to the original names
_NO_DECAY = [re.compile(p) for p in (r"bias", r"layernorm", r"rmsnorm", r"(?:^|\.)norm(?:$|\.)", r"_norm(?:$|\.)")]


def _ties_kept(*args: Any, **kwargs: Any) -> None:
    """``tie_weights`` of a wrapped model: the engine keeps its ties already."""


if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..plugin import XlaFsdpPlugin
    from .throughput import Throughput


class XlaFsdpSession:
    """The plugin's settings with their engine, and what every entry point does with them (see the module)."""

    def __init__(self, plugin: "XlaFsdpPlugin", *, barrier: Optional[Callable[[str], None]] = None) -> None:
        #: the settings in use: the plugin given, or a copy with what the session derived (never the user's object)
        self.plugin = plugin
        #: the FSDP engine, resolved once
        self.engine = engine_for(plugin)
        self.checkpoints = CheckpointManager(self, barrier=barrier)
        self._preemption: Optional[PreemptionGuard] = None
        #: the training step now (set by an entry point that counts steps), named when a new graph compiles late
        self.step_source: Optional[Callable[[], Optional[int]]] = None
        self._pad_errors: list = []  # refusals of the padding collators (loader threads), raised in the training thread
        self._moved: dict[int, Any] = {}  # id(original parameter) -> the sharded parameter holding it now

    def __repr__(self) -> str:
        return f"XlaFsdpSession({self.engine.title}, sharding={self.plugin.sharding!r})"

    # ----------------------------------------------------------------- runtime
    def setup_runtime(self, *, counted_processes: Optional[int] = None, what: str = "this process") -> None:
        """The XLA runtime readied for the engine, before any XLA tensor exists: once per process
        (:func:`.bootstrap.ready_runtime`).

        ``counted_processes``: how many processes a launcher has already counted (accelerate's state); when the
        runtime can no longer be set up for the engine (FSDP v2 needs SPMD before the device is first used), one
        line says what to add to the script (``what`` names who used the device first).
        """
        ready_runtime(self.plugin, what=what, counted_processes=counted_processes)

    def processes_per_host(self, requested: Any) -> Optional[int]:
        """How many processes a launcher starts on this host for the engine, ``requested`` being what the user asked
        for (``--num_processes``, a YAML's ``num_processes``); ``None``: the launcher's own process runs the script."""
        return self.engine.processes_per_host(requested)

    # ----------------------------------------------------------------- models
    def build_model(self, source: Union["PretrainedConfig", str, os.PathLike], *, model_cls: Any = None,
                    dtype: torch.dtype = torch.float32, progress: bool = True, wrap_root: bool = True,
                    peft_config: Any = None, evaluation_mode: bool = False) -> nn.Module:
        """Build ``source`` (a config, a ``config.json``, a local pretrained directory, a Hub id in the local cache, or
        a model loaded lazily by ``from_pretrained`` / ``from_config`` under the launch) wrapped with XLA FSDP.

        With the plugin's ``meta_init`` (the default) each block is materialized, wrapped and sharded in turn, so the
        whole model never exists on the host; otherwise the model is built eagerly and then wrapped (the reference
        path). ``wrap_root=False`` stops before the outer unit (see :meth:`finish_wrapping`). ``peft_config`` (a
        ``peft.LoraConfig``) attaches adapters on ``meta`` first and returns the wrapped ``PeftModel``.
        ``evaluation_mode``: a model for inference only (a reference, teacher or reward model; see :meth:`wrap_model`).
        """
        from ..modeling.lazy import lazy_state
        from ..modeling.meta_init import build_eager, build_sharded, resolve_source

        if evaluation_mode and peft_config is not None:
            raise ConfigError("a model in evaluation mode trains nothing: build it without peft_config")
        lazy = lazy_state(source)
        if lazy is not None:
            return self._build_lazy(source, lazy, wrap_root=wrap_root, progress=progress, peft_config=peft_config,
                                    evaluation_mode=evaluation_mode)
        src = resolve_source(source)
        self.setup_runtime()
        self._resolve_tensor_parallel(src.config)
        if not self.plugin.meta_init:
            eager = build_eager(src, model_cls=model_cls, dtype=dtype)
            if peft_config is not None:
                from ..modeling.adapters import require_peft

                eager = require_peft().get_peft_model(eager, peft_config)
            if wrap_root:
                return self.wrap_model(eager, evaluation_mode=evaluation_mode)
            return self._wrap_blocks(eager, evaluation_mode) if evaluation_mode else eager
        block = functools.partial(self._wrap_block, evaluation_mode=evaluation_mode)
        root = functools.partial(self._wrap_root, evaluation_mode=evaluation_mode) if wrap_root else None
        return build_sharded(src, self.plugin, wrap_block=block, wrap_root=root, model_cls=model_cls, dtype=dtype,
                             progress=progress, peft_config=peft_config, sync=self.engine.sync)

    def _build_lazy(self, model: nn.Module, lazy: Any, *, wrap_root: bool, progress: bool, peft_config: Any,
                    evaluation_mode: bool = False) -> nn.Module:
        """A model loaded lazily (:mod:`hf_xla_fsdp.modeling.lazy`): its own skeleton filled and sharded block by block
        from its weight files (or recorded init), as :meth:`build_model` builds a directory."""
        from ..modeling.lazy import check_no_foreign_meta
        from ..modeling.meta_init import build_sharded

        check_no_foreign_meta(model, lazy)
        self.setup_runtime()
        self._resolve_tensor_parallel(getattr(model, "config", None))
        if not self.plugin.meta_init:
            lazy.materialize("meta_init: false")
            if peft_config is not None:
                from ..modeling.adapters import require_peft

                model = require_peft().get_peft_model(model, peft_config)
            if wrap_root:
                return self.wrap_model(model, evaluation_mode=evaluation_mode)
            return self._wrap_blocks(model, evaluation_mode) if evaluation_mode else model
        state = torch.get_rng_state()
        lazy.release()
        try:
            block = functools.partial(self._wrap_block, evaluation_mode=evaluation_mode)
            root = functools.partial(self._wrap_root, evaluation_mode=evaluation_mode) if wrap_root else None
            return build_sharded(lazy.skeleton.source, self.plugin, wrap_block=block, progress=progress, wrap_root=root,
                                 peft_config=peft_config, skeleton=lazy.skeleton, sync=self.engine.sync)
        finally:
            if peft_config is None:  # loading draws nothing at wrap time eagerly; adapters draw now, as peft would
                torch.set_rng_state(state)

    def materialize(self, model: Any, *, seed: int, progress: bool = True, wrap_root: bool = True,
                    peft_config: Any = None) -> nn.Module:
        """A trainer's ``model`` argument as a model: a module as it is (wrapped unless it is already or ``wrap_root``
        is False); any other source (:meth:`build_model`'s) built after seeding with ``seed``, so fresh weights and
        adapters are those of building after ``set_seed`` (run_clm, TRL); a model loaded lazily built from its weight
        files, seeded only for its adapters (``peft_config``), since loading draws nothing."""
        from transformers import set_seed

        from ..modeling.lazy import lazy_state
        from ..modeling.meta_init import check_model_source

        if isinstance(model, nn.Module) and lazy_state(model) is None:
            return model if is_wrapped(model) or not wrap_root else self.wrap_model(model)
        check_model_source(model)
        if not isinstance(model, nn.Module) or peft_config is not None:  # a model loaded lazily is built, not drawn
            set_seed(seed)
        return self.build_model(model, progress=progress, wrap_root=wrap_root, peft_config=peft_config)

    def wrap_model(self, model: nn.Module, *, evaluation_mode: bool = False) -> nn.Module:
        """Nested (zero3) or root-only (zero2) XLA FSDP wrapping of an eager ``model`` (or of one loaded lazily).

        ``evaluation_mode``: the model only runs forward (a reference, teacher or reward model). Its parameters are
        frozen before they are sharded, so it has no gradients, no fp32 master copies and is never given to an
        optimizer; its shards are stored in the plugin's ``compute_dtype`` (bf16 runs keep a bf16 reference); every
        block is its own unit whatever ``sharding`` says (there is no backward whose all-gathers zero2 would save);
        it is put in ``eval()`` mode (no dropout).
        """
        from ..modeling.lazy import lazy_state

        lazy = lazy_state(model)
        if lazy is not None:
            return self._build_lazy(model, lazy, wrap_root=True, progress=True, peft_config=None,
                                    evaluation_mode=evaluation_mode)
        self._check_not_wrapped(model)
        if any(p.is_meta for p in model.parameters()):
            raise ConfigError("the model has parameters on the meta device; use XlaFsdpPlugin.build to materialize it")
        return self._wrap_root(self._wrap_blocks(model, evaluation_mode), evaluation_mode=evaluation_mode)

    def _wrap_blocks(self, model: nn.Module, evaluation_mode: bool) -> nn.Module:
        from ..modeling.wrapping import plan_blocks, replace_submodule

        self.setup_runtime()
        self._resolve_tensor_parallel(getattr(model, "config", None))
        plan = plan_blocks(model, self.plugin)
        for name in plan.names:
            replace_submodule(model, name, self._wrap_block(model.get_submodule(name), plan.nested,
                                                            evaluation_mode=evaluation_mode))
        return model

    def _resolve_tensor_parallel(self, config: Any) -> None:
        """``tensor_parallel_size: auto`` becomes the planner's choice for this model and these devices, once: the
        session's plugin becomes a copy with the chosen size (the user's plugin stays as given), so every later model
        and checkpoint of the session uses the same mesh."""
        if self.plugin.tensor_parallel_size != "auto":
            return
        if config is None:
            raise ConfigError("tensor_parallel_size=auto needs a transformers model (its config) to plan; give a number")
        from ..planning.tpu import choose_tensor_parallel
        from ..runtime import device_count, device_memory_bytes

        size, why = choose_tensor_parallel(config, self.plugin, device_count(), device_memory_bytes())
        logger.warning("tensor_parallel_size=auto -> %d: %s", size, why)
        self.plugin = dataclasses.replace(self.plugin, tensor_parallel_size=size)

    def finish_wrapping(self, model: nn.Module, *, evaluation_mode: Optional[bool] = None) -> nn.Module:
        """The model with its outer unit: wrapped whole when nothing is yet, else only the root added (after a
        ``build_model(..., wrap_root=False)`` and whatever the caller did to the model in between).

        ``evaluation_mode`` defaults to what the model's blocks were built with (False for an unwrapped model).
        """
        if not is_wrapped(model):
            return self.wrap_model(model, evaluation_mode=bool(evaluation_mode))
        if evaluation_mode is None:
            evaluation_mode = in_evaluation_mode(model)
        elif evaluation_mode != in_evaluation_mode(model):
            built = "for training" if evaluation_mode else "for inference"
            raise ConfigError(f"{type(model).__name__}'s blocks were wrapped {built}; finish wrapping it with "
                              f"evaluation_mode={not evaluation_mode}")
        if not isinstance(model, unit_classes()):
            return self._wrap_root(model, evaluation_mode=evaluation_mode)
        return model

    def unwrap(self, model: nn.Module) -> nn.Module:
        """The user's module inside the FSDP units."""
        return self.engine.unwrap(model)

    def transformers_model(self, model: nn.Module) -> nn.Module:
        """The transformers model inside the FSDP units and, for a PEFT model, inside peft's (whose plain
        ``PeftModel.forward(*args, **kwargs)`` names no input), as transformers inspects a model."""
        inner = self.unwrap(model)
        if hasattr(inner, "get_base_model") and hasattr(inner, "peft_config"):
            inner = inner.get_base_model()
        return inner

    def _wrap_block(self, block: nn.Module, nested: bool, *, evaluation_mode: bool = False) -> nn.Module:
        # the keyword only when asked: an engine that wraps every model for training need not know it
        mode = {"evaluation_mode": True} if evaluation_mode else {}
        return self.engine.wrap_block(block, self.plugin, nested, **mode)

    def _wrap_root(self, model: nn.Module, *, evaluation_mode: bool = False) -> nn.Module:
        if self.plugin.scan_layers and getattr(getattr(model, "config", None), "use_cache", False):
            model.config.use_cache = False  # a KV cache cannot live in a scan: evaluation scans too
        mode = {"evaluation_mode": True} if evaluation_mode else {}
        wrapped = self.engine.wrap_root(model, self.plugin, **mode)
        if self.plugin.scan_layers:
            self._install_scan(wrapped)
        from ..modeling.routing import inner_modules, route_through_root

        # unwrap_model(model)(...) and .generate() run through the root unit (which gathers its own shards)
        inner = self.engine.unwrap(wrapped)
        route_through_root(wrapped, inner_modules(wrapped, inner))
        if hasattr(inner, "tie_weights"):
            # the engine keeps a tied weight once, shared by both names; re-tying (as accelerate scripts do on XLA after
            # prepare) would look for parameters the engine has replaced by its shards
            inner.tie_weights = _ties_kept
        return wrapped

    def _install_scan(self, wrapped: nn.Module) -> None:
        """Run the wrapped model's stack of identical blocks (its FSDP units) as one scanned layer."""
        from ..modeling.scan import install

        inner = self.engine.unwrap(wrapped)
        names = set(self.plugin.transformer_layer_cls_to_wrap or getattr(inner, "_no_split_modules", None) or ())
        blocks = [m for m in inner.modules() if m is not inner
                  and (isinstance(m, self.engine.unit_class()) or type(self.engine.unwrap(m)).__name__ in names)]
        install(inner, blocks, unwrap=self.engine.unwrap, remat=self.plugin.activation_checkpointing,
                annotations=self.engine.scan_annotations(self.plugin, wrapped))

    @staticmethod
    def _check_not_wrapped(model: nn.Module) -> None:
        """Refuse a model that already holds XLA FSDP units: wrapping twice would shard shards."""
        if is_wrapped(model):
            unit = next((type(m).__name__ for m in model.modules() if isinstance(m, unit_classes())), "XLA FSDP")
            raise ConfigError(f"{type(model).__name__} is already wrapped with {unit}; pass the unwrapped model to "
                              "XlaFsdpPlugin.wrap (or use it as it is)")

    # ----------------------------------------------------------------- training
    def prepare_optimizer(self, model: nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Ready ``optimizer`` (built from the wrapped ``model``'s parameters) for the engine and create its state
        on the devices (see :meth:`create_optimizer_state`); returns it."""
        self.engine.prepare_optimizer(model, optimizer)
        self.create_optimizer_state(optimizer)
        return optimizer

    def wrap_for_optimizers(self, model: nn.Module) -> nn.Module:
        """:meth:`wrap_model` for a model whose optimizers may have been built before it was wrapped (accelerate's
        ``prepare`` in any order): which shard now holds each original parameter is kept for :meth:`repoint_optimizers`."""
        from .optimizers import moved_parameters, original_parameters

        originals = original_parameters(model)
        wrapped = self.wrap_model(model)
        self._moved.update(moved_parameters(originals, wrapped))
        return wrapped

    def repoint_optimizers(self, optimizers: list, models: list) -> list[list[nn.Parameter]]:
        """``optimizers`` built before their models were wrapped, pointed at the shards of the wrapped ``models`` that
        hold their parameters now (the parameters of a model not yet wrapped stay until it is). Returns, for each
        optimizer, the parameters it holds of no wrapped model."""
        from .optimizers import repoint_optimizer, updated_parameter_ids

        sharded = updated_parameter_ids(models)
        return [repoint_optimizer(optimizer, self._moved, sharded) for optimizer in optimizers]

    def ready_optimizers(self, models: list, optimizers: list) -> None:
        """Optimizers built before their models were wrapped (accelerate's ``prepare`` of any order): re-pointed at
        the sharded parameters (:meth:`repoint_optimizers`), checked to hold the wrapped ``models``' parameters only,
        readied by the engine (e.g. fp32 master copies), their state created."""
        from .optimizers import check_optimizer_parameters

        if not models:
            return
        for unknown in self.repoint_optimizers(optimizers, models):
            check_optimizer_parameters(unknown)
        for model in models:  # e.g. FSDP v2 with compute_dtype: the optimizer updates fp32 master copies
            for optimizer in optimizers:
                self.engine.prepare_optimizer(model, optimizer)
        for optimizer in optimizers:  # after every model's, so the state is made for what is updated
            self.create_optimizer_state(optimizer)

    def create_optimizer_state(self, optimizer: torch.optim.Optimizer) -> None:
        """Create now, sharded like the parameters, the state ``optimizer`` would make in its first step, so the
        first training step traces the same graph as every later one (XLA compiles it once, not twice)."""
        from .optimizers import create_state

        if create_state(optimizer, self.engine.zeros_like):
            self.engine.sync()

    def pad_batches(self, loader: Any, models: Optional[Callable[[], Any]] = None) -> Any:
        """A host data loader whose batches are padded to the ``pad_to_buckets`` lengths (see :mod:`.shapes`);
        ``models`` gives the prepared models (their config's pad token and longest sequence), read at the first batch."""
        if not self.engine.compiles_graphs:  # an eager engine compiles nothing: padding would only cost compute
            return loader
        inner = (lambda: [self.unwrap(m) for m in models()]) if models is not None else None
        return shapes.pad_loader(loader, self.plugin.pad_to_buckets, models=inner, errors=self._pad_errors)

    def prepare_loader(self, loader: Any) -> Any:
        """An XLA device loader adjusted for the engine (FSDP v2: every batch split over all devices) that logs one
        line when, after warm-up, new input shapes compile a new graph."""
        loader = self.engine.prepare_loader(loader, self.plugin)
        if not self.engine.compiles_graphs:
            return loader
        watch = shapes.RecompileWatch(self.plugin.pad_to_buckets, step=lambda: self.step_source and self.step_source(),
                                      after_compile=compile_cache.check, errors=self._pad_errors)
        return shapes.watch_loader(loader, watch)

    def like_step_output(self, tensor: torch.Tensor) -> None:
        """Annotate ``tensor``, carried by a training loop from step to step, as a step's outputs are, so the
        training step compiles once (not again at step 2)."""
        self.engine.like_step_output(tensor, self.plugin)

    def whole(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` held whole by every device, for a read on the host that compiles nothing the second time
        (see the engines' ``whole``)."""
        return self.engine.whole(tensor, self.plugin)

    @staticmethod
    def model_of(parameters: Any, models: list, what: str) -> nn.Module:
        """The wrapped model of ``models`` whose ``parameters()`` these are, all of them in order (FSDP clips, and
        gathers, a whole model at a time); one line naming ``what`` was called otherwise."""
        ids = [id(p) for p in parameters]
        for model in models:
            if ids == [id(p) for p in model.parameters()]:
                return model
        raise ConfigError(f"{what} on an XLA FSDP model needs the prepared model's model.parameters()")

    def clip_grad_norm(self, model: nn.Module, max_norm: float, norm_type: float = 2.0) -> torch.Tensor:
        """Clip the gradients over every shard of every rank; returns the total norm."""
        return self.engine.clip_grad_norm(model, max_norm, norm_type)

    def original_names(self, model: nn.Module) -> dict[str, str]:
        """Wrapped parameter name -> the user's parameter name (a flattened group maps to its flat name)."""
        return self.engine.original_names(model)

    def decay_parameter_names(self, model: nn.Module) -> list[str]:
        """The wrapped ``model``'s parameters that get weight decay by transformers' rule
        (``Trainer.get_decay_parameter_names``: not biases, not norms) applied to the original names inside the units;
        a flattened group (``flatten_parameters``) is one tensor, so it decays as a whole."""
        inner = self.unwrap(model)
        decay = []
        for name, orig in self.original_names(model).items():
            owner = orig.rsplit(".", 1)[0] if "." in orig else ""
            try:
                is_norm = isinstance(inner.get_submodule(owner), nn.LayerNorm)
            except AttributeError:
                is_norm = False
            if "flat_param" in orig or not (is_norm or any(p.search(orig.lower()) for p in _NO_DECAY)):
                decay.append(name)
        return decay

    def parameter_origins(self, model: nn.Module) -> dict[str, list[str]]:
        """Wrapped parameter name -> the user's names of every parameter it holds."""
        return self.engine.parameter_origins(model)

    def throughput_meter(self, model: nn.Module) -> "Throughput":
        """A new throughput meter of the wrapped ``model`` (:mod:`.throughput`): its FLOPs sized from its config, the
        batch key holding its tokens named (none for an image or audio model), the devices read."""
        from .throughput import Throughput

        return Throughput.for_model(model, self.transformers_model)

    # ----------------------------------------------------------------- preemption
    @property
    def preemption(self) -> Optional[PreemptionGuard]:
        """The SIGTERM guard once :meth:`watch_preemption` installed it (None before, or when switched off)."""
        return self._preemption

    def watch_preemption(self) -> bool:
        """With ``save_on_preemption``, record SIGTERM from now on instead of dying (main thread only); True when
        the guard is installed. :meth:`stop_watching_preemption` gives the previous handler back."""
        if not self.plugin.save_on_preemption:
            return False
        if self._preemption is None:
            self._preemption = PreemptionGuard()
        return self._preemption.install()

    @property
    def preempted(self) -> bool:
        """True once SIGTERM has arrived while watched."""
        return self._preemption is not None and self._preemption.received

    def stop_watching_preemption(self) -> None:
        """Give SIGTERM its previous handler back."""
        if self._preemption is not None:
            self._preemption.restore()
