"""Each engine owns its facts: a new engine is a class in engines/ and an entry in ``ENGINES``, and the settings, the
CLI, the settings table, checkpoints and model cards know it from its declarations alone (tests/scripts/toy_engine.py
adds one). The older spellings of the engines (``engine: xla`` + ``version``, transformers' ``xla_fsdp_v2``) select
what they always selected."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys

import pytest
from helpers import ROOT, SCRIPTS, fsdp2_env, tiny_llama

from hf_xla_fsdp import XlaFsdpPlugin
from hf_xla_fsdp.errors import ConfigError


def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def toy(monkeypatch):
    """The toy engine registered for one test (removed after it)."""
    from hf_xla_fsdp.engines import ENGINES

    module = _load(SCRIPTS / "toy_engine.py", "toy_engine")
    monkeypatch.setitem(ENGINES, "toy", module.ToyEngine())
    return ENGINES["toy"]


def test_a_new_engine_is_known_to_the_settings_cli_and_table_from_its_declarations(toy, tmp_path, capsys):
    from hf_xla_fsdp import cli

    # the settings: key and alias select it, what it does not honour is refused naming who does, launchers are its own
    assert XlaFsdpPlugin(engine="toy").engine == XlaFsdpPlugin(engine="TOY_FSDP").engine == "toy"
    with pytest.raises(ConfigError, match="^compile applies to engine=fsdp2 only; remove it for engine=toy$"):
        XlaFsdpPlugin(engine="toy", compile=True)
    assert XlaFsdpPlugin(engine="toy", replica_size=2).replica_size == 2
    with pytest.raises(ConfigError, match="distributed_type='FSDP' in x.yaml: the toy engine runs"):
        XlaFsdpPlugin(engine="toy").check_launcher("FSDP", "x.yaml")
    with pytest.raises(ConfigError, match=r"allowed values: .*'fsdp2' \(FSDP2 .*\), 'toy' \(Toy engine"):
        XlaFsdpPlugin(engine="toys")
    # the CLI: `plan --engine` takes it, a wrong value is refused with it among the allowed ones
    tiny_llama().save_pretrained(tmp_path / "model")
    assert cli.main(["plan", str(tmp_path / "model"), "--engine", "toy", "--world-size", "2"]) == 0
    assert json.loads(capsys.readouterr().out)["engine"] == "toy"
    assert cli.main(["plan", str(tmp_path / "model"), "--engine", "toys"]) == 2
    err = capsys.readouterr().err
    assert "engine='toys' is not valid" in err and "'toy' (Toy engine" in err and err.count("\n") == 1
    # the settings table of docs/trainer.md: its row, and the engines column of every setting
    table = _load(ROOT / "docs" / "settings_table.py", "settings_table").table()
    assert "| `toy` | Toy engine (fully_shard under new declarations) | `engine: toy_fsdp` | `MULTI_CPU`, `NO` |" in table
    assert "| `meta_init` | `true` | xla_v1, xla_v2, fsdp2, toy |" in table
    assert "| `compile` | `false` | fsdp2 |" in table and "| `replica_size` | `1` | xla_v2, fsdp2, toy |" in table


def test_a_new_engine_writes_checkpoints_that_name_it_in_the_model_card(tmp_path):
    """One process of engine fsdp2's code under the toy declarations (~5 s): the rank files record the engine, verify
    passes, and the consolidated model's card names it."""
    res = subprocess.run([sys.executable, str(SCRIPTS / "toy_engine.py"), str(tmp_path)], cwd=ROOT,
                         env=fsdp2_env(), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    assert out["engine"] == out["wrapped_by"] == "toy"
    assert out["meta"]["engine"] == "toy_engine" and out["meta"]["engine_title"].startswith("Toy engine")
    assert "| engine | Toy engine (fully_shard under new declarations) |" in out["card"]
    from hf_xla_fsdp import cli

    assert cli.main(["verify", str(tmp_path / "ckpt")]) == 0  # the validator takes what the writer wrote


@pytest.mark.parametrize("settings,key,version", [
    ({}, None, 1),  # the default: the first installed engine
    ({"engine": "xla"}, "xla_v1", 1),
    ({"engine": "xla", "version": 2}, "xla_v2", 2),
    ({"version": 2}, "xla_v2", 2),
    ({"xla": True, "xla_fsdp_v2": True}, "xla_v2", 2),  # transformers' own keys
    ({"engine": "xla_v2"}, "xla_v2", 2),
    ({"engine": "xla_fsdp_v2"}, "xla_v2", 2),  # the name training records carry
    ({"engine": "fsdp2"}, "fsdp2", 1),
    ({"fsdp_version": 2}, "fsdp2", 1),  # accelerate's FSDP2 YAML key
    ({"xla": True, "xla_fsdp_v2": True, "fsdp_version": 2}, "xla_v2", 2),
])
def test_older_spellings_select_what_they_always_did(settings, key, version):
    from hf_xla_fsdp.config.engines import default_engine

    plugin = XlaFsdpPlugin.from_fsdp_config(settings)
    assert (plugin.engine, plugin.version) == (key or default_engine().key, version)
    assert XlaFsdpPlugin.from_dict(plugin.to_dict()) == plugin  # what checkpoints record reads back the same


@pytest.mark.parametrize("settings,needle", [
    ({"engine": "xla_v1", "version": 2}, "version=2 selects engine=xla_v2, not engine=xla_v1; remove version"),
    ({"engine": "xla", "version": 3}, "engine=xla, version=3 name no engine; allowed versions with engine=xla: "
                                      "1 (engine=xla_v1), 2 (engine=xla_v2)"),
    ({"engine": "fsdp2", "version": 2}, "version applies to engine=xla_v1 or engine=xla_v2 only"),
])
def test_spellings_that_name_two_engines_are_refused_in_one_line(settings, needle):
    with pytest.raises(ConfigError) as err:
        XlaFsdpPlugin.from_fsdp_config(settings)
    assert needle in str(err.value) and "\n" not in str(err.value)
