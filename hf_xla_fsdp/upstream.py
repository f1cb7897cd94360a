"""The private (or fragile) upstream APIs hf_xla_fsdp relies on, in one list, each checked against what is installed.

Our Trainer and accelerate glue override private methods of ``transformers.Trainer`` and ``accelerate.Accelerator``;
the start-up code patches ``TrainingArguments._setup_devices`` and accelerate's ``gather_object``; meta construction
hooks transformers' weight init; FSDP v1 units override torch_xla's ``_shard_parameters_``. A release that renames
one of them, or changes the parameters we call or receive, would otherwise surface as an ``AttributeError`` or a
``TypeError`` deep inside a training step. :func:`require` runs before each part uses them (the Trainer and
accelerate integrations when imported, meta construction and FSDP v1 units when first used): a missing or changed
API is one line naming it, the installed version and the supported range.

Every private name of torch_xla, transformers, accelerate, trl, peft or torch that the package reaches (an underscore
name: ``torch_xla._XLAC.<fn>``, ``from torch.utils import _pytree``, ``trainer._metrics``, ``getattr(x, "_name")``)
has an entry here: tests/unit/test_package.py reads the package for such reaches and fails on one without an entry.
An attribute upstream code sets on its objects (``attribute=True``: ``Accelerator._custom_objects``) cannot be looked
up on a class: it is checked in the source of the module that sets it. Where our code already has a fallback for a
missing name (``getattr(obj, "_name", None)``, an ``ImportError`` caught) the entry is ``optional``: :func:`require`
never refuses a run for it, :func:`problems` (the suite, ``hf-xla-fsdp env``) still names it when it is gone.

The version side: :data:`TESTED` is the range of releases of each package the fast test tier ran with (the oldest
and newest tested combinations, constraints/oldest.txt and constraints/tested.txt), :data:`SUPPORTED` the ranges
setup.cfg declares. :func:`check_versions` runs when hf_xla_fsdp is imported: a package installed outside its tested
range is one warning line (it may still work; no test ran it).
"""

from __future__ import annotations

import importlib
import inspect
import logging
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import metadata
from typing import Any, Optional

from .errors import ConfigError


@dataclass(frozen=True)
class Upstream:
    """One upstream API we rely on: ``target`` is ``"module:Attr.attr"``; ``params`` the parameter names we call it
    with or receive (in order, ``self`` excluded; None: only that it exists); ``user`` the part of hf_xla_fsdp that
    relies on it; ``why`` what it does with it. An API we *override* (upstream calls our version) must keep exactly
    these parameters; one we *call* may gain trailing ones. ``attribute``: the last part of ``target`` is an attribute
    upstream code sets on its objects (instances, parameters, modules), checked in the source of ``target``'s module;
    ``optional``: our code has a fallback when it is gone (see the module docstring)."""

    package: str
    user: str
    target: str
    params: Optional[tuple[str, ...]]
    why: str
    override: bool = True
    attribute: bool = False
    optional: bool = False


def _t(target: str, params: Optional[tuple[str, ...]], why: str, user: str = "trainer", override: bool = True
       ) -> Upstream:
    return Upstream("transformers", user, target, params, why, override)


def _a(target: str, params: Optional[tuple[str, ...]], why: str, override: bool = True) -> Upstream:
    return Upstream("accelerate", "accelerate", target, params, why, override)


def _xlac(name: str, user: str, why: str, optional: bool = False) -> Upstream:
    """A function of torch_xla's C++ binding (no Python signature to check: its existence is)."""
    return Upstream("torch_xla", user, f"torch_xla:_XLAC.{name}", None, why, override=False, optional=optional)


def _set(package: str, user: str, target: str, why: str, optional: bool = False) -> Upstream:
    """An attribute upstream code sets on its objects (see :class:`Upstream`)."""
    return Upstream(package, user, target, None, why, override=False, attribute=True, optional=optional)


def _torch(target: str, user: str, why: str) -> Upstream:
    return Upstream("torch", user, target, None, why, override=False)


_TRAINER = "transformers.trainer:Trainer"
_ACCELERATOR = "accelerate.accelerator:Accelerator"

