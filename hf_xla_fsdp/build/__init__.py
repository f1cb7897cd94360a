"""Building a sharded model: which blocks become units (``wrapping``), meta construction block by block
(``meta_init``) and sizing from the meta skeleton (``planning``)."""
