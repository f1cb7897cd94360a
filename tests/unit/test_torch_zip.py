"""torch_xla ``.pth`` and Trainer ``.bin`` rank files read without torch.load: bit-exact, safe, one-line errors."""

from __future__ import annotations

import os
import zipfile
from pathlib import Path

import pytest
import torch
from helpers import build_ranks, fake_adam_state, save_torch_xla_style, save_trainer_style, tiny_llama
from helpers import consolidate as xla_consolidate
from safetensors.torch import load_file

from hf_xla_fsdp.checkpoint.readers import TorchRankFile
from hf_xla_fsdp.checkpoint.torch_zip import TorchZipArchive, UnsafePickle
from hf_xla_fsdp.cli import main
from hf_xla_fsdp.errors import CheckpointError

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


@pytest.fixture(scope="module")
def models():
    return build_ranks(tiny_llama(), 3)


def _cli_error(capsys, *args) -> str:
    rc = main(["consolidate", *map(str, args), "--quiet"])
    err = capsys.readouterr().err.strip()
    assert rc == 2, err
    assert len(err.splitlines()) == 1, err
    return err


def test_every_tensor_matches_torch_load_bit_for_bit(tmp_path, models):
    optimizers = fake_adam_state(models)
    paths = save_torch_xla_style(str(tmp_path / "xla"), models, optimizers)
    for path in paths:
        ref = torch.load(path, map_location="cpu", weights_only=True)
        f = TorchRankFile(path)
        assert f.shard_metadata == ref["shard_metadata"] and f.meta["optimizer"]["param_groups"] == \
            ref["optimizer"]["param_groups"]
        expected = {f"model/{k}": v for k, v in ref["model"].items()}
        expected.update({f"optim/{i}/{k}": v for i, s in ref["optimizer"]["state"].items() for k, v in s.items()
                         if isinstance(v, torch.Tensor)})
        assert f.names() == list(expected)
        for name, value in expected.items():
            got = f.get(name)
            assert got.dtype == value.dtype and got.shape == value.shape and torch.equal(got, value), name
            assert f.shape(name) == tuple(value.shape) and f.dtype(name) == value.dtype
            if value.dim() and value.shape[0] > 2:
                assert torch.equal(f.get_rows(name, 1, value.shape[0] - 1), value[1:-1]), name
                out = torch.full_like(value[:2], 7)
                f.read_rows_into(name, 0, 2, out)
                assert torch.equal(out, value[:2])


def test_views_shared_storages_and_dtypes(tmp_path):
    base = torch.arange(60, dtype=torch.float32).reshape(6, 10)
    obj = {
        "view": base[2:5],                      # a view into a larger storage (non-zero offset)
        "transposed": base.t(),                  # a strided view
        "column": base[:, 3],
        "shared": base,                          # the same storage again
        "bf16": torch.randn(4, 3).to(torch.bfloat16),
        "half": torch.randn(5).half(),
        "int64": torch.arange(7),
        "bool": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.empty(0, 4),
        "param": torch.nn.Parameter(torch.randn(3, 2)),
        "size": torch.Size([2, 3]),
        "dtype": torch.bfloat16,
        "nested": {"list": [1, 2.5, "x", None, (True, b"raw")], "set": {1, 2}},
    }
    path = tmp_path / "mixed.pt"
    torch.save(obj, path)
    archive = TorchZipArchive(path)
    got = archive.obj
    assert got["size"] == torch.Size([2, 3]) and got["dtype"] is torch.bfloat16 and got["nested"] == obj["nested"]
    for key, value in obj.items():
        if isinstance(value, torch.Tensor):
            read = archive.read(got[key])
            assert read.dtype == value.dtype and read.shape == value.shape and torch.equal(read, value.detach()), key
    assert torch.equal(archive.read(got["transposed"], 1, 3), base.t()[1:3])


def test_pth_and_bin_consolidation_are_bit_exact(tmp_path):
    config = tiny_llama()
    models = build_ranks(config, 4, flatten_parameters=True)
    expected = xla_consolidate(models)
    save_torch_xla_style(str(tmp_path / "xla"), models)
    save_trainer_style(tmp_path / "trainer", models)
    config.save_pretrained(tmp_path / "cfg")
    assert main(["consolidate", str(tmp_path / "xla"), "--ckpt-suffix", "_rank-*.pth", "--config",
                 str(tmp_path / "cfg"), "-o", str(tmp_path / "out_pth"), "--quiet"]) == 0
    assert main(["consolidate", str(tmp_path / "trainer"), "--config", str(tmp_path / "cfg"),
                 "-o", str(tmp_path / "out_bin"), "--quiet"]) == 0
    for out in ("out_pth", "out_bin"):
        got = load_file(tmp_path / out / "model.safetensors")
        assert got.keys() == expected.keys() - {"lm_head.weight"} or got.keys() == expected.keys()
        for key, value in got.items():
            assert torch.equal(value, expected[key]), (out, key)


