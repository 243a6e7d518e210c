"""The book's helpers and the figures' data functions, without building the book: the kernel-free explorer
(one control per parameter, later controls rebuilt for each choice), source sections, claims that assert,
the widget registry a GPU test presses, HTML tables, and the chapter figures the issue found wrong (a log
axis to 10^144, the decode crossover, the read ceiling, both create_block_mask modes)."""
import math

import pytest
import torch

pytest.importorskip("plotly")

from sparseattn import book  # noqa: E402
from sparseattn.bench.record import BenchFile, Impl, Pass, Record  # noqa: E402
from sparseattn.viz import Table  # noqa: E402

ENV = {"device": "test", "date": "2026-12-01T00:00:00", "torch": "t", "triton": "t"}


def _fig(pattern, block=16, L=1):
    import plotly.graph_objects as go
    return go.Figure(go.Scatter(x=[0, block], y=[0, L], name=f"{pattern}-{block}-{L}"),
                     layout=dict(title=f"{pattern} {block} {L}", xaxis_title="x", yaxis_title="y"))


def _visible(fig):
    return [t.name for t in fig.data if t.visible]


def test_explorer_gives_each_parameter_its_own_control():
    fig = book.static_explorer(_fig, {"pattern": ["a", "b"], "block": [16, 32, 64]})
    assert [m.buttons[1].label for m in fig.layout.updatemenus] == ["pattern: b"]
    assert [s.label for s in fig.layout.sliders[0].steps] == ["16", "32", "64"]
    assert _visible(fig) == ["a-16-1"]
    # choosing "b" shows b at the first block and rebuilds the slider's steps for b
    vis, lay = fig.layout.updatemenus[0].buttons[1].args
    assert [t.name for t, v in zip(fig.data, vis["visible"]) if v] == ["b-16-1"]
    steps = lay["sliders[0].steps"]
    assert [[t.name for t, v in zip(fig.data, st["args"][0]["visible"]) if v] for st in steps] == \
        [["b-16-1"], ["b-32-1"], ["b-64-1"]]
    assert lay["sliders[0].active"] == 0 and lay["title.text"] == "b 16 1"


def test_explorer_with_three_parameters_rebuilds_every_later_control():
    fig = book.static_explorer(_fig, {"pattern": ["a", "b"], "block": [16, 32], "L": [1, 2, 3]})
    assert len(fig.layout.updatemenus) == 1 and len(fig.layout.sliders) == 2
    _, lay = fig.layout.updatemenus[0].buttons[1].args
    block_steps = lay["sliders[0].steps"]
    _, lay2 = block_steps[1]["args"]  # b, block 32: rebuilds the L slider for (b, 32)
    names = [[t.name for t, v in zip(fig.data, st["args"][0]["visible"]) if v] for st in lay2["sliders[1].steps"]]
    assert names == [["b-32-1"], ["b-32-2"], ["b-32-3"]]


def test_explorer_refuses_an_empty_grid():
    with pytest.raises(ValueError, match="grid"):
        book.static_explorer(_fig, {})
    with pytest.raises(ValueError, match="pattern"):
        book.static_explorer(_fig, {"pattern": []})


def test_source_sections_and_anchors_come_from_the_package():
    from sparseattn.kernels import decode, prefill_fwd
    sec = book.source(prefill_fwd.sparse_fwd_kernel, "which rows")
    assert sec.text.startswith("# ---- which rows") and "ROW_ORDER" in sec.text
    assert "sparseattn/kernels/prefill_fwd.py" in sec._repr_html_()
    part = book.source(decode.decode_split_kernel, start="for blk in range", stop="b_o, b_lse = finalize")
    assert part.text.startswith("for blk in range") and "finalize" not in part.text
    with pytest.raises(ValueError, match="titles"):
        book.source(prefill_fwd.sparse_fwd_kernel, "no such section")
    with pytest.raises(ValueError, match="start="):
        book.source(decode.decode_split_kernel, start="this line is not in the kernel")


