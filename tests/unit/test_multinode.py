"""Several machines: the launcher's accelerate-style machine flags (what torchrun is told, what is refused in one
line), and the heartbeat watch that names a lost machine (real TCPStores in this process, a second apart)."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
import torch.distributed as dist
from helpers import USER_SCRIPTS, free_port

from hf_xla_fsdp.engines.base import Machines
from hf_xla_fsdp.engines.fsdp2 import torchrun_placement
from hf_xla_fsdp.engines.nodes import EXIT_NODE_LOST, NodeWatch
from hf_xla_fsdp.launch import main as launch_main
from hf_xla_fsdp.launch import split_command_line

SCRIPT = str(USER_SCRIPTS / "fsdp2_trainer.py")
FSDP2 = ["--fsdp_config", '{"engine": "fsdp2"}']


def test_torchrun_is_told_what_accelerate_would_tell_it():
    assert torchrun_placement(4) == ["--standalone", "--nproc_per_node=4"]
    assert torchrun_placement(2, Machines(2, 1, "10.0.0.1", 1234)) == [
        "--nnodes=2", "--node_rank=1", "--rdzv_backend=static", "--master_addr=10.0.0.1", "--master_port=1234",
        "--nproc_per_node=2"]
    assert "--master_port=29500" in torchrun_placement(2, Machines(2, 0, "10.0.0.1"))  # torchrun's default port
    # dashed and underscored spellings take their value, and the script's own flags stay the script's
    own, script = split_command_line(["--num-machines", "2", "--machine_rank", "1", "--main-process-ip", "h",
                                      "--main_process_port", "9", "t.py", "--num_machines", "3"])
    assert own[-1] == "t.py" and script == ["--num_machines", "3"]


@pytest.mark.parametrize("args, expected", [
    (["--num_machines", "2", "--num_processes", "4", *FSDP2], "num_machines=2 needs main_process_ip"),
    (["--num_machines", "2", "--machine_rank", "2", "--main_process_ip", "h", "--num_processes", "4", *FSDP2],
     "machine_rank=2 with num_machines=2: give 0 to 1"),
    (["--num_machines", "2", "--main_process_ip", "h", *FSDP2], "num_machines=2 needs num_processes"),
    (["--num_machines", "2", "--main_process_ip", "h", "--num_processes", "3", *FSDP2],
     "num_processes=3 does not divide among num_machines=2"),
    (["--num_machines", "2", "--main_process_ip", "h", "--main_process_port", "70000", "--num_processes", "4", *FSDP2],
     "main_process_port=70000: give a TCP port"),
    pytest.param(["--num_machines", "2", "--main_process_ip", "h", "--num_processes", "2", "--fsdp_config",
                  '{"xla": true, "xla_fsdp_v2": true}'], "--num_machines 2, --main_process_ip h: FSDP v2",
                 marks=pytest.mark.xla),
    pytest.param(["--main_process_port", "1234", "--fsdp_config", '{"xla": true}'],
                 "does not start processes across machines", marks=pytest.mark.xla),
])
def test_bad_machine_flags_are_one_line_before_any_work(args, expected, capsys, tmp_path):
    assert launch_main([*args, SCRIPT, "--model", str(tmp_path / "no_model"), "--output_dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("hf-xla-fsdp launch: error: ") and expected in err[0], err


@pytest.mark.xla  # the YAML selects engine xla
def test_a_yamls_machine_keys_count_as_accelerates(tmp_path, capsys):
    yaml = tmp_path / "multi.yaml"
    yaml.write_text("distributed_type: XLA\nnum_machines: 2\nmachine_rank: 1\nmain_process_ip: 10.0.0.1\n"
                    "num_processes: 8\n")
    assert launch_main(["--config_file", str(yaml), SCRIPT]) == 2
    err = capsys.readouterr().err
    assert f"num_machines: 2 in {yaml}, machine_rank: 1 in {yaml}: " in err and "engine fsdp2" in err, err


class Machine:
    """One machine's watch on a real store client, its line and exit code kept instead of printed and taken."""

    def __init__(self, port: int, rank: int, machines: int = 2, timeout: float = 1.0):
        store = dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False,
                              timeout=timedelta(seconds=2))
        self.lines: list[str] = []
        self.codes: list[int] = []
        self.watch = NodeWatch(store, machine=rank, machines=machines, rank=2 * rank, local_rank=0, local_world=2,
                               timeout=timeout, store_address=f"127.0.0.1:{port}", key="test",
                               report=self.lines.append, stop=self.codes.append).start()

    def die(self) -> None:
        """Stop beating without saying goodbye (what SIGKILL does)."""
        self.watch._closed.set()


