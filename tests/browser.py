"""Headless Chromium for the browser tests (tests/test_sweep_report.py: the report page;
tests/test_docs_browser.py: the documentation site), driven through Selenium. Where Chromium,
its driver or selenium is missing, :func:`chromium` skips the test and its reason says how to
run it (docs/contributing.md says the same)."""

from __future__ import annotations

import shutil

import pytest

HOW_TO_RUN = ("apt-get install chromium chromium-driver (Debian/Ubuntu: the packages that "
              "provide chromium and chromedriver), pip install -e '.[test]' (selenium), then "
              ".venv/bin/python -m pytest tests/test_sweep_report.py tests/test_docs_browser.py")


def chromium(width: int = 1200, height: int = 1600):
    """A headless Chromium WebDriver (the caller quits it), or a skip naming what is missing."""
    pytest.importorskip("selenium", reason=f"the browser tests drive Chromium with selenium: "
                                           f"{HOW_TO_RUN}")
    browser = next((p for p in (shutil.which("chromium"), shutil.which("chromium-browser"),
                                shutil.which("google-chrome")) if p), None)
    driver = shutil.which("chromedriver")
    if not browser or not driver:
        missing = " and ".join(n for n, p in (("chromium", browser), ("chromedriver", driver))
                               if not p)
        pytest.skip(f"the browser tests need {missing} on PATH: {HOW_TO_RUN}")
    from selenium import webdriver
    from selenium.webdriver.chrome.options import Options
    from selenium.webdriver.chrome.service import Service

    options = Options()
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage",
                f"--window-size={width},{height}"):
        options.add_argument(arg)
    options.binary_location = browser
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    return webdriver.Chrome(options=options, service=Service(driver))
