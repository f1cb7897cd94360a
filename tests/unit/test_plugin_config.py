"""Every configuration path of XlaFsdpPlugin, and every error it must name."""

from __future__ import annotations

import json

import pytest
import torch

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin


def test_defaults_are_nested_zero3_fp32():
    p = XlaFsdpPlugin()
    assert p.sharding == "zero3" and p.version == 1 and p.meta_init
    assert p.compute_dtype is None and not p.activation_checkpointing
    kwargs = p.fsdp_kwargs()
    assert "sharding_groups" not in kwargs and kwargs["reshard_after_forward"] is True


@pytest.mark.parametrize("value,expected", [("bf16", torch.bfloat16), ("bfloat16", torch.bfloat16),
                                            ("torch.float16", torch.float16), ("fp32", torch.float32),
                                            (torch.bfloat16, torch.bfloat16)])
@pytest.mark.xla
def test_dtype_strings(value, expected):
    assert XlaFsdpPlugin(compute_dtype=value, buffer_dtype=value).compute_dtype is expected


@pytest.mark.parametrize(
    "kwargs,needle",
    [
        (dict(sharding="zero1"), "sharding='zero1' is not valid; allowed values: 'zero3'"),
        (dict(compute_dtype="int8"), "compute_dtype='int8' is not a valid dtype; use one of"),
        (dict(buffer_dtype="fp8"), "buffer_dtype='fp8' is not a valid dtype"),
        (dict(flatten_parameters="maybe"), "flatten_parameters='maybe' must be a boolean"),
        (dict(min_num_params=-1), "min_num_params=-1 must be an integer >= 0"),
        (dict(min_num_params="lots"), "min_num_params='lots' must be an integer"),
        (dict(version=2, shard_param_on_dim_0=True), "shard_param_on_dim_0 applies to engine=xla_v1"),
        # FSDP v1 never reads replica_size: silently ignoring it would run plain FSDP where hybrid sharding was asked
        (dict(engine="xla", version=1, replica_size=2),
         "replica_size applies to engine=xla_v2 or engine=fsdp2 only; remove it for engine=xla_v1"),
        (dict(version=3), "version=3 is not valid; allowed values: 1"),
        (dict(checkpoint_format="zip"), "checkpoint_format='zip' is not valid"),
        (dict(checkpoint_storage="nfs"), "checkpoint_storage='nfs' is not valid; allowed values: 'auto', 'shared'"),
        (dict(consolidate_max_shard_size="huge"), "consolidate_max_shard_size='huge' is not a size"),
        (dict(transformer_layer_cls_to_wrap=[1, 2]), "transformer_layer_cls_to_wrap=[1, 2] must be a class name"),
        (dict(sharding_rank=0), "must be given together"),
        (dict(sharding_groups=[[0, 1]], sharding_rank=2, sharding_world_size=2), "sharding_rank=2 must be below"),
    ],
)
def test_invalid_values_name_the_field(kwargs, needle):
    with pytest.raises(ConfigError) as err:
        XlaFsdpPlugin(**kwargs)
    assert needle in str(err.value)
    assert "\n" not in str(err.value)


def test_sharding_strategy_aliases():
    assert XlaFsdpPlugin(sharding="FULL_SHARD").sharding == "zero3"
    assert XlaFsdpPlugin(sharding="SHARD_GRAD_OP").sharding == "zero2"


def test_transformers_fsdp_config_dict_with_prefixes():
    cfg = {
        "xla": True,
        "fsdp_transformer_layer_cls_to_wrap": "LlamaDecoderLayer",
        "xla_fsdp_grad_ckpt": True,
        "fsdp_min_num_params": 0,
        "xla_fsdp_settings": {"compute_dtype": "bfloat16", "buffer_dtype": "bfloat16", "flatten_parameters": True,
                              "shard_param_on_dim_0": True, "fp32_reduce_scatter": True},
    }
    p = XlaFsdpPlugin.from_fsdp_config(cfg)
    assert p.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"]
    assert p.activation_checkpointing and p.flatten_parameters and p.shard_param_on_dim_0 and p.fp32_reduce_scatter
    assert p.compute_dtype is torch.bfloat16 and p.buffer_dtype is torch.bfloat16


