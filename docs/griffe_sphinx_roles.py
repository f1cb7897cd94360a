"""Griffe extension used by the API reference (see mkdocs.yml); static analysis only, nothing is imported.

* The package's docstrings are plain prose that name other objects with Sphinx roles (``:class:`XlaFsdpPlugin```,
  ``:func:`~hf_xla_fsdp.checkpoint.load_checkpoint```). Markdown has no roles, so each one becomes an inline code
  span of its target (the last component only with ``~``, as Sphinx shows it).
* ``XlaFsdpPlugin`` describes each setting once, as ``name: type = setting(default, "help", ...)``: that help text
  becomes the field's docstring, so the reference lists every setting with its default and meaning.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:py:)?(?:class|meth|func|mod|attr|data|exc|obj|const):`(~?)([^`]+)`")


def _as_code(match: re.Match) -> str:
    short, target = match.groups()
    target = target.strip()
    if short:
        target = target.rsplit(".", 1)[-1]
    return f"`{target}`"


def _setting_help(node: Any) -> str | None:
    """The help text of ``name: type = setting(default, "help", ...)``, if ``node`` is such a field."""
    value = getattr(node, "value", None)
    if not (isinstance(node, ast.AnnAssign) and isinstance(value, ast.Call)):
        return None
    if not (isinstance(value.func, ast.Name) and value.func.id == "setting"):
        return None
    text = value.args[1] if len(value.args) > 1 else next((k.value for k in value.keywords if k.arg == "help"), None)
    return text.value if isinstance(text, ast.Constant) and isinstance(text.value, str) else None


class SphinxRoles(griffe.Extension):
    """Roles rendered as code in every docstring; plugin settings documented by their help text."""

    def on_instance(self, *, node: Any, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.is_attribute and obj.docstring is None:
            text = _setting_help(node)
            if text is not None:
                default = ast.unparse(node.value.args[0]) if node.value.args else None
                obj.docstring = griffe.Docstring(text + (f" (default: `{default}`)" if default else ""), parent=obj)
        if obj.docstring is not None:
            obj.docstring.value = _ROLE.sub(_as_code, obj.docstring.value)
