"""``--path DIR``: the user's directories of kernel modules, which never replace another module.

A ``--path`` directory is often ``.`` or a checked-out repository, and whatever lies there is
imported if its name is asked for: a ``jax.py`` there, put first on ``sys.path``, would replace
the real JAX (and run) the moment a kernel module imported it. So the directories are never put
on ``sys.path``. While a command imports kernels (:func:`import_path`), a finder placed after
every other one (:class:`DirFinder`) serves the top-level modules found in them, and only those
that nothing else provides:

- the dependencies (JAX, NumPy, pallas-tune itself) are imported first (:func:`preload`), and
  an imported module is never looked up again;
- a module the standard library, an installed package or any other finder provides is theirs;
- a name pallas-tune or its dependencies may import later, even where it is not installed
  (``libtpu``, ``jax_plugins``, ``plotly``... see :func:`_dependency_names`), is never served.

A file of such a name in a ``--path`` directory is skipped with a warning naming it
(:func:`warn_skipped`). The directories do not join namespace packages found elsewhere either.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from typing import Any, Final

__all__ = ["DirFinder", "import_path", "location", "preload", "refusal", "under", "warn_skipped"]

# Imported before any --path directory can serve a module: what a kernel module imports.
_PRELOAD: Final = ("numpy", "jax", "jax.numpy", "pallas_tune.runtime.tunable")
# Modules pallas-tune, JAX and Optuna import (some lazily, some only where installed), beyond
# the requirements their distributions declare.
_ALWAYS_REFUSED: Final = frozenset({
    "pallas_tune", "jax", "jaxlib", "jax_plugins", "libtpu", "libtpu_nightly", "numpy",
    "ml_dtypes", "opt_einsum", "scipy", "optuna", "sqlalchemy", "alembic", "colorlog", "tqdm",
    "cmaes", "torch", "tensorflow", "cupy", "triton", "plotly", "matplotlib", "pandas",
    "kaleido", "ipython", "absl", "etils", "google", "tomli", "psutil", "pytest"})
_MAX_SCANNED: Final = 2000  # Entries of one --path directory looked at for warnings.
_scanned: set[str] = set()  # The --path directories warn_skipped looked at already.


@functools.cache
def _dependency_names() -> frozenset[str]:
    """Top-level module names pallas-tune's dependencies may import: the requirements (extras
    included) of pallas-tune, JAX, jaxlib and Optuna, as import names, and a fixed list."""
    import re
    from importlib import metadata

    names = set(_ALWAYS_REFUSED)
    for dist in ("pallas-tune", "jax", "jaxlib", "optuna"):
        try:
            requires = metadata.requires(dist) or []
        except metadata.PackageNotFoundError:
            continue
        for req in requires:
            m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)", req)
            if m:
                names.add(re.sub(r"[-.]", "_", m.group(1)).lower())
    return frozenset(names)


def refusal(name: str) -> str | None:
    """Why a top-level module ``name`` is never imported from a ``--path`` directory, or None."""
    if name in sys.stdlib_module_names or name in sys.builtin_module_names:
        return "the name of a standard library module"
    if name.lower() in _dependency_names() or name.startswith(("jax_", "jaxlib")):
        return "the name of a module pallas-tune or its dependencies import"
    return None


class DirFinder:
    """Finds top-level modules in the ``--path`` directories, placed after every other finder
    on ``sys.meta_path`` (so whatever they provide wins), never one :func:`refusal` names.
    Submodules are found through their package's ``__path__``, as usual."""

    def __init__(self, dirs: Sequence[str]):
        self.dirs = [os.path.realpath(d) for d in dirs]

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if path is not None or "." in name or refusal(name) is not None:
            return None
        return importlib.machinery.PathFinder.find_spec(name, self.dirs)

    def invalidate_caches(self) -> None:
        pass


@functools.cache
def preload() -> None:
    """Imports the dependencies before any ``--path`` directory may serve a module."""
    for module in _PRELOAD:
        with contextlib.suppress(Exception):
            importlib.import_module(module)


