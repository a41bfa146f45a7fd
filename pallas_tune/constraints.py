"""Named constraints that relate a kernel's tunable parameters to the shapes of a call.

A constraint is a name and a predicate over the call's arguments by name (array arguments as
objects with ``.shape`` and ``.dtype``, static arguments, and the config)::

    @pt.tunable(bk=[128, 256, 512], ...,
                constraints={"bk_divides_k": "x.shape[1] % bk == 0 or bk >= x.shape[1]"})
    def matmul(x, y, *, bm, bn, bk): ...

The predicate is either a Python callable, called with keyword arguments (declare the ones you
read, plus ``**_``: ``lambda x, bk, **_: x.shape[1] % bk == 0``), or an expression string in a
small language: numbers, strings, names of the kernel's arguments, ``.shape``/``.ndim``/
``.dtype``/``.itemsize``/``.size``/``.name``, indexing, arithmetic, comparisons, ``and``/``or``/
``not``, ``x if c else y`` and ``min``/``max``/``abs``/``len``. Expressions are data, not code:
they are parsed when declared (a typo fails then, not at the first call) and evaluated by a
walker that can do nothing else, so search-space files may carry them (``[constraints]``).

Pure Python: nothing here imports jax.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import operator
from collections.abc import Callable, Mapping
from typing import Any, Final

from pallas_tune.errors import SearchSpaceError

__all__ = ["Constraint", "as_constraints", "config_admits"]

_ATTRS: Final = frozenset({"shape", "ndim", "dtype", "itemsize", "size", "name"})
_FUNCS: Final[dict[str, Callable[..., Any]]] = {"min": min, "max": max, "abs": abs, "len": len}
_BINOPS: Final = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul,
                  ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod,
                  ast.Div: operator.truediv, ast.Pow: operator.pow}
_CMPOPS: Final = {ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt,
                  ast.LtE: operator.le, ast.Gt: operator.gt, ast.GtE: operator.ge,
                  ast.In: lambda a, b: a in b, ast.NotIn: lambda a, b: a not in b}
_NODES: Final = (ast.Expression, ast.BoolOp, ast.And, ast.Or, ast.UnaryOp, ast.Not, ast.USub,
                  ast.UAdd, ast.BinOp, ast.Compare, ast.IfExp, ast.Subscript, ast.Tuple, ast.List,
                  ast.Load, ast.Slice, *_BINOPS, *_CMPOPS)
_MAX_EXPR_CHARS: Final = 1000
_MAX_ITEMS: Final = 10_000  # The longest string, tuple or list a repetition may make.
_MAX_INT_BITS: Final = 2**16  # The largest whole number arithmetic may make.


def _check_tree(node: ast.AST, text: str) -> set[str]:
    """Raises SearchSpaceError for anything outside the expression language; returns the
    argument names the expression reads."""
    names: set[str] = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name):
            if n.id not in _FUNCS:
                names.add(n.id)
        elif isinstance(n, ast.Attribute):
            if n.attr not in _ATTRS:
                raise SearchSpaceError(
                    f"constraint {text!r} reads `.{n.attr}`; expressions may read only "
                    f"{sorted(_ATTRS)}.")
        elif isinstance(n, ast.Call):
            if not (isinstance(n.func, ast.Name) and n.func.id in _FUNCS) or n.keywords:
                raise SearchSpaceError(
                    f"constraint {text!r} calls {ast.unparse(n.func)}; expressions may call "
                    f"only {sorted(_FUNCS)}, with positional arguments.")
        elif isinstance(n, ast.Constant):
            if not isinstance(n.value, int | float | str | bool | type(None)):
                raise SearchSpaceError(f"constraint {text!r} holds the constant {n.value!r}.")
        elif isinstance(n, ast.BinOp) and type(n.op) not in _BINOPS:
            raise SearchSpaceError(f"constraint {text!r} uses an operator outside "
                                   "+ - * / // % **.")
        elif isinstance(n, ast.Compare) and not all(type(o) in _CMPOPS for o in n.ops):
            raise SearchSpaceError(f"constraint {text!r} uses `is`; compare with == or !=.")
        elif not isinstance(n, _NODES):
            raise SearchSpaceError(
                f"constraint {text!r} uses {type(n).__name__}, which constraint expressions "
                "do not allow (see pallas_tune.constraints).")
    return names


def _check_binop(op: ast.operator, a: Any, b: Any) -> None:
    """Raises ValueError for an operation whose result could be huge: a power of a big base or
    exponent, a string, tuple or list repeated past ``_MAX_ITEMS``, %-formatting of a string."""
    if isinstance(op, ast.Pow) and (abs(b) > 64 or abs(a) > 2**64):
        raise ValueError(f"{a} ** {b} is out of range for a constraint")
    if isinstance(op, ast.Mult):
        for seq, times in ((a, b), (b, a)):
            if isinstance(seq, str | tuple | list) and isinstance(times, int) and (
                    len(seq) * times > _MAX_ITEMS):
                raise ValueError(f"repeating {len(seq)} items {times} times is out of range "
                                 f"for a constraint (too long: over {_MAX_ITEMS})")
    if isinstance(op, ast.Mod) and isinstance(a, str | bytes):
        raise ValueError("%-formatting a string is not allowed in a constraint")


def _eval(n: ast.AST, env: Mapping[str, Any]) -> Any:
    if isinstance(n, ast.Expression):
        return _eval(n.body, env)
    if isinstance(n, ast.Constant):
        return n.value
    if isinstance(n, ast.Name):
        if n.id in env:
            return env[n.id]
        if n.id in _FUNCS:
            return _FUNCS[n.id]
        raise NameError(f"no argument named {n.id!r}")
    if isinstance(n, ast.Attribute):
        return getattr(_eval(n.value, env), n.attr)
    if isinstance(n, ast.Subscript):
        return _eval(n.value, env)[_eval(n.slice, env)]
    if isinstance(n, ast.Slice):
        return slice(*(None if p is None else _eval(p, env) for p in (n.lower, n.upper, n.step)))
    if isinstance(n, ast.Tuple | ast.List):
        return tuple(_eval(e, env) for e in n.elts)
    if isinstance(n, ast.BoolOp):
        value = None
        for e in n.values:
            value = _eval(e, env)
            if isinstance(n.op, ast.And) != bool(value):
                return value
        return value
    if isinstance(n, ast.UnaryOp):
        v = _eval(n.operand, env)
        return not v if isinstance(n.op, ast.Not) else (-v if isinstance(n.op, ast.USub) else +v)
    if isinstance(n, ast.BinOp):
        a, b = _eval(n.left, env), _eval(n.right, env)
        _check_binop(n.op, a, b)
        out = _BINOPS[type(n.op)](a, b)
        if isinstance(out, int) and out.bit_length() > _MAX_INT_BITS:
            raise ValueError(f"a result of {out.bit_length()} bits is out of range for a "
                             "constraint")
        return out
    if isinstance(n, ast.Compare):
        left = _eval(n.left, env)
        for op, comp in zip(n.ops, n.comparators, strict=True):
            right = _eval(comp, env)
            if not _CMPOPS[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(n, ast.IfExp):
        return _eval(n.body, env) if _eval(n.test, env) else _eval(n.orelse, env)
    if isinstance(n, ast.Call):
        return _eval(n.func, env)(*(_eval(a, env) for a in n.args))
    raise TypeError(f"cannot evaluate {type(n).__name__}")  # Unreachable after _check_tree.


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class Constraint:
    """A named predicate that a config must satisfy for a call's arguments.

    Args:
      name: an identifier naming the rule in messages (``"bk_divides_k"``).
      check: an expression string (see the module docstring) or a callable taking the call's
        arguments and config as keywords; a true result means the config may run.
    """

    name: str
    check: str | Callable[..., Any]
    _tree: ast.Expression | None = dataclasses.field(default=None, repr=False, compare=False)
    _reads: frozenset[str] | None = dataclasses.field(default=None, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name.isidentifier():
            raise SearchSpaceError(
                f"constraint name {self.name!r} is not an identifier; name each constraint, "
                'e.g. constraints={"bk_divides_k": "x.shape[1] % bk == 0"}.')
        if isinstance(self.check, str):
            text = self.check.strip()
            if not text or len(text) > _MAX_EXPR_CHARS:
                raise SearchSpaceError(
                    f"constraint {self.name!r} is empty or longer than {_MAX_EXPR_CHARS} chars.")
            try:
                tree = ast.parse(text, mode="eval")
            except SyntaxError as e:
                raise SearchSpaceError(
                    f"constraint {self.name!r} = {text!r} is not an expression: {e.msg}."
                ) from None
            reads = _check_tree(tree, text)
        elif callable(self.check):
            tree, reads = None, _callable_reads(self.name, self.check)
        else:
            raise SearchSpaceError(
                f"constraint {self.name!r} is {self.check!r}; give an expression string or a "
                "callable.")
        object.__setattr__(self, "_tree", tree)
        object.__setattr__(self, "_reads", reads)

    @property
    def reads(self) -> frozenset[str] | None:
        """The argument names the predicate reads (None: any, a callable taking ``**kwargs``
        only)."""
        return self._reads

    def describe(self) -> str:
        if isinstance(self.check, str):
            return self.check.strip()
        return getattr(self.check, "__qualname__", repr(self.check))

    def holds(self, env: Mapping[str, Any]) -> bool:
        """Evaluates the predicate on the call's arguments and config, by name. Raises whatever
        the predicate raises (the caller turns it into a violation)."""
        return bool(self.value(env))


    def value(self, env: Mapping[str, Any]) -> Any:
        """The expression's value (not made a bool): clamps use it for the dimension a
        parameter is capped at. Raises whatever the expression raises."""
        if self._tree is not None:
            return _eval(self._tree, env)
        fn = self.check
        assert callable(fn)
        if self._reads is None:
            return fn(**env)
        return fn(**{k: env[k] for k in self._reads if k in env})


def _callable_reads(name: str, fn: Callable[..., Any]) -> frozenset[str] | None:
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    reads = set()
    for p in sig.parameters.values():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            return None
        if p.kind in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.VAR_POSITIONAL):
            raise SearchSpaceError(
                f"constraint {name!r}: {fn!r} takes positional-only arguments; it is called with "
                "the call's arguments by keyword, e.g. lambda x, bk, **_: x.shape[1] % bk == 0.")
        reads.add(p.name)
    return frozenset(reads)


def as_constraints(value: Any) -> tuple[Constraint, ...]:
    """Normalises ``constraints=``: a mapping name → expression or callable, or a sequence of
    :class:`Constraint`. Raises SearchSpaceError for anything else or a duplicate name."""
    if value is None:
        return ()
    if isinstance(value, Mapping):
        out = [Constraint(name=k, check=v) for k, v in value.items()]
    elif isinstance(value, list | tuple) and all(isinstance(c, Constraint) for c in value):
        out = list(value)
    else:
        raise SearchSpaceError(
            f"constraints={value!r} must map names to expressions or callables, e.g. "
            '{"bk_divides_k": "x.shape[1] % bk == 0"}, or be a list of Constraint.')
    names = [c.name for c in out]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise SearchSpaceError(f"constraints named more than once: {dup}.")
    return tuple(out)


def config_admits(constraints: tuple[Constraint, ...], config: Mapping[str, Any]) -> bool:
    """Whether every constraint that reads only ``config``'s own names holds for it: a rule
    between tuned parameters (``not fused or bq_dq == 128``), which samplers and warm starts
    apply to their candidates before any is proposed. Constraints that read a call's arguments
    are not judged here, nor one that raises (the call's own check records why)."""
    for c in constraints:
        reads = c.reads
        if reads is None or not reads <= config.keys():
            continue
        try:
            if not c.holds(config):
                return False
        except Exception:  # noqa: BLE001 - left to the call's check, which says why.
            continue
    return True

