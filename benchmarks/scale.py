"""What one rank of a 7B / 13B model costs to build on a small host: peak RSS, time, the rank's bytes.

    python benchmarks/scale.py                                  # llama-2-7b, rank 0 of 64
    python benchmarks/scale.py --preset llama-2-13b --world-size 64
    python benchmarks/scale.py --compare-with 8651a6a           # the same build from another commit, same run
    python benchmarks/scale.py --smoke                          # a tiny Llama, rank 0 of 2: checks the script runs

Each build runs in a fresh child process (benchmarks/_harness.py; peak = the child's own VmHWM). Prints JSON
with the target: peak <= baseline + model / N + 1.5 x the largest FSDP unit, where baseline is
the child's RSS once everything is imported and the XLA runtime runs. The eager path (the whole model
built on the host, then wrapped) is computed, not run: it needs at least the fp32 model plus the baseline.
``--compare-with REV`` exports commit REV of this repository (``git archive``) to a temporary directory and
builds with that tree too, so before/after figures come from the same machine state.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _harness import SMOKE_LLAMA, add_smoke_flag, emit, mib, run_json_child, vm_hwm_bytes

ROOT = Path(__file__).resolve().parents[1]
TARGET_SECONDS = 90  # rank 0 of 64 of the 7B config on a 2-core host


def child(config_json: str, world_size: int, rank: int) -> None:
    """Build rank ``rank`` of ``world_size`` of the Llama config in this process; print its JSON line.

    Uses only the package's public API of every version, so an exported older tree runs it too.
    """
    import torch
    import torch_xla
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin

    torch.zeros(1, device=torch_xla.device()).cpu()  # the runtime is up before the baseline is read
    baseline = vm_hwm_bytes()
    plugin = XlaFsdpPlugin(sharding_groups=[list(range(world_size))], sharding_rank=rank, sharding_world_size=world_size)
    torch.manual_seed(0)
    start = time.perf_counter()
    model = plugin.build(LlamaConfig(**json.loads(config_json)), progress=False)
    torch_xla.sync()
    seconds = time.perf_counter() - start
    emit({"baseline_rss": baseline, "peak_rss": vm_hwm_bytes(), "build_seconds": round(seconds, 1),
          "rank_param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
          "package": str(Path(sys.modules["hf_xla_fsdp"].__file__).parent)})


def host_memory_bytes() -> int:
    """MemTotal of this machine."""
    with open("/proc/meminfo", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("MemTotal:")) * 1024


def export_tree(rev: str, into: Path) -> Path:
    """Commit ``rev`` of this repository as plain files under ``into`` (nothing of the work tree is touched)."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev], capture_output=True, check=False)
    if archive.returncode != 0:
        raise SystemExit(f"git archive {rev} failed: {archive.stderr.decode()[-500:]}")
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive.stdout, check=True)
    return into


def main() -> None:
    """As a child build one rank; as the parent plan, build (once per tree) and print the report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-2-7b", choices=["llama-2-7b", "llama-2-13b"])
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--compare-with", default=None, help="also build with this commit's tree (e.g. a commit before a change)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)
    add_smoke_flag(p)
    args = p.parse_args()
    if args.child:
        return child(args.child, args.world_size, args.rank)

    sys.path.insert(0, str(ROOT))
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.planning.presets import MODEL_PRESETS, preset_config
    from hf_xla_fsdp.planning.units import plan

    if args.smoke:
        kwargs, args.world_size = dict(SMOKE_LLAMA), 2
        config = LlamaConfig(**kwargs)
    else:
        kwargs = {k: v for k, v in MODEL_PRESETS[args.preset][1].items() if k != "architectures"}
        config = preset_config(args.preset)
    sizing = plan(config, XlaFsdpPlugin(), world_size=args.world_size)
    model_bytes, largest = sizing["total_bytes"], sizing["largest_unit_bytes"]
    cmd = [__file__, "--child", json.dumps(kwargs), "--world-size", args.world_size, "--rank", args.rank]
    trees = {"current": ROOT}
    with tempfile.TemporaryDirectory(prefix="scale-bench-") as tmp:
        if args.compare_with:
            trees[args.compare_with] = export_tree(args.compare_with, Path(tmp))
        results = {name: run_json_child(cmd, name=f"{name} build", env={"PYTHONPATH": str(tree)})
                   for name, tree in trees.items()}
    host = host_memory_bytes()
    report: dict = {
        "smoke": args.smoke, "preset": "smoke" if args.smoke else args.preset, "world_size": args.world_size, "rank": args.rank,
        "model_params": sizing["total_params"], "model_fp32_mib": mib(model_bytes),
        "largest_unit": max(sizing["units"], key=lambda u: u["bytes"])["unit"], "largest_unit_mib": mib(largest),
        "planned_rank_param_mib": mib(sizing["bytes_per_rank"]), "host_memory_mib": mib(host),
        "eager_path": {"needs_at_least_mib": mib(model_bytes + results["current"]["baseline_rss"]),
                       "fits_this_host": model_bytes + results["current"]["baseline_rss"] <= host,
                       "how": "computed, not run: the whole fp32 model on the host plus the runtime baseline"},
        "cpu_count": os.cpu_count(), "load_average_1min": round(os.getloadavg()[0], 2),
    }
    for name, res in results.items():
        target = res["baseline_rss"] + model_bytes / args.world_size + 1.5 * largest
        report[name] = {
            "baseline_rss_mib": mib(res["baseline_rss"]), "peak_rss_mib": mib(res["peak_rss"]),
            "above_baseline_mib": mib(res["peak_rss"] - res["baseline_rss"]), "target_mib": mib(target),
            "within_memory_target": res["peak_rss"] <= target, "build_seconds": res["build_seconds"],
            "within_time_target": res["build_seconds"] <= TARGET_SECONDS, "process_seconds": res["process_seconds"],
            "rank_param_mib": mib(res["rank_param_bytes"]),
        }
    emit(report)


if __name__ == "__main__":
    main()
