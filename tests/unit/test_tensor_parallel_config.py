"""tensor_parallel_size / tensor_parallel_plan: how the setting arrives, which weights a plan splits, the planner's
2D mesh, and one line for every bad input (no XLA devices needed: plans resolve on configs and meta skeletons)."""

from __future__ import annotations

import json

import pytest
from helpers import tiny_bert, tiny_gpt2, tiny_llama

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin
from hf_xla_fsdp.cli import main
from hf_xla_fsdp.engines.v2 import mesh_layout
from hf_xla_fsdp.modeling.tensor_parallel import COLUMN, ROW, resolve_plan
from hf_xla_fsdp.planning.presets import preset_config
from hf_xla_fsdp.planning.tpu import GIB, choose_tensor_parallel, plan_tpu


def test_setting_arrives_from_every_source(tmp_path):
    assert XlaFsdpPlugin(version=2, tensor_parallel_size="2").tensor_parallel_size == 2
    assert XlaFsdpPlugin.from_fsdp_config({"xla": True, "xla_fsdp_v2": True,
                                           "tensor_parallel_size": 4}).tensor_parallel_size == 4
    path = tmp_path / "fsdp.json"
    path.write_text(json.dumps({"xla": True, "xla_fsdp_v2": True, "fsdp_tensor_parallel_size": 2,
                                "tensor_parallel_plan": {"q_proj.weight": ["tensor", "fsdp"]}}))
    plugin = XlaFsdpPlugin.from_fsdp_config(str(path))
    assert plugin.tensor_parallel_size == 2 and plugin.tensor_parallel_plan == {"q_proj.weight": ("tensor", "fsdp")}
    yaml = tmp_path / "acc.yaml"
    yaml.write_text("distributed_type: 'NO'\nfsdp_config:\n  version: 2\n  tensor_parallel_size: 2\n")
    assert XlaFsdpPlugin.from_accelerate_config(yaml).tensor_parallel_size == 2
    assert XlaFsdpPlugin.from_dict(plugin.to_dict()) == plugin  # round-trips (a Trainer's saved settings)


