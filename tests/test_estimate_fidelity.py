"""benchmarks/estimates/estimate_fidelity.py's pure parts, on tiny made-up data: reading
tpu-inference's block-size table, the space per key, the seeded key sample, the stand-in's batch
blocks and the ranking metrics; and, where tpu-inference is installed, that its kernel modules
load without vLLM and that the proxy's quantization computes what the original does."""

from __future__ import annotations

import contextlib
import sys

import pytest
from conftest import estimate_modules

SOURCE = """
from typing import NamedTuple
UNRELATED = {(1, 2): (3, 4)}
TUNED_BLOCK_SIZES_RAW = {
    (6, 16, 1536, 640, 'int8', 'int8'): (16, 768, 640),
    (6, 256, 1536, 640, 'int8', 'int8'): (256, 768, 640),
    (6, 1024, 4096, 4096, 'int8', 'int8'): (512, 1024, 2048),
    (6, 1024, 128, 8192, 'int8', 'int8'): (256, 128, 8192),
    (6, 4096, 128, 8192, 'int8', 'int8'): (2048, 128, 8192),
    (7, 1024, 4096, 4096, 'float8_e4m3fn', 'float8_e4m3fn'): (256, 256, 256),
    (6, 64, 128, 128, 'float8_e4m3fn', 'int8'): (64, 128, 128),
}
TUNED_BLOCK_SIZES = {k: v for k, v in TUNED_BLOCK_SIZES_RAW.items()}
"""


@pytest.fixture(scope="module")
def ef():
    """The benchmark module, taken out of ``sys.modules`` afterwards with the stub
    ``tpu_inference`` modules its import installs (where tpu-inference is installed)."""
    with estimate_modules("estimate_fidelity") as (module,):
        yield module


@pytest.fixture
def table(ef):
    return ef.v6e_int8(ef.parse_table(SOURCE))


def test_the_table_is_read_as_a_literal_and_only_v6e_int8_rows_kept(ef, table):
    raw = ef.parse_table(SOURCE)
    assert len(raw) == 7 and raw[(6, 16, 1536, 640, "int8", "int8")] == (16, 768, 640)
    assert table == {(16, 1536, 640): (16, 768, 640), (256, 1536, 640): (256, 768, 640),
                     (1024, 4096, 4096): (512, 1024, 2048), (1024, 128, 8192): (256, 128, 8192),
                     (4096, 128, 8192): (2048, 128, 8192)}
    with pytest.raises(ValueError, match="TUNED_BLOCK_SIZES_RAW"):
        ef.parse_table("TUNED = {}\n")
    # Executable code in the source is never run, and malformed rows are dropped.
    assert ef.v6e_int8({(6, 16, 128, 128, "int8", "int8"): (0, 128, 128),
                        (6, 16, 128, "x", "int8", "int8"): (16, 128, 128)}) == {}


def test_space_holds_powers_of_two_that_divide_the_winner_and_the_miss_default(ef, table):
    assert ef.batch_floor(table) == 16
    assert ef.batch_floor({(64, 128, 128): (24, 128, 128)}) == 32
    assert ef.block_choices(1536, 128) == [128, 256, 512]
    assert ef.block_choices(640, 128, [640]) == [128, 640]
    key = (256, 1536, 640)
    space = ef.space(key, table)
    assert table[key] in space and ef.MISS_DEFAULT in space
    assert {b for b, _, _ in space} == {16, 32, 64, 128, 256}
    assert {o for _, o, _ in space} == {128, 256, 512, 768}
    assert {i for _, _, i in space} == {128, 640}
    assert len(space) == len(set(space)) == 5 * 4 * 2
    # The wider space: every multiple of 128 dividing the dimension; it holds the first.
    assert ef.block_choices(1536, 128, divisors=True) == [128, 256, 384, 512, 768, 1536]
    wide = ef.space(key, table, divisors=True)
    assert set(space) <= set(wide) and len(wide) == len(set(wide)) == 5 * 6 * 2
    assert {i for _, _, i in wide} == {128, 640}
    # A batch under 128: the miss default pads it, and is added once.
    small = ef.space((16, 1536, 640), table)
    assert small.count(ef.MISS_DEFAULT) == 1 and {b for b, _, _ in small} == {16, 128}


