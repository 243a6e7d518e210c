"""The built book, opened in headless Chromium with the network cut off: plotly figures must draw, math must
render, and no page may ask for anything outside the build folder. Screenshots go to _build/screenshots/.

Runs after the README's book build. Without a built book or a Chromium it skips, unless
SPARSEATTN_REQUIRE_BROWSER=1 (set by .ci/run), where it fails instead.
"""
import os
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HTML = ROOT / "_build" / "html"
SHOTS = ROOT / "_build" / "screenshots"
REQUIRED = os.environ.get("SPARSEATTN_REQUIRE_BROWSER", "0") not in ("", "0")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]


def _need(condition: bool, why: str):
    if not condition:
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)


def _chapter_pages():
    return sorted((HTML / "notebooks").glob("*.html")) + [HTML / "book" / "intro.html"]


@pytest.fixture(scope="module")
def browser():
    _need((HTML / "index.html").exists(), "the book is not built (run the README's build command first)")
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    _need(chromium is not None, "no chromium on PATH (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        _need(False, "playwright (pip) is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=CHROMIUM_FLAGS)
        yield b
        b.close()


def _open(browser, page_path: pathlib.Path):
    context = browser.new_context(viewport={"width": 1200, "height": 1600})
    blocked = []

    def route(r):
        if r.request.url.startswith("file://"):
            r.continue_()
        else:
            blocked.append(r.request.url)
            r.abort()

    context.route("**/*", route)
    page = context.new_page()
    errors = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(page_path.as_uri(), wait_until="load")
    return context, page, blocked, errors


@pytest.mark.parametrize("name", [p.relative_to(HTML).as_posix() for p in _chapter_pages()] or ["none"])
def test_page_renders_offline(browser, name):
    path = HTML / name
    _need(path.exists(), f"{name} was not built")
    context, page, blocked, errors = _open(browser, path)
    try:
        n_plots = page.locator(".js-plotly-plot").count()
        if name.startswith("notebooks/"):
            assert n_plots > 0, f"{name}: no plotly figure on a chapter page"
        if n_plots:
            page.wait_for_function(
                "n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n", arg=n_plots,
                timeout=30_000)
            drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(
                gd => gd.querySelector('.main-svg') && gd.data && gd.data.length > 0).length""")
            assert drawn == n_plots, f"{name}: {drawn} of {n_plots} figures drew"
        has_math = page.locator(".math").count() > 0
        if has_math:
            page.wait_for_function("() => document.querySelectorAll('mjx-container').length > 0", timeout=30_000)
        SHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SHOTS / (name.replace("/", "_").replace(".html", ".png"))), full_page=False)
        assert not blocked, f"{name} asked the network for {blocked[:5]}"
        # sphinx-thebe declares THEBE_JS_URL twice on every page (a theme bug, harmless)
        errors = [e for e in errors if "THEBE_JS_URL" not in e]
        assert not errors, f"{name}: JavaScript errors {errors[:3]}"
    finally:
        context.close()
