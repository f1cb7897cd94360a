"""XlaFsdpTrainer against transformers' own XLA FSDP Trainer path: the same causal-LM training, the
same TrainingArguments and fsdp_config (examples/xla_fsdp_config.json), each trainer in its own process.

    PJRT_DEVICE=CPU python benchmarks/trainer_vs_stock.py [--steps 30] [--warmup 5] [--workdir DIR]
        [--construct-world-size 8] [--construct-model llama-325m] [--skip-training] [--skip-construction]
    PJRT_DEVICE=CPU python benchmarks/trainer_vs_stock.py --smoke   # a tiny Llama, 3 steps: checks the script runs

"ours" is ``XlaFsdpTrainer(model=config)`` (meta init, block-by-block wrap); "stock" is
``transformers.Trainer`` given ``AutoModelForCausalLM.from_config(config)`` built after ``set_seed``
(as run_clm does), which it wraps with XLA FSDP at ``train()``. Each child measures host RSS (psutil,
sampled every 5 ms, max per phase) for: construction (model + trainer), wrap (``train()`` start to
``on_train_begin``: the stock path wraps and creates its optimizer here), the first step, the rest of
training and the final ``save_model``; "model ready" = max(construction, wrap). Ratios use RSS above
the baseline (imports done, XLA runtime started), and for the save, above the RSS when it starts.
Steady-state step time is the median ``on_step_end`` interval after the warm-up (logging_steps=1
syncs every step; no saves while timing), also in process CPU seconds, which other load on the
machine disturbs less; XLA compiles after the warm-up come from the ``CompileTime`` metric. The
parent checks that both saved models load with ``from_pretrained`` without missing/unexpected keys
and compares losses and final weights. Prints one JSON object (sizes in MiB, times in seconds).
Targets: our steady step time within 10% of stock; 0 compiles after warm-up for ours.
One process is one FSDP rank of world size 1, so both hold the whole model: RSS differences are the
construction paths' transient copies, not per-rank sharding.

Section "construction_world_size" (skip with --skip-construction; --skip-training runs only this one)
shows the per-rank difference: each trainer, in its own process, makes the model ready as rank 0 of
``--construct-world-size`` N ranks, emulated in one process with XLA FSDP's explicit sharding group
(``sharding_groups=[[0..N-1]], sharding_rank=0, sharding_world_size=N`` added to the fsdp_config's
``xla_fsdp_settings``, which both paths pass to ``XlaFullyShardedDataParallel``). No training there
(collectives over an emulated group would hang). "ours" is ``XlaFsdpTrainer(model=config)`` (builds on
meta block by block and wraps at construction); "stock" is ``set_seed``, ``from_config``,
``StockTrainer(model)`` and the wrap ``train()`` would do: ``trainer._wrap_model(trainer.model)``
(transformers' ``wrap_model_xla_fsdp``; with the STOCK_FIX it also creates the optimizer, whose AdamW
state is lazy), then ``torch_xla.sync()``. Model: ``--construct-model`` (default the ~325M-parameter
Llama of benchmarks/meta_init.py). Reports baseline/peak RSS (sampler, VmHWM), peak above
baseline, the RSS left when ready (also after gc + malloc_trim: freed memory glibc kept), seconds, the
parameter bytes the rank holds (checked against model bytes / N) and the stock/ours ratio of peak RSS
above baseline.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from _harness import MIB, add_smoke_flag, emit, mib, run_json_child, vm_hwm_bytes

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
FSDP_CONFIG = ROOT / "examples" / "xla_fsdp_config.json"
STOCK_FIX = ("transformers 5.23 never creates the optimizer on its XLA FSDP path (the wrapped model is not "
             "self.model, so _prepare_for_training calls accelerator.prepare(None) and create_scheduler fails on "
             "None.param_groups); StockTrainer._wrap_model sets self.model to the wrapped model and calls "
             "create_optimizer(wrapped), so train() then takes the prepare(model)/prepare(optimizer) branch "
             "the torch FSDP path takes. Also optim=adamw_torch for both "
             "(fused AdamW has no XLA kernel).")


# --construct-model presets. "llama-325m" is benchmarks/meta_init.py's MODEL: 24 decoder layers of 12.8M
# parameters, embeddings + lm_head 1.3 blocks; "train" is the training section's model (its flags).
CONSTRUCT_MODELS = {
    "llama-325m": {"vocab_size": 8192, "hidden_size": 1024, "intermediate_size": 2816, "num_hidden_layers": 24,
                   "num_attention_heads": 16, "num_key_value_heads": 16, "max_position_embeddings": 2048,
                   "tie_word_embeddings": False},
}


def hwm_rss_mib() -> float:
    """VmHWM, this process's own peak RSS (not ru_maxrss, which includes the parent's: see _harness.py)."""
    return mib(vm_hwm_bytes())


def stock_trainer_class() -> type:
    """The StockTrainer class (made on call: transformers is imported in the children only)."""
    import torch
    from transformers import Trainer

    class StockTrainer(Trainer):
        """transformers.Trainer plus the minimal fix of its XLA FSDP optimizer creation (see STOCK_FIX)."""

        def _wrap_model(self, model: torch.nn.Module, training: bool = True, dataloader: Any = None) -> torch.nn.Module:
            """The stock wrap, then the optimizer over the wrapped model's parameters."""
            # Stock 5.23 delays optimizer creation for XLA FSDP, then finds the wrapped model is not
            # self.model and only calls accelerator.prepare(self.optimizer) with optimizer None: create it here.
            wrapped = super()._wrap_model(model, training, dataloader)
            if training and wrapped is not model and self.optimizer is None:
                self.model = wrapped
                self.create_optimizer(wrapped)
            return wrapped

    return StockTrainer


