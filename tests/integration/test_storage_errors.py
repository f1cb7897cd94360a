"""A full disk (for real: RLIMIT_FSIZE makes writes past a size fail with EFBIG, as ENOSPC would) and places that
cannot be written, during a save and during a consolidation: one line, staging files removed, the previous
checkpoint and any existing output untouched."""

from __future__ import annotations

import gc
import os
import resource
import subprocess
import sys

import pytest
from helpers import ROOT, build_ranks, run_ranks, save_ranks, tiny_llama, xla_env

from hf_xla_fsdp.checkpoint import save_checkpoint
from hf_xla_fsdp.checkpoint.consolidate import consolidate
from hf_xla_fsdp.checkpoint.verify import verify_checkpoint
from hf_xla_fsdp.errors import CheckpointError

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


def test_full_disk_during_a_two_process_save(tmp_path):
    # rank 1 may write at most 64 kB per file after its first save: its next rank file (~0.8 MB) hits EFBIG
    root = tmp_path / "run"
    runs = run_ranks(2, lambda rank: ["--root", root, "--saves", "2", "--timeout", "60",
                                      *(["--fsize-limit-after-first", str(64 * 1024)] if rank == 1 else [])],
                     timeout=600)
    for run in runs:
        line = run.last_line()
        assert run.returncode == 3, (run.rank, run.stdout, run.stderr[-2000:])
        assert line.startswith("error: the save of ") and "failed on rank 1: [Errno 27] File too large" in line, line
        assert "earlier checkpoints are untouched" in line
    assert sorted(p.name for p in root.iterdir()) == ["checkpoint-0"]  # the staging directory is gone
    assert verify_checkpoint(root / "checkpoint-0")["checksummed_files"] == 2


def test_save_into_a_path_that_cannot_be_a_directory(tmp_path):
    model = build_ranks(tiny_llama(), 1)[0]
    save_checkpoint(tmp_path / "checkpoint-1", model, step=1)
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("a file where a directory is needed")
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(blocker / "checkpoint-2", model, step=2)
    assert len(str(err.value).splitlines()) == 1 and "failed on rank 0: [Errno 20] Not a directory" in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1", "not_a_dir"]
    assert verify_checkpoint(tmp_path / "checkpoint-1")["files"] == 1


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes into a read-only directory: the other tests use what fails")
def test_save_into_a_read_only_directory(tmp_path):
    model = build_ranks(tiny_llama(), 1)[0]
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o555)
    try:
        with pytest.raises(CheckpointError, match="Permission denied"):
            save_checkpoint(locked / "checkpoint-1", model)
    finally:
        locked.chmod(0o755)
    assert list(locked.iterdir()) == []


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return save_ranks(tmp_path_factory.mktemp("ckpt") / "ckpt", build_ranks(tiny_llama(), 2), step=1)


def _consolidate_with_file_size_limit(ckpt, output, limit):
    def limit_file_size():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return subprocess.run([sys.executable, "-m", "hf_xla_fsdp.cli", "consolidate", str(ckpt), "-o", str(output),
                           "--overwrite", "--quiet"], cwd=ROOT, env=xla_env(env={"USE_TORCH_XLA": "0"}),
                          capture_output=True, text=True, timeout=600, preexec_fn=limit_file_size)


def test_full_disk_during_consolidation_keeps_the_existing_output(tmp_path, ckpt):
    out = tmp_path / "out"
    out.mkdir()
    (out / "model.safetensors").write_bytes(b"the previous consolidation")
    res = _consolidate_with_file_size_limit(ckpt, out, 64 * 1024)  # the model's safetensors is ~0.7 MB
    err = res.stderr.strip()
    assert res.returncode == 2 and len(err.splitlines()) == 1, res.stderr[-3000:]
    assert err.startswith("hf-xla-fsdp consolidate: error: cannot write the consolidated model to ")
    assert "[Errno 27] File too large" in err and "is unchanged" in err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no staging directory left
    assert [p.name for p in out.iterdir()] == ["model.safetensors"]
    assert (out / "model.safetensors").read_bytes() == b"the previous consolidation"
    assert verify_checkpoint(ckpt)["files"] == 2  # the checkpoint itself is untouched


