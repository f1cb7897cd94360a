"""``scan_layers`` against the unrolled model, in one SPMD process over 4 XLA:CPU devices (FSDP v2).

    python scan_worker.py {equal,lora,resume,bf16}... [--out DIR]

Prints one JSON line (with several modes, one object of their reports by mode). ``equal``: Llama (with and
without activation checkpointing) and GPT-2 (tied embeddings),
the same initial weights trained 2 AdamW steps unrolled and scanned: losses, the largest gradient and parameter
differences. ``lora``: the same for a PEFT LoRA model (adapter gradients). ``resume``: a scanned model built on
meta from a pretrained directory trains and saves a checkpoint, an unrolled one loads it (parameter differences)
and the checkpoint consolidates into a directory whose ``from_pretrained`` logits are compared with the scanned model.
"""

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch
import torch_xla
import torch_xla.runtime as xr

xr.use_spmd()

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/: helpers

from helpers import tiny_gpt2, tiny_llama  # noqa: E402
from transformers import AutoModelForCausalLM, GPT2LMHeadModel, LlamaForCausalLM  # noqa: E402

from hf_xla_fsdp import XlaFsdpPlugin, XlaFsdpSession  # noqa: E402

STEPS = 2


def batches() -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return [torch.randint(0, 96, (4, 16), generator=g) for _ in range(STEPS)]


def make(family: str) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "gpt2":
        return GPT2LMHeadModel(tiny_gpt2(vocab_size=96, n_layer=3, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))
    return LlamaForCausalLM(tiny_llama(vocab_size=96, num_hidden_layers=3))


def train(model: torch.nn.Module, session: XlaFsdpSession, optimizer=None, steps=None):
    """AdamW steps over ``batches()[steps]``; the losses, the gradients of the first step (by the user's parameter
    names) and the optimizer."""
    if optimizer is None:
        params = [p for p in model.parameters() if p.requires_grad]
        optimizer = session.prepare_optimizer(model, torch.optim.AdamW(params, lr=1e-2))
    losses, grads = [], {}
    for step, ids in enumerate(batches()[steps or slice(None)]):
        ids = ids.to(torch_xla.device())
        loss = model(input_ids=ids, labels=ids).loss
        if step == 0:
            # how many layers the compiled graph holds: a scanned stack is one `while` loop
            hlo = torch_xla._XLAC._get_xla_tensors_hlo([loss])
            train.while_loops = hlo.count(" while(")
        loss.backward()
        if step == 0:
            torch_xla.sync()  # one graph for every gradient (reading them one by one would compile one graph each)
            grads = by_layer(model, session, {n: p.grad for n, p in model.named_parameters() if p.grad is not None})
        optimizer.step()
        optimizer.zero_grad()
        torch_xla.sync()
        losses.append(loss.item())
    return losses, grads, optimizer


def by_layer(model: torch.nn.Module, session: XlaFsdpSession, tensors: dict) -> dict[str, torch.Tensor]:
    """Host copies of ``tensors`` (by wrapped parameter name) under the user's names; a stacked parameter
    (scan_layers) is split into its layers."""
    origins = session.engine.parameter_origins(model)
    out = {}
    for name, t in tensors.items():
        t = t.detach().cpu()
        names = origins[name]
        if len(names) == 1:
            out[names[0]] = t
        else:
            out.update(zip(names, t.unbind(0)))
    return out


def params(model: torch.nn.Module, session: XlaFsdpSession) -> dict[str, torch.Tensor]:
    return by_layer(model, session, dict(model.named_parameters()))


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def compare(build, **settings) -> dict:
    runs = {}
    for scan in (False, True):
        session = XlaFsdpSession(XlaFsdpPlugin(version=2, scan_layers=scan, **settings))
        model = build(session)
        losses, grads, _ = train(model, session)
        runs[scan] = (losses, grads, params(model, session), train.while_loops)
    (l0, g0, p0, w0), (l1, g1, p1, w1) = runs[False], runs[True]
    return {"losses": [l0, l1], "while_loops": [w0, w1], "grad_diff": max_diff(g0, g1), "param_diff": max_diff(p0, p1),
            "grad_max": max(g.abs().max().item() for g in g0.values()), "n_grads": len(g1)}


def cmd_equal(args: argparse.Namespace) -> dict:
    return {
        "llama": compare(lambda s: s.wrap_model(make("llama"))),
        "llama_ckpt": compare(lambda s: s.wrap_model(make("llama")), activation_checkpointing=True),
        "gpt2": compare(lambda s: s.wrap_model(make("gpt2"))),
    }


def cmd_lora(args: argparse.Namespace) -> dict:
    from peft import LoraConfig, get_peft_model

    def build(session: XlaFsdpSession) -> torch.nn.Module:
        model = get_peft_model(make("llama"), LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"],
                                                         lora_dropout=0.0, init_lora_weights=False))
        return session.wrap_model(model)

    return compare(build)


