"""`pallas-tune report` in a real headless browser (Chromium through Selenium): the page loads
with no script error, every plotly figure draws, and the screenshot is not blank. And what a
report holds: the user's own entries unless --shipped, a chip and a source column, the
default's figure from the entry where no final ranking has it, PNGs only with --png.

The browser test needs Chromium, its driver and selenium (tests/browser.py says how to get
them; where they are missing it skips, saying so)."""

from __future__ import annotations

import html
import json
import os
import pathlib
import re
import shutil
import subprocess
import sys

import pytest
from browser import chromium
from conftest import subprocess_env

pytest.importorskip("plotly", reason="report needs the report extra (plotly, matplotlib)")
pytest.importorskip("matplotlib", reason="report needs the report extra (plotly, matplotlib)")


def _wait_until_drawn(driver, *, expected, timeout):
    """Wait until every figure has drawn (not until the first element exists: find_elements
    returns as soon as one does, and under load the page takes ~9 s to draw all of them).
    Returns (figure divs, drawn svgs) as found when all had drawn or the time ran out."""
    from selenium.common.exceptions import TimeoutException
    from selenium.webdriver.support.ui import WebDriverWait

    def counts(d):
        figures = d.find_elements("css selector", ".plotly-graph-div")
        drawn = [f for f in figures if f.find_elements("css selector", ".main-svg")]
        return figures, drawn

    try:
        WebDriverWait(driver, timeout, poll_frequency=0.25).until(
            lambda d: len(counts(d)[1]) >= expected)
    except TimeoutException:
        pass  # The assertion below names the counts.
    return counts(driver)


def _cli(args, cache_dir):
    return subprocess.run([sys.executable, "-m", "pallas_tune", *args], capture_output=True,
                          text=True, timeout=600,
                          env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir))


