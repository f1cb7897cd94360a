"""Async saves: the step waits only for the copy of the rank's state to host memory; the files are written and
committed in a background thread while training goes on; the bytes on disk are a synchronous save's; a failure in
the background is raised at the next save, a load, or at exit."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch
from helpers import ROOT, build_rank, run_python, tiny_llama

from hf_xla_fsdp.checkpoint import COMPLETE_MARKER, load_checkpoint, save_checkpoint, wait_for_pending_save
from hf_xla_fsdp.checkpoint.background import pending_save
from hf_xla_fsdp.errors import CheckpointError
from hf_xla_fsdp.runtime import sync, xla_device

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


def step(model, optimizer, seed: int) -> float:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 16), generator=g).to(xla_device())
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    sync()
    return float(loss)


@pytest.fixture
def trained():
    model = build_rank(tiny_llama(), 1, 0)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for seed in range(2):
        step(model, optimizer, seed)
    return model, optimizer


def tensor_file(ckpt: Path) -> bytes:
    return (ckpt / "rank-00000-of-00001.safetensors").read_bytes()


def test_training_goes_on_while_the_save_is_written_and_the_bytes_are_a_sync_saves(tmp_path, trained):
    model, optimizer = trained
    save_checkpoint(tmp_path / "sync", model, optimizer, step=2)
    release, held = threading.Event(), threading.Event()

    def hold(stage: Path) -> None:  # the background commit waits here until the main thread has trained on
        held.set()
        assert release.wait(120)

    save_checkpoint(tmp_path / "async", model, optimizer, step=2, async_save=True, before_commit=hold)
    assert held.wait(120)
    assert not (tmp_path / "async").exists()  # not published before its marker is
    after = step(model, optimizer, 2)  # updates parameters and AdamW's in-place CPU step counter meanwhile
    assert pending_save() is not None and not pending_save().done()
    release.set()
    assert wait_for_pending_save() == tmp_path / "async"
    assert (tmp_path / "async" / COMPLETE_MARKER).is_file()
    assert tensor_file(tmp_path / "async") == tensor_file(tmp_path / "sync")  # the state as of the save call

    fresh = build_rank(tiny_llama(), 1, 0, seed=5)
    fresh_opt = torch.optim.AdamW(fresh.parameters(), lr=1e-2)
    assert load_checkpoint(tmp_path / "async", fresh, fresh_opt)["step"] == 2
    assert step(fresh, fresh_opt, 2) == pytest.approx(after, abs=1e-6)  # resumes where the save was taken


def test_a_failure_in_the_background_is_raised_at_the_next_save_and_nothing_is_published(tmp_path, trained):
    model, optimizer = trained
    (tmp_path / "file").write_text("not a directory")
    save_checkpoint(tmp_path / "file" / "ckpt", model, optimizer, async_save=True)  # returns: the write is later
    with pytest.raises(CheckpointError, match=r"the save of .*file/ckpt failed on rank 0: .*Not a directory"):
        save_checkpoint(tmp_path / "next", model, optimizer, async_save=True)
    assert not (tmp_path / "next").exists() and pending_save() is None  # the failing wait stopped the next save

    def refuse(stage: Path) -> None:
        raise OSError(28, "No space left on device")

    save_checkpoint(tmp_path / "full", model, optimizer, async_save=True, before_commit=refuse)
    with pytest.raises(CheckpointError, match="No space left on device"):
        load_checkpoint(tmp_path / "sync", model, optimizer)  # a load waits too, and hears of it
    assert not list(tmp_path.glob("*full*"))  # staging removed, nothing published
    save_checkpoint(tmp_path / "ok", model, optimizer, async_save=True)
    assert wait_for_pending_save() == tmp_path / "ok" and (tmp_path / "ok" / COMPLETE_MARKER).is_file()


def test_a_failure_nobody_waited_for_makes_the_process_exit_1_with_one_line(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(f"""
import sys
sys.path.insert(0, {str(ROOT / 'tests')!r})
import torch
from helpers import build_rank, tiny_llama
from hf_xla_fsdp.checkpoint import save_checkpoint

model = build_rank(tiny_llama(), 1, 0)
save_checkpoint(sys.argv[1] + "/ckpt", model, async_save=True)
print("returned", flush=True)
""")
    (tmp_path / "file").write_text("")
    res = run_python([script, tmp_path / "file"], timeout=300, preloaded=True)
    assert res.returncode == 1 and "returned" in res.stdout, res.stdout + res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("hf_xla_fsdp: the save of ") and "ckpt failed on rank 0" in last, res.stderr[-2000:]
    assert "Traceback" not in res.stderr


@pytest.mark.parametrize("group_bytes", [1, 3000, 1 << 30])
def test_host_copies_in_groups_are_exact_fresh_copies(group_bytes):
    """The async snapshot fetches device tensors in batched groups of about ``group_bytes`` (one transfer of the whole
    state allocates it twice at once); any grouping gives the same values, in order, as host tensors later steps
    cannot change, with host tensors among them cloned."""
    from hf_xla_fsdp.engines.base import host_copies

    g = torch.Generator().manual_seed(0)
    expected = [torch.randn(n, generator=g) for n in (5, 700, 1, 300, 2000)]
    tensors = [t.clone() if i == 2 else t.to(xla_device()) for i, t in enumerate(expected)]  # one stays on the host
    sync()
    copies = host_copies(tensors, group_bytes=group_bytes)
    assert [c.device.type for c in copies] == ["cpu"] * len(expected)
    assert all(torch.equal(c, e) for c, e in zip(copies, expected))
    for t in tensors:  # a later step updates the state in place: the snapshot keeps the values it took
        t.add_(1)
    sync()
    assert all(torch.equal(c, e) for c, e in zip(copies, expected))
