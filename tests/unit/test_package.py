"""Package-level guards: an acyclic import graph, an XLA-free checkpoint package, a wheel that works installed.

Written against the package's layout on disk (any depth of subpackages), not against module names,
so they keep working while modules move between subpackages.
"""

from __future__ import annotations

import ast
import os
import shutil
import subprocess
import sys
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import pytest
from helpers import copy_sources

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = "hf_xla_fsdp"
PACKAGE_DIR = ROOT / PACKAGE
MAX_CYCLES = 200  # enumeration is exponential in the worst case; enough to act on, bounded output


# ---------------------------------------------------------------- static import collection


@dataclass(frozen=True)
class ImportSite:
    """One module named by an import statement (or a constant ``importlib.import_module`` call)."""

    module: str  # absolute dotted name; relative imports already resolved
    names: tuple[str, ...]  # the names of ``from module import ...``; empty for ``import module``
    line: int
    in_getattr_hook: bool  # inside a module-level ``def __getattr__`` (PEP 562 lazy re-export)


def _shown(path: Path) -> str:
    """``path`` relative to the repository when it is inside it."""
    return str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)


def module_name(path: Path, package_dir: Path = PACKAGE_DIR) -> str:
    """Dotted name of one file of the package; a package is named by its ``__init__.py``."""
    parts = path.relative_to(package_dir.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def discover_modules(package_dir: Path = PACKAGE_DIR) -> dict[str, Path]:
    """Dotted name -> file for every .py of the package, subpackages at any depth included."""
    return {module_name(path, package_dir): path for path in sorted(package_dir.rglob("*.py"))}


def _resolve_relative(package: str, level: int, module: Optional[str]) -> Optional[str]:
    """Absolute name of ``from {'.' * level}{module} import ...`` inside ``package``; None past the top."""
    if level == 0:
        return module
    parts = package.split(".")
    if level > len(parts):
        return None
    base = ".".join(parts[: len(parts) - level + 1])
    return f"{base}.{module}" if module else base


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _is_import_module_call(node: ast.Call) -> bool:
    func = node.func
    return (isinstance(func, ast.Name) and func.id == "import_module") or (
        isinstance(func, ast.Attribute) and func.attr == "import_module")


class _ImportCollector(ast.NodeVisitor):
    """Every import of a module, wherever it sits (lazy ones inside functions count), except
    under ``if TYPE_CHECKING:``, which never runs."""

    def __init__(self, package: str, type_checking: bool = False) -> None:
        self.package = package
        self.type_checking = type_checking  # also the imports under ``if TYPE_CHECKING:`` (what a type checker follows)
        self.scope_depth = 0  # >0 inside a def or class: a ``__getattr__`` there is not the module's hook
        self.in_hook = False
        self.sites: list[ImportSite] = []

    def _add(self, module: Optional[str], names: tuple[str, ...], line: int) -> None:
        if module:
            self.sites.append(ImportSite(module, names, line, self.in_hook))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, (), node.lineno)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        module = _resolve_relative(self.package, node.level, node.module)
        self._add(module, tuple(alias.name for alias in node.names), node.lineno)

    def visit_Call(self, node: ast.Call) -> None:
        # a constant importlib.import_module(...) is as real an import as the statement
        if _is_import_module_call(node) and node.args and isinstance(node.args[0], ast.Constant) \
                and isinstance(node.args[0].value, str):
            name = node.args[0].value
            level = len(name) - len(name.lstrip("."))
            self._add(_resolve_relative(self.package, level, name[level:] or None), (), node.lineno)
        self.generic_visit(node)

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test) and not self.type_checking:
            for child in node.orelse:  # the else branch does run
                self.visit(child)
            return
        self.generic_visit(node)

    def _visit_scope(self, node: ast.AST) -> None:
        hook = self.scope_depth == 0 and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) \
            and node.name == "__getattr__"
        outer_hook, self.in_hook = self.in_hook, self.in_hook or hook
        self.scope_depth += 1
        self.generic_visit(node)
        self.scope_depth -= 1
        self.in_hook = outer_hook

    visit_FunctionDef = visit_AsyncFunctionDef = visit_ClassDef = _visit_scope


def collect_imports(path: Path, module: str, type_checking: bool = False) -> list[ImportSite]:
    """Every import in one file of the package named ``module`` (with ``type_checking``, those under
    ``if TYPE_CHECKING:`` too)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    collector = _ImportCollector(package, type_checking)
    collector.visit(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
    return collector.sites


# ---------------------------------------------------------------- import graph and cycles


Graph = dict[str, dict[str, list[str]]]  # source -> target -> import sites "path:line"


def _ancestors(module: str) -> list[str]:
    """The packages whose ``__init__`` runs before ``module``: ``a.b.c`` -> ``a``, ``a.b``."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def run_by_import(target: str, source: str) -> list[str]:
    """What importing ``target`` from ``source`` runs: ``target`` and its package ``__init__``s, except the top
    package (it is always imported first: every module of ours is reached through it) and the packages of
    ``source`` itself (their ``__init__`` ran before ``source`` did)."""
    own = set(_ancestors(source)) | {source}
    return [p for p in _ancestors(target)[1:] if p not in own] + [target]


