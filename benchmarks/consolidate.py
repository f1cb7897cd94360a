"""Consolidating the 8 rank files of a 1.2 GB model from each input format, ours against the stock path.

    python benchmarks/consolidate.py [--workdir DIR] [--world-size 8] [--repeats 3]
    python benchmarks/consolidate.py --checksums-only --repeats 7
    python benchmarks/consolidate.py --smoke      # a tiny Llama, 2 ranks, one run of each: checks the script runs

The same real torch_xla FSDP state (every rank built with sharding_groups in one process, cached in --workdir) is
saved three ways: our rank files (safetensors), torch_xla's ``xm.save`` ``.pth`` files and the
Trainer's ``rank*-of-*-pytorch_model.bin`` files (also ``xm.save``). ``hf-xla-fsdp consolidate`` turns
each into the same safetensors model; the references are the stock tools: for ``.bin`` what
transformers' Trainer does (torch_xla's consolidate_sharded_model_checkpoints, then
save_pretrained(state_dict=...)), for ``.pth`` torch_xla's consolidate_sharded_model_checkpoints
writing its consolidated ``.pth``. Every path runs in its own process, in the same run.

Prints JSON: per path the peak RSS (each child's own VmHWM, see _harness.py), the peak above the bare
``import torch`` (the CUDA build of torch 2.9.0 maps ~0.5-0.7 GB of libraries before any work), the
time of the work and of the whole process; whether every output is identical to the reference's.
Targets, for every input format: peak above ``import torch`` <= 128 MiB + the
largest tensor, >= 5x below the reference's (both above ``import torch``), process time <= today's.
``above_imports_mib`` is the peak above the child's baseline after the imports its path needs: for our own rank
files only ours (they carry their model's config, written back as JSON); for ``.pth`` / ``.bin`` files, checked
against ``--config``, also transformers' config and model classes (~190 MiB above ``import torch`` here).
Checksum cost: our consolidation of the same rank files with their CRC-32C checksums checked, with
zlib's CRC-32 instead, and with no checksums (the tables removed, as an earlier version wrote them), each run
--repeats times alternately (``--checksums-only`` runs just this); reported: each variant's times, best and median, and
the headline, the median (and range) of each repeat's overhead against the unchecked run beside it;
target: checking costs <= 10 % of the unchecked time, at the median.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from _harness import SMOKE_LLAMA, add_smoke_flag, emit, mib, run_json_child, vm_hwm_bytes  # noqa: E402
from meta_init import MODEL  # noqa: E402  (the same ~325M-parameter Llama)


def make_ranks(workdir: Path, world: int, model_fields: dict) -> None:
    """Every rank's files, one rank after the other in this process (sharding_groups: no collectives)."""
    for rank in range(world):
        make_rank(workdir, rank, world, model_fields)


def make_rank(workdir: Path, rank: int, world: int, model_fields: dict) -> None:
    """Build rank ``rank`` with real torch_xla FSDP and save it in our format, torch_xla's and Trainer's."""
    import torch
    import torch_xla.core.xla_model as xm
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.checkpoint import write_rank_file

    torch.manual_seed(0)
    plugin = XlaFsdpPlugin(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world)
    model = plugin.build(LlamaConfig(**model_fields), progress=False)
    write_rank_file(workdir / "ours", model, step=0)
    trainer = workdir / "trainer"
    trainer.mkdir(exist_ok=True)
    state = {"model": model.state_dict(), "shard_metadata": model.get_shard_metadata()}
    # what Trainer._save_tpu and torch_xla's FSDP examples write: xm.save (CPU copies, torch.save) per rank
    xm.save(state, trainer / f"rank{rank}-of-{world}-pytorch_model.bin", master_only=False)
    (workdir / "xla").mkdir(exist_ok=True)
    xm.save(state, workdir / "xla" / f"final_ckpt_rank-{rank:08d}-of-{world:08d}.pth", master_only=False)
    if rank == 0:
        model.module.config.save_pretrained(trainer)


def run_ours(source: Path, out: Path, config: Path | None, suffix: str | None = None) -> dict:
    from hf_xla_fsdp.cli import main

    args = ["consolidate", str(source), "-o", str(out), "--quiet"]
    args += ["--config", str(config)] if config else []
    args += ["--ckpt-suffix", suffix] if suffix else []
    start = time.perf_counter()
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
        rc = main(args)
    if rc != 0:  # the CLI's one line says why (a refused input is a broken benchmark, not a figure)
        raise SystemExit(f"hf-xla-fsdp {' '.join(args)} exited {rc}: {err.getvalue().strip()[-2000:]}")
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss": vm_hwm_bytes(),
            "imported_torch_xla": "torch_xla" in sys.modules, "imported_transformers": "transformers" in sys.modules}


