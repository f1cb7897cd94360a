"""FSDP v2 with tensor parallelism on ``CPU_NUM_DEVICES`` XLA:CPU devices, in a fresh process; prints one JSON line.

``python tests/scripts/tp_worker.py train --family llama --tensor 2 --out DIR``: build the tiny model on a
(1, devices / T, T) mesh, report the weights' and activations' XLA shardings, train a few AdamW steps, save a
checkpoint (DIR/ckpt), the trained parameters (DIR/ref.safetensors) and eval logits (DIR/logits.safetensors),
then train two more steps. ``--family gpt2,qwen2 --out ROOT``: each family in turn in this one process (one start-up
and one runtime for several models: what a test needs of each is its own model's), into ROOT/<family>; the JSON
line maps each family to its report. ``resume --ckpt DIR/ckpt --ref DIR/ref.safetensors --tensor T``: load that checkpoint
into a model on another mesh, report which parameters differ from the saved ones, then train the same two steps.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import torch  # noqa: E402
from helpers import tiny_gpt2, tiny_llama  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from hf_xla_fsdp import XlaFsdpPlugin  # noqa: E402
from hf_xla_fsdp.checkpoint import load_checkpoint, save_checkpoint  # noqa: E402
from hf_xla_fsdp.engines import v2 as spmd  # noqa: E402
from hf_xla_fsdp.runtime import wait_device_ops  # noqa: E402
from hf_xla_fsdp.train import arithmetic_lm_batches, train_step  # noqa: E402

VOCAB = 128
STEPS = 4  # before the checkpoint
MORE = 2  # after it (the resumed run repeats these)


def config(family: str):
    """The tiny model of ``family``: hidden 64, 2 layers, 4 heads (2 KV heads where the family has GQA)."""
    if family == "gpt2":
        return tiny_gpt2(n_layer=2, vocab_size=VOCAB)
    if family == "gemma":  # tied embeddings, scaled by sqrt(hidden)
        from transformers import GemmaConfig

        return GemmaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    if family == "mistral":  # sliding-window attention
        from transformers import MistralConfig

        return MistralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, sliding_window=8)
    if family == "qwen2":
        from transformers import Qwen2Config

        return Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                           tie_word_embeddings=False)
    return tiny_llama(num_hidden_layers=2, vocab_size=VOCAB)


def batches() -> list[dict[str, torch.Tensor]]:
    """The same 8-sample batches in every run."""
    data = arithmetic_lm_batches(VOCAB, 16, 8, seed=3)
    return [next(data) for _ in range(STEPS + MORE + 1)]


def steps(model: torch.nn.Module, optimizer: torch.optim.Optimizer, data: list, mesh) -> list[float]:
    """Train on ``data`` (split over every device); the losses."""
    import torch_xla

    device = torch_xla.device()
    return [train_step(model, spmd.shard_batch({k: v.to(device) for k, v in b.items()}, mesh), optimizer).item()
            for b in data]


def host_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter, gathered to the host, by its user name (a tied weight once)."""
    return {spmd.clean_name(n): p.detach().cpu().contiguous() for n, p in model.named_parameters()}


def main() -> None:
    """Run one scenario."""
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["train", "resume"])
    p.add_argument("--family", default="llama")
    p.add_argument("--tensor", default="1", help="tensor_parallel_size (a number or 'auto')")
    p.add_argument("--replicas", type=int, default=1, help="replica_size")
    p.add_argument("--out", default=None)
    p.add_argument("--ckpt", default=None)
    p.add_argument("--ref", default=None)
    p.add_argument("--dtype", default=None, help="compute_dtype (bf16: parameters in bf16, fp32 master copies)")
    p.add_argument("--lora", action="store_true", help="LoRA adapters on q_proj, v_proj and down_proj")
    args = p.parse_args()
    plugin = XlaFsdpPlugin(version=2, activation_checkpointing=True, tensor_parallel_size=args.tensor,
                           replica_size=args.replicas, compute_dtype=args.dtype)
    families = args.family.split(",")
    if len(families) == 1:
        print(json.dumps(run(args, plugin, families[0], args.out)))
        return
    reports = {}
    for family in families:
        reports[family] = run(args, plugin, family, str(Path(args.out) / family))
        gc.collect()  # the previous family's model and optimizer state leave the devices
    print(json.dumps(reports))