def import_graph(modules: dict[str, Path], type_checking: bool = False) -> Graph:
    """Edges between the package's own modules; ``from X import n`` goes to ``X.n`` when that is a module.

    Importing a submodule runs its package's ``__init__`` first, so an import of ``pkg.sub.mod`` is an edge to
    ``pkg.sub`` too (see :func:`run_by_import`): a cycle through what a package ``__init__`` imports counts."""
    graph: Graph = {name: {} for name in modules}
    for source, path in modules.items():
        for site in collect_imports(path, source, type_checking):
            if site.in_getattr_hook:
                continue  # a lazy re-export hook runs after the package finished importing
            targets = [f"{site.module}.{n}" if f"{site.module}.{n}" in modules else site.module
                       for n in site.names] or [site.module]
            for target in targets:
                for ran in run_by_import(target, source):
                    if ran in modules and ran != source:
                        where = f"{_shown(path)}:{site.line}"
                        sites = graph[source].setdefault(ran, [])
                        if where not in sites:  # one line may import several names of the same module
                            sites.append(where)
    return graph


def strongly_connected(graph: Graph) -> list[list[str]]:
    """Tarjan's strongly connected components, each sorted, in a stable order."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for nxt in sorted(graph[node]):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in on_stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            components.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return sorted(components)


def simple_cycles(graph: Graph, limit: int = MAX_CYCLES) -> list[list[str]]:
    """Every elementary cycle (up to ``limit``), each starting and ending at its smallest module.

    Only nodes of one strongly connected component can share a cycle, so the search stays inside
    each component; a cycle is found once, from its smallest node.
    """
    cycles: list[list[str]] = []

    def extend(path: list[str], members: set[str]) -> None:
        start = path[0]
        for nxt in sorted(graph[path[-1]]):
            if len(cycles) >= limit:
                return
            if nxt == start:
                cycles.append(path + [start])
            elif nxt in members and nxt > start and nxt not in path:
                extend(path + [nxt], members)

    for component in strongly_connected(graph):
        for start in component:
            extend([start], set(component))
    return sorted(cycles, key=lambda c: (len(c), c))


def format_cycles(graph: Graph, cycles: list[list[str]], limit: int = MAX_CYCLES) -> str:
    """One ``a -> b -> a`` line per cycle, then where each import on a cycle is written."""
    lines = [f"{len(cycles)}{'+' if len(cycles) >= limit else ''} import cycle(s) in {PACKAGE}:"]
    lines += ["  " + " -> ".join(cycle) for cycle in cycles]
    edges = sorted({(a, b) for cycle in cycles for a, b in zip(cycle, cycle[1:])})
    lines.append("imports on those cycles:")
    lines += [f"  {a} -> {b}: {', '.join(graph[a][b])}" for a, b in edges]
    return "\n".join(lines)


def test_import_graph_has_no_cycle() -> None:
    """No cycle among the imports that can run: module-level and function-level ones, with the package ``__init__``s
    an import runs (:func:`import_graph`)."""
    modules = discover_modules()
    assert PACKAGE in modules, f"no {PACKAGE_DIR / '__init__.py'}"
    graph = import_graph(modules)
    cycles = simple_cycles(graph)
    if cycles:
        pytest.fail(format_cycles(graph, cycles), pytrace=False)


def test_no_cycle_with_the_imports_of_annotations_either() -> None:
    """The layers stay a one-way order for a type checker too: counted with the ``if TYPE_CHECKING:`` imports, the
    graph has no cycle. The only imports left out are the plugin's forwards (``build`` / ``wrap`` /
    ``prepare_optimizer`` hand over to a session, see :func:`plugin_forward_sites`). Lower modules name what they read
    of a higher one with a Protocol (e.g. ``engines.base.EngineSettings``, ``session.checkpoints.Owner``)."""
    graph = import_graph(discover_modules(), type_checking=True)
    forwards = plugin_forward_sites()
    plugin = f"{PACKAGE}.plugin"
    graph[plugin] = {t: kept for t, sites in graph[plugin].items()
                     for kept in [[s for s in sites if s not in forwards]] if kept}
    cycles = simple_cycles(graph)
    if cycles:
        pytest.fail(format_cycles(graph, cycles), pytrace=False)


def _reachable(graph: Graph, start: str) -> dict[str, list[str]]:
    """Every module importing ``start`` runs (lazy imports included), with the chain that gets there."""
    paths: dict[str, list[str]] = {start: [start]}
    todo = [start]
    while todo:
        here = todo.pop()
        for nxt in sorted(graph[here]):
            if nxt not in paths:
                paths[nxt] = paths[here] + [nxt]
                todo.append(nxt)
    return paths


PLUGIN_FORWARDS = ("wrap", "build", "prepare_optimizer")  # XlaFsdpPlugin's methods that hand over to a session


def plugin_forward_sites() -> set[str]:
    """``path:line`` of every import inside the plugin's forwards (:data:`PLUGIN_FORWARDS`)."""
    path = PACKAGE_DIR / "plugin.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    classes = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "XlaFsdpPlugin"]
    methods = {n.name: n for c in classes for n in c.body if isinstance(n, ast.FunctionDef)}
    assert set(PLUGIN_FORWARDS) <= set(methods), f"XlaFsdpPlugin lacks {set(PLUGIN_FORWARDS) - set(methods)}"
    return {f"{_shown(path)}:{n.lineno}" for name in PLUGIN_FORWARDS for n in ast.walk(methods[name])
            if isinstance(n, (ast.Import, ast.ImportFrom))}


