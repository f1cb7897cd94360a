"""Per-tensor checksums: a flipped byte in a tensor's payload is caught by consolidation, resume, resharding and
`hf-xla-fsdp verify`, naming the file and the tensor; checkpoints saved without checksums still load."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import torch
from helpers import build_ranks, fake_adam_state, save_ranks, tiny_llama
from helpers import consolidate as xla_consolidate

from hf_xla_fsdp.checkpoint import COMPLETE_MARKER, load_checkpoint
from hf_xla_fsdp.checkpoint.consolidate import consolidate, read_full_state_dict
from hf_xla_fsdp.checkpoint.safetensors_io import SafetensorsReader
from hf_xla_fsdp.cli import main
from hf_xla_fsdp.errors import CheckpointError

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

WORLD = 3
VICTIM = "rank-00001-of-00003.safetensors"


@pytest.fixture(scope="module")
def ranks():
    models = build_ranks(tiny_llama(), WORLD)
    return models, fake_adam_state(models)


@pytest.fixture
def ckpt(tmp_path, ranks):
    models, opts = ranks
    return save_ranks(tmp_path / "ckpt", models, opts, step=4)


def model_tensor(path: Path) -> str:
    """A sharded weight of rank 1 that holds real values (a decoder layer's MLP, not the file's first tensor)."""
    names = [n for n in SafetensorsReader(path).entries if n.startswith("model/") and "layers.1." in n and "gate_proj" in n]
    return sorted(names)[0]


def flip(path: Path, name: str, where: str = "middle") -> None:
    """Flip the bits of one byte inside tensor ``name``'s payload (the header is untouched)."""
    _, _, begin, end = SafetensorsReader(path).entries[name]
    pos = {"middle": (begin + end) // 2, "last": end - 1}[where]
    with open(path, "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)[0]
        fh.seek(pos)
        fh.write(bytes([byte ^ 0xFF]))


def one_line_naming(err: str, name: str) -> None:
    assert len(err.splitlines()) == 1, err
    assert VICTIM in err and name in err and "earlier checkpoint" in err, err


def test_checksums_recorded_and_verify_passes(ckpt, capsys):
    meta = json.loads((ckpt / "rank-00000-of-00003.json").read_text())
    sums = meta["checksums"]
    assert sums["algorithm"] in ("crc32c", "crc32")
    assert set(sums["tensors"]) == set(SafetensorsReader(ckpt / "rank-00000-of-00003.safetensors").entries)
    marker = json.loads((ckpt / COMPLETE_MARKER).read_text())
    assert all(len(entry["checksums"]) == 64 for entry in marker["files"].values())
    assert main(["verify", str(ckpt)]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["ok"] and summary["files"] == summary["checksummed_files"] == WORLD
    assert summary["bytes"] == sum(r.nbytes(n) for p in ckpt.glob("rank-*.safetensors")
                                   for r in [SafetensorsReader(p)] for n in r.entries)


@pytest.mark.parametrize("where", ["middle", "last"])
def test_flipped_byte_fails_consolidation(tmp_path, ckpt, where):
    name = model_tensor(ckpt / VICTIM)
    flip(ckpt / VICTIM, name, where)
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt, tmp_path / "out", progress=False)
    one_line_naming(str(err.value), name)
    assert not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no staging left behind


def test_flipped_byte_in_shard_padding_is_caught_too(tmp_path, ckpt):
    # rank 2's shard of a 64-element norm weight is all padding: consolidation reads none of it, and still checks it
    path = ckpt / "rank-00002-of-00003.safetensors"
    reader = SafetensorsReader(path)
    name = next(n for n in sorted(reader.entries) if n.startswith("model/") and "input_layernorm" in n)
    flip(path, name, "last")
    with pytest.raises(CheckpointError, match=f"rank-00002-of-00003.safetensors: tensor {name} fails"):
        read_full_state_dict(ckpt)


def test_flipped_byte_fails_resume_and_resharding(ckpt, ranks):
    name = model_tensor(ckpt / VICTIM)
    flip(ckpt / VICTIM, name)
    same = build_ranks(tiny_llama(), WORLD, seed=5)[1]
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ckpt, same, torch.optim.AdamW(same.parameters()))
    one_line_naming(str(err.value), name)
    for model in build_ranks(tiny_llama(), 2, seed=5):  # resharding 3 -> 2: every new rank reads part of rank 1
        before = {k: v.cpu().clone() for k, v in model.state_dict().items()}
        with pytest.raises(CheckpointError) as err:
            load_checkpoint(ckpt, model)
        one_line_naming(str(err.value), name)
        after = model.state_dict()
        assert all(torch.equal(before[k], after[k].cpu()) for k in before)  # nothing was loaded


def test_flipped_optimizer_byte_fails_resume(ckpt):
    path = ckpt / VICTIM
    name = next(n for n in sorted(SafetensorsReader(path).entries) if n.endswith("/exp_avg_sq"))
    flip(path, name)
    model = build_ranks(tiny_llama(), WORLD, seed=5)[1]
    with pytest.raises(CheckpointError) as err:
        load_checkpoint(ckpt, model, torch.optim.AdamW(model.parameters()))
    one_line_naming(str(err.value), name)


def test_verify_command_names_the_tensor(ckpt, capsys):
    name = model_tensor(ckpt / VICTIM)
    flip(ckpt / VICTIM, name)
    assert main(["verify", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("hf-xla-fsdp verify: error: ")
    one_line_naming(err, name)


def test_damaged_checksum_table_is_caught(ckpt, capsys):
    meta_path = ckpt / "rank-00001-of-00003.json"
    meta = json.loads(meta_path.read_text())
    name = sorted(meta["checksums"]["tensors"])[0]
    meta["checksums"]["tensors"][name] = "00000000"
    meta_path.write_text(json.dumps(meta))
    assert main(["verify", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()  # the JSON's own SHA-256 in the marker catches it first
    assert "rank-00001-of-00003.json is corrupted: its SHA-256 differs" in err and len(err.splitlines()) == 1
    marker = json.loads((ckpt / COMPLETE_MARKER).read_text())  # a marker with only the checksum tables' digests
    del marker["self_sha256"]
    for entry in marker["files"].values():
        del entry["meta_sha256"]
    (ckpt / COMPLETE_MARKER).write_text(json.dumps(marker))
    assert main(["verify", str(ckpt)]) == 2
    err = capsys.readouterr().err.strip()
    assert "rank-00001-of-00003.json is corrupted: its checksum table differs" in err and len(err.splitlines()) == 1


def test_checkpoint_without_checksums_loads_with_one_note(tmp_path, ckpt, ranks, caplog):
    for meta_path in ckpt.glob("rank-*.json"):  # as an earlier version wrote them
        meta = json.loads(meta_path.read_text())
        del meta["checksums"], meta["header_sha256"]
        meta_path.write_text(json.dumps(meta))
    marker = json.loads((ckpt / COMPLETE_MARKER).read_text())
    del marker["self_sha256"]
    for entry in marker["files"].values():
        del entry["checksums"], entry["meta_sha256"]
    (ckpt / COMPLETE_MARKER).write_text(json.dumps(marker))
    models, _ = ranks
    with caplog.at_level(logging.WARNING, logger="hf_xla_fsdp"):
        consolidate(ckpt, tmp_path / "out", progress=False)
        new = build_ranks(tiny_llama(), 2, seed=9)
        for model in new:
            load_checkpoint(ckpt, model)
    notes = [r for r in caplog.records if "without checksums" in r.getMessage()]
    assert len(notes) == 1, [r.getMessage() for r in notes]
    expected = xla_consolidate(models)
    got = xla_consolidate(new)
    assert all(torch.equal(got[k], expected[k]) for k in expected)
    assert main(["verify", str(ckpt)]) == 0
