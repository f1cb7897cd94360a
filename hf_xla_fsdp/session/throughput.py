"""Throughput of a training run, added to every logging step of ``XlaFsdpTrainer`` and ``XlaFsdpAccelerator.log``.

Keys (each over the steps since the previous logging step):

* ``tokens_per_second`` and ``tokens_per_second_per_device``: tokens of the batches trained on (the main input's
  elements: ``input_ids``, padding included, as the device computes them), over every process, divided by the
  wall time of those steps, and by the job's device count;
* ``tflops_per_second_per_device``: model FLOPs (:mod:`hf_xla_fsdp.planning.flops`: ``6N + 12LHQT`` per token, after
  PaLM appendix B) per second and device;
* ``mfu_percent``: that, against the device's peak dense bf16 FLOP/s (:mod:`hf_xla_fsdp.planning.peaks`: the TPU
  table, v4, v5e, v5p, v6e, and common GPUs by their device name; ``$HF_XLA_FSDP_PEAK_TFLOPS`` overrides both).
  Elsewhere, CPUs included, it is left out and one log line says why (no published peak);
* ``step_seconds``: wall time per optimizer step; ``host_seconds_per_step``: the part of it the host spends in the
  step's own code (tracing forward, backward and the optimizer into XLA's lazy graph), less the time that code
  spent waiting for device values it read (torch_xla's ``TransferFromDeviceTime``) and compiling
  (``CompileTime``); ``device_reads_per_step``: how many device values the step's own code read. Each such read
  makes the host wait for the device before it can trace on (transformers 5.23's causal-mask shortcuts read one
  per forward on XLA);
* ``graphs_compiled``: graphs compiled in the window (:func:`graphs_compiled`: torch.compile's on engine fsdp2 with
  ``compile``, torch_xla's on the XLA engines): a fixed-shape run logs 0 after its first steps.

The device runs a step's graph while the host traces the next one, so a step takes about the longer of the two.
When the host's part reaches 90 % of the step, the device waits for the host: one warning line says so (the fix is
less tracing per token: ``scan_layers`` on FSDP v2, or a larger batch per step). An eager accelerator (engine fsdp2
on a GPU) runs the kernels the host queues: when its queue is already empty at the end of 90 % of the steps (the
device finished all the host had issued before the host finished issuing), the host is the bottleneck and the same
warning says so (the fix: ``compile: true``, fewer and larger kernels, or a larger batch per step). On a CPU device
the host is the device: no such warning. Nothing here waits for the
device: token counts come from tensor shapes (host metadata), the clock and torch_xla's metrics are read on the
host at step boundaries, and the Trainer reads its loss (a device sync) before every logging step anyway.
"""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

from torch import nn

from ..planning.flops import ModelFlops, model_flops
from ..planning.peaks import known_devices, peak_flops

logger = logging.getLogger(__name__)

#: the host's share of a step from which the run counts as host-bound
HOST_BOUND = 0.9
KEYS = ("tokens_per_second", "tokens_per_second_per_device", "tflops_per_second_per_device", "mfu_percent",
        "step_seconds", "host_seconds_per_step", "device_reads_per_step", "graphs_compiled")


def device_kind() -> str:
    """The kind of this process's XLA device as the PJRT runtime reports it (``TPU v5 lite``; ``cpu`` on XLA:CPU).

    Under SPMD (FSDP v2) the process's device is a virtual one the runtime gives no kind (``Unknown device SPMD:0``):
    on TPU the slice's accelerator type names the generation instead (``v5litepod``, ``v6e``: torch_xla reads it from
    the TPU VM's metadata), elsewhere the runtime's device type (``cpu``). Never raises: a kind it cannot read is
    ``unknown`` (no MFU; tokens per second are logged all the same). A process whose engine runs without torch_xla
    (fsdp2: torch_xla never imported) gets torch's default device type (``cpu``, ``cuda``): nothing imports it here."""
    if "torch_xla" not in sys.modules:
        return _eager_device_kind()
    import torch_xla.core.xla_model as xm
    import torch_xla.runtime as xr

    try:
        return xm.xla_device_kind()
    except RuntimeError:  # the SPMD virtual device
        pass
    try:
        if xr.device_type() == "TPU":
            from torch_xla._internal import tpu

            return tpu.get_tpu_type()
        return str(xr.device_type()).lower()
    except Exception as err:  # noqa: BLE001 - no metadata server, an unknown runtime: no MFU, nothing else lost
        logger.info("throughput: the device kind cannot be read (%s: %s)", type(err).__name__, err)
        return "unknown"