def test_the_plugin_imports_no_layer_above_it_but_in_its_forwards() -> None:
    """The plugin is the settings object: importing it imports no session or engine, and its only imports of them
    are the forwards' (``XlaFsdpPlugin.build`` / ``wrap`` / ``prepare_optimizer``, kept as the documented spelling of
    a hand-written loop; ``XlaFsdpSession`` does the work)."""
    graph = import_graph(discover_modules())
    above = (f"{PACKAGE}.session", f"{PACKAGE}.engines", f"{PACKAGE}.integrations")
    forwards = plugin_forward_sites()
    found = [f"{target}: {site}" for target, sites in graph[f"{PACKAGE}.plugin"].items() if target.startswith(above)
             for site in sites if site not in forwards]
    assert not found, "hf_xla_fsdp.plugin imports a layer above it outside its forwards:\n  " + "\n  ".join(found)
    assert forwards, "the plugin's forwards import nothing: drop the allowance in plugin_forward_sites"


#: the settings' one door to the engines: what they declare (key, aliases, title, launchers, honoured and refused
#: settings), read from the registry; nothing else of the settings layer imports an engine
DECLARATIONS = f"{PACKAGE}.config.engines"
DECLARED_NAMES = {"ENGINES", "Engine"}  # all it imports from engines/: the registry and the class that declares


@pytest.mark.parametrize("layer", [f"{PACKAGE}.checkpoint", f"{PACKAGE}.plugin", f"{PACKAGE}.config",
                                   f"{PACKAGE}.modeling", f"{PACKAGE}.export"])
def test_lower_layers_never_reach_an_engine(layer: str) -> None:
    """Data flows one way (config -> plugin -> session -> engine -> ... -> checkpoint -> export): checkpoints, settings,
    model construction and export never import an engine, directly or through anything they import. Two kinds of
    import are left out, and only they: the plugin's forwards (``build``, ``wrap``, ``prepare_optimizer`` hand its
    work to a session, which is where engines come in), and :data:`DECLARATIONS` reading the registry (the settings
    derive their rules from what engines declare; :func:`test_the_settings_read_only_the_engines_declarations`)."""
    modules = discover_modules()
    graph = import_graph(modules)
    plugin = f"{PACKAGE}.plugin"
    forwards = plugin_forward_sites()
    graph[plugin] = {t: kept for t, sites in graph[plugin].items()
                     for kept in [[s for s in sites if s not in forwards]] if kept}
    graph[DECLARATIONS] = {t: sites for t, sites in graph[DECLARATIONS].items() if not t.startswith(f"{PACKAGE}.engines")}
    starts = [m for m in modules if m == layer or m.startswith(layer + ".")]
    for start in starts:
        engines = [(m, chain) for m, chain in _reachable(graph, start).items() if m.startswith(f"{PACKAGE}.engines")]
        if engines:
            pytest.fail(f"{start} reaches {engines[0][0]}: {' -> '.join(engines[0][1])}", pytrace=False)