@pytest.fixture
def store():
    port = free_port()
    # a dict: a test that removes the server from it is the last to hold it (the server stops)
    return {"port": port, "server": dist.TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                                                  timeout=timedelta(seconds=5))}


def test_a_machine_that_stops_beating_is_named_within_the_timeout(store):
    port = store["port"]
    first, second = Machine(port, 0), Machine(port, 1)
    time.sleep(1.5)  # longer than the timeout: beating machines are never lost
    assert not first.lines and not second.lines
    second.die()
    start = time.monotonic()
    verdict = first.watch.wait_for_verdict(5)
    # the timeout (1 s) after the last beat seen, read every 0.2 s; 2.5 s leaves room for a loaded machine
    assert verdict is not None and time.monotonic() - start < 2.5
    assert first.lines == [verdict] and first.codes == [EXIT_NODE_LOST]
    assert "rank 0 on machine 0 stops: machine 1 of 2 (host " in verdict and "ranks 2-3) sent no heartbeat" in verdict


def test_a_machine_whose_processes_finished_is_not_lost(store):
    port = store["port"]
    first, second = Machine(port, 0, timeout=0.5), Machine(port, 1, timeout=0.5)
    for _ in range(2):  # both of its processes (local_world 2) finish
        second.watch._marked = False
        second.watch.mark_finished()
    second.die()
    assert first.watch.wait_for_verdict(3) is None  # settled at once: nobody is left to lose
    time.sleep(1.0)
    assert not first.lines and not first.codes


def test_a_store_that_stops_answering_names_machine_0(store):
    port = store["port"]
    first, second = Machine(port, 0), Machine(port, 1)
    time.sleep(0.5)
    del store["server"]  # machine 0's launcher, which serves the store, is gone
    verdict = second.watch.wait_for_verdict(5)
    assert verdict is not None and "machine 0 of 2 (host " in verdict and f"store at 127.0.0.1:{port}" in verdict
    assert second.codes == [EXIT_NODE_LOST]
    first.die()


def test_flags_in_either_spelling_and_the_yamls_keys_give_the_machines(tmp_path):
    import argparse

    from hf_xla_fsdp.launch import add_arguments, machines_of

    parser = argparse.ArgumentParser()
    add_arguments(parser)
    dashed = parser.parse_args(["--num-machines", "2", "--machine-rank", "1", "--main-process-ip", "10.0.0.1",
                                "--main-process-port", "1234", "t.py"])
    got = machines_of(dashed, {})
    assert (got.count, got.rank, got.main_ip, got.main_port) == (2, 1, "10.0.0.1", 1234)
    yaml = {"num_machines": 2, "machine_rank": 1, "main_process_ip": "10.0.0.2", "main_process_port": 29400}
    got = machines_of(parser.parse_args(["t.py"]), yaml)
    assert (got.count, got.rank, got.main_ip, got.main_port) == (2, 1, "10.0.0.2", 29400)
    # the command line wins over the YAML, as for num_processes
    got = machines_of(parser.parse_args(["--machine_rank", "0", "t.py"]), yaml)
    assert (got.count, got.rank) == (2, 0)
    # what accelerate config writes for one machine changes nothing
    got = machines_of(parser.parse_args(["t.py"]), {"num_machines": 1, "machine_rank": 0})
    assert got == Machines()
