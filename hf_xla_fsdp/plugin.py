"""`XlaFsdpPlugin`: every XLA FSDP setting in one validated dataclass, readable from
transformers' `fsdp_config` (dict or JSON) and from an accelerate YAML's `fsdp_config:` mapping."""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Optional, Sequence, Union

import torch

if TYPE_CHECKING:  # keep torch_xla and transformers out of the import path of config-only users
    from transformers import PretrainedConfig


class ConfigError(ValueError):
    """A setting of the plugin is invalid; the message names the field and the allowed values."""


_DTYPES = {
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
}
_SHARDING = ("zero3", "zero2")
CHECKPOINT_FORMATS = ("sharded", "sharded+consolidated")
# accelerate / torch FSDP spell the same choice with sharding-strategy names
_SHARDING_ALIASES = {"full_shard": "zero3", "1": "zero3", "shard_grad_op": "zero2", "2": "zero2"}


def parse_dtype(value: Union[str, torch.dtype, None], field_name: str) -> Optional[torch.dtype]:
    """Turn a dtype string such as ``"bf16"`` or ``"bfloat16"`` into a ``torch.dtype``."""
    if value is None or isinstance(value, torch.dtype):
        return value
    if isinstance(value, str):
        key = value.strip().lower().removeprefix("torch.")
        if key in _DTYPES:
            return _DTYPES[key]
    raise ConfigError(
        f"{field_name}={value!r} is not a valid dtype; use one of: {', '.join(sorted(set(_DTYPES)))}"
    )


def _parse_bool(value: Any, field_name: str) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.strip().lower() in ("true", "1", "yes")
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    raise ConfigError(f"{field_name}={value!r} must be a boolean (true or false)")


def _parse_int(value: Any, field_name: str, minimum: int = 0) -> int:
    try:
        if isinstance(value, bool):
            raise ValueError
        out = int(value)
        if isinstance(value, float) and out != value:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{field_name}={value!r} must be an integer >= {minimum}") from None
    if out < minimum:
        raise ConfigError(f"{field_name}={value!r} must be an integer >= {minimum}")
    return out


def _check_shard_size(value: Any, field_name: str) -> None:
    from huggingface_hub.serialization._base import parse_size_to_int

    try:
        if isinstance(value, bool) or (value if isinstance(value, int) else parse_size_to_int(value)) <= 0:
            raise ValueError
    except (TypeError, ValueError):
        raise ConfigError(f"{field_name}={value!r} is not a size; use bytes or a string such as '5GB' or '500MB'") from None