def test_report_renders_in_chromium(cache_dir, tmp_path):
    r = _cli(["sweep", "toy_kernels:scale", "--shapes", "x=64x256:float32", "--trials", "6",
              "--repeats", "1", "--no-storage", "-q"], cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    out = tmp_path / "report"
    r = _cli(["report", "--kernel", "scal", "--out", str(out)], cache_dir)
    assert r.returncode == 2 and "toy_kernels.scale" in r.stderr  # A name or its last part.
    r = _cli(["report", "--kernel", "toy_kernels.scale", "--out", str(out), "--png"], cache_dir)
    assert r.returncode == 0, r.stderr[-3000:]
    pngs = sorted(p.name for p in out.glob("*.png"))
    stem = "00_x-64x256-float32-factor-2-0"  # Figures are named by the shape they show.
    assert pngs == [f"{stem}_{n}.png" for n in ("compare", "heatmap", "history",
                                                "importances", "outcomes")], pngs
    page = (out / "index.html").read_text()
    assert "<script src=" not in page  # Self-contained: plotly.js is inline.
    assert "ms, wall clock (interpret mode)" in page  # Axes say what the numbers are.
    ledger = json.loads((cache_dir / "cpu" / "toy_kernels.scale.trials.jsonl").read_text()
                        .splitlines()[-1])
    ranking = ledger["provenance"]["retimed_interleaved"]
    tuned_ms = ranking[0]["median_ms"]
    default_ms = next(r["median_ms"] for r in ranking if r.get("default"))
    driver = chromium()
    try:
        driver.get((out / "index.html").as_uri())
        figures, drawn = _wait_until_drawn(driver, expected=5, timeout=120)
        row = driver.find_element("css selector", "table.summary tr:nth-child(2)")
        cells = {c: row.find_element("css selector", f"td.{c}")
                 for c in ("tuned", "default", "speedup")}
        shown = {c: (e.text, e.get_attribute(f"data-{c}")) for c, e in cells.items()}
        errors = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        title = driver.title
        shot = tmp_path / "screenshot.png"
        driver.save_screenshot(str(shot))
    finally:
        driver.quit()
    assert title == "pallas-tune report: toy_kernels.scale"
    # The summary table's speed-up is default / tuned from the same final ranking.
    assert float(shown["tuned"][1]) == tuned_ms and float(shown["default"][1]) == default_ms
    assert float(shown["speedup"][1]) == default_ms / tuned_ms
    assert shown["speedup"][0] == f"{default_ms / tuned_ms:.2f}x"
    assert len(figures) == 5 and len(drawn) >= 5, (len(figures), len(drawn))
    assert not errors, errors
    import matplotlib.image

    pixels = matplotlib.image.imread(str(shot))
    assert pixels.shape[0] > 1000 and pixels.std() > 0.05  # Drawn, not a blank page.
    keep = os.environ.get("PALLAS_TUNE_KEEP_SCREENSHOT")
    if keep:
        shutil.copy(shot, keep)


def test_report_without_entries_is_a_clear_error(cache_dir, tmp_path):
    r = _cli(["report", "--kernel", "nothing_here", "--out", str(tmp_path / "r")], cache_dir)
    assert r.returncode == 2 and "run pallas-tune sweep first" in r.stderr, r.stderr


def _summary_rows(page):
    """The summary table's rows as {column class: (text, data- value)}."""
    table = page[page.index("<table class=summary>"):]
    table = table[:table.index("</table>")]
    rows = []
    for row in re.findall(r"<tr>(.*?)</tr>", table)[1:]:
        cells = re.findall(r'<td class=(\w+)(?: data-\w+="([^"]*)")?>(.*?)</td>', row)
        rows.append({c: (html.unescape(re.sub("<[^>]+>", "", text)), value or None)
                     for c, value, text in cells})
    return rows


def test_report_is_the_user_s_own_by_default(cache_dir, tmp_path):
    """`report --kernel matmul` (a short name, as `show --kernel matmul` takes it): only the
    user's entries, no PNGs, fast; --shipped adds the library's, told apart by the chip and
    source columns, estimate entries with their default and speed-up from the entry."""
    r = _cli(["sweep", "pallas_tune.kernels.matmul:matmul", "--shapes",
              "x=128x128:float32,y=128x128:float32", "--trials", "2"], cache_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    run = ("import sys; from pallas_tune.cli import main; rc = main(sys.argv[1:]); "
           "print('jax imported:', 'jax' in sys.modules); sys.exit(rc)")
    r = subprocess.run([sys.executable, "-c", run, "report", "--kernel", "matmul", "--out",
                        str(tmp_path / "r")], capture_output=True, text=True, timeout=600,
                       env=subprocess_env(PALLAS_TUNE_CACHE_DIR=cache_dir))
    assert r.returncode == 0, r.stderr[-2000:]
    assert "jax imported: False" in r.stdout  # Only --reference times anything.
    assert "kernel: pallas_tune.kernels.matmul.matmul" in r.stdout
    assert "(1 shape(s))" in r.stdout and "--shipped reports them too" in r.stdout, r.stdout
    assert not list((tmp_path / "r").glob("*.png"))  # PNGs only with --png.
    (row,) = _summary_rows((tmp_path / "r" / "index.html").read_text())
    assert row["chip"][0] == "cpu" and row["source"][0] == "user, measured", row
    assert row["speedup"][0].endswith("x"), row

    r = _cli(["report", "--kernel", "matmul", "--shipped", "--chip", "v6e", "--out",
              str(tmp_path / "s")], cache_dir)
    assert r.returncode == 0, r.stderr[-2000:]
    rows = _summary_rows((tmp_path / "s" / "index.html").read_text())
    assert rows and {(x["chip"][0], x["source"][0]) for x in rows} == {
        ("tpu_v6e", "shipped, estimate")}
    from pallas_tune.cache import reader

    shipped = pathlib.Path(__file__).resolve().parent.parent / "caches"
    wf = reader.read(str(shipped / "tpu_v6e" / "pallas_tune.kernels.matmul.matmul.estimate.json"))
    recorded = {k: v["default_ms"] for k, v, problem in wf.items()
                if problem is None and "default_ms" in v}
    assert recorded and {x["key"][0] for x in rows} >= set(recorded)
    for x in rows:  # Estimates are not re-ranked: the default is the entry's own default_ms.
        if x["key"][0] in recorded:
            tuned, default = float(x["tuned"][1]), float(x["default"][1])
            assert default == recorded[x["key"][0]], x
            assert x["speedup"][0] == f"{default / tuned:.2f}x", x
