"""Supported and tested versions: the ranges in the package agree with setup.cfg and the constraint files, an
untested combination is one warning line, and ``hf-xla-fsdp env`` reports versions and devices without crashing."""

from __future__ import annotations

import configparser
import json
import logging
import re
from pathlib import Path

import pytest

from hf_xla_fsdp import __version__, cli, upstream

ROOT = Path(__file__).resolve().parents[2]


def _pins(name: str) -> dict[str, str]:
    """``package -> version`` of a pip constraints file (names as in TESTED)."""
    pins = {}
    for line in (ROOT / "constraints" / name).read_text().splitlines():
        line = line.split("#")[0].strip()
        if line:
            package, version = line.split("==")
            pins[package] = version
    return pins


def _declared() -> dict[str, str]:
    """``package -> specifier`` of setup.cfg's install_requires and runtime extras (not the tools of ``dev``)."""
    cfg = configparser.ConfigParser()
    cfg.read(ROOT / "setup.cfg")
    lines = cfg["options"]["install_requires"].splitlines()
    lines += [line for name, extra in cfg["options.extras_require"].items()
              if name != "dev" for line in extra.splitlines()]
    found = {}
    for line in lines:
        match = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*(.*)", line.split("#")[0].strip())
        if match:
            found[match.group(1)] = match.group(2)
    return found


def test_tested_ranges_are_the_constraint_files():
    oldest, newest = _pins("oldest.txt"), _pins("tested.txt")
    for package, (low, high) in upstream.TESTED.items():
        assert (oldest[package], newest[package]) == (low, high), f"{package}: TESTED disagrees with constraints/"


def test_supported_ranges_are_setup_cfg_and_start_at_the_oldest_tested():
    declared, oldest = _declared(), _pins("oldest.txt")
    for package, spec in upstream.SUPPORTED.items():
        assert declared[package] == spec, f"{package}: upstream.SUPPORTED disagrees with setup.cfg"
    # every declared lower bound is a version the oldest combination really installs
    for package, spec in declared.items():
        low = re.search(r">=([^,]+)", spec)
        if low and package in oldest:
            assert oldest[package] == low.group(1), f"{package}: setup.cfg's lower bound is not constraints/oldest.txt"


def test_an_untested_version_is_one_warning_line_naming_package_version_and_range():
    versions = dict(upstream.installed_versions(), transformers="5.99.1", torch="2.9.0+cpu", peft=None)
    line = upstream.version_warning(versions, "0.3.0")
    assert line is not None and "\n" not in line
    low, high = upstream.TESTED["transformers"]
    assert f"transformers 5.99.1 (tested {low} to {high})" in line
    assert "torch " not in line and "peft" not in line  # a local build tag is its release; absent is not judged
    assert "private API" in line and "hf-xla-fsdp env" in line
    older = dict(versions, transformers="5.12.0", accelerate="0.34.2")
    assert "transformers 5.12.0" in upstream.version_warning(older, "0.3.0")
    assert "accelerate 0.34.2 (tested 1.8.0 to" in upstream.version_warning(older, "0.3.0")


def test_the_tested_combinations_give_no_warning():
    for name in ("oldest.txt", "tested.txt"):
        pins = _pins(name)
        assert upstream.version_warning({p: pins[p] for p in upstream.TESTED}, __version__) is None, name


def test_check_versions_logs_once(caplog, monkeypatch):
    monkeypatch.setattr(upstream, "_warned", [])
    monkeypatch.delenv(upstream.VERSION_CHECK_ENV, raising=False)
    untested = dict(upstream.installed_versions(), accelerate="9.0.0")
    with caplog.at_level(logging.WARNING, logger="hf_xla_fsdp.upstream"):
        first = upstream.check_versions(__version__, untested)
        upstream.check_versions(__version__, untested)
    assert [r.getMessage() for r in caplog.records] == [first]
    monkeypatch.setenv(upstream.VERSION_CHECK_ENV, "0")
    assert upstream.check_versions(__version__, untested) is None


def test_a_gone_api_names_it_and_the_supported_range():
    line = upstream.unsupported_message("accelerate", "1.7.0", "accelerate.accelerator:Accelerator.load_state takes "
                                        "(input_dir, load_model_func_kwargs), not (input_dir, load_kwargs, ...)")
    assert line.startswith("accelerate 1.7.0 is not supported by hf_xla_fsdp: accelerate.accelerator:")
    assert "install accelerate>=1.8.0,<2 (tested 1.8.0 to" in line and "\n" not in line


@pytest.fixture(scope="module")
def env_json() -> dict:
    """``hf-xla-fsdp env --json`` run in process (starts this process's XLA runtime, as the other unit tests do)."""
    import contextlib
    import io

    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        assert cli.main(["env", "--json"]) == 0
    return json.loads(out.getvalue())


def test_env_json_reports_versions_devices_and_the_combination(env_json):
    installed = upstream.installed_versions(cli.ENV_PACKAGES)
    for package in cli.ENV_PACKAGES:
        expected = __version__ if package == "hf_xla_fsdp" else installed[package] or "not installed"
        assert env_json["versions"][package] == expected
    # "tested" is a combination the suite ran (constraints/oldest.txt, constraints/tested.txt), not any mix inside
    assert env_json["tested_combination"] is (upstream.tested_combination(installed) is not None)
    assert env_json["in_tested_ranges"] is (upstream.version_warning(installed, __version__) is None)
    devices = env_json["devices"]
    assert "error" not in devices, devices
    import torch_xla.runtime as xr

    assert devices["device_kind"] == xr.device_type() and devices["device_count"] == xr.global_runtime_device_count()
    assert devices["process_count"] >= 1 and isinstance(devices["spmd"], bool)


def test_env_without_torch_xla_and_with_absent_packages():
    versions = dict(upstream.installed_versions(cli.ENV_PACKAGES), torch_xla=None, peft=None, trl=None)
    report = cli.collect_env(versions, cli.device_info(torch_xla_installed=False))
    assert report["versions"]["torch_xla"] == report["versions"]["peft"] == "not installed"
    assert report["devices"]["error"] == "torch_xla is not installed" and report["devices"]["device_count"] is None
    text = cli.format_env(report)
    assert "- torch_xla: not installed" in text and "device query failed: torch_xla is not installed" in text
    outside = cli.collect_env(dict(versions, transformers="4.57.0"))
    assert outside["tested_combination"] is False and outside["untested"]["transformers"].startswith("4.57.0 (tested")
    assert "devices" not in outside and "tested combination: no: transformers 4.57.0" in cli.format_env(outside)
