"""The upstream-Pallas figures of ``step_tuning.py``: each layer as a MaxText user runs it (XLA
dots and norms, JAX's splash attention at MaxText's block sizes), and with splash's blocks tuned
by pallas-tune (a fair comparison tunes both).

Composed like the other settings: the layer's glue plus each call's figure, where every call but
attention is the all-XLA setting's (MaxText's dots and norms are XLA) and attention is splash's
estimate. libtpu cannot read splash past one block (its mask tables are taken as 0), so splash
is estimated on its stand-in (``kernels/_splash.py``: no tables, one KV head, scaled; checked on
flash attention in ``benchmarks/results/splash_standin.md``, where it leans in splash's favour).

Splash's training cost is its forward plus its backward: the backward adapter's program is
upstream's forward (at the dK/dV blocks) and VJP, so the total is forward(forward blocks) +
adapter(backward blocks) - forward(dK/dV blocks). Every figure is a v6e compiler ESTIMATE.
"""

from __future__ import annotations

import time
from typing import Any

import jax
import jax.numpy as jnp
from pallas_tune.kernels import upstream as adapters

from pallas_tune import keys
from pallas_tune.measure.estimate import Estimator, cycles_to_ms

CLOCK = 1.75e9
MAXTEXT_FWD = {"block_q": 512, "block_kv": 512, "block_kv_compute": 512}
MAXTEXT_BWD = {"block_q_dkv": 512, "block_kv_dkv": 512, "block_kv_dkv_compute": 512,
               "block_q_dq": 512, "block_kv_dq": 512, "use_fused_bwd_kernel": False}

# Per layer: whether the step is jax.grad of it, and attention's (q, k) shapes at T tokens.
LAYERS = {
    "llama_fwd": (False, lambda t: ((1, 32, t, 128), (1, 8, t, 128))),
    "llama_fwd_bwd": (True, lambda t: ((1, 32, t, 128), (1, 8, t, 128))),
    "llama70b_fwd_bwd": (True, lambda t: ((1, 8, t, 128), (1, 1, t, 128))),
    "mixtral_fwd_bwd": (True, lambda t: ((1, 4, t, 128), (1, 1, t, 128))),
}
# MaxText's megablox tiling (its config's tile_batch_seq 512, tile_embed_dim 1024 and
# tile_mlp_dim 1024; clamped to the shape), which its gmm's own VJP passes unchanged to the
# dlhs gmm and to tgmm: MaxText's grouped matmuls, forward and backward.
MAXTEXT_GMM = {"tm": 512, "tk": 1024, "tn": 1024}
MAXTEXT_GMM_BWD = {**MAXTEXT_GMM, "tm_t": 512, "tk_t": 1024, "tn_t": 1024}
GMM = "pallas_tune.kernels.grouped_matmul.grouped_matmul"


def _specs(q_shape, k_shape):
    q = jax.ShapeDtypeStruct(q_shape, jnp.bfloat16)
    k = jax.ShapeDtypeStruct(k_shape, jnp.bfloat16)
    return q, k


def splash_cost(q_shape, k_shape, grad: bool, fwd: dict, bwd: dict | None,
                memory_gb: float) -> dict[str, Any]:
    """Splash's estimated cost (ms) in a step: its forward at ``fwd``, and where ``grad`` its
    backward at ``bwd`` (the adapter's figure less its forward at the dK/dV blocks)."""
    q, k = _specs(q_shape, k_shape)
    out: dict[str, Any] = {"forward_blocks": fwd, "backward_blocks": bwd}
    with Estimator(1, memory_limit_bytes=int(memory_gb * (1 << 30))) as est:
        def ms(kernel, args, config):
            r = est.map(kernel, args, {"causal": True}, [config], "tpu_v6e", standin=True)[0]
            if not r.ok or not r.cycles:
                raise RuntimeError(f"{kernel.name} {config}: {r.message[:300] or r.kind}")
            return cycles_to_ms(r.cycles, CLOCK)

        out["forward_ms"] = ms(adapters.splash_attention, [q, k, k], fwd)
        out["ms"] = out["forward_ms"]
        if grad:
            at_dkv = {"block_q": bwd["block_q_dkv"], "block_kv": bwd["block_kv_dkv"],
                      "block_kv_compute": bwd["block_kv_dkv_compute"]}
            out["adapter_ms"] = ms(adapters.splash_attention_bwd, [q, k, k, q], bwd)
            out["forward_at_dkv_ms"] = (out["forward_ms"] if at_dkv == fwd
                                        else ms(adapters.splash_attention, [q, k, k], at_dkv))
            out["backward_ms"] = out["adapter_ms"] - out["forward_at_dkv_ms"]
            out["ms"] = out["forward_ms"] + out["backward_ms"]
    return out


