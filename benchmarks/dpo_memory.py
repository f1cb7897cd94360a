"""Peak host RSS per rank of a DPO run with a reference model against the SFT run of the same model and rows: what
the reference costs each rank, on engine fsdp2 (torch's ``fully_shard``, CPU/gloo) in ``--world-size`` real
``torchrun`` processes.

    python benchmarks/dpo_memory.py [--world-size 2] [--steps 2] [--smoke]

Both runs give TRL's trainer the model's directory (the usual script: ``model=path``) through the one-import swap
(``xla_fsdp_trainer(DPOTrainer)``, ``xla_fsdp_trainer(SFTTrainer)``) with ``fsdp_config={"engine": "fsdp2"}``:

* dpo: ``DPOTrainer(model=dir)`` with no ``ref_model``: TRL builds the reference from the same path, here on meta
  block by block and sharded for inference (frozen, no optimizer state, no master copies);
* sft: ``SFTTrainer(model=dir)`` on the same texts: each preference pair becomes two prompt/completion rows (chosen,
  rejected) and the batch is twice DPO's, so both forward the same sequences per step.

Every rank reports its own VmHWM above its baseline (the RSS after the imports). Target (post-training issue): the
reference adds at most its shard, ``model bytes / N`` plus one block, to each rank's peak. The model: a Llama of
~168M parameters (hidden 1024, 8 layers, vocab 32000; 643 MiB fp32), fp32, AdamW, 16-token sequences (activations
are small next to the weights, so the figure is the weights'). ``--smoke``: a tiny model and one step.

glibc's default allocator moved these figures by +-100 MiB between ranks and runs (heap fragmentation around FSDP's
gathered blocks); engine fsdp2 now fixes glibc's mmap threshold at 1 MiB on the CPU (``map_large_host_allocations`` in
engines/fsdp2.py) unless ``MALLOC_MMAP_THRESHOLD_`` is in the environment, and the report says which setting ran.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import tempfile
from pathlib import Path

from _harness import add_smoke_flag, emit, mib, run_json_child, vm_hwm_bytes

MODEL = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8, num_attention_heads=16,
             num_key_value_heads=16, max_position_embeddings=128, tie_word_embeddings=False)
SMOKE_MODEL = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=4, max_position_embeddings=128, tie_word_embeddings=False)
WORDS = ["<pad>", ".", "<unk>", "up", *(str(i) for i in range(20))]
#: engine fsdp2's processes: transformers and accelerate stay off torch_xla, one OpenMP thread each
FSDP2_ENV = {"USE_TORCH_XLA": "0", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false",
             "HF_XLA_FSDP_COMPILATION_CACHE": "none", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}


def make_model(out: Path, model: dict) -> None:
    """A seeded Llama of ``model``'s shape with a word-level tokenizer, saved as a ``from_pretrained`` directory."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=".", pad_token="<pad>", unk_token="<unk>")
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**model, bos_token_id=1, eos_token_id=1, pad_token_id=0)).save_pretrained(out)
    tokenizer.save_pretrained(out)


def pairs(n: int) -> list[dict[str, str]]:
    """``n`` preference pairs: a count and its right continuation against a wrong one."""
    rng = random.Random(0)
    rows = []
    for _ in range(n):
        start = rng.randint(0, 12)
        rows.append({"prompt": "up " + " ".join(str(start + i) for i in range(3)),
                     "chosen": f" {start + 3} {start + 4} .", "rejected": f" {rng.randint(0, 19)} {rng.randint(0, 19)} ."})
    return rows


