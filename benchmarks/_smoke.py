"""Every benchmark's ``--smoke`` run from one process that imported the stack once.

    python benchmarks/_smoke.py                    # every benchmarks/*.py, one line each
    python benchmarks/_smoke.py engines mesh2d     # some of them
    python benchmarks/_smoke.py --serve            # tests/e2e/test_benchmarks.py's protocol (below)

A child process of a benchmark spends most of a smoke run importing torch, torch_xla and transformers (about 10 s
of CPU each on the 2-core machine) and a smoke run starts 2 to 9 of them. Here torch, torch_xla, transformers and
the package are imported once, without starting the XLA runtime; each benchmark then runs as ``__main__`` in a fork
of this process with ``--smoke``, and the children it starts through ``_harness.run_json_child`` are forks of it in
turn (``FORK_ENV``): the same scripts, arguments and environment, the imports not paid again. Each fork starts its
own XLA runtime, so ``CPU_NUM_DEVICES`` still takes effect per child. ``OMP_NUM_THREADS=1``: GNU OpenMP's thread
pool does not survive a fork, and tiny smoke sizes gain nothing from it. ``XLA_FLAGS`` gets
``--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true``: XLA:CPU's LLVM code generation
unoptimized, which compiles the smoke sizes' graphs about 4x faster (the HLO passes and the results are the same:
torch_xla already turns fast-math off, so LLVM may not reorder floating-point operations). What a fork cannot show is what a fresh
process imports (consolidate's "ours never imports torch_xla" is true only in a real run); smoke figures are not
figures.

``--serve``: reads one JSON request per stdin line, ``{"script": path, "args": [...], "timeout": seconds}``, and
writes one JSON line per request to stdout, ``{"script", "returncode", "stdout", "stderr", "seconds"}``.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
WARM = ("torch", "torch_xla", "torch_xla.core.xla_model", "torch_xla.debug.metrics", "torch_xla.runtime",
        "torch_xla.distributed.fsdp", "torch_xla.distributed.spmd", "transformers",
        "transformers.models.llama.modeling_llama", "transformers.trainer", "accelerate", "safetensors.torch",
        "psutil", "hf_xla_fsdp", "hf_xla_fsdp.cli", "hf_xla_fsdp.checkpoint", "hf_xla_fsdp.integrations.trainer",
        "hf_xla_fsdp.engines.v1", "hf_xla_fsdp.engines.v2", "hf_xla_fsdp.train")
DEFAULT_TIMEOUT = 600.0
#: XLA:CPU flags of every smoke run: LLVM code generation without optimization (see the module docstring)
FAST_COMPILE = ("--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true")


def benchmarks() -> list[Path]:
    """Every benchmark script: benchmarks/*.py but the helpers (a leading underscore)."""
    return sorted(p for p in HERE.glob("*.py") if not p.name.startswith("_"))


def warm_up() -> None:
    """Import what the benchmarks import, without starting the XLA runtime (see the module docstring)."""
    os.environ["OMP_NUM_THREADS"] = "1"
    os.environ.setdefault("PJRT_DEVICE", "CPU")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    # XLA:CPU's client pool sized for two 4-device programs in flight (tests/conftest.py says why); smoke only
    os.environ.setdefault("PJRT_NPROC", "8")
    os.environ["HF_XLA_FSDP_COMPILATION_CACHE"] = "none"  # a smoke run never writes the user's cache
    flags = os.environ.get("XLA_FLAGS", "").split()  # the test suite's conftest may have set them already
    os.environ["XLA_FLAGS"] = " ".join(flags + [f for f in FAST_COMPILE if f not in flags])
    for name in WARM:
        importlib.import_module(name)
    sys.path.insert(0, str(HERE))
    import _harness

    os.environ[_harness.FORK_ENV] = "1"


def run_one(script: Path, args: list[str], timeout: float) -> dict:
    """Run ``script --smoke *args`` in a fork; its exit code, output and wall seconds."""
    from _harness import run_forked

    start = time.perf_counter()
    code, out, err = run_forked([str(script), "--smoke", *args], dict(os.environ), timeout=timeout)
    return {"script": str(script), "returncode": code, "stdout": out, "stderr": err,
            "seconds": round(time.perf_counter() - start, 1)}


def serve() -> None:
    """Answer requests on stdin (see the module docstring) until it closes."""
    protocol = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever else prints (imports' warnings) goes to stderr, not into the replies
    warm_up()
    print(json.dumps({"ready": True}), file=protocol, flush=True)
    for line in sys.stdin:
        if line.strip():
            req = json.loads(line)
            reply = run_one(Path(req["script"]), list(req.get("args", [])), float(req.get("timeout", DEFAULT_TIMEOUT)))
            print(json.dumps(reply), file=protocol, flush=True)


def main() -> None:
    """Serve, or run the named (default: every) benchmark's smoke and print one line per benchmark."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("names", nargs="*", help="benchmark names (file stems); default: all")
    p.add_argument("--serve", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds per benchmark")
    args = p.parse_args()
    if args.serve:
        return serve()
    scripts = [s for s in benchmarks() if not args.names or s.stem in args.names]
    warm_up()
    failed = 0
    for script in scripts:
        r = run_one(script, [], args.timeout)
        failed += r["returncode"] != 0
        print(f"{script.stem}: exit {r['returncode']} in {r['seconds']} s", flush=True)
        if r["returncode"] != 0:
            print(r["stderr"][-3000:], flush=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
