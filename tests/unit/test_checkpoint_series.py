"""The checkpoint policy every entry point shares (checkpoint/layout.py CheckpointSeries): naming, which checkpoint is
the latest (complete ones only), rotation (never an incomplete one, never the newest complete one or a protected one).
The Trainer and XlaFsdpAccelerator use it: tests/integration/test_checkpoint_policy.py (this file is
test_checkpoint_series.py: pytest needs unique basenames)."""

from __future__ import annotations

import os
import time

import pytest

from hf_xla_fsdp.checkpoint.layout import (
    ACCELERATE_PREFIX,
    COMPLETE_MARKER,
    TRAINER_PREFIX,
    CheckpointSeries,
    latest_checkpoint,
)


def make(root, prefix, number, complete=True, age=0.0):
    """A checkpoint directory; ``age`` seconds in the past (its marker's time)."""
    path = root / f"{prefix}{number}"
    path.mkdir(parents=True)
    (path / "rank-00000-of-00001.safetensors").write_bytes(b"x")
    if complete:
        marker = path / COMPLETE_MARKER
        marker.write_text("{}")
        when = time.time() - age
        os.utime(marker, (when, when))
    return path


def names(paths):
    return [p.name for p in paths]


def test_prefixes_are_the_trainers_and_accelerates():
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    assert TRAINER_PREFIX == f"{PREFIX_CHECKPOINT_DIR}-"
    assert CheckpointSeries("p", ACCELERATE_PREFIX).path(3).name == "checkpoint_3"  # accelerate's automatic naming


@pytest.mark.parametrize("prefix", [TRAINER_PREFIX, ACCELERATE_PREFIX])
def test_the_latest_is_the_highest_complete_one_and_numbering_goes_past_incomplete_ones(tmp_path, prefix):
    series = CheckpointSeries(tmp_path, prefix)
    assert series.latest() is None and series.next_number() == 0
    for n in (2, 10):
        make(tmp_path, prefix, n)
    make(tmp_path, prefix, 11, complete=False)  # a save killed midway (written in place)
    (tmp_path / f"{prefix}x").mkdir()  # not of the series
    (tmp_path / "other-12").mkdir()
    assert names(series.numbered()) == [f"{prefix}2", f"{prefix}10", f"{prefix}11"]  # by number, not by name
    assert series.latest().name == f"{prefix}10"
    assert series.next_number() == 12  # a new save never lands on the incomplete directory
    assert latest_checkpoint(tmp_path, prefix) == series.latest()


def test_rotation_never_counts_or_deletes_incomplete_checkpoints(tmp_path):
    series = CheckpointSeries(tmp_path)
    for n in (1, 2):
        make(tmp_path, TRAINER_PREFIX, n)
    for n in (3, 4):
        make(tmp_path, TRAINER_PREFIX, n, complete=False)
    assert series.rotate(2) == []  # two complete ones: within the limit, whatever else lies there
    assert names(series.numbered()) == ["checkpoint-1", "checkpoint-2", "checkpoint-3", "checkpoint-4"]
    make(tmp_path, TRAINER_PREFIX, 5)
    assert names(series.rotate(2)) == ["checkpoint-1"]
    assert names(series.numbered()) == ["checkpoint-2", "checkpoint-3", "checkpoint-4", "checkpoint-5"]


def test_rotation_never_deletes_the_only_complete_checkpoint(tmp_path):
    series = CheckpointSeries(tmp_path)
    make(tmp_path, TRAINER_PREFIX, 1)
    make(tmp_path, TRAINER_PREFIX, 2, complete=False)
    make(tmp_path, TRAINER_PREFIX, 3, complete=False)
    assert series.rotate(1) == [] and series.latest().name == "checkpoint-1"


def test_rotation_keeps_the_newest_and_the_protected_best_and_nothing_without_a_limit(tmp_path):
    series = CheckpointSeries(tmp_path)
    for n in (1, 2, 3, 4):
        make(tmp_path, TRAINER_PREFIX, n)
    assert series.to_rotate(None) == [] and series.to_rotate(0) == []
    best = tmp_path / "checkpoint-2"
    # limit 1 with a best model elsewhere: the newest (to resume) and the best stay, as transformers' rotation does
    assert names(series.to_rotate(1, protect=[str(best), None])) == ["checkpoint-1", "checkpoint-3"]
    assert names(series.rotate(2, protect=[best])) == ["checkpoint-1", "checkpoint-3"]
    assert names(series.numbered()) == ["checkpoint-2", "checkpoint-4"]


def test_rotation_goes_by_completion_time_after_a_resume_from_an_earlier_step(tmp_path):
    """Resumed from checkpoint-20 after a run that had reached checkpoint-40: the new checkpoint-30 is the newest
    (transformers' Trainer rotates by mtime for the same reason); by number it would be deleted at once."""
    series = CheckpointSeries(tmp_path)
    make(tmp_path, TRAINER_PREFIX, 20, age=300)
    make(tmp_path, TRAINER_PREFIX, 40, age=200)
    make(tmp_path, TRAINER_PREFIX, 30, age=0)
    assert names(series.rotate(2)) == ["checkpoint-20"]
    assert names(series.numbered()) == ["checkpoint-30", "checkpoint-40"]
