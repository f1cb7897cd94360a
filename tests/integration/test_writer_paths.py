"""Every checkpoint the project writes verifies, consolidates and resumes: each writer path of
tests/scripts/writer_paths.py (meta and eager models, on the host or already on the device, fp32 and bf16 compute,
tied weights, non-persistent and persistent float buffers, LoRA, sync and async saves, several ranks), on FSDP v1 in
this process and on FSDP v2 in one worker process with 4 XLA:CPU devices.

The bug this guards against: an eager model placed on the device before wrapping (the Trainer and accelerate do
that when bf16 comes from an accelerate YAML, the launcher, ``--bf16`` or ``mixed_precision``) made torch_xla's
``get_shard_metadata()`` list the non-persistent rotary ``inv_freq`` (and every cast buffer under a name with
``_fpw_module.``) in ``buffer_info``; the validator refused every such checkpoint as corrupted. Checkpoints already
written that way must still load (the ``before_buffer_info_fix`` case).
"""

from __future__ import annotations

import gc
import json
import sys

import pytest
from helpers import SCRIPTS, run_python

sys.path.insert(0, str(SCRIPTS))
import writer_paths  # noqa: E402

V1_CASES = [case for case, engines in writer_paths.CASES.items() if 1 in engines]


@pytest.fixture(scope="module", autouse=True)
def older_objects_frozen():
    """FSDP v1's constructor runs gc.collect() once per unit; with the test session's objects frozen that costs
    nothing (0.8 s a unit otherwise, with transformers and torch_xla loaded)."""
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.mark.parametrize("case", V1_CASES)
def test_v1_writer_path_verifies_consolidates_and_resumes(tmp_path, case):
    writer_paths.run_case(case, 1, tmp_path)


@pytest.mark.slow
def test_v2_writer_paths_verify_consolidate_and_resume(tmp_path):
    res = run_python([SCRIPTS / "writer_paths.py", "--version", "2", "--out", tmp_path], devices=4,
                     env={"TF_CPP_MIN_LOG_LEVEL": "2"}, timeout=900)
    assert res.returncode == 0, res.stderr[-5000:]
    results = json.loads(res.stdout.strip().splitlines()[-1])
    assert set(results) == {case for case, engines in writer_paths.CASES.items() if 2 in engines}
    failed = {case: why for case, why in results.items() if why != "ok"}
    assert not failed, failed