def run(args: argparse.Namespace, plugin: XlaFsdpPlugin, family: str, out: str) -> dict:
    """One scenario for one model family; its report."""
    import torch_xla

    torch.manual_seed(0 if args.mode == "train" else 1)  # a resumed model differs until the checkpoint loads
    peft_config = None
    if args.lora:
        from peft import LoraConfig

        peft_config = LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
    model = plugin.build(config(family), progress=False, peft_config=peft_config)
    mesh = spmd.get_mesh(plugin)
    data = batches()
    report: dict = {"mesh": dict(zip(mesh.axis_names, mesh.mesh_shape)),
                    "dtypes": sorted({str(q.dtype) for q in model.parameters()})}
    optimizer = torch.optim.AdamW([q for q in model.parameters() if q.requires_grad], lr=1e-2)
    plugin.prepare_optimizer(model, optimizer)  # bf16: AdamW updates the fp32 master copies
    if args.mode == "resume":
        load_checkpoint(args.ckpt, model, optimizer)
        ref = load_file(args.ref)
        here = host_params(model)
        report["differ"] = sorted(n for n in ref if n not in here or not torch.equal(ref[n], here[n]))
        report["missing"] = sorted(set(here) - set(ref))
        report["continued"] = steps(model, optimizer, data[STEPS:STEPS + MORE], mesh)
        return report
    report["specs"] = {spmd.clean_name(n): spmd.sharding_spec(q) for n, q in model.named_parameters()}
    wait_device_ops()  # placements are readable only once the optimizer state's creation has run
    report["device_bytes"] = spmd.device_bytes(model)
    # the shardings XLA sees on activations: a block's output, and inside it the attention's and the MLP's
    blocks = next(m for n, m in model.named_modules() if isinstance(m, torch.nn.ModuleList)
                  and spmd.clean_name(n).endswith(("layers", ".h")))
    first = blocks[0]
    inner = spmd.XlaFsdpV2().unwrap(first)
    seen: dict[str, str] = {}

    def spy(name: str):
        def hook(_m, _i, out):
            t = out[0] if isinstance(out, tuple) else out
            seen[name] = spmd.sharding_spec(t)
        return hook

    targets = {"block": first}
    if family == "gpt2":
        targets.update({"attn": inner.attn.c_proj, "mlp_in": inner.mlp.c_fc, "mlp": inner.mlp.c_proj})
    else:
        targets.update({"q": inner.self_attn.q_proj, "attn": inner.self_attn.o_proj, "mlp_in": inner.mlp.up_proj,
                        "mlp": inner.mlp.down_proj})
    handles = [m.register_forward_hook(spy(k)) for k, m in targets.items()]
    ids = data[-1]["input_ids"]
    model.eval()
    with torch.no_grad():
        model(input_ids=spmd.shard_batch({"i": ids.to(torch_xla.device())}, mesh)["i"])
    model.train()
    for h in handles:
        h.remove()
    report["activation_specs"] = seen
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    report["losses"] = steps(model, optimizer, data[:STEPS], mesh)
    save_checkpoint(out / "ckpt", model, optimizer, step=STEPS, plugin=plugin)
    save_file(host_params(model), str(out / "ref.safetensors"))
    model.eval()
    with torch.no_grad():
        logits = model(input_ids=spmd.shard_batch({"i": ids.to(torch_xla.device())}, mesh)["i"]).logits.cpu()
    model.train()
    save_file({"ids": ids, "logits": logits}, str(out / "logits.safetensors"))
    report["continued"] = steps(model, optimizer, data[STEPS:STEPS + MORE], mesh)
    return report


if __name__ == "__main__":
    main()
