"""Failure isolation: bad candidates are recorded, the study completes, a good one wins; workers
die with their parent; scripts without a __main__ guard work or are told what to fix."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
from conftest import subprocess_env

pytestmark = pytest.mark.slow

EXPECTED = {  # mode -> (outcome, detail, text in the error)
    "raise": ("runtime_error", "", "fails at run time"),
    "hang": ("timeout", "timeout_run", "run limit"),
    "abort": ("runtime_error", "worker_crashed", "SIGABRT"),
    "wrong": ("mismatch", "", "max abs error"),
    "trace_raise": ("compile_error", "trace_error", "fails while traced"),
    "trace_hang": ("timeout", "timeout_trace", "trace limit"),
    "trace_abort": ("compile_error", "worker_crashed", "SIGABRT"),
    "spec_hang": ("timeout", "timeout_trace", "trace limit"),
}


def test_every_bad_candidate_is_recorded_and_a_good_one_wins(cache_dir, fresh):
    import toy_kernels

    x = toy_kernels.ones((64, 256))
    res = toy_kernels.misbehaving.tune(x, trials=32, timeout_s=6, repeats=2)
    df = res.trials
    assert len(df) == toy_kernels.misbehaving.space.size == 18  # The study completed.
    # The kernel's constraint refuses the hanging modes at br=16 (each hang waits out the
    # whole limit), before any worker runs them.
    refused = df.error.str.contains("constraint hangs_once", na=False)
    assert set(df[refused]["br"]) == {16} and refused.sum() == 3, df[refused]
    df = df[~refused]
    for mode, (outcome, detail, text) in EXPECTED.items():
        rows = df[df["mode"] == mode]
        assert set(rows.outcome) == {outcome}, (mode, rows[["outcome", "detail", "error"]])
        assert (rows.detail == detail).all() if detail else True, (mode, rows.detail)
        assert rows.error.str.contains(text).all(), (mode, rows.error.tolist())
    good = df[df["mode"] == "good"]
    assert "ok" in set(good.outcome) and set(good.outcome) <= {"ok", "slow"}
    assert res.best["mode"] == "good"
    assert res.provenance["isolated"] is True and res.provenance["evaluator"] == "workers"
    np.testing.assert_allclose(toy_kernels.misbehaving(x), 2 * x)  # Served from the cache.


def _descendants(pid):
    """Processes below ``pid`` (Linux /proc), with their state letters."""
    parents = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            parents[int(entry)] = (int(fields[1]), fields[0])
    out, frontier = {}, [pid]
    while frontier:
        p = frontier.pop()
        for child, (ppid, state) in parents.items():
            if ppid == p and child not in out:
                out[child] = state
                frontier.append(child)
    return out


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


HANGS = """
import toy_kernels, pallas_tune as pt
hangs = pt.tunable(mode=["hang"], br=[8], reference=toy_kernels.scale_reference,
                   name="hangs")(toy_kernels.misbehaving.fn)
print("tuning", flush=True)
hangs.tune(toy_kernels.ones((64, 256)), isolate=True, timeout_s=900, write=False)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_workers_die_with_their_parent(tmp_path, sig):
    script = tmp_path / "hangs.py"
    script.write_text(HANGS)
    proc = subprocess.Popen([sys.executable, str(script)], env=subprocess_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        workers = {}
        while time.monotonic() < deadline and not workers:
            time.sleep(0.5)
            workers = _descendants(proc.pid)
        assert workers, "no worker process started"
        time.sleep(8)  # Into the candidate's endless run.
        workers = _descendants(proc.pid)
        assert proc.poll() is None and workers
        proc.send_signal(sig)
        proc.wait(30)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and any(_alive(p) for p in workers):
            time.sleep(0.2)
        assert not [p for p in workers if _alive(p)], "workers outlived their parent"
    finally:
        if proc.poll() is None:
            proc.kill()
        for p in _descendants(proc.pid):
            os.kill(p, signal.SIGKILL)


MAIN_KERNEL = """
import toy_kernels, pallas_tune as pt

def double(x, *, br):  # Defined in this script: workers must import it to find it.
    return toy_kernels.scale.fn(x, br=br, bc=128, buffering=2)

kernel = pt.tunable(br=[8, 16], name="double")(double)

def main():
    res = kernel.tune(toy_kernels.ones((64, 256)), isolate=True, trials=2, repeats=1,
                      write=False)
    print("tuned", res.best)

{call}
"""


@pytest.mark.parametrize("guarded", [False, True])
def test_a_script_that_defines_its_kernel_needs_a_main_guard(tmp_path, guarded):
    call = 'if __name__ == "__main__":\n    main()' if guarded else "main()"
    script = tmp_path / "script.py"
    script.write_text(textwrap.dedent(MAIN_KERNEL).replace("{call}", call))
    r = subprocess.run([sys.executable, str(script)], env=subprocess_env(), capture_output=True,
                       text=True, timeout=600)
    if guarded:
        assert r.returncode == 0 and "tuned {'br'" in r.stdout, r.stdout + r.stderr[-3000:]
    else:
        assert r.returncode != 0
        assert 'if __name__ == "__main__":' in r.stderr and "EOFError" not in r.stderr


def test_a_script_without_a_guard_tunes_an_importable_kernel(tmp_path):
    script = tmp_path / "plain.py"
    script.write_text("import toy_kernels\n"
                      "res = toy_kernels.scale.tune(toy_kernels.ones(), isolate=True, trials=2,\n"
                      "                             repeats=1, write=False)\n"
                      "print('tuned', res.counts['timed'])\n")
    r = subprocess.run([sys.executable, str(script)], env=subprocess_env(), capture_output=True,
                       text=True, timeout=600)
    assert r.returncode == 0 and "tuned 2" in r.stdout, r.stdout + r.stderr[-3000:]
