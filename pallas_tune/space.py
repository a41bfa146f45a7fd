"""Search spaces: named parameters with finite choices, and the configs drawn from them.

Pure Python: nothing here imports jax, so spaces can be built and validated anywhere.
"""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import math
import os
import re
import tomllib
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

from pallas_tune import _bounded, _settings
from pallas_tune.config import Config, _freeze
from pallas_tune.constraints import Constraint, as_constraints
from pallas_tune.errors import InputTooLargeError, SearchSpaceError

__all__ = ["Config", "Constraint", "Param", "SearchSpace", "TrialEncoder", "load_space",
           "shipped_spaces", "space_path"]

def typed_equal(a: Any, b: Any) -> bool:
    """Equality that also compares types: ``128.0``, ``True`` and ``128`` are three values."""
    if type(a) is not type(b):
        return False
    if isinstance(a, tuple):
        return len(a) == len(b) and all(typed_equal(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)


def _same_kind(value: Any, choice: Any) -> bool:
    """Whether ``value`` has the type (and, for tuples, the length and element types) of
    ``choice``."""
    if type(value) is not type(choice):
        return False
    if isinstance(value, tuple):
        return len(value) == len(choice) and all(
            _same_kind(v, c) for v, c in zip(value, choice, strict=True))
    return True


def _check_hashable(name: str, value: Any) -> None:
    try:
        hash(value)
    except TypeError as e:
        raise SearchSpaceError(
            f"choice {value!r} of parameter {name!r} is unhashable ({e}); use tuples instead of "
            "lists or dicts, because configs are static arguments of jax.jit."
        ) from None


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Param:
    """One tunable keyword parameter and its finite, ordered choices."""

    name: str
    choices: tuple[Any, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise SearchSpaceError(f"parameter name {self.name!r} is not a Python identifier.")
        if isinstance(self.choices, str | bytes) or not isinstance(self.choices, Sequence):
            raise SearchSpaceError(
                f"choices of parameter {self.name!r} must be a list or tuple of values, got "
                f"{self.choices!r}; write {self.name}=[{self.choices!r}] for a single value."
            )
        choices = tuple(_freeze(c) for c in self.choices)
        if not choices:
            raise SearchSpaceError(
                f"parameter {self.name!r} has no choices; give it at least one value."
            )
        for c in choices:
            _check_hashable(self.name, c)
        if len(set(choices)) != len(choices):
            dup = [c for c in choices if choices.count(c) > 1][0]
            raise SearchSpaceError(f"parameter {self.name!r} lists {dup!r} more than once.")
        object.__setattr__(self, "choices", choices)

    def value_problem(self, value: Any, *, outside_ok: bool = False) -> str | None:
        """Why ``value`` cannot be this parameter's value (None: it can). A value must be one of
        the choices, of the same type (``128.0`` is not ``128``); with ``outside_ok``, any value
        of a declared choice's type (a config marked as outside the space)."""
        value = _freeze(value)
        if any(typed_equal(value, c) for c in self.choices):
            return None
        if outside_ok and (any(_same_kind(value, c) for c in self.choices)
                           or set(self.choices) == {None}):  # Pinned off: no type to compare.
            return self._sign_problem(value)
        kinds = sorted({type(c).__name__ for c in self.choices})
        if not any(_same_kind(value, c) for c in self.choices):
            return (f"{self.name}={value!r} is a {type(value).__name__}, not a "
                    f"{' or '.join(kinds)} like the declared choices {self.choices}")
        return f"{self.name}={value!r} is not one of the declared choices {self.choices}"

    def _sign_problem(self, value: Any) -> str | None:  # A sign no choice has: bm=0, all > 0.
        nums = [c for c in self.choices if isinstance(c, int | float) and not isinstance(c, bool)]
        low = min(nums) if nums and type(value) in (int, float) else None
        if low is not None and ((low > 0 and not value > 0) or (low >= 0 and value < 0)):
            return (f"{self.name}={value!r} is not {'positive' if low > 0 else 'non-negative'}"
                    f", unlike every choice {self.choices}")
        return None

    @property
    def is_power_of_two_ints(self) -> bool:
        return all(
            isinstance(c, int) and not isinstance(c, bool) and c > 0 and c & (c - 1) == 0
            for c in self.choices
        )


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class SearchSpace:
    """A product of :class:`Param` choices, in declaration order.

    Args:
      params: the tunable parameters.
      default: the config used on a cache miss, if given (must be a point of the space).
      constraints: named predicates relating parameters to a call's arguments
        (:class:`Constraint`); a config that breaks one is invalid for that call.
      clamps: parameter name → expression of the dimension the kernel caps that parameter at
        (a mapping, kept as sorted pairs); see :mod:`pallas_tune.effective`.
    """

    params: tuple[Param, ...]
    default: Mapping[str, Any] | None = None
    constraints: tuple[Constraint, ...] = ()
    clamps: tuple[tuple[str, Constraint], ...] = ()

    def __post_init__(self) -> None:
        names = [p.name for p in self.params]
        if len(set(names)) != len(names):
            raise SearchSpaceError(f"duplicate parameter names in {names}.")
        object.__setattr__(self, "constraints", as_constraints(tuple(self.constraints)))
        object.__setattr__(self, "clamps", _as_clamps(self.clamps, names))
        if self.default is not None:
            default = {k: _freeze(v) for k, v in dict(self.default).items()}
            for k, v in default.items():
                if k not in names:
                    raise SearchSpaceError(
                        f"default= names {k!r}, which is not a declared parameter ({names})."
                    )
                why = self[k].value_problem(v)
                if why:
                    raise SearchSpaceError(f"default {why}.")
            object.__setattr__(self, "default", default)

    @classmethod
    def from_choices(cls, choices: Mapping[str, Sequence[Any]], **kwargs: Any) -> SearchSpace:
        return cls(params=tuple(Param(name=k, choices=v) for k, v in choices.items()), **kwargs)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.params)

    @property
    def size(self) -> int:
        return math.prod(len(p.choices) for p in self.params)

    def __getitem__(self, name: str) -> Param:
        for p in self.params:
            if p.name == name:
                return p
        raise KeyError(name)

    def __contains__(self, config: Mapping[str, Any]) -> bool:
        return not self.config_problems(config)

    def config_problems(self, config: Mapping[str, Any], *, outside_ok: bool = False
                        ) -> list[str]:
        """Why ``config`` is not a config of this space (empty: it is): it must name exactly
        the declared parameters, with values of the declared types that are declared choices
        (any value of those types with ``outside_ok``). Pure Python, no tracing."""
        if not isinstance(config, Mapping):
            return [f"the config is a {type(config).__name__}, not a mapping"]
        names = set(self.names)
        problems = []
        unknown = sorted(str(k) for k in config if k not in names)
        missing = [n for n in self.names if n not in config]
        if unknown:
            problems.append(f"names unknown parameter(s) {unknown} (declared: {list(self.names)})")
        if missing:
            problems.append(f"lacks parameter(s) {missing}")
        for p in self.params:
            if p.name in config:
                why = p.value_problem(config[p.name], outside_ok=outside_ok)
                if why:
                    problems.append(why)
        return problems

    def constraint_problems(self, env: Mapping[str, Any]) -> list[str]:
        """The declared constraints that do not hold for a call's arguments and config, by
        name (``env``: every argument of the call and every tuned parameter)."""
        problems = []
        for c in self.constraints:
            try:
                if c.holds(env):
                    continue
                why = "does not hold"
            except Exception as e:
                why = f"raised {type(e).__name__}: {e}"
            shown = ", ".join(f"{k}={_show(env[k])}" for k in sorted(c.reads or ()) if k in env)
            problems.append(f"constraint {c.name} ({c.describe()}) {why}"
                            + (f" for {shown}" if shown else ""))
        return problems

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """Yields every config as a dict, the first parameter varying slowest."""
        for values in itertools.product(*(p.choices for p in self.params)):
            yield dict(zip(self.names, values, strict=True))

    def ordered_candidates(self) -> Iterator[dict[str, Any]]:
        """Every config, the declared default first, then the rest in product order."""
        if self.default is not None and set(self.default) == set(self.names):
            yield dict(self.default)
            for c in self:
                if c != self.default:
                    yield c
        else:
            yield from self

    def check_function(self, fn: Callable[..., Any]) -> None:
        """Raises :class:`SearchSpaceError` unless every parameter is a keyword-only arg of fn."""
        try:
            sig = inspect.signature(fn)
        except (TypeError, ValueError):
            return  # Builtins and C functions: nothing to check against.
        kwonly = {
            n for n, p in sig.parameters.items() if p.kind is inspect.Parameter.KEYWORD_ONLY
        }
        has_var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in sig.parameters.values())
        where = getattr(fn, "__qualname__", repr(fn))
        for c in self.constraints:
            unknown = sorted((c.reads or set()) - set(sig.parameters))
            if unknown and not has_var_kw:
                raise SearchSpaceError(
                    f"constraint {c.name!r} ({c.describe()}) reads {unknown}, which are not "
                    f"parameters of {where}{sig}; use the names of the signature, e.g. "
                    "x.shape[1] for the second dim of argument x.")
        for p in self.params:
            if p.name in kwonly or has_var_kw:
                continue
            where = getattr(fn, "__qualname__", repr(fn))
            if p.name in sig.parameters:
                raise SearchSpaceError(
                    f"tunable parameter {p.name!r} of {where} is not keyword-only; declare it "
                    f"after a `*` in the signature, e.g. `def f(x, *, {p.name}): ...`."
                )
            raise SearchSpaceError(
                f"tunable parameter {p.name!r} is not a parameter of {where}{sig}; add it as a "
                "keyword-only argument or remove it from the decorator."
            )