def test_claim_prints_what_holds_and_refuses_what_does_not(capsys):
    book.claim("two is more than one", 2 > 1)
    assert capsys.readouterr().out == "two is more than one\n"
    book.claim("a tensor condition", torch.tensor(True))
    with pytest.raises(AssertionError, match="merging an empty state changes nothing"):
        book.claim("merging an empty state changes nothing", False)


def test_widget_settings_and_presses(monkeypatch, capsys):
    calls = []

    def remeasure(pattern="window", N=1024, keep=0.13):
        calls.append((pattern, N, keep))
    grid = {"pattern": ["window", "causal", "dilated"], "N": [1024, 4096], "keep": (0.01, 0.5, 0.01)}
    assert book.widget_settings(remeasure, grid, 3) == [
        {"pattern": "window", "N": 1024, "keep": 0.13}, {"pattern": "dilated", "N": 1024, "keep": 0.13},
        {"pattern": "window", "N": 4096, "keep": 0.13}]
    monkeypatch.setattr(book, "WIDGETS", [(remeasure, grid)])
    assert book.press_widgets(3) == 3 and len(calls) == 3
    with pytest.raises(ValueError, match="does not take"):
        book.interact(remeasure, window=[1, 2])


def test_table_keeps_every_row_and_checks_its_width():
    t = Table(["a", "b"], [[i, i * i] for i in range(40)], caption="squares")
    html = t._repr_html_()
    assert html.count("<tr>") == 41 and "squares" in html and t.column("b")[-1] == 39 * 39
    with pytest.raises(ValueError, match="row 1"):
        Table(["a", "b"], [[1, 2], [3]])


def test_split_count_figure_log_axis_stays_near_its_data():
    """Chapter 7's figure once ran its log axis to 10^144 (text outside bars breaks plotly's autorange)."""
    from sparseattn.viz import ch07_decode
    fig = ch07_decode.splits_figure()
    ys = [y for tr in fig.data for y in tr.y] + [132]
    lo, hi = fig.layout.yaxis.range
    assert math.log10(min(ys)) - 0.5 <= lo and hi <= math.log10(max(ys)) + 0.5


def _keep_file(extra_points=()):
    rows = []
    for b, dense, cud, pts in ((1, 0.14, 0.137, [(0.5, 0.12, 0.08), (0.75, 0.15, 0.11)]),
                               (8, 0.96, 0.94, [(0.75, 0.90, 0.80), (1.0, 1.14, 1.04)])):
        case = dict(N=131072, B=b, page_size=16)
        rows.append(Record({**case, "pattern": "dense"}, Impl.OURS, Pass.DECODE_GRAPH, dense))
        rows.append(Record({**case, "pattern": "dense"}, Impl.CUDNN, Pass.DECODE_DENSE, cud, {"tbps": 4.5}))
        for keep, step, dec in pts:
            c = {**case, "pattern": f"keep{keep:.2f}", "keep": keep}
            rows.append(Record(c, Impl.OURS, Pass.SELECT_DECODE_GRAPH, step))
            rows.append(Record(c, Impl.OURS, Pass.DECODE_GRAPH, dec, {"keep_fraction": keep, "tbps": 3.0}))
    return BenchFile({"suite": "decode_keep", **ENV}, tuple(rows))


def test_keep_crossover_brackets_and_interpolates_per_batch():
    from sparseattn.viz import ch07_decode
    cross = ch07_decode.keep_crossover(_keep_file())
    assert cross[1]["last_paying"] == 0.5 and cross[1]["first_not"] == 0.75
    assert cross[1]["crossover"] == pytest.approx(0.5 + (0.137 - 0.12) * 0.25 / (0.15 - 0.12))
    assert cross[8]["last_paying"] == 0.75 and cross[8]["first_not"] == 1.0


