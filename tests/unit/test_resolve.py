"""One conflict rule for the settings of every entry point (config/resolve.py): the same conflict, whichever two
sources give it (keyword arguments / an XlaFsdpPlugin, transformers' fsdp_config, TrainingArguments flags, an
accelerate YAML, the launcher's flags, accelerate's mixed precision), is refused with the same line by every entry
point (XlaFsdpTrainer, XlaFsdpAccelerator, `hf-xla-fsdp launch`, the start-up hook, TrainingArguments); the launch's
settings reach the script's processes through the environment; the plugin is immutable."""

from __future__ import annotations

import dataclasses
import json
import re

import pytest
from helpers import USER_SCRIPTS

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin, process
from hf_xla_fsdp.config import resolve as r

SCRIPT = USER_SCRIPTS / "trainer_outputs.py"


def line(first: str, second: str, key: str, a: str, b: str) -> str:
    """The one line every entry point says for a conflict (the earlier source first)."""
    return f"{first} and {second} disagree: {key}={a} vs {b}; keep the setting in one place"


#: the cases use what the XLA engines take and the default engine is xla only where torch_xla is installed: fp16
#: compute (engine fsdp2 refuses it before any conflict), bf16 TrainingArguments on the CPU, SPMD (the no-xla leg
#: skips them; tests/unit/test_plugin_config.py covers engine fsdp2's settings)
XLA_DEFAULTS = pytest.mark.xla


@pytest.fixture
def fresh(monkeypatch):
    """A process state of its own (this pytest process keeps its real one) and no launch in the environment."""
    monkeypatch.setattr(process, "_STATE", process.ProcessState())
    for name in (r.LAUNCH_ENV, r.ACCELERATE_PRECISION_ENV, "HF_XLA_FSDP_ACCELERATE_CONFIG"):
        monkeypatch.setenv(name, "")  # recorded as it was, so what hand_off writes is undone after the test
        monkeypatch.delenv(name)
    return monkeypatch


