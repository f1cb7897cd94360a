"""What the tests share: tiny configs of real transformers models, real multi-rank FSDP v1 state made in
one process (FSDP v1 with sharding_groups: no collectives), torch_xla's own consolidation as the reference, and a runner of Python
subprocesses with the XLA environment.

Test modules import it as ``from helpers import ...`` (pytest puts tests/ on sys.path); so do the
scripts the tests start (tests/scripts/), which cannot import conftest's fixtures.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch
import zygote
from transformers import BertConfig, GPT2Config, LlamaConfig

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests"
#: worker scripts the tests start, and (user/) scripts written the way users write them
SCRIPTS = TESTS / "scripts"
USER_SCRIPTS = SCRIPTS / "user"

# hf_xla_fsdp and torch_xla are imported inside the functions below: conftest imports this module, and
# a test process should load the package only when a test uses it (some tests check what gets imported)


def tiny_llama(**kw) -> LlamaConfig:
    """A 3-layer Llama of a few hundred kB; ``kw`` overrides any field."""
    base = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    base.update(kw)
    return LlamaConfig(**base)


def tiny_gpt2(**kw) -> GPT2Config:
    """A 3-layer GPT-2 (tied embeddings); ``kw`` overrides any field."""
    base = dict(vocab_size=128, n_embd=64, n_layer=3, n_head=4, n_positions=64, bos_token_id=0, eos_token_id=0)
    base.update(kw)
    return GPT2Config(**base)


def tiny_bert(**kw) -> BertConfig:
    """A 3-layer BERT; ``kw`` overrides any field."""
    base = dict(vocab_size=128, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                intermediate_size=128, max_position_embeddings=64)
    base.update(kw)
    return BertConfig(**base)


def consolidate(models) -> dict[str, torch.Tensor]:
    """Full CPU state dict from the FSDP models of every rank, via torch_xla's own consolidation."""
    from torch_xla.distributed.fsdp import consolidate_sharded_state_dicts

    models = models if isinstance(models, (list, tuple)) else [models]
    state_dicts = [{k: v.cpu() for k, v in m.state_dict().items()} for m in models]
    return consolidate_sharded_state_dicts(state_dicts, models[0].get_shard_metadata())


def build_rank(config, world: int, rank: int, seed: int = 0, **settings) -> torch.nn.Module:
    """The FSDP model of rank ``rank`` of a world of ``world`` ranks (what that rank's own process would build)."""
    from hf_xla_fsdp import XlaFsdpPlugin

    torch.manual_seed(seed)
    plugin = XlaFsdpPlugin(sharding_groups=[list(range(world))], sharding_rank=rank, sharding_world_size=world,
                           **settings)
    return plugin.build(config, progress=False)


def build_ranks(config, world: int, seed: int = 0, **settings) -> list[torch.nn.Module]:
    """The FSDP models of every rank of a world of ``world`` ranks, same seed."""
    return [build_rank(config, world, rank, seed, **settings) for rank in range(world)]


def fake_adam_rank(model, seed: int, rank: int) -> torch.optim.Optimizer:
    """Real AdamW state for one rank, from random gradients seeded by (seed, rank): the same in any process."""
    gen = torch.Generator().manual_seed(seed * 1000 + rank)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).to(p.device)
    opt.step()
    return opt


def fake_adam_state(models, seed: int = 0) -> list[torch.optim.Optimizer]:
    """Real AdamW state on every rank without collectives: a step on random gradients of the shards."""
    gen = torch.Generator().manual_seed(seed)
    optimizers = []
    for model in models:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        for p in model.parameters():
            p.grad = torch.randn(p.shape, generator=gen).to(p.device)
        opt.step()
        optimizers.append(opt)
    return optimizers


def save_ranks(path: Path, models, optimizers=None, step: int = 0) -> Path:
    """Save every rank's files, then commit, exactly as N processes would."""
    from hf_xla_fsdp.checkpoint import commit_checkpoint, write_rank_file

    optimizers = optimizers or [None] * len(models)
    for model, opt in zip(models, optimizers):
        write_rank_file(path, model, opt, step=step)
    return commit_checkpoint(path, len(models))


