import json
import subprocess
import sys

import pytest
from conftest import subprocess_env


def _cli(args, cache_dir, **env):
    return subprocess.run([sys.executable, "-m", "pallas_tune", *args], capture_output=True,
                          text=True, timeout=600,
                          env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir, **env))


def test_sweep_then_show_then_skip(cache_dir):
    r = _cli(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32",
              "--shapes", "x=128x256:bfloat16,factor=3.0", "--trials", "4", "--repeats", "1"],
             cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert r.stdout.count("best {") == 2
    data = json.loads((cache_dir / "cpu" / "toy_kernels.scale.json").read_text())
    assert set(data["entries"]) == {"x=64x256:float32,factor=2.0", "x=128x256:bfloat16,factor=3.0"}
    show = _cli(["show"], cache_dir)
    assert show.returncode == 0
    assert "toy_kernels.scale" in show.stdout and "x=128x256:bfloat16,factor=3.0" in show.stdout
    again = _cli(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32", "--trials", "4"],
                 cache_dir)
    assert "cached, skipped" in again.stdout


@pytest.mark.parametrize("args,message", [
    (["sweep", "toy_kernels:nope", "--shapes", "x=8x128:float32"], "no attribute 'nope'"),
    (["sweep", "toy_kernels:plain_add", "--shapes", "x=8x128:float32"], "not a @pallas_tune"),
    (["sweep", "toy_kernels:scale", "--shapes", "x=8x128:floaty"], "unknown dtype"),
    (["sweep", "toy_kernels:scale", "--shapes", "z=8x128:float32"], "does not fit"),
    (["sweep", "toy_kernels:scale", "--shapes", "x8x128"], "name=DIMS:DTYPE"),
])
def test_bad_input_is_a_clear_error(cache_dir, args, message):
    r = _cli(args, cache_dir)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]


def _write(path, content):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(content if isinstance(content, bytes) else content.encode())


def test_show_survives_hostile_files_and_escapes_control_characters(cache_dir):
    from pallas_tune.cache import TuningCache

    c = TuningCache(str(cache_dir), use_shipped=False)
    c.write("cpu", "toy_kernels.scale", "x=8x128:float32",
            {"config": {"br": 8, "bc": 128, "buffering": 1}, "median_ms": 0.5,
             "provenance": {"timer": "wallclock"}})
    c.write("cpu", "other.kernel", "x=8x8:int32", {"config": {"b": 1}, "median_ms": 0.25})
    path = c.path("cpu", "toy_kernels.scale")
    lines = open(path).read().splitlines()
    lines.insert(2, ',"typed": {"config": {"br": 8}, "median_ms": "fast", "provenance": [1]}')
    lines.insert(3, ',"x=\\u001b[2J\\u001b]0;pwned\\u0007": {"config": {"br": "\\u001b[31m"}}')
    _write(cache_dir / "cpu" / "toy_kernels.scale.json", "\n".join(lines) + "\n")
    _write(cache_dir / "cpu" / "bad.json", b"\xff\xfe not utf-8")
    _write(cache_dir / "cpu" / ".tmp-host-1-abc.json", b"{half")  # A killed writer's.
    r = _cli(["show"], cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    out = r.stdout
    assert "\x1b" not in out and "\x07" not in out and "\\x1b[2J" in out
    assert "other.kernel" in out and "0.25" in out  # Every other cache is still shown.
    assert "SKIPPED: `median_ms` is a string" in out
    assert "UNREADABLE" in out and "not UTF-8" in out
    assert ".tmp-" not in out


def test_show_trials_reads_the_ledger(cache_dir):
    r = _cli(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32", "--trials", "3",
              "--repeats", "1"], cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (cache_dir / "cpu" / "toy_kernels.scale.trials.jsonl").exists()
    show = _cli(["show", "--trials", "--key", "x=64x256"], cache_dir)
    assert show.returncode == 0, show.stderr[-3000:]
    assert "1 tuning run(s)" in show.stdout and "3 trials" in show.stdout
    assert show.stdout.count(" ok ") >= 1


def test_the_current_directory_is_not_imported_from(cache_dir, tmp_path):
    here = tmp_path / "here"
    marker = tmp_path / "ran"
    _write(here / "jax.py", f"open({str(marker)!r}, 'w').write('x')\nraise SystemExit(9)\n")
    _write(here / "mykern.py", "import pallas_tune as pt\n"
                               "@pt.tunable(b=[1], name='mykern.k')\n"
                               "def k(x, *, b):\n    return x\n")
    args = ["feasibility", "pallas_tune.kernels.matmul:matmul", "--shapes", "x=8x128:floaty"]
    r = subprocess.run([sys.executable, "-m", "pallas_tune", *args], capture_output=True,
                       text=True, cwd=here, timeout=600,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir))
    assert r.returncode == 2 and "unknown dtype" in r.stderr, r.stderr[-2000:]
    assert not marker.exists()  # The shipped kernel imported the real jax.
    local = ["sweep", "mykern:k", "--shapes", "x=8:float32", "--trials", "1", "--repeats", "1"]
    r = subprocess.run([sys.executable, "-m", "pallas_tune", *local], capture_output=True,
                       text=True, cwd=tmp_path, timeout=600,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir))
    assert r.returncode == 2 and "--path" in r.stderr, r.stderr[-2000:]
    r = subprocess.run([sys.executable, "-m", "pallas_tune", *local, "--path", str(here)],
                       capture_output=True, text=True, cwd=tmp_path, timeout=600,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir))
    assert r.returncode == 0 and "best {'b': 1}" in r.stdout, r.stderr[-3000:]


