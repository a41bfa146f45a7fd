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
