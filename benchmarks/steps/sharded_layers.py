"""The sharded layers ``sharded_step.py`` compiles: Llama-3.1 decoder layers written once per
chip over ops (``layers.Ops``), put on an 8-chip mesh by ``jax.shard_map`` in two layouts, with
their collectives; and the three settings' ops (all-XLA, upstream Pallas, pallas-tune).

Layouts (one mesh axis "x" of 8 chips):
- ``tp8`` (Megatron): one sequence of T tokens, replicated; the fused QKV and the MLP's gate and
  up split by columns (each chip's QKV columns hold its 1/8 of the query heads and of the KV
  heads), the O and down projections by rows; an all-reduce (``psum``) after each of the two,
  and in the backward one before each norm (the transpose of the replicated input's use).
- ``fsdp``: 8 sequences of T tokens, one per chip; every matrix split by rows and all-gathered
  before its use (its gradient reduce-scattered: the all-gather's transpose); the norms'
  weights replicated (their gradients all-reduced).

Each chip's program is ``chip_layer``: for Llama-3.1-8B under FSDP it is ``layers.llama8b`` at
T tokens, for Llama-3.1-70B under TP8 ``layers.llama70b_tp8`` (the shapes of
``step_tuning.md``'s single-chip rows, so its figures are this layer's per-chip figures).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from steps import layers

AXIS = "x"
CHIPS = 8
TOPOLOGY = "v6e:2x4"
BF = jnp.bfloat16


@dataclasses.dataclass(frozen=True)
class Model:
    name: str
    d: int
    q_heads: int
    kv_heads: int
    mlp: int
    fused_gate_up: bool  # One (d, 2*mlp) matrix (70B, as layers.llama70b_tp8) or two.


MODELS = {"8b": Model("Llama-3.1-8B", 4096, 32, 8, 14336, False),
          "70b": Model("Llama-3.1-70B", 8192, 64, 8, 28672, True)}


def chip_layer(x, n1, wqkv, wo, n2, *mlp, q_heads: int, kv_heads: int, ops: layers.Ops,
               reduce: Callable[[Any], Any]):
    """One chip's decoder layer on x (T, d): ``reduce`` after the O and down projections (an
    all-reduce under TP8, nothing under FSDP); ``mlp`` is (wg, wu, wd) or (wgu, wd)."""
    t, nq = x.shape[0], q_heads * 128
    qkv = ops.mm(ops.norm(x, n1, eps=1e-5), wqkv)
    q = layers._rope(layers._heads(qkv, t, 0, q_heads)[0])[None]
    k = layers._rope(layers._heads(qkv, t, nq, kv_heads)[0])[None]
    v = layers._heads(qkv, t, nq + kv_heads * 128, kv_heads)
    x = x + reduce(ops.mm(ops.attn(q, k, v)[0].transpose(1, 0, 2).reshape(t, nq), wo))
    h = ops.norm(x, n2, eps=1e-5)
    if len(mlp) == 2:
        gu = ops.mm(h, mlp[0])
        f = gu.shape[1] // 2
        act = jax.nn.silu(gu[:, :f]) * gu[:, f:]
    else:
        act = jax.nn.silu(ops.mm(h, mlp[0])) * ops.mm(h, mlp[1])
    return x + reduce(ops.mm(act, mlp[-1]))


def weight_shapes(m: Model) -> list[tuple[int, ...]]:
    """The global weights: n1, wqkv, wo, n2, then (wg, wu, wd) or (wgu, wd)."""
    qkv = (m.q_heads + 2 * m.kv_heads) * 128
    mlp = [(m.d, 2 * m.mlp)] if m.fused_gate_up else [(m.d, m.mlp), (m.d, m.mlp)]
    return [(m.d,), (m.d, qkv), (m.q_heads * 128, m.d), (m.d,), *mlp, (m.mlp, m.d)]


def specs(m: Model, layout: str) -> list[P]:
    """Each argument's PartitionSpec (x first, then the weights as ``weight_shapes``)."""
    cols, rows, rep = P(None, AXIS), P(AXIS, None), P()
    n_up = 1 if m.fused_gate_up else 2
    if layout == "tp8":
        return [rep, rep, cols, rows, rep, *[cols] * n_up, rows]
    if layout == "fsdp":
        return [P(AXIS, None, None), rep, rows, rows, rep, *[rows] * n_up, rows]
    raise ValueError(f"layout {layout!r}: choose tp8 or fsdp")


def global_args(m: Model, layout: str, tokens: int, mesh: Any) -> list[jax.ShapeDtypeStruct]:
    """The step's global arguments, each with its NamedSharding on ``mesh``."""
    x = (tokens, m.d) if layout == "tp8" else (CHIPS, tokens, m.d)
    return [jax.ShapeDtypeStruct(s, BF, sharding=NamedSharding(mesh, spec))
            for s, spec in zip([x, *weight_shapes(m)], specs(m, layout), strict=True)]


