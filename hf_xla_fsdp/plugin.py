"""`XlaFsdpPlugin`: every XLA FSDP setting in one validated dataclass, readable from
transformers' `fsdp_config` (dict or JSON) and from an accelerate YAML's `fsdp_config:` mapping.

Each setting is described once, by its field: its type and default, ``help``, the other spellings
it is accepted under (``aliases``) and whether it is an ``XlaFullyShardedDataParallel`` keyword
(``fsdp_kwarg``, also accepted inside transformers' ``xla_fsdp_settings``). Which engines honour a
setting and which values an engine refuses are the engines' own declarations (``honours``, ``refuses``
of :class:`hf_xla_fsdp.engines.base.Engine`), read through :mod:`hf_xla_fsdp.config.engines`. The
accepted keys, the aliases, the type checks and the "allowed keys" of error messages are all derived
from these descriptions, so a new setting is one field. The plugin holds settings only: it reads the
engines' declarations and calls no engine; :meth:`build`, :meth:`wrap` and :meth:`prepare_optimizer`
are forwards to :class:`~hf_xla_fsdp.session.XlaFsdpSession`, which does the work.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

import torch

from .config import engines as engine_rules
from .config import resolve as sources
from .config.engines import engine_label
from .config.keys import normalize, read_accelerate_yaml
from .errors import ConfigError
from .modeling.tensor_parallel import parse_plan
from .settings import check_size, parse_bool, parse_buckets, parse_cache_dir, parse_dtype, parse_int

if TYPE_CHECKING:  # keep torch_xla and transformers out of the import path of config-only users
    from transformers import PretrainedConfig

    from .engines.base import Engine

logger = logging.getLogger(__name__)

_SHARDING = ("zero3", "zero2")
CHECKPOINT_FORMATS = ("sharded", "sharded+consolidated")
CHECKPOINT_STORAGES = ("auto", "shared", "local", "object")  # checkpoint/storage.py: one backend each
# accelerate / torch FSDP spell the same choice with sharding-strategy names
_SHARDING_ALIASES = {"full_shard": "zero3", "1": "zero3", "shard_grad_op": "zero2", "2": "zero2"}

def setting(default: Any, help: str, *, aliases: Sequence[str] = (), fsdp_kwarg: bool = False, minimum: int = 0) -> Any:
    """A plugin field with its one description (see the module docstring for the keys)."""
    return dataclasses.field(default=default, metadata={
        "help": help, "aliases": tuple(aliases), "fsdp_kwarg": fsdp_kwarg, "minimum": minimum})


#: ``version``'s default: what a settings mapping without it means (transformers reads a missing ``xla_fsdp_v2`` so)
_UNSAID_VERSION = 1


@dataclass(frozen=True)
class XlaFsdpPlugin:
    """Settings for PyTorch/XLA Fully Sharded Data Parallel, applied with :meth:`wrap` or :meth:`build`.

    Every field's ``help`` says what it does (``XlaFsdpPlugin.describe()`` lists them all). A plugin is fixed once
    built (a frozen dataclass): ``dataclasses.replace(plugin, ...)`` makes a changed copy, and whatever a session
    derives from it (e.g. ``tensor_parallel_size: auto``'s value) is the session's, never written back.
    """

    engine: Optional[str] = setting(
        None, "which engine shards: one of the engine keys (the engines table of docs/trainer.md; an older spelling "
              "is accepted as its alias). Default: the first engine in that table whose runtime is installed, unless "
              "a setting is given that only another engine honours (see docs/fsdp2.md)")
    version: int = setting(_UNSAID_VERSION, "the older spelling of an engine: with engine unset or an alias that "
                                            "several engines share, the engine of this version (the engines table "
                                            "lists each one's); once resolved, the version of the engine selected",
                           minimum=1)
    transformer_layer_cls_to_wrap: Optional[list[str]] = setting(
        None, "class names of the blocks that become their own FSDP unit (default: the model's _no_split_modules)")
    min_num_params: int = setting(0, "size-based wrapping instead: every module with at least this many "
                                     "parameters becomes a unit (wins over class names when > 0)")
    sharding: str = setting("zero3", "'zero3': a unit per selected block and the root; 'zero2': the root only",
                            aliases=("sharding_strategy",))
    activation_checkpointing: bool = setting(False, "recompute each block's activations in backward "
                                                    "(torch_xla's checkpoint_module; fsdp2: torch.utils.checkpoint)",
                                             aliases=("xla_fsdp_grad_ckpt",))
    meta_init: bool = setting(True, "build a model given as a config or directory on meta and materialize it "
                                    "block by block (never whole in memory)")
    # XlaFullyShardedDataParallel options, passed on unchanged
    compute_dtype: Optional[Union[str, torch.dtype]] = setting(
        None, "dtype of forward/backward compute, e.g. 'bfloat16'. v1: shards stay fp32, gathered parameters are "
              "cast; v2: parameters are stored in it and the optimizer updates fp32 master copies of the "
              "trainable ones; fsdp2: MixedPrecisionPolicy(param_dtype), fp32 shards and fp32 gradient reduction",
        fsdp_kwarg=True)
    buffer_dtype: Optional[Union[str, torch.dtype]] = setting(
        None, "dtype of buffers during compute", fsdp_kwarg=True)
    fp32_reduce_scatter: bool = setting(False, "reduce-scatter gradients in fp32", fsdp_kwarg=True)
    reshard_after_forward: bool = setting(True, "free gathered parameters after forward (fsdp2: false keeps each "
                                                "block's gathered parameters until its backward, as zero2 does)",
                                          fsdp_kwarg=True)
    flatten_parameters: bool = setting(False, "flatten each unit's parameters into one tensor", fsdp_kwarg=True)
    execute_sharding_on_init: bool = setting(True, "run the sharding when wrapping", fsdp_kwarg=True)
    optimization_barrier_in_forward: bool = setting(True, "XLA optimization barrier in forward", fsdp_kwarg=True)
    optimization_barrier_in_backward: bool = setting(True, "XLA optimization barrier in backward", fsdp_kwarg=True)
    sync_on_finalization: bool = setting(False, "sync after each backward", fsdp_kwarg=True)
    disable_reshard_on_root: bool = setting(True, "keep the root unit's parameters gathered", fsdp_kwarg=True)
    shard_param_on_dim_0: bool = setting(False, "shard parameters along dim 0 instead of flattening",
                                         fsdp_kwarg=True)
    pin_layout_in_collective_ops: bool = setting(True, "pin layouts in collectives", fsdp_kwarg=True)
    reduce_scatter_bucket_size_mb: int = setting(0, "bucket reduce-scatters up to this size", fsdp_kwarg=True)
    coalesce_all_gather_ops: bool = setting(False, "coalesce all-gathers", fsdp_kwarg=True)
    # explicit sharding group: lets one process build exactly what rank r of N holds
    sharding_groups: Optional[list[list[int]]] = setting(None, "explicit sharding groups (with sharding_rank and "
                                                               "sharding_world_size)", fsdp_kwarg=True)
    sharding_rank: Optional[int] = setting(None, "this process's rank in its sharding group", fsdp_kwarg=True)
    sharding_world_size: Optional[int] = setting(None, "size of the sharding group", fsdp_kwarg=True)
    replica_size: int = setting(1, "FSDP v2 and fsdp2: devices form a (replica_size, N / replica_size) mesh; parameters "
                                   "are split over the second axis and replicated over the first (hybrid, HSDP, "
                                   "when > 1)", minimum=1)
    tensor_parallel_size: Union[int, str] = setting(
        1, "FSDP v2: devices form a (replica_size, fsdp, T) mesh with fsdp = devices / (replica_size x T); inside each "
           "block attention is split by heads and the MLP by its intermediate dim over the T devices (and the "
           "vocabulary, when T divides it), every split weight still sharded over fsdp on its other dim. The split "
           "follows the model family's plan (llama, mistral, gemma, qwen2, gpt2) or tensor_parallel_plan "
           "(see docs/fsdp-v2.md). 'auto': when the model is built, the planner's smallest T whose per-device "
           "memory fits the devices' memory (batch 1, the model's sequence length; 1 when the runtime reports no "
           "memory limit, as XLA:CPU)", minimum=1)
    tensor_parallel_plan: Optional[dict[str, Any]] = setting(
        None, "FSDP v2 with tensor_parallel_size > 1: {param-name glob or 're:regex': axes} replacing the family's "
              "plan; axes has one entry per weight dim: a mesh axis ('replica', 'fsdp', 'tensor'), a list of them or "
              "null, e.g. {'q_proj.weight': ['tensor', 'fsdp'], 'o_proj.weight': ['fsdp', 'tensor']}")
    checkpoint_format: str = setting("sharded", "what a training checkpoint (the Trainer's checkpoint-N, accelerate's "
                                                "save_state) holds: 'sharded' (rank files) or 'sharded+consolidated' "
                                                "(also a from_pretrained-ready copy)")
    consolidate_dtype: str = setting("auto", "dtype of consolidated models ('auto' keeps the trained dtype)")
    consolidate_max_shard_size: Union[int, str] = setting("5GB", "largest safetensors file of consolidated models")
    merge_adapters: bool = setting(False, "PEFT models: the final save writes the full model with the LoRA updates "
                                          "merged in, instead of peft's adapter files")
    async_save: bool = setting(False, "checkpoints (XlaFsdpTrainer, XlaFsdpAccelerator.save_state): the step waits only "
                                      "for the copy of this rank's shard to host memory (one extra copy of it in host "
                                      "RAM); writing, fsync and the completion marker run in a background thread, "
                                      "and the next save, a load and the end of training wait for it")
    checkpoint_storage: str = setting("auto", "where checkpoint files go and what commits a save: 'shared' (one file "
                                              "system: staging directory renamed into place), 'object' (a gcsfuse "
                                              "mount or a gs:// URL: files in place, the completion marker written "
                                              "last), 'local' (per-host disks: a marker per host, then `hf-xla-fsdp "
                                              "gather`); 'auto': object for a URL or a FUSE mount, else shared")
    save_on_preemption: bool = setting(True, "on SIGTERM (a preemptible TPU VM about to stop), save a checkpoint at "
                                             "the next step boundary and stop cleanly: XlaFsdpTrainer when "
                                             "save_strategy is not 'no' (then exits with code 0); XlaFsdpAccelerator "
                                             "through accelerator.preempted")
    compilation_cache_dir: Optional[str] = setting(
        "auto", "folder of XLA's persistent compilation cache, set up before the first graph compiles: 'auto' = "
                "$HF_XLA_FSDP_COMPILATION_CACHE or ~/.cache/hf_xla_fsdp/xla_cache (skipped once this torch_xla is "
                "known not to load it back); a path; none/false = off. Process 0 of the job writes (holding a lock "
                "file), every other process reads only (see docs/compile-time.md)")
    scan_layers: bool = setting(
        False, "run the model's stack of identical decoder layers as one layer in a loop (torch_xla's scan), so XLA "
               "compiles one layer instead of all of them. The layers' weights are stored stacked (model.layers_scanned.*); "
               "state_dict, checkpoints and every output keep the unrolled model's names, and a checkpoint's model "
               "weights load with or without the setting (the optimizer state only with the same setting). With "
               "activation_checkpointing each layer's activations are recomputed inside the loop. Layers that "
               "differ (e.g. alternating sliding-window attention) are refused (see docs/compile-time.md)")
    compile: bool = setting(
        False, "engine fsdp2: torch.compile each wrapped block (after its activation checkpointing, before fully_shard, "
               "as torchtitan does; parameter names unchanged), with inductor on CPU/CUDA (automatic dynamic shapes: the "
               "first change of sequence length compiles once more, later lengths nothing) and TorchTPU's 'tpu' "
               "backend on TPUs (static shapes). Off by default: it costs start-up, measured on the CPU only (see "
               "docs/fsdp2.md); the Trainer logs graphs_compiled per logging window")
    pad_to_buckets: Union[bool, int, list[int]] = setting(
        True, "XlaFsdpTrainer and XlaFsdpAccelerator's data loaders pad each batch's sequence length up to a few "
              "bucket lengths so varied text compiles a bounded number of graphs (XLA engines; fsdp2 never pads: "
              "with compile, inductor handles new lengths with dynamic shapes): true = powers of two from 64 up to "
              "the model's longest sequence; an int = multiples of it; a list = those lengths; false = off. "
              "input_ids get the pad token (else eos, else 0: hidden by the mask), labels -100, attention masks 0, "
              "on the tokenizer's padding side")

    def __post_init__(self) -> None:  # noqa: C901 - one check per setting, in field order
        def put(name: str, value: Any) -> None:  # frozen: values are normalized once, here
            object.__setattr__(self, name, value)

        for f in dataclasses.fields(self):  # the simple types, from the field descriptions
            if f.type == "bool":
                put(f.name, parse_bool(getattr(self, f.name), f.name))
            elif f.type == "int":
                put(f.name, parse_int(getattr(self, f.name), f.name, f.metadata["minimum"]))
        engine = self._resolved_engine()
        put("engine", engine.key)
        if engine.version is not None:
            put("version", engine.version)
        sharding = str(self.sharding).strip().lower()
        sharding = _SHARDING_ALIASES.get(sharding, sharding)
        if sharding not in _SHARDING:
            raise ConfigError(
                f"sharding={self.sharding!r} is not valid; allowed values: 'zero3' (nested, default), 'zero2' (root only)"
            )
        put("sharding", sharding)
        cls_names = self.transformer_layer_cls_to_wrap
        if isinstance(cls_names, str):
            cls_names = [c.strip() for c in cls_names.split(",") if c.strip()]
        if cls_names is not None:
            if not isinstance(cls_names, (list, tuple)) or not all(isinstance(c, str) and c for c in cls_names):
                raise ConfigError(
                    f"transformer_layer_cls_to_wrap={self.transformer_layer_cls_to_wrap!r} must be a class name "
                    "or a list of class names, e.g. ['LlamaDecoderLayer']"
                )
            cls_names = list(cls_names)
        put("transformer_layer_cls_to_wrap", cls_names)
        fmt = str(self.checkpoint_format).strip().lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise ConfigError(f"checkpoint_format={self.checkpoint_format!r} is not valid; allowed values: "
                              + ", ".join(repr(f) for f in CHECKPOINT_FORMATS))
        put("checkpoint_format", fmt)
        storage = str(self.checkpoint_storage).strip().lower()
        if storage not in CHECKPOINT_STORAGES:
            raise ConfigError(f"checkpoint_storage={self.checkpoint_storage!r} is not valid; allowed values: "
                              + ", ".join(repr(f) for f in CHECKPOINT_STORAGES))
        put("checkpoint_storage", storage)
        put("compilation_cache_dir", parse_cache_dir(self.compilation_cache_dir))
        put("pad_to_buckets", parse_buckets(self.pad_to_buckets))
        put("consolidate_dtype", str(self.consolidate_dtype).strip().lower())
        if self.consolidate_dtype != "auto":
            parse_dtype(self.consolidate_dtype, "consolidate_dtype")
        check_size(self.consolidate_max_shard_size, "consolidate_max_shard_size")
        put("compute_dtype", parse_dtype(self.compute_dtype, "compute_dtype"))
        put("buffer_dtype", parse_dtype(self.buffer_dtype, "buffer_dtype"))
        key = self.engine
        for name, (values, why) in engine.refuses.items():
            if getattr(self, name) in values:
                raise ConfigError(f"{name}={str(getattr(self, name)).replace('torch.', '')} is not available with "
                                  f"{engine_label(key)}: {why}")
        changed = [n for n in self.engine_only_fields(key) if n in self._changed()]
        if changed:
            owners = dict.fromkeys(k for n in changed for k in engine_rules.honouring(n))
            raise ConfigError(f"{', '.join(changed)} appl{'ies' if len(changed) == 1 else 'y'} to "
                              f"{' or '.join(engine_label(k) for k in owners)} only; remove it for {engine_label(key)}")
        put("tensor_parallel_plan", parse_plan(self.tensor_parallel_plan))
        if str(self.tensor_parallel_size).strip().lower() == "auto":
            put("tensor_parallel_size", "auto")  # resolved by the session once the model and devices are known
        else:
            put("tensor_parallel_size", parse_int(self.tensor_parallel_size, "tensor_parallel_size", 1))
        if self.scan_layers and self.tensor_parallel_size != 1:
            # scan stacks each weight over the layers and shards the stack over fsdp only: the tensor split and
            # the head-local attention would be silently lost
            raise ConfigError(f"scan_layers and tensor_parallel_size={self.tensor_parallel_size} cannot be combined yet "
                              "(scanned layers are stacked and sharded over fsdp only); turn one of them off")
        group = (self.sharding_groups, self.sharding_rank, self.sharding_world_size)
        if any(v is not None for v in group) and not all(v is not None for v in group):
            raise ConfigError(
                "sharding_groups, sharding_rank and sharding_world_size must be given together (or none of them)"
            )
        if self.sharding_world_size is not None:
            put("sharding_world_size", parse_int(self.sharding_world_size, "sharding_world_size", 1))
            put("sharding_rank", parse_int(self.sharding_rank, "sharding_rank", 0))
            if self.sharding_rank >= self.sharding_world_size:
                raise ConfigError(
                    f"sharding_rank={self.sharding_rank} must be below sharding_world_size={self.sharding_world_size}"
                )

    def _changed(self) -> list[str]:
        """The settings given another value than their default (``version`` is an engine's name, not a setting)."""
        return [f.name for f in dataclasses.fields(self)
                if f.name not in ("engine", "version") and getattr(self, f.name) != f.default]

    def _resolved_engine(self) -> "Engine":
        """The engine ``engine`` (a key or an alias) and ``version`` select; both unset, the default engine
        (:func:`hf_xla_fsdp.config.engines.default_engine`: the first installed one, unless a setting only another
        engine honours is given)."""
        version = None if self.version == _UNSAID_VERSION else parse_int(self.version, "version", 1)
        if self.engine is None and version is None:
            return engine_rules.default_engine(self._changed())
        return engine_rules.select_engine(self.engine, version)

    @property
    def engine_key(self) -> str:
        """The key of the engine these settings select: ``engine`` once resolved (kept for older callers)."""
        return self.engine

    # ------------------------------------------------------------------ descriptions
    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every setting this plugin accepts."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def fsdp_kwarg_names(cls) -> list[str]:
        """The settings passed to ``XlaFullyShardedDataParallel`` (also accepted inside ``xla_fsdp_settings``)."""
        return [f.name for f in dataclasses.fields(cls) if f.metadata["fsdp_kwarg"]]

    @classmethod
    def engine_only_fields(cls, key: str) -> list[str]:
        """Settings that the engine ``key`` does not honour (they must keep their defaults there)."""
        return [f.name for f in dataclasses.fields(cls) if key not in engine_rules.honouring(f.name)]

    @classmethod
    def describe(cls) -> dict[str, str]:
        """Every setting's help text, by name."""
        return {f.name: f.metadata["help"] for f in dataclasses.fields(cls)}

    # ------------------------------------------------------------------ readers
    @classmethod
    def from_dict(cls, settings: Mapping[str, Any], *, source: str = "settings") -> "XlaFsdpPlugin":
        """Build from our own vocabulary (field names, ``fsdp_`` prefixes allowed); unknown keys are errors."""
        return cls(**cls._normalize(settings, source))

    @classmethod
    def _normalize(cls, settings: Mapping[str, Any], source: str) -> dict[str, Any]:
        fields = dataclasses.fields(cls)
        return normalize(settings, source, fields={f.name for f in fields}, fsdp_kwargs=cls.fsdp_kwarg_names(),
                         aliases={alias: f.name for f in fields for alias in f.metadata["aliases"]})

    @classmethod
    def resolve(cls, settings_sources: Sequence[Optional["sources.Source"]]) -> "XlaFsdpPlugin":
        """The plugin that settings from several places describe together, by the one conflict rule of
        :func:`hf_xla_fsdp.config.resolve.resolve` (every entry point resolves its settings through it)."""
        return sources.resolve(settings_sources, cls)

    @classmethod
    def from_fsdp_config(cls, fsdp_config: Union[Mapping[str, Any], str, os.PathLike]) -> "XlaFsdpPlugin":
        """Build from transformers' ``fsdp_config`` (a dict, inline JSON or the path of its JSON file).

        Accepts transformers' keys (``xla``, ``xla_fsdp_settings``, ``xla_fsdp_grad_ckpt``,
        ``xla_fsdp_v2``, ``transformer_layer_cls_to_wrap``, ``min_num_params``, each optionally
        prefixed ``fsdp_``) and any of this plugin's field names.
        """
        return cls.resolve([sources.settings_source("fsdp_config", fsdp_config)])

    @classmethod
    def from_accelerate_config(cls, yaml_path: Union[str, os.PathLike]) -> "XlaFsdpPlugin":
        """Build from the ``fsdp_config:`` mapping (and ``mixed_precision``) of an accelerate YAML config file."""
        return cls.resolve(sources.yaml_sources(yaml_path))

    @classmethod
    def from_accelerate_launch(cls) -> "XlaFsdpPlugin":
        """The plugin described by the ``fsdp_config:`` of the accelerate YAML this process was launched with
        (found as :func:`hf_xla_fsdp.config.sources.find_accelerate_config` says), checked against its
        ``distributed_type``."""
        from .config.sources import launched_yaml

        path = launched_yaml()
        plugin = cls.from_accelerate_config(path)
        plugin.check_launcher(read_accelerate_yaml(path).get("distributed_type", "XLA"), str(path))
        return plugin

    def with_mixed_precision(self, precision: Any, source: str) -> "XlaFsdpPlugin":
        """This plugin with accelerate's / the Trainer's mixed precision (``"no"``, ``"bf16"``, ``"fp16"``) applied,
        by the one conflict rule of :func:`hf_xla_fsdp.config.resolve.resolve` (``source`` names the precision's
        origin in messages). On XLA FSDP mixed precision is the engine's compute dtype, never autocast (which breaks
        SDPA attention on XLA)."""
        return self.resolve([sources.plugin_source(self), sources.precision_source(source, precision)])

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable settings (dtypes as strings); ``from_dict(to_dict())`` round-trips."""
        out = dataclasses.asdict(self)
        for key in ("compute_dtype", "buffer_dtype"):
            if out[key] is not None:
                out[key] = str(out[key]).removeprefix("torch.")
        return out

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``XlaFullyShardedDataParallel``."""
        kwargs = {name: getattr(self, name) for name in self.fsdp_kwarg_names()}
        for name in ("sharding_groups", "sharding_rank", "sharding_world_size"):
            if kwargs[name] is None:
                del kwargs[name]
        return kwargs

    def check_launcher(self, distributed_type: Any, source: str) -> None:
        """Refuse an accelerate ``distributed_type`` the selected engine cannot run under (one line with the fix)."""
        distributed = str(distributed_type).upper()
        allowed, why = engine_rules.launchers(self.engine)
        if distributed not in allowed:
            raise ConfigError(f"distributed_type={distributed!r} in {source}: {why}")

    # ------------------------------------------------------------------ actions: forwards to a session
    # The session does the work; these three are the plugin's only imports of a layer above it (inside the methods,
    # so importing the plugin imports no session; tests/unit/test_package.py allows them and nothing else). They stay,
    # without a DeprecationWarning: they are the documented spelling of a hand-written loop (docs/index.md, the
    # examples, the benchmarks) and cost nothing; a warning would only break `-W error` runs.
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model`` (eager, on CPU or XLA) with nested FSDP per this plugin: a forward to
        ``XlaFsdpSession(plugin).wrap_model(model)`` (:meth:`hf_xla_fsdp.session.XlaFsdpSession.wrap_model`), a
        short-lived session of its own; keep one session to build, wrap and save with the same runtime."""
        from .session import XlaFsdpSession

        return XlaFsdpSession(self).wrap_model(model)

    def build(self, config_or_pretrained_dir: Union["PretrainedConfig", str, os.PathLike], **kwargs: Any) -> torch.nn.Module:
        """Construct the model on ``meta`` and materialize, wrap and shard it block by block: a forward to
        ``XlaFsdpSession(plugin).build_model(...)``; see :meth:`hf_xla_fsdp.session.XlaFsdpSession.build_model` for
        the keyword arguments."""
        from .session import XlaFsdpSession

        return XlaFsdpSession(self).build_model(config_or_pretrained_dir, **kwargs)

    @staticmethod
    def prepare_optimizer(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
        """Ready ``optimizer`` (built from the wrapped ``model``'s parameters) for the engine; returns it.

        Needed only in a hand-written loop: accelerate's ``prepare`` and the Trainer call it. With FSDP v2
        and ``compute_dtype`` it makes the optimizer update the fp32 master copies of the parameters. A forward to
        :func:`hf_xla_fsdp.session.prepare_optimizer` (``XlaFsdpSession.prepare_optimizer`` in a session).
        """
        from .session import prepare_optimizer

        return prepare_optimizer(model, optimizer)
