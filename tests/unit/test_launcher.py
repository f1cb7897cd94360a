"""`hf-xla-fsdp launch` and the start-up hook, the parts that need no training: settings and their conflicts, the
command line, the pod check's comparison, bad input (one line, exit 2), that importing the package patches nothing,
and that the .pth hook acts only when HF_XLA_FSDP is set (and ships in the wheels)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from helpers import ROOT, USER_SCRIPTS, copy_sources, make_hook_venv, run_python

from hf_xla_fsdp import ConfigError, XlaFsdpPlugin
from hf_xla_fsdp.config.resolve import launch_sources
from hf_xla_fsdp.launch import compare_fingerprints, launch_fingerprint, split_command_line

CONFIGS = USER_SCRIPTS / "configs"


def launch_settings(argv=None, yaml=None, fsdp_config=None):
    """What the launcher resolves from the script's flags, the YAML and its own --fsdp_config (None: no settings)."""
    sources = launch_sources(argv, yaml, fsdp_config)
    return XlaFsdpPlugin.resolve(sources) if sources else None
PTH = ROOT / "hf_xla_fsdp" / "hf_xla_fsdp_hook.pth"


# --------------------------------------------------------------------------- settings
def test_settings_come_from_the_script_flags_the_yaml_and_the_launcher(tmp_path):
    assert launch_settings([], None, None) is None
    assert launch_settings(["--fsdp", "full_shard", "--fsdp_config", '{"xla": true, "xla_fsdp_v2": true}']).version == 2
    assert launch_settings([], CONFIGS / "xla_v2_minimal.yaml").version == 2
    # each source adds the settings it names
    cfg = tmp_path / "xla.json"
    cfg.write_text(json.dumps({"xla": True, "activation_checkpointing": True}))
    plugin = launch_settings(["--fsdp_config", str(cfg)], CONFIGS / "xla_minimal.yaml", '{"compute_dtype": "bfloat16"}')
    assert plugin.version == 1 and plugin.activation_checkpointing and plugin.sharding == "zero3"
    assert str(plugin.compute_dtype) == "torch.bfloat16"


def test_conflicting_settings_name_both_sources(tmp_path):
    # the script's flags say v1 (no xla_fsdp_v2), the YAML v2
    with pytest.raises(ConfigError, match=r"the script's --fsdp_config and fsdp_config in .*xla_v2_minimal.yaml "
                                          r"disagree: version=1 vs 2"):
        launch_settings(["--fsdp", "full_shard", "--fsdp_config", '{"xla": true}'], CONFIGS / "xla_v2_minimal.yaml")
    # the same setting with two values
    with pytest.raises(ConfigError, match=r"xla_minimal.yaml and the launcher's --fsdp_config disagree: "
                                          r"sharding='zero3' vs 'zero2'"):
        launch_settings([], CONFIGS / "xla_minimal.yaml", '{"sharding": "zero2"}')


def test_script_arguments_are_passed_on_untouched():
    own, script = split_command_line(["--config_file", "a.yaml", "-m", "pkg.train", "--fsdp", "full_shard",
                                      "--fsdp_config", "x.json", "--config_file", "theirs"])
    assert own == ["--config_file", "a.yaml", "-m", "pkg.train"]
    assert script == ["--fsdp", "full_shard", "--fsdp_config", "x.json", "--config_file", "theirs"]
    assert split_command_line(["--no_pod_check", "--", "-odd.py", "x"]) == (["--no_pod_check", "-odd.py"], ["x"])