RELIED_ON: tuple[Upstream, ...] = (
    # transformers: the Trainer methods XlaFsdpTrainerMixin overrides (same parameters), and what they call
    _t(f"{_TRAINER}._wrap_model", ("model", "training", "dataloader"), "never a second FSDP wrap"),
    _t(f"{_TRAINER}._set_signature_columns_if_needed", (), "columns from the model inside the FSDP units"),
    _t(f"{_TRAINER}._build_accelerator_args", ("kwargs",), "accelerate's autocast kept off (compute_dtype instead)"),
    _t(f"{_TRAINER}.create_accelerator_and_postprocess", (), "XlaFsdpAccelerator as the accelerator"),
    _t(f"{_TRAINER}._save_checkpoint", ("model", "trial"), "sharded rank checkpoints"),
    _t(f"{_TRAINER}._load_from_checkpoint", ("resume_from_checkpoint", "model"), "refuse foreign checkpoints"),
    _t(f"{_TRAINER}._load_optimizer_and_scheduler", ("checkpoint",), "resume from this rank's file"),
    _t(f"{_TRAINER}._load_rng_state", ("checkpoint",), "RNG of this rank"),
    _t(f"{_TRAINER}._load_best_model", (), "load_best_model_at_end from sharded checkpoints"),
    _t(f"{_TRAINER}.call_model_init", ("trial",), "model_init's model built and wrapped"),
    _t(f"{_TRAINER}.get_decay_parameter_names", ("model",), "weight decay by the original names"),
    _t(f"{_TRAINER}._get_output_dir", ("trial",), "where checkpoint-N goes", override=False),
    _t(f"{_TRAINER}._push_from_checkpoint", ("checkpoint_folder",), "Hub pushes of published checkpoints", override=False),
    _t(f"{_TRAINER}.store_flos", (), "trainer state of a checkpoint", override=False),
    _t("transformers.trainer:TRAINER_STATE_NAME", None, "trainer_state.json of a checkpoint"),
    _t("transformers.training_args:TrainingArguments._setup_devices", None,
       "patched: FSDP v2 starts SPMD before accelerate's PartialState takes the device"),
    # transformers: weight init, replayed block by block on meta
    _t("transformers.modeling_utils:PreTrainedModel._initialize_weights", ("module", "is_custom_code"),
       "meta construction records every init call", "modeling"),
    _t("transformers.modeling_utils:PreTrainedModel._from_config", ("config", "kwargs"), "models built on meta",
       "modeling", override=False),
    _t("transformers.initialization:guard_torch_init_functions", (), "init of loaded tensors skipped", "modeling",
       override=False),
    _t("transformers.initialization:no_init_weights", (), "skeletons without init draws", "modeling", override=False),
    # accelerate: the Accelerator methods XlaFsdpAccelerator overrides, and its internals it reads
    _a(f"{_ACCELERATOR}._get_named_parameters", ("args", "drop_refs"), "XLA's by-name optimizer re-mapping kept off"),
    _a(f"{_ACCELERATOR}.prepare", ("args", "device_placement"), "optimizers re-pointed at sharded parameters"),
    _a(f"{_ACCELERATOR}.prepare_model", ("model", "device_placement", "evaluation_mode"), "models wrapped once"),
    _a(f"{_ACCELERATOR}.prepare_optimizer", ("optimizer", "device_placement"), "optimizer groups re-pointed"),
    _a(f"{_ACCELERATOR}.prepare_data_loader", ("data_loader", "device_placement", "slice_fn_for_dispatch"),
       "FSDP v2 input sharding"),
    _a(f"{_ACCELERATOR}.backward", ("loss", "kwargs"), "no second gradient all-reduce"),
    _a(f"{_ACCELERATOR}.clip_grad_norm_", ("parameters", "max_norm", "norm_type"), "norm over every shard"),
    _a(f"{_ACCELERATOR}.get_state_dict", ("model", "unwrap"), "full weights from shards"),
    _a(f"{_ACCELERATOR}.unwrap_model", ("model", "keep_fp32_wrapper", "keep_torch_compile"), "save_pretrained of shards"),
    _a(f"{_ACCELERATOR}.save_state", ("output_dir", "safe_serialization", "save_model_func_kwargs"),
       "sharded rank checkpoints"),
    _a(f"{_ACCELERATOR}.load_state", ("input_dir", "load_kwargs", "load_model_func_kwargs"),
       "resume from sharded rank checkpoints"),
    _a(f"{_ACCELERATOR}.end_training", (), "pending background saves end"),
    _a(f"{_ACCELERATOR}.save_iteration", None, "automatic checkpoint naming"),
    _a("accelerate.state:GradientState.is_xla_gradients_synced", None, "no second gradient all-reduce"),
    _a("accelerate.commands.config:default_config_file", None, "the YAML of a launch without --config_file"),
    _a("accelerate.utils.other:extract_model_from_parallel",
       ("model", "keep_fp32_wrapper", "keep_torch_compile", "recursive"),
       "patched (its code, when an XlaFsdpAccelerator is built): sees through XLA FSDP units (is_peft_model)"),
    _a("accelerate.utils.operations:gather_object", ("object",),
       "patched (its code, when an XlaFsdpAccelerator is built): gathers objects on XLA instead of raising"),
    # trl: what a TRL trainer's __init__ builds models with, replaced while it runs (integrations/trl_hooks.py)
    Upstream("trl", "trl", "trl.trainer.utils:create_model_from_path", ("model_id", "architecture", "kwargs"),
             "policy and reference models built block by block on meta"),
    *(Upstream("trl", "trl", f"trl.trainer.{module}:create_model_from_path", None,
               "the name the trainer's module calls, replaced while its __init__ runs")
      for module in ("sft_trainer", "dpo_trainer", "grpo_trainer", "reward_trainer")),
    Upstream("trl", "trl", "trl.trainer.grpo_trainer:AutoModelForSequenceClassification", None,
             "reward models named by path built in evaluation mode"),
    Upstream("peft", "trl", "peft:get_peft_model", ("model", "peft_config"),
             "adapters attached on meta handed to TRL's call", override=False),
    # torch_xla: FSDP v1 units cut each shard on the host
    Upstream("torch_xla", "engine_v1", "torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel:"
             "XlaFullyShardedDataParallel._shard_parameters_", ("params_to_shard",),
             "FSDP v1 units built without a full-parameter copy on the device"),
    Upstream("torch_xla", "engine_v1", "torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel:"
             "XlaFullyShardedDataParallel._get_shard", ("tensor",), "the reference shard layout", override=False),
    Upstream("torch_xla", "engine_v1", "torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel:"
             "XlaFullyShardedDataParallel._cast_buffers", ("dtype", "memo"),
             "buffers cast on the host keep their original dtype for buffer_info"),
    # torch_xla: scan_layers runs its own Scan autograd function over torch_xla's scan internals (no jax needed)
    *(Upstream("torch_xla", "scan", f"torch_xla.experimental.scan:{name}", params, "scan_layers' loop", override=False)
      for name, params in (("value_and_grad_partitioned", ("fn", "init", "xs", "partition_fn", "is_fn_pure")),
                           ("_scan_impl_pytree", ("fn", "init", "xs", "reverse")),
                           ("_save_for_backward", ("ctx", "pytree")), ("_load_from_context", ("ctx",)))),
    Upstream("torch_xla", "scan", "torch_xla.experimental.pytreeify:pytreeify", None, "scan_layers' loop",
             override=False),
    # torch_xla: under SPMD the device has no kind; the TPU slice's accelerator type names the generation (for MFU)
    Upstream("torch_xla", "throughput", "torch_xla._internal.tpu:get_tpu_type", (), "the TPU generation under SPMD",
             override=False),
    Upstream("torch_xla", "scan", "torch_xla.experimental.spmd_fully_sharded_data_parallel:_prepare_spmd_partition_spec",
             ("param", "extra_data_axis", "shard_maximal"), "the FSDP v2 split of a layer's weight, for its stack",
             override=False),
    # torch_xla's C++ binding (torch_xla._XLAC): what no public torch_xla API exposes
    _xlac("_replace_xla_tensor", "engine_v1", "a parameter's device data swapped for a placeholder in place "
          "(engines/v1.py: the lean unit's handle, under functionalization)"),
    _xlac("_xla_get_spmd_config_is_locked", "engine_v2", "whether SPMD can still start (engines/v2.py spmd_too_late; "
          "absent: assumed startable)", optional=True),
    _xlac("_get_xla_sharding_spec", "engine_v2", "a tensor's sharding, read (engines/v2.py, master_weights.py, "
          "modeling/tensor_parallel.py: already-split weights are left alone)"),
    _xlac("_get_local_shards", "engine_v2", "the pieces each device holds, fetched for rank files (engines/v2.py)"),
    _xlac("_get_local_shard_replica_and_indices", "engine_v2", "which slice of a tensor each device holds "
          "(engines/v2.py: rank-file offsets, device bytes)"),
    _xlac("_xla_sync_multi", "engine_v2", "only the given tensors materialized, waited for (engines/v2.py)"),
    _xlac("_xla_mark_sharding", "engine_v2", "a tensor given another's sharding (engines/v2.py restore, "
          "master_weights.py fp32 masters)"),
    _xlac("_get_xla_op_sharding", "engine_v2", "the sharding handed to _xla_mark_sharding"),
    _xlac("_xla_get_cpu_tensors", "runtime", "many device tensors fetched to the host in one call (runtime.py; absent: "
          "one .cpu() each)", optional=True),
    _xlac("_xla_computation_cache_is_initialized", "compile_cache", "whether a graph compiled before the persistent "
          "cache could be set up (session/compile_cache.py)"),
    # torch_xla: attributes its FSDP units, loaders and checkpoint_module set, read by ours
    *(_set("torch_xla", "engine_v1", "torch_xla.distributed.fsdp.xla_fully_sharded_data_parallel:"
           f"XlaFullyShardedDataParallel.{name}", why)
      for name, why in (("_shard_size_multiple", "the lean unit cuts shards with the stock padding"),
                        ("_shard_param_on_dim_0", "the lean unit cuts shards along the stock dimension"),
                        ("_is_sharded", "set on each parameter a unit sharded: the fp32 check skips inner units' shards"),
                        ("_orig_dtype", "set on each buffer a unit cast: the host cast keeps the dtype buffer_info "
                                        "records"),
                        # what stock FSDP code reads on the shards and handles the lean unit makes itself
                        *((name, "set on each shard / full-parameter handle as the stock _shard_parameters_ sets it")
                          for name in ("_orig_size", "_orig_name", "_name", "_sharded_param", "_has_full_param")))),
    *(_set("torch_xla", "engine_v1", f"torch_xla.distributed.fsdp.xla_flatten_params_wrapper:FlatParameter.{name}",
           "copied onto the lean unit's flat handle, as stock FSDP reads them")
      for name in ("_param_numels", "_param_shapes", "_param_infos", "_shared_param_infos")),
    _set("torch_xla", "engine_v2", "torch_xla.distributed.parallel_loader:MpDeviceLoader._parallel_loader_kwargs",
         "an XLA device loader told apart and given FSDP v2's input sharding (engines/v2.py shard_loader_inputs)"),
    _set("torch_xla", "scan", "torch_xla.distributed.fsdp.utils:_xla_checkpointed_forward_original",
         "checkpoint_module's original forward, run inside the scanned loop (modeling/scan.py)"),
    # transformers: private attributes of models, configs, auto classes and the Trainer
    _t("transformers.modeling_utils:PreTrainedModel._init_weights", ("module",),
       "each module's init replayed on meta, block by block (modeling/meta_init.py)", "modeling", override=False),
    _t("transformers.modeling_utils:PreTrainedModel._no_split_modules", None,
       "the blocks that become FSDP units by default (modeling/wrapping.py, session/session.py)", "modeling"),
    _t("transformers.models.auto.modeling_auto:AutoModelForCausalLM._model_mapping", None,
       "a config without architectures told to be a causal LM (modeling/meta_init.py)", "modeling"),
    _set("transformers", "modeling", "transformers.modeling_utils:_is_hf_initialized",
         "the flag from_pretrained puts on tensors it loaded: their init is not recorded (modeling/meta_init.py)"),
    _t("transformers.configuration_utils:PretrainedConfig._attn_implementation", None,
       "tensor parallel attention switched to its head-local kernel (modeling/tensor_parallel.py)", "engine_v2"),
    _set("transformers", "trl", "transformers.configuration_utils:PretrainedConfig._name_or_path",
         "the path a TRL trainer's model came from, kept for its reference model (integrations/trl_hooks.py; absent: "
         "the class name)", optional=True),
    Upstream("transformers", "scan", "transformers.utils.output_capturing:_active_collector", None,
             "output_hidden_states / attentions refused under scan_layers (modeling/scan.py; absent: nothing records "
             "through that path)", override=False, optional=True),
    _set("transformers", "trainer", f"{_TRAINER}._tr_loss", "the running loss made a device tensor before training "
         "(integrations/trainer.py training_step; absent: step 2 compiles once more)", optional=True),
    # accelerate: Accelerator / PartialState internals
    _set("accelerate", "accelerate", f"{_ACCELERATOR}._schedulers", "the scheduler a sharded checkpoint saves"),
    _set("accelerate", "accelerate", f"{_ACCELERATOR}._custom_objects", "register_for_checkpointing's objects saved "
         "with a sharded checkpoint"),
    Upstream("accelerate", "engine_fsdp2", "accelerate.state:PartialState._shared_state", None,
             "engine fsdp2 refuses a process whose accelerate state took the XLA device (engines/fsdp2.py; absent: "
             "nothing to refuse)", override=False, optional=True),
    # trl: GRPOTrainer internals the fixed-shape rollout reads (integrations/rollout.py), each with a fallback
    Upstream("trl", "rollout", "trl.trainer.grpo_trainer:GRPOTrainer._tokenize_prompts", None,
             "TRL's own prompt tokenization (chat template, tools); absent: the processing class", override=False,
             optional=True),
    _set("trl", "rollout", "trl.trainer.grpo_trainer:GRPOTrainer._tokenizer", "the tokenizer inside a processor "
         "(pad token); absent: the processing class", optional=True),
    _set("trl", "rollout", "trl.trainer.grpo_trainer:GRPOTrainer._metrics", "completion-length metrics logged as "
         "TRL logs them; absent: not logged", optional=True),
    Upstream("huggingface_hub", "settings", "huggingface_hub.serialization._base:parse_size_to_int", None,
             "size strings (\"5GB\") read as huggingface_hub's save_pretrained reads them (settings.py)",
             override=False),
    # torch: private functions and nn.Module internals
    _torch("torch:_C.DisableTorchFunctionSubclass", "modeling", "lazy weights run torch functions on their plain "
           "tensors (modeling/lazy.py)"),
    _torch("torch:_has_compatible_shallow_copy_type", "modeling", "lazy weights accepted where a tensor's data is "
           "swapped (modeling/lazy.py)"),
    _torch("torch.utils:_pytree", "modeling", "tree maps over arguments and scanned carries (modeling/lazy.py, "
           "meta_init.py, scan.py)"),
    _torch("torch:_foreach_mul_", "engine_fsdp2", "local gradient shards clipped in one call (engines/fsdp2.py)"),
    _torch("torch.storage:_dtype_to_storage_type_map", "checkpoint", "storage type names of torch.save archives "
           "mapped to dtypes without torch.load (checkpoint/torch_zip.py)"),
    _torch("torch.optim.optimizer:_get_scalar_dtype", "session", "the dtype of an optimizer's step counter made before "
           "the first step (session/optimizers.py)"),
    _torch("torch.nn.modules.module:Module._register_state_dict_hook", "scan", "scanned layers saved under the "
           "unrolled names (modeling/scan.py)"),
    _torch("torch.nn.modules.module:Module._register_load_state_dict_pre_hook", "scan", "unrolled names loaded into "
           "scanned layers (modeling/scan.py)"),
    _torch("torch.utils._python_dispatch:TorchDispatchMode", "modeling", "meta construction replays random ops "
           "aimed at meta tensors on scratch CPU tensors (modeling/meta_init.py)"),
    *(_set("torch", user, f"torch.nn.modules.module:Module.{name}", why)
      for name, user, why in (("_parameters", "modeling", "parameters swapped for handles, shards or materialized "
                                                           "tensors (modeling/meta_init.py, scan.py, engines/v1.py, "
                                                           "engines/fsdp2.py)"),
                              ("_buffers", "modeling", "buffers replaced in place, cast or materialized (modeling/"
                                                        "meta_init.py, engines/v1.py, engines/fsdp2.py)"),
                              ("_modules", "scan", "a layer list swapped for its scanned stack (modeling/scan.py)"),
                              ("_non_persistent_buffers_set", "modeling", "non-persistent buffers kept out of loads "
                                                                          "(modeling/meta_init.py, lazy.py)"))),
)


