"""The settings vocabularies the plugin reads: transformers' ``fsdp_config`` keys and accelerate's torch-FSDP keys.

Both are mapped onto the plugin's field names here, once; a key with no meaning on XLA is accepted with one logged
note, one that cannot be honoured is refused with one line. The plugin passes its own field descriptions in; what
transformers' ``xla`` switch and accelerate's ``fsdp_version`` mean is read from the engines' declarations
(:mod:`.engines`), so no engine is named here.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Mapping, Union

from ..errors import ConfigError
from ..settings import parse_bool, parse_int
from . import engines as engine_rules

logger = logging.getLogger(__name__)

# accelerate / torch FSDP spell the sharding choice with strategy names
_LEGACY_STRATEGIES = {"full_shard": "zero3", "shard_grad_op": "zero2"}


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


# transformers' fsdp_config keys that are not settings of their own
_SPECIAL_KEYS = ("xla", "xla_fsdp_v2", "xla_fsdp_settings")

# keys of accelerate's torch-FSDP plugin (as `accelerate config` writes them) that say nothing on XLA: accepted
# with one logged note each
_NO_MEANING_ON_XLA = {
    "fsdp_backward_prefetch": "XLA schedules the all-gathers itself",
    "fsdp_forward_prefetch": "XLA schedules the all-gathers itself",
    "fsdp_sync_module_states": "every rank builds the same weights (same seed, or the same pretrained files)",
    "fsdp_use_orig_params": "optimizer groups, weight decay and checkpoints use the original parameter names anyway",
    "fsdp_cpu_offload": "parameters stay on the XLA device",
}
_STATE_DICT_TYPES = {"full_state_dict": "sharded+consolidated", "sharded_state_dict": "sharded",
                     "local_state_dict": "sharded"}
_WRAP_POLICIES = ("transformer_based_wrap", "size_based_wrap", "no_wrap")
_ACCELERATE_DEFAULT_MIN_NUM_PARAMS = 100_000_000  # accelerate's FullyShardedDataParallelPlugin default


def _note(key: str, value: Any, why: str, source: str) -> None:
    logger.warning("%s=%r in %s has no meaning on XLA (%s); ignored", key, value, source, why)


def _accelerate_key(key: str, value: Any, out: dict[str, Any], source: str) -> bool:
    """Map one key of accelerate's torch-FSDP vocabulary onto our settings; False when ``key`` is not one of them."""
    if key in _NO_MEANING_ON_XLA:
        _note(key, value, _NO_MEANING_ON_XLA[key], source)
    elif key == "fsdp_version":  # torch FSDP1 / FSDP2 (fully_shard): 2 selects engine fsdp2
        if parse_int(value, key, 1) == 2:
            out["_torch_fsdp2"] = True
        else:
            _note(key, value, "it picks torch's FSDP implementation; `engine` picks ours", source)
    elif key == "fsdp_offload_params":
        if parse_bool(value, key):
            raise ConfigError(f"{key}=true in {source} cannot be honoured: XLA FSDP keeps parameters on the XLA device "
                              "(no CPU offload); set it to false or remove it")
    elif key == "fsdp_cpu_ram_efficient_loading":
        out["meta_init"] = value  # the same intent: never the whole model in host memory
    elif key == "fsdp_state_dict_type":
        fmt = _STATE_DICT_TYPES.get(str(value).strip().lower())
        if fmt is None:
            raise ConfigError(f"{key}={value!r} in {source} is not valid; allowed values: "
                              f"{', '.join(t.upper() for t in _STATE_DICT_TYPES)}")
        out["checkpoint_format"] = fmt
    elif key == "fsdp_auto_wrap_policy":
        policy = str(value).strip().lower()
        if policy not in _WRAP_POLICIES:
            raise ConfigError(f"{key}={value!r} in {source} is not valid; allowed values: "
                              f"{', '.join(p.upper() for p in _WRAP_POLICIES)}")
        out["_auto_wrap_policy"] = policy
    else:
        return False
    return True