class TrialEncoder:
    """Maps configs to and from Optuna trial parameters: every parameter categorical, over its
    choice indices (so any hashable choice works). Calls only ``trial.suggest_categorical``.

    Replayed on the shared measured landscapes (benchmarks/search/search_efficiency.py),
    multivariate TPE over categorical parameters beat log2-ordinal encodings of the power-of-two
    sizes (@50: 0.82 against 0.76 on the convolution space, equal elsewhere).
    """

    def __init__(self, space: SearchSpace):
        self.params = space.params

    def suggest(self, trial: Any) -> dict[str, Any]:
        return {p.name: p.choices[trial.suggest_categorical(p.name, list(range(len(p.choices))))]
                if len(p.choices) > 1 else p.choices[0] for p in self.params}

    @property
    def distributions(self) -> dict[str, Any]:
        """The Optuna distribution of each encoded parameter (those with several choices)."""
        from optuna.distributions import CategoricalDistribution

        return {p.name: CategoricalDistribution(list(range(len(p.choices))))
                for p in self.params if len(p.choices) > 1}

    @property
    def values(self) -> dict[str, tuple[Any, ...]]:
        """What each encoded parameter's choice indices stand for."""
        return {p.name: p.choices for p in self.params if len(p.choices) > 1}

    def encode(self, config: Mapping[str, Any]) -> dict[str, int]:
        return {p.name: p.choices.index(config[p.name]) for p in self.params
                if len(p.choices) > 1}

    def decode(self, params: Mapping[str, int]) -> dict[str, Any]:
        """The config of a stored trial's params (KeyError/IndexError if it is not ours)."""
        return {p.name: p.choices[params[p.name]] if len(p.choices) > 1 else p.choices[0]
                for p in self.params}


