"""The engines a plugin's ``version`` selects, as data (no engine is imported): their titles, the names training
records carry, and the accelerate ``distributed_type`` each runs under. ``hf_xla_fsdp.engines.ENGINES`` implements
each; tests/unit/test_session.py keeps the tables equal to the engines."""

from __future__ import annotations

#: the engines ``version`` selects (``hf_xla_fsdp.engines.ENGINES`` implements each; a test keeps them equal)
ENGINE_TITLES = {1: "FSDP v1 (XlaFullyShardedDataParallel)", 2: "FSDP v2 (SPMD, SpmdFullyShardedDataParallel)"}
#: the name each engine writes into training records (a test keeps them equal to the engines' ``name``)
ENGINE_NAMES = {1: "xla_fsdp_v1", 2: "xla_fsdp_v2"}
#: accelerate's ``distributed_type`` each engine runs under, and the fix when it is another
ENGINE_LAUNCHERS = {
    1: (("XLA", "TPU"), "XLA FSDP needs distributed_type: XLA"),
    # accelerate's XLA launcher starts one process per device (xmp.spawn); SPMD needs exactly one
    2: (("NO",), "FSDP v2 (SPMD) drives every device from one process; set distributed_type: NO and num_processes: 1 "
                 "(see examples/xla_fsdp_v2.yaml)"),
}

__all__ = ["ENGINE_LAUNCHERS", "ENGINE_NAMES", "ENGINE_TITLES"]
