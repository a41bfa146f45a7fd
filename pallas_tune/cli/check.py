"""``pallas-tune check`` (validate cache files, for a library's CI) and ``pallas-tune merge``
(combine the cache files several hosts wrote). Neither ever changes an input file."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from pallas_tune.cli.registry import KernelRegistry, add_import_option
from pallas_tune.cli.shapes import CLIUsageError

if TYPE_CHECKING:
    from pallas_tune.cli.edge import CheckRequest, MergeRequest

__all__ = ["add_parsers", "cmd_check", "cmd_merge", "root_problem"]


def add_parsers(sub: Any) -> None:
    c = sub.add_parser("check", help="validate cache files (exit 1 on a problem)")
    c.add_argument("paths", nargs="*", metavar="PATH",
                   help="cache roots, chip directories or winners files (default: the user "
                        "cache)")
    c.add_argument("--path", action="append", metavar="DIR",
                   help="also import the kernels files name from DIR, to check configs against "
                        "them (repeatable)")
    add_import_option(c, "configs are checked against the shipped kernels and those of --import "
                         "modules, --path directories or declared entry points; a file naming "
                         "any other kernel is a problem (exit 1), never an import")
    c.add_argument("--no-kernels", action="store_true",
                   help="check the files' format only, importing no kernel (their configs are "
                        "then not checked against their kernels' spaces)")
    c.add_argument("--fail-stale", action="store_true",
                   help="count entries tuned on other code of their kernel (stale kernel "
                        "fingerprint) as problems, not notes")
    c.add_argument("--space", action="append", metavar="NAME",
                   help="also check that the cache holds an entry for every shape of this "
                        "shipped space (or a file given as a path: ./NAME, DIR/NAME.toml) on "
                        "--chip (repeatable); a shape without one is a problem, named with the "
                        "sweep command that fills it")
    c.add_argument("--chip", help="the chip whose entries --space looks for (e.g. v6e)")
    c.set_defaults(func=cmd_check)
    m = sub.add_parser("merge", help="merge cache files written by several hosts into one cache")
    m.add_argument("inputs", nargs="+", metavar="FILE", help="winners files (<chip>/<kernel>.json)")
    m.add_argument("--into", metavar="ROOT",
                   help="the cache root to merge into (default: the user cache; made if "
                        "missing), or one winners file in a cache root "
                        "(ROOT/<chip>/<kernel>.json): then only the entries that belong in it")
    m.set_defaults(func=cmd_merge)


MAX_ENTRIES = 10_000  # Directory entries looked at under one path given to check or merge.
_LAYOUT = "DIR/*.json and DIR/<chip>/*.json"


def _winners_files(paths: list[str]) -> list[tuple[str, str]]:
    """(path, chip directory name) of every winners or side file under ``paths``: whatever lies
    under such a name (a directory, a link to nothing) is checked, as a call meets it. A
    directory given is a cache root or a chip directory: only ``DIR/*.json`` and
    ``DIR/<chip>/*.json`` are looked at, never deeper, no directory link is followed, and more
    than :data:`MAX_ENTRIES` entries under one path is a CLIUsageError (``check /`` does not
    walk the disk). Listed whole before any file is read."""
    out = []
    for p in paths:
        if os.path.isfile(p) or os.path.islink(p):
            out.append((p, os.path.basename(os.path.dirname(os.path.abspath(p)))))
            continue
        if not os.path.isdir(p):
            raise CLIUsageError(f"{p}: not a regular file nor a directory" if os.path.exists(p)
                                else f"{p}: no such file or directory")
        budget = [MAX_ENTRIES]
        for entry in _entries(p, p, budget):
            if _is_named(entry.name):
                out.append((entry.path, os.path.basename(os.path.abspath(p))))
            elif not entry.name.startswith((".", "_")) and _is_dir(entry):
                out += [(e.path, entry.name) for e in _entries(entry.path, p, budget)
                        if _is_named(e.name)]
    return out


def _entries(d: str, given: str, budget: list[int]) -> list[os.DirEntry[str]]:
    """The entries of ``d`` (none if it cannot be listed), by name; ``budget`` counts them."""
    found = []
    try:
        with os.scandir(d) as it:
            for entry in it:
                budget[0] -= 1
                if budget[0] < 0:
                    raise CLIUsageError(
                        f"{given}: more than {MAX_ENTRIES:,} directory entries under it, the "
                        f"most pallas-tune looks at (it looks at {_LAYOUT} only); is it a cache? "
                        "Give a cache root, a chip directory or the files")
                found.append(entry)
    except OSError:
        return []
    return sorted(found, key=lambda e: e.name)


def _is_dir(entry: os.DirEntry[str]) -> bool:
    try:
        return entry.is_dir(follow_symlinks=False)
    except OSError:
        return False


def _is_named(name: str) -> bool:
    """Whether a name is a winners or side file's (a directory so named is checked as one)."""
    from pallas_tune.cache import names

    return _is_winners(names.classify(name))


def _is_winners(role_kind: tuple[str, str] | None) -> bool:
    return role_kind is not None and role_kind[0] != "ledger"


def _read(path: str, *, as_named: bool = True) -> tuple[Any, str | None]:
    """(the file as a call would serve from it, None) or (None, why no call would). With
    ``as_named=False``, any readable winners file, whatever its name (what merge takes: its
    header says where its entries go)."""
    from pallas_tune.cache import reader
    from pallas_tune.errors import CacheFormatError

    try:
        return (reader.read_named(path) if as_named else reader.read(path)), None
    except (OSError, CacheFormatError) as e:
        return None, str(e)


def _space_kernels(request: CheckRequest) -> list[Any]:
    """The kernels the ``--space`` files name (a file that cannot be read is left to
    :func:`_coverage`, which says why)."""
    from pallas_tune.cli.registry import load_kernel
    from pallas_tune.errors import SearchSpaceError
    from pallas_tune.space import load_space

    out = []
    for name in request.spaces:
        try:
            ref = load_space(name)["kernel"]
        except SearchSpaceError:
            continue
        if ref:
            out.append(load_kernel(ref, request.paths))
    return out


def _kernel_of(wf: Any, registry: KernelRegistry) -> tuple[Any, str | None]:
    """(the kernel the file's entries are checked against, None) or (None, why there is none
    here and how to allow one)."""
    name = wf.header.get("kernel")
    if not isinstance(name, str):
        return None, ('its header names no kernel: add `"kernel": NAME`, or pass --no-kernels '
                      "to check the file format only")
    return registry.find(name)


def _call_problems(kernel: Any, key: str, config: Any) -> list[str]:
    """Why a call of ``kernel`` at ``key``'s shapes refuses ``config``, traced as a call does.
    Raises CLIUsageError when ``key`` is not a shape spec of the kernel."""
    from pallas_tune.cli.shapes import build_call

    args, kwargs = build_call(kernel, key)
    return kernel.violations(config, args, kwargs)  # type: ignore[no-any-return]


def _merge_call_problems(kernel: Any, key: str, config: Any) -> list[str]:
    try:
        return _call_problems(kernel, key, config)
    except CLIUsageError:  # A key that names no shapes (a key= function's): not traced.
        return []


def _check_entries(wf: Any, kernel: Any, path: str) -> list[str]:
    from pallas_tune.cache.entries import entry_problem

    problems = []
    for key, value, problem in wf.items():
        problem = problem or entry_problem(value)
        if problem is None and kernel is not None:
            found = kernel.entry_problems(value)
            if not found:
                try:
                    found = _call_problems(kernel, key, value["config"])
                except CLIUsageError as e:
                    found = [f"key is not a shape spec of {kernel.name} ({e})"]
            problem = "; ".join(found) or None
        if problem is not None:
            problems.append(f"{path}: entry {key!r}: {problem}")
    return problems


def _fingerprints(wf: Any, kernel: Any, path: str, counts: dict[str, int]
                  ) -> tuple[list[str], list[str]]:
    """(malformed fingerprint problems, stale entry lines); ``counts`` gets each entry's
    state (current, stale, unknown, unchecked: the kernel's own fingerprint is unknown)."""
    from pallas_tune import _kernel_hash

    current = kernel.fingerprint if kernel is not None else None
    malformed, stale = [], []
    for key, value, problem in wf.items():
        if problem is not None or not isinstance(value, dict):
            continue
        recorded, bad = _kernel_hash.recorded(value.get("provenance"))
        if bad is not None:
            malformed.append(f"{path}: entry {key!r}: {bad}")
        state = "unchecked" if recorded is not None and current is None else \
            _kernel_hash.kernel_state(recorded, kernel)
        counts[state] = counts.get(state, 0) + 1
        if state == "stale":
            stale.append(f"{path}: entry {key!r}: stale: tuned on kernel {recorded}, now "
                         f"{current}; re-tune it (pallas-tune sweep re-tunes stale entries)")
    return malformed, stale


def root_problem(root: str) -> str | None:
    """Why the user cache directory cannot hold a cache (it is a file), or None."""
    if os.path.lexists(root) and not os.path.isdir(root):
        return (f"the cache directory {root} is not a directory (a file?), left as it is; "
                "point PALLAS_TUNE_CACHE_DIR at a directory")
    return None


def cmd_check(request: CheckRequest) -> int:
    from pallas_tune import chips
    from pallas_tune.cache import default_cache

    paths = list(request.roots) or [default_cache().user_root]
    if not request.roots and root_problem(paths[0]):
        print(f"problem: {root_problem(paths[0])}")
        return 1
    registry = None if request.no_kernels else KernelRegistry(request.imports, request.paths)
    if registry is not None:
        for kernel in _space_kernels(request):  # Named by the user's --space files: allowed.
            registry.allow(kernel)
    problems: list[str] = []
    notes: list[str] = []
    n_files = n_entries = 0
    stale: list[str] = []
    states: dict[str, int] = {}
    for path, chip_dir in _winners_files(paths):
        n_files += 1
        if chips.normalize_chip(chip_dir) != chip_dir:
            problems.append(f"{path}: chip directory {chip_dir!r} is not a normalized chip name;"
                            f" rename it to {chips.normalize_chip(chip_dir)!r}")
        wf, error = _read(path)
        if wf is None:
            problems.append(f"{path}: not served: {error}")
            continue
        problems += [f"{path}: {d}" for d in wf.damage]
        kernel = None
        if registry is not None:
            kernel, why = _kernel_of(wf, registry)
            if why is not None:  # A file not fully checked is never OK.
                problems.append(f"{path}: its configs were checked against the file format "
                                f"only: {why}")
        n_entries += len(wf.keys())
        problems += _check_entries(wf, kernel, path)
        malformed, stale_here = _fingerprints(wf, kernel, path, states)
        problems += malformed
        stale += stale_here
    summaries = _coverage(request, problems, stale)
    if request.fail_stale:
        problems += stale
    else:
        notes += stale
    for line in notes:
        print(f"note: {line}")
    for line in problems:
        print(f"problem: {line}")
    for line in summaries:
        print(line)
    if not n_files:
        print(f"pallas-tune check: no cache files under {', '.join(paths)} (it looks at "
              f"{_LAYOUT}: give a cache root, a chip directory or the files)", file=sys.stderr)
        return 1
    verdict = "OK" if not problems else f"{len(problems)} problem(s)"
    if request.no_kernels:
        verdict += " (file format only: --no-kernels)"
    code = ", ".join(f"{states[s]} {s}" for s in ("current", "stale", "unknown", "unchecked")
                     if states.get(s))
    code = f" (kernel code: {code})" if code else ""
    print(f"pallas-tune check: {n_files} file(s), {n_entries} entries{code}: {verdict}")
    return 1 if problems else 0


def _coverage(request: CheckRequest, problems: list[str], stale: list[str]) -> list[str]:
    """--space: a problem per shape without an entry; stale entries join ``stale``. (The edge
    refused --space without --chip.)"""
    if not request.spaces:
        return []
    from pallas_tune.cli.coverage import space_coverage

    summaries = []
    for cov in space_coverage(request.spaces, request.chip, request.roots, request.paths):
        problems += [f"{cov.space}: no {cov.chip} entry for {key!r}; tune it: {cmd}"
                     for key, cmd in cov.missing]
        said = {line.partition(": stale")[0] for line in stale}  # Found by the file walk too.
        stale += [line for line in cov.stale if line.partition(": stale")[0] not in said]
        summaries.append(cov.summary())
    return summaries


def cmd_merge(request: MergeRequest) -> int:
    """Per (chip, kernel, kind, key), the fastest entry of the inputs and the target that a
    call would serve wins (:mod:`pallas_tune.cache.merge`); written with the cache's atomic
    merge (inputs are only read). Every input entry is counted: written, skipped (with its
    reason) or not faster."""
    from pallas_tune import chips
    from pallas_tune.cache import TuningCache, declared, default_cache, merge

    cache = TuningCache(request.into) if request.into else default_cache()
    registry = KernelRegistry()  # Shipped kernels and entry points: their spaces judge configs.
    groups: dict[tuple[str, str, str], dict[str, dict[str, Any]]] = {}
    sources: dict[tuple[str, str, str, str], str] = {}  # The file each kept entry came from.
    skips: dict[str, int] = {}  # Why, and how many.
    slower, unchecked = 0, set()
    for path, chip_dir in _winners_files(list(request.inputs)):
        wf, error = _read(path, as_named=False)
        fault = merge.file_fault(wf.header) if wf is not None else None
        if wf is None or fault is not None:
            print(f"pallas-tune merge: skipped {path}: {error or fault}", file=sys.stderr)
            why = fault.reason if fault is not None else "file unreadable"
            skips[why] = skips.get(why, 0) + 1
            continue
        kernel, kind = wf.header["kernel"], wf.header.get("kind", "measured")
        chip = chips.normalize_chip(str(wf.header.get("chip") or chip_dir))
        found = registry.find(kernel)[0]
        kernels = [found] if found is not None else None  # None: those declared here.
        if found is None and not declared.kernels_named(kernel) and kernel not in unchecked:
            unchecked.add(kernel)
            print(f"pallas-tune merge: note: {kernel} is neither a pallas-tune kernel nor a "
                  "declared entry point, so its entries' configs were checked for format only, "
                  "not against its space", file=sys.stderr)
        target = groups.setdefault((chip, kernel, kind), {})
        for damage in wf.damage:
            print(f"pallas-tune merge: {path}: {damage}", file=sys.stderr)
        for key, value, problem in wf.items():
            fault = merge.input_fault(kernel, key, value, problem, kernels=kernels,
                                      call_problems=_merge_call_problems)
            if fault is not None:
                print(f"pallas-tune merge: skipped {path}, key {key!r}: {fault}",
                      file=sys.stderr)
                skips[fault.reason] = skips.get(fault.reason, 0) + 1
                continue
            if not merge.better(target.get(key), value):
                slower += 1
                continue
            slower += key in target
            target[key] = dict(value)
            sources[(chip, kernel, kind, key)] = path
    written = 0
    if request.into_file is not None:
        groups = _only_into_file(cache, groups, request.into_file)
    for (chip, kernel, kind), entries in groups.items():
        keep = {}
        found = registry.find(kernel)[0]
        for key, entry in entries.items():
            there = merge.current(cache, chip, kernel, kind, key,
                                  kernels=[found] if found is not None else None,
                                  call_problems=_merge_call_problems)
            if merge.better(there, entry):
                keep[key] = _with_history(entry, sources[(chip, kernel, kind, key)], kernel,
                                          kind, key)
            else:
                slower += 1
        if keep:
            path = cache.write_many(chip, kernel, keep, kind=kind)
            written += len(keep)
            print(f"merged {len(keep)} entries of {kernel} on {chip} into {path}")
    print(f"pallas-tune merge: {merge.summary(written, skips, slower)}")
    return 1 if skips and not written else 0


def _only_into_file(cache: Any, groups: dict[tuple[str, str, str], dict[str, Any]],
                    into_file: str) -> dict[tuple[str, str, str], dict[str, Any]]:
    """``--into FILE``: the groups whose entries belong in FILE (the winners file of their
    chip, kernel and kind under the cache root FILE lies in); each other group is named, with
    where its entries belong. Raises CLIUsageError, before anything is written, where none
    belongs in FILE."""
    root = os.path.dirname(os.path.dirname(into_file))
    kept, elsewhere = {}, []
    for (chip, kernel, kind), entries in groups.items():
        target = os.path.abspath(cache.path(chip, kernel, kind=kind))
        if target == into_file:
            kept[(chip, kernel, kind)] = entries
        else:
            elsewhere.append(f"{len(entries)} {kind} entries of {kernel} on {chip} belong in "
                             f"{target}")
    if not kept:
        raise CLIUsageError(
            f"--into {into_file}: no input entry belongs in that file "
            f"({'; '.join(elsewhere) or 'no valid entries'}). --into takes a cache root, the "
            "directory whose <chip>/<kernel>.json files the entries go to (made if missing), "
            f"e.g. --into {root}; or the winners file itself, "
            "ROOT/<chip>/<kernel>[.estimate].json, to merge only the entries that belong in it")
    for line in elsewhere:
        print(f"pallas-tune merge: not merged: {line}, not in {into_file} (--into {root} "
              "merges them too)", file=sys.stderr)
    return kept


def _with_history(entry: dict[str, Any], path: str, kernel: str, kind: str, key: str
                  ) -> dict[str, Any]:
    """The entry with its trials and full provenance from the ledger beside the file it came
    from (the run that chose its config), so the merged cache's ledger has them too: reports
    and ``show --trials`` on a merged cache show the evidence, not nothing."""
    from pallas_tune.cache import ledger, names

    beside = os.path.join(os.path.dirname(path),
                          names.ledger_name(names.kernel_filename(kernel), kind))
    try:
        records, _ = ledger.read(beside, key=key)
    except OSError:
        return entry
    for record in reversed(records):
        if record.get("config") == entry.get("config") and isinstance(record.get("trials"),
                                                                      list):
            prov = record.get("provenance")
            return {**entry, "trials": record["trials"],
                    **({"provenance": prov} if isinstance(prov, dict) else {})}
    return entry

