"""Runs FSDP v2 (SPMD) scenarios in a fresh process with ``CPU_NUM_DEVICES`` devices; prints one JSON line.

SPMD mode and the device count are fixed per process, so tests/test_spmd.py starts this script as
``python tests/scripts/spmd_worker.py MODE [--replicas R] [--out DIR]`` with the environment it needs, or, for
several scenarios on the same devices in one process (each process start imports torch_xla and transformers: ~10 s of
CPU), ``spmd_worker.py --many '[["train"], ["train", "--replicas", "2"], ...]'``, printing the list of their reports.
Each scenario builds its own model and mesh; graphs the scenarios share are compiled once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import torch  # noqa: E402
from helpers import tiny_llama  # noqa: E402

from hf_xla_fsdp import XlaFsdpPlugin  # noqa: E402
from hf_xla_fsdp.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from hf_xla_fsdp.engines import v2 as spmd  # noqa: E402
from hf_xla_fsdp.train import arithmetic_lm_batches, train_step  # noqa: E402

CONFIG = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3)


def build(plugin: XlaFsdpPlugin, seed: int = 0) -> torch.nn.Module:
    """The tiny Llama, built on meta and sharded block by block with ``plugin``."""
    torch.manual_seed(seed)
    return plugin.build(tiny_llama(**CONFIG), progress=False)


def steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batches: list, mesh) -> list[float]:
    """Train on ``batches`` (split over every device); the losses."""
    import torch_xla

    device = torch_xla.device()
    return [train_step(model, spmd.shard_batch({k: v.to(device) for k, v in b.items()}, mesh), optimizer).item()
            for b in batches]


def logits(model: torch.nn.Module, ids: torch.Tensor, mesh) -> torch.Tensor:
    """Eval-mode logits of ``ids`` on the host."""
    import torch_xla

    model.eval()
    with torch.no_grad():
        out = model(input_ids=spmd.shard_batch({"i": ids.to(torch_xla.device())}, mesh)["i"]).logits.cpu()
    model.train()
    return out


def scenario(argv: list[str]) -> dict:
    """Run one scenario (``argv``: MODE and its options); its report."""
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["shard", "train", "roundtrip", "precision"])
    p.add_argument("--replicas", type=int, default=1)
    p.add_argument("--out", default=None)
    p.add_argument("--dtype", default=None, help="compute_dtype (precision mode)")
    args = p.parse_args(argv)
    import torch_xla.runtime as xr

    plugin = XlaFsdpPlugin(version=2, activation_checkpointing=True, replica_size=args.replicas,
                           compute_dtype=args.dtype)
    import hf_xla_fsdp.modeling.meta_init as wrapping  # where the build places each wrapped block

    order, replace = [], wrapping.replace_submodule

    def spy(root: torch.nn.Module, name: str, new: torch.nn.Module) -> None:
        # when block `name` is placed, which decoder layers still have parameters on meta
        layers = root.get_submodule("model.layers")
        order.append([name, [i for i, layer in enumerate(layers) if any(p.is_meta for p in layer.parameters())]])
        replace(root, name, new)

    wrapping.replace_submodule = spy
    model = build(plugin)
    wrapping.replace_submodule = replace
    mesh = spmd.get_mesh(plugin)
    report: dict = {"devices": xr.global_runtime_device_count(), "mesh": list(mesh.mesh_shape), "build_order": order}
    data = list(zip(range(12), arithmetic_lm_batches(128, 16, 8, seed=3)))
    batches = [b for _, b in data]
    if args.mode == "shard":
        report["specs"] = {spmd.clean_name(n): spmd.sharding_spec(p) for n, p in model.named_parameters()}
        report["device_bytes"] = spmd.device_bytes(model)
        report["total_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        report["units"] = sum(isinstance(m, spmd.spmd_class()) for m in model.modules())
    elif args.mode == "precision":
        from hf_xla_fsdp.engines.master_weights import master_weights

        out = Path(args.out)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)  # a fine-tuning rate
        report["losses"] = steps(model, optimizer, batches[:6], mesh)
        save_checkpoint(out / "ckpt", model, optimizer, step=6, plugin=plugin)
        report["losses"] += steps(model, optimizer, batches[6:12], mesh)
        report["param_dtypes"] = sorted({str(p.dtype) for p in model.parameters()})
        report["specs"] = {spmd.clean_name(n): spmd.sharding_spec(p) for n, p in model.named_parameters()}
        masters = master_weights(model)
        if masters is not None:
            names = {id(p): spmd.clean_name(n) for n, p in model.named_parameters()}
            report["master_specs"] = {names[id(p)]: spmd.sharding_spec(m) for p, m in masters.pairs}
        report["device_bytes"] = spmd.device_bytes(model)
        report["optimizer_state_bytes"] = sum(v.numel() * v.element_size() for s in optimizer.state.values()
                                              for k, v in s.items() if k != "step")
        meta = json.loads(next((out / "ckpt").glob("rank-*.json")).read_text())
        report["saved_dtypes"] = sorted({e["dtype"] for n, e in meta["tensors"].items() if n.startswith("model/")})
        resumed = build(plugin, seed=1)  # different weights until the checkpoint is loaded
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-3)
        load_checkpoint(out / "ckpt", resumed, resumed_opt)
        report["resumed"] = steps(resumed, resumed_opt, batches[6:12], mesh)
    elif args.mode == "train":
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        report["losses"] = steps(model, optimizer, batches[:6], mesh)
    else:
        from transformers import AutoModelForCausalLM

        from hf_xla_fsdp.checkpoint.consolidate import consolidate

        out = Path(args.out)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
        first = steps(model, optimizer, batches[:3], mesh)
        save_checkpoint(out / "ckpt", model, optimizer, step=3, plugin=plugin)
        report["continued"] = steps(model, optimizer, batches[3:6], mesh)
        resumed = build(plugin, seed=1)  # different weights until the checkpoint is loaded
        resumed_opt = torch.optim.AdamW(resumed.parameters(), lr=1e-2)
        info = load_checkpoint(out / "ckpt", resumed, resumed_opt)
        report["step"] = info["step"]
        report["state_specs_sharded"] = all(
            spmd.sharding_spec(v) for s in resumed_opt.state.values() for k, v in s.items() if k != "step")
        ids = batches[7]["input_ids"]
        sharded_logits = logits(resumed, ids, mesh)
        report["resumed"] = steps(resumed, resumed_opt, batches[3:6], mesh)
        report["first"] = first
        consolidate(out / "ckpt", out / "final", progress=False)
        full, info = AutoModelForCausalLM.from_pretrained(out / "final", output_loading_info=True)
        report["loading_info"] = {k: sorted(v) for k, v in info.items() if k != "error_msgs"}
        with torch.no_grad():
            report["logits_max_diff"] = float((full(input_ids=ids).logits - sharded_logits).abs().max())
    return report


def main() -> None:
    """One scenario's report, or with ``--many JSON`` the list of the reports of several, as one JSON line."""
    if sys.argv[1:2] == ["--many"]:
        print(json.dumps([scenario(argv) for argv in json.loads(sys.argv[2])]))
    else:
        print(json.dumps(scenario(sys.argv[1:])))


if __name__ == "__main__":
    main()