@pytest.mark.parametrize("space,message", [
    ('kernel = "evil:k"\n[params]\nb = []\n', "has no choices"),
    ('kernel = "evil:k"\n[params]\nb = [1]\n[constraints]\nc = "__import__(1)"\n',
     "may call only"),
    ('kernel = "evil:k"\n[params]\nb = [1]\n[[shapes]]\nx = "8:float32,oops"\n', "name=DIMS"),
])
def test_a_space_file_is_validated_before_its_module_is_imported(cache_dir, tmp_path, space,
                                                                 message):
    marker = tmp_path / "imported"
    _write(tmp_path / "evil.py", f"open({str(marker)!r}, 'w').write('x')\n")
    _write(tmp_path / "s.toml", space)
    r = _cli(["sweep", "--space", str(tmp_path / "s.toml"), "--path", str(tmp_path)], cache_dir)
    assert r.returncode == 2 and message in r.stderr, r.stderr[-2000:]
    assert not marker.exists()


def test_bare_show_lists_the_user_s_entries_and_counts_the_shipped_ones(cache_dir, capsys):
    """Bare ``show``: the user's entries row by row, the library's shipped ones one line per
    kernel and chip (their full rows run to hundreds of characters); a filter lists them."""
    from pallas_tune.cache import default_cache
    from pallas_tune.cli import main

    default_cache().write_many("cpu", "toy_kernels.scale", {
        "x=64x256:float32,factor=2.0": {"config": {"br": 8, "bc": 128, "buffering": 2},
                                        "median_ms": 0.25}})
    assert main(["show"]) == 0
    out = capsys.readouterr().out
    assert "x=64x256:float32,factor=2.0" in out and "0.25" in out  # The user's row.
    assert "shipped with installed libraries:" in out
    line = next(ln for ln in out.splitlines() if "kernels.matmul.matmul " in ln)
    assert line.split()[-2:][1] == "entries" and int(line.split()[-2]) > 0
    assert "x=8192x4096:bfloat16" not in out  # No shipped key listed.
    summary = out[out.index("shipped with installed libraries:"):].split("\n\n")[0]
    assert max(len(ln) for ln in summary.splitlines()[1:]) < 120
    assert main(["show", "--kernel", "kernels.matmul.matmul"]) == 0
    assert "x=8192x4096:bfloat16" in capsys.readouterr().out


def test_no_libtpu_probing_noise_on_a_host_without_a_tpu(cache_dir):
    """With libtpu installed and ALLOW_MULTIPLE_LIBTPU_LOAD=1 (as deviceless compiles need),
    libtpu initialises on any host and, with no TPU, prints a screen of worker-probing errors;
    the CLI keeps it from probing where the host has no TPU chip."""
    from pallas_tune.feasibility.compile import libtpu_available

    if not libtpu_available():
        pytest.skip("libtpu is not installed: it prints nothing to silence")
    from jax._src import hardware_utils

    if hardware_utils.num_available_tpu_chips_and_device_id()[0]:
        pytest.skip("this host has TPU chips: JAX's own start-up configures libtpu")
    env = subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir, ALLOW_MULTIPLE_LIBTPU_LOAD="1")
    for name in ("JAX_PLATFORMS", "TPU_WORKER_HOSTNAMES", "TPU_ACCELERATOR_TYPE"):
        env.pop(name, None)  # Every backend starts, libtpu's too, as on a user's host.
    r = subprocess.run([sys.executable, "-m", "pallas_tune", "show", "--kernel", "rms_norm_bwd"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "TPU worker hostnames" not in r.stderr and "host bounds" not in r.stderr, r.stderr
