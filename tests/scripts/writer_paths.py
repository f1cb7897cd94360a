"""Every way the project writes a checkpoint, and what must hold of each one: it verifies, consolidates into a
``from_pretrained``-ready model equal to the trained weights, and resumes bit-exactly into a fresh model.

The cases are the model states a writer can meet: built on ``meta``, eager on the host, eager already on the XLA
device (what the Trainer and accelerate do to an eager model before wrapping it, whatever the settings source), fp32
or bf16 compute, tied weights (GPT-2), non-persistent buffers (Llama's rotary ``inv_freq``), persistent float buffers
(ResNet's BatchNorm statistics), LoRA (eager peft and adapters attached on meta), synchronous and background saves,
and a checkpoint of the writer before its ``buffer_info`` fix (which must still load).

tests/integration/test_writer_paths.py runs the FSDP v1 cases in its own process (one XLA device) and starts this
script for FSDP v2 (``python writer_paths.py --version 2 --out DIR``, ``CPU_NUM_DEVICES=4``: SPMD is a property of the
process); it prints one JSON line ``{"case": "ok" | "<failure>"}``.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

os.environ.setdefault("PJRT_DEVICE", "CPU")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

import torch  # noqa: E402
from helpers import tiny_gpt2, tiny_llama  # noqa: E402

from hf_xla_fsdp import XlaFsdpPlugin  # noqa: E402
from hf_xla_fsdp.session import AsyncMode, XlaFsdpSession  # noqa: E402

#: small enough that every distinct graph compiles in a second or two
LLAMA = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=32)
GPT2 = dict(vocab_size=96, n_embd=32, n_layer=2, n_head=4, n_positions=32)

#: case name -> engines it applies to
CASES = {
    "meta_bf16": (1, 2), "eager_host_bf16": (1, 2), "eager_device_bf16": (1, 2), "eager_device_fp32": (1, 2),
    "tied_gpt2_bf16": (1, 2), "lora_eager_bf16": (1, 2), "lora_meta_bf16": (1, 2), "batchnorm_bf16": (1,),
    "async_eager_device_bf16": (1, 2), "two_ranks_eager_device_bf16": (1,), "before_buffer_info_fix": (1,),
}


def _resnet_config() -> Any:
    from transformers import ResNetConfig

    return ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic",
                        num_labels=3)


def _lora() -> Any:
    from peft import LoraConfig

    return LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"], lora_dropout=0.0)


def _eager(config: Any, seed: int) -> torch.nn.Module:
    from transformers import AutoModelForCausalLM, AutoModelForImageClassification

    torch.manual_seed(seed)
    if getattr(config, "model_type", "") == "resnet":
        return AutoModelForImageClassification.from_config(config)
    return AutoModelForCausalLM.from_config(config)


def build(case: str, version: int, seed: int, rank: int = 0, world: int = 1) -> tuple[torch.nn.Module, XlaFsdpSession]:
    """The wrapped model of ``case`` (rank ``rank`` of ``world``, FSDP v1 only for world > 1) and its session."""
    from hf_xla_fsdp.runtime import xla_device

    settings: dict[str, Any] = {"version": version}
    if "fp32" not in case:
        settings["compute_dtype"] = "bfloat16"
    if world > 1:
        settings.update(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world)
    if case == "batchnorm_bf16":
        settings["transformer_layer_cls_to_wrap"] = "ResNetBasicLayer"
    session = XlaFsdpSession(XlaFsdpPlugin(**settings))
    session.setup_runtime()
    config = tiny_gpt2(**GPT2) if case.startswith("tied") else \
        _resnet_config() if case == "batchnorm_bf16" else tiny_llama(**LLAMA)
    if case.startswith("meta"):
        torch.manual_seed(seed)
        return session.build_model(config, progress=False), session
    if case == "lora_meta_bf16":
        torch.manual_seed(seed)
        return session.build_model(config, progress=False, peft_config=_lora()), session
    model = _eager(config, seed)
    if case.startswith("lora"):
        from peft import get_peft_model

        model = get_peft_model(model, _lora())
    if "host" not in case:
        model = model.to(xla_device())  # as Trainer and Accelerator.prepare place an eager model before wrapping
    return session.wrap_model(model), session


def make_optimizer(model: torch.nn.Module, session: XlaFsdpSession, seed: int, rank: int = 0) -> torch.optim.Optimizer:
    """AdamW after one step on random gradients of the trainable parameters (seeded by ``seed`` and ``rank``): trained
    weights and optimizer moments to save, without compiling a forward and backward per model (and in-process ranks
    of a larger world cannot meet in the collectives a real step needs)."""
    from hf_xla_fsdp.runtime import sync

    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = session.prepare_optimizer(model, torch.optim.AdamW(trainable, lr=1e-2))
    g = torch.Generator().manual_seed(seed * 1000 + rank)
    for p in trainable:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype).to(p.device)
    optimizer.step()
    optimizer.zero_grad()
    sync()
    return optimizer


def host_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer, session: XlaFsdpSession) -> dict[str, Any]:
    """What a resume must reproduce: the rank's saved tensors (model and optimizer) on the host."""
    state = session.engine.rank_state(model, optimizer)
    return {name: state.produce(name).clone() for name, _, _ in state.specs}


