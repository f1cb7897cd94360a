"""``hf-xla-fsdp`` command line: every subcommand exits non-zero with one clear line on bad input."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import TYPE_CHECKING, Any, Optional, Sequence

from . import __version__
from .errors import ConfigError, PushError
from .launch import HelpFormatter

if TYPE_CHECKING:  # the plugin imports torch: only a command that needs it does (`--help` stays fast)
    from .plugin import XlaFsdpPlugin


def _plugin_from_args(args: argparse.Namespace) -> "XlaFsdpPlugin":
    from .plugin import XlaFsdpPlugin

    if args.fsdp_config and args.accelerate_config:
        raise ConfigError("give either --fsdp-config or --accelerate-config, not both")
    if args.fsdp_config:
        return XlaFsdpPlugin.from_fsdp_config(args.fsdp_config)
    if args.accelerate_config:
        return XlaFsdpPlugin.from_accelerate_config(args.accelerate_config)
    return XlaFsdpPlugin()


def _plan_plugin(args: argparse.Namespace) -> "XlaFsdpPlugin":
    """The plugin of --fsdp-config / --accelerate-config with the plan's own flags applied on top."""
    plugin = _plugin_from_args(args)
    changes = {}
    if args.activation_checkpointing:
        changes["activation_checkpointing"] = True
    if args.compute_dtype is not None:
        changes["compute_dtype"] = None if args.compute_dtype == "float32" else args.compute_dtype
    if args.engine is not None:
        changes["engine"] = args.engine
    if args.engine_version is not None:
        changes["version"] = args.engine_version
        changes.setdefault("engine", None)  # the version names the engine, whatever the settings named
    if args.tensor_parallel_size is not None:
        changes["tensor_parallel_size"] = args.tensor_parallel_size
    return dataclasses.replace(plugin, **changes) if changes else plugin


def cmd_plan(args: argparse.Namespace) -> int:
    """Print which blocks become FSDP units and the bytes each rank holds, without building anything.

    With ``--tpu SLICE``: the memory per chip of training on that slice, and whether it fits.
    """
    from .planning.presets import is_preset, preset_config
    from .planning.units import plan

    plugin = _plan_plugin(args)
    if args.tpu is None:
        source = preset_config(args.model) if is_preset(args.model) else args.model
        print(json.dumps(plan(source, plugin, world_size=args.world_size or 1), indent=2))
        return 0
    from .planning.tpu import format_plan, plan_tpu

    if args.world_size is not None:
        raise ConfigError("--world-size and --tpu exclude each other: a slice has one FSDP rank per chip")
    report = plan_tpu(args.model, plugin, args.tpu, batch_size=args.batch_size, seq_len=args.seq_len,
                      optimizer=args.optimizer)
    print(json.dumps(report, indent=2) if args.json else format_plan(report))
    return 0


def _no_xla_runtime() -> None:
    """Keep torch_xla out of a consolidation-only process.

    transformers imports torch_xla with its model classes (needed to check a config against a
    checkpoint) unless USE_TORCH_XLA is off when transformers is first imported. Only set here,
    in a process that has not imported transformers yet, so an in-process caller's environment
    and later subprocesses are left alone.
    """
    if "transformers" not in sys.modules and "USE_TORCH_XLA" not in os.environ:
        os.environ["USE_TORCH_XLA"] = "0"


def _checkpoint_source(args: argparse.Namespace, positional: str = "ckpt") -> tuple[str, Optional[str]]:
    """The checkpoint (positional, or torch_xla's ``--ckpt-prefix``) and the suffix to glob after it.

    With ``--ckpt-prefix`` the two are joined as plain strings, as torch_xla's ``consolidate_sharded_ckpts`` and the
    Trainer join them (suffix default ``*.pth``, as there)."""
    given = getattr(args, positional)
    if given is not None and args.ckpt_prefix is not None:
        raise ConfigError(f"give the checkpoint either as {positional.upper()} or as --ckpt-prefix, not both")
    if args.ckpt_prefix is not None:
        return args.ckpt_prefix, args.ckpt_suffix if args.ckpt_suffix is not None else "*.pth"
    if given is None:
        raise ConfigError(f"give the checkpoint: {positional.upper()} (a checkpoint directory or a torch_xla prefix) or "
                          "--ckpt-prefix PREFIX [--ckpt-suffix GLOB]")
    return given, args.ckpt_suffix


