"""The engines a plugin's ``version`` selects, as data (no engine is imported): their titles, the names training
records carry, and the accelerate ``distributed_type`` each runs under. ``hf_xla_fsdp.engines.ENGINES`` implements
each; tests/unit/test_session.py keeps the tables equal to the engines."""

from __future__ import annotations

#: the engine keys (``XlaFsdpPlugin.engine_key``: ``version`` under ``engine="xla"``, else the engine's name) and their
#: titles (``hf_xla_fsdp.engines.ENGINES`` implements each; a test keeps them equal)
ENGINE_TITLES = {1: "FSDP v1 (XlaFullyShardedDataParallel)", 2: "FSDP v2 (SPMD, SpmdFullyShardedDataParallel)",
                 "fsdp2": "FSDP2 (torch fully_shard, DTensor)"}
#: the name each engine writes into training records (a test keeps them equal to the engines' ``name``)
ENGINE_NAMES = {1: "xla_fsdp_v1", 2: "xla_fsdp_v2", "fsdp2": "fsdp2"}
#: accelerate's ``distributed_type`` each engine runs under, and the fix when it is another
ENGINE_LAUNCHERS = {
    1: (("XLA", "TPU"), "XLA FSDP needs distributed_type: XLA"),
    # accelerate's XLA launcher starts one process per device (xmp.spawn); SPMD needs exactly one
    2: (("NO",), "FSDP v2 (SPMD) drives every device from one process; set distributed_type: NO and num_processes: 1 "
                 "(see examples/xla_fsdp_v2.yaml)"),
    # torch.distributed processes (accelerate launch / torchrun / hf-xla-fsdp launch start one per device)
    "fsdp2": (("FSDP", "MULTI_CPU", "MULTI_GPU", "MULTI_XPU", "NO"),
              "engine fsdp2 runs torch.distributed processes, not torch_xla's; set distributed_type: FSDP (or MULTI_CPU "
              "/ MULTI_GPU, or NO for one process)"),
}
#: the values of the plugin's ``engine``: ``xla`` (torch_xla; ``version`` picks v1 or v2 inside it) or ``fsdp2``
ENGINE_CHOICES = ("xla", "fsdp2")
#: every engine key, and those of the XLA engines (``version`` values)
ALL_ENGINES = (1, 2, "fsdp2")
XLA_ENGINES = (1, 2)


def engine_label(key: object) -> str:
    """How messages name an engine key: ``version=1`` / ``version=2`` (XLA), ``engine=fsdp2``."""
    return f"version={key}" if isinstance(key, int) else f"engine={key}"


def default_engine() -> str:
    """``xla`` where torch_xla is installed, ``fsdp2`` where it is not (found without importing it)."""
    import importlib.util

    try:
        found = importlib.util.find_spec("torch_xla") is not None
    except (ImportError, ValueError):  # a broken or blocked installation counts as absent
        found = False
    return "xla" if found else "fsdp2"


__all__ = ["ALL_ENGINES", "ENGINE_CHOICES", "ENGINE_LAUNCHERS", "ENGINE_NAMES", "ENGINE_TITLES", "XLA_ENGINES",
           "default_engine", "engine_label"]