def _eager_accelerator() -> Optional[str]:
    """The device type of torch's current accelerator (``cuda``, ``xpu``, TorchTPU's ``tpu``), None on the CPU."""
    import torch

    current = getattr(torch, "accelerator", None)
    found = current.current_accelerator(check_available=True) if current is not None else None
    return found.type if found is not None else ("cuda" if torch.cuda.is_available() else None)


def _eager_device_kind() -> str:
    """What a device without torch_xla is: its name where torch can read it (``NVIDIA H100 80GB HBM3``), else its
    type (``cpu``, ``tpu``)."""
    import torch

    device_type = _eager_accelerator()
    if device_type is None:
        return "cpu"
    try:
        return str(torch.get_device_module(device_type).get_device_name())
    except Exception:  # noqa: BLE001 - a backend without names: the type still says what it is
        return device_type


def queue_idle_probe() -> Optional[Callable[[], bool]]:
    """For an eager accelerator, a function telling whether the device has run everything queued on its current
    stream (``Stream.query()``, which waits for nothing); None on the CPU, under torch_xla (lazy tracing: its own
    rule) and where the backend has no streams."""
    if "torch_xla" in sys.modules:
        return None
    device_type = _eager_accelerator()
    if device_type is None:
        return None
    import torch

    module = torch.get_device_module(device_type)
    if not hasattr(module, "current_stream"):
        return None
    return lambda: bool(module.current_stream().query())


def _waits() -> tuple[int, float]:
    """Device-to-host reads so far, and the seconds spent in them and in compiling, from torch_xla's metrics (host
    counters: reading them waits for nothing); none where torch_xla is not this process's runtime (fsdp2)."""
    if "torch_xla" not in sys.modules:
        return 0, 0.0
    import torch_xla.debug.metrics as met

    reads, compiles = met.metric_data("TransferFromDeviceTime"), met.metric_data("CompileTime")
    return (int(reads[0]) if reads else 0,
            ((reads[1] if reads else 0) + (compiles[1] if compiles else 0)) / 1e9)


def graphs_compiled() -> int:
    """Graphs compiled in this process so far (a host counter): torch.compile's (``torch._dynamo``'s unique graphs,
    engine fsdp2 with ``compile``) plus torch_xla's (its ``CompileTime`` count, the XLA engines). A fixed-shape run
    stops adding to it after its first steps; a rise later is a recompile. Nothing is imported here: a runtime not yet
    loaded has compiled nothing."""
    count = 0
    utils = sys.modules.get("torch._dynamo.utils")
    if utils is not None:
        count += int(utils.counters["stats"]["unique_graphs"])
    if "torch_xla" in sys.modules:
        import torch_xla.debug.metrics as met

        compiles = met.metric_data("CompileTime")
        count += int(compiles[0]) if compiles else 0
    return count


def _round(value: float) -> float:
    return float(f"{value:.6g}")


def tokens_of(inputs: Any, main_input: str = "input_ids") -> Optional[tuple[int, int]]:
    """``(tokens, sequence length)`` of a batch, from its main input's shape (no device access); None when the
    batch has no such input (an image model: no tokens)."""
    tensor = inputs.get(main_input) if isinstance(inputs, dict) or hasattr(inputs, "get") else None
    shape = getattr(tensor, "shape", None)
    if shape is None or len(shape) < 1:
        return None
    return int(tensor.numel()), int(shape[-1])


