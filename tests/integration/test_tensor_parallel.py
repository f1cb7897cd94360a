"""FSDP v2 x tensor parallelism on 8 XLA:CPU devices, on a tiny Llama: 2D shardings of weights and activations (and
what XLA really all-gathers), equality with the 1D mesh, 2D<->1D and hybrid resume, consolidation through the CLI,
the stock Trainer script. Other families and LoRA: test_tensor_parallel_models.py."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Optional

import pytest
import torch
from helpers import ROOT, SCRIPTS, run_python

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

WORKER = SCRIPTS / "tp_worker.py"
DEVICES = 8


def worker(*args: str, dump: Optional[Path] = None) -> dict:
    """One tp_worker.py scenario on 8 XLA:CPU devices; its JSON report. ``dump``: XLA writes its HLO there."""
    env = {"XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} --xla_dump_to={dump} --xla_dump_hlo_as_text".strip()} \
        if dump else None
    # a run that dumps its HLO has XLA_FLAGS of its own, which would need a preloaded server of its own: fresh
    res = run_python([WORKER, *args], devices=DEVICES, timeout=600, env=env, preloaded=dump is None)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def tiles(spec: str) -> list[int]:
    """The tile grid of an XLA sharding annotation, e.g. ``[2, 4]`` for ``{devices=[2,4]...}``."""
    return [int(d) for d in re.search(r"devices=\[([\d,]+)\]", spec).group(1).split(",")]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Llama on fsdp 4 x tensor 2 and on fsdp 8, each trained, checkpointed and resumed on the other mesh."""
    root = tmp_path_factory.mktemp("tp")
    # the 1D run asks for tensor_parallel_size=auto: XLA:CPU reports no memory limit, so the planner picks 1
    out = {t: worker("train", "--tensor", "auto" if t == 1 else "2", "--out", str(root / f"t{t}"), dump=root / f"hlo{t}")
           for t in (2, 1)}
    for saved, loaded in ((2, 1), (1, 2)):
        out[f"{saved}->{loaded}"] = worker("resume", "--tensor", str(loaded), "--ckpt", str(root / f"t{saved}" / "ckpt"),
                                           "--ref", str(root / f"t{saved}" / "ref.safetensors"))
    out["root"] = root
    return out


@pytest.mark.slow
def test_weights_split_over_fsdp_and_tensor(runs):
    two = runs[2]
    assert two["mesh"] == {"replica": 1, "fsdp": 4, "tensor": 2}
    specs = two["specs"]
    for i in range(2):
        layer = f"model.layers.{i}."
        for name in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"):
            assert tiles(specs[layer + name + ".weight"]) == [2, 4], name  # column: out over tensor, in over fsdp
        for name in ("self_attn.o_proj", "mlp.down_proj"):
            assert tiles(specs[layer + name + ".weight"]) == [4, 2], name  # row: out over fsdp, in over tensor
        # 1-D parameters: over fsdp only (over all 8, XLA would all-gather their [batch, seq, hidden] broadcast)
        assert tiles(specs[layer + "input_layernorm.weight"]) == [4, 2] and "last_tile_dim_replicate" in specs[
            layer + "input_layernorm.weight"]
    assert tiles(specs["model.embed_tokens.weight"]) == [2, 4] and tiles(specs["lm_head.weight"]) == [2, 4]
    assert all("last_tile_dim_replicate" not in s for n, s in specs.items() if "norm" not in n)  # no 2-D one replicated
    # activations: q / up split over batch (fsdp) and features (tensor); attention, MLP and block outputs over
    # batch only, replicated over tensor (XLA all-reduces the row-parallel partial sums there)
    act = two["activation_specs"]
    assert tiles(act["q"]) == [4, 1, 2] and tiles(act["mlp_in"]) == [4, 1, 2]
    for name in ("attn", "mlp", "block"):
        assert tiles(act[name]) == [4, 1, 1, 2] and "last_tile_dim_replicate" in act[name], (name, act[name])
    # each device holds 1/8 of every 2-D parameter as on the 1D mesh, 1/4 of the norms
    one_bytes, two_bytes = runs[1]["device_bytes"], two["device_bytes"]
    assert len(two_bytes) == DEVICES and all(one_bytes[d] < two_bytes[d] < one_bytes[d] * 1.01 for d in one_bytes)


def all_gathers(dump: Path) -> list[tuple[tuple[int, ...], str]]:
    """(output shape, replica groups) of every all-gather in the training step's partitioned HLO (its largest graph)."""
    step = max(dump.glob("*SyncTensorsGraph*cpu_after_optimizations.txt"), key=lambda f: f.stat().st_size)
    found = re.findall(r"= f32\[([\d,]+)\]\S* all-gather\(.*?replica_groups=(\S+)", step.read_text())
    return [(tuple(int(d) for d in shape.split(",")), groups) for shape, groups in found]


