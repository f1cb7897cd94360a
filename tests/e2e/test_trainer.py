"""XlaFsdpTrainer: `examples/run_clm.py --fsdp --fsdp_config examples/xla_fsdp_config.json`, for real."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers import ROOT, USER_SCRIPTS, marked_copy, run_in_turn, run_python

from hf_xla_fsdp import ConfigError

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)

SCRIPT = ROOT / "examples" / "run_clm.py"
FSDP_JSON = ROOT / "examples" / "xla_fsdp_config.json"
COMMON = ["--fsdp", "--fsdp_config", str(FSDP_JSON), "--max_steps", "20", "--save_steps", "10", "--logging_steps", "1",
          "--per_device_train_batch_size", "4", "--learning_rate", "3e-3", "--report_to", "none",
          "--max_eval_samples", "16", "--seed", "7"]


def run_clm(out: Path, *extra: str, timeout: int = 900, devices: int = 1, fsdp_json: Path = FSDP_JSON
            ) -> subprocess.CompletedProcess:
    """``examples/run_clm.py`` with the COMMON arguments (``fsdp_json`` as its --fsdp_config) and ``extra``."""
    common = [str(fsdp_json) if c == str(FSDP_JSON) else c for c in COMMON]
    return run_python([SCRIPT, *common, "--output_dir", out, *extra], devices=devices, timeout=timeout, preloaded=True)


def losses(run_dir: Path) -> dict[int, float]:
    history = json.loads((run_dir / "trainer_state.json").read_text())["log_history"]
    return {e["step"]: e["loss"] for e in history if "loss" in e}


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    # trains end to end in a subprocess: every test that uses it is marked slow
    out = tmp_path_factory.mktemp("trainer") / "run"
    res = run_clm(out)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return out


@pytest.mark.slow
def test_checkpoints_are_sharded_and_pickle_free(trained):
    for step in (10, 20):
        ckpt = trained / f"checkpoint-{step}"
        names = {p.name for p in ckpt.iterdir()}
        assert {"checkpoint_complete.json", "rank-00000-of-00001.safetensors", "rank-00000-of-00001.json",
                "trainer_state.json", "config.json", "tokenizer.json"} <= names
        assert not [n for n in names if n.endswith((".bin", ".pt", ".pth"))], names
        meta = json.loads((ckpt / "rank-00000-of-00001.json").read_text())
        assert meta["step"] == step and meta["optimizer"]["param_groups"] and meta["scheduler"]["last_epoch"] == step
    assert not [p for p in trained.iterdir() if p.name.startswith(".")]  # no staging leftovers


@pytest.mark.slow
def test_resume_reproduces_the_uninterrupted_losses(trained, tmp_path):
    ckpt = marked_copy(trained / "checkpoint-10", tmp_path / "checkpoint-10")
    resumed = tmp_path / "resumed"
    res = run_clm(resumed, "--resume_from_checkpoint", str(ckpt))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    full, again = losses(trained), losses(resumed)
    assert sorted(again) == list(range(1, 21)) and {again[s] for s in range(1, 11)} == {-1.0}
    assert json.loads((resumed / "checkpoint-20" / "trainer_state.json").read_text())["global_step"] == 20
    for step in range(11, 21):
        assert again[step] == pytest.approx(full[step], abs=1e-6), step
    eval_full = json.loads((trained / "eval_results.json").read_text())["eval_loss"]
    eval_again = json.loads((resumed / "eval_results.json").read_text())["eval_loss"]
    assert eval_again == pytest.approx(eval_full, abs=1e-6)


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_exits_0_and_resume_matches(trained, tmp_path):
    import re
    import signal
    import time

    from helpers import start_python

    out = tmp_path / "preempted"
    stdout = tmp_path / "preempted.log"
    stderr = Path(f"{stdout}.err")
    proc = start_python([SCRIPT, *COMMON, "--output_dir", out], log=stdout)

    def output() -> str:
        return "".join(f.read_text(errors="replace") for f in (stdout, stderr) if f.is_file())

    sent = False
    deadline = time.monotonic() + 900
    while proc.poll() is None:
        # the loss of every step is logged (logging_steps=1)
        if not sent and sum(("'loss'" in line or '"loss"' in line) for line in output().splitlines()) >= 3:
            proc.send_signal(signal.SIGTERM)  # while step 4 (or a later one) runs
            sent = True
        assert time.monotonic() < deadline, output()[-3000:]
        time.sleep(0.05)
    rc = proc.wait()
    log = output()
    assert sent and rc == 0, log[-3000:]
    found = re.findall(r"SIGTERM received: saved checkpoint (\S+checkpoint-(\d+)) at step (\d+)", log)
    assert len(found) == 1, log[-3000:]
    path, step = Path(found[0][0]), int(found[0][1])
    assert path == out / f"checkpoint-{step}" and int(found[0][2]) == step and 3 <= step < 20, found
    assert (path / "checkpoint_complete.json").is_file()
    assert sorted(p.name for p in out.glob("checkpoint-*")) == sorted({f"checkpoint-{step}"} | (
        {"checkpoint-10"} if step >= 10 else set()))
    assert not (out / "model.safetensors").exists()  # it stopped: no final save_model / evaluate ran
    full = losses(trained)
    assert losses(path) == {s: full[s] for s in range(1, step + 1)}
    # resume from it (logged losses marked, so a silent restart from scratch would show) and finish the run
    ckpt = marked_copy(path, tmp_path / f"checkpoint-{step}")
    resumed = tmp_path / "resumed"
    res = run_clm(resumed, "--resume_from_checkpoint", str(ckpt))
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    again = losses(resumed)
    assert {again[s] for s in range(1, step + 1)} == {-1.0}
    # the same XLA:CPU computations in the same order: the uninterrupted losses, bit for bit
    assert {s: again[s] for s in range(step + 1, 21)} == {s: full[s] for s in range(step + 1, 21)}
    assert "SIGTERM" not in res.stdout + res.stderr


@pytest.mark.slow
def test_output_dir_loads_with_from_pretrained(trained):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(trained, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    tokenizer = AutoTokenizer.from_pretrained(trained)
    assert (trained / "checkpoint-10").is_dir()  # the final save merged beside the checkpoints
    # the from_pretrained model (fp32, CPU) evaluates like the trained FSDP model (bf16 compute on XLA)
    sys.path.insert(0, str(SCRIPT.parent))
    from clm_data import build_datasets

    _, eval_ds = build_datasets(str(ROOT / "examples/data/tiny_corpus.txt"), tokenizer, block_size=64, seed=7)
    batch = {k: torch.tensor(eval_ds[:16][k]) for k in ("input_ids", "attention_mask", "labels")}
    with torch.no_grad():
        loss = model(**{k: v[:8] for k, v in batch.items()}).loss + model(**{k: v[8:] for k, v in batch.items()}).loss
    eval_loss = json.loads((trained / "eval_results.json").read_text())["eval_loss"]
    assert float(loss) / 2 == pytest.approx(eval_loss, abs=0.02)
    assert eval_loss < losses(trained)[1] - 1.0  # it learned
    record = json.loads((trained / "xla_fsdp_training.json").read_text())
    assert record["step"] == 20 and record["metrics"]["eval_loss"] == pytest.approx(eval_loss)
    from huggingface_hub import ModelCard

    card = ModelCard.load(trained / "README.md")
    assert card.data.model_name == "run" and f"{eval_loss:.4f}" in card.text


@pytest.mark.slow
def test_v2_spmd_on_four_devices_resumes_exactly(tmp_path):
    v2_json = ROOT / "examples" / "xla_fsdp_v2_config.json"
    first = tmp_path / "first"
    res = run_clm(first, devices=4, fsdp_json=v2_json)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    meta = json.loads((first / "checkpoint-10" / "rank-00000-of-00001.json").read_text())
    assert meta["engine"] == "spmd" and meta["devices"] == 4 and meta["plugin"]["version"] == 2
    resumed = tmp_path / "resumed"
    ckpt = marked_copy(first / "checkpoint-10", tmp_path / "checkpoint-10")
    res = run_clm(resumed, "--resume_from_checkpoint", str(ckpt), devices=4, fsdp_json=v2_json)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    full, again = losses(first), losses(resumed)
    # steps 1-10 come from the checkpoint (marked), 11-20 are trained again from its state
    assert sorted(again) == list(range(1, 21)) and {again[s] for s in range(1, 11)} == {-1.0}
    assert all(again[s] == pytest.approx(full[s], abs=1e-6) for s in range(11, 21))
    from transformers import AutoModelForCausalLM

    _, info = AutoModelForCausalLM.from_pretrained(first, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert json.loads((first / "xla_fsdp_training.json").read_text())["engine"] == "xla_fsdp_v2"


# --------------------------------------------------------------------------- in-process behaviour
def make_args(out: Path, fsdp_config, **kw):
    from transformers import TrainingArguments

    base = dict(output_dir=str(out), fsdp=True, fsdp_config=fsdp_config, max_steps=4, logging_steps=1,
                per_device_train_batch_size=2, report_to=[], save_strategy="no", seed=0, disable_tqdm=True)
    base.update(kw)
    return TrainingArguments(**base)


def token_dataset(n: int = 16, length: int = 16, vocab: int = 128):
    from datasets import Dataset

    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (n, length), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "attention_mask": [[1] * length] * n, "labels": ids})


def test_meta_built_model_is_wrapped_once_and_introspected(tmp_path, llama_config):
    import torch_xla.core.xla_model as xm

    from hf_xla_fsdp import XlaFsdpTrainer
    from hf_xla_fsdp.engines import ENGINES, fsdp_units, unwrap

    def fsdp_class():
        return ENGINES["xla_v1"].unit_class()

    step_before = xm.optimizer_step
    args = make_args(tmp_path, {"xla": True, "xla_fsdp_grad_ckpt": True, "meta_init": True}, weight_decay=0.1)
    trainer = XlaFsdpTrainer(model=llama_config, args=args, train_dataset=token_dataset())
    units = [name for name, _ in fsdp_units(trainer.model)]
    assert len(units) == llama_config.num_hidden_layers + 1
    assert not isinstance(trainer.model.module, fsdp_class())  # the root wraps the model, not another FSDP
    assert trainer.label_names == ["labels"]  # from LlamaForCausalLM, not from the wrapper class
    trainer.train()
    assert [name for name, _ in fsdp_units(trainer.model)] == units  # train() did not wrap again
    assert xm.optimizer_step is step_before  # unlike the stock path, nothing global is patched
    # weight decay follows transformers' rule on the original names: norms never decay
    names = trainer.xla_fsdp_session.original_names(trainer.model)
    decayed = {names[n] for n in trainer.get_decay_parameter_names(trainer.model)}
    assert "model.layers.0.self_attn.q_proj.weight" in decayed and "lm_head.weight" in decayed
    assert not [n for n in decayed if "norm" in n]
    groups = trainer.optimizer.optimizer.param_groups
    assert groups[0]["weight_decay"] == 0.1 and groups[1]["weight_decay"] == 0.0 and groups[1]["params"]
    assert type(unwrap(trainer.model)).__name__ == "LlamaForCausalLM"


def test_bad_settings_fail_with_the_problem_named(tmp_path, llama_config):
    from hf_xla_fsdp import XlaFsdpTrainer

    with pytest.raises(ConfigError, match='"xla": true'):
        XlaFsdpTrainer(model=llama_config, args=make_args(tmp_path, {"transformer_layer_cls_to_wrap": "X"}))
    with pytest.raises(ConfigError, match="unknown key 'meta_inti'"):
        XlaFsdpTrainer(model=llama_config, args=make_args(tmp_path, {"xla": True, "meta_inti": True}))
    with pytest.raises(ConfigError, match="checkpoint_format='zip' is not valid"):
        XlaFsdpTrainer(model=llama_config, args=make_args(tmp_path, {"xla": True, "checkpoint_format": "zip"}))
    with pytest.raises(ConfigError, match="NoSuchLayer"):
        XlaFsdpTrainer(model=llama_config,
                       args=make_args(tmp_path, {"xla": True, "transformer_layer_cls_to_wrap": ["NoSuchLayer"]}))


def test_stock_checkpoint_is_refused_and_final_save_replaces_stale_weights(tmp_path, llama_config):
    from transformers import AutoModelForCausalLM

    from hf_xla_fsdp import XlaFsdpTrainer

    out = tmp_path / "out"
    stock = out / "checkpoint-2"
    stock.mkdir(parents=True)
    (stock / "rank0-of-1-pytorch_model.bin").write_bytes(b"")
    (out / "model-00001-of-00002.safetensors").write_bytes(b"stale")  # an earlier, differently sharded save
    (out / "notes.txt").write_text("mine")
    args = make_args(out, {"xla": True, "consolidate_max_shard_size": "100KB"}, max_steps=2)
    trainer = XlaFsdpTrainer(model=llama_config, args=args, train_dataset=token_dataset())
    with pytest.raises(ConfigError, match="transformers' own XLA FSDP path"):
        trainer.train(resume_from_checkpoint=str(stock))
    trainer.train()
    trainer.save_model()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = set(index["weight_map"].values())
    assert len(files) > 2 and files <= {p.name for p in out.glob("model-*.safetensors")}
    assert {p.name for p in out.glob("model-*.safetensors")} == files  # stale shard removed
    assert (out / "notes.txt").read_text() == "mine" and (stock / "rank0-of-1-pytorch_model.bin").exists()
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]


def test_sharded_plus_consolidated_checkpoints_load_and_resume(tmp_path, llama_config):
    from transformers import AutoModelForCausalLM

    from hf_xla_fsdp import XlaFsdpTrainer

    cfg = {"xla": True, "checkpoint_format": "sharded+consolidated", "consolidate_dtype": "bfloat16"}
    args = make_args(tmp_path / "a", cfg, save_strategy="steps", save_steps=2, max_steps=4)
    trainer = XlaFsdpTrainer(model=llama_config, args=args, train_dataset=token_dataset())
    trainer.train()
    ckpt = tmp_path / "a" / "checkpoint-2"
    model = AutoModelForCausalLM.from_pretrained(ckpt)
    assert next(model.parameters()).dtype == torch.bfloat16
    first = losses(tmp_path / "a" / "checkpoint-4")
    # the resumed run saves in the background (async_save): published by the time train() returns, same weights
    resumed = XlaFsdpTrainer(model=llama_config, args=make_args(tmp_path / "b", {**cfg, "async_save": True},
                                                                 save_strategy="steps", save_steps=2, max_steps=4),
                             train_dataset=token_dataset())
    resumed.train(resume_from_checkpoint=str(ckpt))
    again = {e["step"]: e["loss"] for e in resumed.state.log_history if "loss" in e}
    assert again[3] == pytest.approx(first[3], abs=1e-6) and again[4] == pytest.approx(first[4], abs=1e-6)
    assert (tmp_path / "b" / "checkpoint-4" / "checkpoint_complete.json").is_file()
    assert losses(tmp_path / "b" / "checkpoint-4")[4] == again[4]  # the trainer state as of step 4
    assert not [p for p in (tmp_path / "b").iterdir() if p.name.startswith(".")]  # no staging left
    from safetensors.torch import load_file

    a, b = (load_file(tmp_path / d / "checkpoint-4" / "rank-00000-of-00001.safetensors") for d in "ab")
    assert a.keys() == b.keys()
    for name in a:  # fp32 shards and AdamW moments of step 4, not of an earlier or later moment
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-5, msg=name)


def test_lora_checkpoints_with_consolidated_copies_and_merge_adapters(tmp_path, llama_config):
    """checkpoint_format sharded+consolidated with a PEFT model: the checkpoint's copy is the adapter files (never
    a merged model beside them); merge_adapters merges the final save only."""
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM, LlamaForCausalLM

    from hf_xla_fsdp import XlaFsdpTrainer

    torch.manual_seed(0)
    LlamaForCausalLM(llama_config).save_pretrained(tmp_path / "base")
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(tmp_path / "base"),
                                peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    cfg = {"xla": True, "checkpoint_format": "sharded+consolidated", "merge_adapters": True}
    trainer = XlaFsdpTrainer(model=model, args=make_args(tmp_path / "out", cfg, save_strategy="steps", save_steps=2,
                                                         max_steps=2, learning_rate=1e-2), train_dataset=token_dataset())
    trainer.train()
    trainer.save_model()
    ckpt, out = tmp_path / "out" / "checkpoint-2", tmp_path / "out"
    names = {p.name for p in ckpt.iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "rank-00000-of-00001.safetensors"} <= names
    assert not {"model.safetensors", "config.json"} & names, names
    batch = torch.randint(0, llama_config.vocab_size, (2, 16), generator=torch.Generator().manual_seed(5))
    adapters = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base"), ckpt).eval()
    merged = AutoModelForCausalLM.from_pretrained(out).eval()  # the final save: the merged model, no adapter files
    assert not (out / "adapter_config.json").exists()
    with torch.no_grad():
        torch.testing.assert_close(merged(input_ids=batch).logits, adapters(input_ids=batch).logits, atol=1e-5, rtol=0)
        base = AutoModelForCausalLM.from_pretrained(tmp_path / "base").eval()(input_ids=batch).logits
    assert (base - merged(input_ids=batch).logits).abs().max() > 1e-3  # the adapters are in it


V2_STOCK = USER_SCRIPTS / "stock_trainer.py"


def run_stock_v2(out: Path, devices: int, **env_extra: str) -> subprocess.CompletedProcess:
    cfg = out.parent / "v2.json"
    cfg.write_text(json.dumps({"xla": True, "xla_fsdp_v2": True, "transformer_layer_cls_to_wrap": ["LlamaDecoderLayer"],
                               "xla_fsdp_grad_ckpt": True}))
    return run_python([V2_STOCK, "--fsdp", "full_shard", "--fsdp_config", cfg, "--output_dir", out, "--max_steps", "6",
                       "--save_steps", "3", "--logging_steps", "1", "--per_device_train_batch_size", "8",
                       "--report_to", "none", "--disable_tqdm", "true"], devices=devices, env=env_extra,
                      preloaded=not env_extra)  # LATE_IMPORT: what the import order does is the subject


@pytest.mark.slow
def test_v2_from_an_unmodified_stock_script_on_1_and_4_devices(tmp_path):
    results = {}
    for devices in (1, 4):  # one device used to segfault (a forced switch to SPMD after the device was taken)
        out = tmp_path / f"d{devices}" / "out"
        out.parent.mkdir()
        res = run_stock_v2(out, devices)
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
        results[devices] = json.loads((out / "results.json").read_text())
        assert results[devices]["spmd"] and results[devices]["devices"] == devices
        assert results[devices]["world_size"] == 1  # one process drives every device
        assert (out / "checkpoint-6" / "checkpoint_complete.json").is_file()
    one, four = ([loss for _, loss in results[d]["losses"]] for d in (1, 4))
    assert len(one) == 6 and one == pytest.approx(four, abs=1e-3)  # same training, split over 4 devices


@pytest.mark.slow
def test_v2_when_the_device_was_taken_before_the_import_is_one_line(tmp_path):
    out = tmp_path / "late" / "out"
    out.parent.mkdir()
    res = run_stock_v2(out, 1, LATE_IMPORT="1")
    assert res.returncode == 1, res.returncode  # a Python error, never a segfault (-11)
    last = res.stderr.strip().splitlines()[-1]
    assert "FSDP v2 needs SPMD before the XLA device is first used" in last and "hf_xla_fsdp.enable_spmd()" in last


# --------------------------------------------------------------------------- the files, beside the stock Trainer's
OUTPUTS = USER_SCRIPTS / "trainer_outputs.py"
OUTPUT_ARGS = ["--max_steps", "4", "--save_steps", "2", "--eval_strategy", "steps", "--eval_steps", "2",
               "--logging_steps", "1", "--report_to", "none", "--per_device_train_batch_size", "4",
               "--learning_rate", "1e-2", "--disable_tqdm", "true", "--seed", "0",
               # the best checkpoint is the one with the *highest* eval loss: the first, not the last one saved
               "--load_best_model_at_end", "true", "--metric_for_best_model", "loss", "--greater_is_better", "true"]
#: what the stock Trainer writes and we do not, and why (docs/trainer.md has the same table)
NOT_WRITTEN = {
    "checkpoint": {
        "model.safetensors": "the weights are in the rank files, one shard per rank (checkpoint_format "
                             "sharded+consolidated adds model.safetensors)",
        "optimizer.pt": "each rank's optimizer state is in its rank file",
        "scheduler.pt": "the scheduler state is in the rank files' metadata",
        "rng_state.pth": "every rank's RNG states are in its rank file",
        "training_args.bin": "training_args.json: the same arguments, no pickle",
    },
    "checkpoint_lora": {
        "optimizer.pt": "each rank's optimizer state is in its rank file",
        "scheduler.pt": "the scheduler state is in the rank files' metadata",
        "rng_state.pth": "every rank's RNG states are in its rank file",
        "training_args.bin": "training_args.json: the same arguments, no pickle",
    },
    "final": {"training_args.bin": "training_args.json: the same arguments, no pickle"},
    "final_lora": {"training_args.bin": "training_args.json: the same arguments, no pickle"},
}


def run_outputs(out: Path, *extra: str, stock: bool = False, more: tuple = ()) -> Path:
    """tests/scripts/user/trainer_outputs.py into ``out``: transformers' Trainer on the CPU (``stock``), or
    XlaFsdpTrainer on XLA:CPU (each run a process of its own, preloaded). ``more``: (out, extra) pairs run after it,
    the same way; the stock runs share one process (helpers.run_in_turn)."""
    if stock:  # no XLA at all: the stock Trainer as it runs on a laptop
        args, env = ["--use_cpu", "true"], {"STOCK": "1", "USE_TORCH_XLA": "0", "PJRT_DEVICE": None}
    else:
        args, env = ["--fsdp", "full_shard", "--fsdp_config", json.dumps({"xla": True})], {}
    argvs = [[OUTPUTS, "--output_dir", o, *OUTPUT_ARGS, *args, *x] for o, x in ((out, extra), *more)]
    if stock:  # without torch_xla, unlike the preloaded processes: one process for every run
        runs = [run_python(argvs[0], env=env, timeout=900) if len(argvs) == 1 else run_in_turn(argvs, env=env, timeout=900)]
    else:
        runs = [run_python(argv, env=env, timeout=900, preloaded=True) for argv in argvs]
    for res in runs:
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-4000:]
    return out


@pytest.fixture(scope="module")
def outputs(tmp_path_factory):
    """The same script, full weights and LoRA, with the stock Trainer and with ours (LoRA runs record logits).

    The full and the LoRA run of each Trainer share one process (two process starts instead of four): what the
    tests compare is the files each run wrote, the logits its checkpoints reload to and a resumed run in a fresh
    process, none of which depends on what ran before in the process (each run seeds itself: set_seed, the
    Trainer's seed, the model built anew)."""
    root = tmp_path_factory.mktemp("outputs")
    runs = {}
    for who in ("stock", "ours"):
        record = ["--record_dir", str(root / f"{who}-lora-rec")] if who == "ours" else []
        run_outputs(root / f"{who}-full", stock=who == "stock", more=((root / f"{who}-lora", ["--lora", "true", *record]),))
        runs[who, "full"], runs[who, "lora"] = root / f"{who}-full", root / f"{who}-lora"
    return root, runs


def names(directory: Path) -> set[str]:
    return {p.name for p in directory.iterdir() if p.is_file()}


@pytest.mark.slow
def test_outputs_have_the_stock_trainers_file_names(outputs):
    _, runs = outputs
    for kind in ("full", "lora"):
        stock, ours = runs["stock", kind], runs["ours", kind]
        suffix = "_lora" if kind == "lora" else ""
        for step in (2, 4):
            theirs, mine = names(stock / f"checkpoint-{step}"), names(ours / f"checkpoint-{step}")
            assert theirs - mine == set(NOT_WRITTEN["checkpoint" + suffix]), (kind, step, theirs, mine)
            # the rank files (exact resume) are there in every case; adapter files only for a PEFT model
            assert {"rank-00000-of-00001.safetensors", "rank-00000-of-00001.json", "checkpoint_complete.json",
                    "training_args.json"} <= mine
            assert ({"adapter_config.json", "adapter_model.safetensors"} <= mine) == (kind == "lora")
            assert ("config.json" in mine) == (kind == "full")  # as peft's save: no config.json beside adapters
        theirs, mine = names(stock), names(ours)
        assert theirs - mine == set(NOT_WRITTEN["final" + suffix]), (kind, theirs, mine)
        # the tokenizer came only through the data collator (no processing_class), on both sides
        assert {"tokenizer.json", "tokenizer_config.json"} <= theirs & mine


def peft_logits(base: Path, adapters: Path, batch: torch.Tensor) -> torch.Tensor:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), adapters).eval()
    with torch.no_grad():
        return model(input_ids=batch).logits