def test_read_ceiling_is_read_when_the_decode_file_has_it():
    from sparseattn.viz import ch07_decode
    case = dict(pattern="dense", N=131072, B=8, page_size=16)
    without = BenchFile({"suite": "decode", **ENV}, (Record(case, Impl.CUDNN, Pass.DECODE_DENSE, 0.96),))
    assert ch07_decode.read_ceiling(without) == {}
    with_read = BenchFile({"suite": "decode", **ENV}, without.records + (
        Record(case, Impl.READ_CEILING, Pass.READ, 0.9, {"bytes": 4.3e9, "tbps": 4.8}),))
    assert ch07_decode.read_ceiling(with_read) == {(8, 131072, 16, "dense"): (0.9, 4.8)}
    fig = ch07_decode.decode_bandwidth_figure(_keep_file(), ceiling=with_read)
    assert any(s.y0 == 4.8 for s in fig.layout.shapes)


def test_layout_table_labels_eager_and_compiled_create_block_mask():
    from sparseattn.viz.ch03_layout import layout_build_table
    case = dict(pattern="causal", N=131072, block=128)
    rows = (Record(case, Impl.OURS, Pass.LAYOUT, 0.8),
            Record(case, Impl.FLEX, Pass.LAYOUT, None, {"error": "out of memory (N x N = 16 Gi cells)"}),
            Record(case, Impl.FLEX, Pass.LAYOUT, 12.5, {"compiled": True, "call": "_compile=True"}))
    t = layout_build_table(BenchFile({"suite": "layout", **ENV}, rows))
    assert t.rows == [["causal", 131072, "0.80", "out of memory", "12.50"]]
    old = layout_build_table(BenchFile({"suite": "layout", **ENV}, rows[:2]))
    assert old.rows[0][4] == "not measured"


def test_bound_figure_builds_its_cache_on_the_device_it_is_given():
    from sparseattn.viz import ch07_decode
    fig = ch07_decode.bound_figure(device="cpu")
    assert all(y >= x - 1e-4 for x, y in zip(fig.data[0].x, fig.data[0].y))
    assert "computed on cpu" in fig.layout.title.text


def test_tile_walk_replays_the_kernel_order_exactly():
    from sparseattn.viz import ch05_prefill
    walk = ch05_prefill.tile_walk("sinks + window", L=256, block=32)
    kinds = [s["kind"] for s in walk["steps"]]
    lay, qi = walk["layout"], walk["q_tile"]
    assert kinds == ["partial"] * int(lay.kv_count[0, 0, qi]) + ["full"] * int(lay.full_count[0, 0, qi])
    assert walk["error"] < 1e-12
    fig = ch05_prefill.tile_walk_figure("sliding window", L=256, block=32)
    assert len(fig.frames) == len(ch05_prefill.tile_walk("sliding window")["steps"])
    assert fig.frames[0].data[2].y.count(None) >= 1  # a row with no key yet has no m to draw


def test_prefill_baseline_is_the_patterns_envelope():
    from sparseattn.bench.cases import dense_pattern_of
    assert [dense_pattern_of(p) for p in ("causal", "window1024", "sinks64+window1024", "random10%+diag")] == \
        ["causal", "causal", "causal", "dense"]


def test_static_explorer_can_start_at_a_chosen_value():
    import plotly.graph_objects as go
    from sparseattn.book import static_explorer

    def make(pattern, N):
        return go.Figure(go.Scatter(x=[1, 2], y=[N, N + 1], name=f"{pattern} {N}"), layout=dict(title=f"{pattern} {N}"))
    fig = static_explorer(make, {"pattern": ["a", "b"], "N": [1024, 16384]}, start={"N": 16384})
    shown = [tr.name for tr in fig.data if tr.visible]
    assert shown == ["a 16384"] and fig.layout.title.text == "a 16384"
    assert fig.layout.sliders[0].active == 1
    with pytest.raises(ValueError, match="start"):
        static_explorer(make, {"pattern": ["a"], "N": [1024]}, start={"N": 99})


