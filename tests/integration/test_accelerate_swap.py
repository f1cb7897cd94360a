"""XlaFsdpAccelerator as a drop-in `Accelerator`: the order of calls users write, in one process (FSDP v1).

The end-to-end runs of a `run_clm_no_trainer`-style script under `accelerate launch` (v1 and v2) are in
test_accelerate_scripts.py.
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hf_xla_fsdp import ConfigError, XlaFsdpAccelerator, XlaFsdpPlugin

NO_DECAY = ("bias", "ln_", "norm")


def tiny_gpt2() -> GPT2Config:
    return GPT2Config(vocab_size=128, n_embd=32, n_layer=2, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def decay_groups(model: torch.nn.Module, names=None) -> list[dict]:
    """run_clm_no_trainer's two groups: weight decay except biases and norms."""
    named = list(model.named_parameters()) if names is None else [(names[n], p) for n, p in model.named_parameters()]
    return [{"params": [p for n, p in named if not any(k in n for k in NO_DECAY)], "weight_decay": 0.1},
            {"params": [p for n, p in named if any(k in n for k in NO_DECAY)], "weight_decay": 0.0}]


def batches(device, n=3, vocab=128):
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (2, 16), generator=gen).to(device) for _ in range(n)]


def train(accelerator, model, optimizer, steps) -> list[float]:
    losses = []
    for ids in steps:
        loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    return losses


def full_state(accelerator, model) -> dict[str, torch.Tensor]:
    return accelerator.get_state_dict(model)


@pytest.mark.parametrize("order", ["together", "model_first", "optimizer_first"])
def test_optimizer_built_before_prepare_is_repointed_group_by_group(order):
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2())  # tied embeddings, eager
    groups = decay_groups(model)
    sizes = [len(g["params"]) for g in groups]
    optimizer = torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95))
    if order == "together":
        model, optimizer = accelerator.prepare(model, optimizer)
    elif order == "model_first":
        model = accelerator.prepare(model)
        optimizer = accelerator.prepare(optimizer)
    else:
        optimizer = accelerator.prepare(optimizer)
        model = accelerator.prepare(model)
    sharded = {id(p) for p in model.parameters()}
    assert [len(g["params"]) for g in optimizer.param_groups] == sizes  # one sharded tensor per original (tie once)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    assert all(g["betas"] == (0.9, 0.95) and g["lr"] == 1e-2 for g in optimizer.param_groups)
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == sharded
    got = train(accelerator, model, optimizer, batches(accelerator.device))

    # the documented order: wrap first, then build the optimizer on the sharded parameters
    from hf_xla_fsdp.engines import engine_of

    reference = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    torch.manual_seed(0)
    ref_model = reference.prepare(GPT2LMHeadModel(tiny_gpt2()))
    ref_opt = reference.prepare(torch.optim.AdamW(decay_groups(ref_model, engine_of(ref_model).original_names(ref_model)),
                                                  lr=1e-2, betas=(0.9, 0.95)))
    expected = train(reference, ref_model, ref_opt, batches(reference.device))
    assert got == expected  # same arithmetic, bit for bit
    a, b = full_state(accelerator, model), full_state(reference, ref_model)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_flat_parameters_with_mixed_groups_fail_in_one_line_and_uniform_groups_work():
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(flatten_parameters=True))
    model = GPT2LMHeadModel(tiny_gpt2())
    with pytest.raises(ConfigError) as err:
        accelerator.prepare(model, torch.optim.AdamW(decay_groups(model), lr=1e-3))
    assert "flatten_parameters" in str(err.value) and "\n" not in str(err.value)

    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(flatten_parameters=True))
    model = GPT2LMHeadModel(tiny_gpt2())
    same = [{"params": g["params"], "weight_decay": 0.0} for g in decay_groups(model)]
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(same, lr=1e-3))
    flat = {id(p) for p in model.parameters()}
    assert {id(p) for g in optimizer.param_groups for p in g["params"]} == flat
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(flat)  # each flat parameter once
    train(accelerator, model, optimizer, batches(accelerator.device, n=1))


