"""Every benchmark script runs on today's code: ``benchmarks/X.py --smoke`` for each X found in benchmarks/ (a new
script is covered the day it lands), its report one JSON line, last.

The scripts run as ``__main__`` in forks of one process that imported torch, torch_xla, transformers and the
package once (benchmarks/_smoke.py; each child a benchmark starts is a fork of it too): about 10 s of imports per
child process would otherwise make this file cost several minutes. One script also runs as a user runs it, a
fresh ``python benchmarks/scale.py --smoke`` with real child processes, so the plain path of
``_harness.run_json_child`` is covered as well.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from helpers import ROOT, run_python, xla_env

BENCHMARKS = sorted(p for p in (ROOT / "benchmarks").glob("*.py") if not p.name.startswith("_"))
#: seconds one smoke run may take on the loaded 2-core machine before it counts as hung (they take 1-60 s)
TIMEOUT = 420


@pytest.fixture(scope="module")
def smoke_server() -> Iterator[subprocess.Popen[str]]:
    """benchmarks/_smoke.py --serve: the warm process the smoke runs are forked from."""
    proc = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "_smoke.py"), "--serve"], cwd=ROOT,
                            env=xla_env(devices=None), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        assert json.loads(proc.stdout.readline()) == {"ready": True}
        yield proc
    finally:
        proc.stdin.close()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def last_json_line(stdout: str) -> dict[str, Any]:
    """The report: the last line of stdout, parsed (fails the test with the output if it is not one JSON line)."""
    lines = stdout.strip().splitlines()
    assert lines, "the benchmark printed nothing"
    try:
        report = json.loads(lines[-1])
    except json.JSONDecodeError:
        pytest.fail(f"the last line of stdout is not one line of JSON:\n{stdout[-2000:]}")
    assert isinstance(report, dict)
    return report


def test_every_benchmark_is_found():
    # the discovery above is what covers new scripts; an empty or shrunken glob would pass every test vacuously
    names = {p.stem for p in BENCHMARKS}
    assert {"consolidate", "compile", "compile_shapes", "engines", "trainer_vs_stock", "fsdp2", "peers"} <= names


@pytest.mark.parametrize("script", BENCHMARKS, ids=lambda p: p.stem)
def test_benchmark_smoke(smoke_server, script: Path):
    smoke_server.stdin.write(json.dumps({"script": str(script), "timeout": TIMEOUT}) + "\n")
    smoke_server.stdin.flush()
    reply = json.loads(smoke_server.stdout.readline())
    assert reply["returncode"] == 0, (f"{script.name} --smoke failed (exit {reply['returncode']}; every benchmark "
                                      f"must take --smoke):\n{reply['stderr'][-4000:]}")
    # a script that ignored --smoke would have run at full size (minutes) and say so
    assert last_json_line(reply["stdout"])["smoke"] is True


def test_a_benchmark_as_users_run_it():
    # real child processes, not forks: the plain path of _harness.run_json_child
    res = run_python([ROOT / "benchmarks" / "scale.py", "--smoke"], devices=None, timeout=TIMEOUT)
    assert res.returncode == 0, res.stderr[-4000:]
    report = last_json_line(res.stdout)
    assert report["smoke"] is True
    # rank 0 of 2 of the smoke Llama holds half its parameters (XLA FSDP pads each flat shard to 128 elements)
    assert report["current"]["rank_param_mib"] == pytest.approx(report["planned_rank_param_mib"], abs=0.1)
