"""The browser checks of tests/test_book_browser.py can fail: each class of defect the book once had is
planted in a small hand-made page and must be reported, and a clean page must pass. Needs Chromium and
playwright (skips without them, unless SPARSEATTN_REQUIRE_BROWSER=1)."""
import pathlib

import pytest

pytest.importorskip("plotly")

import test_book_browser as B  # noqa: E402


def _page(tmp_path: pathlib.Path, name: str, body: str, figures=()) -> pathlib.Path:
    import plotly
    import plotly.io as pio
    js = pathlib.Path(plotly.__file__).parent / "package_data" / "plotly.min.js"
    figs = "".join(pio.to_html(f, include_plotlyjs=False, full_html=False, auto_play=False) for f in figures)
    path = tmp_path / f"{name}.html"
    path.write_text(f"<html><head><script src='{js.as_uri()}'></script></head><body><article>"
                    f"<div style='width: 624px'>{figs}</div>{body}</article></body></html>")
    return path


@pytest.fixture(scope="module")
def browser():
    import shutil
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    B._need(chromium is not None, "no chromium on PATH (apt-get install chromium)")
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        B._need(False, "playwright (pip) is not installed")
    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=chromium, args=B.CHROMIUM_FLAGS)
        yield b
        b.close()


def _problems(browser, path):
    context, page, blocked, errors = B.open_page(browser, path)
    try:
        return B.check_page(page, need_figure=False) + errors + [f"network {u}" for u in blocked]
    finally:
        context.close()


def _titled(fig, title="t"):
    fig.update_layout(title=title, xaxis_title="x (unit)", yaxis_title="y (unit)", width=600)
    return fig


def test_a_clean_page_passes(browser, tmp_path):
    import plotly.graph_objects as go
    fig = _titled(go.Figure(go.Scatter(x=[1, 10, 100], y=[1, 2, 3])))
    fig.update_xaxes(type="log")
    html = "<div class='cell_output'><pre>merging an empty state changes nothing: yes</pre></div>"
    assert _problems(browser, _page(tmp_path, "clean", html, [fig])) == []


def test_log_axis_past_its_data_is_reported(browser, tmp_path):
    import plotly.graph_objects as go
    fig = _titled(go.Figure(go.Bar(x=["1", "2"], y=[8, 2000], text=["64 splits", "3 splits"],
                                   textposition="outside")))
    fig.update_yaxes(type="log", range=[-6.6, 144.4])  # what chapter 7's split figure once drew
    assert any("log yaxis runs" in p for p in _problems(browser, _page(tmp_path, "log", "", [fig])))


def test_missing_axis_title_is_reported(browser, tmp_path):
    import plotly.graph_objects as go
    fig = go.Figure(go.Heatmap(z=[[0, 1], [2, 0]]), layout=dict(title="tiles", width=600))
    found = _problems(browser, _page(tmp_path, "untitled", "", [fig]))
    assert any("xaxis has no title" in p for p in found) and any("yaxis has no title" in p for p in found)


def test_cut_title_is_reported(browser, tmp_path):
    import plotly.graph_objects as go
    fig = _titled(go.Figure(go.Scatter(x=[1, 2], y=[1, 2])), "a title far too long for its figure " * 4)
    assert any("is cut" in p for p in _problems(browser, _page(tmp_path, "cut", "", [fig])))


def test_plotly_table_and_clipped_html_table_are_reported(browser, tmp_path):
    import plotly.graph_objects as go
    table = go.Figure(go.Table(header=dict(values=["a"]), cells=dict(values=[list(range(10))])))
    rows = "".join(f"<tr><td>{i}</td></tr>" for i in range(10))
    clipped = f"<div style='max-height: 60px; overflow-y: auto'><table>{rows}</table></div>"
    wide = ("<div style='width: 200px; overflow-x: auto'><table><tr>" + "<td>a wide cell</td>" * 20
            + "</tr></table></div>")
    found = _problems(browser, _page(tmp_path, "tables", clipped + wide, [table]))
    assert any("a plotly table" in p for p in found) and any("is clipped" in p for p in found)
    assert any("wider than its container" in p for p in found), found


def test_bare_false_next_to_a_claim_is_reported(browser, tmp_path):
    html = "<div class='cell_output'><pre>merging an empty state changes nothing: True False</pre></div>"
    assert any("bare False" in p for p in _problems(browser, _page(tmp_path, "false", html)))


def test_console_errors_and_bad_explorer_states_are_reported(browser, tmp_path):
    import plotly.graph_objects as go
    fig = _titled(go.Figure(go.Scatter(x=[1, 2], y=[1, 2])))
    fig.update_layout(updatemenus=[dict(buttons=[dict(label="bad", method="relayout",
                                                      args=[{"yaxis.range": [0, 1e6]}])])])
    body = "<script>const X = 1;</script><script>const X = 2;</script><script>console.error('boom')</script>"
    found = _problems(browser, _page(tmp_path, "console", body, [fig]))
    assert any("already been declared" in p for p in found), found
    assert any("console.error: boom" in p for p in found), found
    assert any('dropdown 1 "bad"' in p and "yaxis runs" in p for p in found), found


def test_an_output_line_cut_on_the_right_is_reported(browser, tmp_path):
    line = "a claim printed on one line far wider than the column it is shown in " * 3
    html = f"<div class='cell_output' style='width: 300px'><pre style='overflow-x: auto'>{line}</pre></div>"
    assert any("output line is cut" in p for p in _problems(browser, _page(tmp_path, "wide", html)))


def test_a_menu_over_the_caption_is_reported_and_the_explorer_keeps_clear(browser, tmp_path):
    import plotly.graph_objects as go
    from sparseattn.book import static_explorer
    title = "a figure<br><sup>measured on an H200, 2026-11-30, torch 2.11</sup><br><sup>second caption line</sup>"
    bad = _titled(go.Figure(go.Scatter(x=[1, 2], y=[1, 2])), title)
    bad.update_layout(height=400, margin=dict(t=100, b=80), title=dict(yref="container", y=0.9, yanchor="top"),
                      updatemenus=[dict(type="dropdown", x=0.0, y=1.05, xanchor="left", yanchor="bottom",
                                        buttons=[dict(label="pattern: a", method="skip")])])
    assert any("dropdown menu covers" in p for p in _problems(browser, _page(tmp_path, "menu", "", [bad])))

    def make(pattern, n):
        return _titled(go.Figure(go.Scatter(x=[1, 2], y=[1, n])), title.replace("figure", f"figure {pattern}"))
    good = static_explorer(make, {"pattern": ["a", "b"], "n": [2, 3]})
    good.update_layout(width=600)
    found = _problems(browser, _page(tmp_path, "explorer", "", [good]))
    assert not [p for p in found if "dropdown menu covers" in p], found
