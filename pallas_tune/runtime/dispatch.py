"""The slow path of the trace-time lookup, and the one validity check every config goes through.

Resolution order for a call whose tuned keywords are not all given (the first config that passes
:func:`check` for the call's arguments wins):

1. the exact cache entries for (chip, kernel, key): measured before estimates, the user's cache
   directory before the caches shipped in the package. An entry must name exactly the kernel's
   parameters, with values of the declared types, inside the declared space (or marked
   ``"outside_space": true``); a refused entry is skipped with one warning naming the file, the
   key and the reason;
2. ``PALLAS_TUNE_MODE=strict`` raises :class:`CacheMissError`; ``=tune`` tunes now and caches;
3. the winners of the nearest tuned shapes (by key distance; at most three distinct configs are
   traced, whatever the cache's size), then those of keys with the call's shapes and other
   static values (fewest differing first);
4. the declared ``default=``;
5. the fastest valid config of the space by the roofline cost model
   (:func:`pallas_tune.feasibility.roofline.roofline_calls`; a model, not a measurement).

An entry tuned on other code of the kernel (its recorded ``kernel_fingerprint`` is not the
kernel's :attr:`~pallas_tune.runtime.tunable.TunableKernel.fingerprint`) still serves when
valid for the call, with one warning per (kernel, key); entries that record none serve silently.

On a TPU chip, what steps 3 to 5 would serve also passes the VMEM model
(:func:`fallback_problems`): such a config was never compiled for this call, and one the model
puts over the chip's VMEM is refused for the next (the shipped ``rms_norm_bwd`` default of 256
rows does not fit v6e at 8192 columns). Exact cache entries were compiled when tuned.

Steps 3 to 5 warn once per (kernel, chip, fallback), naming the config used, why the others were
refused and the command that tunes the shape; later shapes served the same way are not warned. The result is memoized per (chip, key) by the kernel.
"""

from __future__ import annotations

import inspect
import itertools
import shlex
from collections.abc import Mapping, Sequence
from typing import Any, Final

from pallas_tune import _settings, keys
from pallas_tune.cache import Hit
from pallas_tune.errors import CacheMissError, InvalidConfig, NoFeasibleConfigError
from pallas_tune.runtime.declare import Declared
from pallas_tune.space import Config, _freeze

__all__ = ["check", "entry_problems", "resolve"]

NEAREST_TRACES: Final = 3  # Distinct neighbour configs traced on a miss, at most.
MODEL_SCAN_LIMIT: Final = 256  # Candidates the cost-model fallback traces, at most.


def _frozen(config: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _freeze(v) for k, v in config.items()}


def check(kernel: Declared, config: Mapping[str, Any], args: Sequence[Any],
          kwargs: Mapping[str, Any]) -> tuple[list[str], list[Any] | None]:
    """Why ``config`` cannot run for these arguments (empty: it can), and the traced
    ``pallas_call``\\ s when it was traced. In order, stopping at the first that fails: the
    parameter names and value types, the kernel's declared constraints, tracing
    (:class:`InvalidConfig` and any tracing error), the TPU block rules."""
    problems = declared_problems(kernel, config, args, kwargs)
    if problems:
        return problems, None
    config = _frozen(config)
    from pallas_tune.feasibility import inspect as _inspect

    try:
        calls = _inspect.find_pallas_calls(kernel.fn, args, {**kwargs, **config})
    except InvalidConfig as e:
        return [f"the kernel refused it: {e}"], None
    except Exception as e:
        return [f"tracing failed: {type(e).__name__}: {e}"], None
    return _inspect.block_rule_violations(calls), calls


def fallback_problems(kernel: Declared, chip: str, config: Mapping[str, Any],
                      args: Sequence[Any], kwargs: Mapping[str, Any]) -> list[str]:
    """:func:`check`, and for a TPU chip the VMEM model's verdict: a config served on a cache
    miss (nearest shape, default, model) was never compiled for this call, so one the model
    puts over the chip's VMEM, or at its limit (uncertain, its estimate above it), is refused
    before it reaches the compiler (an exact cache entry was compiled when it was tuned)."""
    problems, calls = check(kernel, config, args, kwargs)
    return problems or vmem_problems(calls, chip)


def vmem_problems(calls: Sequence[Any] | None, chip: str) -> list[str]:
    """Why the feasibility model says these traced calls do not fit ``chip``'s VMEM (empty:
    they fit, the model is unsure but its estimate is under the limit, or the chip is no TPU)."""
    from pallas_tune.chips import chip_spec

    try:
        spec = chip_spec(chip)
    except ValueError:
        return []
    if not calls or spec is None or spec.platform != "tpu":
        return []
    from pallas_tune.feasibility.model import model_verdict

    verdict = model_verdict(calls, spec)
    if verdict.ok:
        return []
    return [f"the VMEM model puts it out of {spec.name}'s VMEM ({verdict.status}: "
            f"{verdict.reason})"]