def megablox_cost(key: str, grad: bool, memory_gb: float) -> dict[str, Any]:
    """MaxText's grouped matmul for one grouped_matmul call (its cache ``key``): JAX's megablox
    gmm at MaxText's tiling, and where ``grad`` its gradient (dlhs gmm and tgmm) at the same
    tiling; each a v6e estimate of its own program (no stand-in: a few hundred grid steps)."""
    spec = {n: jax.ShapeDtypeStruct(shape, jnp.dtype(dtype))
            for n, (_, shape, dtype) in keys.parse_key(key).items()}
    lhs, rhs, sizes = spec["lhs"], spec["rhs"], spec["group_sizes"]
    d = jax.ShapeDtypeStruct((lhs.shape[0], rhs.shape[2]), lhs.dtype)
    out: dict[str, Any] = {"tiling": MAXTEXT_GMM}
    with Estimator(1, memory_limit_bytes=int(memory_gb * (1 << 30))) as est:
        for part, kernel, args, config in (
                ("forward", adapters.megablox_gmm, [lhs, rhs, sizes], MAXTEXT_GMM),
                ("backward", adapters.megablox_gmm_bwd, [lhs, rhs, sizes, d], MAXTEXT_GMM_BWD)):
            if part == "backward" and not grad:
                continue
            r = est.map(kernel, args, {}, [config], "tpu_v6e", standin=False)[0]
            if not r.ok or not r.cycles:
                raise RuntimeError(f"{kernel.name} {config}: {r.message[:300] or r.kind}")
            out[f"{part}_ms"] = cycles_to_ms(r.cycles, CLOCK)
            out[f"{part}_partial"] = bool(r.ops_without_estimate)
    out["ms"] = out["forward_ms"] + out.get("backward_ms", 0.0)
    return out


def mxu_floor_ms(key: str, grad: bool, peak_flops: float) -> float:
    """The least time any implementation of one grouped_matmul call takes on the MXU: its
    2·m·k·n flops (three times that with the gradient's two matmuls) at ``peak_flops``."""
    parts = keys.parse_key(key)
    (m, k), n = parts["lhs"][1], parts["rhs"][1][2]
    return 2 * m * k * n * (3 if grad else 1) / peak_flops * 1e3


def _dkv_forward(bwd: dict) -> dict:
    """The forward config whose program the backward adapter runs first (its dK/dV blocks)."""
    return {"block_q": bwd["block_q_dkv"], "block_kv": bwd["block_kv_dkv"],
            "block_kv_compute": bwd["block_kv_dkv_compute"]}


def recorded_cost(path: str, grad: bool) -> dict[str, Any]:
    """Splash's cost from a ``splash_grid.py`` record (the same stand-in estimates, made
    earlier and kept): the forward of the record's fastest forward config, and where ``grad``
    the backward (adapter less its forward at the dK/dV blocks) of its fastest backward whose
    dK/dV forward the record holds. A record of MaxText's blocks alone gives MaxText's cost."""
    import json

    with open(path, encoding="utf-8") as f:
        records = [r for r in json.load(f) if isinstance(r.get("ms"), float)]
    forwards = {tuple(sorted(r["config"].items())): r["ms"] for r in records
                if r["kind"] == "forward"}
    if not forwards:
        raise RuntimeError(f"{path}: no forward with a figure")
    fwd_key = min(forwards, key=forwards.get)
    out: dict[str, Any] = {"forward_blocks": dict(fwd_key), "forward_ms": forwards[fwd_key],
                           "backward_blocks": None, "recorded": path}
    out["ms"] = out["forward_ms"]
    if grad:
        backs = []
        for r in records:
            at = tuple(sorted(_dkv_forward(r["config"]).items())) if r["kind"].startswith(
                "adapter") else None
            if at in forwards:
                backs.append((r["ms"] - forwards[at], r["config"], r["ms"], forwards[at]))
        if not backs:
            raise RuntimeError(f"{path}: no backward whose dK/dV forward has a figure")
        back, blocks, adapter, at_dkv = min(backs, key=lambda b: b[0])
        out.update(backward_blocks=blocks, adapter_ms=adapter, forward_at_dkv_ms=at_dkv,
                   backward_ms=back, ms=out["forward_ms"] + back)
    return out