class Throughput:
    """Counts one process's batches and step times; :meth:`logs` gives the keys above for the steps since its last call."""

    def __init__(self, flops: Optional[ModelFlops], *, devices: int, processes: int, kind: str,
                 clock: Callable[[], float] = time.perf_counter, main_input: Optional[str] = "input_ids",
                 traced: bool = True, queue_idle: Optional[Callable[[], bool]] = None) -> None:
        """``traced``: the host traces each step into a lazy graph (torch_xla), so its share of the step is what can
        make the device wait; else (eager) ``queue_idle`` (:func:`queue_idle_probe`), when given, tells at each step's
        end whether the device already ran all that was queued."""
        self.flops, self.devices, self.processes, self.kind = flops, max(1, devices), max(1, processes), kind
        self.main_input = main_input  # the batch key whose tokens are counted (None: a model without tokens)
        self.peak, peak_source = peak_flops(kind)
        self.traced, self._queue_idle = traced, queue_idle
        self._clock = clock
        self._warned = False
        self._start: Optional[float] = None
        self._reset()
        if self.peak is None:
            logger.info("throughput: mfu_percent is not logged: %s (the tables know %s; set $HF_XLA_FSDP_PEAK_TFLOPS "
                        "to the device's dense bf16 TFLOP/s); tokens and TFLOP/s per second are", peak_source,
                        known_devices())
        else:
            logger.info("throughput: mfu_percent against %.4g TFLOP/s per device, from %s", self.peak / 1e12,
                        peak_source)

    @classmethod
    def for_model(cls, model: nn.Module, unwrap: Callable[[nn.Module], nn.Module]) -> "Throughput":
        """A meter for the wrapped ``model`` (``unwrap`` gives the transformers model inside, a PEFT model's base
        model: :meth:`~hf_xla_fsdp.session.XlaFsdpSession.transformers_model`), on this runtime."""
        from .. import runtime

        inner = unwrap(model)
        flops = None
        # tokens are what a text model takes (input_ids); an image or audio model's main input holds no tokens
        main_input = "input_ids" if getattr(inner, "main_input_name", "input_ids") == "input_ids" else None
        config = getattr(inner, "config", None)
        if config is not None:
            # the shards of trained and frozen parameters are cut alike, so their ratio is the whole model's
            sizes = [(p.numel(), p.requires_grad) for p in model.parameters()]
            total = sum(n for n, _ in sizes)
            trained = sum(n for n, grad in sizes if grad) / total if total else 1.0
            try:
                flops = model_flops(config, trained)
            except Exception as err:  # noqa: BLE001 - a model the skeleton builder cannot build: no FLOPs, tokens still
                logger.info("throughput: model FLOPs unknown (%s: %s): tflops and mfu are not logged",
                            type(err).__name__, err)
        if "torch_xla" in sys.modules:
            devices, processes = runtime.device_count(), runtime.process_count()
        else:  # an engine without torch_xla (fsdp2): one device per torch.distributed process
            import torch.distributed as dist

            devices = processes = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
        traced = "torch_xla" in sys.modules
        return cls(flops, devices=devices, processes=processes, kind=device_kind(), main_input=main_input,
                   traced=traced, queue_idle=None if traced else queue_idle_probe())

    def _reset(self) -> None:
        self._tokens = 0
        self._flops = 0.0
        self._steps = 0
        self._host = 0.0
        self._reads = 0
        self._idle_ends = 0
        self._begin: Optional[float] = None
        self._begin_waits = (0, 0.0)
        self._graphs = graphs_compiled()

    # ----------------------------------------------------------------- what the training loop reports
    def batch(self, inputs: Any) -> None:
        """One (micro-)batch trained on."""
        counted = tokens_of(inputs, self.main_input) if self.main_input is not None else None
        if counted is not None:
            tokens, seq = counted
            self._tokens += tokens
            if self.flops is not None:
                self._flops += tokens * self.flops.per_token(seq)

    def step_begin(self) -> None:
        """An optimizer step starts (the host starts tracing it)."""
        now = self._clock()
        if self._start is None:
            self._start = now
        self._begin, self._begin_waits = now, _waits()

    def step_end(self) -> None:
        """The optimizer step's code has run (traced; the device runs it asynchronously)."""
        self._steps += 1
        if self._queue_idle is not None and self._queue_idle():
            self._idle_ends += 1
        if self._begin is not None:
            reads, waited = _waits()
            self._reads += reads - self._begin_waits[0]
            self._host += max(0.0, self._clock() - self._begin - (waited - self._begin_waits[1]))
        self._begin = None

    def logs(self) -> dict[str, float]:
        """The throughput keys for the steps since the last call (none before the first step), then start anew."""
        now = self._clock()
        if self._start is None or self._steps == 0:
            return {}
        seconds = max(now - self._start, 1e-9)
        out: dict[str, float] = {"step_seconds": _round(seconds / self._steps)}
        host = self._host / self._steps
        out["host_seconds_per_step"] = _round(host)
        out["device_reads_per_step"] = _round(self._reads / self._steps)
        out["graphs_compiled"] = graphs_compiled() - self._graphs  # in this logging window (0 once warmed up)
        if self.traced and host >= HOST_BOUND * seconds / self._steps and not self._warned:
            self._warned = True
            logger.warning("host-bound: tracing a step takes %.3f s of the %.3f s a step takes, so the devices wait "
                           "for the host; trace less per token: scan_layers=true (FSDP v2) or a larger batch per step",
                           host, out["step_seconds"])
        elif self._queue_idle is not None and self._idle_ends >= HOST_BOUND * self._steps and not self._warned:
            self._warned = True
            logger.warning("host-bound: the device had run everything queued before the host ended %d of %d steps "
                           "(%.3f s a step), so it waits for the host to launch kernels; launch fewer, larger ones: "
                           "compile: true (engine fsdp2) or a larger batch per step", self._idle_ends, self._steps,
                           out["step_seconds"])
        if self._tokens:
            tokens = self._tokens * self.processes / seconds
            out["tokens_per_second"] = _round(tokens)
            out["tokens_per_second_per_device"] = _round(tokens / self.devices)
        if self._flops:
            per_device = self._flops * self.processes / seconds / self.devices
            out["tflops_per_second_per_device"] = _round(per_device / 1e12)
            if self.peak:
                out["mfu_percent"] = _round(100 * per_device / self.peak)
        self._reset()
        self._start = now
        return out


