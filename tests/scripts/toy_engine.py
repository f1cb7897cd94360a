"""A new engine as a contributor adds one: a class in engines/ with its declarations, one entry in ``ENGINES``.

The toy engine is engine fsdp2's code under declarations of its own (key, alias, name, title, launchers, an own
setting), so that what it shows is what the declarations alone reach: the settings' checks, the CLI, the settings
table, checkpoints and model cards. Run as a script (one process, engine fsdp2's environment), it registers the engine,
builds the tiny Llama with ``engine: toy``, saves a checkpoint, consolidates it and prints the model card as JSON.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/, for helpers

from hf_xla_fsdp.engines import ENGINES  # noqa: E402
from hf_xla_fsdp.engines.fsdp2 import Fsdp2  # noqa: E402


class ToyEngine(Fsdp2):
    """torch's fully_shard under the toy engine's declarations."""

    key = "toy"
    aliases = ("toy_fsdp",)
    name = "toy_engine"
    title = "Toy engine (fully_shard under new declarations)"
    launchers = ("MULTI_CPU", "NO")
    launcher_fix = "the toy engine runs torch.distributed processes on the CPU; set distributed_type: MULTI_CPU"
    honours = frozenset({"reshard_after_forward", "replica_size"})  # fsdp2's, without compile
    torch_fsdp2 = False  # accelerate's fsdp_version: 2 stays engine fsdp2's


def register() -> ToyEngine:
    """Add the toy engine to the registry (the one line a new engine adds); returns it."""
    engine = ENGINES["toy"] = ToyEngine()
    return engine


def main(out: Path) -> None:
    """Train nothing: build, save, consolidate and render the card of the tiny Llama on the toy engine."""
    import torch
    from helpers import tiny_llama

    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.checkpoint import save_checkpoint
    from hf_xla_fsdp.checkpoint.consolidate import TRAINING_INFO, consolidate
    from hf_xla_fsdp.engines import engine_of
    from hf_xla_fsdp.export.hub import render_card

    register()
    torch.manual_seed(0)
    plugin = XlaFsdpPlugin(engine="toy_fsdp")
    model = plugin.build(tiny_llama(), progress=False)
    save_checkpoint(out / "ckpt", model, step=1, plugin=plugin)
    consolidate(out / "ckpt", out / "model", progress=False)
    card = render_card(out / "model", model_name="toy")
    print(json.dumps({"engine": plugin.engine, "wrapped_by": engine_of(model).key,
                      "meta": json.loads((out / "model" / TRAINING_INFO).read_text()),
                      "card": str(card)}))


if __name__ == "__main__":
    os.environ.setdefault("USE_TORCH_XLA", "0")  # engine fsdp2's code: transformers stays off torch_xla
    main(Path(sys.argv[1]))