def run_reference(trainer_dir: Path, out: Path) -> dict:
    """What Trainer._save_tpu does on the master after the rank files are written."""
    import torch
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(trainer_dir)
    with torch.device("meta"):  # Trainer already holds the model; a meta one keeps it out of the figure
        model = AutoModelForCausalLM.from_config(config)
    start = time.perf_counter()
    full_state_dict, _ = consolidate_sharded_model_checkpoints(
        ckpt_prefix=os.path.join(str(trainer_dir), ""), ckpt_suffix="rank*-of-*-pytorch_model.bin", save_model=False)
    model.save_pretrained(str(out), state_dict=full_state_dict, safe_serialization=True)
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss": vm_hwm_bytes()}


def run_reference_pth(prefix: str, out: Path) -> dict:
    """torch_xla's own tool for .pth rank files (``python -m torch_xla.distributed.fsdp.consolidate_sharded_ckpts``)."""
    from torch_xla.distributed.fsdp import consolidate_sharded_model_checkpoints

    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    consolidate_sharded_model_checkpoints(ckpt_prefix=prefix, ckpt_suffix="_rank-*-of-*.pth",
                                          save_path=str(out / "consolidated.pth"), save_model=True)
    return {"seconds": round(time.perf_counter() - start, 2), "peak_rss": vm_hwm_bytes()}


def baseline_rss(kind: str) -> tuple[int, int]:
    """Peak RSS after ``import torch`` alone, and after importing what the path imports, before any work."""
    import torch  # noqa: F401  (the CUDA build of torch 2.9.0 maps ~0.5 GB of libraries)

    torch_only = vm_hwm_bytes()
    if kind.startswith("ours"):
        import hf_xla_fsdp.checkpoint.consolidate  # noqa: F401
        import hf_xla_fsdp.cli  # noqa: F401

        if kind != "ours":
            # a foreign checkpoint is checked against its --config on meta: transformers' config and model classes,
            # which pull in torch._dynamo (~190 MiB above `import torch` with transformers 5); our own rank files
            # carry their config and need none of it
            from transformers.models.llama import configuration_llama, modeling_llama  # noqa: F401
    else:
        import torch_xla.distributed.fsdp  # noqa: F401
        import transformers  # noqa: F401
    return torch_only, vm_hwm_bytes()


def child(args: argparse.Namespace) -> None:
    """Make one rank's files, or run one consolidation path and print its JSON line."""
    work = Path(args.workdir)
    if args.child == "ranks":
        start = time.perf_counter()
        make_ranks(work, args.world_size, SMOKE_LLAMA if args.smoke else MODEL)
        return emit({"ranks": args.world_size, "seconds": round(time.perf_counter() - start, 2)})
    torch_rss, base = baseline_rss("reference" if args.child.startswith("reference") else args.child)
    if args.child == "ours":
        result = run_ours(work / "ours", work / "out_ours", None)
    elif args.child in ("ours_crc32", "ours_unverified"):
        result = run_ours(work / args.child, work / f"out_{args.child}", None)
    elif args.child == "ours_bin":
        result = run_ours(work / "trainer", work / "out_ours_bin", work / "trainer")
    elif args.child == "ours_pth":
        result = run_ours(work / "xla" / "final_ckpt", work / "out_ours_pth", work / "trainer", "_rank-*-of-*.pth")
    elif args.child == "reference_pth":
        result = run_reference_pth(str(work / "xla" / "final_ckpt"), work / "out_reference_pth")
    else:
        result = run_reference(work / "trainer", work / "out_reference")
    result["baseline_rss"] = base
    result["torch_import_rss"] = torch_rss
    emit(result)


def checksum_variants(work: Path) -> dict[str, Path]:
    """The rank files of ``work/ours`` (hard links) with CRC-32 tables, and with none: same bytes, other metadata.

    Each variant is a checkpoint our reader accepts: its rank JSON's digest and its checksum table's digest are
    recorded in the completion marker, which is sealed again with its own digest (``marker_bytes``), as a save
    writes it.
    """
    import hashlib

    from hf_xla_fsdp.checkpoint.checksums import CRC32, hexdigest, table_digest, update
    from hf_xla_fsdp.checkpoint.layout import COMPLETE_MARKER
    from hf_xla_fsdp.checkpoint.safetensors_io import SafetensorsReader
    from hf_xla_fsdp.checkpoint.schema import marker_bytes

    out = {}
    for kind in ("crc32", "unverified"):
        target = work / f"ours_{kind}"
        out[kind] = target
        if (target / COMPLETE_MARKER).exists():
            continue
        shutil.rmtree(target, ignore_errors=True)
        target.mkdir()
        marker = json.loads((work / "ours" / COMPLETE_MARKER).read_text())
        for name, entry in marker["files"].items():
            os.link(work / "ours" / name, target / name)
            meta_name = name.removesuffix(".safetensors") + ".json"
            meta = json.loads((work / "ours" / meta_name).read_text())
            if kind == "unverified":
                meta.pop("checksums")
            else:
                reader = SafetensorsReader(target / name)
                meta["checksums"] = {"algorithm": CRC32, "tensors": {
                    n: hexdigest(update(CRC32, 0, reader.read_bytes(n, 0, reader.nbytes(n)))) for n in reader.entries}}
            data = json.dumps(meta, indent=1).encode()
            (target / meta_name).write_bytes(data)
            entry["meta_sha256"] = hashlib.sha256(data).hexdigest()
            entry["checksums"] = table_digest(meta.get("checksums"))
            if entry["checksums"] is None:
                entry.pop("checksums")
        (target / COMPLETE_MARKER).write_bytes(marker_bytes(marker))
    return out


