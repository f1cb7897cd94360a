"""Every bad input of `hf-xla-fsdp consolidate`: one clear line, exit code 2, nothing written."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import build_ranks, save_ranks, save_torch_xla_style, tiny_llama

from hf_xla_fsdp.checkpoint.schema import marker_bytes
from hf_xla_fsdp.cli import main

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


@pytest.fixture(scope="module")
def models():
    return build_ranks(tiny_llama(), 3)


@pytest.fixture
def ckpt(tmp_path, models):
    return save_ranks(tmp_path / "ckpt", models, step=1)


def run_cli(capsys, *args):
    rc = main(["consolidate", *map(str, args), "--quiet"])
    err = capsys.readouterr().err.strip()
    return rc, err


def assert_refused(capsys, tmp_path, needle, *args, output=None):
    output = output or tmp_path / "out"
    before = sorted(p.name for p in tmp_path.iterdir())
    rc, err = run_cli(capsys, *args, "--output", output)
    assert rc == 2
    assert len(err.splitlines()) == 1 and needle in err, err
    assert err.startswith("hf-xla-fsdp consolidate: error: ")
    if output == tmp_path / "out":
        assert not output.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == before  # no staging leftovers either


def test_missing_rank_file(capsys, tmp_path, ckpt):
    (ckpt / "rank-00001-of-00003.safetensors").unlink()
    assert_refused(capsys, tmp_path, "rank file", ckpt)
    prefix = tmp_path / "xla"
    paths = save_torch_xla_style(str(prefix), build_ranks(tiny_llama(), 3))
    paths[1].unlink()
    assert_refused(capsys, tmp_path, "missing rank file(s) for rank(s) [1] of 3", prefix, "--ckpt-suffix",
                   "_rank-*.pth", "--config", ckpt)


def test_duplicate_rank(capsys, tmp_path, models, ckpt):
    prefix = tmp_path / "xla"
    paths = save_torch_xla_style(str(prefix), models)
    shutil.copy(paths[0], f"{prefix}_rank-00000000-of-00000003.copy.pth")
    assert_refused(capsys, tmp_path, "duplicate rank 0", prefix, "--config", ckpt)


def test_world_size_mismatch_between_files(capsys, tmp_path, models, ckpt):
    prefix = tmp_path / "xla"
    save_torch_xla_style(str(prefix), models)
    other = save_torch_xla_style(str(tmp_path / "other"), build_ranks(tiny_llama(), 2))
    shutil.copy(other[1], f"{prefix}_rank-00000001-of-00000002.pth")
    assert_refused(capsys, tmp_path, "world-size mismatch", prefix, "--config", ckpt)


def test_files_from_two_different_runs(capsys, tmp_path, ckpt):
    other = save_ranks(tmp_path / "other", build_ranks(tiny_llama(), 3, seed=9), step=1)
    for ext in ("safetensors", "json"):
        shutil.copy(other / f"rank-00002-of-00003.{ext}", ckpt / f"rank-00002-of-00003.{ext}")
    assert_refused(capsys, tmp_path, "does not belong to this checkpoint", ckpt)
    # torch_xla files of differently-configured runs
    prefix = tmp_path / "xla"
    save_torch_xla_style(str(prefix), build_ranks(tiny_llama(), 2))
    flat = save_torch_xla_style(str(tmp_path / "flat"), build_ranks(tiny_llama(), 2, flatten_parameters=True))
    shutil.copy(flat[1], f"{prefix}_rank-00000001-of-00000002.pth")
    assert_refused(capsys, tmp_path, "come from different runs", prefix, "--config", ckpt)


def test_truncated_or_corrupted_file(capsys, tmp_path, ckpt, models):
    path = ckpt / "rank-00001-of-00003.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    assert_refused(capsys, tmp_path, "truncated or corrupted", ckpt)
    path.write_bytes(b"\x00" * len(data))  # same size, garbage header
    assert_refused(capsys, tmp_path, "truncated or corrupted", ckpt)
    prefix = tmp_path / "xla"
    paths = save_torch_xla_style(str(prefix), models)
    paths[2].write_bytes(paths[2].read_bytes()[:1000])
    assert_refused(capsys, tmp_path, "truncated, corrupted or not a safe torch file", prefix, "--config", ckpt)


def test_non_fsdp_files(capsys, tmp_path, ckpt):
    plain = tmp_path / "plain"
    plain.mkdir()
    torch.save({"weight": torch.ones(2)}, plain / "model_rank-0.pth")
    assert_refused(capsys, tmp_path, "is not an FSDP rank checkpoint", plain / "model", "--config", ckpt)
    hf_dir = tmp_path / "hf"
    build_ranks(tiny_llama(), 1)  # any model directory without rank files
    tiny_llama().save_pretrained(hf_dir)
    assert_refused(capsys, tmp_path, "holds no FSDP rank files", hf_dir)


def test_pickle_that_is_not_weights_only_is_refused(capsys, tmp_path, ckpt):
    prefix = tmp_path / "evil"
    torch.save({"model": {}, "shard_metadata": {"rank": 0}, "payload": Path("/etc/passwd")}, f"{prefix}_rank-0.pth")
    assert_refused(capsys, tmp_path, "not a safe torch file", prefix, "--config", ckpt)


def test_wrong_config(capsys, tmp_path, ckpt):
    wrong = tmp_path / "wrong"
    tiny_llama(hidden_size=32, intermediate_size=64).save_pretrained(wrong)
    assert_refused(capsys, tmp_path, "the config does not match the checkpoint", ckpt, "--config", wrong)
    assert_refused(capsys, tmp_path, "--config", ckpt, "--config", tmp_path / "nope.json")
    prefix = tmp_path / "xla"
    save_torch_xla_style(str(prefix), build_ranks(tiny_llama(), 1))
    assert_refused(capsys, tmp_path, "carry no model config; pass --config", prefix)


def test_existing_output_is_refused_unless_overwrite(capsys, tmp_path, ckpt):
    out = tmp_path / "existing"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"precious")
    assert_refused(capsys, tmp_path, "already exists and is not empty; pass --overwrite", ckpt, output=out)
    assert (out / "model.safetensors").read_bytes() == b"precious"
    rc, _ = run_cli(capsys, ckpt, "--output", out, "--overwrite")
    assert rc == 0 and (out / "config.json").is_file()
    assert (out / "model.safetensors").read_bytes() != b"precious"
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging or old copies left


def test_path_traversal_in_marker_is_refused(capsys, tmp_path, ckpt):
    marker = json.loads((ckpt / "checkpoint_complete.json").read_text())
    marker["files"]["../../etc/passwd"] = marker["files"].pop("rank-00002-of-00003.safetensors")
    (ckpt / "checkpoint_complete.json").write_text(json.dumps(marker))
    assert_refused(capsys, tmp_path, "does not match its own SHA-256", ckpt)
    (ckpt / "checkpoint_complete.json").write_bytes(marker_bytes(marker))  # sealed again: the name itself is refused
    assert_refused(capsys, tmp_path, "only plain file names inside the checkpoint are allowed", ckpt)


def test_incomplete_checkpoint_is_refused(capsys, tmp_path, ckpt):
    (ckpt / "checkpoint_complete.json").unlink()
    assert_refused(capsys, tmp_path, "is incomplete (no checkpoint_complete.json)", ckpt)


def test_bad_dtype_and_shard_size(capsys, tmp_path, ckpt):
    with pytest.raises(SystemExit) as err:
        main(["consolidate", str(ckpt), "--output", str(tmp_path / "out"), "--dtype", "int8"])
    assert err.value.code == 2 and not (tmp_path / "out").exists()
    capsys.readouterr()
    # huggingface_hub's size parser words it (its "Unit 'TS'" is the last two letters of the value); the line names
    # the bad value and the units that work
    assert_refused(capsys, tmp_path, "Supported units are TB, GB, MB, KB. Got 'lots'", ckpt, "--max-shard-size", "lots")


def test_console_script_exit_code(tmp_path, ckpt):
    # the installed entry point started as a shell starts it (its shebang), not through run_python
    exe = Path(sys.executable).parent / "hf-xla-fsdp"
    res = subprocess.run([str(exe), "consolidate", str(tmp_path / "nowhere"), "-o", str(tmp_path / "out")],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and "no rank files match" in res.stderr
    res = subprocess.run([str(exe), "consolidate", str(ckpt), "-o", str(tmp_path / "out"), "--dtype", "bfloat16"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["files"] == ["model.safetensors"]
