"""Compile time in fresh processes: XlaFsdpTrainer's graphs on varied-length text with and without pad_to_buckets
(and the one-line report of a late new graph), and the persistent compilation cache shared by several processes."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys

import pytest
from helpers import SCRIPTS, run_python, xla_env

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

WORKER = SCRIPTS / "shapes_worker.py"


def worker(*args: str) -> dict:
    res = run_python([WORKER, *args], timeout=900)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.slow
def test_trainer_with_stock_collator_compiles_a_bounded_number_of_graphs():
    """transformers' DataCollatorForLanguageModeling on texts of 40 lengths, 12 steps of batch 2: at most 4 graphs
    from step 4 on (with buckets off every new length compiles; measured 18 in 16 steps), none of them reported as a
    late new shape; evaluation and prediction batches are bucketed too."""
    run = worker("trainer", "--buckets", "true", "--steps", "12", "--eval-batches", "3")
    assert run["graphs_after_step_3"] <= 4, run
    assert not [line for line in run["log"] if "new XLA graph" in line], run["log"]
    # training, evaluation and prediction batches all reach the model at bucket lengths only
    assert set(run["lengths"]["train"]) <= {64, 128, 256} and set(run["lengths"]["eval"]) <= {64, 128, 256}, run
    assert run["lengths"]["eval"] and run["graphs_in_second_eval"] == 0 and run["eval_loss_again"] == run["eval_loss"]


@pytest.mark.slow
def test_a_new_shape_after_warm_up_is_one_line_with_buckets_off():
    run = worker("trainer", "--buckets", "false", "--steps", "5")
    late = [line for line in run["log"] if "new XLA graph" in line]
    assert late, run["log"]
    first = late[0]
    assert first.startswith("WARNING step 4 (batch 4 of this data loader) compiled a new XLA graph after warm-up: "
                            "input_ids (2, "), first
    assert "labels (2, " in first and "attention_mask (2, " in first and "\n" not in first
    assert first.endswith("fix: set pad_to_buckets: true (off here), or pad every batch to a few fixed lengths "
                          "yourself (the tokenizer's padding='max_length' with a max_length, or the collator's "
                          "pad_to_multiple_of=64)")


def test_accelerator_loaders_are_bucketed_to_the_models_length_with_its_pad_token():
    """XlaFsdpAccelerator.prepare pads a plain DataLoader's batches (a collator without a tokenizer: the pad token
    comes from the model config), cuts buckets at the model's n_positions and watches the device loader."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin

    def collate(rows):  # pads to the longest row only, as many hand-written collators do
        longest = max(len(r) for r in rows)
        ids = torch.tensor([r + [5] * (longest - len(r)) for r in rows])
        mask = torch.tensor([[1] * len(r) + [0] * (longest - len(r)) for r in rows])
        return {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}

    import copy

    rows = [[7] * n for n in (3, 30, 70, 90, 20, 10)]
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=32, n_layer=1, n_head=4, n_positions=100,
                                       pad_token_id=5, bos_token_id=0, eos_token_id=0))
    reference = copy.deepcopy(model).eval()  # the same weights, eager on the CPU, fed the unbucketed batches
    model, loader = accelerator.prepare(model, torch.utils.data.DataLoader(rows, batch_size=2, collate_fn=collate))
    assert loader._hf_xla_fsdp_watch is not None
    batches = [{k: v.cpu() for k, v in b.items()} for b in loader]
    assert [b["input_ids"].shape for b in batches] == [(2, 64), (2, 100), (2, 64)]  # 128 cut to n_positions=100
    for batch, (a, b) in zip(batches, [(3, 30), (70, 90), (20, 10)]):
        for row, n in enumerate((a, b)):
            assert batch["attention_mask"][row].sum() == n and (batch["labels"][row, n:] == -100).all()
            assert (batch["input_ids"][row, n:] == 5).all() and (batch["input_ids"][row, :n] == 7).all()
    model.eval()
    with torch.no_grad():
        losses = [model(**{k: v.to(accelerator.device) for k, v in b.items()}).loss.item() for b in batches]
        # each pair padded to its own longer row only (what the collator made): the bucket's extra padding is
        # masked out of attention and of the loss, so the loss is the same (fp32: summation order only, <1e-5 of
        # a loss near ln(128) = 4.85; a padding position counted in the loss moves it by ~1e-1)
        expected = [reference(**collate(rows[i:i + 2])).loss.item() for i in range(0, len(rows), 2)]
    assert losses == pytest.approx(expected, abs=1e-5)


