"""The training step compiles once: from the second step on, XLA compiles nothing new.

Each run is a fresh process (XLA's in-memory graph cache is per process) training a model whose shape nothing else
uses; the first step must compile (so a cached graph cannot make the test pass by accident) and the next three
must not. Before the optimizer's state was created at prepare time, step 2 compiled the whole step again (AdamW
makes its state inside its first step, so step 1 traced another graph). On FSDP v2 the Trainer's running loss
(``_tr_loss``, made before training as a plain device tensor) came back from step 1 annotated as replicated, which
made step 2's graph differ too.
"""

import json

import pytest
from helpers import SCRIPTS, run_python

pytestmark = pytest.mark.xla  # needs torch_xla (skipped where it is not installed: tests/conftest.py)


@pytest.mark.parametrize("loop,engine", [("plugin", "v1"), ("trainer", "v1"), ("accelerate", "v2"), ("trainer", "v2")])
def test_steps_after_the_first_compile_nothing(loop: str, engine: str) -> None:
    args = [SCRIPTS / "compile_steps.py", loop, "--steps", "4"] + (["--v2"] if engine == "v2" else [])
    proc = run_python(args, devices=4 if engine == "v2" else 1, timeout=600, preloaded=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    compiles = result["compiles"]
    assert len(compiles) == 4 and compiles[0] >= 1, result
    assert compiles[1:] == [0, 0, 0], f"{loop} on {engine} compiled new graphs after step 1: {compiles}"
