"""Where a meta build spends its time and memory: wall time and peak RSS per build phase, one build.

    python benchmarks/build_timeline.py                      # llama-2-7b, rank 0 of 64
    python benchmarks/build_timeline.py --layers 4           # the same widths, fewer blocks (quick)
    python benchmarks/build_timeline.py --smoke              # a tiny Llama, rank 0 of 2: checks the script runs

Phases: ``skeleton`` (meta construction, construction-time draws), ``fill_block`` / ``fill_root`` (materialize and
initialize), ``wrap_block`` / ``wrap_root`` (FSDP unit construction), ``sync_*`` (running the sharding graph). A
thread samples VmRSS every 20 ms and charges it to the phase running then; the phases are marked by wrapping the
package's own build steps (``build_skeleton``, ``Materializer.fill``, ``wrap_block``, ``wrap_root``) for this
process. Prints JSON: the runtime baseline and, per phase, the peak RSS and the seconds spent in it.
"""

from __future__ import annotations

import argparse
import threading
import time
from typing import Any, Callable

from _harness import SMOKE_LLAMA, add_smoke_flag, emit


def _rss_mib() -> int:
    with open("/proc/self/status", encoding="ascii") as fh:
        return next(int(line.split()[1]) for line in fh if line.startswith("VmRSS:")) // 1024


class Timeline:
    """Wall time and sampled peak RSS per named phase."""

    def __init__(self) -> None:
        self.phase, self.last = "start", time.perf_counter()
        self.peaks: dict[str, int] = {}
        self.seconds: dict[str, float] = {}
        threading.Thread(target=self._sample, daemon=True).start()

    def _sample(self) -> None:
        while True:
            rss, phase = _rss_mib(), self.phase
            self.peaks[phase] = max(self.peaks.get(phase, 0), rss)
            time.sleep(0.02)

    def enter(self, phase: str) -> None:
        """End the current phase and start ``phase``."""
        now = time.perf_counter()
        self.seconds[self.phase] = self.seconds.get(self.phase, 0.0) + now - self.last
        self.phase, self.last = phase, now

    def around(self, fn: Callable[..., Any], name: Callable[..., str], after: str) -> Callable[..., Any]:
        """``fn`` that enters phase ``name(*args)`` while it runs and ``after`` once it returns."""
        def wrapped(*args: Any, **kwargs: Any) -> Any:
            self.enter(name(*args, **kwargs))
            try:
                return fn(*args, **kwargs)
            finally:
                self.enter(after)
        return wrapped


def main() -> None:
    """Build one rank with the phases marked; print the JSON report."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="llama-2-7b", choices=["llama-2-7b", "llama-2-13b"])
    p.add_argument("--layers", type=int, default=None, help="override num_hidden_layers")
    p.add_argument("--world-size", type=int, default=64)
    p.add_argument("--rank", type=int, default=0)
    add_smoke_flag(p)
    args = p.parse_args()

    import torch
    import torch_xla
    from transformers import LlamaConfig

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.engines.v1 import XlaFsdpV1
    from hf_xla_fsdp.modeling import meta_init
    from hf_xla_fsdp.planning.presets import MODEL_PRESETS

    kwargs = {k: v for k, v in MODEL_PRESETS[args.preset][1].items() if k != "architectures"}
    if args.smoke:
        kwargs, args.world_size = dict(SMOKE_LLAMA), 2
    if args.layers:
        kwargs["num_hidden_layers"] = args.layers
    torch.zeros(1, device=torch_xla.device()).cpu()  # the runtime is up before the baseline is read
    baseline = _rss_mib()
    tl = Timeline()
    root_names = {"LlamaForCausalLM"}
    meta_init.build_skeleton = tl.around(meta_init.build_skeleton, lambda *a, **k: "skeleton", "between")
    meta_init.Materializer.fill = tl.around(
        meta_init.Materializer.fill,
        lambda self, modules: "fill_root" if any(type(m).__name__ in root_names for m in modules) else "fill_block",
        "between")
    XlaFsdpV1.wrap_block = tl.around(XlaFsdpV1.wrap_block, lambda *a, **k: "wrap_block", "sync_block")
    XlaFsdpV1.wrap_root = tl.around(XlaFsdpV1.wrap_root, lambda *a, **k: "wrap_root", "sync_root")
    plugin = XlaFsdpPlugin(sharding_groups=[list(range(args.world_size))], sharding_rank=args.rank,
                           sharding_world_size=args.world_size)
    torch.manual_seed(0)
    start = time.perf_counter()
    tl.enter("build")
    plugin.build(LlamaConfig(**kwargs), progress=False)
    torch_xla.sync()
    tl.enter("end")
    time.sleep(0.1)
    phases = {name: {"peak_rss_mib": tl.peaks.get(name), "seconds": round(tl.seconds.get(name, 0.0), 1)}
              for name in tl.seconds if name not in ("start",)}
    emit({"smoke": args.smoke, "baseline_rss_mib": baseline, "build_seconds": round(time.perf_counter() - start, 1),
          "phases": phases})


if __name__ == "__main__":
    main()
