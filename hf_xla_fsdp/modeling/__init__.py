"""Turning a transformers model into a sharded one: meta construction block by block (``meta_init``), which
blocks become FSDP units (``wrapping``) and PEFT adapters attached on ``meta`` (``adapters``).

Nothing here knows which FSDP engine runs: the session passes the engine's wrap functions in."""