# The releases the fast test tier ran with, per package: (oldest, newest) of constraints/oldest.txt and
# constraints/tested.txt / no-xla.txt (tests/unit/test_versions.py keeps them equal). Bump both when a combination is
# tested.
TESTED: dict[str, tuple[str, str]] = {
    "torch": ("2.9.0", "2.13.0"),  # 2.13: the no-xla leg (constraints/no-xla.txt), engine fsdp2
    "torch_xla": ("2.9.0", "2.9.0"),
    "transformers": ("5.13.0", "5.23.0"),
    "accelerate": ("1.8.0", "1.15.0"),
    "datasets": ("4.7.0", "5.2.0"),
    "safetensors": ("0.8.0", "0.8.0"),
    "huggingface_hub": ("1.5.0", "2.4.0"),
    "peft": ("0.18.0", "0.21.2"),
    "trl": ("1.0.0", "1.16.0"),
}

# What setup.cfg declares (install_requires and the finetune extra; the same test keeps them equal): pip refuses
# anything outside, so a version outside these was forced in (--no-deps, a later install of another package)
SUPPORTED: dict[str, str] = {
    "torch": ">=2.9.0,<2.16",  # torch_xla 2.9 (the [xla] extra) pins 2.9; torch-tpu 0.2.0 takes 2.11 to 2.15
    "torch_xla": ">=2.9.0,<2.10",
    "transformers": ">=5.13.0,<6",
    "accelerate": ">=1.8.0,<2",
    "datasets": ">=4.7.0,<6",
    "safetensors": ">=0.8.0,<1",
    "huggingface_hub": ">=1.5.0,<3",
    "peft": ">=0.18.0,<1",
    "trl": ">=1.0.0,<2",
}

