"""Which kernel modules the CLI may import: a file may name a kernel, only the user decides to run
code.

A winners file's ``"kernel"`` and a ``PALLAS_TUNE_RECORD`` line's ``"ref"`` are data that anyone
may have written (a cache checked out of a repository, a record copied from production), and
importing a module runs it: ``"kernel": "venv.__main__.x"`` would turn the checked directory
into a virtualenv. So a name read from a file is looked up only among the kernels the user
allowed, in this order:

1. the modules named with ``--import MODULE`` (imported up front, because the user asked);
2. the modules that lie under a ``--path DIR`` (the user's "import kernels from DIR"; an
   already imported module of the same name elsewhere does not count);
3. the entry points installed packages declare in the group ``pallas_tune.kernels``: the entry
   point's name is the kernel's name, its value the tunable's ``module:attr``;
4. the kernels shipped in pallas-tune (``pallas_tune.kernels``), by import path or by the name
   they register (the upstream adapters, e.g. ``jax.ops.gpu.softmax``).

Nothing else is imported; the caller reports the kernel as not checked and names the flag that
allows it. A ``--space`` file and a ``MODULE:NAME`` argument are the user's own choice of code,
and are loaded as before (:func:`pallas_tune.cli.sweep.load_kernel`).

A ``--path`` directory never replaces another module (:mod:`pallas_tune.cli.pathdirs`), and
whatever a kernel module raises when imported (``SystemExit`` included: an import is not the
command's exit) is that kernel failing to load; only Ctrl-C (or SIGTERM) stops the command.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import types
from collections.abc import Sequence
from typing import Any, Final

from pallas_tune.cli import pathdirs
from pallas_tune.cli.pathdirs import import_path
from pallas_tune.cli.shapes import CLIUsageError

__all__ = ["ENTRY_POINT_GROUP", "KernelImportError", "KernelRegistry", "add_import_option",
           "check_module", "check_ref", "import_path", "load_kernel", "raised"]

ENTRY_POINT_GROUP: Final = "pallas_tune.kernels"
_SHIPPED: Final = "pallas_tune.kernels"


class KernelImportError(CLIUsageError):
    """Importing a kernel's module raised what no import should (``SystemExit``, or another
    exception outside ``Exception``): the kernel cannot be loaded."""


def raised(e: BaseException) -> str:
    """``SystemExit: 0``: what a module raised when imported, for a message."""
    text = str(e)
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


_FILE_HINT: Final = ("a file is not imported by its path: give its directory with --path DIR "
                     "and the file's module name (for ./mykernels.py: --path . "
                     "mykernels:NAME)")


def check_module(module: str, what: str) -> None:
    """Raises CLIUsageError unless ``module`` is a module's dotted name (``a.b.c``, each part
    an identifier): a path (``../x``, ``k.py``) or a relative name (``.x``) is refused with
    how to import a file, before anything is imported."""
    if (not module or not all(part.isidentifier() for part in module.split("."))
            or module.endswith(".py")):
        hint = (f"; {_FILE_HINT}" if any(c in module for c in "/\\") or module.startswith(".")
                or module.endswith(".py") else "")
        raise CLIUsageError(f"{what}: {module!r} is not a module's dotted name (e.g. "
                            f"pallas_tune.kernels.matmul){hint}")


def check_ref(ref: str, what: str) -> None:
    """Raises CLIUsageError unless ``ref`` has the form MODULE:NAME (NAME a dotted attribute
    path), naming the problem; imports nothing."""
    module, sep, attr = ref.partition(":")
    if not sep or not module or not attr:
        raise CLIUsageError(f"{what} {ref!r} must be MODULE:NAME, e.g. "
                            "pallas_tune.kernels.matmul:matmul")
    check_module(module, f"{what} {ref!r}")
    if not all(part.isidentifier() for part in attr.split(".")):
        raise CLIUsageError(f"{what} {ref!r}: {attr!r} is not a name in a module (MODULE:NAME, "
                            "e.g. pallas_tune.kernels.matmul:matmul)")


def load_kernel(ref: str, paths: Sequence[str] = ()) -> Any:
    from pallas_tune import _refs
    from pallas_tune.runtime.tunable import TunableKernel

    check_ref(ref, "kernel")
    for p in paths:
        if not os.path.isdir(p):
            raise CLIUsageError(f"--path {p}: not a directory")
    with import_path(paths):
        try:
            obj = _refs.load(ref)
        except (ValueError, ImportError, AttributeError) as e:
            hint = ("" if paths else " (the current directory is not searched: pass --path . "
                                     "to import kernels from files here)")
            raise CLIUsageError(f"cannot load kernel {ref!r}: {e}{hint}") from None
        except (Exception, KeyboardInterrupt):
            raise
        except BaseException as e:  # noqa: BLE001 - SystemExit at import: not our exit.
            raise KernelImportError(f"cannot load kernel {ref!r}: importing its module raised "
                                    f"{raised(e)}") from None
    if not isinstance(obj, TunableKernel):
        raise CLIUsageError(f"{ref} is not a @pallas_tune.tunable kernel (got {type(obj).__name__})")
    return obj


def add_import_option(parser: Any, what: str) -> None:
    """``--import MODULE`` (repeatable) on a command that reads kernel names from files."""
    parser.add_argument("--import", dest="imports", action="append", metavar="MODULE",
                        help=f"import MODULE and use its tunable kernels (repeatable); {what}")


def _tunables(module: Any) -> dict[str, Any]:
    """The tunables a module holds at its top level, by their registered names."""
    from pallas_tune.runtime.tunable import TunableKernel

    return {v.name: v for v in vars(module).values() if isinstance(v, TunableKernel)}


@functools.cache
def _shipped_modules() -> tuple[str, ...]:
    """pallas-tune's own kernel modules (listed, not imported)."""
    import pkgutil

    import pallas_tune.kernels as shipped

    return tuple(f"{_SHIPPED}.{info.name}" for info in pkgutil.iter_modules(shipped.__path__))