def declared_problems(kernel: Declared, config: Mapping[str, Any], args: Sequence[Any],
                      kwargs: Mapping[str, Any]) -> list[str]:
    """The part of :func:`check` that needs no trace: parameter names and value types, then the
    kernel's declared constraints for these arguments (empty: none refuses it)."""
    problems = kernel.space.config_problems(config, outside_ok=True)
    if problems or not kernel.space.constraints:
        return problems
    config = _frozen(config)
    try:
        bound = kernel.signature.bind(*args, **kwargs, **config)
    except TypeError as e:
        return [f"the arguments do not fit {kernel.name}{kernel.signature}: {e}"]
    bound.apply_defaults()
    env = dict(bound.arguments)
    for name, p in kernel.signature.parameters.items():
        if p.kind is inspect.Parameter.VAR_KEYWORD:
            env.update(env.pop(name, {}))
    return kernel.space.constraint_problems(env)


def entry_problems(kernel: Declared, entry: Mapping[str, Any]) -> list[str]:
    """Why a well-formed cache entry cannot be this kernel's (names, types, declared space);
    empty if it can. No tracing: :func:`check` then decides for a call's shapes."""
    outside = entry.get("outside_space") is True
    return kernel.space.config_problems(_frozen(entry["config"]), outside_ok=outside)


def _vet(kernel: Declared, hit: Hit, args: Sequence[Any], kwargs: Mapping[str, Any]
         ) -> tuple[dict[str, Any] | None, str | None]:
    if hit.problem is not None:
        return None, hit.problem
    assert hit.entry is not None
    problems = entry_problems(kernel, hit.entry)
    if problems:
        return None, "; ".join(problems)
    config = _frozen(hit.entry["config"])
    problems, _ = check(kernel, config, args, kwargs)
    if problems:
        return None, f"invalid for this call: {problems[0]}"
    return config, None


def resolve(kernel: Declared, chip: str, key: str, args: Sequence[Any],
            kwargs: Mapping[str, Any]) -> Config:
    """The config for a call whose key is ``key`` (see the module docstring for the order)."""
    cache = kernel.cache
    refused = []
    for hit in cache.lookup_all(chip, kernel.name, key):
        config, why = _vet(kernel, hit, args, kwargs)
        if config is not None:
            _check_fingerprint(kernel, key, hit)
            xla = hit.entry.get("implementation") == "xla" and kernel.reference is not None
            return Config(config, source="cache", origin=hit.path,
                          implementation="xla" if xla else "pallas")
        cache.report(hit.path, key, why or "", fix=f"Re-tune it with: {tune_hint(kernel, key)}")
        refused.append(f"{hit.path}: {why}")
    mode = _settings.mode()
    if mode == "strict":
        was = f" Cache entries for it were refused: {'; '.join(refused)}." if refused else ""
        raise CacheMissError(
            f"PALLAS_TUNE_MODE=strict: no usable tuned config of kernel {kernel.name!r} on chip "
            f"{chip!r} for key {key!r} (looked in {cache.roots()}).{was} Fill it with:\n"
            f"  {tune_hint(kernel, key)}\n"
            "or unset PALLAS_TUNE_MODE to run on a fallback config."
        )
    if mode == "tune":
        from pallas_tune.errors import warn

        # This call waits for a whole tuning run: say so before it starts, not after.
        warn(f"pallas-tune: PALLAS_TUNE_MODE=tune: tuning {kernel.name!r} for {key!r} on "
             f"{chip!r} now; this call waits for it (unset PALLAS_TUNE_MODE, or tune ahead "
             f"with: {tune_hint(kernel, key)})")
        result = kernel._tune_from_trace(args, kwargs)
        return Config(result.best, source="tuned", origin=key,
                      implementation=result.implementation)
    notes: list[str] = []
    found = _nearest(kernel, chip, key, args, kwargs, notes)
    if found is None:
        found = _default_or_model(kernel, chip, key, args, kwargs, notes)
    head = f"pallas-tune: no tuned config of {kernel.name!r} on {chip!r} for {key!r}"
    if found.source == "nearest":
        what = (f"using that of the nearest tuned shape {found.origin!r}: "
                f"{found.to_dict()}")
    elif found.source == "default":
        what = f"using the default {found.to_dict()}"
    else:
        what = (f"using {found.to_dict()}, the fastest of {found.origin} by the roofline cost "
                "model (a model, not a measurement)")
    refusals = f" Refused first: {'; '.join(notes)}." if notes else ""
    if kernel.name.startswith("__main__."):  # Defined with no file: an interactive session.
        refusals += (f" The kernel is named {kernel.name!r} after a session with no file; "
                     "other processes name theirs otherwise: give @tunable(name=\"mylib.kernel\")"
                     " to share cache entries.")
    kernel._warn_once(key, f"{head}; {what}.{refusals} Tune this shape with: "
                           f"{tune_hint(kernel, key)}", topic=f"miss:{found.source}")
    return found