@contextlib.contextmanager
def import_path(paths: Sequence[str] = ()) -> Iterator[None]:
    """While kernels are imported: the ``--path`` directories served by a :class:`DirFinder`
    after every other finder, and ``sys.path`` without the current directory that ``python -m``
    and ``-c`` put first (both restored afterwards)."""
    if paths:
        preload()
    saved = list(sys.path)
    here = os.path.realpath(os.getcwd())
    if sys.path and (sys.path[0] == "" or os.path.realpath(sys.path[0]) == here):
        del sys.path[0]
    finder = DirFinder(paths) if paths else None
    if finder is not None:
        sys.meta_path.append(finder)
        warn_skipped(paths)
    try:
        yield
    finally:
        sys.path[:] = saved
        if finder is not None:
            with contextlib.suppress(ValueError):  # A module's own hooks, if any, stay.
                sys.meta_path.remove(finder)


def location(spec: Any) -> str | None:
    """Where a module spec's code lies: its file, or a namespace package's first directory."""
    if spec is None:
        return None
    if spec.origin and getattr(spec, "has_location", False):
        return spec.origin
    paths = list(spec.submodule_search_locations or ())
    return paths[0] if paths else None


def under(where: str | None, dirs: Sequence[str]) -> bool:
    """Whether the file or directory ``where`` lies in one of ``dirs``."""
    if not where:
        return False
    real = os.path.realpath(where)
    return any(real.startswith(os.path.realpath(d) + os.sep) for d in dirs)


def _provider(name: str) -> tuple[str, str | None] | None:
    """(how, where) the module ``name`` comes from other than a ``--path`` directory (imported,
    or found by another finder), without importing it; None if nowhere."""
    loaded = sys.modules.get(name)
    if loaded is not None:
        return "already imported from", getattr(loaded, "__file__", None)
    for finder in sys.meta_path:
        if isinstance(finder, DirFinder) or not hasattr(finder, "find_spec"):
            continue
        try:
            spec = finder.find_spec(name, None)
        except Exception:  # noqa: BLE001, S112 - a broken finder: ask the others.
            continue
        if spec is not None:
            return "installed at", location(spec)
    return None


def _module_name(entry: os.DirEntry[str]) -> str | None:
    """The top-level module a directory entry would be imported as (None: not a module, or a
    directory without ``__init__.py``, which is warned about nowhere)."""
    try:
        if entry.is_dir():
            ok = os.path.isfile(os.path.join(entry.path, "__init__.py"))
            return entry.name if ok and entry.name.isidentifier() else None
    except OSError:
        return None
    for suffix in importlib.machinery.all_suffixes():
        if entry.name.endswith(suffix):
            stem = entry.name[: -len(suffix)]
            return stem if stem.isidentifier() else None
    return None


def warn_skipped(paths: Sequence[str]) -> None:
    """Warns (once per directory) of every file of the ``--path`` directories that is not
    imported from there: its name belongs to the standard library, a dependency or an
    installed or already imported module."""
    for d in paths:
        if os.path.abspath(d) in _scanned:
            continue
        _scanned.add(os.path.abspath(d))
        try:
            with os.scandir(d) as it:
                entries = [e for _, e in zip(range(_MAX_SCANNED), it, strict=False)]
        except OSError:
            continue
        for entry in sorted(entries, key=lambda e: e.name):
            name = _module_name(entry)
            path = os.path.join(os.path.abspath(d), entry.name)
            if name is None:
                continue
            why = refusal(name)
            if why is None:
                found = _provider(name)
                if found is None or under(found[1], [d]):
                    continue  # Served from d, or the same file found another way.
                why = f"{found[0]} {found[1] or 'elsewhere'}"
            print(f"pallas-tune: warning: --path {d}: {path} is not imported: `{name}` is "
                  f"{why}, which a --path directory never replaces; rename it to import it",
                  file=sys.stderr, flush=True)