def test_log_axes_get_full_tick_labels_and_dots_instead_of_bars():
    import plotly.graph_objects as go
    from sparseattn.viz._axes import log_ticks, tidy_log
    vals, text = log_ticks(0.2, 16.3)
    assert vals == [0.2, 0.5, 1.0, 2.0, 5.0, 10.0] and text == ["0.2", "0.5", "1", "2", "5", "10"]
    assert len(log_ticks(1e-30, 1e10)[0]) <= 12  # a very wide span thins out and ends
    assert len(log_ticks(1.5, 2.5)[0]) >= 2
    with pytest.raises(ValueError, match="positive"):
        log_ticks(0, 1)
    fig = go.Figure(go.Bar(x=["a", "b"], y=[0.3, 12.0], name="ms", text=["0.3", "12"]))
    fig.update_layout(yaxis_type="log")
    fig.add_trace(go.Scatter(x=[1, 2], y=[1, 2], xaxis="x2", yaxis="y2"))
    fig.update_layout(xaxis2=dict(type="log", tickvals=[1, 2]), yaxis2=dict(type="log", overlaying="y"))
    tidy_log(fig)
    assert fig.data[0].type == "scatter" and list(fig.data[0].y) == [0.3, 12.0]  # same values, as dots
    assert "5" in fig.layout.yaxis.ticktext and "10" in fig.layout.yaxis.ticktext
    assert list(fig.layout.xaxis2.tickvals) == [1, 2]  # explicit ticks are left alone


def test_log_axes_without_a_range_reach_a_label_past_every_value():
    """An axis plotly would range itself gets the labelled ticks just outside its values (the slowest bar of
    chapter 6's backward figure sat above the last label), rules included; an explorer's axis, whose hidden
    states have other values, keeps plotly's range per state."""
    import plotly.graph_objects as go
    from sparseattn.viz._axes import log_ticks, tidy_log
    assert log_ticks(0.127, 33.7, outer=True)[0] == [0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0]
    assert log_ticks(0.0238, 0.5044, outer=True)[0][-1] == 0.5  # within 5% of a tick: that tick
    narrow = log_ticks(0.19, 0.33, outer=True)[0]
    assert narrow[0] <= 0.19 and narrow[-1] >= 0.33 and narrow[-1] / narrow[0] < 3  # a finer ladder, not 0.1-0.5
    ends = log_ticks(1e-30, 1e10, outer=True)[0]
    assert len(ends) <= 12 and ends[0] <= 1e-30 and ends[-1] >= 1e10
    fig = go.Figure(go.Bar(x=["a", "b"], y=[0.127, 33.7]))
    fig.add_hline(y=80.0)
    fig.update_layout(yaxis_type="log")
    tidy_log(fig)
    ax = fig.layout.yaxis
    assert ax.tickvals[0] <= 0.127 and ax.tickvals[-1] >= 80 and ax.ticktext[-1] == "100"
    assert 10 ** ax.range[0] < 0.127 and 10 ** ax.range[1] > 100 and ax.autorange is False
    # a range the figure set is widened to the labelled ticks past the values inside it, never narrowed
    fig = go.Figure(go.Scatter(x=[1024, 65536], y=[0.0145, 14.06]))
    fig.update_layout(xaxis=dict(type="log", range=[2.96, 4.87]), yaxis=dict(type="log", range=[-1.95, 1.3]))
    tidy_log(fig)
    x, y = fig.layout.xaxis, fig.layout.yaxis
    assert x.tickvals[0] <= 1024 and x.tickvals[-1] >= 65536 and x.range[0] <= 2.96 and 10 ** x.range[1] >= 1e5
    assert y.tickvals[0] <= 0.0145 and y.tickvals[-1] >= 14.06 and y.range[0] <= -1.95 and y.range[1] >= 1.3
    # a shared range (predicted against measured) stays shared; a value outside the given range stays out
    fig = go.Figure(go.Scatter(x=[0.02, 14.0, 1e6], y=[0.0145, 14.1, 1e6]))
    fig.update_layout(xaxis=dict(type="log", range=[-1.95, 1.26]), yaxis=dict(type="log", range=[-1.95, 1.26]))
    tidy_log(fig)
    assert tuple(fig.layout.xaxis.range) == tuple(fig.layout.yaxis.range) and fig.layout.yaxis.range[1] < 2
    assert fig.layout.yaxis.tickvals[-1] == 20 and fig.layout.xaxis.tickvals[0] <= 0.02
    fig = go.Figure([go.Scatter(x=[1, 2], y=[0.1, 0.3]), go.Scatter(x=[1, 2], y=[10.0, 40.0], visible=False)])
    fig.update_layout(yaxis_type="log")
    tidy_log(fig)
    assert fig.layout.yaxis.range is None and "20" in fig.layout.yaxis.ticktext