@contextlib.contextmanager
def writer_before_buffer_info_fix() -> Iterator[None]:
    """The FSDP v1 writer as it was: torch_xla's buffer_info stored as is (``_fpw_module.`` names, non-persistent
    buffers listed): what runs of examples/xla_fsdp.yaml wrote, which must still verify, consolidate and resume."""
    from hf_xla_fsdp.engines import v1

    kept = v1.saved_buffer_info
    v1.saved_buffer_info = lambda md, keys: md.get("buffer_info", {})
    try:
        yield
    finally:
        v1.saved_buffer_info = kept


def save(case: str, out: Path, models: list[torch.nn.Module], optimizers: list[Any],
         sessions: list[XlaFsdpSession]) -> Path:
    """Write ``case``'s checkpoint the way the integrations do (the session's CheckpointManager), or rank by rank for
    an in-process multi-rank world (as N processes would)."""
    ckpt = out / case / "checkpoint-1"
    peft = case.startswith("lora")
    if len(models) > 1:
        from hf_xla_fsdp.checkpoint import commit_checkpoint, write_rank_file

        for model, optimizer in zip(models, optimizers):
            write_rank_file(ckpt, model, optimizer, step=1)
        commit_checkpoint(ckpt, len(models))
        return ckpt
    checkpoints = sessions[0].checkpoints
    mode = AsyncMode.ASYNC if case.startswith("async") else AsyncMode.SYNC
    guard = writer_before_buffer_info_fix() if case == "before_buffer_info_fix" else contextlib.nullcontext()
    with guard:
        checkpoints.save(ckpt, models[0], optimizers[0], step=1, mode=mode, adapters=peft)
        assert checkpoints.wait() in (None, ckpt)
    return ckpt


def whole(t: torch.Tensor) -> torch.Tensor:
    """A host copy of the SPMD tensor ``t`` put together from its device shards (``.cpu()`` would compile a gather per
    tensor: 0.1 s each here)."""
    import torch_xla

    t = t.detach()
    if t.device.type != "xla":
        return t.clone()
    from hf_xla_fsdp.runtime import wait_device_ops

    wait_device_ops()
    out = torch.empty(t.shape, dtype=t.dtype)
    shards = torch_xla._XLAC._get_local_shards([t])[0]
    for (shard, _), (_, index) in zip(shards, torch_xla._XLAC._get_local_shard_replica_and_indices([t])[0]):
        if index is Ellipsis:
            out.copy_(shard)
        else:  # a shard of an uneven split is padded past the tensor's end
            out[index] = shard[tuple(slice(0, s.stop - s.start) for s in index)]
    return out


def reference_weights(case: str, models: list[torch.nn.Module], sessions: list[XlaFsdpSession]) -> dict[str, Any]:
    """The trained full weights under their original names, from the live models (independent of the files)."""
    engine = sessions[0].engine
    if engine.version == 2:
        from hf_xla_fsdp.engines.v2 import clean_name

        masters = getattr(models[0], "_hf_xla_fsdp_master_weights", None)
        by_id = {id(p): m for p, m in masters.pairs} if masters is not None else {}
        # the checkpoint holds the fp32 copies of trainable low-precision parameters
        out = {clean_name(name): whole(t) for name, t in models[0].state_dict().items()}
        out.update({clean_name(name): whole(by_id[id(p)]) for name, p in models[0].named_parameters() if id(p) in by_id})
        return out
    from helpers import consolidate

    return consolidate(models)