# set to 0 to skip the import-time check (e.g. a deliberately untested combination whose warning is known)
VERSION_CHECK_ENV = "HF_XLA_FSDP_VERSION_CHECK"

logger = logging.getLogger(__name__)


def _release(version: str) -> Any:
    from packaging.version import InvalidVersion, Version

    try:  # the public part: a local build tag (2.9.0+cpu) is the release it was built from
        return Version(Version(version).public)
    except InvalidVersion:
        return None


def untested(versions: Mapping[str, Optional[str]],
             tested: Mapping[str, tuple[str, str]] = TESTED) -> list[tuple[str, str, tuple[str, str]]]:
    """``(package, version, (oldest, newest))`` of every package in ``versions`` (name -> installed version, None:
    not installed) whose version lies outside its tested range; packages without a tested range are not judged."""
    found = []
    for package, version in versions.items():
        if version is None or package not in tested:
            continue
        low, high = tested[package]
        release = _release(version)
        if release is None or not _release(low) <= release <= _release(high):
            found.append((package, version, (low, high)))
    return found


def tested_combination(versions: Mapping[str, Optional[str]], tested: Mapping[str, tuple[str, str]] = TESTED,
                       ) -> Optional[str]:
    """Which combination the suite ran the installed ``versions`` are: ``"constraints/tested.txt"`` (every package at
    the top of its tested range), ``"constraints/oldest.txt"`` (every one at the bottom), or None (packages not
    installed are not judged). A mix of versions inside the ranges is no combination the suite ran."""
    judged = {p: _release(v) for p, v in versions.items() if v is not None and p in tested}
    for name, end in (("constraints/tested.txt", 1), ("constraints/oldest.txt", 0)):
        if all(release is not None and release == _release(tested[p][end]) for p, release in judged.items()):
            return name
    return None