def cmd_consolidate(args: argparse.Namespace) -> int:
    """Consolidate FSDP rank files into a from_pretrained-ready safetensors directory."""
    _no_xla_runtime()
    from .export.peft import consolidate_checkpoint

    ckpt, suffix = _checkpoint_source(args)
    summary = consolidate_checkpoint(
        ckpt, args.output, merge_adapters=args.merge_adapters, ckpt_suffix=suffix, config=args.config,
        dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=not args.quiet,
    )
    print(json.dumps(summary, indent=2))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    """Check every rank file of a checkpoint (ids, sizes, every tensor's checksum) without consolidating it."""
    from .checkpoint.verify import verify_checkpoint

    print(json.dumps(verify_checkpoint(*_checkpoint_source(args)), indent=2))
    return 0


def cmd_gather(args: argparse.Namespace) -> int:
    """Bring the host directories of a local-mode checkpoint (per-host disks) together into one checkpoint."""
    from .checkpoint.gather import gather_checkpoint

    print(json.dumps(gather_checkpoint(args.sources, args.output, overwrite=args.overwrite), indent=2))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Consolidated model + model card in DIR, optionally pushed to the Hub."""
    _no_xla_runtime()
    from .export.hub import export

    source, suffix = _checkpoint_source(args, "source")
    try:
        result = export(
            source, args.output, repo_id=args.repo_id, push=args.push, private=args.private,
            revision=args.revision, dtype=args.dtype, max_shard_size=args.max_shard_size, overwrite=args.overwrite,
            ckpt_suffix=suffix, config=args.config, license=args.license, base_model=args.base_model,
            datasets=args.dataset, merge_adapters=args.merge_adapters, progress=not args.quiet,
        )
    except PushError as err:
        print(f"hf-xla-fsdp export: error: {err}", file=sys.stderr)
        return 3
    print(json.dumps(result, indent=2))
    return 0


def _prefix_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--ckpt-prefix", "--ckpt_prefix", default=None,
                   help="torch_xla's spelling of the checkpoint: rank files are glob(PREFIX + SUFFIX), joined as plain "
                        "strings (a directory needs its trailing slash: out/checkpoint-100/) (default: none, the "
                        "positional checkpoint)")
    p.add_argument("--ckpt-suffix", "--ckpt_suffix", default=None,
                   help="glob after the prefix for torch_xla-style files, as torch_xla's consolidate_sharded_ckpts; "
                        "e.g. 'rank*-of-*-pytorch_model.bin' for the Trainer's files (default: *.pth with "
                        "--ckpt-prefix)")


# ---------------------------------------------------------------- env: what a bug report needs (self-contained block)
# Versions come from package metadata (nothing imported); only the device part imports torch_xla, and any failure
# there becomes a field of the report, never a crash: `env` is what users run when something is broken.
ENV_PACKAGES = ("torch", "torch_xla", "transformers", "accelerate", "peft", "trl", "datasets", "safetensors",
                "huggingface_hub", "hf_xla_fsdp")
_TPU_TYPE_URL = "http://metadata.google.internal/computeMetadata/v1/instance/attributes/accelerator-type"


def _tpu_type() -> Optional[str]:
    """The TPU slice type (``v5litepod-8``, ``v4-32``) of a TPU VM, from the environment or, when TPU chips sit on
    the PCI bus, from the VM's metadata server (one short request); None elsewhere."""
    for name in ("TPU_ACCELERATOR_TYPE", "ACCELERATOR_TYPE"):
        if os.environ.get(name):
            return os.environ[name]
    try:
        from torch_xla._internal import tpu

        if tpu.num_available_chips() == 0:  # reads /sys only
            return None
        import urllib.request

        request = urllib.request.Request(_TPU_TYPE_URL, headers={"Metadata-Flavor": "Google"})
        with urllib.request.urlopen(request, timeout=2) as response:
            return response.read().decode().strip() or None
    except Exception:  # not a TPU VM, no metadata server, another torch_xla layout: unknown
        return None