def _show(v: Any) -> str:
    shape = getattr(v, "shape", None)
    if shape is not None and hasattr(v, "dtype"):
        return f"{'x'.join(map(str, shape)) or 'scalar'}:{getattr(v.dtype, 'name', v.dtype)}"
    return repr(v)


def _spaces_dir() -> str:
    from importlib import resources

    return str(resources.files("pallas_tune.search_spaces"))


_KERNEL_REF = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*"
                         r":[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _as_clamps(value: Any, names: Sequence[str]) -> tuple[tuple[str, Constraint], ...]:
    """Validates clamps: tuned parameter name → expression (or callable) of the dimension the
    kernel caps it at, e.g. ``{"bm": "x.shape[0]"}``."""
    if not value:
        return ()
    items = list(value.items()) if isinstance(value, Mapping) else list(value)
    out = []
    for item in items:
        if not (isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str)):
            raise SearchSpaceError(f"clamp={value!r} must map tuned parameter names to the "
                                   'dimension each is capped at, e.g. {"bm": "x.shape[0]"}.')
        name, check = item
        if name not in names:
            raise SearchSpaceError(f"clamp names {name!r}, which is not a tuned parameter "
                                   f"({list(names)}).")
        out.append((name, check if isinstance(check, Constraint)
                    else Constraint(name=f"clamp_{name}", check=check)))
    return tuple(sorted(out, key=lambda t: t[0]))


