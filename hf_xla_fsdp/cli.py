"""``hf-xla-fsdp`` command line: every subcommand exits non-zero with one clear line on bad input."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Optional, Sequence

from . import __version__
from .plugin import ConfigError, XlaFsdpPlugin


def _plugin_from_args(args: argparse.Namespace) -> XlaFsdpPlugin:
    if args.fsdp_config and args.accelerate_config:
        raise ConfigError("give either --fsdp_config or --accelerate_config, not both")
    if args.fsdp_config:
        return XlaFsdpPlugin.from_fsdp_config(args.fsdp_config)
    if args.accelerate_config:
        return XlaFsdpPlugin.from_accelerate_config(args.accelerate_config)
    return XlaFsdpPlugin()


def cmd_plan(args: argparse.Namespace) -> int:
    """Print which blocks become FSDP units and the bytes each rank holds, without building anything."""
    from .planning import plan

    report = plan(args.model, _plugin_from_args(args), world_size=args.world_size)
    print(json.dumps(report, indent=2))
    return 0


def cmd_consolidate(args: argparse.Namespace) -> int:
    """Consolidate FSDP rank files into a from_pretrained-ready safetensors directory."""
    # consolidation needs no XLA runtime; without this, importing a transformers model class
    # (to check the config against the checkpoint) imports torch_xla when it is installed
    os.environ.setdefault("USE_TORCH_XLA", "0")
    from .consolidate import consolidate

    summary = consolidate(
        args.ckpt, args.output, ckpt_suffix=args.ckpt_suffix, config=args.config, dtype=args.dtype,
        max_shard_size=args.max_shard_size, overwrite=args.overwrite, progress=not args.quiet,
    )
    print(json.dumps(summary, indent=2))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``hf-xla-fsdp``."""
    parser = argparse.ArgumentParser(prog="hf-xla-fsdp", description="PyTorch/XLA FSDP for Hugging Face models")
    parser.add_argument("--version", action="version", version=f"hf_xla_fsdp {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("plan", help="show the FSDP units and per-rank memory of a model (built on meta only)")
    p.add_argument("model", help="a local model directory or a config.json")
    p.add_argument("--world_size", "--world-size", type=int, default=1, help="number of ranks to shard over")
    p.add_argument("--fsdp_config", "--fsdp-config", help="transformers-style fsdp_config JSON")
    p.add_argument("--accelerate_config", "--accelerate-config", help="accelerate YAML with an fsdp_config: mapping")
    p.set_defaults(func=cmd_plan)

    p = sub.add_parser("consolidate", help="merge FSDP rank files into a sharded safetensors model (streaming)")
    p.add_argument("ckpt", help="an hf_xla_fsdp checkpoint dir, a Trainer checkpoint dir, or a torch_xla file prefix")
    p.add_argument("--output", "-o", required=True, help="directory to write (must not exist, unless --overwrite)")
    p.add_argument("--ckpt-suffix", "--ckpt_suffix", default=None,
                   help="glob after the prefix for torch_xla-style files (default *.pth), as consolidate_sharded_ckpts")
    p.add_argument("--config", default=None, help="model dir or config.json, when the rank files carry no config")
    p.add_argument("--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"])
    p.add_argument("--max-shard-size", "--max_shard_size", default="5GB")
    p.add_argument("--overwrite", action="store_true", help="replace a non-empty output directory")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_consolidate)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of the ``hf-xla-fsdp`` console script."""
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ConfigError, FileNotFoundError, FileExistsError, ValueError) as err:
        print(f"hf-xla-fsdp {args.command}: error: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