def read_outputs(d: Path) -> dict[str, Any]:
    """Name -> tensor of a consolidated directory (safetensors, lazily) or of torch_xla's consolidated .pth."""
    import torch
    from safetensors import safe_open

    if (d / "consolidated.pth").exists():
        return torch.load(d / "consolidated.pth", map_location="cpu", weights_only=True, mmap=True)["model"]
    idx = d / "model.safetensors.index.json"
    files = sorted(set(json.loads(idx.read_text())["weight_map"].values())) if idx.exists() else ["model.safetensors"]
    out = {}
    for name in files:
        with safe_open(str(d / name), "pt") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def compare_outputs(a: Path, b: Path) -> bool:
    """Tensor-by-tensor equality of two consolidated outputs (a tied lm_head may be stored once)."""
    import torch

    ta, tb = read_outputs(a), read_outputs(b)
    if ta.keys() - tb.keys() or tb.keys() - ta.keys() - {"lm_head.weight"}:
        return False
    return all(torch.equal(ta[k], tb[k]) for k in ta)


def largest_tensor_bytes(d: Path) -> int:
    """Bytes of the largest tensor of a consolidated safetensors directory (from the headers)."""
    import struct

    biggest = 0
    for f in d.glob("*.safetensors"):
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        header.pop("__metadata__", None)
        biggest = max([biggest] + [e["data_offsets"][1] - e["data_offsets"][0] for e in header.values()])
    return biggest


PATHS = {  # ours -> (input format, reference path, whether the reference reads the same files)
    "ours": ("safetensors (ours)", "reference", False),  # no stock tool reads our format: the Trainer's .bin path
    "ours_pth": ("torch_xla .pth", "reference_pth", True),
    "ours_bin": ("Trainer .bin", "reference", True),
}


