"""The built book, every page opened in headless Chromium with the network cut off, checked the way a careful
reader and a technical editor would check it. Per page:

* nothing is asked of the network, and the console stays clean: no uncaught exception and no
  ``console.error`` at all (a doubly declared ``THEBE_JS_URL`` included);
* every plotly figure draws, math renders;
* every plotly axis that carries data has a title, and its range stays near the data (a log axis at most
  half a decade past it, a linear one at most half the data's span): no axis runs to 10^144;
* titles and annotations fit inside their figure (no cut titles);
* the same two checks hold in every state of every kernel-free explorer (each dropdown option, each slider
  step) and on the last frame of every animation;
* no plotly table (it scrolls rows out of sight inside a fixed-height figure), and every HTML table shows all
  its rows (no ancestor clips or scrolls it);
* no output prints a bare boolean ``False`` (a demo states its result in words and asserts it; chapter 2
  once printed "merging an empty state changes nothing: True False").

Screenshots go to _build/screenshots/. Runs after the README's book build; without a built book or a
Chromium it skips, unless SPARSEATTN_REQUIRE_BROWSER=1 (set by .ci/run), where it fails instead.
The checks themselves are tested on small hand-made pages in tests/test_book_checks.py.
"""
import os
import pathlib
import shutil

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
HTML = pathlib.Path(os.environ.get("SPARSEATTN_BOOK_HTML", ROOT / "_build" / "html"))
SHOTS = HTML.parent / "screenshots"
REQUIRED = os.environ.get("SPARSEATTN_REQUIRE_BROWSER", "0") not in ("", "0")
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
SKIP_PAGES = {"genindex.html", "search.html", "py-modindex.html"}
CHECKS_JS = (pathlib.Path(__file__).resolve().parent / "tools" / "book_checks.js").read_text()


def _need(condition: bool, why: str):
    if not condition:
        if REQUIRED:
            pytest.fail(why)
        pytest.skip(why)


def book_pages(html: pathlib.Path = HTML):
    """Every page of the built book (not Sphinx's index/search pages, not sources or static files)."""
    if not html.exists():
        return []
    return sorted(p.relative_to(html).as_posix() for p in html.rglob("*.html")
                  if p.name not in SKIP_PAGES and not {"_static", "_sources", "_images"} & set(p.parts))


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


def open_page(browser, page_path: pathlib.Path):
    """The page in a fresh context with every non-file request blocked; returns (context, page, blocked,
    errors) where errors collects uncaught exceptions and console errors."""
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
    page.on("pageerror", lambda e: errors.append(f"uncaught: {e}"))
    page.on("console", lambda m: errors.append(f"console.error: {m.text}") if m.type == "error" else None)
    page.goto(page_path.as_uri(), wait_until="load")
    if 'http-equiv="refresh"' in page_path.read_text(errors="replace").lower():
        # a redirect page (the book's index.html): check the page it lands on, once it has loaded -- a
        # screenshot taken mid-navigation fails ("Unable to capture screenshot")
        page.wait_for_url(lambda url: url != page_path.as_uri(), timeout=15_000)
        page.wait_for_load_state("load")
    return context, page, blocked, errors


def check_page(page, need_figure: bool, screenshot=None) -> list:
    """Every problem the page shows (empty list: none), after its figures and math have drawn (then the
    screenshot is taken, before the checks move any control)."""
    problems = []
    n_plots = page.locator(".js-plotly-plot").count()
    if need_figure and n_plots == 0:
        problems.append("no plotly figure on a chapter page")
    if n_plots:
        page.wait_for_function("n => document.querySelectorAll('.js-plotly-plot .main-svg').length >= n",
                               arg=n_plots, timeout=30_000)
        drawn = page.evaluate("""() => [...document.querySelectorAll('.js-plotly-plot')].filter(
            gd => gd.querySelector('.main-svg') && gd.data && gd.data.length > 0).length""")
        if drawn != n_plots:
            problems.append(f"{drawn} of {n_plots} figures drew")
    if page.locator(".math").count() > 0:
        page.wait_for_function("() => document.querySelectorAll('mjx-container').length > 0", timeout=30_000)
    if screenshot is not None:
        screenshot.parent.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(screenshot), full_page=False)
    problems += page.evaluate(CHECKS_JS)
    return problems


@pytest.mark.parametrize("name", book_pages() or ["none"])
def test_page(browser, name):
    path = HTML / name
    _need(path.exists(), f"{name} was not built")
    context, page, blocked, errors = open_page(browser, path)
    try:
        shot = SHOTS / (name.replace("/", "_").replace(".html", ".png"))
        problems = check_page(page, need_figure=name.startswith("notebooks/"), screenshot=shot)
        page.wait_for_timeout(200)  # late console errors of the checks' own interactions
        problems += [f"asked the network for {u}" for u in blocked[:5]]
        problems += errors[:5]
        assert not problems, f"{name}:\n  " + "\n  ".join(problems)
    finally:
        context.close()