def chip_args(m: Model, layout: str, tokens: int) -> list[jax.ShapeDtypeStruct]:
    """One chip's arguments as ``chip_layer`` sees them (FSDP's weights gathered)."""
    out = [jax.ShapeDtypeStruct((tokens, m.d), BF)]
    for shape, spec in zip(weight_shapes(m), specs(m, layout)[1:], strict=True):
        if layout == "tp8" and len(spec) == 2:
            shape = tuple(n // CHIPS if s == AXIS else n for n, s in zip(shape, spec,
                                                                         strict=True))
        out.append(jax.ShapeDtypeStruct(shape, BF))
    return out


def _per_chip(m: Model, layout: str, ops: layers.Ops):
    """The body shard_map runs on each chip: its collectives around ``chip_layer``."""
    heads = {"q_heads": m.q_heads, "kv_heads": m.kv_heads}
    if layout == "tp8":
        heads = {k: v // CHIPS for k, v in heads.items()}

        def body(x, *w):
            return chip_layer(x, *w, ops=ops, reduce=lambda y: jax.lax.psum(y, AXIS), **heads)
        return body

    def body(x, n1, wqkv, wo, n2, *mlp):
        gather = functools.partial(jax.lax.all_gather, axis_name=AXIS, axis=0, tiled=True)
        out = chip_layer(x[0], n1, gather(wqkv), gather(wo), n2, *map(gather, mlp), ops=ops,
                         reduce=lambda y: y, **heads)
        return out[None]
    return body


def sharded_train(m: Model, layout: str, ops: layers.Ops, mesh: Any) -> Callable[..., Any]:
    """jax.grad of the sharded layer's output sum over its input and every weight: the
    layer under ``jax.shard_map`` (check_vma on, its default) on ``mesh``."""
    sp = specs(m, layout)
    layer = jax.shard_map(_per_chip(m, layout, ops), mesh=mesh, in_specs=tuple(sp),
                          out_specs=sp[0])

    def step(*a):
        return jax.value_and_grad(lambda *b: layer(*b).astype(jnp.float32).sum(),
                                  argnums=tuple(range(len(a))))(*a)
    return step


def chip_train(m: Model, layout: str, ops: layers.Ops) -> Callable[..., Any]:
    """The same step's per-chip program alone (no collective): for a single-chip compile."""
    heads = {"q_heads": m.q_heads, "kv_heads": m.kv_heads}
    if layout == "tp8":
        heads = {k: v // CHIPS for k, v in heads.items()}
    layer = functools.partial(chip_layer, ops=ops, reduce=lambda y: y, **heads)

    def step(*a):
        return jax.value_and_grad(lambda *b: layer(*b).astype(jnp.float32).sum(),
                                  argnums=tuple(range(len(a))))(*a)
    return step


# MaxText's splash blocks (upstream.py's: 512 throughout, two backward kernels).
def _maxtext_hook(kernel: Any, args: Any, kwargs: Any) -> Any:
    from steps import upstream

    from pallas_tune.config import Config

    blocks = {"jax.ops.tpu.splash_attention": upstream.MAXTEXT_FWD,
              "jax.ops.tpu.splash_attention_bwd": upstream.MAXTEXT_BWD}.get(kernel.name)
    return Config(blocks, source="explicit") if blocks is not None else None


def setting(name: str) -> tuple[layers.Ops, Any]:
    """A setting's ops and the context (a resolution hook, or none) to trace it in:
    ``xla``: every kernel's XLA reference; ``upstream``: XLA's dots and norms, JAX's splash
    attention at MaxText's blocks (through pallas-tune's adapter, its configs forced);
    ``tuned``: pallas-tune's kernels at their cached configs (defaults where none)."""
    import contextlib

    from pallas_tune.kernels import upstream as adapters
    from pallas_tune.runtime.tunable import resolution_hook
    from pallas_tune.step import figures

    if name == "xla":
        return layers.Ops(), figures.settings(None)["xla"]
    if name == "upstream":
        ctx = contextlib.ExitStack()
        ctx.enter_context(figures.settings(None)["xla"])  # Dots and norms (outer hook).
        ctx.enter_context(resolution_hook(_maxtext_hook))  # Splash: MaxText's blocks.
        return layers.Ops(attn=lambda q, k, v: adapters.splash_attention(q, k, v, causal=True)
                          ), ctx
    if name == "tuned":
        return layers.Ops(), contextlib.nullcontext()
    raise ValueError(f"setting {name!r}: choose xla, upstream or tuned")


__all__ = ["AXIS", "CHIPS", "MODELS", "TOPOLOGY", "Model", "chip_args", "chip_layer",
           "chip_train", "global_args", "setting", "sharded_train", "specs", "weight_shapes"]