# --------------------------------------------------------------------------- the pod check
def test_pod_check_names_the_host_that_differs(tmp_path):
    script, edited = tmp_path / "train.py", tmp_path / "edited.py"
    script.write_text("print('train')\n")
    edited.write_text("print('train')  # edited on one host\n")
    args = ["--fsdp", "full_shard"]
    here = launch_fingerprint(str(script), False, args, {"version": 2})
    same = dict(launch_fingerprint(str(script), False, args, {"version": 2}), host="worker-1")
    assert compare_fingerprints([here, same]) is None
    other_script = dict(launch_fingerprint(str(edited), False, args, {"version": 2}), host="worker-2")
    other_settings = dict(launch_fingerprint(str(script), False, args, {"version": 1}), host="worker-3")
    other_args = dict(launch_fingerprint(str(script), False, args + ["--bf16"], {"version": 2}), host="worker-4")
    assert other_script["script"] != here["script"] and other_settings["settings"] != here["settings"]
    problem = compare_fingerprints([here, same, other_script, other_settings])
    assert problem.startswith(f"host worker-2 does not run what host {here['host']} runs: it differs in script;")
    assert "\n" not in problem
    assert "differs in settings;" in compare_fingerprints([here, other_settings])
    assert "differs in arguments;" in compare_fingerprints([here, other_args])
    # a package at another version (as another host's pip would report it)
    older = dict(here, host="worker-5", versions={**here["versions"], "transformers": "5.22.0"})
    assert f"transformers 5.22.0 vs {here['versions']['transformers']}" in compare_fingerprints([here, older])


# --------------------------------------------------------------------------- bad input: one line, exit 2
TOUCHES_DEVICE_FIRST = """
import torch_xla
torch_xla.device()  # the XLA device is taken in replica mode, before any setting asks for SPMD
from transformers import TrainingArguments
TrainingArguments(output_dir="{out}", fsdp="full_shard", fsdp_config={{"xla": True, "xla_fsdp_v2": True}})
print("not reached")
"""


def _bad(tmp_path, case):
    trainer = str(USER_SCRIPTS / "trainer_outputs.py")
    if case == "missing script":
        return ["no_such_train.py"], "script no_such_train.py does not exist"
    if case == "missing module":
        return ["-m", "no_such_pkg.train"], "no module named 'no_such_pkg.train'"
    if case == "missing yaml":
        return ["--config_file", "nope.yaml", trainer], "accelerate config file nope.yaml does not exist"
    if case == "flags vs yaml":
        return (["--config_file", str(CONFIGS / "xla_v2_minimal.yaml"), trainer, "--fsdp", "full_shard",
                 "--fsdp_config", '{"xla": true}'], "disagree: version=1 vs 2")
    if case == "v2 with processes":
        return (["--num_processes", "4", trainer, "--fsdp_config", '{"xla": true, "xla_fsdp_v2": true}'],
                "FSDP v2 (SPMD) drives every device of a host from one process")
    script = tmp_path / "touches_device.py"
    script.write_text(TOUCHES_DEVICE_FIRST.format(out=tmp_path / "out"))
    if case == "v2 in code, in a spawned v1 process":  # xmp.spawn's process took the device in replica mode
        # (with the launcher's own --fsdp_config saying v1 this is a conflict of two settings sources, refused before
        # the device is touched: tests/unit/test_resolve.py)
        return (["--num_processes", "1", str(script)], "FSDP v2 needs SPMD before the XLA device is first used")
    return [str(script)], "FSDP v2 needs SPMD before the XLA device is first used"


@pytest.mark.parametrize("case", ["missing script", "missing module", "missing yaml", "flags vs yaml",
                                  "v2 with processes", "v2 after the device was used",
                                  "v2 in code, in a spawned v1 process"])
def test_bad_input_is_one_line_and_exit_2(tmp_path, case):
    args, expected = _bad(tmp_path, case)
    res = run_python(["-m", "hf_xla_fsdp.cli", "launch", *args], devices=2, cwd=tmp_path, timeout=300)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 2, res.stdout[-2000:] + res.stderr[-3000:]
    assert "Traceback" not in res.stderr and "not reached" not in res.stdout, res.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith("hf-xla-fsdp launch: error: ") and expected in lines[0], lines
    assert not (tmp_path / "out").exists()


# --------------------------------------------------------------------------- nothing happens without a launch
SNAPSHOT = """
import sys
import accelerate, transformers, transformers.trainer
from accelerate.utils import operations

def snapshot():
    import transformers.training_args as ta
    return {"Trainer": (transformers.Trainer, dict(transformers.Trainer.__dict__)),
            "TrainingArguments": (transformers.TrainingArguments, ta.TrainingArguments.__dict__["_setup_devices"]),
            "Accelerator": (accelerate.Accelerator, dict(accelerate.Accelerator.__dict__)),
            "gather_object": operations.gather_object.__code__, "meta_path": list(sys.meta_path)}

before = snapshot()
{imports}
after = snapshot()
print("changed:", sorted(k for k in before if before[k] != after[k]))
"""


