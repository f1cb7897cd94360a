"""``hf-xla-fsdp launch``: run an unmodified training script with XLA FSDP.

    hf-xla-fsdp launch [--config_file YAML] [--fsdp_config JSON] [--num_processes N] SCRIPT [SCRIPT ARGS...]
    hf-xla-fsdp launch [...] -m MODULE [ARGS...]                  # python -m style entry points
    python -m hf_xla_fsdp.launch [...]                            # the same

The script runs as ``__main__`` (``runpy``), with ``sys.argv`` set to its own arguments. Before its first line:
the settings are read and checked (:func:`hf_xla_fsdp.config.resolve.launch_sources`: the script's
``--fsdp_config``, the YAML's ``fsdp_config:`` and ``mixed_precision``, the launcher's ``--fsdp_config`` and
``--mixed_precision``, by the one conflict rule) and handed to the script's processes in ``HF_XLA_FSDP_LAUNCH``
(:func:`hf_xla_fsdp.config.resolve.hand_off`); in each process the runtime is readied for them (FSDP v2: SPMD) and
``transformers.Trainer`` with every subclass and ``accelerate.Accelerator`` build their XLA FSDP versions
(:func:`hf_xla_fsdp.integrations.launched.start`); on a pod every host checks that the others run the same script,
arguments, settings and package versions. When the session says the engine runs one process per device (FSDP v1,
:meth:`hf_xla_fsdp.session.XlaFsdpSession.processes_per_host`), ``--num_processes`` (or a YAML that gives it) starts
the processes as ``accelerate launch`` does on XLA: ``xmp.spawn`` (PJRT), one per local device; engine fsdp2 starts
them as torchrun does, on several machines with accelerate's ``--num_machines``, ``--machine_rank``,
``--main_process_ip`` and ``--main_process_port`` (torchrun's static rendezvous; ``--num_processes`` then counts every
machine's), which the XLA engines refuse.

Bad input (a script that does not exist, conflicting settings, a v2 config once the script used the XLA device
without SPMD, a host that differs) is one line on stderr and exit code 2, before any work.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import logging
import os
import runpy
import socket
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Optional, Sequence

from .errors import ConfigError

if TYPE_CHECKING:
    from .engines.base import Engine, Machines

logger = logging.getLogger(__name__)

#: the packages whose versions every host of a pod must share
POD_PACKAGES = ("hf_xla_fsdp", "torch", "torch_xla", "transformers", "accelerate", "datasets", "peft", "trl",
                "safetensors")


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Every flag's help ends with its default (unless it says it already, or there is none to say)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if (not action.option_strings or action.required or action.default in (None, argparse.SUPPRESS)
                or "(default:" in text or isinstance(action, (argparse._HelpAction, argparse._VersionAction))):
            return text
        return f"{text} (default: %(default)s)"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The launcher's options (shared by ``hf-xla-fsdp launch`` and ``python -m hf_xla_fsdp.launch``)."""
    parser.add_argument("--config-file", "--config_file", dest="config_file", default=None,
                        help="accelerate YAML (the file `accelerate launch --config_file` reads); its fsdp_config: "
                             "mapping gives settings, mixed_precision and num_processes apply (default: none)")
    parser.add_argument("--fsdp-config", "--fsdp_config", dest="fsdp_config", default=None,
                        help="settings (JSON file or inline JSON) for scripts that name none themselves (default: "
                             "none; the script's own --fsdp_config and the YAML's apply too)")
    parser.add_argument("--num-processes", "--num_processes", dest="num_processes", type=int, default=None,
                        help="engines with a process per device: processes on this host, started with xmp.spawn as "
                             "accelerate does on XLA for FSDP v1 (XLA:CPU: sets CPU_NUM_DEVICES), as torchrun does for "
                             "engine fsdp2 (default: the YAML's, else the script runs in the launcher's process); FSDP "
                             "v2 runs one per host")
    parser.add_argument("--num-machines", "--num_machines", dest="num_machines", type=int, default=None,
                        help="engine fsdp2: machines of the run, as accelerate's; run the same command on each with its "
                             "--machine_rank (default: the YAML's, else 1)")
    parser.add_argument("--machine-rank", "--machine_rank", dest="machine_rank", type=int, default=None,
                        help="this machine's rank, 0 on the machine at --main_process_ip (default: the YAML's, else 0)")
    parser.add_argument("--main-process-ip", "--main_process_ip", dest="main_process_ip", default=None,
                        help="address of machine 0, where torchrun's rendezvous store is served (default: the YAML's)")
    parser.add_argument("--main-process-port", "--main_process_port", dest="main_process_port", type=int,
                        default=None, help="its port (default: the YAML's, else 29500, torchrun's)")
    parser.add_argument("--mixed-precision", "--mixed_precision", dest="mixed_precision", choices=("no", "bf16", "fp16"),
                        default=None, help="as accelerate's: the compute dtype (compute_dtype, never autocast) of the "
                                           "script's Trainer or Accelerator (default: the YAML's, else none)")
    parser.add_argument("--no-pod-check", "--no_pod_check", dest="no_pod_check", action="store_true",
                        help="skip the check that every host runs the same script, settings and versions")
    parser.add_argument("-m", "--module", action="store_true", help="run SCRIPT as a module, as `python -m` does")
    parser.add_argument("script", help="the training script (or module, with -m)")
    parser.add_argument("script_args", nargs="*", help="the script's own arguments (passed on untouched)")