def child(kind: str, model_dir: str, out_dir: str, steps: int, batch: int) -> None:
    """One rank of a dpo or sft run; rank 0 reports every rank's baseline and peak."""
    import torch.distributed as dist
    from datasets import Dataset
    from transformers import AutoTokenizer
    from trl import DPOConfig, DPOTrainer, SFTConfig, SFTTrainer

    from hf_xla_fsdp import xla_fsdp_trainer

    baseline = vm_hwm_bytes()  # after the imports: what both runs pay before any model exists
    rows = pairs(batch * steps * 4)
    common = dict(output_dir=out_dir, max_steps=steps, learning_rate=1e-5, logging_steps=1, report_to="none",
                  save_strategy="no", bf16=False, seed=0, max_length=16, disable_tqdm=True,
                  fsdp_config={"engine": "fsdp2", "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"]})
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    if kind == "dpo":
        trainer = xla_fsdp_trainer(DPOTrainer)(
            model=model_dir, args=DPOConfig(per_device_train_batch_size=batch, **common),
            train_dataset=Dataset.from_list(rows), processing_class=tokenizer)
    else:  # the same sequences: a pair's chosen and rejected as two rows, twice the rows per batch
        texts = [{"prompt": r["prompt"], "completion": r[side]} for r in rows for side in ("chosen", "rejected")]
        trainer = xla_fsdp_trainer(SFTTrainer)(
            model=model_dir, args=SFTConfig(per_device_train_batch_size=2 * batch, **common),
            train_dataset=Dataset.from_list(texts), processing_class=tokenizer)
    trainer.train()
    mine = {"baseline_rss": baseline, "peak_rss": vm_hwm_bytes(),
            "reference": getattr(trainer, "ref_model", None) is not None}
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    if dist.get_rank() == 0:
        emit({"kind": kind, "ranks": every})


def main() -> None:
    """As a child run one rank; as the parent run both kinds and print the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--batch", type=int, default=2, help="preference pairs per rank and step")
    p.add_argument("--child", choices=["dpo", "sft"], help=argparse.SUPPRESS)
    p.add_argument("--model-dir", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", help=argparse.SUPPRESS)
    add_smoke_flag(p)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.model_dir, args.out_dir, args.steps, args.batch)
    if args.smoke:
        args.steps = 1
    model = SMOKE_MODEL if args.smoke else MODEL

    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.engines.fsdp2 import ENV_MMAP_THRESHOLD, HOST_MMAP_THRESHOLD
    from hf_xla_fsdp.planning.units import plan

    sizing = plan(LlamaConfig(**model), XlaFsdpPlugin(engine="fsdp2", transformer_layer_cls_to_wrap=["LlamaDecoderLayer"]),
                  world_size=args.world_size)
    largest = max(u["bytes"] for u in sizing["units"] if u["unit"] != "<root>")
    root = sum(u["bytes"] for u in sizing["units"] if u["unit"] == "<root>")  # embeddings + LM head, gathered at once
    reference_share = sizing["total_bytes"] / args.world_size + largest
    report: dict = {"smoke": args.smoke, "model_params": sizing["total_params"], "model_mib": mib(sizing["total_bytes"]),
                    "world_size": args.world_size, "largest_block_mib": mib(largest), "root_unit_mib": mib(root),
                    "target_extra_mib": mib(reference_share),
                    # engine fsdp2 fixes glibc's threshold on the CPU unless the environment sets it (engines/fsdp2.py)
                    "malloc_mmap_threshold": os.environ.get(ENV_MMAP_THRESHOLD, f"{HOST_MMAP_THRESHOLD} (engine fsdp2)")}
    with tempfile.TemporaryDirectory(prefix="dpo_memory-") as tmp:
        make_model(Path(tmp) / "model", model)
        runs = {}
        for kind in ("sft", "dpo"):
            runs[kind] = run_json_child(
                ["-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.world_size}", __file__,
                 "--child", kind, "--model-dir", Path(tmp) / "model", "--out-dir", Path(tmp) / kind,
                 "--steps", args.steps, "--batch", args.batch], name=f"{kind} run", env=FSDP2_ENV)
    assert runs["dpo"]["ranks"][0]["reference"], "the DPO run held no reference model: nothing was measured"
    report["ranks"] = []
    for rank, (sft, dpo) in enumerate(zip(runs["sft"]["ranks"], runs["dpo"]["ranks"])):
        above = {kind: r["peak_rss"] - r["baseline_rss"] for kind, r in (("sft", sft), ("dpo", dpo))}
        extra = above["dpo"] - above["sft"]
        report["ranks"].append({"rank": rank, "sft_above_baseline_mib": mib(above["sft"]),
                                "dpo_above_baseline_mib": mib(above["dpo"]), "reference_extra_mib": mib(extra),
                                "within_target": extra <= reference_share})
    report["process_seconds"] = {kind: r["process_seconds"] for kind, r in runs.items()}
    emit(report)


if __name__ == "__main__":
    sys.exit(main())