@dataclass
class XlaFsdpPlugin:
    """Settings for PyTorch/XLA Fully Sharded Data Parallel, applied with :meth:`wrap` or :meth:`build`.

    Block selection: ``transformer_layer_cls_to_wrap`` (class names, default: the model's
    ``_no_split_modules``) or ``min_num_params`` (size-based; wins when > 0).
    ``sharding="zero3"`` wraps every selected block in its own FSDP unit and then the root;
    ``"zero2"`` wraps only the root. The XLA FSDP options are passed to
    ``torch_xla.distributed.fsdp.XlaFullyShardedDataParallel`` unchanged.

    Saving: ``checkpoint_format`` is ``"sharded"`` (rank files only, the default) or
    ``"sharded+consolidated"`` (each checkpoint also holds a ``from_pretrained``-ready copy);
    ``consolidate_dtype`` (``"auto"`` keeps the trained dtype) and ``consolidate_max_shard_size``
    shape every consolidated model.
    """

    version: int = 1
    transformer_layer_cls_to_wrap: Optional[list[str]] = None
    min_num_params: int = 0
    sharding: str = "zero3"
    activation_checkpointing: bool = False
    meta_init: bool = True
    # XlaFullyShardedDataParallel options
    compute_dtype: Optional[Union[str, torch.dtype]] = None
    buffer_dtype: Optional[Union[str, torch.dtype]] = None
    fp32_reduce_scatter: bool = False
    reshard_after_forward: bool = True
    flatten_parameters: bool = False
    execute_sharding_on_init: bool = True
    optimization_barrier_in_forward: bool = True
    optimization_barrier_in_backward: bool = True
    sync_on_finalization: bool = False
    disable_reshard_on_root: bool = True
    shard_param_on_dim_0: bool = False
    pin_layout_in_collective_ops: bool = True
    reduce_scatter_bucket_size_mb: int = 0
    coalesce_all_gather_ops: bool = False
    # explicit sharding group: lets one process build exactly what rank r of N holds
    sharding_groups: Optional[list[list[int]]] = None
    sharding_rank: Optional[int] = None
    sharding_world_size: Optional[int] = None
    # FSDP v2 (SPMD): devices form a (replica_size, N / replica_size) mesh; parameters are split over
    # the second ("fsdp") axis and replicated over the first (hybrid sharding when > 1)
    replica_size: int = 1
    # saving: what a Trainer checkpoint holds, and the dtype / file size of consolidated models
    checkpoint_format: str = "sharded"
    consolidate_dtype: str = "auto"
    consolidate_max_shard_size: Union[int, str] = "5GB"

    _BOOL_FIELDS = (
        "activation_checkpointing", "meta_init", "fp32_reduce_scatter", "reshard_after_forward",
        "flatten_parameters", "execute_sharding_on_init", "optimization_barrier_in_forward",
        "optimization_barrier_in_backward", "sync_on_finalization", "disable_reshard_on_root",
        "shard_param_on_dim_0", "pin_layout_in_collective_ops", "coalesce_all_gather_ops",
    )
    _FSDP_KWARGS = (
        "compute_dtype", "buffer_dtype", "fp32_reduce_scatter", "reshard_after_forward",
        "flatten_parameters", "execute_sharding_on_init", "optimization_barrier_in_forward",
        "optimization_barrier_in_backward", "sync_on_finalization", "disable_reshard_on_root",
        "shard_param_on_dim_0", "pin_layout_in_collective_ops", "reduce_scatter_bucket_size_mb",
        "coalesce_all_gather_ops", "sharding_groups", "sharding_rank", "sharding_world_size",
    )

    _V1_ONLY = (
        "fp32_reduce_scatter", "reshard_after_forward", "flatten_parameters", "execute_sharding_on_init",
        "optimization_barrier_in_forward", "optimization_barrier_in_backward", "sync_on_finalization",
        "disable_reshard_on_root", "shard_param_on_dim_0", "pin_layout_in_collective_ops",
        "reduce_scatter_bucket_size_mb", "coalesce_all_gather_ops", "sharding_groups", "sharding_rank",
        "sharding_world_size",
    )

    def __post_init__(self) -> None:
        self.version = _parse_int(self.version, "version", 1)
        if self.version not in (1, 2):
            raise ConfigError(f"version={self.version!r} is not valid; allowed values: 1 (XlaFullyShardedDataParallel), "
                              "2 (SPMD, SpmdFullyShardedDataParallel)")
        self.replica_size = _parse_int(self.replica_size, "replica_size", 1)
        for name in self._BOOL_FIELDS:
            setattr(self, name, _parse_bool(getattr(self, name), name))
        self.min_num_params = _parse_int(self.min_num_params, "min_num_params", 0)
        self.reduce_scatter_bucket_size_mb = _parse_int(
            self.reduce_scatter_bucket_size_mb, "reduce_scatter_bucket_size_mb", 0
        )
        sharding = str(self.sharding).strip().lower()
        sharding = _SHARDING_ALIASES.get(sharding, sharding)
        if sharding not in _SHARDING:
            raise ConfigError(
                f"sharding={self.sharding!r} is not valid; allowed values: 'zero3' (nested, default), 'zero2' (root only)"
            )
        self.sharding = sharding
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
        self.transformer_layer_cls_to_wrap = cls_names
        fmt = str(self.checkpoint_format).strip().lower()
        if fmt not in CHECKPOINT_FORMATS:
            raise ConfigError(f"checkpoint_format={self.checkpoint_format!r} is not valid; allowed values: "
                              + ", ".join(repr(f) for f in CHECKPOINT_FORMATS))
        self.checkpoint_format = fmt
        self.consolidate_dtype = str(self.consolidate_dtype).strip().lower()
        if self.consolidate_dtype != "auto":
            parse_dtype(self.consolidate_dtype, "consolidate_dtype")
        _check_shard_size(self.consolidate_max_shard_size, "consolidate_max_shard_size")
        self.compute_dtype = parse_dtype(self.compute_dtype, "compute_dtype")
        self.buffer_dtype = parse_dtype(self.buffer_dtype, "buffer_dtype")
        if self.version == 2:
            self._check_v1_only()
        group = (self.sharding_groups, self.sharding_rank, self.sharding_world_size)
        if any(v is not None for v in group) and not all(v is not None for v in group):
            raise ConfigError(
                "sharding_groups, sharding_rank and sharding_world_size must be given together (or none of them)"
            )
        if self.sharding_world_size is not None:
            self.sharding_world_size = _parse_int(self.sharding_world_size, "sharding_world_size", 1)
            self.sharding_rank = _parse_int(self.sharding_rank, "sharding_rank", 0)
            if self.sharding_rank >= self.sharding_world_size:
                raise ConfigError(
                    f"sharding_rank={self.sharding_rank} must be below sharding_world_size={self.sharding_world_size}"
                )

    def _check_v1_only(self) -> None:
        if self.compute_dtype is not None or self.buffer_dtype is not None:
            raise ConfigError("compute_dtype/buffer_dtype are not available with version=2: SpmdFullyShardedDataParallel "
                              "has no mixed precision and XLA autocast fails in SDPA attention on torch_xla 2.9; "
                              "remove them (parameters and compute stay fp32) or use version=1")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        changed = [n for n in self._V1_ONLY if getattr(self, n) != defaults[n]]
        if changed:
            raise ConfigError(f"{', '.join(changed)} appl{'ies' if len(changed) == 1 else 'y'} to version=1 "
                              "(XlaFullyShardedDataParallel) only; remove it for version=2")

    # ------------------------------------------------------------------ readers
    @classmethod
    def field_names(cls) -> list[str]:
        """Names of every setting this plugin accepts."""
        return [f.name for f in dataclasses.fields(cls)]

    @classmethod
    def from_dict(cls, settings: Mapping[str, Any], *, source: str = "settings") -> "XlaFsdpPlugin":
        """Build from our own vocabulary (field names, ``fsdp_`` prefixes allowed); unknown keys are errors."""
        return cls(**_normalize(settings, source))

    @classmethod
    def from_fsdp_config(cls, fsdp_config: Union[Mapping[str, Any], str, os.PathLike]) -> "XlaFsdpPlugin":
        """Build from transformers' ``fsdp_config`` (a dict or the path of its JSON file).

        Accepts transformers' keys (``xla``, ``xla_fsdp_settings``, ``xla_fsdp_grad_ckpt``,
        ``xla_fsdp_v2``, ``transformer_layer_cls_to_wrap``, ``min_num_params``, each optionally
        prefixed ``fsdp_``) and any of this plugin's field names.
        """
        source = "fsdp_config"
        if isinstance(fsdp_config, (str, os.PathLike)):
            source = str(fsdp_config)
            fsdp_config = read_settings_file(fsdp_config, "fsdp_config", json.load, json.JSONDecodeError, "JSON")
        if not isinstance(fsdp_config, Mapping):
            raise ConfigError(f"{source} must be a JSON object / dict of settings, got {type(fsdp_config).__name__}")
        return cls(**_normalize(fsdp_config, source))

    @classmethod
    def from_accelerate_config(cls, yaml_path: Union[str, os.PathLike]) -> "XlaFsdpPlugin":
        """Build from the ``fsdp_config:`` mapping of an accelerate YAML config file."""
        data = read_accelerate_yaml(yaml_path)
        if not isinstance(data, Mapping):
            raise ConfigError(f"accelerate config file {yaml_path} must hold a mapping")
        settings = data.get("fsdp_config") or {}
        if not isinstance(settings, Mapping):
            raise ConfigError(f"fsdp_config in {yaml_path} must be a mapping of settings")
        return cls(**_normalize(settings, f"fsdp_config in {yaml_path}"))

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable settings (dtypes as strings); ``from_dict(to_dict())`` round-trips."""
        out = dataclasses.asdict(self)
        for key in ("compute_dtype", "buffer_dtype"):
            if out[key] is not None:
                out[key] = str(out[key]).removeprefix("torch.")
        return out

    def fsdp_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``XlaFullyShardedDataParallel``."""
        kwargs = {name: getattr(self, name) for name in self._FSDP_KWARGS}
        for name in ("sharding_groups", "sharding_rank", "sharding_world_size"):
            if kwargs[name] is None:
                del kwargs[name]
        return kwargs

    # ------------------------------------------------------------------ actions
    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """Wrap ``model`` (eager, on CPU or XLA) with nested XLA FSDP per this plugin."""
        from .wrapping import wrap_model

        return wrap_model(model, self)

    def build(self, config_or_pretrained_dir: Union["PretrainedConfig", str, os.PathLike], **kwargs: Any) -> torch.nn.Module:
        """Construct the model on ``meta`` and materialize, wrap and shard it block by block.

        See :func:`hf_xla_fsdp.meta_init.build_model` for the keyword arguments.
        """
        from .meta_init import build_model

        return build_model(config_or_pretrained_dir, self, **kwargs)