def wire_message_is_complete(data: bytes) -> bool:
    """True when ``data`` is a sequence of protobuf wire-format fields ending exactly at its end (a torn or
    interleaved write leaves a field that overruns it or a bad wire type)."""
    def varint(i: int) -> tuple[int, int]:
        shift = value = 0
        while True:
            if i >= len(data):
                raise ValueError("truncated varint")
            byte = data[i]
            value |= (byte & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if not byte & 0x80:
                return value, i

    i = 0
    try:
        while i < len(data):
            key, i = varint(i)
            wire = key & 7
            if key >> 3 == 0:
                return False
            if wire == 0:
                _, i = varint(i)
            elif wire == 1:
                i += 8
            elif wire == 2:
                size, i = varint(i)
                i += size
            elif wire == 5:
                i += 4
            else:
                return False
    except ValueError:
        return False
    return i == len(data)


@pytest.mark.slow
def test_cache_folder_shared_by_processes_has_one_writer_intact_files_and_stable_hashes(tmp_path):
    alone, shared = tmp_path / "alone", tmp_path / "shared"
    # the reference: one process alone; every graph it compiled is a file named by the graph's hash
    first = worker("step", "--cache", str(alone))
    assert first["reason"] == "writer (holds the lock)" and first["PersistentCacheMiss"] >= 1 and first["files"]

    # two processes started together on one fresh folder: exactly one writes, the other reads only
    procs = [subprocess.Popen([sys.executable, str(WORKER), "step", "--cache", str(shared)], env=xla_env(devices=1),
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=900) for p in procs]
    assert all(p.returncode == 0 for p in procs), [err[-2000:] for _, err in outs]
    runs = [json.loads(out.strip().splitlines()[-1]) for out, _ in outs]
    assert sorted(r["readonly"] for r in runs) == [False, True], runs
    assert any(r["reason"] == "reader: another process holds the writer lock" for r in runs)
    assert runs[0]["loss"] == runs[1]["loss"] == first["loss"]
    # the same graph hashes in every fresh process, nothing but the writer's files, each file whole
    files = sorted(f for f in os.listdir(shared) if f.isdigit())
    assert files == first["files"]
    assert all(wire_message_is_complete((shared / f).read_bytes()) for f in files)

    # a reader while another process holds the lock: it finds every graph by its hash and writes nothing
    before = {f: (shared / f).stat().st_mtime_ns for f in files}
    with open(shared / ".hf_xla_fsdp-writer.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        reader = worker("step", "--cache", str(shared))
    assert reader["readonly"] and reader["PersistentCacheMiss"] == 0, reader
    found = reader["PersistentCacheHit"] + reader["PersistentCacheDeserializeFailure"]
    assert found == len(files), reader  # each graph looked up once and found on disk
    assert {f: (shared / f).stat().st_mtime_ns for f in files} == before

    # a second run as the writer: every graph found by hash; a runtime that loads executables compiles nothing
    again = worker("step", "--cache", str(alone))
    assert again["PersistentCacheMiss"] == 0 and again["files"] == first["files"], again
    if again["PersistentCacheHit"] == 0:  # torch_xla 2.9's XLA:CPU (and TPU) client cannot load them: said once
        assert again["PersistentCacheDeserializeFailure"] == len(first["files"])
        said = [line for line in again["log"] if "pytorch/xla#9094" in line]
        assert len(said) == 1 and said[0].startswith("WARNING compilation cache "), again["log"]
        # the default ("auto") cache is then skipped for this runtime: no writing for nothing
        auto = run_python([WORKER, "step", "--cache", "auto"], env={"HF_XLA_FSDP_COMPILATION_CACHE": str(alone)})
        assert auto.returncode == 0, auto.stderr[-2000:]
        state = json.loads(auto.stdout.strip().splitlines()[-1])
        assert state["path"] is None and "cannot load it (pytorch/xla#9094)" in state["reason"], state