@functools.cache
def _observed_class(cls: type) -> type:
    def __iter__(self: Any) -> Iterator[Any]:
        meter_of = self._hf_xla_fsdp_throughput
        for batch in super(observed, self).__iter__():
            meter = meter_of()
            if meter is not None:
                meter.batch(batch)
                meter.step_begin()  # the loop holds the batch from here to its request for the next one
            yield batch
            if meter is not None:
                meter.step_end()

    observed = type(cls.__name__, (cls,), {"__iter__": __iter__, "__module__": cls.__module__,
                                           "__qualname__": cls.__qualname__})
    return observed


def observe_loader(loader: Any, meter: Callable[[], Optional[Throughput]]) -> Any:
    """``loader`` itself (same object; its class becomes a subclass, so ``isinstance`` holds) whose batches are
    counted by ``meter()``, each one a step from the moment it is handed out to the request for the next one (an
    accelerate loop's forward, backward and optimizer step). Unchanged when its class cannot take a subclass."""
    if getattr(loader, "_hf_xla_fsdp_throughput", None) is not None:
        return loader
    try:
        loader.__class__ = _observed_class(type(loader))
        loader._hf_xla_fsdp_throughput = meter
    except (TypeError, AttributeError):  # accelerate's DataLoaderShard makes __class__ a read-only property
        logger.debug("%s cannot be observed for throughput", type(loader).__name__)
    return loader


__all__ = ["HOST_BOUND", "KEYS", "Throughput", "device_kind", "graphs_compiled", "observe_loader", "queue_idle_probe",
           "tokens_of"]
