"""Tokens per second, MFU and the host's time per step in the Trainer's and the accelerator's logs
(hf_xla_fsdp/session/throughput.py), the FLOPs they rest on (hf_xla_fsdp/planning/flops.py) and the planner's
expected tokens per second per chip. MFU is checked against the TPU table with a TPU device kind given to the meter
(XLA:CPU has no published peak: there the key is left out)."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from helpers import tiny_llama

from hf_xla_fsdp.planning.flops import SOURCE, ModelFlops, expected_tokens_per_second, matmul_params, model_flops
from hf_xla_fsdp.planning.tpu import TPU_GENERATIONS, generation_for_device_kind, plan_tpu
from hf_xla_fsdp.session import throughput
from hf_xla_fsdp.session.throughput import Throughput

V5E_PEAK = 197e12  # TPU v5e, bf16, per chip (Google Cloud's v5e page)


def test_flops_per_token_is_palms_formula_on_a_real_model():
    from transformers import LlamaForCausalLM

    config = tiny_llama(tie_word_embeddings=False)  # vocab 128, hidden 64, 3 layers, 4 heads of 16
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    total = sum(p.numel() for p in model.parameters())
    assert matmul_params(model) == total - 128 * 64  # the input table is a lookup; lm_head is a matrix multiply
    tied = LlamaForCausalLM(tiny_llama(tie_word_embeddings=True))
    assert matmul_params(tied) == sum(p.numel() for p in tied.parameters())  # stored once, multiplied once
    flops = model_flops(config)
    assert (flops.layers, flops.heads, flops.head_dim) == (3, 4, 16)
    n = total - 128 * 64
    assert flops.per_token(32) == 6 * n + 12 * 3 * 4 * 16 * 32  # PaLM appendix B, every parameter trained
    lora = ModelFlops(n, 1000, 3, 4, 16)  # frozen base: no weight gradients but the adapters'
    assert lora.per_token(32) == 4 * n + 2 * 1000 + 12 * 3 * 4 * 16 * 32
    assert "PaLM" in SOURCE


def test_tpu_device_kinds_name_their_generation_and_peak():
    assert generation_for_device_kind("TPU v5 lite").peak_bf16_flops == V5E_PEAK
    assert generation_for_device_kind("TPU v4").name == "v4" and generation_for_device_kind("TPU v5").name == "v5p"
    assert generation_for_device_kind("TPU v6 lite").peak_bf16_flops == 918e12
    # under SPMD the runtime names no device kind: the TPU slice's accelerator type (torch_xla's get_tpu_type) does
    assert generation_for_device_kind("v5litepod").name == "v5e" and generation_for_device_kind("v6e").name == "v6e"
    assert generation_for_device_kind("cpu") is None and generation_for_device_kind(None) is None
    assert all(g.peak_bf16_flops > 0 and g.device_kinds for g in TPU_GENERATIONS.values())


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_meter_keys_values_and_the_host_bound_line(caplog):
    flops = ModelFlops(10_000, 10_000, 2, 4, 16)
    clock = Clock()
    meter = Throughput(flops, devices=4, processes=2, kind="TPU v5 lite", clock=clock)
    batch = {"input_ids": torch.zeros(8, 32, dtype=torch.long)}
    for _ in range(3):  # 3 steps of 1 s, 0.2 s of it the host's
        meter.batch(batch)
        meter.step_begin()
        clock.now += 0.2
        meter.step_end()
        clock.now += 0.8
    logs = meter.logs()
    tokens = 8 * 32 * 2 * 3 / 3.0  # both processes' batches, over 3 s
    assert logs["tokens_per_second"] == pytest.approx(tokens) and logs["tokens_per_second_per_device"] == tokens / 4
    assert logs["step_seconds"] == pytest.approx(1.0) and logs["host_seconds_per_step"] == pytest.approx(0.2)
    assert logs["device_reads_per_step"] == 0
    per_device = tokens / 4 * flops.per_token(32)
    assert logs["tflops_per_second_per_device"] == pytest.approx(per_device / 1e12, rel=1e-5)
    assert logs["mfu_percent"] == pytest.approx(100 * per_device / V5E_PEAK, rel=1e-3)
    assert meter.logs() == {}  # nothing since the last call
    with caplog.at_level(logging.WARNING, logger="hf_xla_fsdp.session.throughput"):
        for _ in range(2):  # now the host takes 0.95 s of each 1 s step: the device waits for it
            meter.step_begin()
            clock.now += 0.95
            meter.step_end()
            clock.now += 0.05
        assert meter.logs()["host_seconds_per_step"] == pytest.approx(0.95)
    lines = [r.getMessage() for r in caplog.records if "host-bound" in r.getMessage()]
    assert len(lines) == 1 and "scan_layers" in lines[0] and "\n" not in lines[0]


def test_on_xla_cpu_mfu_is_left_out_with_the_reason(caplog):
    with caplog.at_level(logging.INFO, logger="hf_xla_fsdp.session.throughput"):
        meter = Throughput(ModelFlops(1000, 1000, 1, 1, 8), devices=1, processes=1, kind="cpu", clock=Clock())
    assert any("mfu_percent is not logged" in r.getMessage() and "'cpu'" in r.getMessage() for r in caplog.records)
    meter.batch({"input_ids": torch.zeros(2, 8, dtype=torch.long)})
    meter.step_begin()
    meter.step_end()
    meter._clock.now += 1.0
    logs = meter.logs()
    assert logs["tokens_per_second"] == 16 and "tflops_per_second_per_device" in logs and "mfu_percent" not in logs


def test_a_meter_counts_the_tokens_of_a_text_model_and_none_of_an_image_model():
    from transformers import LlamaForCausalLM, ViTConfig, ViTForImageClassification

    text = Throughput.for_model(LlamaForCausalLM(tiny_llama()), lambda m: m)
    vit = ViTForImageClassification(ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                              intermediate_size=64, image_size=16, patch_size=8))
    image = Throughput.for_model(vit, lambda m: m)
    assert vit.main_input_name == "pixel_values"
    for meter, batch in ((text, {"input_ids": torch.zeros(2, 8, dtype=torch.long)}),
                         (image, {"pixel_values": torch.zeros(2, 3, 16, 16), "input_ids": torch.zeros(2, 8)})):
        meter.batch(batch)
        meter.step_begin()
        meter.step_end()
    # pixels are not tokens, and an image model's batch has none even when a collator adds another key
    assert text._tokens == 16 and image._tokens == 0


def test_a_device_read_inside_a_step_is_counted_and_its_wait_is_not_host_time():
    import torch_xla

    clock = Clock()
    meter = Throughput(None, devices=1, processes=1, kind="cpu", clock=clock)
    before = throughput._waits()
    meter.step_begin()
    clock.now += 0.5
    (torch.ones(2, device=torch_xla.device()) * 3).sum().item()  # compiles a graph, runs it and waits for its value
    meter.step_end()
    waited = throughput._waits()[1] - before[1]
    clock.now += 0.5
    logs = meter.logs()
    assert logs["device_reads_per_step"] == 1 and logs["step_seconds"] == 1.0
    assert waited > 0 and logs["host_seconds_per_step"] == pytest.approx(max(0.0, 0.5 - waited), abs=1e-5)


def test_trainer_logs_throughput_at_every_logging_step_and_mfu_for_a_known_device(tmp_path, monkeypatch):
    from datasets import Dataset
    from transformers import TrainingArguments

    from hf_xla_fsdp import XlaFsdpTrainer

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (16, 16), generator=g).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})

    def run(out: str) -> list[dict]:
        args = TrainingArguments(output_dir=str(tmp_path / out), max_steps=4, logging_steps=2, per_device_train_batch_size=2,
                                 report_to=[], save_strategy="no", seed=0, disable_tqdm=True, fsdp=True,
                                 fsdp_config={"xla": True, "pad_to_buckets": False})
        trainer = XlaFsdpTrainer(model=tiny_llama(), args=args, train_dataset=data)
        trainer.train()
        return [e for e in trainer.state.log_history if "loss" in e]

    on_cpu = run("cpu")
    assert [e["step"] for e in on_cpu] == [2, 4]
    for entry in on_cpu:
        assert set(throughput.KEYS) - {"mfu_percent"} <= set(entry), entry
        # the host's part of a step is part of the step (the windows exclude waiting for data and for the device)
        assert 0 < entry["host_seconds_per_step"] <= entry["step_seconds"]
        # one process, one device: 2 x 16 tokens a step (rounding of the logged values only)
        assert entry["tokens_per_second"] * entry["step_seconds"] == pytest.approx(32, rel=1e-3)
        assert entry["tokens_per_second_per_device"] == entry["tokens_per_second"]
        assert "mfu_percent" not in entry  # XLA:CPU: no published peak
    flops = model_flops(tiny_llama())
    monkeypatch.setattr(throughput, "device_kind", lambda: "TPU v5 lite")  # the meter reads the kind from here
    on_tpu = run("tpu")
    assert [e["step"] for e in on_tpu] == [2, 4]
    for entry in on_tpu:
        tflops = entry["tokens_per_second_per_device"] * flops.per_token(16) / 1e12
        assert entry["tflops_per_second_per_device"] == pytest.approx(tflops, rel=1e-3)
        assert entry["mfu_percent"] == pytest.approx(100 * tflops * 1e12 / V5E_PEAK, rel=1e-3)


def test_accelerator_log_adds_throughput(monkeypatch):
    from hf_xla_fsdp import XlaFsdpAccelerator, XlaFsdpPlugin

    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(pad_to_buckets=False))
    logged = []
    monkeypatch.setattr(type(accelerator).__mro__[1], "log", lambda self, values, **kw: logged.append(values))
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama())
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = [{"input_ids": torch.randint(0, 128, (16,)), "labels": torch.randint(0, 128, (16,))} for _ in range(8)]
    loader = torch.utils.data.DataLoader(rows, batch_size=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    for batch in loader:
        loss = model(**batch).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    model.eval()
    with torch.no_grad():  # an evaluation pass over a prepared loader: not training tokens, not steps
        [model(**batch).loss for batch in loader]
    model.train()
    assert accelerator._xla_fsdp_meter._steps == 4
    loss.item()  # as a logging loop reads its loss before it logs
    accelerator.log({"loss": 1.0}, step=4)
    values = logged[-1]
    assert values["loss"] == 1.0
    # 4 batches of 2 x 16 tokens
    assert values["tokens_per_second"] * values["step_seconds"] == pytest.approx(32, rel=1e-3)
    tflops = values["tokens_per_second_per_device"] * model_flops(tiny_llama()).per_token(16) / 1e12
    assert values["tflops_per_second_per_device"] == pytest.approx(tflops, rel=1e-3) and "mfu_percent" not in values


def test_plan_prints_the_expected_tokens_per_second_per_chip():
    from hf_xla_fsdp import XlaFsdpPlugin
    from hf_xla_fsdp.planning.tpu import format_plan

    report = plan_tpu("llama-2-7b", XlaFsdpPlugin(), "v5p-8")
    tp = report["throughput"]
    per_token = tp["flops_per_token"]
    # Llama-2-7B: 6.74 B parameters, 131 M of them the untied input table; 32 layers x 32 heads x 128 over 2048 tokens
    n = report["total_params"] - 32000 * 4096
    assert per_token == 6 * n + 12 * 32 * 32 * 128 * 2048
    low, high = tp["tokens_per_second_per_chip"]
    assert low == pytest.approx(0.20 * 459e12 / per_token, abs=0.1) and high == pytest.approx(0.45 * 459e12 / per_token,
                                                                                               abs=0.1)
    assert expected_tokens_per_second(model_flops_from(report), 2048, 459e12)["tokens_per_second_per_chip"] == [low, high]
    assert f"{low:,.0f} to {high:,.0f} tokens/s per chip at 20% to 45% MFU" in format_plan(report)
    assert math.isclose(high / low, 0.45 / 0.20)


def model_flops_from(report: dict) -> ModelFlops:
    n = report["total_params"] - 32000 * 4096
    return ModelFlops(n, n, 32, 32, 128)