def test_the_settings_read_only_the_engines_declarations() -> None:
    """:data:`DECLARATIONS` imports the registry and the declaring class, nothing else of engines/ (no engine module,
    no function that runs an engine)."""
    path = PACKAGE_DIR / "config" / "engines.py"
    sites = [s for s in collect_imports(path, DECLARATIONS, type_checking=True) if s.module.startswith(f"{PACKAGE}.engines")]
    assert sites, f"{DECLARATIONS} no longer reads the registry: drop DECLARATIONS' allowance"
    bad = [f"{s.module}: {', '.join(s.names) or '(module)'} (line {s.line})" for s in sites
           if s.module not in (f"{PACKAGE}.engines", f"{PACKAGE}.engines.base") or not set(s.names) <= DECLARED_NAMES]
    assert not bad, f"{_shown(path)} imports more of engines/ than the declarations:\n  " + "\n  ".join(bad)


def test_trainer_and_accelerate_glue_stays_within_700_lines() -> None:
    """The integrations translate the Trainer's and accelerate's calls; what they decide belongs to the session. 700
    lines is the budget the seam was given (it was 691 when ``XlaFsdpSession`` took the shared work over); more means
    logic grew in the glue again: move it to its owner (docs/architecture.md says which)."""
    glue = [PACKAGE_DIR / "integrations" / name for name in ("trainer.py", "accelerate.py")]
    counts = {p.name: len(p.read_text(encoding="utf-8").splitlines()) for p in glue}
    assert sum(counts.values()) <= 700, f"Trainer + accelerate glue is {sum(counts.values())} lines: {counts}"


def test_no_package_folder_is_named_like_build_output() -> None:
    """Tools skip folders named build/dist (gitignore templates, linters, pytest's norecursedirs)."""
    bad = [p for p in PACKAGE_DIR.rglob("*") if p.is_dir() and p.name in ("build", "dist", "out")]
    assert not bad, f"package folders named like build output: {bad}"


# ---------------------------------------------------------------- checkpoint package stays XLA-free


def _is_torch_xla(module: str) -> bool:
    return module == "torch_xla" or module.startswith("torch_xla.")


def torch_xla_imports(files: Iterable[Path]) -> Iterator[str]:
    """``path:line: module`` for every torch_xla import in ``files`` (lazy and hook imports included)."""
    for path in files:
        for site in collect_imports(path, module_name(path)):
            if _is_torch_xla(site.module):
                yield f"{_shown(path)}:{site.line}: {site.module}"


def test_checkpoint_package_never_imports_torch_xla() -> None:
    checkpoint_dir = PACKAGE_DIR / "checkpoint"
    if not checkpoint_dir.is_dir():
        pytest.skip(f"{checkpoint_dir.relative_to(ROOT)}/ does not exist yet (checkpoint code is still flat modules)")
    files = sorted(checkpoint_dir.rglob("*.py"))
    assert files, f"no .py file under {checkpoint_dir}"
    found = list(torch_xla_imports(files))
    if found:  # consolidation and export must run on a machine with torch only
        pytest.fail("torch_xla imported in the checkpoint package:\n  " + "\n  ".join(found), pytrace=False)


# ---------------------------------------------------------------- only engines/ knows which engine runs


def _mentions_version(node: ast.AST) -> bool:
    return any((isinstance(n, ast.Attribute) and n.attr == "version") or (isinstance(n, ast.Name) and n.id == "version")
               or (isinstance(n, ast.Constant) and n.value == "version") for n in ast.walk(node))


def engine_tests(path: Path) -> Iterator[str]:
    """``path:line: code`` for every place in ``path`` that tests which engine runs: a comparison of the ``version``
    with a number (``plugin.version == 2``, ``version != 1``), an engine class or module named outside the registry
    (``XlaFsdpV1``, ``engines.v2``), or a registry entry picked by number (``ENGINES[2]``)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    source = path.read_text(encoding="utf-8").splitlines()
    for node in ast.walk(tree):
        found = False
        if isinstance(node, ast.Compare):
            operands = [node.left, *node.comparators]
            found = any(isinstance(o, ast.Constant) and type(o.value) is int for o in operands) and any(
                _mentions_version(o) for o in operands)
        elif isinstance(node, ast.Name):
            found = node.id in ("XlaFsdpV1", "XlaFsdpV2")
        elif isinstance(node, (ast.ImportFrom, ast.Import)):
            names = [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in node.names]
            names += [a.name for a in node.names] if isinstance(node, ast.ImportFrom) else []
            found = any(n.split(".")[-1] in ("v1", "v2") and "engines" in (getattr(node, "module", "") or n)
                        for n in names)
        elif isinstance(node, ast.Subscript):
            found = isinstance(node.value, ast.Name) and node.value.id == "ENGINES" and isinstance(node.slice, ast.Constant)
        if found:
            yield f"{_shown(path)}:{node.lineno}: {source[node.lineno - 1].strip()}"


def test_only_the_engines_test_which_engine_runs(tmp_path: Path) -> None:
    """Code outside engines/ asks the engine (``engine_for(plugin)``, ``engine_of(model)``, the session) and never
    branches on which engine it is: a new engine is a module in engines/ and an entry in the plugin's tables."""
    engines_dir = PACKAGE_DIR / "engines"
    files = [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if not p.is_relative_to(engines_dir)]
    found = [hit for path in files for hit in engine_tests(path)]
    if found:
        pytest.fail("which engine runs is tested outside engines/:\n  " + "\n  ".join(found), pytrace=False)
    # the check itself finds what it is for
    probe = tmp_path / "probe.py"
    probe.write_text("from hf_xla_fsdp.engines.v2 import enable_spmd\nif plugin.version == 2:\n    pass\n"
                     "if int(cfg.get('version', 1)) != 2:\n    pass\nENGINES[1]\nengine.spmd\n")
    assert [hit.split(":")[1] for hit in engine_tests(probe)] == ["1", "2", "4", "6"]