def cmd_resume(args: argparse.Namespace) -> dict:
    """Scanned -> consolidated (from_pretrained logits), scanned -> unrolled and unrolled -> scanned (model weights),
    scanned -> scanned with the optimizer (the next step), and the one line for the optimizer across the setting."""
    from hf_xla_fsdp.checkpoint.consolidate import consolidate_into
    from hf_xla_fsdp.errors import CheckpointError

    out = Path(args.out)
    pretrained = out / "pretrained"
    make("llama").save_pretrained(pretrained)

    def build(scan: bool) -> tuple[torch.nn.Module, XlaFsdpSession, torch.optim.Optimizer]:
        session = XlaFsdpSession(XlaFsdpPlugin(version=2, scan_layers=scan))
        model = session.build_model(pretrained, progress=False)  # meta, block by block
        return model, session, session.prepare_optimizer(model, torch.optim.AdamW(model.parameters(), lr=1e-2))

    scanned, scanned_session, optimizer = build(True)
    scanned_is_scanned = any(type(m).__name__ == "ScannedLayers" for m in scanned.modules())
    train(scanned, scanned_session, optimizer, steps=slice(0, 1))
    ckpt = out / "ckpt"
    scanned_session.checkpoints.save(ckpt, scanned, optimizer, step=1)
    consolidated = out / "consolidated"
    consolidate_into(ckpt, consolidated)
    reloaded = AutoModelForCausalLM.from_pretrained(consolidated)
    ids = batches()[0]
    with torch.no_grad():
        scanned.eval()  # evaluation scans too (no KV cache)
        want = scanned(input_ids=ids.to(torch_xla.device())).logits.cpu()
        got = reloaded(input_ids=ids).logits
    scanned.train()
    trained = params(scanned, scanned_session)

    unrolled, unrolled_session, unrolled_optimizer = build(False)
    try:
        unrolled_session.checkpoints.load(ckpt, unrolled, unrolled_optimizer)
        optimizer_error = None
    except CheckpointError as err:
        optimizer_error = str(err)
    unrolled_session.checkpoints.load(ckpt, unrolled)
    to_unrolled = max_diff(trained, params(unrolled, unrolled_session))
    back = out / "unrolled"
    unrolled_session.checkpoints.save(back, unrolled, step=1)
    again, again_session, _ = build(True)
    again_session.checkpoints.load(back, again)
    to_scanned = max_diff(trained, params(again, again_session))

    resumed, resumed_session, resumed_optimizer = build(True)
    resumed_session.checkpoints.load(ckpt, resumed, resumed_optimizer)
    train(scanned, scanned_session, optimizer, steps=slice(1, 2))
    train(resumed, resumed_session, resumed_optimizer, steps=slice(1, 2))
    next_step_diff = max_diff(params(scanned, scanned_session), params(resumed, resumed_session))
    return {"scanned": scanned_is_scanned, "to_unrolled": to_unrolled, "to_scanned": to_scanned,
            "optimizer_error": optimizer_error, "next_step_diff": next_step_diff,
            "logits_diff": (want - got).abs().max().item(),
            "names_equal": sorted(reloaded.state_dict()) == sorted(make("llama").state_dict())}


def cmd_bf16(args: argparse.Namespace) -> dict:
    """compute_dtype bfloat16 (parameters in bf16, the optimizer on fp32 copies): scanned vs unrolled losses, and a
    scanned checkpoint's fp32 copies loaded into an unrolled run."""
    from hf_xla_fsdp.engines.master_weights import master_weights

    def fp32_copies(model: torch.nn.Module, session: XlaFsdpSession) -> dict[str, torch.Tensor]:
        masters = master_weights(model)
        return by_layer(model, session, {n: masters.master(p) for n, p in model.named_parameters()
                                         if masters.master(p) is not None})

    runs = {}
    for scan in (False, True):
        session = XlaFsdpSession(XlaFsdpPlugin(version=2, scan_layers=scan, compute_dtype="bfloat16"))
        model = session.wrap_model(make("llama"))
        losses, _, optimizer = train(model, session)
        runs[scan] = (losses, model, session)
    ckpt = Path(args.out) / "bf16"
    _, scanned, scanned_session = runs[True]
    scanned_session.checkpoints.save(ckpt, scanned, step=2)
    unrolled_session = XlaFsdpSession(XlaFsdpPlugin(version=2, compute_dtype="bfloat16"))
    unrolled = unrolled_session.wrap_model(make("llama"))
    unrolled_session.checkpoints.load(ckpt, unrolled)
    want, got = fp32_copies(scanned, scanned_session), fp32_copies(unrolled, unrolled_session)
    return {"losses": [runs[False][0], runs[True][0]], "n_copies": len(want),
            "dtypes": sorted({str(p.dtype) for p in scanned.parameters()}), "resumed_diff": max_diff(want, got),
            "bf16_diff": max_diff(params(scanned, scanned_session), params(unrolled, unrolled_session))}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("what", nargs="+", choices=["equal", "lora", "resume", "bf16"])
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    if args.out is None:
        args.out = tempfile.mkdtemp()
    commands = {"equal": cmd_equal, "lora": cmd_lora, "resume": cmd_resume, "bf16": cmd_bf16}
    # several in one process share its start (imports, SPMD over 4 devices): {what: report} then
    results = {what: commands[what](args) for what in args.what}
    print(json.dumps(results[args.what[0]] if len(args.what) == 1 else results))


if __name__ == "__main__":
    main()
