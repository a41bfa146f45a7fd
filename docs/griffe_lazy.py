"""A griffe extension for the API reference (mkdocs.yml names it).

- pallas_tune's lazy names become package members. `pallas_tune/__init__.py` imports some
  public names on first use, through a `_LAZY` table (name -> module) and a module
  `__getattr__`, which static analysis cannot follow. The table is read from the package as
  griffe loaded it and each name added as an alias, so that `::: pallas_tune.tune` resolves
  wherever the table says the name lives.
- Sphinx roles in docstrings (:class:`X`, :mod:`x.y`, :func:`~x.f`) are shown as code, as
  Markdown has no roles, and reST's `Example::` loses its second colon.
"""

from __future__ import annotations

import ast
import re
from typing import Any

import griffe

_ROLE = re.compile(r":(?:mod|class|func|meth|attr|data|exc|obj):`~?([^`]+)`")
_LITERAL = re.compile(r"(\S)::$", re.MULTILINE)  # reST's "Example::" before an indented block.


def _plain_roles(obj: griffe.Object) -> None:
    if obj.docstring is not None:
        obj.docstring.value = _LITERAL.sub(r"\1:", _ROLE.sub(r"`\1`", obj.docstring.value))
    for member in obj.members.values():
        if not member.is_alias:
            _plain_roles(member)


class LazyNames(griffe.Extension):
    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.path != "pallas_tune":
            return
        _plain_roles(pkg)
        if "_LAZY" not in pkg.members:
            return
        table = ast.literal_eval(str(pkg.members["_LAZY"].value))
        for name, module in table.items():
            if name not in pkg.members:
                pkg.set_member(name, griffe.Alias(name, f"{module}.{name}", parent=pkg))

    # Griffe before 2.0 named the same hook this way (both are idempotent).
    on_package_loaded = on_package
