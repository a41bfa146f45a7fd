"""Packaging: every third-party module the library imports is a declared dependency (core or
an extra), and the heavy optional ones are imported only inside the functions that use them."""

from __future__ import annotations

import ast
import os
import re
import sys
import tomllib

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = ("pallas_tune", "kernels", "search_spaces")
# Import name -> distribution name, where they differ.
DIST = {"jax": "jax", "jaxlib": "jaxlib", "yaml": "pyyaml", "psycopg": "psycopg"}
OPTIONAL = {"plotly", "matplotlib", "rich", "pgserver", "psycopg", "selenium", "torch", "libtpu"}


def _declared() -> tuple[set[str], set[str]]:
    with open(os.path.join(ROOT, "pyproject.toml"), "rb") as f:
        project = tomllib.load(f)["project"]

    def names(reqs):
        return {re.split(r"[\s<>=!\[;~]", r, maxsplit=1)[0].lower().replace("_", "-")
                for r in reqs}

    extras = set()
    for reqs in project.get("optional-dependencies", {}).values():
        extras |= names(reqs)
    return names(project["dependencies"]), extras


def _imports():
    """(module, file, at module level?) of every absolute import."""
    for base in SOURCES:
        for dirpath, _, files in os.walk(os.path.join(ROOT, base)):
            for name in files:
                if not name.endswith(".py"):
                    continue
                path = os.path.join(dirpath, name)
                tree = ast.parse(open(path, encoding="utf-8").read())
                top = {id(n) for n in tree.body}
                for node in ast.walk(tree):
                    if isinstance(node, ast.Import):
                        for a in node.names:
                            yield a.name.split(".")[0], path, id(node) in top
                    elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                        yield node.module.split(".")[0], path, id(node) in top


def test_every_import_is_declared_and_heavy_ones_are_lazy():
    core, extras = _declared()
    missing, eager = [], []
    for module, path, top in _imports():
        if module in sys.stdlib_module_names or module in ("pallas_tune", "__future__"):
            continue
        dist = DIST.get(module, module).lower().replace("_", "-")
        if dist not in core and dist not in extras and module != "libtpu":
            missing.append(f"{module} ({os.path.relpath(path, ROOT)})")
        if top and (module in OPTIONAL or dist not in core):
            eager.append(f"{module} at the top of {os.path.relpath(path, ROOT)}")
    assert not missing, f"imported but not declared in pyproject.toml: {missing}"
    assert not eager, f"optional dependencies imported eagerly: {eager}"


def test_license_and_py_typed_ship():
    assert os.path.exists(os.path.join(ROOT, "LICENSE"))
    assert os.path.exists(os.path.join(ROOT, "pallas_tune", "py.typed"))
