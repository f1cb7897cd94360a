"""The test runner's preloaded processes (tests/zygote.py) are processes as ``python script args`` makes them: what a
script sees and how it ends equal a fresh interpreter's, also where the environment is read at import, and a timeout
kills the run."""

from __future__ import annotations

import json
import subprocess
import textwrap

import pytest
import zygote
from helpers import run_python, xla_env

pytestmark = pytest.mark.xla

PROBE = textwrap.dedent("""
    import atexit, json, os, sys, threading, time
    import torch
    import torch_xla.runtime as xr

    atexit.register(lambda: print("atexit ran", flush=True))
    done = threading.Event()
    def late():
        done.wait()
        time.sleep(0.2)
        print("thread joined", flush=True)
    threading.Thread(target=late).start()
    print(json.dumps({"argv": sys.argv, "path0": sys.path[0], "cwd": os.getcwd(), "name": __name__,
                      "probe": os.environ.get("TEST_PROBE"), "xla_flags": os.environ.get("XLA_FLAGS"),
                      "log_level": os.environ.get("TF_CPP_MIN_LOG_LEVEL"), "devices": xr.global_runtime_device_count(),
                      "hf_xla_fsdp_imported": "hf_xla_fsdp" in sys.modules, "seed": torch.initial_seed()}), flush=True)
    done.set()
    if sys.argv[1] == "raise":
        raise ValueError("the probe's own error")
    sys.exit(int(sys.argv[1]))
    """)


def test_a_preloaded_run_is_what_a_fresh_process_is(tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(PROBE)
    # 2 devices and a variable of its own: the server was started with neither
    runs = [run_python([script, "raise"], devices=2, env={"TEST_PROBE": "x"}, cwd=tmp_path, preloaded=preloaded)
            for preloaded in (False, True)]
    fresh, forked = runs
    assert forked.returncode == fresh.returncode == 1
    reports = [json.loads(next(line for line in run.stdout.splitlines() if line.startswith("{"))) for run in runs]
    assert reports[0].pop("seed") != reports[1].pop("seed")  # each process draws its own, as fresh ones do
    assert reports[1] == reports[0]
    assert reports[1]["devices"] == 2 and reports[1]["probe"] == "x" and not reports[1]["hf_xla_fsdp_imported"]
    assert "ValueError: the probe's own error" in forked.stderr and "ValueError: the probe's own error" in fresh.stderr
    # an exit code of the script's own (a fresh process's is known: the code given to sys.exit)
    runs.append(run_python([script, "3"], devices=2, cwd=tmp_path, preloaded=True))
    assert runs[-1].returncode == 3 and "Traceback" not in runs[-1].stderr, runs[-1].stderr[-2000:]
    for run in runs:  # non-daemon threads joined, then atexit handlers, as at any interpreter's end
        assert run.stdout.splitlines()[-2:] == ["thread joined", "atexit ran"], run.stdout


def test_a_variable_read_at_import_gets_its_own_server_and_a_timeout_kills(tmp_path):
    # accelerate imports torch_xla unless USE_TORCH_XLA=0 (read at import): preloaded or not, the same modules
    # (a fresh process is the reference where the variable is set; without it, every import of accelerate brings
    # torch_xla: the server's own preload)
    code = "import sys, transformers.trainer; print('torch_xla' in sys.modules)"
    for env, reference in (({}, ()), ({"USE_TORCH_XLA": "0"}, (False,))):
        runs = [run_python(["-c", code], env=env, preloaded=preloaded) for preloaded in (*reference, True)]
        assert [r.stdout.strip() for r in runs] == [str(not env)] * len(runs), [r.stderr[-2000:] for r in runs]
    with pytest.raises(subprocess.TimeoutExpired):
        run_python(["-c", "import time; time.sleep(60)"], timeout=3, preloaded=True)
    # a variable only the XLA runtime reads (in the child) shares the server
    assert zygote._import_environment(xla_env(devices=4)) == zygote._import_environment(xla_env(devices=1))