def test_consolidation_into_a_path_that_cannot_be_a_directory(tmp_path, ckpt):
    blocker = tmp_path / "not_a_dir"
    blocker.write_text("x")
    with pytest.raises(CheckpointError, match=r"beside .*not_a_dir/out: \[Errno 17\] File exists: .*not_a_dir'$"):
        consolidate(ckpt, blocker / "out", progress=False)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["not_a_dir"]


def unmount(mount) -> None:
    """Unmount a test file system: memory maps of its files held by objects not yet collected keep it busy, and a
    lazy unmount is the fallback so no mount outlives the test."""
    gc.collect()
    if subprocess.run(["umount", str(mount)], capture_output=True).returncode != 0:
        subprocess.run(["umount", "-l", str(mount)], check=False, capture_output=True)


@pytest.fixture
def small_disk(tmp_path):
    """A real 1 MiB file system (tmpfs): writes past its size fail with ENOSPC. Skipped where mounting is not allowed."""
    mount = tmp_path / "small_disk"
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.strip()}); the RLIMIT_FSIZE tests cover a full disk")
    try:
        yield mount
    finally:
        unmount(mount)


def test_no_space_left_during_save_and_consolidation(tmp_path, small_disk, ckpt):
    model = build_ranks(tiny_llama(), 1)[0]
    save_checkpoint(small_disk / "checkpoint-1", model, step=1)  # ~0.5 MB: fits once, not twice
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(small_disk / "checkpoint-2", model, step=2)
    line = str(err.value)
    assert len(line.splitlines()) == 1 and "failed on rank 0: [Errno 28] No space left on device" in line, line
    assert sorted(p.name for p in small_disk.iterdir()) == ["checkpoint-1"]
    assert verify_checkpoint(small_disk / "checkpoint-1")["files"] == 1
    with pytest.raises(CheckpointError) as err:  # the 2-rank checkpoint's model no longer fits beside checkpoint-1
        consolidate(ckpt, small_disk / "out", progress=False)
    assert "[Errno 28] No space left on device" in str(err.value) and "nothing was written" in str(err.value)
    assert sorted(p.name for p in small_disk.iterdir()) == ["checkpoint-1"]


@pytest.fixture
def read_only_disk(tmp_path):
    """A real file system holding a checkpoint, then remounted read-only (EROFS for root too, unlike a chmod).
    Skipped where mounting is not allowed (the chmod test above covers a non-root user)."""
    mount = tmp_path / "read_only_disk"
    mount.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True, text=True)
    if res.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({res.stderr.strip()})")
    model = build_ranks(tiny_llama(), 1)[0]
    try:
        save_checkpoint(mount / "checkpoint-1", model, step=1)
        (mount / "out").mkdir()
        (mount / "out" / "model.safetensors").write_bytes(b"the previous consolidation")
        subprocess.run(["mount", "-o", "remount,ro", str(mount)], check=True, capture_output=True)
        yield mount, model
    finally:
        unmount(mount)


def test_read_only_file_system_during_save_and_consolidation(read_only_disk, ckpt):
    mount, model = read_only_disk
    with pytest.raises(CheckpointError) as err:
        save_checkpoint(mount / "checkpoint-2", model, step=2)
    line = str(err.value)
    assert len(line.splitlines()) == 1 and "failed on rank 0: [Errno 30] Read-only file system" in line, line
    assert "earlier checkpoints are untouched" in line
    with pytest.raises(CheckpointError) as err:
        consolidate(ckpt, mount / "out", overwrite=True, progress=False)
    line = str(err.value)
    assert len(line.splitlines()) == 1 and "[Errno 30] Read-only file system" in line, line
    assert sorted(p.name for p in mount.iterdir()) == ["checkpoint-1", "out"]
    assert verify_checkpoint(mount / "checkpoint-1")["files"] == 1
    assert (mount / "out" / "model.safetensors").read_bytes() == b"the previous consolidation"