class RssSampler(threading.Thread):
    """Samples this process's RSS every ``interval`` seconds and keeps the maximum per named phase."""

    def __init__(self, interval: float = 0.005) -> None:
        """A daemon sampler of this process; call ``start()``."""
        import psutil

        super().__init__(daemon=True)
        self.proc, self.interval, self.phase, self.peaks = psutil.Process(), interval, "idle", {}

    def sample(self) -> None:
        """Record the current RSS against the current phase."""
        rss = self.proc.memory_info().rss
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), rss)

    def set_phase(self, name: str) -> None:
        """Close the current phase (one last sample) and start ``name``."""
        self.sample()
        self.phase = name
        self.sample()

    def run(self) -> None:
        """Sample until the process exits."""
        while True:
            self.sample()
            time.sleep(self.interval)


def child(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Train with one trainer (``ours`` or ``stock``) and return its measurements."""
    import torch
    import torch_xla
    import torch_xla.debug.metrics as met
    from run_clm import load_data, parse_args
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, TrainerCallback, default_data_collator, set_seed

    from hf_xla_fsdp import XlaFsdpTrainer

    torch.zeros(1, device=torch_xla.device()).cpu()  # start the XLA runtime before the baseline
    sampler = RssSampler()
    sampler.start()
    sampler.set_phase("baseline")  # imports done, runtime started: the floor of both processes
    compiles = lambda: int((met.metric_data("CompileTime") or [0])[0])  # noqa: E731

    StockTrainer = stock_trainer_class()

    class Timer(TrainerCallback):
        """Step-end times, losses, compile counts and RSS phases of the training loop."""

        def __init__(self) -> None:
            """Empty records."""
            self.step_ends: list[float] = []
            self.step_cpu: list[float] = []  # process CPU time (all threads): less sensitive to other load
            self.losses: list[float] = []
            self.compiles_at: dict[str, int] = {}
            self.train_begin = 0.0

        def on_train_begin(self, *a: Any, **k: Any) -> None:
            """Model wrapped, optimizer made: the wrap phase ends and the first step begins."""
            sampler.set_phase("first_step")
            self.step_ends.append(time.perf_counter())
            self.step_cpu.append(time.process_time())
            self.train_begin = time.perf_counter()

        def on_step_end(self, a: Any, state: Any, *rest: Any, **k: Any) -> None:
            """Time and CPU time at the end of each optimizer step."""
            self.step_ends.append(time.perf_counter())
            self.step_cpu.append(time.process_time())

        def on_log(self, a: Any, state: Any, control: Any, logs: dict | None = None, **k: Any) -> None:
            """The step's loss (already synced), phase changes and compile counts."""
            if logs and "loss" in logs:
                self.losses.append(float(logs["loss"]))  # logged after the step's .item(): its graph ran
                if state.global_step == 1:
                    sampler.set_phase("train")
                if state.global_step == args.warmup:
                    self.compiles_at["warmup"] = compiles()
                self.compiles_at["last_step"] = compiles()

    out_dir = Path(args.workdir) / kind
    argv = ["--output_dir", str(out_dir / "run"), "--fsdp", "--fsdp_config", str(FSDP_CONFIG),
            "--max_steps", str(args.steps), "--per_device_train_batch_size", str(args.batch_size),
            "--block_size", str(args.block_size), "--logging_steps", "1", "--save_strategy", "no",
            "--optim", "adamw_torch", "--report_to", "none", "--disable_tqdm", "true", "--seed", "42"]
    _, data_args, training_args = parse_args(argv)
    sampler.set_phase("data")
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "examples" / "tiny_tokenizer")
    train_ds, _ = load_data(data_args, tokenizer, training_args.seed)
    config = AutoConfig.from_pretrained(Path(args.workdir) / "config")
    timer = Timer()
    common = dict(args=training_args, train_dataset=train_ds, processing_class=tokenizer,
                  data_collator=default_data_collator, callbacks=[timer])

    sampler.set_phase("construction")
    start = time.perf_counter()
    if kind == "ours":
        trainer = XlaFsdpTrainer(model=config, **common)
    else:
        set_seed(training_args.seed)
        trainer = StockTrainer(model=AutoModelForCausalLM.from_config(config), **common)
    construction_s = time.perf_counter() - start
    sampler.set_phase("wrap")
    train_start = time.perf_counter()
    trainer.train()
    sampler.set_phase("after_train")
    compiles_end = compiles()

    sampler.set_phase("save")
    save_start_rss = sampler.proc.memory_info().rss
    start = time.perf_counter()
    trainer.save_model(str(out_dir / "model"))
    save_s = time.perf_counter() - start
    sampler.set_phase("done")

    # an interval ends before the step's .item(), so it holds the previous step's run and this step's trace
    steps = [b - a for a, b in zip(timer.step_ends, timer.step_ends[1:])]
    cpu = [b - a for a, b in zip(timer.step_cpu, timer.step_cpu[1:])]
    peaks = {k: round(v / MIB, 1) for k, v in sampler.peaks.items()}
    ready = max(peaks["construction"], peaks["wrap"])
    return {
        "baseline_rss_mib": peaks["baseline"], "construction_peak_mib": peaks["construction"],
        "construction_s": round(construction_s, 2), "wrap_peak_mib": peaks["wrap"],
        "wrap_s": round(timer.train_begin - train_start, 2),
        "model_ready_s": round(construction_s + timer.train_begin - train_start, 2),
        "first_step_peak_mib": peaks["first_step"], "train_peak_mib": peaks.get("train"),
        "model_ready_peak_mib": ready, "model_ready_above_baseline_mib": round(ready - peaks["baseline"], 1),
        "construction_above_baseline_mib": round(peaks["construction"] - peaks["baseline"], 1),
        "save_peak_mib": peaks["save"], "save_above_start_mib": round(peaks["save"] - save_start_rss / MIB, 1),
        "save_s": round(save_s, 2),
        "vm_hwm_mib": hwm_rss_mib(),  # the kernel's exact peak: checks the sampler
        "warmup_s": round(sum(steps[:args.warmup]), 2), "step_times_s": [round(s, 3) for s in steps],
        "steady_step_s": round(statistics.median(steps[args.warmup:]), 3),
        "steady_step_cpu_s": round(statistics.median(cpu[args.warmup:]), 3),
        "compiles_at_warmup": timer.compiles_at["warmup"],
        "compiles_after_warmup": timer.compiles_at["last_step"] - timer.compiles_at["warmup"],
        "compiles_after_train": compiles_end - timer.compiles_at["last_step"],
        "losses": timer.losses, "model_dir": str(out_dir / "model"),
    }