def _check_fingerprint(kernel: Declared, key: str, hit: Hit) -> None:
    """Warns (once per kernel and key) when a served entry was tuned on other code of the
    kernel, or records a malformed fingerprint (then unknown). Never raises."""
    from pallas_tune import _kernel_hash

    recorded, problem = _kernel_hash.recorded((hit.entry or {}).get("provenance"))
    if problem is not None:
        kernel._warn_once(key, f"pallas-tune: the cache entry {key!r} of {kernel.name!r} in "
                               f"{hit.path}: {problem}. It still serves; the file was left as "
                               "it is.", topic="fingerprint")
        return
    if recorded is None:
        return  # Tuned before fingerprints were recorded: unknown, as before.
    current = kernel.fingerprint
    if _kernel_hash.kernel_state(recorded, kernel) != "stale":
        return
    kernel._warn_once(key, (
        f"pallas-tune: the cached config of {kernel.name!r} for {key!r} ({hit.path}) was tuned "
        f"on other code of the kernel (kernel fingerprint {recorded}, now {current}); it is "
        "still used, as it is valid for this call, but may no longer be the fastest. Re-tune "
        f"it with: {tune_hint(kernel, key)} (a sweep re-tunes such entries; or, to re-tune "
        "every shape of a space file: pallas-tune sweep --space NAME)"), topic="stale")


def _nearest(kernel: Declared, chip: str, key: str, args: Sequence[Any],
             kwargs: Mapping[str, Any], notes: list[str]) -> Config | None:
    if kernel.key_fn is not None:
        return None  # Custom keys have no notion of distance.
    tried: set[tuple[Any, ...]] = set()
    for _, hit in kernel.cache.neighbours(chip, kernel.name, key):
        if hit.problem is not None or entry_problems(kernel, hit.entry or {}):
            continue
        config = _frozen(hit.entry["config"])  # type: ignore[index]
        marker = tuple(sorted(config.items()))
        if marker in tried:
            continue
        if len(tried) >= NEAREST_TRACES:
            break
        tried.add(marker)
        problems = fallback_problems(kernel, chip, config, args, kwargs)
        if not problems:
            return Config(config, source="nearest", origin=hit.key)
        notes.append(f"the config of the tuned shape {hit.key!r} {config} ({problems[0]})")
    return _same_shapes(kernel, chip, key, args, kwargs, notes, tried)


def _same_shapes(kernel: Declared, chip: str, key: str, args: Sequence[Any],
                 kwargs: Mapping[str, Any], notes: list[str], tried: set[tuple[Any, ...]]
                 ) -> Config | None:
    """The entry of a key with the call's shapes but other static values (fewest differing
    statics first): a miss on a static value (``alpha=3`` tuned, ``alpha=4`` called) reuses the
    tiles tuned for the same arrays. Scans the kernel's keys once per missed key (slow path)."""
    arrays, statics = keys.split_statics(key)
    if not statics:
        return None
    ranked = []
    for other, entry, path in kernel.cache.entries(chip, kernel.name):
        o_arrays, o_statics = keys.split_statics(other)
        if o_arrays == arrays and o_statics.keys() == statics.keys() and other != key:
            differ = sum(o_statics[n] != v for n, v in statics.items())
            ranked.append((differ, other, entry))
    for _, other, entry in sorted(ranked, key=lambda t: t[:2]):
        if len(tried) >= NEAREST_TRACES:
            break
        if entry_problems(kernel, entry):
            continue
        config = _frozen(entry["config"])
        marker = tuple(sorted(config.items()))
        if marker in tried:
            continue
        tried.add(marker)
        problems = fallback_problems(kernel, chip, config, args, kwargs)
        if not problems:
            return Config(config, source="nearest", origin=other)
        notes.append(f"the config of the tuned key {other!r} {config} ({problems[0]})")
    return None


