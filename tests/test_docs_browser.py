"""The documentation site as a reader sees it, in headless Chromium: long code lines wrap
instead of hiding their ends (comments included) behind a scrollbar, and no table, the API
reference's parameter tables with their Default column included, runs off the page
(docs/stylesheets/extra.css). Needs the docs extra and Chromium (tests/browser.py)."""

from __future__ import annotations

import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from browser import chromium

REPO = pathlib.Path(__file__).resolve().parent.parent
# Pages with the longest code lines and the widest tables.
PAGES = ("reference/api/", "reference/cli/", "tutorial/", "how-to/tune-without-a-tpu/")

# Per page: code blocks whose text is wider than their box, and tables (or their last column's
# cells) whose right edge passes the article's.
OVERFLOWS = """
const article = document.querySelector("article").getBoundingClientRect();
const code = [...document.querySelectorAll("pre > code")]
    .filter(c => c.scrollWidth > c.clientWidth + 1)
    .map(c => c.textContent.slice(0, 80));
const tables = [...document.querySelectorAll("article table")]
    .filter(t => {
        const cells = [...t.querySelectorAll("tr > :last-child"), t];
        return cells.some(c => c.getBoundingClientRect().right > article.right + 1);
    })
    .map(t => t.querySelector("tr").textContent.trim().replace(/\\s+/g, " ").slice(0, 80));
const scrolled = [...document.querySelectorAll(".md-typeset__scrollwrap, .md-typeset__table")]
    .filter(w => w.scrollWidth > w.clientWidth + 1).length;
return {code, tables, scrolled, n_code: document.querySelectorAll("pre > code").length,
        n_tables: document.querySelectorAll("article table").length};
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory):
    for module in ("mkdocs", "material", "mkdocstrings"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed: `pip install -e '.[docs]'` builds the site")
    out = tmp_path_factory.mktemp("site")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "-q", "-f",
                        str(REPO / "mkdocs.yml"), "-d", str(out)], cwd=REPO,
                       capture_output=True, text=True, timeout=300, check=False,
                       env=dict(os.environ, NO_MKDOCS_2_WARNING="1"))
    assert r.returncode == 0, r.stderr[-3000:]
    return out


@pytest.mark.parametrize("width", [1280, 900])
def test_code_wraps_and_tables_fit(site, width, tmp_path):
    driver = chromium(width=width, height=1200)
    found = {}
    try:
        for page in PAGES:
            driver.get((site / page / "index.html").as_uri())
            found[page] = driver.execute_script(OVERFLOWS)
        driver.get((site / "reference/api/index.html").as_uri())
        shot = tmp_path / "api.png"
        driver.save_screenshot(str(shot))
    finally:
        driver.quit()
    assert found["reference/api/"]["n_tables"] >= 5 and found["reference/cli/"]["n_code"] >= 1
    for page, f in found.items():
        assert not f["code"], f"{page} at {width}px: code lines behind a scrollbar: {f['code']}"
        assert not f["tables"], f"{page} at {width}px: tables past the page: {f['tables']}"
        assert not f["scrolled"], f"{page} at {width}px: {f['scrolled']} tables scroll sideways"
    keep = os.environ.get("PALLAS_TUNE_KEEP_SCREENSHOT")
    if keep:
        os.replace(shot, f"{keep}.docs-{width}.png")