def test_an_optimizer_of_another_model_is_refused():
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    model = GPT2LMHeadModel(tiny_gpt2())
    other = GPT2LMHeadModel(tiny_gpt2())
    with pytest.raises(ConfigError) as err:
        accelerator.prepare(model, torch.optim.AdamW(other.parameters(), lr=1e-3))
    assert "parameter(s) of no prepared model" in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("family", ["gpt2", "llama"])
@pytest.mark.parametrize("with_state_dict", [False, True])
def test_save_pretrained_the_way_scripts_do(tmp_path, family, with_state_dict):
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    torch.manual_seed(0)
    if family == "gpt2":
        model = GPT2LMHeadModel(tiny_gpt2())
    else:  # grouped-query attention, untied lm_head
        model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                             num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False))
    optimizer = torch.optim.AdamW(decay_groups(model), lr=1e-2)
    model, optimizer = accelerator.prepare(model, optimizer)
    train(accelerator, model, optimizer, batches(accelerator.device, n=2))
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("files already in the output directory stay")
    unwrapped = accelerator.unwrap_model(model)
    kwargs = {"state_dict": accelerator.get_state_dict(model)} if with_state_dict else {}
    unwrapped.save_pretrained(out, is_main_process=accelerator.is_main_process, save_function=accelerator.save, **kwargs)
    assert (out / "keep.txt").is_file() and (out / "model.safetensors").is_file()
    reloaded, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    ids = batches("cpu", n=1)[0]
    model.eval()
    with torch.no_grad():
        want = model(input_ids=ids.to(accelerator.device)).logits.cpu()
        got = reloaded.eval()(input_ids=ids).logits
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)  # fp32 on both sides: reduction order only


def test_a_state_dict_of_another_model_is_refused_before_anything_is_written(tmp_path):
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())
    model = accelerator.prepare(GPT2LMHeadModel(tiny_gpt2()))
    wrong = GPT2LMHeadModel(GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64)).state_dict()
    with pytest.raises(ConfigError) as err:
        accelerator.unwrap_model(model).save_pretrained(tmp_path / "out", state_dict=wrong)
    assert "does not belong to this model" in str(err.value) and "\n" not in str(err.value)
    assert not (tmp_path / "out").exists() and not list(tmp_path.iterdir())


@pytest.mark.parametrize("async_save", [False, True], ids=["sync", "async"])
def test_save_state_automatic_naming_rotation_registered_objects_and_latest(tmp_path, async_save):
    from accelerate.utils import ProjectConfiguration

    from hf_xla_fsdp.checkpoint import wait_for_pending_save

    class Counter:
        def __init__(self):
            self.seen = 0

        def state_dict(self):
            return {"seen": torch.tensor(self.seen)}

        def load_state_dict(self, state):
            self.seen = int(state["seen"])

    project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True, total_limit=2)
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(async_save=async_save), project_config=project)
    counter = Counter()
    accelerator.register_for_checkpointing(counter)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(tiny_gpt2())
    model, optimizer = accelerator.prepare(model, torch.optim.AdamW(decay_groups(model), lr=1e-2))
    steps = batches(accelerator.device, n=4)
    for ids in steps[:3]:
        train(accelerator, model, optimizer, [ids])
        counter.seen += 1
        accelerator.save_state()
    counter.seen = 99  # changed after the call: the checkpoint holds the value save_state saw (3)
    wait_for_pending_save()  # an async save_state may still be writing checkpoint_2
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir())
    assert names == ["checkpoint_1", "checkpoint_2"]  # total_limit=2: checkpoint_0 rotated out
    latest = tmp_path / "checkpoints" / "checkpoint_2"
    assert (latest / "custom_checkpoint_0.pkl").is_file() and (latest / "checkpoint_complete.json").is_file()
    expected = train(accelerator, model, optimizer, steps[3:])

    again = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(),
                               project_config=ProjectConfiguration(project_dir=str(tmp_path),
                                                                   automatic_checkpoint_naming=True, total_limit=2))
    restored = Counter()
    again.register_for_checkpointing(restored)
    torch.manual_seed(1)  # different initial weights: the checkpoint must replace them
    model2 = GPT2LMHeadModel(tiny_gpt2())
    model2, optimizer2 = again.prepare(model2, torch.optim.AdamW(decay_groups(model2), lr=1e-2))
    again.load_state()
    assert restored.seen == 3 and again.save_iteration == 3
    assert train(again, model2, optimizer2, steps[3:]) == expected
    meta = json.loads((latest / "rank-00000-of-00001.json").read_text())
    assert meta["optimizer"]["param_groups"][0]["weight_decay"] == 0.1


