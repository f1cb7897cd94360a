"""A stock Trainer script with the one-import swap to ``XlaFsdpTrainer(model=DIR)`` and ``fsdp_config={"engine":
"fsdp2"}``, under ``torchrun --nproc_per_node 4`` on CPU with torch_xla unimportable: its losses equal the stock
single-process CPU Trainer's (SGD, AdamW; bf16 within its precision), as do the unmodified script's under
``hf-xla-fsdp launch``; its checkpoint consolidates with ``hf-xla-fsdp consolidate`` into the final model and resumes
on 2 processes with the same losses. And accelerate's own FSDP2 YAML selects the engine for an Accelerator script."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
import zygote
from helpers import ROOT, USER_SCRIPTS, fsdp2_env, tiny_llama, torchrun

SCRIPT = USER_SCRIPTS / "fsdp2_trainer.py"
RUNS = ["sgd", "adamw_torch", "adamw_torch+bf16"]
#: the single-process runs on the host (stock references, building the models, consolidation): forked from one
#: preloaded process (tests/zygote.py; their subject is not start-up), torch_xla unimportable as in the ranks
HOST_ENV = fsdp2_env({"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "ACCELERATE_USE_CPU": "true"})


def losses(out, run: str) -> dict[str, float]:
    found = json.loads((out / run / "losses.json").read_text())
    assert not found["torch_xla_imported"]
    return found["losses"]


@pytest.mark.slow
@pytest.mark.no_xla_leg  # the Must-show run, also without torch_xla installed on a newer torch
def test_trainer_on_fsdp2_equals_the_stock_cpu_trainer_consolidates_and_resumes(tmp_path):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(tmp_path / "model")
    ours, stock, resumed = tmp_path / "fsdp2", tmp_path / "stock", tmp_path / "resumed"
    model = ["--model", tmp_path / "model"]
    # 4 processes of 2 rows each against one process of 8: the same global batches (accelerate's seedable sampler)
    run = torchrun(4, [SCRIPT, *model, "--output_dir", ours, "--optim", *RUNS, "--save_steps", "3"])
    assert run.returncode == 0, run.stderr[-6000:]
    reference = zygote.run([SCRIPT, "--stock", *model, "--output_dir", stock, "--optim", *RUNS,
                            "--per_device_train_batch_size", "8"], cwd=ROOT, env=HOST_ENV, timeout=900)
    assert reference.returncode == 0, reference.stderr[-6000:]
    # fp32: the same arithmetic but for reductions in another order (4 partial means, a reduce-scatter, the norm
    # summed over shards); 5e-7 was measured over 6 steps
    for name in ("sgd", "adamw_torch"):
        assert losses(ours, name) == pytest.approx(losses(stock, name), abs=1e-4), name
    # bf16: fsdp2 computes in bf16 parameters (MixedPrecisionPolicy, fp32 shards and gradient reduction), the stock
    # Trainer under CPU autocast (fp32 weights, bf16 matmuls): bf16's 8-bit mantissa is 0.4% of a loss near 4.8
    # (0.02) per rounding
    assert losses(ours, "adamw_torch+bf16") == pytest.approx(losses(stock, "adamw_torch+bf16"), abs=0.05)

    # the stock script itself (no hf_xla_fsdp import, model built by from_pretrained) under `hf-xla-fsdp launch`,
    # which starts 2 processes as torchrun does and makes its Trainer ours: the same losses
    launched = subprocess.run([sys.executable, "-m", "hf_xla_fsdp.cli", "launch", "--num_processes", "2", "--fsdp_config",
                               '{"engine": "fsdp2"}', str(SCRIPT), "--stock", *map(str, model), "--output_dir",
                               str(tmp_path / "launched"), "--optim", "sgd", "--per_device_train_batch_size", "4"],
                              cwd=ROOT, env=fsdp2_env(), capture_output=True, text=True, timeout=900)
    assert launched.returncode == 0, launched.stderr[-6000:]
    assert json.loads((tmp_path / "launched" / "sgd" / "losses.json").read_text())["world_size"] == 2
    assert losses(tmp_path / "launched", "sgd") == pytest.approx(losses(stock, "sgd"), abs=1e-4)

    # resumed from checkpoint-3 on 2 processes of 4 rows: steps 4-6 as the uninterrupted run on 4
    run = torchrun(2, [SCRIPT, *model, "--output_dir", resumed, "--optim", "adamw_torch", "--per_device_train_batch_size",
                       "4", "--resume", ours / "adamw_torch" / "checkpoint-3"])
    assert run.returncode == 0, run.stderr[-6000:]
    after, before = losses(resumed, "adamw_torch"), losses(ours, "adamw_torch")
    assert sorted(after) == ["1", "2", "3", "4", "5", "6"]  # steps 1-3 come back with the checkpoint's trainer state
    # 2 processes reduce in another order than 4: 5e-7 was measured
    assert [after[k] for k in "456"] == pytest.approx([before[k] for k in "456"], abs=1e-5)

    # `hf-xla-fsdp consolidate` of the last checkpoint (no torch_xla) is the final model the Trainer saved, and it
    # computes the stock Trainer's final model's loss
    out = tmp_path / "consolidated"
    done = zygote.run(["-m", "hf_xla_fsdp.cli", "consolidate", ours / "adamw_torch" / "checkpoint-6", "--output", out,
                       "--quiet"], cwd=ROOT, env=HOST_ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    consolidated = AutoModelForCausalLM.from_pretrained(out)
    final = AutoModelForCausalLM.from_pretrained(ours / "adamw_torch")
    for (name, a), (_, b) in zip(consolidated.state_dict().items(), final.state_dict().items()):
        assert torch.equal(a, b), name
    ids = torch.arange(32).reshape(2, 16) % 128
    reference_model = AutoModelForCausalLM.from_pretrained(stock / "adamw_torch")
    with torch.no_grad():
        assert consolidated(input_ids=ids, labels=ids).loss.item() == pytest.approx(
            reference_model(input_ids=ids, labels=ids).loss.item(), abs=1e-4)


@pytest.mark.slow
def test_accelerate_script_under_accelerates_own_fsdp2_yaml_equals_one_stock_process(tmp_path):
    """run_clm_no_trainer-style script, its Accelerator import swapped, under `accelerate launch` with the FSDP2 YAML
    `accelerate config` writes (distributed_type FSDP, fsdp_version 2, 2 CPU processes): engine fsdp2 is selected and
    the final weights are the stock Accelerator's in one process with the same global batches."""
    from safetensors.torch import load_file

    pre = tmp_path / "pre"
    made = zygote.run([USER_SCRIPTS / "make_pretrained.py", pre], cwd=ROOT, env=HOST_ENV, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    common = ["--model_name_or_path", pre / "llama", "--train_file", pre / "train.txt", "--validation_file",
              pre / "validation.txt", "--block_size", "32", "--learning_rate", "1e-3", "--seed", "0",
              "--max_train_steps", "6"]
    env = fsdp2_env({"USE_HF_XLA_FSDP": "1", "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"})
    accelerate = [str(sys.executable.rsplit("/", 1)[0] + "/accelerate"), "launch", "--config_file",
                  USER_SCRIPTS / "configs" / "fsdp2_from_accelerate_config.yaml"]
    ours = subprocess.run([*map(str, accelerate), str(USER_SCRIPTS / "clm_no_trainer.py"), *map(str, common),
                           "--per_device_train_batch_size", "4", "--per_device_eval_batch_size", "4",
                           "--checkpointing_steps", "3", "--output_dir", str(tmp_path / "ours")],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    assert ours.returncode == 0, ours.stdout[-3000:] + ours.stderr[-5000:]
    stock = zygote.run([USER_SCRIPTS / "clm_no_trainer.py", *common, "--per_device_train_batch_size", "8",
                        "--per_device_eval_batch_size", "8", "--output_dir", tmp_path / "stock"], cwd=ROOT, env=HOST_ENV,
                       timeout=900)
    assert stock.returncode == 0, stock.stderr[-5000:]
    assert sorted(p.name for p in (tmp_path / "ours" / "checkpoints").iterdir()) == ["checkpoint_0", "checkpoint_1"]
    a, b = load_file(tmp_path / "ours" / "model.safetensors"), load_file(tmp_path / "stock" / "model.safetensors")
    assert set(a) == set(b)
    # fp32, reductions in another order (2 partial means, a reduce-scatter): 1.2e-7 was measured after 6 AdamW steps
    for name in a:
        assert torch.allclose(a[name], b[name], rtol=0, atol=1e-5), name


def graphs(out, run: str) -> dict[str, int]:
    return json.loads((out / run / "losses.json").read_text())["graphs_compiled"]


@pytest.mark.slow
def test_compiled_fsdp2_trainer_equals_eager_compiles_once_consolidates_and_resumes_on_one_process(tmp_path):
    """``fsdp_config={"engine": "fsdp2", "compile": true}`` on 2 torchrun processes: every decoder layer compiled
    (one graph serves the 3 layers), losses equal to the eager run's, nothing compiled after step 1 (fixed shapes),
    parameter names unchanged, so the checkpoint consolidates into the final model and resumes on 1 process."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(tiny_llama()).save_pretrained(tmp_path / "model")
    model = ["--model", tmp_path / "model", "--optim", "adamw_torch"]
    compiled, eager, resumed = tmp_path / "compiled", tmp_path / "eager", tmp_path / "resumed"
    run = torchrun(2, [SCRIPT, *model, "--output_dir", compiled, "--compile", "--save_steps", "3"])
    assert run.returncode == 0, run.stderr[-6000:]
    run = torchrun(2, [SCRIPT, *model, "--output_dir", eager])
    assert run.returncode == 0, run.stderr[-6000:]
    # fp32 both: inductor fuses the norms, activations and softmax and may sum in another order; 4.8e-7 was measured
    # over 6 steps, while a step moves the loss by 1e-2 or more (a wrong gradient shows at once)
    assert losses(compiled, "adamw_torch") == pytest.approx(losses(eager, "adamw_torch"), abs=1e-5)
    # the same layer code and shapes in every block and step: step 1 compiles (one graph, forward and backward, for
    # the 3 layers), every later step finds it; the eager run compiles nothing
    counts = graphs(compiled, "adamw_torch")
    assert counts["1"] >= 1 and all(counts[str(s)] == 0 for s in range(2, 7)), counts
    assert set(graphs(eager, "adamw_torch").values()) == {0}

    # resumed from checkpoint-3 on 1 process of 4 rows (compiled again): steps 4-6 as the uninterrupted run
    run = torchrun(1, [SCRIPT, *model, "--output_dir", resumed, "--compile", "--per_device_train_batch_size", "4",
                       "--resume", compiled / "adamw_torch" / "checkpoint-3"])
    assert run.returncode == 0, run.stderr[-6000:]
    after, before = losses(resumed, "adamw_torch"), losses(compiled, "adamw_torch")
    # one process reduces in another order than 2: 5e-7 was measured eagerly, as above for compiling
    assert [after[k] for k in "456"] == pytest.approx([before[k] for k in "456"], abs=1e-5)

    # the checkpoint holds the model's own names (no _orig_mod.): it consolidates into the model the Trainer saved
    out = tmp_path / "consolidated"
    done = zygote.run(["-m", "hf_xla_fsdp.cli", "consolidate", compiled / "adamw_torch" / "checkpoint-6", "--output", out,
                       "--quiet"], cwd=ROOT, env=HOST_ENV, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    consolidated = AutoModelForCausalLM.from_pretrained(out).state_dict()
    final = AutoModelForCausalLM.from_pretrained(compiled / "adamw_torch").state_dict()
    assert list(consolidated) == list(final)
    for name in final:
        assert torch.equal(consolidated[name], final[name]), name
