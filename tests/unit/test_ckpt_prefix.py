"""torch_xla's consolidation convention: ``--ckpt-prefix`` and ``--ckpt-suffix`` joined as plain strings.

torch_xla's ``consolidate_sharded_model_checkpoints`` globs ``ckpt_prefix + ckpt_suffix`` and transformers' Trainer
calls it with ``ckpt_prefix=os.path.join(output_dir, "")`` (a trailing slash) and
``ckpt_suffix="rank*-of-*-pytorch_model.bin"``. The rank files here are made by torch_xla's FSDP ``state_dict()`` +
``get_shard_metadata()`` of a 2-rank world and saved the way torch_xla's example (``{'model', 'shard_metadata',
'optimizer'}`` as ``<prefix>_rank-00000000-of-00000002.pth``, ``xm.save``) and the Trainer's XLA FSDP path
(``rank{i}-of-{N}-pytorch_model.bin``, ``xm.save``) save them; the reference is torch_xla's own consolidation over
the very same prefix and suffix.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers import build_ranks, fake_adam_state, tiny_llama
from safetensors.torch import load_file

from hf_xla_fsdp.cli import main

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

WORLD = 2
CONFIG = dict(num_hidden_layers=2, hidden_size=32, intermediate_size=64)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    import torch_xla.core.xla_model as xm

    root = tmp_path_factory.mktemp("prefix")
    models = build_ranks(tiny_llama(**CONFIG), WORLD)
    opts = fake_adam_state(models)
    (root / "ckpt").mkdir()
    (root / "checkpoint-100").mkdir()
    for rank, (model, opt) in enumerate(zip(models, opts)):
        # torch_xla's test_train_mp_mnist_fsdp_with_ckpt.py: f'{ckpt_prefix}_rank-{rank:08d}-of-{world:08d}.pth'; here
        # the prefix is a stem ending in '_' as users write it ('out/ckpt/model_')
        example = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata(),
                   "optimizer": opt.state_dict()}
        xm.save(example, str(root / "ckpt" / f"model_rank-{rank:08d}-of-{WORLD:08d}.pth"), master_only=False)
        # transformers/integrations/tpu.py save_tpu_checkpoint
        trainer = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}
        xm.save(trainer, str(root / "checkpoint-100" / f"rank{rank}-of-{WORLD}-pytorch_model.bin"), master_only=False)
    tiny_llama(**CONFIG).save_pretrained(root / "config")
    return root


def torch_xla_reference(prefix: str, suffix: str) -> dict[str, torch.Tensor]:
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints

    full, _ = consolidate_sharded_model_checkpoints(ckpt_prefix=prefix, ckpt_suffix=suffix, save_model=False)
    return full


def run(capsys, *argv: str) -> tuple[int, str]:
    rc = main(list(argv))
    return rc, capsys.readouterr().err.strip()


def assert_matches_torch_xla(out, prefix: str, suffix: str) -> None:
    expected = torch_xla_reference(prefix, suffix)
    got = load_file(out / "model.safetensors")
    assert sorted(got) == sorted(expected)
    assert all(torch.equal(got[k], expected[k]) for k in expected)


@pytest.mark.parametrize("spelling", ["--ckpt-prefix", "--ckpt_prefix"])
def test_file_stem_prefix(files, capsys, tmp_path, spelling):
    prefix, suffix = f"{files}/ckpt/model_", "rank-*-of-*.pth"
    out = tmp_path / "out"
    rc, err = run(capsys, "consolidate", spelling, prefix, "--ckpt_suffix", suffix, "--config", str(files / "config"),
                  "--output", str(out), "--quiet")
    assert rc == 0, err
    assert_matches_torch_xla(out, prefix, suffix)
    rc, err = run(capsys, "verify", spelling, prefix, "--ckpt-suffix", suffix)
    assert rc == 0, err


def test_directory_prefix_with_trailing_slash_as_the_trainer_calls_it(files, capsys, tmp_path):
    prefix, suffix = os.path.join(str(files / "checkpoint-100"), ""), "rank*-of-*-pytorch_model.bin"
    for n, argv in enumerate([["--ckpt-prefix", prefix], [prefix]]):  # torch_xla's flag, and our positional CKPT
        out = tmp_path / f"out{n}"
        rc, err = run(capsys, "consolidate", *argv, "--ckpt-suffix", suffix, "--config", str(files / "config"),
                      "--output", str(out), "--quiet")
        assert rc == 0, err
        assert_matches_torch_xla(out, prefix, suffix)
        rc, err = run(capsys, "verify", *argv, "--ckpt-suffix", suffix)
        assert rc == 0, err


def test_directory_prefix_without_trailing_slash_names_the_fix(files, capsys, tmp_path):
    """Joined as plain strings, ``out/checkpoint-100`` + ``rank*...`` matches nothing, in torch_xla as here; here the
    one line says so and names the fix (the trailing slash) instead of only 'no rank files match'."""
    prefix, suffix = str(files / "checkpoint-100"), "rank*-of-*-pytorch_model.bin"
    with pytest.raises(AssertionError, match="Cannot find any files matching"):
        torch_xla_reference(prefix, suffix)
    for command in (["consolidate", "--output", str(tmp_path / "out"), "--quiet"], ["verify"]):
        rc, err = run(capsys, *command, "--ckpt-prefix", prefix, "--ckpt-suffix", suffix)
        assert rc == 2 and len(err.splitlines()) == 1, err
        assert f"no rank files match {prefix}{suffix}" in err and f"--ckpt-prefix {prefix}/" in err, err
    assert not (tmp_path / "out").exists()


def test_default_suffix_and_conflicting_spellings(files, capsys, tmp_path):
    prefix = f"{files}/ckpt/model_"
    out = tmp_path / "out"
    rc, err = run(capsys, "consolidate", "--ckpt-prefix", prefix, "--config", str(files / "config"), "--output",
                  str(out), "--quiet")  # torch_xla's default suffix: *.pth
    assert rc == 0, err
    assert_matches_torch_xla(out, prefix, "*.pth")
    rc, err = run(capsys, "verify", prefix, "--ckpt-prefix", prefix)
    assert rc == 2 and "either as CKPT or as --ckpt-prefix, not both" in err, err
    rc, err = run(capsys, "verify")
    assert rc == 2 and "give the checkpoint" in err, err