def normalize(settings: Mapping[str, Any], source: str, *, fields: set[str], aliases: Mapping[str, str],
              fsdp_kwargs: list[str]) -> dict[str, Any]:
    """Map transformers/accelerate spellings onto the plugin's field names; reject anything unknown.

    ``fields``, ``aliases`` (alias -> field) and ``fsdp_kwargs`` describe the plugin (see its field metadata).
    """
    kwargs = fsdp_kwargs
    out: dict[str, Any] = {}
    for raw_key, value in settings.items():
        if _accelerate_key(str(raw_key), value, out, source):
            continue
        key = str(raw_key)
        key = key[len("fsdp_"):] if key.startswith("fsdp_") else key
        if key == "xla":  # transformers' switch for its XLA path; false is what it writes for torch's FSDP
            out["_xla"] = (parse_bool(value, "xla"), value)
            continue
        if key == "xla_fsdp_v2":
            if parse_bool(value, "xla_fsdp_v2"):
                out["version"] = 2
            continue
        if key == "xla_fsdp_settings":
            if not isinstance(value, Mapping):
                raise ConfigError(f"xla_fsdp_settings in {source} must be a mapping of XlaFullyShardedDataParallel options")
            for sub_key, sub_value in value.items():
                if sub_key not in kwargs:
                    raise ConfigError(f"unknown key xla_fsdp_settings.{sub_key} in {source}; allowed: {', '.join(kwargs)}")
                out[sub_key] = sub_value
            continue
        if key == "reshard_after_forward" and isinstance(value, str):
            # accelerate writes the FSDP1 sharding strategy here; transformers turns `--fsdp "full_shard"` into it
            out["sharding"] = _strategy(value, str(raw_key), source)
            continue
        key = aliases.get(key, key)
        if key not in fields:
            raise ConfigError(
                f"unknown key {raw_key!r} in {source}; allowed: {', '.join(_SPECIAL_KEYS)}, "
                f"{', '.join(sorted(set(aliases) | fields))}, and accelerate's fsdp_* keys (see docs/accelerate.md)"
            )
        out[key] = value
    if "sharding" in out:
        out["sharding"] = _strategy(out["sharding"], "sharding", source)
    policy = out.pop("_auto_wrap_policy", None)
    if policy == "no_wrap":
        out["sharding"] = "zero2"  # one unit: the root
    elif policy == "size_based_wrap":
        out.setdefault("min_num_params", _ACCELERATE_DEFAULT_MIN_NUM_PARAMS)
    elif policy == "transformer_based_wrap" and int(out.get("min_num_params") or 0) > 0:
        raise ConfigError(f"fsdp_auto_wrap_policy=TRANSFORMER_BASED_WRAP in {source} conflicts with min_num_params > 0 "
                          "(size-based wrapping); keep one of them")
    _engine_switches(out, source)
    return out


def _engine_switches(out: dict[str, Any], source: str) -> None:
    """Apply transformers' ``xla`` switch and accelerate's ``fsdp_version: 2`` to the engine ``out`` names, by the
    engines' declarations: ``xla: true`` means an engine on torch_xla, ``xla: false`` one that is not, and
    ``fsdp_version: 2`` the engine that is torch's ``fully_shard`` (unless the settings name an engine that drives
    every device from one process, which accelerate's ``distributed_type: NO`` launches the same way)."""
    xla, xla_value = out.pop("_xla", (None, None))
    engine = str(out.get("engine") or "").strip().lower()
    fsdp2 = engine_rules.torch_fsdp2_engine()
    on_xla = engine in engine_rules.xla_spellings()
    if xla is False and not (engine and not on_xla):
        raise ConfigError(f"xla={xla_value!r} in {source}: hf_xla_fsdp configures XLA FSDP; set xla to true (or "
                          f"engine: {fsdp2.key} for torch's FSDP2)")
    if xla and engine and not on_xla:
        raise ConfigError(f"xla={xla_value!r} and engine={engine} in {source} disagree: xla selects PyTorch/XLA, "
                          f"{engine} does not run on it; keep one of them")
    if out.pop("_torch_fsdp2", False):
        # accelerate's FSDP2 YAML (`accelerate config`: distributed_type FSDP, fsdp_version 2) means torch's fully_shard,
        # unless the settings name an XLA engine that drives every device from one process (a v2 config that also
        # says fsdp_version: 2 stays v2)
        if not xla and "version" not in out and engine in ("", fsdp2.key, *fsdp2.aliases):
            out["engine"] = fsdp2.key
            return
        version = out.get("version")
        try:
            named = engine_rules.select_engine(engine or None, None if version is None else parse_int(version, "version"))
        except ConfigError:
            named = None
        one_process = engine_rules.one_process_engines()
        if named not in one_process:
            spmd = " or ".join(f"engine: {e.key}" for e in one_process)
            raise ConfigError(f"fsdp_version=2 in {source} selects torch's FSDP2 (fully_shard), which does not run on "
                              f"XLA; remove it for XLA FSDP v1 (distributed_type: XLA), set {spmd} with "
                              f"distributed_type: NO for XLA FSDP v2 (SPMD), or engine: {fsdp2.key} (without xla) for "
                              "torch's FSDP2")


def _strategy(value: Any, key: str, source: str) -> Any:
    """Sharding strategies of torch FSDP mapped onto ``sharding``; those XLA FSDP cannot honour are refused."""
    name = str(value).strip().lower()
    if name in ("no_shard", "3"):
        raise ConfigError(f"{key}={value!r} in {source}: NO_SHARD is plain data parallelism, not FSDP; use "
                          "FULL_SHARD (zero3) or SHARD_GRAD_OP (zero2), or train without hf_xla_fsdp")
    if name.startswith("hybrid_shard") or name in ("4", "5"):
        raise ConfigError(f"{key}={value!r} in {source}: hybrid sharding is FSDP v2's replica_size here; "
                          "set version: 2 and replica_size: N (parameters replicated over N groups)")
    return _LEGACY_STRATEGIES.get(name, value)
