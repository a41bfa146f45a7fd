"""How ``pallas-tune sweep`` turns every :class:`pallas_tune.TuneOptions` field into a flag."""

from __future__ import annotations

import argparse
import re
from typing import Any

__all__ = ["add_tune_options", "tune_options"]


# How `pallas-tune sweep` reads each TuneOptions field (its help is the field's documentation).
_OPTION_TYPES: dict[str, Any] = {
    **dict.fromkeys(("trials", "seed", "warm_start", "patience", "max_attempts", "warmup",
                     "repeats", "retime_top", "workers", "compile_workers", "confirm_top"),
                    int),
    **dict.fromkeys(("min_time_s", "max_time_s", "slow_factor", "vreg_limit",
                     "worker_memory_gb"), float),
    **dict.fromkeys(("sampler", "storage", "study_name", "timer", "chip", "feasibility",
                     "estimate_fallback"), str),
    **dict.fromkeys(("isolate", "standin", "write", "xla", "grad", "transfer",
                     "estimate_correction"), bool),
    "timeout_s": "limits",
    "warm_configs": "configs",
}
_OPTION_CHOICES = {"sampler": ("gp", "tpe"), "timer": ("auto", "wallclock", "profiler", "tpu-estimate"),
                   "feasibility": ("auto", "off", "model", "compile"),
                   "estimate_fallback": ("roofline", "model")}
_CLI_ONLY = ("callbacks",)  # Functions: from the API only.
# Fields documented together in TuneOptions get a help text each here.
_CLI_HELP = {
    "storage": "an Optuna storage URL (sqlite:///tune.db, postgresql://user@host/db): the "
               "study is then resumable and may be shared by several hosts; configs and "
               "programs already evaluated there are not evaluated again.",
    "study_name": "the study's name in --storage (default: \"<kernel>|<chip>|<key>|"
                  "kernel=<fingerprint>\"; changed kernel code gets a study of its own): "
                  "runs and hosts with the same name resume and share its trials.",
}


def _plain(text: str) -> str:
    """A docstring's reST as terminal text: ``x`` and :class:`~a.b.X` become x and X."""
    text = re.sub(r":\w+:`~?(?:[\w.]*\.)?([^`]+)`", r"\1", text)
    return re.sub(r"``(.+?)``", r"\1", text)


def add_tune_options(parser: argparse.ArgumentParser) -> None:
    from pallas_tune.tuning.options import TuneOptions

    group = parser.add_argument_group("tuning options (pallas_tune.TuneOptions)")
    for name, text in TuneOptions.help().items():
        if name in _CLI_ONLY:
            continue
        flag = "--" + name.replace("_", "-")
        kind = _OPTION_TYPES[name]
        text = _plain(_CLI_HELP.get(name, text)).replace("%", "%%")
        if kind is bool:
            group.add_argument(flag, action=argparse.BooleanOptionalAction, default=None,
                               help=text)
        elif kind == "configs":
            group.add_argument(flag, type=_configs_arg, default=None, metavar="JSON",
                               help=text + " A JSON object, or a list of them.")
        elif kind == "limits":
            group.add_argument(flag, type=_limits_arg, default=None, metavar="S|PHASE=S,...",
                               help=text)
        else:
            group.add_argument(flag, type=kind, default=None, choices=_OPTION_CHOICES.get(name),
                               help=text)


_EXAMPLE = 'give a config as an object, e.g. \'{"bq": 512, "bkv": 512}\', or a list of them'
_MAX_DEPTH = 8  # A list of configs of (nested) tuples is 4 deep; past 8 it is no config.


def _configs_arg(text: str) -> list[Any]:
    import json

    shown = text if len(text) <= 80 else text[:77] + "..."
    try:
        value = json.loads(text)
        deep = _depth(value) > _MAX_DEPTH
    except RecursionError:  # Deeper than the decoder's stack: deeper than any config.
        deep = True
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"{shown!r} is not JSON ({e}); {_EXAMPLE}") from None
    if deep:
        raise argparse.ArgumentTypeError(
            f"{shown!r} is nested more than {_MAX_DEPTH} deep: no config is; {_EXAMPLE}")
    return [value] if isinstance(value, dict) else value


def _depth(value: Any) -> int:
    """How deep lists and objects nest in a JSON value (a scalar: 0), without recursion."""
    deepest, stack = 0, [(value, 0)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, dict | list):
            deepest = max(deepest, d + 1)
            stack += [(x, d + 1) for x in (v.values() if isinstance(v, dict) else v)]
    return deepest


def _limits_arg(text: str) -> float | dict[str, float]:
    try:
        if "=" not in text:
            return float(text)
        return {k.strip(): float(v) for k, v in (part.split("=") for part in text.split(","))}
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give seconds (e.g. 60) or phase=seconds pairs (e.g. trace=60,run=300)"
        ) from None


def tune_options(args: argparse.Namespace, chip: str | None, *,
                 callbacks: tuple[Any, ...] | None = None, **overrides: Any) -> Any:
    """The ``TuneOptions`` of a sweep's flags (``chip`` None: this host's); ``callbacks``: the
    progress display's (else ``-v`` prints every trial); ``overrides``: options set over the
    flags. Called once per sweep, by the edge (:func:`pallas_tune.cli.edge.sweep_request`)."""
    from pallas_tune.tuning.options import TuneOptions

    given = {n: getattr(args, n) for n in TuneOptions.names()
             if n not in _CLI_ONLY and getattr(args, n, None) is not None}
    given.setdefault("seed", 0)  # Sweeps are reproducible unless told otherwise.
    given["chip"] = chip
    if callbacks is not None:
        given["callbacks"] = callbacks
    elif getattr(args, "verbose", False):
        given["callbacks"] = (_print_trial,)
    return TuneOptions.build(**{**given, **overrides})


def _print_trial(record: Any, progress: Any) -> None:
    del progress  # Unused.
    if record.duplicate_of is not None:
        what = f"same program as trial {record.duplicate_of}"
    elif record.outcome.timed:
        what = f"{record.outcome.value} {record.median_ms:.4g} ms"
    else:
        what = f"{record.outcome.value} ({record.error.splitlines()[0][:120] if record.error else ''})"
    print(f"  [{record.number:3d}] {_fmt_config(record.config)} -> {what}", flush=True)

def _fmt_config(config: Any) -> str:
    if not isinstance(config, dict):
        return repr(config)[:70]
    return " ".join(f"{k}={_fmt_value(v)}" for k, v in config.items())



def _fmt_value(v: Any) -> str:
    if isinstance(v, list | tuple):
        return "(" + ",".join(str(x) for x in v) + ")"
    return str(v)
