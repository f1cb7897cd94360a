"""The docs say what the code does, checked so they cannot drift: the settings table is generated from the plugin's
fields, every error message docs/troubleshooting.md quotes is one the code can still produce, and every
`hf-xla-fsdp` command is on the docs' front page."""

from __future__ import annotations

import ast
import importlib.util
import re

import pytest
from helpers import ROOT

DOCS = ROOT / "docs"
PACKAGE = ROOT / "hf_xla_fsdp"
HOLE = None  # a variable part: a placeholder in the docs, a formatted value in the code
#: messages troubleshooting.md quotes that are not ours: raised by another library, with our fix beside them
UPSTREAM = {"Please register PrivateUse1HooksInterface by ..."}
#: A quoted message is found when, lined up with one message template of the code (``_aligned``), at least this
#: share of its own characters match the template's (the rest is where the docs fill in a value the code formats:
#: "fsdp_config file" for "{kind} file")...
OF_THE_DOCS = 0.45
#: ... or when it covers this share of the template's own characters, 20 at least (the docs spell out a long list
#: the code joins from a table: "allowed values: FULL_STATE_DICT, SHARDED_STATE_DICT, ...").
#: Every current message passes one of the two with room to spare (0.5 / 0.95 and up); a message whose wording is gone
#: from the code lines up with less than 0.25 of its own characters (the two left behind when shard_metadata's checks
#: were reworded: 0.04, 0.16; a short template may still match all its own characters, hence the 20)
OF_THE_CODE = 0.9