def device_info(torch_xla_installed: bool) -> dict:
    """PJRT device kind and count, SPMD, process count and host of this process's XLA runtime (starting it);
    ``error`` says why a part is unknown (torch_xla missing, the runtime failing to start, e.g. a TPU in use)."""
    info: dict = {"pjrt_device": os.environ.get("PJRT_DEVICE"), "device_kind": None, "device_count": None,
                  "spmd": None, "process_count": None, "host_index": None, "tpu_type": None}
    if not torch_xla_installed:
        info["error"] = "torch_xla is not installed"
        return info
    try:
        import torch_xla.runtime as xr

        info["spmd"] = bool(xr.is_spmd())
        info["tpu_type"] = _tpu_type()
        info["device_count"] = xr.global_runtime_device_count()  # starts the runtime: PJRT_DEVICE is now chosen
        info["device_kind"] = xr.device_type()
        info["process_count"] = xr.process_count()
        info["host_index"] = xr.host_index()
    except Exception as err:  # report, do not crash
        info["error"] = f"{type(err).__name__}: {str(err).strip().splitlines()[0] if str(err).strip() else ''}"
    return info


def collect_env(versions: dict, devices: Optional[dict] = None) -> dict:
    """The ``env`` report from ``versions`` (distribution name -> version, None: not installed) and the result of
    :func:`device_info` (skipped when None)."""
    import platform

    from .upstream import SUPPORTED, TESTED, tested_combination, untested

    outside = untested(versions)
    ran = tested_combination(versions)
    report = {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "versions": {name: versions.get(name) or "not installed" for name in ENV_PACKAGES},
        # only the combinations the suite ran (constraints/oldest.txt and constraints/tested.txt) are "tested"
        "tested_combination": ran is not None,
        "tested_as": ran,
        "in_tested_ranges": not outside,
        "untested": {name: f"{version} (tested {low} to {high})" for name, version, (low, high) in outside},
        "tested_ranges": {name: f"{low} to {high}" for name, (low, high) in TESTED.items()},
        "supported": dict(SUPPORTED),
    }
    if devices is not None:
        report["devices"] = devices
    return report


def format_env(report: dict) -> str:
    """The ``env`` report as the text to paste into a bug report."""
    lines = ["Copy-and-paste the text below in your GitHub issue.", "",
             f"- Python: {report['python']} ({report['platform']})"]
    lines += [f"- {name}: {version}" for name, version in report["versions"].items()]
    devices = report.get("devices")
    if devices is not None:
        count = devices["device_count"]
        lines.append(f"- PJRT device: {devices['device_kind'] or 'unknown'} x {count if count is not None else '?'}"
                     f" (PJRT_DEVICE={devices['pjrt_device'] or 'unset'})")
        lines.append(f"- TPU type: {devices['tpu_type'] or 'none found'}")
        lines.append(f"- SPMD: {'yes' if devices['spmd'] else 'no'} (XLA_USE_SPMD in this process)")
        lines.append(f"- processes: {devices['process_count']}, this host: {devices['host_index']}")
        if devices.get("error"):
            lines.append(f"- device query failed: {devices['error']}")
    if report["tested_combination"]:
        lines.append(f"- tested combination: yes ({report['tested_as']})")
    elif report["untested"]:
        lines.append("- tested combination: no: " + ", ".join(f"{n} {v}" for n, v in report["untested"].items()))
    else:
        lines.append("- tested combination: no: every package is within its tested range, but the suite ran only "
                     "constraints/oldest.txt and constraints/tested.txt")
    return "\n".join(lines)


def cmd_env(args: argparse.Namespace) -> int:
    """Print the versions, devices and whether they are a tested combination (for bug reports)."""
    from .upstream import installed_versions

    versions = installed_versions(ENV_PACKAGES)
    versions["hf_xla_fsdp"] = __version__  # the one imported (a source checkout's metadata may be older)
    devices = None if args.no_devices else device_info(versions.get("torch_xla") is not None)
    report = collect_env(versions, devices)
    print(json.dumps(report, indent=2) if args.json else format_env(report))
    return 0


def _add_env_parser(sub: "argparse._SubParsersAction") -> None:
    p = _sub(sub, "env", "versions, XLA devices and whether they are a tested combination (for bug reports)")
    p.add_argument("--json", action="store_true", help="one JSON object")
    p.add_argument("--no-devices", "--no_devices", action="store_true",
                   help="versions only: do not import torch_xla or start its runtime (e.g. while a job holds the TPU)")
    p.set_defaults(func=cmd_env)