_VALUED = {"--config_file", "--config-file", "--fsdp_config", "--fsdp-config", "--num_processes", "--num-processes",
           "--mixed_precision", "--mixed-precision", "--num_machines", "--num-machines", "--machine_rank",
           "--machine-rank", "--main_process_ip", "--main-process-ip", "--main_process_port", "--main-process-port"}
#: torchrun's default rendezvous port, accelerate's default main_process_port
DEFAULT_MAIN_PORT = 29500  # the options that take a value (the next argument)


def split_command_line(argv: Sequence[str]) -> tuple[list[str], list[str]]:
    """The launcher's arguments (up to and including the script) and the script's own, untouched: argparse would
    read a script flag such as ``--fsdp`` as an abbreviation of the launcher's ``--fsdp_config``."""
    argv = list(argv)
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            return argv[:i] + argv[i + 1:i + 2], argv[i + 2:]
        if arg in _VALUED:
            i += 2
        elif arg.startswith("-") and arg != "-":
            i += 1
        else:
            return argv[:i + 1], argv[i + 1:]
    return argv, []


def parse_command_line(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """Parse ``[launcher options] SCRIPT [SCRIPT ARGS]`` (see :func:`split_command_line`)."""
    own, script_args = split_command_line(argv)
    ns = parser.parse_args(own)
    ns.script_args = script_args
    return ns


# --------------------------------------------------------------------------- the pod check
def launch_fingerprint(target: str, is_module: bool, script_args: Sequence[str], settings: dict[str, Any]) -> dict[str, Any]:
    """What must be the same on every host: digests of the script's file, its arguments and the settings, and the
    versions of :data:`POD_PACKAGES` (``host`` names this one)."""
    from importlib import metadata

    if is_module:
        import importlib.util

        spec = importlib.util.find_spec(target)
        origin = spec.origin if spec is not None else None
    else:
        origin = target
    code = Path(origin).read_bytes() if origin and os.path.isfile(origin) else target.encode()
    versions = {}
    for name in POD_PACKAGES:
        try:
            versions[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            versions[name] = None
    versions["python"] = sys.version.split()[0]

    def digest(data: Any) -> str:
        raw = data if isinstance(data, bytes) else json.dumps(data, sort_keys=True, default=str).encode()
        return hashlib.sha256(raw).hexdigest()[:16]

    return {"host": socket.gethostname(), "script": digest(code), "arguments": digest(list(script_args)),
            "settings": digest(settings), "versions": versions}


def compare_fingerprints(fingerprints: Sequence[dict[str, Any]]) -> Optional[str]:
    """One line naming the first host whose fingerprint differs from the first host's, and what differs; ``None`` when
    every host agrees."""
    if not fingerprints:
        return None
    reference = fingerprints[0]
    for other in fingerprints[1:]:
        differs = [key for key in ("script", "arguments", "settings") if other[key] != reference[key]]
        differs += [f"{name} {other['versions'].get(name)} vs {version}" for name, version in
                    sorted(reference["versions"].items()) if other["versions"].get(name) != version]
        if differs:
            return (f"host {other['host']} does not run what host {reference['host']} runs: it differs in "
                    f"{', '.join(differs)}; start the same command with the same files and packages on every host")
    return None


def exchange_fingerprints(fingerprint: dict[str, Any], engine: "Engine") -> list[dict[str, Any]]:
    """Every process's fingerprint (the engine's runtime's all-gather); this one alone in a single process."""
    if engine.process_count() <= 1:
        return [fingerprint]
    try:
        payloads = engine.gather_bytes(json.dumps(fingerprint).encode(), tag="hf_xla_fsdp.launch.pod_check")
    except ConfigError as err:  # several SPMD hosts without torch.distributed: nothing to gather with yet
        logger.warning("pod check skipped: %s", err)
        return [fingerprint]
    return [json.loads(p) for p in payloads]


def check_pod(fingerprint: dict[str, Any], engine: "Engine") -> None:
    """Raise the one-line ConfigError of :func:`compare_fingerprints` when a host differs."""
    problem = compare_fingerprints(exchange_fingerprints(fingerprint, engine))
    if problem:
        raise ConfigError(problem)


# --------------------------------------------------------------------------- running the script
def run_target(target: str, is_module: bool, script_args: Sequence[str]) -> None:
    """Run the script (or module) as ``__main__`` with ``sys.argv`` set to its own arguments, as python would."""
    if is_module:
        sys.argv = [target, *script_args]
        runpy.run_module(target, run_name="__main__", alter_sys=True)
    else:
        path = os.path.abspath(target)
        sys.argv = [target, *script_args]
        sys.path.insert(0, os.path.dirname(path))
        runpy.run_path(path, run_name="__main__")


def _start(plan: dict[str, Any]) -> None:
    """In the training process, before the script: patches and the runtime for the handed-over settings, the pod
    check, then the script."""
    from .integrations import launched

    launched.start(what="the launcher")
    if not plan["no_pod_check"]:
        check_pod(plan["fingerprint"], _engine(plan))
    run_target(plan["target"], plan["module"], plan["script_args"])


def _engine(plan: dict[str, Any]) -> "Engine":
    """The engine the plan's settings select (the default settings' when there are none)."""
    from .engines import engine_for
    from .plugin import XlaFsdpPlugin

    return engine_for(XlaFsdpPlugin.from_dict(plan["settings"] or {}), require_runtime=False)


def _spawned(plan: dict[str, Any]) -> None:
    """One process an engine starts in Python (FSDP v1's ``xmp.spawn``): the same start as a single process."""
    try:
        _start(plan)
    except ConfigError as err:
        print(f"hf-xla-fsdp launch: error: {err}", file=sys.stderr, flush=True)
        # SystemExit travels back through xmp.spawn's pools and ends the launcher with code 2, printing nothing more
        raise SystemExit(2) from None


def machines_of(ns: argparse.Namespace, yaml: dict[str, Any]) -> "Machines":
    """The machines of the launch from the command line, else the accelerate YAML's ``num_machines``,
    ``machine_rank``, ``main_process_ip`` and ``main_process_port``; checked (one line for each problem)."""
    from .engines.base import Machines
    from .settings import parse_int

    given: list[str] = []

    def pick(name: str, default: Any, yaml_counts: bool) -> Any:
        flag = getattr(ns, name, None)
        if flag is not None:
            given.append(f"--{name} {flag}")
            return flag
        value = yaml.get(name)
        if value is None:
            return default
        if yaml_counts and value != default:
            given.append(f"{name}: {value} in {ns.config_file}")
        return value

    count = parse_int(pick("num_machines", 1, True), "num_machines", 1)
    rank = parse_int(pick("machine_rank", 0, True), "machine_rank", 0)
    ip = pick("main_process_ip", None, False)
    port = pick("main_process_port", None, False)
    port = None if port is None else parse_int(port, "main_process_port", 0)
    if rank >= count:
        raise ConfigError(f"machine_rank={rank} with num_machines={count}: give 0 to {count - 1} (0 on the machine at "
                          "main_process_ip)")
    if count > 1 and not ip:
        raise ConfigError(f"num_machines={count} needs main_process_ip: the address of machine 0 (machine_rank 0), "
                          "the same on every machine and reachable from each")
    if port is not None and not 0 < port < 65536 and not (port == 0 and count == 1):
        raise ConfigError(f"main_process_port={port}: give a TCP port (1-65535) free on machine 0, the same on every "
                          "machine")
    return Machines(count, rank, str(ip) if ip else None, port or None, tuple(given))


def prepare(ns: argparse.Namespace) -> dict[str, Any]:
    """Check the command line and read the settings (no XLA runtime, nothing run) and hand them over (the
    environment); returns the launch plan."""
    from .config.keys import read_accelerate_yaml
    from .config.resolve import hand_off, launch_sources
    from .engines.base import Machines
    from .plugin import XlaFsdpPlugin
    from .session import XlaFsdpSession

    target = ns.script
    if ns.module:
        import importlib.util

        try:
            found = importlib.util.find_spec(target) is not None
        except (ImportError, ValueError):
            found = False
        if not found:
            raise ConfigError(f"no module named {target!r} (-m {target}): check the name and that its package is "
                              "installed or on PYTHONPATH")
    elif not os.path.isfile(target):
        raise ConfigError(f"script {target} does not exist" + (" (it is a directory)" if os.path.isdir(target) else "")
                          + ": give the path of the training script")
    yaml = read_accelerate_yaml(ns.config_file) if ns.config_file else {}
    if not isinstance(yaml, dict):
        raise ConfigError(f"accelerate config file {ns.config_file} must hold a mapping")
    sources = launch_sources(ns.script_args, ns.config_file, ns.fsdp_config, ns.mixed_precision)
    plugin = XlaFsdpPlugin.resolve(sources)  # the defaults when no source names a setting
    requested = ns.num_processes if ns.num_processes is not None else yaml.get("num_processes")
    machines = machines_of(ns, yaml)
    session = XlaFsdpSession(plugin)
    session.engine.check_machines(machines)
    if session.engine.started_by_launcher():  # placed already: a YAML's machine keys were the launcher's to read
        machines = Machines()
    if machines.count > 1:
        from .settings import parse_int

        if requested is None:
            raise ConfigError(f"num_machines={machines.count} needs num_processes: the processes of all machines "
                              f"together, as accelerate's (e.g. --num_processes {2 * machines.count} for 2 on each)")
        total = parse_int(requested, "num_processes", 1)
        if total % machines.count:
            raise ConfigError(f"num_processes={total} does not divide among num_machines={machines.count}; give a "
                              f"multiple of {machines.count} (accelerate's num_processes counts every machine's)")
        requested = total // machines.count
    processes = session.processes_per_host(requested)
    hand_off(sources)  # this process and every process it starts (xmp.spawn's) read them from the environment
    settings = plugin.to_dict() if sources else None
    return {"target": target, "module": ns.module, "script_args": list(ns.script_args), "settings": settings,
            "no_pod_check": ns.no_pod_check, "spawn": processes is not None, "processes": processes,
            "machines": machines,
            "fingerprint": launch_fingerprint(target, ns.module, ns.script_args, settings or {})}


def launch(ns: argparse.Namespace) -> int:
    """Run the launch described by parsed arguments; 2 (one line on stderr) for bad input."""
    try:
        plan = prepare(ns)
        if plan["spawn"]:  # the engine's own start (fsdp2: as torchrun; the XLA engines: xmp.spawn)
            return _engine(plan).start_processes(plan["processes"], _child_arguments(ns), plan["machines"],
                                                 functools.partial(_spawned, plan))
        _start(plan)
    except ConfigError as err:
        print(f"hf-xla-fsdp launch: error: {err}", file=sys.stderr, flush=True)
        return 2
    return 0


def _child_arguments(ns: argparse.Namespace) -> list[str]:
    """The launcher's command line for each process an engine starts: the same settings and script, no process count."""
    out = []
    for flag, value in (("--config-file", ns.config_file), ("--fsdp-config", ns.fsdp_config),
                        ("--mixed-precision", ns.mixed_precision)):
        if value is not None:
            out += [flag, str(value)]
    if ns.no_pod_check:
        out.append("--no-pod-check")
    if ns.module:
        out.append("-m")
    return [*out, "--", ns.script, *ns.script_args]


def main(argv: Optional[Sequence[str]] = None, prog: str = "python -m hf_xla_fsdp.launch") -> int:
    """``python -m hf_xla_fsdp.launch`` (and ``hf-xla-fsdp launch``)."""
    parser = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0].replace("``", ""),
                                     allow_abbrev=False,
                                     formatter_class=HelpFormatter)
    add_arguments(parser)
    return launch(parse_command_line(parser, sys.argv[1:] if argv is None else argv))


if __name__ == "__main__":
    # through the imported module, so xmp.spawn's processes find _spawned by its real name
    from hf_xla_fsdp.launch import main as _main

    sys.exit(_main())