#: string constants outside engines/ that equal an engine's spelling but do not name the engine, with why
SPELLED_ELSEWHERE = {
    ("checkpoint/readers.py", "xla_fsdp_v1"): "the flat tensor layout's id in every rank file since the first format",
    ("checkpoint/schema.py", "xla_fsdp_v1"): "the same layout id (what a file without one means)",
    ("config/keys.py", "xla_fsdp_v2"): "transformers' fsdp_config key (its vocabulary, mapped onto `version`)",
    ("config/training_args.py", "xla_fsdp_v2"): "transformers' fsdp_config key, as TrainingArguments fills it in",
    ("checkpoint/consolidate.py", "xla_fsdp_v1"): "rank files written before they recorded their engine (2026-12)",
    ("checkpoint/consolidate.py", "xla_fsdp_v2"): "rank files written before they recorded their engine (2026-12)",
    ("checkpoint/consolidate.py", "fsdp2"): "rank files written before they recorded their engine (2026-12)",
}


def engine_spellings() -> set[str]:
    """Every key, alias and record name of the registered engines, but ``xla``: that is also torch's device type and
    transformers' ``fsdp_config`` switch, which code outside engines/ compares with as such."""
    from hf_xla_fsdp.engines import ENGINES

    out = {s for e in ENGINES.values() for s in (e.key, e.name, *e.aliases)}
    return {s for s in out if s} - {"xla"}


def spelled_engines(path: Path, spellings: set[str]) -> Iterator[tuple[str, int]]:
    """``(spelling, line)`` for every string constant in ``path`` that is an engine's spelling (any case)."""
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.strip().lower() in spellings:
            yield node.value.strip().lower(), node.lineno


def test_no_engine_is_spelled_outside_the_engines(tmp_path: Path) -> None:
    """An engine's key, alias or name written as a value outside engines/ (``plugin.engine == "fsdp2"``, a table keyed
    by engine) is engine knowledge in the wrong place: the code asks the engine, or derives from ``ENGINES``
    (config/engines.py). Help texts and messages may mention an engine in prose; a constant that is exactly its
    spelling fails, but for :data:`SPELLED_ELSEWHERE`, each with its reason (and an allowance no longer used fails)."""
    spellings = engine_spellings()
    assert {"fsdp2", "xla_v1", "xla_v2", "xla_fsdp_v1"} <= spellings
    engines_dir = PACKAGE_DIR / "engines"
    seen: set[tuple[str, str]] = set()
    found = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        if path.is_relative_to(engines_dir):
            continue
        shown = str(path.relative_to(PACKAGE_DIR))
        for spelling, line in spelled_engines(path, spellings):
            if (shown, spelling) in SPELLED_ELSEWHERE:
                seen.add((shown, spelling))
            else:
                found.append(f"{PACKAGE}/{shown}:{line}: {spelling!r}")
    assert not found, "an engine is spelled outside engines/:\n  " + "\n  ".join(found)
    assert not set(SPELLED_ELSEWHERE) - seen, f"unused allowances: {sorted(set(SPELLED_ELSEWHERE) - seen)}"
    probe = tmp_path / "probe.py"  # the check finds what it is for
    probe.write_text("if plugin.engine == 'fsdp2':\n    pass\nTITLES = {'XLA_V2': 'FSDP v2'}\nx = 'engine fsdp2'\n")
    assert list(spelled_engines(probe, spellings)) == [("fsdp2", 1), ("xla_v2", 3)]


# ---------------------------------------------------------------- the architecture page names every module


