"""Peak dense bf16 FLOP/s of a device, the denominator of MFU: TPU chips (:data:`~.tpu.TPU_GENERATIONS`) and common
GPUs, found from the kind the runtime reports (``TPU v5 lite``, ``NVIDIA H100 80GB HBM3``); ``$HF_XLA_FSDP_PEAK_TFLOPS``
overrides the table for any device (a chip not listed, a clock-limited part, a CPU one wants a figure for).

Figures are the vendors' dense (not 2:4 sparse) bf16 matrix-multiply peaks per device as torch sees it (one
``cuda`` device each); a GPU sold in several form factors is matched by the name's form-factor word first (``H100
PCIe`` before ``H100``), as the runtime names them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..settings import env_number
from .tpu import generation_for_device_kind

#: the peak, in TFLOP/s per device, that replaces the table's (a positive number)
ENV_PEAK_TFLOPS = "HF_XLA_FSDP_PEAK_TFLOPS"


@dataclass(frozen=True)
class GpuPeak:
    """One GPU: the words its device name contains (all of them, case-insensitive), its peak and where it is from."""

    name: str
    words: tuple[str, ...]
    peak_bf16_flops: float
    source: str


_NVIDIA = "https://www.nvidia.com/en-us/data-center/"
#: first match wins: a form factor's entry stands before its family's
GPU_PEAKS: tuple[GpuPeak, ...] = (
    GpuPeak("B200", ("b200",), 2250e12, _NVIDIA + "dgx-b200/"),
    GpuPeak("H200", ("h200",), 989e12, _NVIDIA + "h200/"),
    GpuPeak("H100 NVL", ("h100", "nvl"), 835e12, _NVIDIA + "h100/"),
    GpuPeak("H100 PCIe", ("h100", "pcie"), 756e12, _NVIDIA + "h100/"),
    GpuPeak("H100 SXM", ("h100",), 989e12, _NVIDIA + "h100/"),
    GpuPeak("A100", ("a100",), 312e12, _NVIDIA + "a100/"),
    GpuPeak("L40S", ("l40s",), 362e12, _NVIDIA + "l40s/"),
    GpuPeak("L4", ("l4",), 121e12, _NVIDIA + "l4/"),
    GpuPeak("A10", ("a10",), 125e12, _NVIDIA + "products/a10-gpu/"),
    GpuPeak("MI300X", ("mi300x",), 1307e12, "https://www.amd.com/en/products/accelerators/instinct/mi300/mi300x.html"),
)


def _words(kind: str) -> set[str]:
    return set(kind.lower().replace("-", " ").replace("_", " ").split())


def gpu_peak(kind: Optional[str]) -> Optional[GpuPeak]:
    """The table's entry for a GPU named ``kind`` (``torch.cuda.get_device_name()``), or None."""
    if not kind:
        return None
    words = _words(kind)
    return next((g for g in GPU_PEAKS if all(w in words for w in g.words)), None)


def override_flops() -> Optional[float]:
    """``$HF_XLA_FSDP_PEAK_TFLOPS`` in FLOP/s, or None when unset; one line when it is not a positive number."""
    value = env_number(ENV_PEAK_TFLOPS, "set it to the device's dense bf16 peak in TFLOP/s per device, e.g. 989 "
                       "for an H100 SXM, or unset it", positive=True)
    if value is None:
        return None
    return value * 1e12


def peak_flops(kind: Optional[str]) -> tuple[Optional[float], str]:
    """``(peak dense bf16 FLOP/s per device, where it comes from)`` for a device of ``kind``; ``(None, why)`` when
    neither the override nor the tables know it."""
    forced = override_flops()
    if forced is not None:
        return forced, f"${ENV_PEAK_TFLOPS}"
    generation = generation_for_device_kind(kind)
    if generation is not None and generation.peak_bf16_flops:
        return generation.peak_bf16_flops, f"TPU {generation.name} ({generation.source})"
    gpu = gpu_peak(kind)
    if gpu is not None:
        return gpu.peak_bf16_flops, f"{gpu.name} ({gpu.source})"
    return None, f"no peak FLOP/s is known for device kind {kind!r}"


def known_devices() -> str:
    """The devices the tables know, for messages."""
    from .tpu import TPU_GENERATIONS

    return ", ".join([f"TPU {g}" for g in TPU_GENERATIONS] + [g.name for g in GPU_PEAKS])


__all__ = ["ENV_PEAK_TFLOPS", "GPU_PEAKS", "GpuPeak", "gpu_peak", "known_devices", "override_flops", "peak_flops"]