def test_settings_table_is_generated_from_the_plugin_fields():
    spec = importlib.util.spec_from_file_location("settings_table", DOCS / "settings_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    page = (DOCS / "trainer.md").read_text()
    assert module.current(page) == module.table(), "docs/trainer.md's settings table is stale: run " \
                                                   "python docs/settings_table.py"
    from hf_xla_fsdp import XlaFsdpPlugin

    assert all(f"| `{name}`" in page for name in XlaFsdpPlugin.field_names())  # scan_layers was missing once


def _templates() -> list[list]:
    """Every string the package builds (docstrings excepted) as a list of characters and HOLEs: f-string values,
    ``+`` joins of non-literals, ``%s`` and ``{name}`` (logging and ``.format``) become HOLEs."""
    out = []
    for path in PACKAGE.rglob("*.py"):
        tree = ast.parse(path.read_text())
        parents = {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}

        def chars(node: ast.AST) -> list:
            if isinstance(node, ast.Constant) and isinstance(node.value, str):
                text = re.sub(r"%[-#0-9.]*[sdrif]|\{[A-Za-z_][A-Za-z_0-9.]*(![rs])?(:[^{}]*)?\}", "\x00", node.value)
                return [HOLE if c == "\x00" else c for c in text.replace("`", "")]
            if isinstance(node, ast.JoinedStr):
                return [c for v in node.values for c in (chars(v) if isinstance(v, ast.Constant) else [HOLE])]
            if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
                return chars(node.left) + chars(node.right)
            return [HOLE]

        for node in ast.walk(tree):
            parent = parents.get(node)
            if not isinstance(node, (ast.Constant, ast.JoinedStr, ast.BinOp)) or isinstance(parent, (ast.JoinedStr, ast.Expr)):
                continue  # a piece of a larger string, or a docstring
            if isinstance(parent, ast.BinOp) and isinstance(parent.op, ast.Add):
                continue
            text = chars(node)
            if sum(c is not HOLE for c in text) >= 10:
                out.append([HOLE, *text, HOLE])
    # the start-up hook's one message lives in its .pth line (Python %-formatting inside a string)
    hook = (PACKAGE / "hf_xla_fsdp_hook.pth").read_text()
    message = re.search(r"'(hf_xla_fsdp start-up hook[^']*)'", hook).group(1).removesuffix("\\n")
    out.append([HOLE, *[HOLE if c == "\x00" else c for c in message.replace("%s", "\x00")], HOLE])
    return out


def _quoted_messages() -> list[str]:
    """The messages troubleshooting.md's tables quote (first column, in backticks)."""
    page = (DOCS / "troubleshooting.md").read_text()
    return [m for line in page.splitlines() if line.startswith("| `")
            for m in re.findall(r"`([^`]+)`", line.split(" | ")[0]) if " " in m]  # not a class name (`PushError`)


def _pattern(message: str) -> list:
    """A quoted message as characters and HOLEs (``<...>`` and ``...`` stand for what varies or is left out)."""
    out: list = [HOLE]
    for piece in re.split(r"(<[^<>]*>|\.\.\.)", message):
        out += [HOLE] if re.fullmatch(r"<[^<>]*>|\.\.\.", piece) else list(piece)
    return [*out, HOLE]


def _aligned(doc: list, code: list) -> int:
    """The most characters of ``doc`` that line up with equal characters of ``code`` in one string both could be
    (a HOLE on either side takes any run of the other's characters)."""
    n, m = len(doc), len(code)
    none = -(10**9)
    best = [[none] * (m + 1) for _ in range(n + 1)]
    best[n][m] = 0
    for i in range(n, -1, -1):
        for j in range(m, -1, -1):
            if i == n and j == m:
                continue
            v = none
            if i < n and doc[i] is HOLE:
                v = max(v, best[i + 1][j], best[i][j + 1] if j < m else none)
            if j < m and code[j] is HOLE:
                v = max(v, best[i][j + 1], best[i + 1][j] if i < n else none)
            if i < n and j < m and doc[i] is not HOLE and doc[i] == code[j]:
                v = max(v, 1 + best[i + 1][j + 1])
            best[i][j] = v
    return best[0][0]


def _words(chars: list) -> set[str]:
    return set(re.findall(r"[A-Za-z_][A-Za-z_0-9]+", "".join(c if c is not HOLE else " " for c in chars)))


@pytest.fixture(scope="module")
def templates() -> list[tuple[list, set[str]]]:
    return [(t, _words(t)) for t in _templates()]


def _found(message: str, templates: list[tuple[list, set[str]]]) -> tuple[bool, float, float]:
    """Whether ``message`` lines up with a template of the code (see OF_THE_DOCS / OF_THE_CODE), and the best
    shares of its own and of the template's characters that matched."""
    doc = _pattern(message)
    own = sum(c is not HOLE for c in doc)
    words = _words(doc)
    best_doc, best_code = 0.0, 0.0
    # the templates sharing the most (and longest) words with the message, then the exact alignment on those few
    for code, _ in sorted(templates, key=lambda t: -sum(map(len, words & t[1])))[:12]:
        matched = _aligned(doc, code)
        of_doc, of_code = matched / own, matched / sum(c is not HOLE for c in code)
        if of_doc >= OF_THE_DOCS or (of_code >= OF_THE_CODE and matched >= 20):
            return True, of_doc, of_code
        best_doc, best_code = max(best_doc, of_doc), max(best_code, of_code)
    return False, best_doc, best_code


def test_every_message_the_troubleshooting_page_quotes_exists_in_the_code(templates):
    messages = _quoted_messages()
    assert len(messages) > 150  # the page's tables were read (183 messages today)
    missing = []
    for message in messages:
        if message not in UPSTREAM:
            found, of_doc, of_code = _found(message, templates)
            if not found:
                missing.append(f"{of_doc:.2f} / {of_code:.2f}: {message}")
    assert not missing, "docs/troubleshooting.md quotes messages the code no longer has:\n" + "\n".join(missing)


def test_a_message_that_is_gone_is_found_out(templates):
    # the check above can fail: the two messages the page quoted after they were reworded, and an invented one
    for message in ("... has an incomplete shard_metadata (needs shard_info, flatten_info, world_size, rank)",
                    "... has a shard_metadata whose rank or world_size is not a number",
                    "<dir> holds a checkpoint from the future: upgrade to version <v> or later"):
        found, of_doc, of_code = _found(message, templates)
        assert not found and of_doc < 0.25, (message, of_doc, of_code)


def test_every_cli_command_is_on_the_front_page():
    from hf_xla_fsdp.cli import build_parser

    parser = build_parser()
    commands = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction").choices
    index = (DOCS / "index.md").read_text()
    assert {"env", "launch", "consolidate", "plan"} <= set(commands)
    # a row of the front page's command table each (env and launch were missing from it once)
    assert [c for c in commands if f"| `hf-xla-fsdp {c}" not in index] == []