@pytest.mark.parametrize("kwargs,message", [
    (dict(version=1, tensor_parallel_size=2), "tensor_parallel_size applies to engine=xla_v2 only; remove it for engine=xla_v1"),
    (dict(version=2, tensor_parallel_size=0), "tensor_parallel_size=0 must be an integer >= 1"),
    (dict(version=2, tensor_parallel_plan={"q_proj.weight": ["tensor", "model"]}), "names mesh axis 'model'; allowed"),
    (dict(version=2, tensor_parallel_plan={"re:q_proj[": [None]}), "is not a valid regex"),
    (dict(version=2, tensor_parallel_plan=["q_proj"]), "tensor_parallel_plan must be a mapping"),
    (dict(version=2, tensor_parallel_size=2, scan_layers=True), "scan_layers and tensor_parallel_size=2 cannot be combined"),
])
def test_bad_settings_are_one_line(kwargs, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[")) as err:
        XlaFsdpPlugin(**kwargs)
    assert "\n" not in str(err.value)


def test_mesh_layout():
    assert mesh_layout(8, 1, 2) == ((1, 4, 2), ("replica", "fsdp", "tensor"))
    assert mesh_layout(8, 2, 2) == ((2, 2, 2), ("replica", "fsdp", "tensor"))
    assert mesh_layout(8, 2) == ((2, 4), ("replica", "fsdp"))  # T = 1: the mesh FSDP v2 always had
    with pytest.raises(ConfigError, match=r"^replica_size=1 x tensor_parallel_size=3 = 3 does not divide the 8 devices"):
        mesh_layout(8, 1, 3)


def test_family_plans_and_their_limits():
    plan = resolve_plan(tiny_llama(), 2)
    assert plan.axes_for("self_attn.q_proj.weight") == COLUMN and plan.axes_for("mlp.down_proj.weight") == ROW
    assert plan.axes_for("model.layers.3.self_attn.o_proj.weight") == ROW  # full names match by suffix
    assert plan.axes_for("self_attn.q_proj.base_layer.weight") == COLUMN  # PEFT's wrapped weight keeps the plan
    assert plan.axes_for("self_attn.q_proj.lora_A.default.weight") is None  # adapters: plain FSDP
    assert plan.axes_for("input_layernorm.weight") is None and plan.axes_for("model.embed_tokens.weight") is not None
    gpt2 = resolve_plan(tiny_gpt2(), 2)
    assert gpt2.axes_for("mlp.c_fc.weight") == ("fsdp", "tensor")  # Conv1D is [in, out]
    assert gpt2.axes_for("attn.c_attn.weight") is None  # packed q/k/v: not split
    # vocab 129 is odd: embeddings stay plain FSDP rather than an uneven split
    assert resolve_plan(tiny_llama(vocab_size=129), 2).axes_for("lm_head.weight") is None
    for config, size, what in [(tiny_llama(), 8, "num_attention_heads=4"), (tiny_llama(), 4, "num_key_value_heads=2"),
                               (tiny_llama(intermediate_size=130, num_key_value_heads=4), 4, "intermediate_size=130")]:
        with pytest.raises(ConfigError, match=f"^tensor_parallel_size={size} does not divide {what} of this llama model"):
            resolve_plan(config, size)
    with pytest.raises(ConfigError, match="no tensor-parallel plan for model_type 'bert'.*give tensor_parallel_plan"):
        resolve_plan(tiny_bert(), 2)
    own = resolve_plan(tiny_bert(), 2, {"re:intermediate\\.dense\\.weight$": COLUMN})  # an override needs no family
    assert own.axes_for("intermediate.dense.weight") == COLUMN and own.axes_for("output.dense.weight") is None


@pytest.fixture(scope="module")
def llama70b():
    plugin = XlaFsdpPlugin(version=2, activation_checkpointing=True, compute_dtype="bfloat16")
    one = plan_tpu("llama-2-70b", plugin, "v5e-256", batch_size=1)
    four = plan_tpu("llama-2-70b", XlaFsdpPlugin(**{**plugin.to_dict(), "tensor_parallel_size": 4}), "v5e-256")
    return one, four


def test_planner_names_the_mesh_and_splits_the_working_set(llama70b):
    one, four = llama70b
    assert one["mesh"] == {"replica": 1, "fsdp": 256, "tensor": 1}
    assert four["mesh"] == {"replica": 1, "fsdp": 64, "tensor": 4}
    g1, g4 = (r["per_chip"]["estimate_gathered_working_set"] for r in (one, four))
    assert g4 <= g1 / 3, (g1, g4)
    assert four["per_chip"]["largest_unit"]["gathered_bytes"] <= one["per_chip"]["largest_unit"]["gathered_bytes"] / 3
    # the sharded state is the same 1/256 per chip on either mesh (70B x 4 bytes, plus padding)
    assert abs(four["per_chip"]["parameters"] - one["per_chip"]["parameters"]) < 0.01 * one["per_chip"]["parameters"]
    assert one["tensor_parallel"]["size"] == 1 and "fits with FSDP alone" in one["tensor_parallel"]["why"]


def test_planner_proposes_the_smallest_tensor_size_that_fits():
    plugin = XlaFsdpPlugin(version=2, activation_checkpointing=True, compute_dtype="bfloat16")
    report = plan_tpu("llama-2-70b", plugin, "v5e-128", seq_len=4096)
    assert report["fits"] is False
    tp = report["tensor_parallel"]
    assert tp["size"] == 4 and "divides the gathered working set by 4" in tp["why"], tp
    assert report["suggestions"][0]["change"] == "--tensor-parallel-size 4" and report["suggestions"][0]["fits"]


@pytest.mark.parametrize("args,message", [
    (["--fsdp-version", "2", "--tensor-parallel-size", "3"], "tensor_parallel_size=3 = 3 does not divide the 256 chips"),
    (["--fsdp-version", "2", "--tensor-parallel-size", "16"], "does not divide num_key_value_heads=8"),
    (["--tensor-parallel-size", "2"], "tensor_parallel_size applies to engine=xla_v2 only"),
])
@pytest.mark.xla
def test_planner_bad_input_exits_2_with_one_line(capsys, args, message):
    assert main(["plan", "llama-2-70b", "--tpu", "v5e-256", "--json", *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_auto_takes_the_planners_choice():
    plugin = XlaFsdpPlugin(version=2, activation_checkpointing=True, compute_dtype="bfloat16",
                           tensor_parallel_size="auto")
    assert plugin.tensor_parallel_size == "auto"
    assert XlaFsdpPlugin.from_fsdp_config({"xla": True, "xla_fsdp_v2": True,
                                           "tensor_parallel_size": "AUTO"}).tensor_parallel_size == "auto"
    with pytest.raises(ConfigError, match="tensor_parallel_size applies to engine=xla_v2 only"):
        XlaFsdpPlugin(version=1, tensor_parallel_size="auto")
    with pytest.raises(ConfigError, match=r"tensor_parallel_size='two' must be an integer >= 1"):
        XlaFsdpPlugin(version=2, tensor_parallel_size="two")
    config = preset_config("llama-2-70b")
    assert choose_tensor_parallel(config, plugin, 256, 16 * GIB)[0] == 1  # fits alone
    size, why = choose_tensor_parallel(config, plugin, 128, 14 * GIB)  # 15.35 GiB alone: too much
    assert size > 1 and f"tensor_parallel_size {size} divides the gathered working set" in why
    assert choose_tensor_parallel(config, plugin, 8, None)[0] == 1  # no memory limit known (XLA:CPU)
    # the planner with auto: its plan is the proposed mesh
    report = plan_tpu("llama-2-70b", plugin, "v5e-128", seq_len=4096)
    assert report["fits"] and report["mesh"] == {"replica": 1, "fsdp": 32, "tensor": 4} and report["suggestions"] == []