def recorded(rec: Path, name: str) -> torch.Tensor:
    from safetensors.torch import load_file

    return load_file(rec / f"{name}.safetensors")["logits"]


@pytest.mark.slow
def test_lora_checkpoints_load_as_adapters_resume_and_load_best_on_v1(outputs):
    pytest.importorskip("peft")
    sys.path.insert(0, str(USER_SCRIPTS))
    from recording import fixed_batch

    root, runs = outputs
    out, rec = runs["ours", "lora"], root / "ours-lora-rec"
    batch = fixed_batch(json.loads((rec / "base" / "config.json").read_text())["vocab_size"])
    steps = {step: recorded(rec, f"step-{step}") for step in (2, 4)}
    assert (steps[2] - steps[4]).abs().max() > 1e-2  # the two checkpoints are told apart by far more than the tolerance
    for step, logits in steps.items():
        # fp32 on both sides (XLA:CPU while training, eager CPU here): summation order only
        torch.testing.assert_close(peft_logits(rec / "base", out / f"checkpoint-{step}", batch), logits,
                                   atol=1e-5, rtol=0)
    # load_best_model_at_end: checkpoint-2 (highest eval loss) came back from its rank files, and was saved
    state = json.loads((out / "checkpoint-4" / "trainer_state.json").read_text())
    assert state["best_model_checkpoint"].endswith("checkpoint-2")
    torch.testing.assert_close(recorded(rec, "final"), steps[2], atol=1e-6, rtol=0)
    torch.testing.assert_close(peft_logits(rec / "base", out, batch), steps[2], atol=1e-5, rtol=0)
    # resume from the LoRA checkpoint: the uninterrupted run's losses and weights
    resumed = run_outputs(root / "ours-lora-resumed", "--lora", "true", "--record_dir", str(root / "resumed-rec"),
                          "--resume_from_checkpoint", str(out / "checkpoint-2"))
    full, again = losses(out / "checkpoint-4"), losses(resumed / "checkpoint-4")
    assert sorted(again) == [1, 2, 3, 4] and all(again[s] == pytest.approx(full[s], abs=1e-6) for s in (3, 4))
    torch.testing.assert_close(recorded(root / "resumed-rec", "step-4"), steps[4], atol=1e-6, rtol=0)
