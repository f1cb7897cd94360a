"""Sharded save / load: exact resume, resharding N -> M, atomicity under SIGKILL."""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, TESTS, build_ranks, fake_adam_state, save_ranks, start_python, tiny_llama, wait_for_output
from helpers import consolidate as xla_consolidate

from hf_xla_fsdp.checkpoint import load_checkpoint, staging_dir
from hf_xla_fsdp.checkpoint.layout import CheckpointSeries
from hf_xla_fsdp.checkpoint.readers import COMPLETE_MARKER, CheckpointError, open_checkpoint

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


def _consolidated_optimizer_state(models, optimizers, key):
    """The full-size ``key`` (e.g. exp_avg) of every parameter, assembled like parameters."""
    state_dicts = []
    for model, opt in zip(models, optimizers):
        names = {id(v): k for k, v in model.state_dict(keep_vars=True).items()}
        state_dicts.append({names[id(p)]: opt.state[p][key].cpu() for p in model.parameters()})
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    return consolidate_sharded_state_dicts(state_dicts, models[0].get_shard_metadata())


@pytest.mark.parametrize("saved,loaded", [(3, 2), (2, 4), (4, 1)])
@pytest.mark.parametrize("flatten", [False, True])
def test_reshard_model_and_optimizer(tmp_path, saved, loaded, flatten):
    config = tiny_llama()
    models = build_ranks(config, saved, flatten_parameters=flatten)
    optimizers = fake_adam_state(models)
    save_ranks(tmp_path / "ckpt", models, optimizers, step=11)
    expected_params = xla_consolidate(models)
    expected_avg = _consolidated_optimizer_state(models, optimizers, "exp_avg")

    new = build_ranks(config, loaded, seed=123, flatten_parameters=flatten)  # different init: must be overwritten
    new_opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in new]
    for model, opt in zip(new, new_opts):
        info = load_checkpoint(tmp_path / "ckpt", model, opt)
        assert info["step"] == 11 and info["saved_world_size"] == saved
    got = xla_consolidate(new)
    assert got.keys() == expected_params.keys()
    assert all(torch.equal(got[k], expected_params[k]) for k in got)
    got_avg = _consolidated_optimizer_state(new, new_opts, "exp_avg")
    assert all(torch.equal(got_avg[k], expected_avg[k]) for k in got_avg)
    step = next(iter(new_opts[0].state.values()))["step"]
    assert float(step) == 1.0


def test_same_world_reads_only_its_own_file(tmp_path, monkeypatch):
    config = tiny_llama()
    models = build_ranks(config, 3)
    save_ranks(tmp_path / "ckpt", models, fake_adam_state(models), step=2)
    from hf_xla_fsdp.checkpoint import readers as rank_files

    opened = []
    real = rank_files.SafetensorsRankFile.__init__

    def spy(self, path, listed=None):
        opened.append(Path(path).name)
        real(self, path, listed)

    monkeypatch.setattr(rank_files.SafetensorsRankFile, "__init__", spy)
    target = build_ranks(config, 3, seed=5)[1]
    load_checkpoint(tmp_path / "ckpt", target, torch.optim.AdamW(target.parameters()))
    assert opened == ["rank-00001-of-00003.safetensors"]


def test_loading_into_a_different_model_is_refused(tmp_path):
    save_ranks(tmp_path / "ckpt", build_ranks(tiny_llama(), 2))
    other = build_ranks(tiny_llama(hidden_size=32, intermediate_size=64), 2)[0]
    with pytest.raises(CheckpointError, match="different model or different FSDP settings"):
        load_checkpoint(tmp_path / "ckpt", other)
    flat = build_ranks(tiny_llama(), 3, flatten_parameters=True)[0]
    with pytest.raises(CheckpointError, match="different model or different FSDP settings"):
        load_checkpoint(tmp_path / "ckpt", flat)


def _run_quickstart(out, log, *extra):
    """examples/quickstart.py started, stdout to ``log`` (the tests kill it while it trains)."""
    return start_python([ROOT / "examples/quickstart.py", "--output_dir", out, "--max_train_steps", "8",
                         "--save_steps", "4", "--skip_consolidation", *extra], log=log)