def test_the_standin_keeps_128_steps_and_two_batch_blocks(ef):
    key = (4096, 128, 8192)
    assert ef.grid_steps(key, (256, 128, 128)) == 16 * 1 * 64
    assert ef.standin_batch_blocks(key, (256, 128, 128)) == 2  # 64 steps a block: 2 blocks.
    assert ef.standin_batch_blocks(key, (256, 128, 8192)) == 16  # 1 step a block: all 16.
    assert ef.standin_batch_blocks(key, (4096, 128, 8192)) == 1  # One block: nothing to cut.
    import jax
    import jax.numpy as jnp

    args = ef.operands(key)
    (x, w, s), kwargs, scale = ef.qmm_standin(args, {}, ef.config((256, 128, 128)))
    assert x.shape == (512, 8192) and x.dtype == jnp.bfloat16 and scale == 8.0
    assert (w, s, kwargs) == (args[1], args[2], {})
    assert isinstance(x, jax.ShapeDtypeStruct)


def test_ties_count_against_the_winner_and_the_verdict_compares_with_the_pick_and_default(ef):
    a, b, c, d = (16, 128, 128), (16, 256, 128), (16, 512, 128), ef.MISS_DEFAULT
    # A config level with the winner is counted ahead of it: a figure that tells configs apart
    # no better than that is no evidence for the winner (shared ranks would put it first).
    assert ef.verdict({a: 2.0, b: 1.0, c: 2.0}, winner=a).winner_rank == 3
    assert ef.verdict({a: 1.0, b: 1.0, c: 1.0}, winner=a).winner_rank == 3
    assert ef.verdict({a: 1.0, b: 1.5, c: 2.0}, winner=a).winner_rank == 1
    v = ef.verdict({a: 2.0, b: 1.0, c: 3.0, d: 2.5}, winner=a)
    assert (v.ranked, v.winner_rank, v.pick, v.ratio) == (4, 2, b, 2.0)
    assert not v.pick_is_winner and v.winner_beats_default is True
    won = ef.verdict({a: 1.0, d: 0.5}, winner=a)
    assert won.winner_rank == 2 and won.winner_beats_default is False
    lost = ef.verdict({b: 1.0, c: 3.0}, winner=a)  # The winner got no figure.
    assert lost.winner_rank is None and lost.ratio is None and lost.winner_beats_default is None
    assert ef.verdict({}, winner=a) == ef.KeyVerdict(0, None, None, None, False, None)
    assert ef.verdict({d: 1.0}, winner=d).winner_beats_default is None  # The default won.


def test_summary_counts_top3_ratios_and_the_2_percent_band(ef):
    K = ef.KeyVerdict
    vs = [K(10, 1, (1, 1, 1), 1.0, True, True), K(10, 3, (1, 1, 2), 1.01, False, True),
          K(10, 4, (1, 1, 3), 1.5, False, False), K(10, None, (1, 1, 4), None, False, None)]
    s = ef.summarize(vs)
    assert (s.keys, s.top1, s.top3, s.unranked) == (4, 1, 2, 1)
    assert s.median_ratio == 1.01 and s.worst_ratio == 1.5
    assert s.within_2pct == 2 and (s.beats_default, s.default_compared) == (2, 3)
    pv = ef.pick_vs_winner([((1, 1, 2), v) for v in vs])
    assert pv["in_block"] == (1, 1, 2) and pv["batch_block"] == (0, 4, 0)


def test_the_sample_is_seeded_spread_over_n_batch_and_within_the_budget(ef, table):
    keys = ef.sample_keys(table, 3, seed=1)
    assert keys == ef.sample_keys(table, 3, seed=1) and len(keys) == 3
    assert len({k[0] for k in keys}) == 3  # Three strata of the four n_batch values.
    everything = ef.sample_keys(table, 9, seed=2)
    assert len(everything) == len(set(everything)) == 5  # Only 5 keys exist.
    assert {k[0] for k in everything} == {16, 256, 1024, 4096}
    cheap = ef.sample_keys(table, 4, seed=3, affordable=lambda k: k[0] * k[1] * k[2] < 1 << 30)
    assert cheap and all(k[0] * k[1] * k[2] < 1 << 30 for k in cheap)
    assert (4096, 128, 8192) not in cheap
    # Shapes repeat only where a drawn n_batch has no other (1024 has two, drawn once each).
    two = ef.sample_keys({k: v for k, v in table.items() if k[0] == 1024}, 2, seed=0)
    assert sorted(two) == [(1024, 128, 8192), (1024, 4096, 4096)]
    assert ef.sample_keys(table, 0, seed=0) == [] and ef.sample_keys({}, 3, seed=0) == []