def test_rule_labels_on_log_axes_sit_at_their_line():
    """Plotly reads an add_hline/add_vline label's coordinate as log10 on a log axis: "132 SMs" at y=132 sat
    at 10^132 and never showed (chapters 7 and 9)."""
    import plotly.graph_objects as go
    from sparseattn.viz import ch07_decode, ch09_roofline
    from sparseattn.viz._axes import tidy_log
    fig = ch07_decode.splits_figure(sms=132)
    (ann,) = [a for a in fig.layout.annotations if a.text == "132 SMs"]
    lo, hi = fig.layout.yaxis.range
    assert ann.y == pytest.approx(math.log10(132)) and lo < ann.y < hi
    fig = ch09_roofline.roofline_figure(ch09_roofline.intensity_points())
    (ridge,) = [a for a in fig.layout.annotations if a.text.startswith("ridge")]
    (rule,) = [s for s in fig.layout.shapes if s.x0 == s.x1]
    lo, hi = fig.layout.xaxis.range
    assert ridge.x == pytest.approx(math.log10(rule.x0)) and lo < ridge.x < hi
    fig = go.Figure(go.Scatter(x=[1, 1000], y=[1, 2]))
    fig.add_vline(x=160.87, annotation_text="ridge")
    fig.add_hline(y=1.5, annotation_text="linear axis stays")
    fig.update_layout(xaxis_type="log")
    tidy_log(fig)
    ridge, lin = fig.layout.annotations
    assert ridge.x == pytest.approx(math.log10(160.87)) and lin.y == 1.5


def test_explorer_moves_its_sliders_down_by_space_below():
    """Chapter 8's top-k slider sat on the x-axis title of two-line tick labels; space_below makes room."""
    plain = book.static_explorer(lambda block: _fig("a", block), {"block": [16, 32]})
    roomy = book.static_explorer(lambda block: _fig("a", block), {"block": [16, 32]}, space_below=40)
    assert roomy.layout.sliders[0].pad.t == plain.layout.sliders[0].pad.t + 40
    assert roomy.layout.height == plain.layout.height + 40
    assert roomy.layout.margin.b == plain.layout.margin.b + 40
    with pytest.raises(ValueError, match="space_below"):
        book.static_explorer(lambda block: _fig("a", block), {"block": [16, 32]}, space_below=-1)


def test_routing_split_panel_says_its_top_k_is_fixed():
    """The right panel was measured at the main top-k only; its title must say so while the slider moves."""
    from sparseattn.viz import ch08_routing
    doc = book.load_bench("routing")
    m = ch08_routing.main_case(doc)
    other = [k for k in ch08_routing.split_at_topk(doc)[1] if k != m["topk"]][0]
    titles = [a.text for a in ch08_routing.split_figure(doc, other).layout.annotations]
    assert any(t.startswith(f"forward step, top-{other}<br>") for t in titles)
    assert any(f"fixed at top-{m['topk']}" in t for t in titles)


def test_load_check_reads_a_kept_record_and_refuses_paths():
    """``book.load_check`` reads a record under book/data/bench/checks by file name (chapter 6 reads the
    backward's per-pass sweep from there); a path or a non-JSON name is a ValueError naming the rule."""
    from sparseattn import book
    sweep = book.load_check("backward-pass-sweep-h200.json")
    assert sweep.records and {r.pass_ for r in sweep.records} >= {"bwd"}
    for bad in ("../prefill-h200.json", "checks/x.json", "notes.txt"):
        with pytest.raises(ValueError, match="name must be a file name ending in .json"):
            book.load_check(bad)