def read_settings_file(path: Union[str, os.PathLike], kind: str, parse: Any, error: type, language: str) -> Any:
    """Parse a settings file, turning a missing or malformed file into a one-line ConfigError."""
    try:
        with open(path, encoding="utf-8") as fh:
            return parse(fh)
    except FileNotFoundError:
        raise ConfigError(f"{kind} file {path} does not exist") from None
    except error as err:
        raise ConfigError(f"{kind} file {path} is not valid {language}: {' '.join(str(err).split())}") from None


def read_accelerate_yaml(path: Union[str, os.PathLike]) -> Any:
    """The parsed accelerate YAML config (``{}`` for an empty file)."""
    import yaml

    return read_settings_file(path, "accelerate config", yaml.safe_load, yaml.YAMLError, "YAML") or {}


# transformers' fsdp_config spelling -> ours
_RENAMES = {
    "xla_fsdp_grad_ckpt": "activation_checkpointing",
    "sharding_strategy": "sharding",
}


_LEGACY_STRATEGIES = {"full_shard": "zero3", "shard_grad_op": "zero2"}


def _normalize(settings: Mapping[str, Any], source: str) -> dict[str, Any]:
    """Map transformers/accelerate spellings onto field names; reject anything unknown."""
    fields = set(XlaFsdpPlugin.field_names())
    out: dict[str, Any] = {}
    for raw_key, value in settings.items():
        key = str(raw_key)
        key = key[len("fsdp_"):] if key.startswith("fsdp_") else key
        if key == "xla":
            if not _parse_bool(value, "xla"):
                raise ConfigError(f"xla={value!r} in {source}: hf_xla_fsdp configures XLA FSDP; set xla to true")
            continue
        if key == "xla_fsdp_v2":
            if _parse_bool(value, "xla_fsdp_v2"):
                out["version"] = 2
            continue
        if key == "xla_fsdp_settings":
            if not isinstance(value, Mapping):
                raise ConfigError(f"xla_fsdp_settings in {source} must be a mapping of XlaFullyShardedDataParallel options")
            for sub_key, sub_value in value.items():
                if sub_key not in XlaFsdpPlugin._FSDP_KWARGS:
                    raise ConfigError(
                        f"unknown key xla_fsdp_settings.{sub_key} in {source}; allowed: {', '.join(XlaFsdpPlugin._FSDP_KWARGS)}"
                    )
                out[sub_key] = sub_value
            continue
        if key == "reshard_after_forward" and isinstance(value, str) and value.lower() in _LEGACY_STRATEGIES:
            # transformers turns a legacy `--fsdp "full_shard"` into this FSDP1 strategy name
            out["sharding"] = _LEGACY_STRATEGIES[value.lower()]
            continue
        key = _RENAMES.get(key, key)
        if key not in fields:
            raise ConfigError(
                f"unknown key {raw_key!r} in {source}; allowed: xla, xla_fsdp_v2, xla_fsdp_settings, "
                f"xla_fsdp_grad_ckpt, {', '.join(sorted(fields))}"
            )
        out[key] = value
    return out


def resolve_classes(model: torch.nn.Module, names: Sequence[str]) -> set[type]:
    """Resolve module class names against the classes that occur in ``model``."""
    present = {type(m).__name__: type(m) for m in model.modules()}
    missing = [n for n in names if n not in present]
    if missing:
        raise ConfigError(
            f"transformer_layer_cls_to_wrap names {missing} not found in {type(model).__name__}; "
            f"its module classes are: {', '.join(sorted(present))}"
        )
    return {present[n] for n in names}