def yaml_file(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text("compute_environment: LOCAL_MACHINE\ndistributed_type: XLA\nnum_processes: 1\n" + text)
    return path


def training_args(tmp_path, **kwargs):
    from transformers import TrainingArguments

    return TrainingArguments(output_dir=str(tmp_path / "out"), report_to="none", **kwargs)


def raised(call) -> str:
    with pytest.raises(ConfigError) as err:
        call()
    return str(err.value)


# --------------------------------------------------------------------------- the launcher
def prepare(*argv: str) -> None:
    import argparse

    from hf_xla_fsdp.launch import add_arguments, parse_command_line, prepare

    parser = argparse.ArgumentParser(allow_abbrev=False)
    add_arguments(parser)
    prepare(parse_command_line(parser, list(argv)))


@XLA_DEFAULTS
def test_launcher_flags_and_yaml(fresh, tmp_path):
    bf16_yaml = yaml_file(tmp_path, "bf16.yaml", "mixed_precision: bf16\n")
    fp16_fsdp_yaml = yaml_file(tmp_path, "fp16.yaml", "fsdp_config:\n  compute_dtype: float16\n")
    # the launcher's own two flags
    assert raised(lambda: prepare("--fsdp_config", '{"compute_dtype": "bfloat16"}', "--mixed_precision", "fp16",
                                  str(SCRIPT))) == line("the launcher's --fsdp_config", "the launcher's --mixed_precision "
                                                        "fp16", "compute_dtype", "bfloat16", "float16")
    # the YAML's mixed_precision against the launcher's --fsdp_config
    assert raised(lambda: prepare("--config_file", str(bf16_yaml), "--fsdp_config", '{"compute_dtype": "float16"}',
                                  str(SCRIPT))) == line(f"mixed_precision=bf16 in {bf16_yaml}", "the launcher's "
                                                        "--fsdp_config", "compute_dtype", "bfloat16", "float16")
    # the script's own --fsdp_config (transformers' vocabulary) against the YAML's fsdp_config:
    assert raised(lambda: prepare("--config_file", str(fp16_fsdp_yaml), str(SCRIPT), "--fsdp", "full_shard",
                                  "--fsdp_config", '{"xla": true, "compute_dtype": "bf16"}')) == line(
        "the script's --fsdp_config", f"fsdp_config in {fp16_fsdp_yaml}", "compute_dtype", "bfloat16", "float16")
    assert r.LAUNCH_ENV not in __import__("os").environ  # refused before anything is handed over


@XLA_DEFAULTS
def test_start_up_hook_reads_the_script_flags_and_the_yaml_it_was_launched_with(fresh, tmp_path):
    fp16_yaml = yaml_file(tmp_path, "fp16.yaml", "mixed_precision: fp16\n")
    fresh.setenv("HF_XLA_FSDP_ACCELERATE_CONFIG", str(fp16_yaml))  # what stock `accelerate launch` cannot say
    fresh.setattr("sys.argv", ["train.py", "--fsdp_config", '{"xla": true, "compute_dtype": "bfloat16"}'])
    assert raised(lambda: XlaFsdpPlugin.resolve(r.hook_sources())) == line(
        "the script's --fsdp_config", f"mixed_precision=fp16 in {fp16_yaml}", "compute_dtype", "bfloat16", "float16")


# --------------------------------------------------------------------------- XlaFsdpTrainer and TrainingArguments
@XLA_DEFAULTS
def test_trainer_arguments_flags_plugin_and_launch(fresh, tmp_path):
    from hf_xla_fsdp import XlaFsdpTrainer
    from hf_xla_fsdp.integrations.patches import ready_for_arguments

    # transformers' fsdp_config against the arguments' own bf16 flag
    args = training_args(tmp_path, bf16=True, fsdp="full_shard", fsdp_config={"xla": True, "compute_dtype": "float16"})
    assert raised(lambda: XlaFsdpTrainer(args=args)) == line("TrainingArguments' fsdp_config",
                                                              "TrainingArguments(bf16=True)", "compute_dtype", "float16",
                                                              "bfloat16")
    # keyword arguments (an XlaFsdpPlugin) against the flag
    args = training_args(tmp_path, bf16=True)
    assert raised(lambda: XlaFsdpTrainer(args=args, fsdp_plugin=XlaFsdpPlugin(compute_dtype="fp16"))) == line(
        "TrainingArguments(bf16=True)", "fsdp_plugin=XlaFsdpPlugin(compute_dtype=float16)", "compute_dtype",
        "bfloat16", "float16")
    # a launched script: the launcher's --mixed_precision against the arguments, at the Trainer and already when the
    # arguments are about to take the device (the patched TrainingArguments)
    r.hand_off(r.launch_sources(mixed_precision="fp16"))
    expected = line("the launcher's --mixed_precision fp16", "TrainingArguments(bf16=True)", "compute_dtype", "float16",
                    "bfloat16")
    assert raised(lambda: XlaFsdpTrainer(args=args)) == expected
    assert raised(lambda: ready_for_arguments(args, "test")) == expected
    # the engine too: the launcher says v1 (a settings source without xla_fsdp_v2), the arguments v2; the patched
    # TrainingArguments refuse it while being built, before they take the device
    r.hand_off(r.launch_sources(fsdp_config='{"xla": true}'))
    assert raised(lambda: training_args(tmp_path, fsdp="full_shard", fsdp_config={"xla": True, "xla_fsdp_v2": True})
                  ) == line("the launcher's --fsdp_config", "TrainingArguments' fsdp_config", "version", "1", "2")
    # as a script's --fsdp_config gives it: a path, still unread when the arguments take the device
    v2 = tmp_path / "v2.json"
    v2.write_text(json.dumps({"xla": True, "xla_fsdp_v2": True}))
    assert raised(lambda: training_args(tmp_path, fsdp=True, fsdp_config=str(v2))) == line(
        "the launcher's --fsdp_config", f"TrainingArguments' fsdp_config {v2}", "version", "1", "2")


@XLA_DEFAULTS
def test_trainer_settings_merge_what_does_not_conflict(fresh, tmp_path):
    from hf_xla_fsdp.config.training_args import trainer_settings

    r.hand_off(r.launch_sources(mixed_precision="bf16", fsdp_config='{"sharding": "zero3"}'))
    args = training_args(tmp_path, bf16=True, gradient_checkpointing=True, fsdp="full_shard",
                         fsdp_config={"xla": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    plugin = trainer_settings(args)
    assert (str(plugin.compute_dtype), plugin.activation_checkpointing, plugin.transformer_layer_cls_to_wrap) == (
        "torch.bfloat16", True, ["LlamaDecoderLayer"])
    assert not args.gradient_checkpointing  # became activation_checkpointing (checkpoint_module), as documented


# --------------------------------------------------------------------------- XlaFsdpAccelerator
@XLA_DEFAULTS
def test_accelerator_kwargs_environment_and_yaml(fresh, tmp_path):
    from hf_xla_fsdp import XlaFsdpAccelerator

    assert raised(lambda: XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(compute_dtype="fp16"), mixed_precision="bf16")
                  ) == line("fsdp_plugin=XlaFsdpPlugin(compute_dtype=float16)", "Accelerator(mixed_precision='bf16')",
                            "compute_dtype", "float16", "bfloat16")
    # under stock `accelerate launch`: the YAML it was started with, and the precision accelerate exports
    fp16_yaml = yaml_file(tmp_path, "fp16.yaml", "fsdp_config:\n  compute_dtype: float16\n")
    fresh.setenv("HF_XLA_FSDP_ACCELERATE_CONFIG", str(fp16_yaml))
    fresh.setenv(r.ACCELERATE_PRECISION_ENV, "bf16")
    assert raised(lambda: XlaFsdpAccelerator()) == line(f"fsdp_config in {fp16_yaml}", "ACCELERATE_MIXED_PRECISION=bf16",
                                                        "compute_dtype", "float16", "bfloat16")
    # launched: the launch's sources (the YAML handed over), not a YAML looked for
    fresh.delenv("HF_XLA_FSDP_ACCELERATE_CONFIG")
    r.hand_off(r.launch_sources(yaml_path=fp16_yaml))
    assert raised(lambda: XlaFsdpAccelerator()) == line(f"fsdp_config in {fp16_yaml}", "ACCELERATE_MIXED_PRECISION=bf16",
                                                        "compute_dtype", "float16", "bfloat16")


@XLA_DEFAULTS
def test_plugin_readers_use_the_same_rule(fresh, tmp_path):
    both = yaml_file(tmp_path, "both.yaml", "mixed_precision: bf16\nfsdp_config:\n  compute_dtype: float16\n")
    assert raised(lambda: XlaFsdpPlugin.from_accelerate_config(both)) == line(
        f"fsdp_config in {both}", f"mixed_precision=bf16 in {both}", "compute_dtype", "float16", "bfloat16")
    assert raised(lambda: XlaFsdpPlugin(compute_dtype="fp16").with_mixed_precision("bf16", "--bf16")) == line(
        "fsdp_plugin=XlaFsdpPlugin(compute_dtype=float16)", "--bf16", "compute_dtype", "float16", "bfloat16")


def test_every_conflict_line_has_one_shape():
    """The rule itself, for any setting: one line, both sources and both values, the fix."""
    pattern = re.compile(r"^(.+) and (.+) disagree: (\w+)=(.+) vs (.+); keep the setting in one place$")
    for a, b in [({"sharding": "zero2"}, {"sharding": "full_shard"}), ({"xla_fsdp_v2": True}, {"version": 1}),
                 ({"fsdp_activation_checkpointing": True}, {"xla_fsdp_grad_ckpt": False})]:
        message = raised(lambda: XlaFsdpPlugin.resolve([r.settings_source("A", a), r.settings_source("B", b)]))
        found = pattern.match(message)
        assert found and found.group(1, 2) == ("A", "B") and "\n" not in message, message


# --------------------------------------------------------------------------- the hand-off and the plugin
def test_launch_settings_are_handed_over_through_the_environment(fresh, tmp_path):
    import os

    yaml = yaml_file(tmp_path, "v1.yaml", "mixed_precision: bf16\nfsdp_config:\n  activation_checkpointing: true\n")
    sources = r.launch_sources(["--fsdp_config", '{"xla": true, "sharding": "zero3"}'], yaml, mixed_precision="bf16")
    r.hand_off(sources)
    handed = json.loads(os.environ[r.LAUNCH_ENV])
    assert [s["name"] for s in handed] == ["the script's --fsdp_config", f"fsdp_config in {yaml}",
                                           f"mixed_precision=bf16 in {yaml}", "the launcher's --mixed_precision bf16"]
    fresh.setattr(process, "_STATE", process.ProcessState())  # a process started by the launcher: nothing in memory
    assert r.current_launch_sources() == sources
    plugin = XlaFsdpPlugin.resolve(r.current_launch_sources())
    assert (plugin.version, plugin.activation_checkpointing, str(plugin.compute_dtype)) == (1, True, "torch.bfloat16")
    fresh.setenv(r.LAUNCH_ENV, "not json")
    fresh.setattr(process, "_STATE", process.ProcessState())
    assert "HF_XLA_FSDP_LAUNCH is not what hf-xla-fsdp launch writes" in raised(r.current_launch_sources)


def test_the_plugin_is_immutable():
    plugin = XlaFsdpPlugin(version=2, tensor_parallel_size="auto")
    with pytest.raises(dataclasses.FrozenInstanceError):
        plugin.tensor_parallel_size = 2
    changed = dataclasses.replace(plugin, tensor_parallel_size=2)
    assert (plugin.tensor_parallel_size, changed.tensor_parallel_size) == ("auto", 2)


# --------------------------------------------------------------------------- the runtime, readied once
ONCE = """
import json, sys
import hf_xla_fsdp.engines.v2 as v2
calls = []
real = v2.XlaFsdpV2.setup_runtime
def counting(self, plugin, what="this process"):
    calls.append(what)
    return real(self, plugin, what=what)
v2.XlaFsdpV2.setup_runtime = counting
import torch_xla.runtime as xr
use_spmd = []
real_use = xr.use_spmd
xr.use_spmd = lambda *a, **k: (use_spmd.append(1), real_use(*a, **k))[1]

from hf_xla_fsdp.config import resolve as r
from hf_xla_fsdp.integrations import launched
from hf_xla_fsdp.process import process_state
r.hand_off(r.launch_sources(fsdp_config='{"xla": true, "xla_fsdp_v2": true}'))
launched.start()                                            # the launcher, before the script
from accelerate import Accelerator
from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainingArguments
tiny = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2)
args = TrainingArguments(output_dir=sys.argv[1], report_to="none", fsdp="full_shard",
                         fsdp_config={"xla": True, "xla_fsdp_v2": True})   # the patched TrainingArguments
trainer = Trainer(model=AutoModelForCausalLM.from_config(tiny), args=args)  # Trainer, its accelerator, the wrap
accelerator = Accelerator()                                 # a launched script's own Accelerator
from hf_xla_fsdp import XlaFsdpPlugin
XlaFsdpPlugin(version=2).build(tiny, progress=False)      # a short-lived session of its own
print(json.dumps({"setups": calls, "use_spmd": len(use_spmd), "counted": process_state().runtime_setups,
                  "spmd": xr.is_spmd(), "classes": [type(trainer).__name__, type(accelerator).__name__],
                  "patched": sorted(process_state().patched)}))
"""


@XLA_DEFAULTS
def test_spmd_is_started_once_per_process_whatever_asks(tmp_path):
    """Every entry point of a launched FSDP v2 script asks for the runtime (launcher, TrainingArguments, Trainer,
    its accelerator, the script's Accelerator, a build): the engine's set-up runs once, and so does use_spmd."""
    from helpers import run_python

    res = run_python(["-c", ONCE, tmp_path / "out"], devices=4, env={r.LAUNCH_ENV: None}, timeout=600,
                     preloaded=True)
    assert res.returncode == 0, res.stderr[-3000:]
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"setups": ["the launcher"], "use_spmd": 1, "counted": 1, "spmd": True,
                   "classes": ["XlaFsdpTrainer", "XlaFsdpAccelerator"],
                   "patched": ["Accelerator.__new__", "PreTrainedModel.from_pretrained", "Trainer.__new__",
                               "TrainingArguments", "extract_model_from_parallel", "gather_object",
                                   "peft BaseTuner.__init__"]}, got