@pytest.mark.slow
def test_no_silent_full_replication_in_the_partitioned_step(runs):
    """What XLA really all-gathers in a training step: on the 2D mesh, weights over fsdp only and no activation."""
    one, two = (all_gathers(runs["root"] / f"hlo{t}") for t in (1, 2))
    full_mlp = {(128, 64), (64, 128)}  # whole gate/up/down_proj weights of the tiny Llama
    assert full_mlp <= {shape for shape, _ in one}  # the 1D mesh gathers them whole (the check can fail)
    assert not full_mlp & {shape for shape, _ in two}, two  # the 2D mesh gathers 1/2 of each, over fsdp
    # no activation ([batch, seq, ...], [batch, heads, seq, head_dim]) is ever gathered: attention stays on the
    # local heads, hidden states on the local samples
    assert all(len(shape) <= 2 for shape, _ in two), [g for g in two if len(g[0]) > 2]


@pytest.mark.slow
def test_trains_like_the_1d_mesh(runs):
    one, two = runs[1], runs[2]
    assert one["mesh"] == {"replica": 1, "fsdp": 8}
    assert one["losses"][-1] < one["losses"][0] - 0.05  # it trains
    # fp32, same init and data: only the order of sharded sums differs
    both = one["losses"] + one["continued"], two["losses"] + two["continued"]
    assert max(abs(a - b) for a, b in zip(*both)) < 1e-4, both


@pytest.mark.slow
def test_resume_across_meshes_is_bit_exact(runs):
    for saved, loaded in ((2, 1), (1, 2)):
        r = runs[f"{saved}->{loaded}"]
        assert r["differ"] == [] and r["missing"] == [], r
        # the resumed run continues like the run that saved (another mesh: sums in another order only)
        assert max(abs(a - b) for a, b in zip(r["continued"], runs[saved]["continued"])) < 1e-4


def consolidated_logits_diff(run: Path) -> float:
    """Consolidate ``run``/ckpt with the CLI; max |logits| difference of its from_pretrained model vs. the trained one."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_xla_fsdp.cli import main

    assert main(["consolidate", str(run / "ckpt"), "--output", str(run / "final"), "--quiet"]) == 0
    model, info = AutoModelForCausalLM.from_pretrained(run / "final", output_loading_info=True)
    assert {k: sorted(v) for k, v in info.items() if k != "error_msgs"} == {
        "missing_keys": [], "unexpected_keys": [], "mismatched_keys": []}
    saved = load_file(str(run / "logits.safetensors"))
    with torch.no_grad():
        return float((model(input_ids=saved["ids"]).logits - saved["logits"]).abs().max())


@pytest.mark.slow
def test_2d_checkpoint_consolidates_into_the_trained_model(runs):
    assert consolidated_logits_diff(runs["root"] / "t2") < 1e-4


@pytest.mark.slow
def test_stock_trainer_script_on_a_2d_mesh(tmp_path):
    """examples/run_clm.py (the Trainer) with ``"tensor_parallel_size": 2`` in its --fsdp_config, on 4 devices."""
    from transformers import AutoModelForCausalLM

    config = json.loads((ROOT / "examples" / "xla_fsdp_v2_config.json").read_text())
    (tmp_path / "fsdp.json").write_text(json.dumps({**config, "tensor_parallel_size": 2}))
    out = tmp_path / "run"
    res = run_python([ROOT / "examples" / "run_clm.py", "--fsdp", "--fsdp_config", tmp_path / "fsdp.json",
                      "--max_steps", "20", "--save_steps", "10", "--logging_steps", "1", "--per_device_train_batch_size",
                      "4", "--learning_rate", "3e-3", "--report_to", "none", "--max_eval_samples", "16", "--seed", "7",
                      "--output_dir", out], devices=4, timeout=900, preloaded=True)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    meta = json.loads((out / "checkpoint-10" / "rank-00000-of-00001.json").read_text())
    assert meta["devices"] == 4 and meta["plugin"]["tensor_parallel_size"] == 2
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    losses = [e["loss"] for e in history if "loss" in e]
    assert len(losses) == 20 and losses[-1] < losses[0] - 1.0  # it learns
    _, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)  # the final save, consolidated
    assert not info["missing_keys"] and not info["unexpected_keys"]


@pytest.mark.slow
def test_hybrid_replica_fsdp_tensor_mesh(runs, tmp_path):
    """replica 2 x fsdp 2 x tensor 2: trains like fsdp 8; its checkpoint (replica 0's pieces) resumes on fsdp 8."""
    three = worker("train", "--tensor", "2", "--replicas", "2", "--out", str(tmp_path))
    assert three["mesh"] == {"replica": 2, "fsdp": 2, "tensor": 2}
    q = three["specs"]["model.layers.0.self_attn.q_proj.weight"]
    assert tiles(q) == [2, 2, 2] and "last_tile_dim_replicate" in q  # split 2 x 2, replicated over replica
    one = runs[1]
    both = one["losses"] + one["continued"], three["losses"] + three["continued"]
    assert max(abs(a - b) for a, b in zip(*both)) < 1e-4, both
    back = worker("resume", "--tensor", "1", "--ckpt", str(tmp_path / "ckpt"), "--ref", str(tmp_path / "ref.safetensors"))
    assert back["differ"] == [] and back["missing"] == []