def save_torch_xla_style(prefix: str, models, optimizers=None) -> list[Path]:
    """torch_xla's MNIST example format: ``<prefix>_rank-00000000-of-00000004.pth``."""
    paths = []
    for rank, model in enumerate(models):
        ckpt = {"model": {k: v.cpu() for k, v in model.state_dict().items()},
                "shard_metadata": model.get_shard_metadata()}
        if optimizers:
            ckpt["optimizer"] = optimizers[rank].state_dict()
        path = Path(f"{prefix}_rank-{rank:08d}-of-{len(models):08d}.pth")
        torch.save(ckpt, path)
        paths.append(path)
    return paths


def save_trainer_style(directory: Path, models) -> list[Path]:
    """transformers Trainer's XLA FSDP format: ``rank{i}-of-{N}-pytorch_model.bin``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for rank, model in enumerate(models):
        path = directory / f"rank{rank}-of-{len(models)}-pytorch_model.bin"
        torch.save({"model": {k: v.cpu() for k, v in model.state_dict().items()},
                    "shard_metadata": model.get_shard_metadata()}, path)
        paths.append(path)
    return paths


def xla_env(*, devices: int | None = 1, env: Mapping[str, str | None] | None = None) -> dict[str, str]:
    """This process's environment for a child on XLA:CPU with ``devices`` devices.

    ``devices=None`` leaves CPU_NUM_DEVICES as inherited; in ``env`` a value of None removes the variable.
    """
    out = dict(os.environ, PJRT_DEVICE="CPU", TOKENIZERS_PARALLELISM="false")
    # an in-process `hf-xla-fsdp consolidate` (cli._no_xla_runtime) sets USE_TORCH_XLA=0 in the test process when it
    # comes first there; inherited, it would keep transformers off torch_xla in an XLA child
    out.pop("USE_TORCH_XLA", None)
    if devices is not None:
        # the device count is fixed when the runtime starts: only a fresh process can have another one
        out["CPU_NUM_DEVICES"] = str(devices)
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def run_python(args: Sequence[str | os.PathLike], *, devices: int | None = 1,
               env: Mapping[str, str | None] | None = None, cwd: Path = ROOT,
               timeout: float = 900, preloaded: bool = False) -> subprocess.CompletedProcess[str]:
    """``python *args`` with this interpreter and the XLA environment (see ``xla_env``), output captured.

    A console script of the venv (``accelerate``, ``hf-xla-fsdp``) runs as ``[script, ...]``: the same
    interpreter and the same ``sys.argv`` as when its shebang starts it. ``preloaded``: the process is forked from
    one that has imported torch, torch_xla, transformers, accelerate, peft, trl and datasets already
    (tests/zygote.py), ~10 s of CPU less; for scripts whose subject is not start-up itself.
    """
    if preloaded:
        return zygote.run(args, env=xla_env(devices=devices, env=env), cwd=cwd, timeout=timeout)
    return subprocess.run([sys.executable, *map(str, args)], cwd=cwd, env=xla_env(devices=devices, env=env),
                          capture_output=True, text=True, timeout=timeout)


def start_python(args: Sequence[str | os.PathLike], *, log: Path, devices: int | None = 1,
                 env: Mapping[str, str | None] | None = None, cwd: Path = ROOT,
                 preloaded: bool = True) -> subprocess.Popen | zygote.ForkedProcess:
    """``python *args`` started and not waited for (several at once, or one a test signals while it runs), stdout to the file
    ``log`` and stderr to ``log`` + ``.err``, so no pipe fills up. ``preloaded`` (the default; see :func:`run_python`)
    forks it from tests/zygote.py's server where that is available."""
    out, err = Path(log), Path(f"{log}.err")
    run_env = xla_env(devices=devices, env=env)
    if preloaded and zygote.available():
        return zygote.start(args, env=run_env, cwd=cwd, stdout=out, stderr=err)
    with open(out, "w") as fo, open(err, "w") as fe:
        return subprocess.Popen([sys.executable, *map(str, args)], cwd=cwd, env=run_env, stdout=fo, stderr=fe,
                                text=True)