def test_every_module_is_named_in_the_architecture_page() -> None:
    """docs/architecture.md's layout table names every module by its path in the package (``config/resolve.py``;
    the top package's ``__init__`` as ``hf_xla_fsdp/__init__.py``), so the page cannot drift from the code."""
    page = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
    rows = {line.split("|")[1].strip().strip("`") for line in page.splitlines() if line.startswith("| `")}
    missing = []
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        shown = str(path.relative_to(PACKAGE_DIR))
        if shown == "__init__.py":
            shown = f"{PACKAGE}/__init__.py"
        if shown not in rows:
            missing.append(shown)
    assert not missing, f"docs/architecture.md (Layout) does not name: {', '.join(missing)}"


# ---------------------------------------------------------------- the installed wheel works


# Runs in the child: proves the installed copy is the one imported, runs the CLI, and catches any
# hf_xla_fsdp module that came from elsewhere (e.g. a venv's editable finder filling in a module
# the wheel lacks).
_EXPORT_SCRIPT = """
import sys
from pathlib import Path

target, ckpt, out = Path(sys.argv[1]).resolve(), sys.argv[2], sys.argv[3]

import hf_xla_fsdp
from hf_xla_fsdp import cli

assert Path(hf_xla_fsdp.__file__).resolve().is_relative_to(target), (
    f"hf_xla_fsdp imported from {hf_xla_fsdp.__file__}, not from the installed wheel in {target}")
rc = cli.main(["export", ckpt, "-o", out, "--quiet"])
strays = sorted(f"{name} ({mod.__file__})" for name, mod in list(sys.modules.items())
                if (name == "hf_xla_fsdp" or name.startswith("hf_xla_fsdp.")) and getattr(mod, "__file__", None)
                and not Path(mod.__file__).resolve().is_relative_to(target))
assert not strays, "imported from outside the installed wheel: " + ", ".join(strays)
sys.exit(rc)
"""

def _run(cmd: list[str], *, what: str, hint: str = "", **kwargs: object) -> subprocess.CompletedProcess:
    """Run ``cmd``; fail the test with its output (and ``hint``) when it exits non-zero."""
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, **kwargs)
    if proc.returncode != 0:
        pytest.fail(f"{what} failed (rc {proc.returncode}){hint}\n"
                    f"--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}", pytrace=False)
    return proc


def build_wheel(tmp: Path) -> Path:
    """A wheel of the project, built offline from a copy of the source tree."""
    # a copy: setuptools keeps build/lib between builds, and a module deleted from the source
    # would still land in the next wheel built in place
    src = tmp / "src"
    copy_sources(src)
    dist = tmp / "dist"
    # --no-build-isolation builds with this interpreter's packages: pip checks that pyproject's
    # [build-system] requires are installed here instead of fetching them
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
          "--check-build-dependencies", "--disable-pip-version-check", "-q", "-w", str(dist), str(src)],
         what="building the wheel",
         hint="\nhint: install pyproject's [build-system] requires in this environment; setuptools<70.1 "
              "needs `wheel<0.46` for bdist_wheel (setuptools>=70.1 needs no `wheel`)")
    wheels = sorted(dist.glob(f"{PACKAGE}-*.whl"))
    assert len(wheels) == 1, f"expected one {PACKAGE} wheel in {dist}, found {wheels}"
    return wheels[0]