@pytest.mark.slow
def test_resume_after_sigkill_continues_the_same_loss_curve(tmp_path):
    full = _run_quickstart(tmp_path / "full", tmp_path / "full.log")
    assert full.wait(600) == 0, (tmp_path / "full.log.err").read_text()[-3000:]
    reference = json.loads((tmp_path / "full" / "quickstart_results.json").read_text())["losses"]

    # the interrupted run: killed (SIGKILL) right after checkpoint-4 is complete
    run = _run_quickstart(tmp_path / "killed", tmp_path / "killed.log")
    marker = tmp_path / "killed" / "checkpoint-4" / COMPLETE_MARKER
    deadline = time.time() + 600
    while not marker.exists() and run.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    run.send_signal(signal.SIGKILL)
    run.wait()
    assert marker.exists()
    log = tmp_path / "resumed.log"
    resumed = _run_quickstart(tmp_path / "killed", log, "--resume_from_checkpoint", tmp_path / "killed" / "checkpoint-4")
    assert resumed.wait(600) == 0, Path(f"{log}.err").read_text()[-3000:]
    # the line the script prints after load_checkpoint, with the step it read back (a silent restart from scratch
    # would recompute steps 1-4, deterministically, and the comparison below could not tell)
    assert f"resumed from {tmp_path / 'killed' / 'checkpoint-4'} at step 4" in log.read_text()
    losses = json.loads((tmp_path / "killed" / "quickstart_results.json").read_text())["losses"]
    for step in range(5, 9):
        assert losses[str(step)] == reference[str(step)], (step, losses[str(step)], reference[str(step)])


CRASH_SAVER = r"""
import sys, torch
sys.path.insert(0, {tests!r})
from helpers import build_ranks, save_ranks, tiny_llama
from pathlib import Path

root, start = Path(sys.argv[1]), int(sys.argv[2])
models = build_ranks(tiny_llama(hidden_size=256, intermediate_size=512, num_hidden_layers=4, vocab_size=1024), 2)
i = start
while True:
    save_ranks(root / f"checkpoint-{{i}}", models, step=i)
    print("saved", i, flush=True)
    i += 1
"""


@pytest.mark.slow
def test_sigkill_during_save_never_leaves_a_complete_looking_checkpoint(tmp_path):
    script = tmp_path / "saver.py"
    script.write_text(CRASH_SAVER.format(tests=str(TESTS)))
    root = tmp_path / "ckpts"
    import random

    rnd = random.Random(0)
    next_index = 0
    for _ in range(4):
        log = tmp_path / f"saver-{next_index}.log"
        proc = start_python([script, root, next_index], log=log)
        # one save finished: now kill at a random moment of later saves
        assert wait_for_output(proc, log, "saved", timeout=300), Path(f"{log}.err").read_text()[-3000:]
        time.sleep(rnd.uniform(0.0, 0.6))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        visible = sorted(p for p in root.iterdir() if not p.name.startswith("."))
        next_index = max(int(p.name.split("-")[1]) for p in visible) + 1
    visible = [p for p in root.iterdir() if not p.name.startswith(".")]
    assert len(visible) >= 4
    for ckpt in visible:  # every visible checkpoint is complete and readable to the last byte
        ranks = open_checkpoint(ckpt)
        for f in ranks.files:
            for name in f.names():
                f.get(name)
    # the killed saves left only hidden staging directories, which no resume looks at: each is incomplete, or (a kill
    # after its marker was written, before its rename) complete under a staging name the series never counts
    series = CheckpointSeries(root)
    assert series.complete() == sorted(visible, key=series.number)
    for hidden in (p for p in root.iterdir() if p.name.startswith(".")):
        assert re.fullmatch(r"\.checkpoint-\d+\.partial", hidden.name) and series.number(hidden) is None, hidden.name
        if not (hidden / COMPLETE_MARKER).exists():
            with pytest.raises(CheckpointError):
                open_checkpoint(hidden)
    assert staging_dir(root / "checkpoint-0").name == ".checkpoint-0.partial"