class _System:
    """Pickles as ``os.system(command)``: what a malicious checkpoint does."""

    def __init__(self, command: str):
        self.command = command

    def __reduce__(self):
        return (os.system, (self.command,))


def test_malicious_pickles_are_refused_without_running_anything(capsys, tmp_path, models):
    flag = tmp_path / "pwned"
    config = tmp_path / "cfg"
    tiny_llama().save_pretrained(config)
    state = {"model": {k: v.cpu() for k, v in models[0].state_dict().items()},
             "shard_metadata": models[0].get_shard_metadata()}
    cases = {
        "top": {**state, "payload": _System(f"touch {flag}")},
        "inside_model": {**state, "model": {**state["model"], "x": _System(f"touch {flag}")}},
        "path": {**state, "note": Path("/etc/passwd")},
    }
    for name, obj in cases.items():
        prefix = tmp_path / name
        torch.save(obj, f"{prefix}_rank-0.pth")
        err = _cli_error(capsys, prefix, "--config", config, "-o", tmp_path / "out")
        assert "not a safe torch file" in err and "nothing of it was executed" in err, err
        assert ("posix.system" in err or "os.system" in err) if name != "path" else "pathlib" in err
    # a module that does not even exist: refused by name, never imported or looked up
    raw = tmp_path / "raw_rank-0.pth"
    torch.save(state, raw)
    _replace_pickle(raw, b"\x80\x02cno_such_module_xyz\nboom\nq\x00)\x81q\x01.")
    with pytest.raises(UnsafePickle, match="no_such_module_xyz.boom"):
        TorchZipArchive(raw)
    assert not flag.exists() and not (tmp_path / "out").exists()


def _replace_pickle(path: Path, data: bytes) -> None:
    """Rewrite ``path`` with its data.pkl replaced by ``data`` (every other record kept, stored)."""
    with zipfile.ZipFile(path) as zin:
        records = [(i.filename, zin.read(i)) for i in zin.infolist()]
    with zipfile.ZipFile(path, "w", zipfile.ZIP_STORED) as zout:
        for name, payload in records:
            zout.writestr(name, data if name.endswith("/data.pkl") else payload)


def test_truncated_and_corrupted_archives_give_one_line(capsys, tmp_path, models):
    config = tmp_path / "cfg"
    tiny_llama().save_pretrained(config)
    good = save_trainer_style(tmp_path / "good", models)
    data = good[1].read_bytes()
    cases: dict[str, bytes] = {
        "empty": b"",
        "header_only": data[:100],
        "half": data[: len(data) // 2],
        "no_central_directory": data[:-30],
        "not_a_zip": b"\x00" * len(data),
    }
    with zipfile.ZipFile(good[1]) as zf:
        info = next(i for i in zf.infolist() if "/data/" in i.filename)
        pkl = next(i for i in zf.infolist() if i.filename.endswith("/data.pkl"))
    broken = bytearray(data)
    broken[info.header_offset: info.header_offset + 4] = b"XXXX"  # a storage's local header
    cases["bad_local_header"] = bytes(broken)
    with zipfile.ZipFile(good[1]) as zf:
        pickled = zf.read(pkl)
    cases["truncated_pickle"] = pickled[: len(pickled) // 2]
    cases["garbage_pickle"] = b"\x80\x02" + bytes(range(7, 200))
    for name, payload in cases.items():
        case = tmp_path / name
        case.mkdir()
        for p in good:
            (case / p.name).write_bytes(p.read_bytes())
        target = case / good[1].name
        if name.endswith("_pickle"):
            _replace_pickle(target, payload)
        else:
            target.write_bytes(payload)
        err = _cli_error(capsys, case, "--config", config, "-o", tmp_path / "out")
        assert good[1].name in err and ("truncated" in err or "corrupted" in err), (name, err)
        assert not (tmp_path / "out").exists()


def test_storage_size_mismatch_is_refused(tmp_path, models):
    # a pickle that claims more elements than the storage record holds: refused before any read
    path = tmp_path / "r.pth"
    torch.save({"w": torch.ones(4)}, path)
    with zipfile.ZipFile(path) as zf:
        pkl = zf.read(next(n for n in zf.namelist() if n.endswith("/data.pkl")))
    patched = pkl.replace(b"cpuq\x06K\x04t", b"cpuq\x06K\x09t")  # the numel closing the persistent id: 4 -> 9
    assert patched != pkl
    _replace_pickle(path, patched)
    with pytest.raises(CheckpointError, match="holds 16 bytes, the pickle says 9"):
        TorchZipArchive(path)
