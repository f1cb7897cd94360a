"""The metadata schema and digests in isolation: FSDP v2 pieces, the sealed marker, the side files a save records."""

from __future__ import annotations

import json

import pytest
from helpers import build_rank, tiny_llama

from hf_xla_fsdp.checkpoint import COMPLETE_MARKER, save_checkpoint
from hf_xla_fsdp.checkpoint.layout import check_side_files, read_marker
from hf_xla_fsdp.checkpoint.schema import check_like, marker_bytes, validate_marker, validate_pieces
from hf_xla_fsdp.errors import CheckpointError


def pieces(*boxes, shape=(4, 6), dtype="float32"):
    return {"model/w": {"shape": list(shape), "dtype": dtype,
                        "pieces": [{"key": f"model/w#{i}", "start": list(a), "stop": list(b)}
                                   for i, (a, b) in enumerate(boxes)]}}


@pytest.mark.parametrize("tensors,needle", [
    (pieces(((0, 0), (2, 6)), ((1, 0), (4, 6))), "pieces[1] overlaps piece 0"),
    (pieces(((0, 0), (2, 7))), "outside the tensor's shape [4, 6]"),
    (pieces(((0,), (2,))), "has 1/1 start/stop offsets for a tensor of 2 dimensions"),
    (pieces(((0, 0), (4, 6)), dtype="float31"), "dtype is 'float31', not one of"),
    (pieces(((2, 0), (1, 6))), "spans [2, 0]:[1, 6]"),
    ({"model/w": {"shape": [4, 6], "dtype": "float32", "pieceZ": []}}, "has an entry 'pieceZ' where 'pieces' belongs"),
])
def test_pieces_are_checked(tensors, needle):
    validate_pieces(pieces(((0, 0), (2, 6)), ((2, 0), (4, 6))), "r.json")  # a valid split passes
    with pytest.raises(CheckpointError) as err:
        validate_pieces(tensors, "rank-00000-of-00002.json")
    assert needle in str(err.value) and "rank-00000-of-00002.json is corrupted" in str(err.value), str(err.value)


def test_sealed_marker_detects_any_content_change():
    marker = {"format": "hf_xla_fsdp.rank/1", "world_size": 1, "step": 5,
              "files": {"rank-00000-of-00001.safetensors": {"file_id": "a" * 32, "bytes": 10}}}
    sealed = json.loads(marker_bytes(marker))
    assert validate_marker(sealed, "m.json")["step"] == 5
    sealed["step"] = 6
    with pytest.raises(CheckpointError, match=r"m.json is corrupted: its content does not match its own SHA-256"):
        validate_marker(sealed, "m.json")
    validate_marker(marker, "m.json")  # an earlier version's marker, without the digest: the schema alone


def test_check_like_names_the_entry():
    live = {"last_epoch": 3, "base_lrs": [0.1, 0.2], "flag": True}
    check_like({"last_epoch": 4, "base_lrs": [1, 2], "flag": False, "new": 1}, live, "scheduler", "r.json", "scheduler")
    for saved, needle in [({"base_lrs": [0.1, 0.2], "flag": True}, "lacks the entry 'last_epoch'"),
                          ({"last_epoch": "3", "base_lrs": [0.1, 0.2], "flag": True}, "['last_epoch'] must be a number"),
                          ({"last_epoch": 3, "base_lrs": [0.1], "flag": True}, "['base_lrs'] must have 2 entries"),
                          ({"last_epoch": 3, "base_lrs": [0.1, 0.2], "flag": 1}, "['flag'] must be true or false")]:
        with pytest.raises(CheckpointError) as err:
            check_like(saved, live, "scheduler", "r.json", "scheduler")
        assert needle in str(err.value) and "r.json does not fit this scheduler" in str(err.value), str(err.value)


@pytest.mark.xla
def test_a_save_records_its_side_files(tmp_path):
    """The save path (rank 0's ``before_commit`` adds side files) seals their SHA-256 into the marker."""
    model = build_rank(tiny_llama(num_hidden_layers=1, hidden_size=32, intermediate_size=64), 1, 0)

    def side(stage):
        (stage / "tokenizer_config.json").write_text("{}")
        (stage / "config.json").write_text("{}")

    ckpt = save_checkpoint(tmp_path / "ckpt", model, before_commit=side)
    marker = read_marker(ckpt)
    assert sorted(marker["side_files"]) == ["config.json", "tokenizer_config.json"]
    assert json.loads((ckpt / COMPLETE_MARKER).read_text())["self_sha256"]
    check_side_files(ckpt, marker)
    (ckpt / "tokenizer_config.json").write_text("{ }")
    with pytest.raises(CheckpointError, match="tokenizer_config.json is corrupted: its SHA-256 differs"):
        check_side_files(ckpt, marker)


def test_a_directory_without_a_marker_is_named_for_what_it_holds(tmp_path):
    """Every reader of our checkpoints (Trainer resume, accelerate's load_state, load_checkpoint) reads the marker
    first: what the directory holds instead decides the one line it gets."""
    cases = {"rank-00000-of-00002.safetensors": "is incomplete (no checkpoint_complete.json): its save did not finish",
             "rank0-of-2-pytorch_model.bin": "was written by transformers' own XLA FSDP path, which hf_xla_fsdp cannot "
                                             "resume; consolidate it with `hf-xla-fsdp consolidate`",
             "notes.txt": "is not an hf_xla_fsdp checkpoint (no checkpoint_complete.json)"}
    for name, needle in cases.items():
        directory = tmp_path / name.split(".")[0]
        directory.mkdir()
        (directory / name).write_bytes(b"")
        with pytest.raises(CheckpointError) as err:
            read_marker(directory)
        assert str(err.value).startswith(f"{directory} {needle}") and "\n" not in str(err.value), err.value
