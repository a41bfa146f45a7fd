"""`pallas-tune sweep` end to end on every shipped kernel, on the CPU (interpret mode)."""

import json

import pytest

from pallas_tune import cli

CASES = [
    ("pallas_tune.kernels.matmul:matmul", "x=256x256:float32,y=256x256:float32"),
    ("pallas_tune.kernels.flash_attention:flash_attention",
     "q=1x2x256x128:float32,k=1x1x256x128:float32,v=1x1x256x128:float32,causal=true"),
    ("pallas_tune.kernels.rms_norm:rms_norm", "x=64x256:float32,weight=256:float32"),
    ("pallas_tune.kernels.linear_attention:linear_attention",
     "q=1x1x256x128:float32,k=1x1x256x128:float32,v=1x1x256x128:float32,decay=0.9"),
    ("pallas_tune.kernels.quantized_matmul:quantized_matmul",
     "x=100x384:bfloat16,w_q=384x300:int8,w_scale=300:float32,quantize_x=true"),
    ("pallas_tune.kernels.quantized_matmul:quantized_matmul",
     "x=16x256:bfloat16,w_q=256x512:float8_e4m3fn,w_scale=512:float32"),
    ("pallas_tune.kernels.quantized_grouped_matmul:quantized_grouped_matmul",
     "lhs=300x256:bfloat16,rhs_q=4x256x384:int8,rhs_scale=4x384:float32,group_sizes=4:int32"),
    ("pallas_tune.kernels.grouped_matmul:grouped_matmul",
     "lhs=512x256:float32,rhs=4x256x256:float32,group_sizes=4:int32"),
    ("pallas_tune.kernels.upstream:flash_attention",
     "q=1x1x256x128:float32,k=1x1x256x128:float32,v=1x1x256x128:float32"),
    ("pallas_tune.kernels.upstream:splash_attention",
     "q=1x1x256x128:float32,k=1x1x256x128:float32,v=1x1x256x128:float32,causal=true"),
    ("pallas_tune.kernels.upstream:megablox_gmm",
     "lhs=512x256:float32,rhs=4x256x256:float32,group_sizes=4:int32"),
]


@pytest.mark.parametrize("kernel,shapes", CASES, ids=[c[0].split(":")[1] + "@" + c[0].split(".")[-1].split(":")[0] for c in CASES])
def test_sweep_runs_end_to_end(cache_dir, capsys, kernel, shapes):
    rc = cli.main(["sweep", kernel, "--shapes", shapes, "--trials", "3", "--repeats", "1"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "best {" in out, out
    files = list(cache_dir.glob("cpu/*.json"))
    assert len(files) == 1
    (key,) = json.loads(files[0].read_text())["entries"]
    # The trials live in the ledger beside the winners file (issue 14).
    (record,) = [json.loads(line) for line in open(str(files[0])[:-5] + ".trials.jsonl")]
    assert record["key"] == key and any(t["outcome"] == "ok" for t in record["trials"])


def test_every_tuning_option_is_a_sweep_flag():
    from pallas_tune.tuning import TuneOptions

    parser = cli.build_parser()
    sweep = parser._subparsers._group_actions[0].choices["sweep"]  # noqa: SLF001
    flags = {opt for action in sweep._actions for opt in action.option_strings}  # noqa: SLF001
    missing = [n for n in TuneOptions.names()
               if n != "callbacks" and "--" + n.replace("_", "-") not in flags]
    assert not missing
    args = parser.parse_args(["sweep", "k:f", "--timeout-s", "trace=5,run=9", "--no-write",
                              "--slow-factor", "3", "--isolate"])
    opts = cli._tune_options(args, "cpu")  # noqa: SLF001
    assert opts.limits["trace"] == 5 and opts.limits["run"] == 9 and opts.limits["compile"] == 600
    assert opts.write is False and opts.slow_factor == 3 and opts.isolate is True
    assert opts.seed == 0  # Sweeps are reproducible by default.


def test_sweep_options_reach_the_loop_and_bad_ones_fail_first(cache_dir, capsys):
    shapes = "x=64x256:float32"
    assert cli.main(["sweep", "toy_kernels:scale", "--shapes", shapes, "--repeats", "0"]) == 2
    assert "repeats=0 must be a whole number from 1" in capsys.readouterr().err
    rc = cli.main(["sweep", "toy_kernels:scale", "--shapes", shapes, "--trials", "2",
                   "--repeats", "1", "--max-time-s", "0.5", "--retime-top", "0", "-v"])
    out = capsys.readouterr().out
    assert rc == 0 and "[  0] " in out and "[  1] " in out, out
    (entry,) = json.loads(next(cache_dir.glob("cpu/*.json")).read_text())["entries"].values()
    assert entry["provenance"]["max_time_s"] == 0.5
    assert entry["provenance"]["ranked_by"] == "search median"