def main() -> None:
    """As a child do one piece; as the parent make the rank files once, run every path, print the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", default="/tmp/hf_xla_fsdp_bench_consolidate")
    p.add_argument("--world-size", type=int, default=8)
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    p.add_argument("--repeats", type=int, default=2, help="runs of each checksum variant (best and median reported)")
    p.add_argument("--checksums-only", action="store_true", help="only the checksum cost (rank files made if needed)")
    add_smoke_flag(p)
    args = p.parse_args()
    if args.child:
        return child(args)
    if args.smoke:
        with tempfile.TemporaryDirectory(prefix="consolidate-smoke-") as tmp:
            args.workdir, args.world_size, args.repeats = tmp, 2, 1
            return measure(args)
    return measure(args)


def measure(args: argparse.Namespace) -> None:
    """Make the rank files once (kept in --workdir), run every path, print the report."""
    work = Path(args.workdir)
    me = [__file__, "--workdir", work, "--world-size", args.world_size, *(["--smoke"] if args.smoke else [])]
    last = work / "xla" / f"final_ckpt_rank-{args.world_size - 1:08d}-of-{args.world_size:08d}.pth"
    first_meta = work / "ours" / f"rank-00000-of-{args.world_size:05d}.json"
    if not ((work / "ours" / "checkpoint_complete.json").exists() and last.exists()
            and "checksums" in json.loads(first_meta.read_text())):
        shutil.rmtree(work, ignore_errors=True)
        work.mkdir(parents=True)
        run_json_child([*me, "--child", "ranks"], name="rank files")
        from hf_xla_fsdp.checkpoint import commit_checkpoint

        commit_checkpoint(work / "ours", args.world_size)
    results = {}
    for kind in () if args.checksums_only else ("reference", "reference_pth", *PATHS):
        shutil.rmtree(work / f"out_{kind}", ignore_errors=True)
        # ours must work without torch_xla; transformers would import it with any model class otherwise
        env = {"USE_TORCH_XLA": "0"} if kind.startswith("ours") else None
        results[kind] = run_json_child([*me, "--child", kind], name=kind, env=env)
    variants = checksum_variants(work)
    timings: dict[str, list[float]] = {"crc32c": [], "crc32": [], "unverified": []}
    for _ in range(args.repeats):  # alternately, so a busy moment of the machine does not fall on one variant only
        for kind, child_name in (("unverified", "ours_unverified"), ("crc32c", "ours"), ("crc32", "ours_crc32")):
            shutil.rmtree(work / f"out_{child_name}", ignore_errors=True)
            run = run_json_child([*me, "--child", child_name], name=child_name, env={"USE_TORCH_XLA": "0"})
            timings[kind].append(run["seconds"])
    assert variants
    best = {kind: min(values) for kind, values in timings.items()}
    median = {kind: statistics.median(values) for kind, values in timings.items()}

    def overheads(kind: str) -> list[float]:  # each repeat's variant against the unchecked run next to it
        return sorted(round(100 * (a / b - 1), 1) for a, b in zip(timings[kind], timings["unverified"]))

    checksums = {
        "consolidation_seconds": timings, "best_seconds": best, "median_seconds": median,
        # the headline: the median of the per-repeat overheads, with their range
        "crc32c_overhead_percent_median": statistics.median(overheads("crc32c")),
        "crc32c_overhead_percent_range": [overheads("crc32c")[0], overheads("crc32c")[-1]],
        "crc32_overhead_percent_median": statistics.median(overheads("crc32")),
        "crc32c_overhead_percent_of_best": round(100 * (best["crc32c"] / best["unverified"] - 1), 1),
        "crc32c_overhead_percent_of_medians": round(100 * (median["crc32c"] / median["unverified"] - 1), 1),
        "outputs_identical": compare_outputs(work / "out_ours_unverified", work / "out_ours")
        and compare_outputs(work / "out_ours_crc32", work / "out_ours"),
        "target_10_percent_met_at_the_median": statistics.median(overheads("crc32c")) <= 10.0,
    }
    if args.checksums_only:
        emit({"smoke": args.smoke, "world_size": args.world_size, "checksums": checksums})
        return
    model_bytes = sum(f.stat().st_size for f in (work / "out_reference").glob("*.safetensors"))
    largest = largest_tensor_bytes(work / "out_reference")
    target = 128 * 2**20 + largest

    def above(r: dict) -> int:
        return r["peak_rss"] - r["torch_import_rss"]

    report: dict[str, Any] = {
        "smoke": args.smoke, "world_size": args.world_size, "model_mib": mib(model_bytes), "largest_tensor_mib": mib(largest),
        "torch_import_rss_mib": mib(results["ours"]["torch_import_rss"]),
        "target_above_torch_import_mib": mib(target),
    }
    for kind in ("reference", "reference_pth"):
        r = results[kind]
        report[kind] = {"peak_rss_mib": mib(r["peak_rss"]), "above_torch_import_mib": mib(above(r)),
                        "above_imports_mib": mib(r["peak_rss"] - r["baseline_rss"]),
                        "seconds": r["seconds"], "process_seconds": r["process_seconds"]}
    all_ok = True
    for kind, (fmt, ref_kind, same_input) in PATHS.items():
        r, ref = results[kind], results[ref_kind]
        entry = {
            "input": fmt, "reference": ref_kind, "reference_reads_the_same_files": same_input,
            "peak_rss_mib": mib(r["peak_rss"]),
            "above_torch_import_mib": mib(above(r)), "above_imports_mib": mib(r["peak_rss"] - r["baseline_rss"]),
            "seconds": r["seconds"], "process_seconds": r["process_seconds"],
            "imported_torch_xla": r["imported_torch_xla"], "imported_transformers": r["imported_transformers"],
            "above_torch_import_ratio_reference_over_ours": round(above(ref) / above(r), 2),
            # the work alone: each path's peak above the imports it needs (ours: transformers' config classes for a
            # foreign format; the stock path: torch_xla and transformers)
            "above_imports_ratio_reference_over_ours": round((ref["peak_rss"] - ref["baseline_rss"])
                                                             / max(r["peak_rss"] - r["baseline_rss"], 1), 2),
            "peak_ratio_reference_over_ours": round(ref["peak_rss"] / r["peak_rss"], 2),
            "process_time_ratio_reference_over_ours": round(ref["process_seconds"] / r["process_seconds"], 2),
            "within_memory_target": above(r) <= target,
            "at_least_5x_below_reference": above(ref) >= 5 * above(r),
            "output_identical_to_reference": compare_outputs(work / f"out_{kind}", work / f"out_{ref_kind}"),
        }
        all_ok &= entry["within_memory_target"] and entry["at_least_5x_below_reference"] \
            and entry["output_identical_to_reference"] and not entry["imported_torch_xla"]
        report[kind] = entry
    report["all_targets_met"] = all_ok
    report["checksums"] = checksums
    emit(report)


if __name__ == "__main__":
    main()