def test_fsdp_config_json_file_and_round_trip(tmp_path):
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"xla": True, "sharding": "zero2", "xla_fsdp_settings": {"compute_dtype": "bf16"}}))
    p = XlaFsdpPlugin.from_fsdp_config(str(path))
    assert p.sharding == "zero2" and p.compute_dtype is torch.bfloat16
    assert XlaFsdpPlugin.from_dict(p.to_dict()) == p
    json.dumps(p.to_dict())  # serialisable


@pytest.mark.parametrize(
    "cfg,needle",
    [
        ({"xla": True, "backward_prefetsh": "BACKWARD_PRE"}, "unknown key 'backward_prefetsh' in fsdp_config"),
        ({"xla": True, "fsdp_offload_params": True}, "fsdp_offload_params=true in fsdp_config cannot be honoured"),
        ({"xla": True, "fsdp_version": 2}, "selects torch's FSDP2 (fully_shard), which does not run on XLA"),
        ({"xla": True, "xla_fsdp_settings": {"bogus": 1}}, "unknown key xla_fsdp_settings.bogus"),
        ({"xla": False}, "set xla to true"),
        ({"xla_fsdp_v2": True, "xla_fsdp_settings": {"compute_dtype": "float16"}},
         "compute_dtype=float16 is not available with engine=xla_v2"),
        ({"xla_fsdp_settings": [1]}, "xla_fsdp_settings in fsdp_config must be a mapping"),
        ([1, 2], "must be a JSON object"),
    ],
)
def test_fsdp_config_errors(cfg, needle):
    with pytest.raises(ConfigError, match=None) as err:
        XlaFsdpPlugin.from_fsdp_config(cfg)
    assert needle in str(err.value)


def test_fsdp_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        XlaFsdpPlugin.from_fsdp_config(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="is not valid JSON"):
        XlaFsdpPlugin.from_fsdp_config(str(bad))


