"""Sizing before building: FSDP units and bytes per rank from the meta skeleton (``units``), the TPU table and the
per-chip memory planner (``tpu``), and named model shapes (``presets``)."""
