"""Settings of an ``XlaFsdpAccelerator``: its ``fsdp_plugin`` and ``mixed_precision`` arguments, the launch's settings
or the accelerate YAML, and ``ACCELERATE_MIXED_PRECISION``, resolved by the one conflict rule; and the one variable of
``accelerate launch`` that must not apply (``ACCELERATE_USE_FSDP``)."""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any, Optional

from . import resolve as r

if TYPE_CHECKING:
    from ..plugin import XlaFsdpPlugin


def accelerate_fsdp_off() -> None:
    """``ACCELERATE_USE_FSDP`` (exported by ``accelerate launch`` with ``distributed_type: FSDP``, e.g. for engine
    fsdp2) turned off for this process: an ``XlaFsdpAccelerator``'s session shards the models, and accelerate's own
    FSDP would shard them a second time."""
    if os.environ.get("ACCELERATE_USE_FSDP", "").strip().lower() in ("1", "true", "yes"):
        os.environ["ACCELERATE_USE_FSDP"] = "false"


def accelerator_settings(fsdp_plugin: Optional["XlaFsdpPlugin"], mixed_precision: Any) -> "XlaFsdpPlugin":
    """The settings of an ``XlaFsdpAccelerator``, by the one conflict rule: ``fsdp_plugin``; in a launched script the
    launch's; with neither, the accelerate YAML this process was launched with; then ``mixed_precision`` (else
    ``ACCELERATE_MIXED_PRECISION``, which ``accelerate launch`` exports)."""
    from ..plugin import XlaFsdpPlugin

    launch = r.current_launch_sources()
    sources: list[Optional[r.Source]] = list(launch or [])
    if fsdp_plugin is not None:
        sources.append(r.plugin_source(fsdp_plugin))
    elif launch is None:  # under stock `accelerate launch`: the YAML it was started with
        from .keys import read_accelerate_yaml
        from .sources import launched_yaml

        path = launched_yaml()
        found = r.yaml_sources(path)
        distributed = read_accelerate_yaml(path).get("distributed_type", "XLA")
        XlaFsdpPlugin.resolve(found).check_launcher(distributed, str(path))  # accelerate starts the processes
        sources += found
    if mixed_precision is not None:
        sources.append(r.precision_source(f"Accelerator(mixed_precision={mixed_precision!r})", mixed_precision))
    elif os.environ.get(r.ACCELERATE_PRECISION_ENV):
        value = os.environ[r.ACCELERATE_PRECISION_ENV]
        sources.append(r.precision_source(f"{r.ACCELERATE_PRECISION_ENV}={value}", value))
    return XlaFsdpPlugin.resolve(sources)