def _default_or_model(kernel: Declared, chip: str, key: str, args: Sequence[Any],
                      kwargs: Mapping[str, Any], notes: list[str]) -> Config:
    default = kernel.space.default
    complete = default is not None and set(default) == set(kernel.space.names)
    if complete:
        problems = fallback_problems(kernel, chip, default, args, kwargs)  # type: ignore[arg-type]
        if not problems:
            return Config(default, source="default")  # type: ignore[arg-type]
        notes.append(f"the declared default {dict(default)} ({problems[0]})")  # type: ignore[arg-type]
    from pallas_tune.feasibility.roofline import roofline_calls

    spec = _cost_spec(chip)
    best: tuple[float, int, dict[str, Any]] | None = None
    valid = scanned = 0
    first_problem = ""
    distinct: set[str] = set()
    for i, candidate in enumerate(itertools.islice(kernel.space.ordered_candidates(),
                                                   MODEL_SCAN_LIMIT)):
        if complete and i == 0:
            continue  # The default, refused above.
        scanned += 1
        problems, calls = check(kernel, candidate, args, kwargs)
        problems = problems or vmem_problems(calls, chip)
        if problems:
            first_problem = first_problem or problems[0]
            distinct.add(problems[0])
            continue
        valid += 1
        cost = roofline_calls(calls, spec).time_s if calls else 0.0
        if best is None or (cost, i) < best[:2]:
            best = (cost, i, candidate)
    if best is None and scanned > 1 and len(distinct) == 1:
        raise NoFeasibleConfigError(
            f"no config of {kernel.name!r} can run {key!r}: all {scanned + complete} candidates "
            f"tried were refused for the same reason, so the call's arguments are the problem, "
            f"not the space: {first_problem}. Call it with arguments the kernel accepts."
        )
    if best is None:
        raise NoFeasibleConfigError(
            f"no config of {kernel.name!r} is valid for {key!r}: the first "
            f"{scanned + complete} candidates of the space were refused (first problem: "
            f"{first_problem or (notes[0] if notes else '?')}). Add choices that fit these "
            "shapes to the declared space, or pass the tuned keywords explicitly."
        )
    return Config(best[2], source="model", origin=f"{valid} valid configs of {scanned + complete}")


def _cost_spec(chip: str) -> Any:
    from pallas_tune.chips import chip_spec

    try:
        spec = chip_spec(chip)
    except ValueError:
        spec = None
    if spec is None or spec.platform != "tpu":
        spec = chip_spec("tpu_v6e")  # Interpret mode and other hosts rank as for a TPU.
    return spec


def tune_hint(kernel: Declared, key: str) -> str:
    """The command that tunes ``key`` (or the call to make, for kernels no CLI can import)."""
    import sys

    fn = kernel.fn
    module, qualname = getattr(fn, "__module__", ""), getattr(fn, "__qualname__", "")
    obj: Any = sys.modules.get(module) if module != "__main__" else None
    for part in qualname.split("."):
        obj = getattr(obj, part, None)
    if kernel.key_fn is None and obj is kernel:
        root = _path_needed(module)
        path = f" --path {shlex.quote(root)}" if root else ""
        shapes = shlex.quote(key) if "'" in key else f"'{key}'"
        return f"pallas-tune sweep {module}:{qualname}{path} --shapes {shapes}"
    return f"{kernel.name}.tune(...) with these arguments"


def _path_needed(module: str) -> str | None:
    """The directory ``pallas-tune sweep --path`` needs to import ``module``, or None when a
    console script finds it as it is (installed, or an editable install's finder). A script
    run as ``python script.py`` sees its own directory and the working directory, which
    ``pallas-tune`` does not."""
    import importlib.machinery
    import os
    import sys

    top = module.split(".")[0]
    for finder in sys.meta_path:
        if finder is importlib.machinery.PathFinder or not hasattr(finder, "find_spec"):
            continue
        if finder in (importlib.machinery.BuiltinImporter, importlib.machinery.FrozenImporter):
            continue
        try:
            if finder.find_spec(top, None) is not None:
                return None  # An editable install's (or another) finder: found anywhere.
        except Exception:  # noqa: BLE001, S112  A broken finder: try the others.
            continue
    local = {"", os.getcwd(), os.path.dirname(os.path.abspath(sys.argv[0] or "."))}
    seen = [p for p in sys.path if p not in local and os.path.abspath(p or ".") not in local]
    if importlib.machinery.PathFinder.find_spec(top, seen) is not None:
        return None
    spec = getattr(sys.modules.get(top), "__spec__", None)
    origin = getattr(spec, "origin", None)
    if not origin:
        return None
    parent = os.path.dirname(origin)
    return os.path.dirname(parent) if os.path.basename(origin) == "__init__.py" else parent