def version_warning(versions: Mapping[str, Optional[str]], ours: str,
                    tested: Mapping[str, tuple[str, str]] = TESTED) -> Optional[str]:
    """The one warning line for the installed ``versions`` (name -> version, None: not installed) with hf_xla_fsdp
    ``ours``: every package outside its tested range, with its version and that range, and the risk; None when all
    installed packages are inside."""
    found = untested(versions, tested)
    if not found:
        return None
    listed = ", ".join(f"{package} {version} (tested {low}" + (f" to {high})" if high != low else " only)")
                       for package, version, (low, high) in found)
    return (f"hf_xla_fsdp {ours} is untested with {listed}: a private API it overrides may have changed "
            f"(failing when first used) or training may behave differently; install a tested version, "
            f"see `hf-xla-fsdp env` and docs/versions.md ({VERSION_CHECK_ENV}=0 silences this)")


def installed_versions(packages: Optional[Mapping[str, Any]] = None) -> dict[str, Optional[str]]:
    """Installed version of each package (of :data:`TESTED` by default) from its metadata; None when absent."""
    found: dict[str, Optional[str]] = {}
    for package in packages if packages is not None else TESTED:
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = None
    return found


_warned: list[str] = []


def check_versions(ours: str, versions: Optional[Mapping[str, Optional[str]]] = None) -> Optional[str]:
    """Log :func:`version_warning` of ``versions`` (the installed ones by default) with hf_xla_fsdp ``ours`` once per
    process; returns it."""
    if os.environ.get(VERSION_CHECK_ENV, "1").strip().lower() in ("0", "false", "no", "off"):
        return None
    line = version_warning(installed_versions() if versions is None else versions, ours)
    if line is not None and line not in _warned:
        _warned.append(line)
        logger.warning(line)
    return line


