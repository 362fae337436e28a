"""The documentation site, checked in a real browser: headless Debian ``chromium`` driven
by selenium through ``chromedriver`` (``.ci/run`` installs both).

Every page of the site (the nav of mkdocs.yml) loads with no console error and every
image on it loads; no code block or signature is wider than its column, at 1280 px and
at 390 px (a phone), and at 1280 px none needs scrolling sideways; the search box finds
``set_order``. ``mkdocs build --strict`` sees
none of these: a plot written as text, a signature on one 300-character line, a
``pre`` that pushes the page sideways. Screenshots of the home, PyTorch and reference
pages go to ``$ASYNCCACHE_SCREENSHOTS`` (CI keeps them) or the test's temporary directory.
"""

from __future__ import annotations

import functools
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMEDRIVER = shutil.which("chromedriver") or "/usr/bin/chromedriver"
WIDTHS = (1280, 390)
SHOTS = {"": "home", "pytorch/": "pytorch", "reference/asynccache/": "reference"}

#: what sticks out sideways: the page wider than the window, or a code block or signature
#: whose box reaches past the content area (on a phone the theme lets code blocks use the
#: whole width, the content area's: that is by design; past it is not)
TOO_WIDE = """
const found = [];
const page = document.documentElement.scrollWidth;
if (page > window.innerWidth + 1) found.push("the page is " + (page - window.innerWidth)
                                            + "px wider than the window");
const area = document.querySelector(".md-content");
const right = area.getBoundingClientRect().right + 1;
for (const e of area.querySelectorAll("pre, .doc-signature")) {
    const box = e.getBoundingClientRect();
    if (e.offsetParent !== null && box.right > right)
        found.push(e.tagName + " " + Math.round(box.right - right) + "px too wide: "
                   + e.textContent.trim().slice(0, 70));
}
return found;
"""
#: code blocks a reader must scroll sideways to read (at 1280 px there should be none)
SCROLLED = """
return [...document.querySelectorAll(".md-content pre > code")]
    .filter(c => c.scrollWidth > c.clientWidth + 1)
    .map(c => (c.scrollWidth - c.clientWidth) + "px hidden: " + c.textContent.trim().slice(0, 70));
"""
BROKEN_IMAGES = """
return [...document.images].filter(i => !(i.complete && i.naturalWidth > 0)).map(i => i.src);
"""


class _Quiet(SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


def pages() -> list[str]:
    """The site's page paths, from the nav (``pytorch.md`` -> ``pytorch/``)."""
    def walk(items: list[Any]) -> Iterator[str]:
        for item in items:
            for value in item.values():
                if isinstance(value, list):
                    yield from walk(value)
                else:
                    yield "" if value == "index.md" else value.removesuffix(".md") + "/"
    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["nav"]
    return list(walk(nav))


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    out = tmp_path_factory.mktemp("site")
    mkdocs = Path(sys.executable).with_name("mkdocs")
    subprocess.run([str(mkdocs), "build", "--strict", "--quiet", "--site-dir", str(out)],
                   cwd=ROOT, check=True, timeout=600,
                   env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    server = ThreadingHTTPServer(("127.0.0.1", 0),
                                 functools.partial(_Quiet, directory=str(out)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu",
                 "--disable-dev-shm-usage", "--hide-scrollbars"):
        options.add_argument(flag)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(60)
    try:
        yield driver
    finally:
        driver.quit()


def shots_dir(tmp_path: Path) -> Path:
    chosen = os.environ.get("ASYNCCACHE_SCREENSHOTS")
    directory = Path(chosen) if chosen else tmp_path
    directory.mkdir(parents=True, exist_ok=True)
    return directory


def open_page(browser: Any, url: str) -> None:
    browser.get(url)
    deadline = time.monotonic() + 30
    while browser.execute_script("return document.readyState") != "complete":
        assert time.monotonic() < deadline, url
        time.sleep(0.05)


@pytest.mark.parametrize("width", WIDTHS)
def test_every_page_loads_cleanly_and_fits_its_column(site: str, browser: Any, width: int,
                                                      tmp_path: Path) -> None:
    browser.set_window_size(width, 1000)
    browser.get_log("browser")  # what earlier pages logged is theirs
    problems: list[str] = []
    for page in pages():
        open_page(browser, site + page)
        errors = [e["message"] for e in browser.get_log("browser") if e["level"] == "SEVERE"]
        problems += [f"{page}: console: {m}" for m in errors]
        problems += [f"{page}: image not loaded: {src}"
                     for src in browser.execute_script(BROKEN_IMAGES)]
        problems += [f"{page}: {what}" for what in browser.execute_script(TOO_WIDE)]
        if width >= 1280:  # on a phone a long line scrolls; on a desktop it need not
            problems += [f"{page}: {what}" for what in browser.execute_script(SCROLLED)]
        if page in SHOTS:
            height = browser.execute_script("return document.body.scrollHeight")
            browser.set_window_size(width, min(int(height), 6000))
            browser.save_screenshot(str(shots_dir(tmp_path) / f"{SHOTS[page]}-{width}.png"))
            browser.set_window_size(width, 1000)
    assert problems == [], "\n".join(problems)


def test_the_plots_of_the_performance_page_are_images(site: str, browser: Any) -> None:
    browser.set_window_size(1280, 1000)
    open_page(browser, site + "performance/")
    sizes = browser.execute_script(
        "return [...document.images].filter(i => i.src.includes('/images/'))"
        ".map(i => i.naturalWidth)")
    assert len(sizes) >= 5 and all(w > 100 for w in sizes), sizes


def test_search_finds_set_order(site: str, browser: Any) -> None:
    from selenium.common.exceptions import StaleElementReferenceException
    from selenium.webdriver.common.by import By

    browser.set_window_size(1280, 1000)
    open_page(browser, site)
    box = browser.find_element(By.CSS_SELECTOR, "input.md-search__input")
    box.click()  # the header's search field, as a reader clicks it
    box.send_keys("set_order")
    deadline = time.monotonic() + 30
    found: list[str] = []
    while not found and time.monotonic() < deadline:
        try:
            found = [e.text for e in browser.find_elements(By.CSS_SELECTOR,
                                                           ".md-search-result__item")]
        except StaleElementReferenceException:  # the results re-rendered as they were read
            found = []
        time.sleep(0.1)
    assert found and any("set_order" in text for text in found), found