def _is_path(name: str) -> bool:
    """Whether ``--space``/``space=`` text names a file (a path) rather than a shipped space:
    it has a directory separator, starts with ``.`` or ``~``, or ends in ``.toml``."""
    seps = {os.sep, "/"} | ({os.altsep} if os.altsep else set())
    return any(s in name for s in seps) or name.startswith((".", "~")) or name.endswith(".toml")


def shipped_spaces() -> list[str]:
    """The names of the spaces shipped in ``search_spaces/`` (``matmul``, ``llama3_matmul``...)."""
    try:
        names = os.listdir(_spaces_dir())
    except OSError:
        return []
    return sorted(n[: -len(".toml")] for n in names if n.endswith(".toml"))


def space_path(name_or_path: str) -> str:
    """The file a space name or path means. A bare name (``llama3_matmul``) is a shipped space
    and nothing else: a file of that name in the current directory is never read (its
    ``kernel=`` would be imported by whoever runs ``--space NAME`` there); a file is given as
    a path (``./llama3_matmul``, ``dir/x.toml``, ``x.toml``, ``/abs/x.toml``, ``~/x.toml``).

    Raises:
      SearchSpaceError: an unknown name (the known ones listed) or a missing file.
    """
    if _is_path(name_or_path):
        path = os.path.expanduser(name_or_path)
        if not os.path.lexists(path):
            base = os.path.basename(name_or_path)
            stem = base[: -len(".toml")] if base.endswith(".toml") else ""
            hint = (f"; the shipped space is named without the suffix: {stem}"
                    if stem and stem in shipped_spaces() else "")
            raise SearchSpaceError(f"no search-space file {name_or_path!r}: no such file{hint}.")
        return path
    if name_or_path in shipped_spaces():
        return os.path.join(_spaces_dir(), f"{name_or_path}.toml")
    lies = f"a file {name_or_path!r} lies here, but " if os.path.lexists(name_or_path) else ""
    raise SearchSpaceError(
        f"no search-space file {name_or_path!r}: {lies}a bare name is a space shipped in "
        f"{_spaces_dir()} ({', '.join(shipped_spaces()) or 'none'}); to use a file here, "
        f"write ./{name_or_path} (a path: ./NAME, DIR/NAME.toml, NAME.toml or /abs/NAME.toml).")