def resolve(target: str) -> Any:
    """The object ``"module:Attr.attr"`` names (``AttributeError`` / ``ImportError`` when it is gone)."""
    module, _, path = target.partition(":")
    obj: Any = importlib.import_module(module)
    for part in path.split("."):
        obj = inspect.getattr_static(obj, part) if isinstance(obj, type) else getattr(obj, part)
    return obj


def _attribute_problem(entry: Upstream) -> Optional[str]:
    """An attribute entry: its owner (when named) resolves and its module's code still sets it (``.name =``,
    ``.name: T =`` or the name as a string, as ``setattr`` / ``__setattr__`` take it)."""
    module, _, path = entry.target.partition(":")
    owner, _, name = path.rpartition(".")
    try:
        source = inspect.getsource(importlib.import_module(module))
        if owner:
            resolve(f"{module}:{owner}")
    except (ImportError, AttributeError, OSError, TypeError):
        return f"{entry.target} is gone"
    pattern = rf"\.{re.escape(name)}\s*(?::[^=\n]*)?=(?!=)|[\"']{re.escape(name)}[\"']"
    return None if re.search(pattern, source) else f"{entry.target} is no longer set by {module}"


def _parameters(obj: Any) -> Optional[tuple[str, ...]]:
    func = getattr(obj, "func", obj)  # a cached_property's function
    func = getattr(func, "__func__", func)  # a staticmethod / classmethod
    try:
        names = tuple(inspect.signature(func).parameters)
    except (TypeError, ValueError):
        return None
    return names[1:] if names[:1] in (("self",), ("cls",)) else names


