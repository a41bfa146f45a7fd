"""benchmarks/estimates/xla_footing.py's pure parts on made-up data: pairing Tokamax's cache
files, the footing's constants, and the decision rule scored against the chip's direction."""

from __future__ import annotations

import json
import os
import sys
import zipfile

import pytest

BENCHMARKS = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir, "benchmarks",
                          "estimates")


@pytest.fixture(scope="module")
def xf():
    sys.path.insert(0, BENCHMARKS)
    try:
        import xla_footing

        yield xla_footing
    finally:
        sys.path.remove(BENCHMARKS)


def _key(q, causal=True, **more):
    d = {"q": q, "k": q, "v": q, "bias": None, "logits_soft_cap": None, "paging_info": None,
         "return_residuals": False, "mask": {"is_causal": causal}, **more}
    return json.dumps(d)


def _wheel(tmp_path, xla, pallas):
    path = tmp_path / "tokamax-0.0.12-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("tokamax/data/autotuning/tpu7x/dot_product_attention.json", json.dumps(xla))
        z.writestr("tokamax/data/autotuning/tpu7x/pallas_mosaic_tpu_flash_attention.json",
                   json.dumps(pallas))
    return str(path)


def test_pairs_only_plain_attention_with_both_times(xf, tmp_path):
    times = {"evaluation_times_ms": [2.0, 1.0, 3.0]}
    plain, biased = _key("bf16[2,1024,8,128]"), _key("bf16[2,1024,8,128]", bias="x")
    xla = {plain: {"{}": times}, biased: {"{}": times},
           _key("bf16[2,512,8,128]", causal=False): {"{}": times}}
    pallas = {plain: {'{"block_q":512}': {"evaluation_times_ms": [0.5, 0.4, 0.6]},
                      '{"block_q":1024}': {"evaluation_times_ms": [0.9]}},
              biased: {"{}": times}}
    keys = xf.paired_keys(xf.tokamax_files(_wheel(tmp_path, xla, pallas)))
    assert keys == [{"batch": 2, "seq": 1024, "heads": 8, "head_dim": 128, "causal": True,
                     "xla_real_ms": 2.0, "pallas_real_ms": 0.5,
                     "pallas_real_config": {"block_q": 512}}]


def _row(xla_real, pallas_real, model, pallas_est, libtpu=0.1):
    return {"xla_real_ms": xla_real, "pallas_real_ms": pallas_real, "xla_model_ms": model,
            "pallas_ms": pallas_est, "xla_libtpu_ms": libtpu}


def test_footing_constants_and_margin(xf):
    rows = [_row(2.0, 1.0, 2.0, 0.5), _row(4.0, 1.0, 4.0, 0.5), _row(1.0, 1.0, 1.2, 0.5)]
    f = xf.footing(rows)
    assert f["pallas_bias"] == 0.5 and f["xla_model_bias"] == 1.0
    # Relative biases 2, 2, 2.4: the last strays 1.2x from the median; rounded up to 0.05.
    assert f["margin"] == 1.2


def test_decisions_score_the_chip_s_direction(xf):
    rows = [_row(2.0, 1.0, 2.0, 0.5),  # Pallas 2x faster on the chip.
            _row(1.0, 1.05, 1.0, 0.5),  # A tie (within 10%): either decision agrees.
            _row(0.5, 1.0, 0.5, 0.5)]   # XLA 2x faster on the chip.
    assert xf.decisions(rows, "xla_model_ms", relative=2.0, margin=1.0) == (3, 0, 3)
    # The raw partial libtpu sum (0.1) puts XLA ahead everywhere: wrong where Pallas wins.
    assert xf.decisions(rows, "xla_libtpu_ms", relative=1.0, margin=1.0) == (2, 1, 3)