def make_checkpoint(directory: Path) -> None:
    """A tiny consolidated Llama (export accepts one), made without any XLA work."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    LlamaForCausalLM(config).save_pretrained(directory)


@pytest.mark.slow
def test_wheel_install_runs_export(tmp_path: Path) -> None:
    wheel = build_wheel(tmp_path / "build")
    target = tmp_path / "site"
    _run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-index", "--disable-pip-version-check", "-q",
          "--target", str(target), str(wheel)], what="installing the wheel")

    ckpt, out = tmp_path / "ckpt", tmp_path / "tiny-llama-export"
    make_checkpoint(ckpt)
    cwd = tmp_path / "cwd"  # outside the repo: the source tree must not be importable from here
    cwd.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHONPATH=str(target), USE_TORCH_XLA="0", PJRT_DEVICE="CPU", HF_HUB_OFFLINE="1")
    _run([sys.executable, "-c", _EXPORT_SCRIPT, str(target), str(ckpt), str(out)],
         what="`hf-xla-fsdp export` from the installed wheel", cwd=cwd, env=env)
    readme = out / "README.md"
    assert readme.is_file(), f"no {readme}; export wrote {sorted(p.name for p in out.iterdir())}"
    card = readme.read_text(encoding="utf-8")
    assert f"# {out.name}" in card and "Llama" in card, card[:2000]


def test_ruff_is_clean() -> None:
    """The line length and import order the code keeps (.ruff.toml), on the package, its tests and examples."""
    ruff = shutil.which("ruff", path=str(Path(sys.executable).parent)) or shutil.which("ruff")
    if ruff is None:
        pytest.skip("ruff is not installed (it comes with the dev extra)")
    res = subprocess.run([ruff, "check", "hf_xla_fsdp", "tests", "examples"], cwd=ROOT, capture_output=True, text=True)
    assert res.returncode == 0, res.stdout[-3000:]


# ---------------------------------------------------------------- every private upstream reach is listed in upstream.py


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _upstream_packages() -> set[str]:
    from hf_xla_fsdp.upstream import TESTED

    return set(TESTED)


# underscore attributes that are not an upstream package's: standard-library internals (no release range of ours
# governs them) and attributes the package puts on objects it does not own
NOT_UPSTREAM = {"_initializing": "importlib's ModuleSpec (importhooks.py: a module still executing)",
                "_backward": "set by modeling/scan.py on the ctx of its own autograd Function"}
OUR_PREFIXES = ("_hf_xla_fsdp", "_xla_fsdp")  # the package's own markers on upstream objects


def _upstream_has(origin: str, name: str) -> bool:
    """Whether the installed upstream class ``origin`` (dotted) has ``name``; True when it cannot be imported here
    (a subclass of a torch_xla class where torch_xla is not installed: counted as a reach)."""
    import importlib

    parts = origin.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for part in parts[cut:]:
                obj = getattr(obj, part)
        except AttributeError:
            return True
        return hasattr(obj, name)
    return True


def _defined_privately(trees: Iterable[ast.AST]) -> set[str]:
    """Underscore names the package itself defines: functions, classes, module- and class-level names, attributes set
    on ``self`` / ``cls`` and names given to ``setattr``. A read of any other underscore attribute is upstream's."""
    found: set[str] = set()
    for tree in trees:
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                found.add(node.name)
                scopes = [node] if isinstance(node, ast.ClassDef) else []
            elif isinstance(node, ast.Module):
                scopes = [node]
            else:
                scopes = []
            for scope in scopes:  # module- and class-level assignments
                for stmt in scope.body:
                    targets = stmt.targets if isinstance(stmt, ast.Assign) else \
                        [stmt.target] if isinstance(stmt, (ast.AnnAssign, ast.AugAssign)) else []
                    found.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                found.add(node.attr)
            elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "setattr" \
                    and len(node.args) > 1 and isinstance(node.args[1], ast.Constant):
                found.add(str(node.args[1].value))
    return {n for n in found if _private(n)} | {n for n in NOT_UPSTREAM}


def _chain(node: ast.expr) -> tuple[Optional[str], list[str]]:
    """``a.b.c`` -> ("a", ["b", "c"]); ``getattr(a.b, "c")`` likewise; root None when it is not a name."""
    attrs: list[str] = []
    while True:
        if isinstance(node, ast.Attribute):
            attrs.append(node.attr)
            node = node.value
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr") \
                and len(node.args) > 1 and isinstance(node.args[1], ast.Constant) and isinstance(node.args[1].value, str):
            attrs.append(node.args[1].value)
            node = node.args[0]
        else:
            return (node.id if isinstance(node, ast.Name) else None), attrs[::-1]


def _truncated(parts: list[str]) -> str:
    """A dotted reach cut after its last underscore part (what the package relies on being there)."""
    last = max(i for i, p in enumerate(parts) if _private(p))
    return ".".join(parts[:last + 1])