def test_accelerate_yaml(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text(
        "compute_environment: LOCAL_MACHINE\ndistributed_type: XLA\nmain_training_function: main\n"
        "fsdp_config:\n  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer,LlamaRMSNorm\n"
        "  fsdp_sharding_strategy: SHARD_GRAD_OP\n  fsdp_activation_checkpointing: true\n"
        "  compute_dtype: bf16\n"
    )
    p = XlaFsdpPlugin.from_accelerate_config(path)
    assert p.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer", "LlamaRMSNorm"]
    assert p.sharding == "zero2" and p.activation_checkpointing and p.compute_dtype is torch.bfloat16


def test_accelerate_yaml_errors(tmp_path):
    path = tmp_path / "acc.yaml"
    path.write_text("distributed_type: XLA\nfsdp_config:\n  fsdp_offload_parameters: true\n")
    with pytest.raises(ConfigError, match=r"unknown key 'fsdp_offload_parameters' in fsdp_config in .*acc.yaml"):
        XlaFsdpPlugin.from_accelerate_config(path)
    path.write_text("fsdp_config: [a, b]\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        XlaFsdpPlugin.from_accelerate_config(path)
    with pytest.raises(ConfigError, match="does not exist"):
        XlaFsdpPlugin.from_accelerate_config(tmp_path / "nope.yaml")


def test_malformed_yaml_is_one_line(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("fsdp_config:\n  a: [1, 2\n  b: c\n")
    with pytest.raises(ConfigError) as err:
        XlaFsdpPlugin.from_accelerate_config(path)
    assert "is not valid YAML" in str(err.value) and "\n" not in str(err.value)


ACCELERATE_CONFIG_FSDP = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: XLA
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_backward_prefetch: BACKWARD_PRE
  fsdp_cpu_ram_efficient_loading: true
  fsdp_forward_prefetch: false
  fsdp_offload_params: false
  fsdp_reshard_after_forward: SHARD_GRAD_OP
  fsdp_state_dict_type: FULL_STATE_DICT
  fsdp_sync_module_states: true
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_use_orig_params: true
  fsdp_version: 1
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 8
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: false
"""


def test_every_key_accelerate_config_writes_for_torch_fsdp_is_mapped(tmp_path, caplog):
    path = tmp_path / "fsdp.yaml"
    path.write_text(ACCELERATE_CONFIG_FSDP)
    with caplog.at_level("WARNING", logger="hf_xla_fsdp"):
        p = XlaFsdpPlugin.from_accelerate_config(path)
    assert p.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"] and p.activation_checkpointing
    assert p.sharding == "zero2" and p.meta_init and p.checkpoint_format == "sharded+consolidated"
    assert p.compute_dtype is torch.bfloat16 and p.version == 1
    noted = {r.getMessage().split("=")[0] for r in caplog.records}
    assert noted == {"fsdp_backward_prefetch", "fsdp_forward_prefetch", "fsdp_sync_module_states",
                     "fsdp_use_orig_params", "fsdp_version"}  # one note each, for the keys with no meaning on XLA


@pytest.mark.parametrize("edit,replacement,named", [
    ("fsdp_offload_params: false", "fsdp_offload_params: true", "fsdp_offload_params"),
    ("fsdp_version: 1", "fsdp_version: 2\n  xla: true", "fsdp_version"),
    ("fsdp_reshard_after_forward: SHARD_GRAD_OP", "fsdp_reshard_after_forward: NO_SHARD", "NO_SHARD"),
    ("fsdp_reshard_after_forward: SHARD_GRAD_OP", "fsdp_reshard_after_forward: HYBRID_SHARD", "replica_size"),
    ("fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP", "fsdp_auto_wrap_policy: LAYER_WRAP", "fsdp_auto_wrap_policy"),
    ("fsdp_state_dict_type: FULL_STATE_DICT", "fsdp_state_dict_type: HALF_STATE_DICT", "fsdp_state_dict_type"),
    ("mixed_precision: bf16", "mixed_precision: fp8", "mixed_precision=fp8"),
    ("fsdp_use_orig_params: true", "fsdp_use_orig_params: true\n  compute_dtype: float16", "disagree"),
])
@pytest.mark.xla
def test_accelerate_fsdp_keys_that_cannot_be_honoured_are_one_line(tmp_path, edit, replacement, named):
    path = tmp_path / "fsdp.yaml"
    path.write_text(ACCELERATE_CONFIG_FSDP.replace(edit, replacement))
    with pytest.raises(ConfigError) as err:
        XlaFsdpPlugin.from_accelerate_config(path)
    assert named in str(err.value) and "\n" not in str(err.value)


def test_size_and_no_wrap_policies():
    size = XlaFsdpPlugin.from_fsdp_config({"xla": True, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP"})
    assert size.min_num_params == 100_000_000  # accelerate's default when the YAML names none
    sized = XlaFsdpPlugin.from_fsdp_config({"xla": True, "fsdp_auto_wrap_policy": "SIZE_BASED_WRAP",
                                            "fsdp_min_num_params": 1000})
    assert sized.min_num_params == 1000
    root = XlaFsdpPlugin.from_fsdp_config({"xla": True, "fsdp_auto_wrap_policy": "NO_WRAP",
                                           "fsdp_reshard_after_forward": "FULL_SHARD"})
    assert root.sharding == "zero2"  # one unit, the root


def test_checkpoint_storage_flows_from_fsdp_config_and_accelerate_yaml(tmp_path):
    assert XlaFsdpPlugin().checkpoint_storage == "auto"
    assert XlaFsdpPlugin.from_fsdp_config({"xla": True, "checkpoint_storage": "Local"}).checkpoint_storage == "local"
    path = tmp_path / "fsdp.yaml"
    path.write_text(ACCELERATE_CONFIG_FSDP.replace("fsdp_config:\n", "fsdp_config:\n  checkpoint_storage: object\n", 1))
    assert XlaFsdpPlugin.from_accelerate_config(path).checkpoint_storage == "object"


# what `accelerate config` writes for torch's FSDP2 (accelerate 1.15: distributed_type FSDP, fsdp_version 2)
ACCELERATE_CONFIG_FSDP2 = """compute_environment: LOCAL_MACHINE
debug: false
distributed_type: FSDP
downcast_bf16: 'no'
enable_cpu_affinity: false
fsdp_config:
  fsdp_activation_checkpointing: true
  fsdp_auto_wrap_policy: TRANSFORMER_BASED_WRAP
  fsdp_cpu_ram_efficient_loading: true
  fsdp_offload_params: false
  fsdp_reshard_after_forward: false
  fsdp_state_dict_type: SHARDED_STATE_DICT
  fsdp_transformer_layer_cls_to_wrap: LlamaDecoderLayer
  fsdp_version: 2
machine_rank: 0
main_training_function: main
mixed_precision: bf16
num_machines: 1
num_processes: 4
rdzv_backend: static
same_network: true
tpu_env: []
tpu_use_cluster: false
tpu_use_sudo: false
use_cpu: true
"""


def test_accelerate_fsdp2_yaml_selects_engine_fsdp2(tmp_path):
    path = tmp_path / "fsdp2.yaml"
    path.write_text(ACCELERATE_CONFIG_FSDP2)
    p = XlaFsdpPlugin.from_accelerate_config(path)
    assert p.engine == "fsdp2" and p.engine_key == "fsdp2"
    assert p.activation_checkpointing and not p.reshard_after_forward and p.compute_dtype is torch.bfloat16
    assert p.transformer_layer_cls_to_wrap == ["LlamaDecoderLayer"] and p.checkpoint_format == "sharded"
    p.check_launcher("FSDP", str(path))  # accelerate's own distributed type for it
    with pytest.raises(ConfigError, match="engine fsdp2 runs torch.distributed processes"):
        p.check_launcher("XLA", str(path))
    # an XLA v2 config that also says fsdp_version: 2 stays XLA v2 (accepted before engine fsdp2 existed)
    v2 = XlaFsdpPlugin.from_fsdp_config({"xla": True, "xla_fsdp_v2": True, "fsdp_version": 2})
    assert v2.engine == "xla_v2" and v2.version == 2


@pytest.mark.parametrize("cfg,needle", [
    ({"engine": "fsdp2", "version": 2}, "version applies to engine=xla_v1 or engine=xla_v2 only; remove it for engine=fsdp2"),
    ({"engine": "fsdp2", "flatten_parameters": True}, "flatten_parameters applies to engine=xla_v1 only"),
    ({"engine": "fsdp2", "scan_layers": True}, "scan_layers=True is not available with engine=fsdp2"),
    ({"engine": "fsdp2", "compute_dtype": "float16"}, "compute_dtype=float16 is not available with engine=fsdp2"),
    ({"engine": "fsdp2", "tensor_parallel_size": 2}, "tensor_parallel_size applies to engine=xla_v2 only"),
    ({"engine": "fsdp3"}, "engine='fsdp3' is not valid; allowed values: 'xla_v1' (FSDP v1"),
    ({"engine": "fsdp2", "xla": True}, "xla=True and engine=fsdp2 in fsdp_config disagree"),
])
def test_engine_fsdp2_refuses_what_it_cannot_honour_in_one_line(cfg, needle):
    with pytest.raises(ConfigError) as err:
        XlaFsdpPlugin.from_fsdp_config(cfg)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_engine_selection_and_its_spellings():
    assert XlaFsdpPlugin(engine="FSDP2").engine == "fsdp2"
    # transformers writes xla: false (and its other defaults) into every fsdp_config of a --fsdp run
    p = XlaFsdpPlugin.from_fsdp_config({"engine": "fsdp2", "xla": False, "xla_fsdp_v2": False,
                                        "xla_fsdp_grad_ckpt": False, "min_num_params": 0})
    assert p.engine == "fsdp2" and XlaFsdpPlugin.from_dict(p.to_dict()) == p
    # unset, settings only XLA FSDP honours pick it whatever is installed; the rest take the installed runtime's
    assert XlaFsdpPlugin(version=2).engine == "xla_v2" and XlaFsdpPlugin(flatten_parameters=True).engine == "xla_v1"
    from hf_xla_fsdp.config.engines import default_engine
    assert XlaFsdpPlugin().engine == default_engine().key