@pytest.mark.parametrize("imports,changed", [
    # the package, its launcher, the launched-script machinery and the import hooks: importing them patches nothing
    ("import hf_xla_fsdp, hf_xla_fsdp.launch, hf_xla_fsdp.integrations.launched, hf_xla_fsdp.importhooks\n"
     "hf_xla_fsdp.XlaFsdpPlugin(); hf_xla_fsdp.XlaFsdpAccelerator", []),
    # the one-line swap still starts its effects on import (what the snapshot would see if the package did)
    ("import hf_xla_fsdp\nhf_xla_fsdp.XlaFsdpTrainer", ["TrainingArguments"]),
])
def test_importing_the_package_changes_no_upstream_class(imports, changed):
    res = run_python(["-c", SNAPSHOT.replace("{imports}", imports)], env={"HF_XLA_FSDP": None}, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    assert res.stdout.strip().splitlines()[-1] == f"changed: {changed}", res.stdout[-2000:]


@pytest.fixture(scope="module")
def hook_python(tmp_path_factory) -> Path:
    """A Python with the start-up hook installed as pip installs it: a venv whose site-packages holds this
    environment's (a .pth adding them) and hf_xla_fsdp_hook.pth."""
    return make_hook_venv(tmp_path_factory.mktemp("hook-venv"))


HOOK_PROBE = """
import sys
at_start = sorted(m for m in ("torch", "hf_xla_fsdp", "transformers") if m in sys.modules)
finders = [type(f).__module__ for f in sys.meta_path if type(f).__module__ == "hf_xla_fsdp.importhooks"]
import accelerate, transformers.trainer
print({"at_start": at_start, "finders": len(finders),
       "Trainer": "__new__" in transformers.Trainer.__dict__, "Accelerator": "__new__" in accelerate.Accelerator.__dict__,
       "TrainingArguments": getattr(transformers.TrainingArguments.__dict__["_setup_devices"].func, "_hf_xla_fsdp", False)})
"""


@pytest.mark.parametrize("opt_in", [None, "1"])
def test_start_up_hook_acts_only_when_opted_in(hook_python, opt_in):
    res = subprocess.run([str(hook_python), "-c", HOOK_PROBE], capture_output=True, text=True, timeout=300,
                         env={**{k: v for k, v in os.environ.items() if k != "HF_XLA_FSDP"}, "PJRT_DEVICE": "CPU",
                              "PYTHONPATH": str(ROOT), **({"HF_XLA_FSDP": opt_in} if opt_in else {})})
    assert res.returncode == 0, res.stderr[-3000:]
    got = eval(res.stdout.strip().splitlines()[-1])  # noqa: S307 - our own probe's dict
    # nothing imported at interpreter start either way: the hook only watches for the upstream modules
    assert got["at_start"] == []
    assert got == {"at_start": [], "finders": 1 if opt_in else 0, "Trainer": bool(opt_in),
                   "Accelerator": bool(opt_in), "TrainingArguments": bool(opt_in)}


def test_wheels_ship_the_start_up_hook(tmp_path):
    """`pip install` (wheel) and `pip install -e` (PEP 660 editable wheel) both put the .pth in site-packages."""
    import zipfile

    src = tmp_path / "src"
    copy_sources(src)
    dist = tmp_path / "dist"
    build = textwrap.dedent(f"""
        from setuptools import build_meta
        build_meta.build_wheel({str(dist)!r})
        build_meta.build_editable({str(dist)!r})
    """)
    dist.mkdir()
    res = subprocess.run([sys.executable, "-c", build], cwd=src, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    wheels = sorted(dist.glob("*.whl"))
    assert len(wheels) == 2 and any(".editable-" in w.name for w in wheels), wheels
    for path in wheels:
        with zipfile.ZipFile(path) as wheel:
            assert wheel.read(PTH.name).decode() == PTH.read_text(), path.name  # at the root: site-packages