# ---------------------------------------------------------------- end of env


class _DeprecatedVersion(argparse.Action):
    """``plan --version N``: the old spelling of ``--fsdp-version`` (it reads like the program's ``--version``)."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: Optional[str] = None) -> None:
        print("hf-xla-fsdp plan: --version N is deprecated (it reads like the program's --version): use "
              "--fsdp-version N", file=sys.stderr)
        setattr(namespace, self.dest, values)


def _sub(sub: "argparse._SubParsersAction", name: str, text: str) -> argparse.ArgumentParser:
    return sub.add_parser(name, help=text, description=text, formatter_class=HelpFormatter)


def _output(p: argparse.ArgumentParser, text: str) -> None:
    p.add_argument_group("required arguments").add_argument("--output", "-o", required=True, help=text)


def _quiet(p: argparse.ArgumentParser) -> None:
    p.add_argument("--quiet", action="store_true", help="no progress bar")


def _shards(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                   help="dtype of the written weights ('auto' keeps the trained dtype)")
    p.add_argument("--max-shard-size", "--max_shard_size", default="5GB",
                   help="largest safetensors file written (e.g. 5GB, 500MB)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hf-xla-fsdp``."""
    parser = argparse.ArgumentParser(prog="hf-xla-fsdp", description="PyTorch/XLA FSDP for Hugging Face models",
                                     formatter_class=HelpFormatter)
    parser.add_argument("--version", action="version", version=f"hf_xla_fsdp {__version__}",
                        help="print the version of hf_xla_fsdp and exit")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    p = _sub(sub, "plan", "show the FSDP units and per-rank memory of a model (built on meta only)")
    p.add_argument("model", help="a local model directory, a config.json, a Hub id in the local cache, or a preset "
                                 "name (llama-2-7b, llama-2-13b, llama-2-70b, vit-10b, ...)")
    p.add_argument("--world-size", "--world_size", type=int, default=None,
                   help="number of ranks to shard over (default: 1; not with --tpu)")
    p.add_argument("--tpu", default=None, help="a TPU slice (v4-8, v5e-16, v5p-8, v6e-8, ...): memory per chip and "
                                               "whether training fits (default: none, the unit plan only)")
    p.add_argument("--batch-size", "--batch_size", type=int, default=1, help="with --tpu: samples per chip per step")
    p.add_argument("--seq-len", "--seq_len", type=int, default=None,
                   help="with --tpu: tokens per sample (default: max_position_embeddings up to 2048; ViT: its patches)")
    p.add_argument("--activation-checkpointing", "--activation_checkpointing", action="store_true",
                   help="count activations as with activation checkpointing (the settings' value otherwise)")
    p.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd", "adafactor"],
                   help="with --tpu: whose state to count (sgd: torch's plain SGD, no momentum)")
    p.add_argument("--compute-dtype", "--compute_dtype", default=None, choices=["float32", "bfloat16", "float16"],
                   help="the settings' compute_dtype replaced (default: the settings', float32 without any)")
    # no argparse choices: the engines are registered in hf_xla_fsdp.engines (importing them imports torch, and
    # --help stays fast); the plugin checks the value and names every allowed one in its one line
    p.add_argument("--engine", default=None, metavar="ENGINE",
                   help="an engine key, as the settings' engine (the engines table of docs/trainer.md; older "
                        "spellings are accepted; a wrong one is refused with every allowed value) (default: the "
                        "settings', else the first engine whose runtime is installed)")
    p.add_argument("--fsdp-version", "--fsdp_version", dest="engine_version", type=int, default=None, metavar="N",
                   help="the older spelling of an engine, by its version (default: the settings')")
    p.add_argument("--version", dest="engine_version", type=int, metavar="N", action=_DeprecatedVersion,
                   help=argparse.SUPPRESS)
    p.add_argument("--tensor-parallel-size", "--tensor_parallel_size", type=int, default=None,
                   help="with --tpu, FSDP v2: split blocks over T chips (a replica x fsdp x tensor mesh) (default: "
                        "the settings'; with 1 the plan proposes the smallest T that fits)")
    p.add_argument("--json", action="store_true", help="with --tpu: one JSON object (top level has 'fits')")
    p.add_argument("--fsdp-config", "--fsdp_config", default=None,
                   help="transformers-style fsdp_config (JSON file or inline JSON) (default: none, the defaults)")
    p.add_argument("--accelerate-config", "--accelerate_config", default=None,
                   help="accelerate YAML with an fsdp_config: mapping (default: none)")
    p.set_defaults(func=cmd_plan)

    p = _sub(sub, "consolidate", "merge FSDP rank files into a sharded safetensors model (streaming)")
    p.add_argument("ckpt", nargs="?", default=None,
                   help="an hf_xla_fsdp checkpoint dir, a Trainer checkpoint dir, or a torch_xla file prefix "
                        "(or --ckpt-prefix)")
    _output(p, "directory to write (must not exist, unless --overwrite)")
    _prefix_flags(p)
    p.add_argument("--config", default=None,
                   help="model dir or config.json, when the rank files carry no config (default: the rank files')")
    _shards(p)
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--merge-adapters", "--merge_adapters", action="store_true",
                   help="PEFT checkpoints: the full model with the LoRA updates merged in (default: peft's adapter "
                        "files)")
    _quiet(p)
    p.set_defaults(func=cmd_consolidate)

    p = _sub(sub, "verify", "check every rank file of a checkpoint against its checksums (no consolidation)")
    p.add_argument("ckpt", nargs="?", default=None,
                   help="an hf_xla_fsdp checkpoint dir (also a Trainer checkpoint dir or a torch_xla file prefix)")
    _prefix_flags(p)
    p.set_defaults(func=cmd_verify)

    p = _sub(sub, "gather", "copy a local-mode checkpoint's parts from every host's directory into one")
    p.add_argument("sources", nargs="+", help="every host's directory of the checkpoint (paths, or URLs such as gs://)")
    _output(p, "directory (or URL) to write; must not exist, unless --overwrite")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output")
    p.set_defaults(func=cmd_gather)

    p = _sub(sub, "export", "consolidated model + generated model card in DIR, optionally pushed to the Hub")
    p.add_argument("source", nargs="?", default=None,
                   help="a sharded checkpoint (as for consolidate) or an already consolidated directory")
    _output(p, "directory to write the model and its card to (must not exist, unless --overwrite)")
    p.add_argument("--repo-id", "--repo_id", default=None,
                   help="ORG/NAME on the Hub, also the card's model name (default: none, the directory's name)")
    p.add_argument("--push", action="store_true", help="create the repo and upload DIR (needs a token and network)")
    p.add_argument("--private", action="store_true", help="with --push: create the repo private")
    p.add_argument("--revision", default=None, help="with --push: the branch to push to (default: main)")
    _shards(p)
    _prefix_flags(p)
    p.add_argument("--config", default=None,
                   help="model dir or config.json, when the rank files carry no config (default: the rank files')")
    p.add_argument("--license", default=None, help="license named in the card (default: none)")
    p.add_argument("--base-model", "--base_model", default=None,
                   help="the model this one was fine-tuned from, for the card (default: none)")
    p.add_argument("--dataset", action="append", default=None,
                   help="training data set id for the card, repeatable (default: none)")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--merge-adapters", "--merge_adapters", action="store_true",
                   help="PEFT checkpoints: export the full model with the LoRA updates merged in (default: adapters)")
    _quiet(p)
    p.set_defaults(func=cmd_export)
    _add_env_parser(sub)

    p = _sub(sub, "launch", "run an unmodified training script with XLA FSDP (docs/launch.md)")
    from .launch import add_arguments

    add_arguments(p)
    p.set_defaults(func=cmd_launch)
    return parser


def cmd_launch(args: argparse.Namespace) -> int:
    """``hf-xla-fsdp launch`` (dispatched by :func:`main` before this parser sees the script's arguments)."""
    from .launch import launch

    return launch(args)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hf-xla-fsdp`` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:  # the script's arguments are its own; its exceptions keep their tracebacks
        from .launch import main as launch_main

        return launch_main(argv[1:], prog="hf-xla-fsdp launch")
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, OSError, ValueError) as err:  # bad input, or a full disk / read-only place: one line
        print(f"hf-xla-fsdp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