def test_mixed_precision_becomes_the_compute_dtype_never_autocast(monkeypatch):
    accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(), mixed_precision="bf16")
    assert accelerator.xla_fsdp_plugin.compute_dtype is torch.bfloat16
    assert not accelerator.native_amp  # accelerate's autocast would break SDPA attention on XLA
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "bf16")  # what `accelerate launch` exports from the YAML
    assert XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin()).xla_fsdp_plugin.compute_dtype is torch.bfloat16
    with pytest.raises(ConfigError, match=r"^fsdp_plugin=XlaFsdpPlugin\(compute_dtype=float16\) and "
                                          r"ACCELERATE_MIXED_PRECISION=bf16 disagree: compute_dtype=float16 vs bfloat16; "
                                          r"keep the setting in one place$"):
        XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(compute_dtype="fp16"))
    monkeypatch.setenv("ACCELERATE_MIXED_PRECISION", "fp8")
    with pytest.raises(ConfigError, match="fp8 cannot be honoured"):
        XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin())


def test_sigterm_sets_preempted_save_state_says_so_and_handlers_are_restored(tmp_path, caplog):
    import logging
    import os
    import signal

    from accelerate.utils import ProjectConfiguration

    calls = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: calls.append(signum))  # a handler of "the user's"
    try:
        previous = signal.getsignal(signal.SIGTERM)
        off = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(save_on_preemption=False))
        assert off.preempted is False and signal.getsignal(signal.SIGTERM) is previous  # nothing installed
        project = ProjectConfiguration(project_dir=str(tmp_path), automatic_checkpoint_naming=True)
        accelerator = XlaFsdpAccelerator(fsdp_plugin=XlaFsdpPlugin(), project_config=project)
        assert signal.getsignal(signal.SIGTERM) is previous  # armed only by the first read of .preempted
        torch.manual_seed(0)
        model = GPT2LMHeadModel(tiny_gpt2())
        model, optimizer = accelerator.prepare(model, torch.optim.AdamW(decay_groups(model), lr=1e-2))
        stopped_at, saved = None, None
        for step, ids in enumerate(batches(accelerator.device, n=4), start=1):
            train(accelerator, model, optimizer, [ids])
            if step == 2:
                os.kill(os.getpid(), signal.SIGTERM)  # a real signal, while "step 2" ends
            if accelerator.preempted:
                with caplog.at_level(logging.WARNING, logger="hf_xla_fsdp"):
                    saved = accelerator.save_state(step=step)
                stopped_at = step
                break
        assert stopped_at == 2 and calls == []  # recorded, not passed on
        assert saved == str(tmp_path / "checkpoints" / "checkpoint_0")
        assert (tmp_path / "checkpoints" / "checkpoint_0" / "checkpoint_complete.json").is_file()
        said = [r.getMessage() for r in caplog.records if "SIGTERM received" in r.getMessage()]
        assert len(said) == 1 and f"saved checkpoint {saved} at step 2" in said[0], said
        os.kill(os.getpid(), signal.SIGTERM)  # a second SIGTERM: the previous handler's effect
        assert calls == [signal.SIGTERM] and signal.getsignal(signal.SIGTERM) is previous
        accelerator.end_training()
        assert signal.getsignal(signal.SIGTERM) is previous
    finally:
        signal.signal(signal.SIGTERM, before)