def check(case: str, ckpt: Path, out: Path, saved: list[dict[str, Any]], reference: dict[str, torch.Tensor],
          buffer_dtypes: dict[str, torch.dtype]) -> None:
    """verify, consolidate and resume ``ckpt``; raises AssertionError naming what differs."""
    from safetensors.torch import load_file

    from hf_xla_fsdp.checkpoint.verify import verify_checkpoint
    from hf_xla_fsdp.export.peft import consolidate_checkpoint

    summary = verify_checkpoint(ckpt)
    assert summary["ok"] and summary["files"] == len(saved), summary
    peft = case.startswith("lora")
    # consolidation as `hf-xla-fsdp consolidate` does it: the full model, or a PEFT model's adapter files; every tensor
    # equal to the trained weights, buffers back in the dtype they had before FSDP cast them
    target = out / case / "consolidated"
    consolidate_checkpoint(ckpt, target, progress=False)
    tensors: dict[str, torch.Tensor] = {}
    for f in sorted(target.glob("*.safetensors")):
        tensors.update(load_file(f))
    if peft:  # peft's file names leave out the adapter name
        reference = {n.replace(".default.", "."): t for n, t in reference.items() if "lora_" in n}
    for name, t in tensors.items():
        ref = reference.get(name)
        assert ref is not None, f"{case}: consolidated {name} is not a tensor of the model"
        if name in buffer_dtypes:
            assert t.dtype == buffer_dtypes[name], \
                f"{case}: buffer {name} consolidated as {t.dtype}, it was {buffer_dtypes[name]} before wrapping"
        assert torch.equal(t, ref.to(t.dtype)), f"{case}: consolidated {name} differs from the trained weights"
    # the reference holds a tied weight under both names (the files once)
    missing = sorted(set(reference) - set(tensors) - {"lm_head.weight"})
    assert not missing, f"{case}: consolidation lacks {missing[:3]}"
    if peft:
        from peft import PeftModel

        loaded = PeftModel.from_pretrained(_eager(tiny_llama(**LLAMA), seed=99), str(ckpt))  # as a stock checkpoint-N
        got = {n.replace(".default.", "."): p for n, p in loaded.named_parameters() if "lora_" in n}
        assert got.keys() == reference.keys() and all(torch.equal(got[n], reference[n]) for n in got), case


def resume(case: str, ckpt: Path, version: int, saved: list[dict[str, Any]], world: int) -> None:
    """A fresh model (other seed) of the same kind, loaded from ``ckpt``: every saved tensor equal, bit for bit."""
    from hf_xla_fsdp.checkpoint import load_checkpoint

    for rank in range(world):
        model, session = build(case, version, seed=7, rank=rank, world=world)
        optimizer = make_optimizer(model, session, seed=3, rank=rank)  # other weights and moments than the saved ones
        info = load_checkpoint(ckpt, model, optimizer)
        assert info["step"] == 1, info
        now = host_state(model, optimizer, session)
        assert set(now) == set(saved[rank]), f"{case}: resumed state has other tensors"
        for name, t in saved[rank].items():
            assert torch.equal(now[name], t), f"{case}: rank {rank} {name} differs after resume"


def buffers_before_wrapping(case: str) -> dict[str, torch.dtype]:
    """Floating persistent buffers of ``case``'s unwrapped model and their dtype (FSDP casts them to compute)."""
    if case != "batchnorm_bf16":
        return {}
    model = _eager(_resnet_config(), 0)
    persistent = model.state_dict()
    return {n: b.dtype for n, b in model.named_buffers() if n in persistent and b.is_floating_point()}


def run_case(case: str, version: int, out: Path) -> None:
    """Write ``case``'s checkpoint, then verify, consolidate and resume it."""
    world = 2 if case.startswith("two_ranks") else 1
    models, sessions, optimizers = [], [], []
    for rank in range(world):
        model, session = build(case, version, seed=0, rank=rank, world=world)
        optimizer = make_optimizer(model, session, seed=1, rank=rank)
        models.append(model)
        sessions.append(session)
        optimizers.append(optimizer)
    saved = [host_state(m, o, s) for m, o, s in zip(models, optimizers, sessions)]
    reference = reference_weights(case, models, sessions)
    ckpt = save(case, out, models, optimizers, sessions)
    check(case, ckpt, out, saved, reference, buffers_before_wrapping(case))
    resume(case, ckpt, version, saved, world)


def run_all(version: int, out: Path, only: Callable[[str], bool] = lambda c: True) -> dict[str, str]:
    """Every case of ``version``: ``{"case": "ok" | "<the failure>"}``."""
    results = {}
    for case, engines in CASES.items():
        if version not in engines or not only(case):
            continue
        try:
            start = time.perf_counter()
            run_case(case, version, out)
            print(f"{case}: {time.perf_counter() - start:.1f} s", file=sys.stderr, flush=True)
            results[case] = "ok"
        except Exception as err:  # noqa: BLE001 - every case reports, the test names the failures
            results[case] = f"{type(err).__name__}: {err}"
            traceback.print_exc()
    return results


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--version", type=int, default=2)
    p.add_argument("--out", required=True)
    p.add_argument("--only", default=None, help="comma-separated case names")
    args = p.parse_args()
    wanted = set(args.only.split(",")) if args.only else None
    gc.freeze()  # FSDP v1's constructor runs gc.collect() per unit: over the imports' objects, 0.8 s each here
    results = run_all(args.version, Path(args.out), lambda c: wanted is None or c in wanted)
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    main()
