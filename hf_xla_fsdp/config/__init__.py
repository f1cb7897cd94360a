"""Settings before they are a plugin: the vocabularies of transformers' ``fsdp_config`` and accelerate's YAML
(``keys``), and where a process finds them (``sources``: the accelerate YAML it was launched with, its
command line)."""