class KernelRegistry:
    """The kernels the user allowed the CLI to import (see the module docstring).

    Args:
      imports: modules to import now (``--import``); raises CLIUsageError if one cannot be.
      paths: directories whose modules may be imported (``--path``); raises CLIUsageError if
        one is not a directory.
    """

    def __init__(self, imports: Sequence[str] = (), paths: Sequence[str] = ()):
        for p in paths:
            if not os.path.isdir(p):
                raise CLIUsageError(f"--path {p}: not a directory")
        self._paths = [os.path.abspath(p) for p in paths]
        self._imports = tuple(imports)
        self._named: dict[str, Any] = {}
        self._memo: dict[str, tuple[Any, str | None]] = {}
        self._all_shipped: dict[str, Any] | None = None
        self._declared: list[Any] | None = None
        for module in self._imports:
            try:
                with import_path(self._paths):
                    found = importlib.import_module(module)
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - whatever the user's module raises.
                raise CLIUsageError(f"--import {module}: cannot import it ({raised(e)})"
                                    ) from None
            self._named = {**_tunables(found), **self._named}  # The first --import wins.

    def allow(self, kernel: Any) -> None:
        """Adds a kernel the user chose otherwise (a ``--space`` file's)."""
        self._named.setdefault(kernel.name, kernel)
        self._memo.pop(kernel.name, None)

    # ---- kernels by the name a winners file gives --------------------------------------

    def find(self, name: str) -> tuple[Any, str | None]:
        """(the tunable registered as ``name``, None), or (None, why it was not imported and
        how to allow it). Never imports a module the user did not allow."""
        if name not in self._memo:
            self._memo[name] = self._find(name)
        return self._memo[name]

    def _find(self, name: str) -> tuple[Any, str | None]:
        if name in self._named:
            return self._named[name], None
        found = self._from_entry_point(name)
        if found is not None:
            return found
        parts = name.split(".")
        if name.startswith(_SHIPPED + ".") and len(parts) > 3:
            module = ".".join(parts[:3])
            if module in _shipped_modules():
                try:
                    kernel = _tunables(importlib.import_module(module)).get(name)
                except KeyboardInterrupt:
                    raise
                except BaseException as e:  # noqa: BLE001 - e.g. an adapter whose JAX lacks an op.
                    return None, f"importing {module} failed ({raised(e)})"
                if kernel is not None:
                    return kernel, None
        elif self._under_path(parts[0]):
            return self._from_path(name)
        kernel = self._shipped_by_name().get(name)
        if kernel is not None:
            return kernel, None
        guess = name.rpartition(".")[0] or name or "MODULE"
        return None, (f"kernel {name!r} is none of those pallas-tune may import (its name comes "
                      f"from a file, and importing a module runs it): pass --import MODULE, the "
                      f"module that defines it (e.g. --import {guess}), or --path DIR if it "
                      "lies in DIR")

    def _entry_points(self) -> list[Any]:
        """The declared entry points (listed once: a scan of every installed distribution)."""
        if self._declared is None:
            from importlib.metadata import entry_points

            self._declared = list(entry_points(group=ENTRY_POINT_GROUP))
        return self._declared

    def _from_entry_point(self, name: str) -> tuple[Any, str | None] | None:
        from pallas_tune.runtime.tunable import TunableKernel

        for ep in self._entry_points():
            if ep.name != name:
                continue
            try:
                obj = ep.load()
            except KeyboardInterrupt:
                raise
            except BaseException as e:  # noqa: BLE001 - an installed package's broken module.
                return None, (f"the entry point {ep.name} = {ep.value} of kernel {name!r} "
                              f"failed to load ({raised(e)})")
            if isinstance(obj, TunableKernel) and obj.name == name:
                return obj, None
            kernel = _tunables(obj).get(name) if isinstance(obj, types.ModuleType) else None
            if kernel is not None:
                return kernel, None
            return None, (f"the entry point {ep.name} = {ep.value} is not the tunable kernel "
                          f"{name!r}")
        return None

    def _under_path(self, top: str) -> bool:
        """Whether importing the top-level module ``top`` imports it from a ``--path``
        directory (found without importing anything: an imported module of that name, or one
        the standard library or an installed package provides, is not a --path module)."""
        if not self._paths or not top.isidentifier():
            return False
        with import_path(self._paths):
            try:
                spec = importlib.util.find_spec(top)
            except (ImportError, ValueError):  # E.g. an imported module without a spec.
                return False
        return pathdirs.under(pathdirs.location(spec), self._paths)

    def _from_path(self, name: str) -> tuple[Any, str | None]:
        module, _, attr = name.rpartition(".")
        last = ""
        while module:
            try:
                kernel = load_kernel(f"{module}:{attr}", self._paths)
                if kernel.name == name:
                    return kernel, None
                return None, (f"{module}:{attr} is the kernel {kernel.name!r}, not {name!r}: "
                              f"pass --import MODULE, the module that defines {name!r} (or "
                              "--path DIR, the directory that holds it)")
            except KernelImportError as e:
                return None, f"importing the module of kernel {name!r} failed ({e})"
            except CLIUsageError as e:
                last = str(e)
            except Exception as e:  # noqa: BLE001 - the user's module raising at import.
                return None, f"importing the module of kernel {name!r} failed ({e})"
            module, _, head = module.rpartition(".")
            attr = f"{head}.{attr}"
        return None, f"kernel {name!r} was not found under --path: {last}"

    def _shipped_by_name(self) -> dict[str, Any]:
        """Every shipped kernel by its registered name (the adapters' names spell no import
        path). Imports pallas-tune's own kernel modules only."""
        if self._all_shipped is None:
            self._all_shipped = {}
            for module in _shipped_modules():
                try:
                    found = importlib.import_module(module)
                except KeyboardInterrupt:
                    raise
                except BaseException:  # noqa: BLE001, S112 - e.g. an adapter whose JAX lacks an op
                    continue
                self._all_shipped.update(_tunables(found))
        return self._all_shipped

    # ---- kernels by a record's MODULE:NAME ---------------------------------------------

    def ref_problem(self, ref: str) -> str | None:
        """Why the module of a record's ``MODULE:NAME`` may not be imported, naming the flag
        that allows it (None: it may)."""
        module = ref.partition(":")[0]
        if module in self._imports or module in _shipped_modules():
            return None
        if module and self._under_path(module.split(".")[0]):
            return None
        if any(ep.module == module for ep in self._entry_points()):
            return None
        return (f"its module is none of those pallas-tune may import (the record names it, "
                f"and importing a module runs it): pass --import {module or 'MODULE'}, or "
                f"--path DIR for the directory that holds {module.split('.')[0] or 'it'}, to "
                "tune it")