def tune_splash(q_shape, k_shape, grad: bool, trials: int, memory_gb: float | None = None
                ) -> dict[str, Any]:
    """Splash's blocks tuned by v6e estimate (on its stand-in), from MaxText's blocks: the
    forward's by ``splash_attention``, the backward's by ``splash_attention_bwd`` (forward +
    VJP); one compile worker, capped at ``memory_gb`` (two beside a step compile starved on this host)."""
    import warnings

    from pallas_tune import chips

    q, k = _specs(q_shape, k_shape)
    opts = {"timer": "tpu-estimate", "chip": "v6e", "trials": trials, "seed": 0, "workers": 1,
            **({"worker_memory_gb": memory_gb} if memory_gb else {})}
    t0 = time.perf_counter()
    out: dict[str, Any] = {"forward": None, "backward": None, "from_cache": []}
    for name, kernel, args, maxtext in (
            ("forward", adapters.splash_attention, [q, k, k], MAXTEXT_FWD),
            ("backward", adapters.splash_attention_bwd, [q, k, k, q], MAXTEXT_BWD)):
        if name == "backward" and not grad:
            continue
        with chips.target("v6e"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            cached = kernel.config_for(*args, causal=True)
        if cached.source == "cache":  # Tuned before (this cache): not again.
            out[name] = dict(cached)
            out["from_cache"].append(name)
        else:
            # MaxText's blocks first: tuned splash is never worse than what MaxText runs.
            out[name] = dict(kernel.tune(*args, causal=True, warm_configs=[maxtext],
                                         **opts).best)
    out["tuning_wall_s"] = round(time.perf_counter() - t0, 1)
    return out


def _attention_index(row: dict) -> int:
    for i, c in enumerate(row["step_detail"]["calls"]):
        if c["kernel"].endswith("flash_attention.flash_attention"):
            return i
    raise ValueError(f"{row['layer']}: no flash_attention call")


def compose(row: dict, splash_ms: float | None, replace: dict[int, float] | None = None
            ) -> tuple[float | None, str]:
    """The layer's upstream figure: the glue, every call at the all-XLA setting's figure (XLA
    dots and norms) but attention, at splash's cost (``splash_ms``; None: XLA's, as in the
    all-XLA setting), and the calls in ``replace`` (call index: ms per occurrence, e.g.
    megablox for a grouped matmul). None where a call has no figure."""
    d = row["step_detail"]
    if "ms" not in d.get("glue", {}) or "xla" not in d:
        return None, "no glue or all-XLA figures to compose with"
    att = _attention_index(row) if splash_ms is not None else None
    replace = replace or {}
    total = d["glue"]["ms"] + (splash_ms or 0.0)
    for i, c in enumerate(d["xla"]["calls"]):
        if i == att or c.get("absorbed"):
            continue  # Attention (and what its XLA form absorbed) is splash's, above.
        if i in replace:
            total += c["live"] * replace[i]
        elif "ms" not in c:
            return None, f"call {i} has no all-XLA figure: {c.get('error', '?')[:120]}"
        else:
            total += c["live"] * c["ms"]
    return total, ""


def _gmm_calls(row: dict) -> list[int]:
    return [i for i, c in enumerate(row["step_detail"]["calls"]) if c["kernel"] == GMM]


def grouped(name: str, row: dict, memory_gb: float) -> dict[str, Any]:
    """For a layer with grouped matmuls: MaxText's megablox cost of each (``megablox``), and
    the all-XLA figure with each grouped matmul at its MXU floor (``xla_floor``: the kernel's
    XLA form is a per-row gather that exceeds v6e HBM, and XLA's own lax.ragged_dot estimates
    below its compute floor, grouped_xla.md, so no XLA figure stands; the glue, attention and
    dots at the all-XLA setting's figures, so a lower bound on the all-XLA layer)."""
    from pallas_tune.chips import chip_spec

    grad = LAYERS[name][0]
    calls = row["step_detail"]["calls"]
    out: dict[str, Any] = {"megablox": {}, "floor": {}}
    for i in _gmm_calls(row):
        out["floor"][i] = mxu_floor_ms(calls[i]["key"], grad, chip_spec("v6e").bf16_flops)
        try:
            out["megablox"][i] = megablox_cost(calls[i]["key"], grad, memory_gb)
        except RuntimeError as e:
            out["megablox"][i] = {"error": str(e)}
    ms, why = compose(row, None, out["floor"])
    out["xla_floor"] = {"ms": ms, "detail": {"error": why} if why else {}}
    return out


def rows(name: str, row: dict, tokens: int, trials: int, memory_gb: float,
         recorded: dict[str, str] | None = None) -> dict[str, Any]:
    """MaxText's and the tuned-splash upstream figures of one composed layer row; ``recorded``:
    {"maxtext" or "tuned": a splash_grid.py record} to compose from instead of estimating."""
    grad, shapes = LAYERS[name]
    q_shape, k_shape = shapes(tokens)
    out: dict[str, Any] = {}
    if "calls" not in row["step_detail"]:  # The glue had no figure: nothing to compose with.
        why = f"no step figures: {row['step_detail'].get('glue', {}).get('error', '?')[:300]}"
        return {k: {"ms": None, "detail": {"error": why}} for k in ("maxtext", "tuned")}
    if "xla" not in row["step_detail"]:  # Before tuning splash (half an hour at 32768 tokens).
        why = ("no all-XLA figures to compose with (the upstream layer is the all-XLA one with "
               "splash's attention): run with --settings xla too")
        return {k: {"ms": None, "detail": {"error": why}} for k in ("maxtext", "tuned")}
    gmm = grouped(name, row, memory_gb) if _gmm_calls(row) else None
    if gmm:
        out["xla_floor"] = gmm["xla_floor"]
        if any("error" in m for m in gmm["megablox"].values()):
            why = "; ".join(m["error"] for m in gmm["megablox"].values() if "error" in m)
            return {**out, **{k: {"ms": None, "detail": {"error": f"megablox: {why}"}}
                              for k in ("maxtext", "tuned")}}
    replace = {i: m["ms"] for i, m in gmm["megablox"].items()} if gmm else {}

    def composed(label: str, cost: dict[str, Any]) -> None:
        ms, why = compose(row, cost["ms"], replace)
        out[label] = {"ms": ms, "splash": cost, "detail": {"error": why} if why else {},
                      **({"megablox": gmm["megablox"]} if gmm else {})}

    if recorded:
        for label, path in recorded.items():
            composed(label, recorded_cost(path, grad))
        return out
    runs = [("maxtext", MAXTEXT_FWD, MAXTEXT_BWD if grad else None)]
    if trials:
        tuned = tune_splash(q_shape, k_shape, grad, trials, memory_gb)
        runs.append(("tuned", tuned["forward"], tuned["backward"]))
    for label, fwd, bwd in runs:
        try:
            cost = splash_cost(q_shape, k_shape, grad, fwd, bwd, memory_gb)
        except RuntimeError as e:
            out[label] = {"ms": None, "detail": {"error": str(e)}}
            continue
        composed(label, cost)
    return out


__all__ = ["LAYERS", "compose", "grouped", "megablox_cost", "mxu_floor_ms", "recorded_cost",
           "rows", "splash_cost", "tune_splash"]
