"""MFU's denominator where users look (hf_xla_fsdp/planning/peaks.py): GPUs found by the names torch reports, TPU
chips by their device kinds, the ``$HF_XLA_FSDP_PEAK_TFLOPS`` override; and the host-bound line of an eager device
(hf_xla_fsdp/session/throughput.py): said from the device's queue, never from the host's share of a step, which on
an eager device is the device's work itself."""

from __future__ import annotations

import logging

import pytest
import torch

from hf_xla_fsdp.errors import ConfigError
from hf_xla_fsdp.planning.flops import ModelFlops
from hf_xla_fsdp.planning.peaks import ENV_PEAK_TFLOPS, gpu_peak, peak_flops
from hf_xla_fsdp.session.throughput import Throughput


@pytest.mark.parametrize("name, entry, peak", [
    # the names torch.cuda.get_device_name() gives these parts (as nvidia-smi prints them)
    ("NVIDIA H100 80GB HBM3", "H100 SXM", 989e12),
    ("NVIDIA H100 PCIe", "H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", "H100 NVL", 835e12),
    ("NVIDIA H200", "H200", 989e12),
    ("NVIDIA A100-SXM4-80GB", "A100", 312e12),
    ("NVIDIA L40S", "L40S", 362e12),
    ("NVIDIA L4", "L4", 121e12),
    ("NVIDIA A10", "A10", 125e12),
    ("AMD Instinct MI300X", "MI300X", 1307e12),
])
def test_gpu_names_find_their_dense_bf16_peak(name, entry, peak):
    found = gpu_peak(name)
    assert found is not None and found.name == entry and found.peak_bf16_flops == peak
    assert peak_flops(name) == (peak, f"{entry} ({found.source})")


def test_unknown_devices_have_no_peak_and_the_override_wins_everywhere(monkeypatch):
    monkeypatch.delenv(ENV_PEAK_TFLOPS, raising=False)
    for kind in ("cpu", "NVIDIA A10G", "NVIDIA GeForce GTX 1080", "", None):  # A10G is not A10: no guessed figure
        assert peak_flops(kind)[0] is None and gpu_peak(kind) is None
    assert peak_flops("TPU v5 lite")[0] == 197e12 and peak_flops("cpu")[1] == "no peak FLOP/s is known for device kind 'cpu'"
    monkeypatch.setenv(ENV_PEAK_TFLOPS, "400")
    assert peak_flops("cpu") == (400e12, f"${ENV_PEAK_TFLOPS}") and peak_flops("NVIDIA H200")[0] == 400e12
    for bad in ("fast", "0", "-3", "inf", "nan"):
        monkeypatch.setenv(ENV_PEAK_TFLOPS, bad)
        with pytest.raises(ConfigError) as err:
            Throughput(None, devices=1, processes=1, kind="cpu")  # at start-up, before any step
        assert ENV_PEAK_TFLOPS in str(err.value) and "\n" not in str(err.value)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _run(meter: Throughput, clock: Clock, steps: int, host: float, rest: float) -> dict[str, float]:
    for _ in range(steps):
        meter.batch({"input_ids": torch.zeros(4, 16, dtype=torch.long)})
        meter.step_begin()
        clock.now += host
        meter.step_end()
        clock.now += rest
    return meter.logs()


def test_an_eager_device_is_host_bound_when_its_queue_is_empty_at_step_ends(caplog):
    flops = ModelFlops(10_000, 10_000, 2, 4, 16)
    with caplog.at_level(logging.WARNING, logger="hf_xla_fsdp.session.throughput"):
        # the CPU device: the step's code is the device's work, all of it host time, and that is no bottleneck
        clock = Clock()
        cpu = Throughput(flops, devices=2, processes=2, kind="cpu", clock=clock, traced=False, queue_idle=None)
        assert _run(cpu, clock, 4, 1.0, 0.0)["host_seconds_per_step"] == pytest.approx(1.0)
        # a GPU whose queue still holds work at every step end: the host runs ahead, the device is the bottleneck
        clock = Clock()
        busy = Throughput(flops, devices=2, processes=2, kind="NVIDIA H200", clock=clock, traced=False,
                          queue_idle=lambda: False)
        logs = _run(busy, clock, 4, 0.1, 0.0)
        assert logs["mfu_percent"] == pytest.approx(100 * logs["tflops_per_second_per_device"] * 1e12 / 989e12, rel=1e-4)
        assert not [r for r in caplog.records if "host-bound" in r.getMessage()]
        # idle at 9 of 10 step ends (the bound: 90 %): the device waited for kernels to be launched
        ends = iter([False] + [True] * 9)
        clock = Clock()
        starved = Throughput(flops, devices=2, processes=2, kind="NVIDIA H200", clock=clock, traced=False,
                             queue_idle=lambda: next(ends))
        _run(starved, clock, 10, 0.1, 0.0)
    lines = [r.getMessage() for r in caplog.records if "host-bound" in r.getMessage()]
    assert len(lines) == 1 and "9 of 10 steps" in lines[0] and "compile: true" in lines[0] and "\n" not in lines[0]

