"""The real commands, run as a user runs them: the console script and the quick-start job."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from helpers import ROOT, run_python

BIN = Path(sys.executable).parent


def test_plan_reports_units_and_bytes_per_rank():
    res = run_python([BIN / "hf-xla-fsdp", "plan", ROOT / "examples/configs/tiny_llama.json", "--world-size", "4",
                      "--fsdp-config", ROOT / "examples/xla_fsdp_config.json"], timeout=600, preloaded=True)
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert report["num_units"] == 5 and report["world_size"] == 4
    assert [u["unit"] for u in report["units"]][:4] == [f"model.layers.{i}" for i in range(4)]
    total = report["total_bytes"]
    assert total / 4 <= report["bytes_per_rank"] < total / 4 + 4 * 128 * 4 * 20  # padding to 128 per rank


def test_cli_bad_config_is_one_line_and_nonzero(tmp_path):
    bad = tmp_path / "fsdp.json"
    bad.write_text(json.dumps({"xla": True, "sharding": "zero9"}))
    res = run_python([BIN / "hf-xla-fsdp", "plan", ROOT / "examples/configs/tiny_llama.json", "--fsdp-config", bad],
                     timeout=600)
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "sharding='zero9' is not valid" in lines[0]
    res = run_python([BIN / "hf-xla-fsdp", "plan", tmp_path / "nowhere"], timeout=600)
    assert res.returncode == 2 and "neither a PretrainedConfig" in res.stderr


@pytest.mark.slow
def test_quickstart_end_to_end(tmp_path):
    res = run_python(["examples/quickstart.py", "--output_dir", tmp_path, "--max_train_steps", "60",
                      "--save_steps", "30"], timeout=600, preloaded=True)
    assert res.returncode == 0, res.stdout + res.stderr
    results = json.loads((tmp_path / "quickstart_results.json").read_text())
    assert results["eval_loss_final"] < results["eval_loss_start"] - 0.5
    assert results["plugin"]["activation_checkpointing"] and results["plugin"]["compute_dtype"] == "bfloat16"
    for step in (30, 60):
        assert (tmp_path / f"checkpoint-{step}" / "checkpoint_complete.json").is_file()
    assert (tmp_path / "final" / "model.safetensors").is_file() and (tmp_path / "final" / "config.json").is_file()
    # the from_pretrained copy (fp32 compute) evaluates like the FSDP model (bf16 compute)
    assert abs(results["consolidated_eval_loss"] - results["eval_loss_final"]) < 0.02
    assert len(results["generated"]) == 10