def test_without_tpu_inference_the_benchmark_exits_2(ef, monkeypatch, capsys):
    monkeypatch.setattr(ef, "TPU_INFERENCE_DIR", None)
    assert ef.main(["--dry-run"]) == 2
    assert "tpu-inference is not installed" in capsys.readouterr().err


def _installed(ef):
    if ef.TPU_INFERENCE_DIR is None:
        pytest.skip("tpu-inference is not installed (pip install --no-deps "
                    "tpu-inference==0.32.0): its kernel cannot be loaded")
    return ef.qmm()


def test_tpu_inference_loads_without_vllm_and_its_table_is_read(ef):
    kernel, util, tbs = _installed(ef)
    assert "vllm" not in sys.modules
    assert callable(kernel.quantized_matmul_kernel) and callable(util.quantize_array)
    assert tbs.TunedValue(1, 2, 3).in_block_size == 3
    table = ef.load_table(ef.TPU_INFERENCE_DIR)
    assert table
    for key, win in table.items():
        assert win in ef.space(key, table)


def test_the_proxy_quantizes_like_the_original_and_the_patch_is_undone(ef):
    _, util, _ = _installed(ef)
    import jax
    import jax.numpy as jnp
    import numpy as np

    x = jax.random.normal(jax.random.key(0), (16, 256), jnp.float32).astype(jnp.bfloat16)
    x_abs_max = jnp.max(jnp.abs(x), axis=-1)[None, :]
    q0, s0 = util.quantize_array(x, x_abs_max, jnp.int8)
    original = util.quantize_array
    with ef.proxy_patch():
        assert util.quantize_array is ef.proxy_quantize_array
        q1, s1 = util.quantize_array(x, x_abs_max, jnp.int8)
    assert util.quantize_array is original
    assert q1.dtype == q0.dtype == jnp.int8 and s1.dtype == s0.dtype == jnp.float32
    assert q1.shape == q0.shape and s1.shape == s0.shape == (16, 1)
    np.testing.assert_allclose(np.asarray(s1), np.asarray(s0), rtol=1e-2)
    # The scale's rounding (f32 vs bf16) moves a value by at most one int8 step.
    assert int(jnp.max(jnp.abs(q1.astype(jnp.int32) - q0.astype(jnp.int32)))) <= 1


def test_the_kernel_is_traced_with_the_target_chips_vmem_limit_and_the_lookup_restored(ef):
    # tpu-inference caps its vmem_limit_bytes by the generation's limit, which it reads from
    # jax.devices(): on this CPU host it would find none and allow 96 MiB, where a real v7
    # allows 48 MiB. Traced for a target, the kernel carries that target's limit.
    _, _, tbs = _installed(ef)
    from pallas_tune import chips
    from pallas_tune.feasibility import inspect as _inspect

    key, blocks = (8192, 5120, 8192), (512, 5120, 2048)  # Its formula asks 71 MB (capped).
    args = ef.operands(key, "float8_e4m3fn")

    def limit(chip):
        with (chips.target(chip, abstract_mesh=False) if chip else contextlib.nullcontext()):
            (call,) = _inspect.find_pallas_calls(ef.unmodified_qmm, args, ef.config(blocks))
        return call.vmem_limit_bytes

    original = tbs.get_tpu_version
    seven, six, host = limit("7x"), limit("v6e"), limit(None)
    assert seven == tbs.DEVICE_VMEM_LIMIT[7] == 48 * 2**20
    assert six == host > seven  # v6e's cap is the host's (96 MiB): the formula's stands.
    assert limit("7x") == seven  # Nor is v6e's trace reused for 7x.
    assert tbs.get_tpu_version is original
    # The model refuses on 7x what needs more than its limit (the published v7 winner of this
    # key, (512, 5120, 2048), fits; (256, 5120, 8192) does not).
    calls = ef.accepted_calls(key, [(512, 5120, 2048), (256, 5120, 8192)], "7x",
                              "float8_e4m3fn")
    assert calls[(512, 5120, 2048)] is not None and calls[(256, 5120, 8192)] is None
    assert ef.accepted_calls(key, [(256, 5120, 8192)], "v6e", "float8_e4m3fn")[
        (256, 5120, 8192)] is not None