def wait_for_output(proc: subprocess.Popen | zygote.ForkedProcess, log: Path, text: str, timeout: float = 600) -> bool:
    """Wait until the file ``log`` holds ``text`` (False if ``proc`` exited or the time ran out first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if log.is_file() and text in log.read_text(errors="replace"):
            return True
        if proc.poll() is not None:
            return log.is_file() and text in log.read_text(errors="replace")
        time.sleep(0.02)
    return False


#: ``python -c IN_TURN '[[script, arg, ...], ...]'``: each script with its arguments, one after the other in this one
#: process, as ``python script arg ...`` would run it (its directory first on sys.path, as ``__main__``)
IN_TURN = ("import json, os, runpy, sys\n"
           "for argv in json.loads(sys.argv[1]):\n"
           "    sys.argv = argv\n"
           "    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))\n"
           "    runpy.run_path(argv[0], run_name='__main__')\n")


def run_in_turn(argvs: Sequence[Sequence[str | os.PathLike]], **kw) -> subprocess.CompletedProcess[str]:
    """Several runs of user scripts (``[script, *args]`` each) in one process, one after the other: one start-up
    (~10 s of imports) for all of them. For runs whose results do not depend on a fresh process (each seeds what it
    draws: transformers' Trainer calls set_seed first; torch's initial seed is random in a fresh process anyway).
    ``kw``: as :func:`run_python`."""
    return run_python(["-c", IN_TURN, json.dumps([[str(a) for a in argv] for argv in argvs])], **kw)


# --------------------------------------------------------------------------- resuming
def marked_copy(ckpt: Path, dest: Path) -> Path:
    """A copy of ``ckpt`` whose logged losses are all -1.0: a run resumed from it carries them in its log, while a run
    that silently started from scratch would log real losses for those steps (and, being deterministic, the very
    losses of the uninterrupted run, which no comparison of later steps could tell apart)."""
    shutil.copytree(ckpt, dest)
    state = json.loads((dest / "trainer_state.json").read_text())
    for entry in state["log_history"]:
        if "loss" in entry:
            entry["loss"] = -1.0
    (dest / "trainer_state.json").write_text(json.dumps(state))
    return dest


# --------------------------------------------------------------------------- the start-up hook, installed
HOOK_PTH = ROOT / "hf_xla_fsdp" / "hf_xla_fsdp_hook.pth"


def make_hook_venv(root: Path) -> Path:
    """``root``/bin/python (and an ``accelerate`` console script) with the hook .pth in its site-packages."""
    import shutil
    import site
    import sysconfig

    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(root)], check=True, timeout=120)
    purelib = Path(sysconfig.get_path("purelib", vars={"base": str(root), "platbase": str(root)}))
    ours = [p for p in site.getsitepackages() if Path(p).is_dir()]
    # before the hook: .pth files run in name order
    (purelib / "aaa_environment.pth").write_text("import site; " + "; ".join(f"site.addsitedir({p!r})" for p in ours))
    shutil.copy(HOOK_PTH, purelib / HOOK_PTH.name)
    launcher = Path(sys.executable).parent / "accelerate"
    body = launcher.read_text().split("\n", 1)[1]
    (root / "bin" / "accelerate").write_text(f"#!{root / 'bin' / 'python'}\n{body}")
    (root / "bin" / "accelerate").chmod(0o755)
    return root / "bin" / "python"


# --------------------------------------------------------------------------- N real processes
WORKERS = SCRIPTS


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@dataclass
class RankRun:
    """One rank process of :func:`run_ranks`: its exit code (negative: killed by that signal) and output."""

    rank: int
    returncode: int
    stdout: str
    stderr: str

    def last_line(self) -> str:
        """The last line the rank printed on stdout ('' if none)."""
        lines = self.stdout.strip().splitlines()
        return lines[-1] if lines else ""


class RankProcesses:
    """The running processes of :func:`run_ranks`, as a kill hook sees them."""

    def __init__(self, procs: list[subprocess.Popen | zygote.ForkedProcess], logs: list[Path]):
        self.procs, self.logs = procs, logs

    def output(self, rank: int) -> str:
        """What rank ``rank`` has printed on stdout so far."""
        return self.logs[rank].read_text()

    def wait_for(self, rank: int, text: str, timeout: float = 300) -> bool:
        """Wait until rank ``rank`` printed ``text`` (False if it exited or the time ran out first)."""
        return wait_for_output(self.procs[rank], self.logs[rank], text, timeout)

    def kill(self, rank: int) -> None:
        """SIGKILL rank ``rank`` now."""
        self.procs[rank].kill()


def run_ranks(n: int, args: Callable[[int], Sequence[str | os.PathLike]], *,
              script: Path = WORKERS / "ckpt_worker.py", env: Callable[[int], Mapping[str, str | None]] | None = None,
              kill: Callable[[RankProcesses], None] | None = None, timeout: float = 300, logs: Path | None = None,
              preloaded: bool = True) -> list[RankRun]:
    """Start ``n`` OS processes ``python script --rank R --world n --port P *args(R)`` that form a torch.distributed
    gloo group on 127.0.0.1 (free port ``P``), each on XLA:CPU with one device; wait for all of them.

    ``args(rank)`` gives each rank its arguments (e.g. its own output directory, for per-host "local disks");
    ``env(rank)`` adds to its environment (None removes a variable); ``kill(processes)`` runs while they run
    (e.g. wait for a line, then SIGKILL one rank). After ``timeout`` seconds the survivors are killed. Output goes
    to files in ``logs`` (a temporary directory by default), so no pipe can fill up. ``preloaded`` (the default: the
    subject of these runs is what the ranks do together, not their start-up): forked from a process that imported the
    stack (tests/zygote.py), so the ranks also start within a second of each other, not ~10 s of imports apart.
    """
    import tempfile

    logs = Path(logs or tempfile.mkdtemp(prefix="ranks-"))
    logs.mkdir(parents=True, exist_ok=True)
    port = free_port()
    outs = [logs / f"rank{rank}.out" for rank in range(n)]
    procs = [start_python([script, "--rank", rank, "--world", n, "--port", port, *args(rank)], log=outs[rank],
                          env=env(rank) if env else None, preloaded=preloaded) for rank in range(n)]
    running = RankProcesses(procs, outs)
    try:
        if kill is not None:
            kill(running)
        deadline = time.monotonic() + timeout
        for proc in procs:
            try:
                proc.wait(max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                pass
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return [RankRun(r, p.returncode, outs[r].read_text(), Path(f"{outs[r]}.err").read_text())
            for r, p in enumerate(procs)]


_NOT_SOURCE = {"build", "dist", "runs", "out", "site"}


def copy_sources(dst: Path) -> Path:
    """Copy the project's sources (what a wheel is built from) to ``dst``: no hidden top-level folders (.git,
    .venv, .venv-oldest: gigabytes each), build outputs, the docs site or caches."""
    import shutil

    def ignore(directory: str, names: list[str]) -> set[str]:
        top = Path(directory) == ROOT
        return {n for n in names if n == "__pycache__" or n.endswith(".egg-info")
                or (top and (n.startswith(".") or n in _NOT_SOURCE))}

    shutil.copytree(ROOT, dst, ignore=ignore)
    return dst


# --------------------------------------------------------------------------- engine fsdp2: torchrun processes
#: first on PYTHONPATH, makes torch_xla unimportable (its sitecustomize): engine fsdp2's runs prove they never need it
NO_TORCH_XLA = SCRIPTS / "no_torch_xla"


def fsdp2_env(env: Mapping[str, str | None] | None = None, *, block_xla: bool = True) -> dict[str, str]:
    """The environment of an engine-fsdp2 process: torch_xla unimportable (``block_xla``), transformers and accelerate
    told not to use it, one OpenMP thread per process (several processes share the cores)."""
    out = dict(os.environ, USE_TORCH_XLA="0", OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false",
               HF_XLA_FSDP_COMPILATION_CACHE="none")
    for key in ("PJRT_DEVICE", "CPU_NUM_DEVICES", "XRT_TPU_CONFIG"):
        out.pop(key, None)
    if block_xla:
        out["PYTHONPATH"] = os.pathsep.join([str(NO_TORCH_XLA), *filter(None, [out.get("PYTHONPATH")])])
    for key, value in (env or {}).items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = value
    return out


def torchrun(n: int, args: Sequence[str | os.PathLike], *, env: Mapping[str, str | None] | None = None,
             block_xla: bool = True, timeout: float = 600, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    """``torchrun --standalone --nproc_per_node n *args`` (this interpreter's torch.distributed.run), output
    captured, in :func:`fsdp2_env`."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={n}", *map(str, args)]
    return subprocess.run(cmd, cwd=cwd, env=fsdp2_env(env, block_xla=block_xla), capture_output=True, text=True,
                          timeout=timeout)