def construct_child(kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Make the model ready as rank 0 of ``args.construct_world_size`` ranks with one trainer; no training."""
    import importlib

    import torch
    import torch_xla
    from transformers import AutoConfig, AutoModelForCausalLM, TrainingArguments, set_seed

    from hf_xla_fsdp import XlaFsdpTrainer

    StockTrainer = stock_trainer_class()
    # modules both paths (and ours) import lazily: loaded before the baseline, so their code is not counted
    for name in ("torch_xla.distributed.fsdp", "transformers.integrations.tpu",
                 "transformers.models.llama.modeling_llama", "hf_xla_fsdp.modeling.meta_init", "hf_xla_fsdp.modeling.wrapping"):
        importlib.import_module(name)
    torch.zeros(1, device=torch_xla.device()).cpu()  # start the XLA runtime before the baseline
    sampler = RssSampler()
    sampler.start()
    sampler.set_phase("baseline")  # imports done, runtime started: the floor of both processes
    baseline_hwm = hwm_rss_mib()
    sampler.set_phase("setup")
    world = args.construct_world_size
    fsdp_config = json.loads(FSDP_CONFIG.read_text())
    # rank 0 of `world`: XLA FSDP shards exactly as there (both paths pass xla_fsdp_settings to the wrapper)
    fsdp_config["xla_fsdp_settings"] = {**fsdp_config["xla_fsdp_settings"], "sharding_groups": [list(range(world))],
                                        "sharding_rank": 0, "sharding_world_size": world}
    training_args = TrainingArguments(output_dir=str(Path(args.workdir) / f"construct-{kind}"), fsdp=True,
                                      fsdp_config=fsdp_config, optim="adamw_torch", report_to=[], seed=42,
                                      disable_tqdm=True)
    config = AutoConfig.from_pretrained(Path(args.workdir) / "construct_config")

    start = time.perf_counter()
    if kind == "ours":
        sampler.set_phase("trainer")  # builds on meta block by block and wraps at construction
        model = XlaFsdpTrainer(model=config, args=training_args).model
    else:
        sampler.set_phase("from_config")
        set_seed(training_args.seed)
        model = AutoModelForCausalLM.from_config(config)
        sampler.set_phase("trainer")
        trainer = StockTrainer(model=model, args=training_args)
        sampler.set_phase("wrap")
        model = trainer._wrap_model(trainer.model)  # what train() calls: transformers' wrap_model_xla_fsdp
    sampler.set_phase("sync")
    torch_xla.sync()
    seconds = time.perf_counter() - start
    sampler.set_phase("ready")
    ready_rss = sampler.proc.memory_info().rss / MIB
    hwm = hwm_rss_mib()
    params = list(model.parameters())
    peaks = {k: round(v / MIB, 1) for k, v in sampler.peaks.items()}
    made = {k: v for k, v in peaks.items() if k not in ("idle", "baseline", "setup", "ready")}
    peak = max(made.values())
    # diagnostic: how much of the RSS left after construction is freed memory the allocator kept
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    trimmed_rss = sampler.proc.memory_info().rss / MIB
    return {
        "baseline_rss_mib": peaks["baseline"], "peak_rss_mib": peak,
        "peak_above_baseline_mib": round(peak - peaks["baseline"], 1), "phase_peaks_mib": made,
        "ready_rss_mib": round(ready_rss, 1), "ready_above_baseline_mib": round(ready_rss - peaks["baseline"], 1),
        "ready_above_baseline_after_malloc_trim_mib": round(trimmed_rss - peaks["baseline"], 1),
        "seconds": round(seconds, 2),
        # a check of the sampler's peak
        "vm_hwm_at_baseline_mib": baseline_hwm, "vm_hwm_mib": hwm,
        "vm_hwm_above_baseline_mib": round(hwm - peaks["baseline"], 1),
        "rank_param_bytes": sum(t.numel() * t.element_size() for t in params),
        "rank_param_mib": round(sum(t.numel() * t.element_size() for t in params) / MIB, 1),
        "param_dtypes": sorted({str(t.dtype).removeprefix("torch.") for t in params}),
        "param_devices": sorted({t.device.type for t in params}),
        "fsdp_world_size": getattr(model, "world_size", None), "fsdp_rank": getattr(model, "rank", None),
        "wrapper": type(model).__name__,
    }


def load_check(model_dir: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """Load a saved model with from_pretrained: its loading info and its state dict."""
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(model_dir, output_loading_info=True)
    bad = {k: sorted(v) for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys") and v}
    return {"loads": not bad, **bad}, model.state_dict()


def run_child(role: str, kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """Run this script as a ``--child``/``--construct-child`` process and return its JSON."""
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items()
             if k not in ("child", "construct_child") and not isinstance(v, bool)]
    return run_json_child([__file__, f"--{role}", kind, *flags], name=f"{role} {kind}")


def construction_section(args: argparse.Namespace, train_config: Any) -> dict[str, Any]:
    """Write the construction model's config, run both construction children and compare them."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    preset = args.construct_model
    config = train_config if preset == "train" else LlamaConfig(**CONSTRUCT_MODELS[preset])
    config.save_pretrained(Path(args.workdir) / "construct_config")
    with torch.device("meta"):
        params = sum(t.numel() for t in AutoModelForCausalLM.from_config(config).parameters())
    world = args.construct_world_size
    ours, stock = (run_child("construct-child", kind, args) for kind in ("ours", "stock"))
    expected = params * 4 / world  # fp32 parameters split over `world` ranks (XLA FSDP pads to a multiple)
    for r in (ours, stock):
        r["rank_param_bytes_over_model_over_n"] = round(r["rank_param_bytes"] / expected, 4)
    ratio = lambda a, b: round(a / b, 3) if b > 0 else None  # noqa: E731
    return {
        "world_size": world, "rank": 0,
        "model": {"preset": preset, "params": params, "fp32_mib": round(params * 4 / MIB, 1),
                  "fp32_mib_over_n": round(expected / MIB, 1),
                  **{k: getattr(config, k) for k in ("vocab_size", "hidden_size", "intermediate_size",
                                                     "num_hidden_layers", "num_attention_heads",
                                                     "num_key_value_heads", "max_position_embeddings",
                                                     "tie_word_embeddings")}},
        "ours": ours, "stock": stock,
        "rank_params_match_model_over_n": all(abs(r["rank_param_bytes_over_model_over_n"] - 1) < 0.01
                                              and r["fsdp_world_size"] == world for r in (ours, stock)),
        "peak_above_baseline_ratio_stock_over_ours": ratio(stock["peak_above_baseline_mib"],
                                                           ours["peak_above_baseline_mib"]),
        # VmHWM is the kernel's exact peak (VmHWM at baseline = baseline RSS); the 5 ms sampler can miss spikes
        "vm_hwm_above_baseline_ratio_stock_over_ours": ratio(stock["vm_hwm_above_baseline_mib"],
                                                             ours["vm_hwm_above_baseline_mib"]),
        "ready_above_baseline_ratio_stock_over_ours": ratio(stock["ready_above_baseline_mib"],
                                                            ours["ready_above_baseline_mib"]),
        "seconds_ratio_stock_over_ours": ratio(stock["seconds"], ours["seconds"]),
    }


def main() -> None:
    """Write the model config, run both children, load their outputs and print the comparison."""
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--warmup", type=int, default=5, help="steps excluded from the steady-state step time")
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--block-size", type=int, default=128)
    p.add_argument("--hidden-size", type=int, default=512)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--intermediate-size", type=int, default=1376)
    p.add_argument("--vocab-size", type=int, default=8192, help="the bundled tokenizer uses ids < 512")
    p.add_argument("--workdir", default=None, help="default: a new temporary directory")
    p.add_argument("--construct-world-size", type=int, default=8,
                   help="construction_world_size section: build as rank 0 of this many ranks")
    p.add_argument("--construct-model", choices=[*CONSTRUCT_MODELS, "train"], default="llama-325m",
                   help="construction_world_size section's model: llama-325m (benchmarks/meta_init.py's) or "
                        "train (the training section's)")
    p.add_argument("--skip-training", action="store_true", help="only the construction_world_size section")
    p.add_argument("--skip-construction", action="store_true", help="no construction_world_size section")
    p.add_argument("--child", choices=["ours", "stock"], help=argparse.SUPPRESS)
    p.add_argument("--construct-child", choices=["ours", "stock"], help=argparse.SUPPRESS)
    add_smoke_flag(p)
    args = p.parse_args()
    if args.smoke:  # the children get these sizes as flags
        args.steps, args.warmup, args.batch_size, args.block_size = 3, 1, 2, 32
        args.hidden_size, args.layers, args.intermediate_size, args.vocab_size = 64, 2, 128, 512
        args.construct_model, args.construct_world_size = "train", 2
    if args.steps <= args.warmup:
        p.error("--steps must exceed --warmup")
    if args.construct_world_size < 1:
        p.error("--construct-world-size must be at least 1")
    if args.skip_training and args.skip_construction:
        p.error("--skip-training and --skip-construction leave nothing to run")
    if args.child:
        emit(child(args.child, args))
        return
    if args.construct_child:
        emit(construct_child(args.construct_child, args))
        return

    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    wall = time.perf_counter()
    temporary = args.smoke and not args.workdir  # a smoke run leaves nothing behind
    args.workdir = args.workdir or tempfile.mkdtemp(prefix="trainer_vs_stock-")
    heads = max(1, args.hidden_size // 64)
    config = LlamaConfig(vocab_size=args.vocab_size, hidden_size=args.hidden_size, num_hidden_layers=args.layers,
                         intermediate_size=args.intermediate_size, num_attention_heads=heads,
                         num_key_value_heads=heads, max_position_embeddings=max(256, args.block_size),
                         tie_word_embeddings=False, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    report: dict[str, Any] = {"smoke": args.smoke}
    comparison: dict[str, Any] = {}
    if not args.skip_training:
        config.save_pretrained(Path(args.workdir) / "config")
        with torch.device("meta"):
            params = sum(t.numel() for t in AutoModelForCausalLM.from_config(config).parameters())

        results = {kind: run_child("child", kind, args) for kind in ("ours", "stock")}
        (ours_load, ours_sd), (stock_load, stock_sd) = (load_check(results[k]["model_dir"]) for k in ("ours", "stock"))
        results["ours"]["load"], results["stock"]["load"] = ours_load, stock_load
        weight_diff = max((ours_sd[k].float() - stock_sd[k].float()).abs().max().item() for k in ours_sd)

        ours, stock = results["ours"], results["stock"]
        ratio = lambda a, b: round(a / b, 3) if b > 0 else None  # noqa: E731  (None: ours adds nothing)
        step_ratio = ratio(ours["steady_step_s"], stock["steady_step_s"])
        cpu_ratio = ratio(ours["steady_step_cpu_s"], stock["steady_step_cpu_s"])
        rss_ratio = lambda key: ratio(stock[key], ours[key])  # noqa: E731
        report.update({
            "model": {"params": params, "fp32_mib": round(params * 4 / MIB, 1), "hidden_size": args.hidden_size,
                      "layers": args.layers, "intermediate_size": args.intermediate_size,
                      "vocab_size": args.vocab_size, "heads": heads, "batch_size": args.batch_size,
                      "block_size": args.block_size, "steps": args.steps, "warmup": args.warmup},
            "ours": ours, "stock": stock,
        })
        comparison.update({
            "step_time_ratio_ours_over_stock": step_ratio,
            "step_cpu_ratio_ours_over_stock": cpu_ratio,
            "construction_rss_above_baseline_ratio_stock_over_ours": rss_ratio("construction_above_baseline_mib"),
            "model_ready_rss_above_baseline_ratio_stock_over_ours": rss_ratio("model_ready_above_baseline_mib"),
            "save_rss_above_start_ratio_stock_over_ours": rss_ratio("save_above_start_mib"),
            "save_rss_above_start_mib": {k: results[k]["save_above_start_mib"] for k in ("ours", "stock")},
            "save_rss_above_baseline_ratio_stock_over_ours": ratio(stock["save_peak_mib"] - stock["baseline_rss_mib"],
                                                                   ours["save_peak_mib"] - ours["baseline_rss_mib"]),
            "save_time_ratio_stock_over_ours": ratio(stock["save_s"], ours["save_s"]),
            "loss_max_abs_diff": max(abs(a - b) for a, b in zip(ours["losses"], stock["losses"], strict=True)),
            "final_weights_max_abs_diff": weight_diff,
            "target_step_time_within_10pct": step_ratio is not None and step_ratio <= 1.10,
            "target_step_cpu_within_10pct": cpu_ratio is not None and cpu_ratio <= 1.10,
            "target_ours_no_compiles_after_warmup": ours["compiles_after_warmup"] == 0,
        })
    report["stock_fix"] = STOCK_FIX
    if not args.skip_construction:
        section = construction_section(args, config)
        report["construction_world_size"] = section
        comparison.update({
            "construction_world_size": section["world_size"],
            "construction_world_size_peak_above_baseline_mib": {
                k: section[k]["peak_above_baseline_mib"] for k in ("ours", "stock")},
            "construction_world_size_peak_above_baseline_ratio_stock_over_ours":
                section["peak_above_baseline_ratio_stock_over_ours"],
            "construction_world_size_vm_hwm_above_baseline_ratio_stock_over_ours":
                section["vm_hwm_above_baseline_ratio_stock_over_ours"],
            "construction_world_size_seconds_ratio_stock_over_ours": section["seconds_ratio_stock_over_ours"],
            "construction_world_size_rank_params_match_model_over_n": section["rank_params_match_model_over_n"],
        })
    report.update({"comparison": comparison, "workdir": args.workdir, "wall_s": round(time.perf_counter() - wall, 1)})
    if temporary:
        shutil.rmtree(args.workdir, ignore_errors=True)
    emit(report)


if __name__ == "__main__":
    main()
