"""benchmarks/_common.scratch: a benchmark's temporary folder is gone when its process exits,
in the process itself and in a spawned pool worker (a compile worker's dump folder)."""

import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

SCRIPT = """
import concurrent.futures, multiprocessing, os, sys
sys.path.insert(0, {benchmarks!r})
import _common as bench

def worker_folder():
    path = bench.scratch("pt-test-scratch-worker-")
    open(os.path.join(path, "dump"), "w").close()
    return path

if __name__ == "__main__":
    own = bench.scratch("pt-test-scratch-")
    with concurrent.futures.ProcessPoolExecutor(
            1, mp_context=multiprocessing.get_context("spawn")) as pool:
        theirs = pool.submit(worker_folder).result()
    print(own)
    print(theirs)
    assert os.path.isdir(own)
"""


def test_scratch_folders_are_removed_when_their_process_exits(tmp_path):
    script = tmp_path / "make.py"
    script.write_text(SCRIPT.format(benchmarks=os.path.join(REPO, "benchmarks")))
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    own, theirs = out
    assert os.path.basename(own).startswith("pt-test-scratch-")
    assert not os.path.exists(own) and not os.path.exists(theirs)