def private_reaches(files: Iterable[Path]) -> Iterator[tuple[str, str]]:
    """``(reach, "path:line")`` for every underscore name of an upstream package (those of ``upstream.TESTED``) the
    files reach: ``torch_xla._XLAC.<fn>`` (attribute or ``getattr``), ``from torch.utils import _pytree``,
    ``transformers.AutoModelForCausalLM._model_mapping``, a private method a subclass of an upstream class overrides
    (``Accelerator._get_named_parameters``), and any underscore attribute read that the package does not define itself
    (``trainer._metrics``, ``getattr(self, "_tr_loss")``). A reach whose package is known is ``pkg.dotted.path`` cut
    after its last underscore part; one read off an object of unknown origin is ``?._name``."""
    files = list(files)
    trees = {path: ast.parse(path.read_text(encoding="utf-8"), filename=str(path)) for path in files}
    ours = _defined_privately(trees.values())
    upstream, stdlib = _upstream_packages(), set(sys.stdlib_module_names)
    for path, tree in trees.items():
        where = _shown(path)
        bound: dict[str, str] = {}  # local name -> dotted upstream origin
        foreign: set[str] = set()  # names bound to standard-library modules
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                for alias in node.names:
                    top = alias.name.split(".")[0]
                    local, origin = (alias.asname, alias.name) if alias.asname else (top, top)
                    if top in upstream:
                        bound[local] = origin
                        if any(_private(p) for p in alias.name.split(".")):
                            yield _truncated(alias.name.split(".")), f"{where}:{node.lineno}"
                    elif top in stdlib:
                        foreign.add(local)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                top = node.module.split(".")[0]
                for alias in node.names:
                    if top in upstream:
                        bound[alias.asname or alias.name] = f"{node.module}.{alias.name}"
                        parts = f"{node.module}.{alias.name}".split(".")
                        if any(_private(p) for p in parts):
                            yield _truncated(parts), f"{where}:{node.lineno}"
                    elif top in stdlib:
                        foreign.add(alias.asname or alias.name)
        inner = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Attribute)}
        inner |= {id(n.args[0]) for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
                  and n.func.id in ("getattr", "hasattr") and n.args}
        for node in ast.walk(tree):
            if isinstance(node, ast.ClassDef):  # private methods overridden in a subclass of an upstream class
                bases = [_chain(b) for b in node.bases]
                origins = [".".join([bound[r], *a]) for r, a in bases if r in bound]
                for stmt in node.body:  # an override, not a helper of our own: the installed base has it
                    if origins and isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and _private(stmt.name) \
                            and _upstream_has(origins[0], stmt.name):
                        yield f"{origins[0]}.{stmt.name}", f"{where}:{stmt.lineno}"
            is_getattr = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) \
                and node.func.id in ("getattr", "hasattr")
            if id(node) in inner or not (isinstance(node, ast.Attribute) or is_getattr):
                continue
            root, attrs = _chain(node)
            if not any(_private(a) for a in attrs):
                continue
            if root in bound:
                yield _truncated(bound[root].split(".") + attrs), f"{where}:{node.lineno}"
            elif root not in foreign:
                for name in attrs:
                    if _private(name) and name not in ours and not name.startswith(OUR_PREFIXES):
                        yield f"?.{name}", f"{where}:{node.lineno}"


def _covered(reach: str, targets: list[str]) -> bool:
    """Whether an entry of upstream.py names ``reach``: the same dotted path (or a longer one under it), or for a reach
    through a re-export (``transformers.AutoModelForCausalLM``) one ending in the same owner and name; a reach of
    unknown origin by an entry of that name."""
    parts = reach.split(".")
    if parts[0] == "?":
        return any(t.split(".")[-1] == parts[1] for t in targets)
    tail = ".".join(parts[-2:])
    return any(t.split(".")[0] == parts[0] and (t == reach or t.startswith(reach + ".") or t.endswith("." + tail)
                                                 or t == tail) for t in targets)


def test_every_private_upstream_reach_is_listed_in_upstream_py(tmp_path: Path) -> None:
    """A private name of torch_xla, transformers, accelerate, trl, peft or torch (``torch_xla._XLAC.<fn>``, a private
    attribute of a Trainer, an override of a private method) may change in any release: each has an entry in
    ``hf_xla_fsdp/upstream.py`` (``RELIED_ON``), which checks it against what is installed before its part runs."""
    from hf_xla_fsdp.upstream import RELIED_ON

    targets = [e.target.replace(":", ".") for e in RELIED_ON]
    files = [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if p.name != "upstream.py"]
    missing: dict[str, list[str]] = {}
    for reach, where in private_reaches(files):
        if not _covered(reach, targets):
            missing.setdefault(reach, []).append(where)
    if missing:
        pytest.fail("private upstream names reached without an entry in hf_xla_fsdp/upstream.py (RELIED_ON: target, "
                    "user, why; checked by upstream.require before use):\n  "
                    + "\n  ".join(f"{r}: {', '.join(w)}" for r, w in sorted(missing.items())), pytrace=False)
    # the scan itself finds each kind of reach it is for, and passes what the package defines itself
    probe = tmp_path / "probe.py"
    probe.write_text("import torch_xla\nfrom torch.utils import _pytree\nimport transformers\nfrom accelerate import "
                     "Accelerator\n\n\nclass A(Accelerator):\n    def _prepare_one(self):\n        self._ours = 1\n"
                     "        return self._ours, self._theirs, getattr(self, '_also_theirs', None)\n\n\n"
                     "torch_xla._XLAC._new_fn(1)\ngetattr(torch_xla._XLAC, '_other_fn', None)\n"
                     "transformers.AutoModel._hidden\n")
    found = sorted(reach for reach, _ in private_reaches([probe]))
    assert found == ["?._also_theirs", "?._theirs", "accelerate.Accelerator._prepare_one", "torch.utils._pytree",
                     "torch_xla._XLAC._new_fn", "torch_xla._XLAC._other_fn", "transformers.AutoModel._hidden"], found
    assert not _covered("torch_xla._XLAC._new_fn", targets) and _covered("torch_xla._XLAC._get_local_shards", targets)
