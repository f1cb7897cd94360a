"""The CLI read as a first-time user reads it: every flag has help text and its default, required arguments are
listed as required, every flag has its hyphen spelling, `--help` imports no torch, `plan`'s engine flag does not look
like the program's `--version`, and `env` calls "tested" only a combination the suite ran."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from hf_xla_fsdp import cli, upstream
from hf_xla_fsdp.launch import add_arguments

COMMANDS = ["plan", "consolidate", "verify", "gather", "export", "env", "launch"]


def subparsers() -> dict[str, argparse.ArgumentParser]:
    parser = cli.build_parser()
    found = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    launch = argparse.ArgumentParser(prog="hf-xla-fsdp launch", formatter_class=cli.HelpFormatter)
    add_arguments(launch)  # what `hf-xla-fsdp launch --help` shows (its own parser: the script's arguments are its)
    return {"hf-xla-fsdp": parser, **found, "launch": launch}


@pytest.mark.parametrize("name", ["hf-xla-fsdp", *COMMANDS])
def test_every_flag_has_help_and_its_default(name):
    parser = subparsers()[name]
    text = parser.format_help()
    for action in parser._actions:
        if action.help == argparse.SUPPRESS or isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        shown = parser._get_formatter()._get_help_string(action)
        assert action.help, f"{name} {action.option_strings or action.dest}: no help text"
        if action.option_strings and not action.required and not isinstance(action, argparse._VersionAction):
            assert "(default:" in shown, f"{name} {action.option_strings}: its default is not said ({shown!r})"
        hyphenless = [s for s in action.option_strings if s.startswith("--") and "_" in s]
        for spelling in hyphenless:  # --world_size has --world-size
            assert spelling.replace("_", "-") in action.option_strings, f"{name} {spelling}: no hyphen form"
    if name in ("consolidate", "gather", "export"):
        required = text.split("required arguments:")[1]
        assert "--output OUTPUT, -o OUTPUT" in required


def test_help_imports_no_torch():
    code = ("import sys\nfrom hf_xla_fsdp import cli\n"
            f"for command in {[[], *[[c] for c in COMMANDS]]!r}:\n"
            "    try:\n        cli.main([*command, '--help'])\n    except SystemExit:\n        pass\n"
            "print(sorted(m for m in ('torch', 'transformers', 'torch_xla', 'accelerate') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.strip().splitlines()[-1] == "[]"


def test_plans_engine_flag_is_not_the_programs_version(capsys):
    parser = cli.build_parser()
    assert parser.parse_args(["plan", "m", "--fsdp-version", "2"]).engine_version == 2
    assert parser.parse_args(["plan", "m", "--version", "2"]).engine_version == 2  # the old spelling still works
    assert "use --fsdp-version N" in capsys.readouterr().err
    assert "--version" not in subparsers()["plan"].format_help().replace("--fsdp-version", "")
    with pytest.raises(SystemExit):
        parser.parse_args(["--version"])
    assert capsys.readouterr().out.startswith("hf_xla_fsdp ")


def test_env_calls_tested_only_the_combinations_the_suite_ran():
    newest = {p: high for p, (low, high) in upstream.TESTED.items()}
    oldest = {p: low for p, (low, high) in upstream.TESTED.items()}
    assert cli.collect_env(newest)["tested_as"] == "constraints/tested.txt"
    assert cli.collect_env(oldest)["tested_as"] == "constraints/oldest.txt"
    assert cli.collect_env(dict(newest, peft=None))["tested_combination"]  # an extra not installed is not judged
    mixed = cli.collect_env(dict(newest, transformers=oldest["transformers"]))  # inside the ranges, never run together
    assert mixed["in_tested_ranges"] and not mixed["tested_combination"] and mixed["untested"] == {}
    assert "tested combination: no: every package is within its tested range" in cli.format_env(mixed)
    assert "tested combination: yes (constraints/tested.txt)" in cli.format_env(cli.collect_env(newest))