def problem(entry: Upstream) -> Optional[str]:
    """What is wrong with ``entry`` in the installed packages (None: it is there as we use it)."""
    if entry.attribute:
        return _attribute_problem(entry)
    try:
        obj = resolve(entry.target)
    except (ImportError, AttributeError):
        return f"{entry.target} is gone"
    if entry.params is not None:
        found = _parameters(obj)
        relied = found if entry.override or found is None else found[:len(entry.params)]
        if found is not None and relied != entry.params:
            return f"{entry.target} takes ({', '.join(found)}), not ({', '.join(entry.params)})"
    return None


def installed_version(package: str) -> str:
    """The installed version of distribution ``package`` ("not installed" when it is not)."""
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return "not installed"


def problems(user: Optional[str] = None) -> list[tuple[Upstream, str]]:
    """Every API relied on by ``user`` (every part when None) that the installed packages lack or changed."""
    return [(e, p) for e in RELIED_ON if user in (None, e.user) for p in [problem(e)] if p is not None]


_checked: set[str] = set()


def unsupported_message(package: str, version: str, what: str) -> str:
    """The one line for a relied-on API of ``package`` ``version`` that is gone or changed (``what``)."""
    tested = TESTED.get(package)
    span = f" (tested {tested[0]} to {tested[1]})" if tested else ""
    return (f"{package} {version} is not supported by hf_xla_fsdp: {what}; install {package}"
            f"{SUPPORTED.get(package, '')}{span} (`hf-xla-fsdp env` shows what is installed)")


def require(user: str) -> None:
    """One line naming the first API relied on by ``user`` (``"trainer"``, ``"accelerate"``, ``"modeling"``,
    ``"engine_v1"``, ``"engine_v2"``, ``"scan"``, ``"compile_cache"``, ...) that the installed packages lack or
    changed; checked once per process. Optional entries (our code has a fallback) never refuse a run."""
    if user in _checked:
        return
    found = [(e, p) for e, p in problems(user) if not e.optional]
    if found:
        (entry, what), more = found[0], f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise ConfigError(unsupported_message(entry.package, installed_version(entry.package), what + more))
    _checked.add(user)