def load_space(name_or_path: str) -> dict[str, Any]:
    """Loads and validates a search-space file (TOML) shipped in ``search_spaces/`` or at a path.

    A bare name (no directory separator, not starting with ``.`` or ``~``, no ``.toml``
    suffix) is a shipped space only, never a file in the current directory; see
    :func:`space_path`.

    The file holds ``[params]`` (name → list of choices), optionally ``default`` (a table),
    ``[constraints]`` (name → expression, see :mod:`pallas_tune.constraints`), ``[clamp]``
    (name → expression of the dimension the kernel caps it at, see
    :mod:`pallas_tune.effective`), ``fallback = "reference"`` (the kernel's reference is a
    candidate implementation, see ``@tunable(fallback=)``), ``kernel``
    (``"module:attr"``) and ``[[shapes]]`` (argument name → ``"AxB:dtype"`` spec, plus static
    keyword values), used by ``pallas-tune sweep``.

    Loading imports nothing: ``kernel`` names code that the caller (the CLI) imports only after
    the whole file has validated here; treat a space file like any config that names a module.

    Returns:
      A dict with keys ``space`` (a :class:`SearchSpace`), ``kernel`` (str or None), ``shapes``
      (list of dicts) and ``path``.

    Raises:
      SearchSpaceError: the file is missing, not TOML, or any field is malformed.
    """
    path = space_path(name_or_path)
    try:
        raw = _bounded.read_path(path, _settings.max_file_bytes(), what="search-space file")
        data = tomllib.loads(raw.decode("utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError) as e:
        raise SearchSpaceError(f"search-space file {path} is not valid TOML: {e}") from None
    except InputTooLargeError as e:
        raise SearchSpaceError(str(e)) from None
    except OSError as e:
        raise SearchSpaceError(f"cannot read search-space file {path}: {e}") from None
    if "params" not in data or not isinstance(data["params"], dict):
        raise SearchSpaceError(f"search-space file {path} has no [params] table.")
    default = data.get("default")
    if default is not None and not isinstance(default, dict):
        raise SearchSpaceError(f"search-space file {path}: `default` must be a table.")
    constraints = data.get("constraints", {})
    if not isinstance(constraints, dict) or not all(isinstance(v, str)
                                                    for v in constraints.values()):
        raise SearchSpaceError(
            f"search-space file {path}: [constraints] must map names to expression strings, "
            'e.g. bk_divides_k = "x.shape[1] % bk == 0".')
    clamp = data.get("clamp", {})
    if not isinstance(clamp, dict) or not all(isinstance(v, str) for v in clamp.values()):
        raise SearchSpaceError(
            f"search-space file {path}: [clamp] must map tuned parameter names to expression "
            'strings of the dimension each is capped at, e.g. bm = "x.shape[0]".')
    try:
        space = SearchSpace.from_choices(data["params"], default=default,
                                         constraints=as_constraints(constraints), clamps=clamp)
    except SearchSpaceError as e:
        raise SearchSpaceError(f"search-space file {path}: {e}") from None
    fallback = data.get("fallback")
    if fallback not in (None, "reference"):
        raise SearchSpaceError(f"search-space file {path}: fallback = {fallback!r} must be "
                               '"reference" (the kernel\'s reference is a candidate) or absent.')
    kernel = data.get("kernel")
    if kernel is not None and (not isinstance(kernel, str) or not _KERNEL_REF.match(kernel)):
        raise SearchSpaceError(
            f"search-space file {path}: kernel = {kernel!r} is not MODULE:NAME, e.g. "
            '"pallas_tune.kernels.matmul:matmul".')
    shapes = data.get("shapes", [])
    if not isinstance(shapes, list) or not all(
        isinstance(sh, dict) and all(isinstance(k, str) and k.isidentifier() for k in sh)
        for sh in shapes
    ):
        raise SearchSpaceError(
            f"search-space file {path}: `shapes` must be an array of tables of argument names.")
    return {"space": space, "kernel": kernel, "shapes": shapes, "path": path,
            "fallback": fallback}
