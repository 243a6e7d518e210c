"""How the book reads the same-run records: issue 13's ``versus`` table (chapter 6), the ``balance`` and
``balance_bwd`` files with FlexAttention rows that may have failed to compile (chapter 10), and an ideal
that a measured time undercuts. Synthetic files are built from the recorded ones in memory, never written to
book/data/bench."""
from __future__ import annotations

import pytest

from sparseattn import book
from sparseattn.bench import versus as VS
from sparseattn.bench.record import BenchFile, Impl, Pass, Record

ERR = "InductorError: LoweringException: boom\nsecond line that the page must not show"


def _with(doc: BenchFile, drop=lambda r: False, add=()) -> BenchFile:
    j = doc.to_json()
    j["results"] = [r for r in j["results"] if not drop(Record.from_json(r))] + [r.to_json() for r in add]
    return BenchFile.from_json(j)


# ---- chapter 6: versus ---------------------------------------------------------------------------------------
def test_versus_bwd_lines_come_from_the_records_and_the_suite_targets():
    from sparseattn.viz import ch06_backward as V
    doc = book.load_bench("versus")
    lines = V.versus_bwd(doc)
    bwd_rows = [r for r in VS.ROWS if "bwd" in r.kind]
    assert [x["row"] for x in lines] == [r.key for r in bwd_rows for _ in range(2)]
    assert [x["kind"] for x in lines] == ["bwd", "bwd atomic"] * len(bwd_rows)
    for x in lines:
        ours = doc.ms(Impl.OURS if x["kind"] == "bwd" else Impl.OURS_ATOMIC, Pass.BWD, row=x["row"])
        flex = doc.ms(Impl.FLEX, Pass.BWD, row=x["row"])
        assert x["ours_ms"] == ours and x["flex_ms"] == flex and x["ratio"] == pytest.approx(flex / ours)
        row = next(r for r in VS.ROWS if r.key == x["row"])
        assert x["target"] == row.targets[x["kind"]].min_ratio
        assert x["met"] == row.targets[x["kind"]].met(ours, flex / ours)
    # the suite's own table lines (rounded) agree with what the page computes
    table = {(ln["row"], ln["kind"]): ln for ln in doc.meta["lines"]}
    for x in lines:
        ln = table[(x["row"], x["kind"])]
        assert round(x["ratio"], 2) == ln["flex/ours"] and ("yes" if x["met"] else "no") == ln["met"]
    assert {x["label"] for x in lines if x["row"] == "gqa-window1024"} == {"window 1024 (H=32/8)"}


def test_versus_bwd_figure_has_one_bar_per_line_targets_and_units():
    from sparseattn.viz import COLORS
    from sparseattn.viz import ch06_backward as V
    doc = book.load_bench("versus")
    lines = V.versus_bwd(doc)
    fig = V.versus_bwd_figure(doc)
    bars = [t for t in fig.data if t.type == "bar"]
    assert [b.marker.color for b in bars] == [COLORS[Impl.OURS], COLORS[Impl.OURS_ATOMIC]]
    assert list(bars[0].y) == [x["ratio"] for x in lines if x["kind"] == "bwd"]
    ticks = [t for t in fig.data if t.type == "scatter"]
    assert sorted(v for t in ticks for v in t.y) == sorted(x["target"] for x in lines)
    assert [s.y0 for s in fig.layout.shapes] == [1.0]
    assert "x" in fig.layout.yaxis.title.text and fig.layout.xaxis.title.text
    title = fig.layout.title.text
    assert doc.meta["device"] in title and doc.meta["torch"] in title and doc.meta["date"][:10] in title
    # the caption times the rows drawn (one run or merged), and names no row the figure does not draw
    dates, shown = V.versus_row_dates(doc), {x["row"] for x in lines}
    assert all(dates[r][11:16] in title for r in shown)
    assert not any(r in title for r in dates if r not in shown)
    assert max(v for b in bars for v in b.y) <= fig.layout.yaxis.range[1]


def test_versus_bwd_survives_a_failed_and_a_missing_row():
    from sparseattn.viz import ch06_backward as V
    doc = book.load_bench("versus")
    failed = Record({**doc.one(Impl.FLEX, Pass.BWD, row="bwd-causal").case}, Impl.FLEX, Pass.BWD, None,
                    {"error": ERR})
    thin = _with(doc, drop=lambda r: r.case.get("row") == "bwd-window333"
                 or (r.impl == Impl.FLEX and r.pass_ == Pass.BWD and r.case.get("row") == "bwd-causal"),
                 add=[failed])
    lines = V.versus_bwd(thin)
    assert "bwd-window333" not in {x["row"] for x in lines}
    causal = [x for x in lines if x["row"] == "bwd-causal"]
    assert all(x["ratio"] is None and x["met"] is None for x in causal)
    V.versus_bwd_figure(thin)  # draws with a gap, no exception
    with pytest.raises(ValueError, match="versus"):
        V.versus_bwd(book.load_bench("balance"))


# ---- chapter 10: Flex rows that failed, an ideal that is undercut -------------------------------------------
def _failed_flex(doc: BenchFile, case: str, pass_: str) -> BenchFile:
    old = next(r for r in doc.records if r.impl == Impl.FLEX and r.pass_ == pass_ and r.case["case"] == case)
    return _with(doc, drop=lambda r: r is old or r.to_json() == old.to_json(),
                 add=[Record(dict(old.case), Impl.FLEX, pass_, None, {"error": ERR, "ideal_ms": 1.0})])


def test_ch9_crossover_captions_date_each_part():
    """The crossover file merges parts run hours or days apart: a caption over all of them names each part's
    time, and one curve's figure gives its own part's date, not the file's."""
    from sparseattn.viz import ch09_roofline as V9
    xo = book.load_bench("crossover")
    parts = xo.meta["parts"]
    cap = V9.run_caption(xo)
    assert all(f"{k} {m['date'][:10]} {m['date'][11:16]}" in cap for k, m in parts.items())
    for family, pass_, n in (("decode", "decode", 16384), ("window", "bwd", None)):
        title = V9.crossover_figure(xo, family, pass_, n).layout.title.text
        assert f"{parts[pass_]['date'][:10]} {parts[pass_]['date'][11:16]} UTC" in title
    assert parts["decode"]["date"][:10] != xo.meta["date"][:10]  # else this test cannot fail


def test_ch10_shows_a_flex_compile_failure_with_its_first_line():
    from sparseattn.viz import ch10_load_balance as V
    bf = _failed_flex(book.load_bench("balance"), "routed skewed (synthetic)", Pass.FWD)
    t = V.recorded_table(bf)
    i = t.column("case").index("routed skewed (synthetic)")
    assert t.column("FlexAttention (ms)")[i].startswith("Flex failed to compile")
    assert t.column("FlexAttention / our fastest")[i] == "Flex failed to compile"
    assert "FlexAttention failed to compile on routed skewed (synthetic): InductorError: LoweringException: boom" \
        in t.caption
    assert "second line" not in str(t.rows) + t.caption and "0.000" not in t.column("FlexAttention (ms)")[i]
    target = V.flex_target(bf)
    assert target["routed skewed (synthetic)"]["ratio"] is None and not target["routed skewed (synthetic)"]["met"]
    verdict = V.flex_verdict(target)
    assert "routed skewed (synthetic): Flex failed to compile (InductorError: LoweringException: boom)" in verdict
    assert "not tested: Flex failed to compile" in verdict and "missed" in verdict
    fig = V.recorded_figure(bf)
    assert any("Flex failed" in a.text for a in fig.layout.annotations)
    # a case with no Flex row at all is "not measured", not a failure
    none = _with(bf, drop=lambda r: r.impl == Impl.FLEX and r.case["case"] == "causal")
    j = V.recorded_table(none).column("case").index("causal")
    assert V.recorded_table(none).column("FlexAttention (ms)")[j] == "not measured"


def test_ch10_backward_flex_failure_and_an_undercut_ideal():
    from sparseattn.viz import ch10_load_balance as V
    bw = _failed_flex(book.load_bench("balance_bwd"), "causal", Pass.BWD)
    t = V.recorded_bwd_table(bw)
    i = t.column("case").index("causal")
    assert t.column("FlexAttention (ms)")[i].startswith("Flex failed to compile")
    assert "failed to compile on causal: InductorError: LoweringException: boom" in t.caption
    assert any("Flex failed" in a.text for a in V.recorded_bwd_figure(bw).layout.annotations)
    # make one case faster than its ideal: it is flagged "below", neither met nor counted as within the target
    plain = bw.one(Impl.OURS, Pass.BWD, case="causal")
    fast = Record(dict(plain.case), Impl.OURS, Pass.BWD, plain.get("ideal_ms") / 2, dict(plain.extra))
    split = bw.select(Impl.OURS_SPLIT, Pass.BWD, case="causal")
    fast_bw = _with(bw, drop=lambda r: r.case["case"] == "causal" and r.impl in (Impl.OURS, Impl.OURS_SPLIT),
                    add=[fast] + [Record(dict(s.case), s.impl, s.pass_, plain.get("ideal_ms") / 1.5, dict(s.extra))
                                  for s in split])
    near = V.bwd_near_ideal(fast_bw)
    assert near["causal"]["below"] and not near["causal"]["met"] and near["causal"]["ratio"] == pytest.approx(0.5)
    cal = V.ideal_calibration(fast_bw, "causal")
    eq = fast_bw.one(Impl.OURS, Pass.BWD, case="equal rows", N=plain.case["N"], H=plain.case["H"])
    assert cal["rows"] * cal["tiles_per_row"] == eq.get("listed_tiles") and cal["sms"] == bw.meta["sm_count"]


def test_ch10_recorded_one_head_calibration_does_not_fill_the_gpu():
    """What the chapter says about the recorded one-head backward: when its time is under the ideal, the
    calibration launch had no more programs than SMs (checked on whatever the file holds)."""
    from sparseattn.viz import ch10_load_balance as V
    bw = book.load_bench("balance_bwd")
    for name, t in V.bwd_near_ideal(bw).items():
        if t["below"]:  # either the calibration did not fill the GPU, or the case is within a few % of it
            cal = V.ideal_calibration(bw, name)
            assert cal["rows"] <= cal["sms"] or t["ratio"] > 0.95, (name, cal, t)


def test_ch10_marks_an_error_the_suite_cut():
    """A failed row keeps ``bench.balance.ERROR_CHARS`` characters of its message; chapter 10 marks one that
    long as cut ("[...]") and leaves a shorter one as it is."""
    from sparseattn.bench import balance as BB
    from sparseattn.viz.ch10_load_balance import flex_error
    case = {"case": "causal", "N": 1024, "H": 1}
    cut = Record(case, Impl.FLEX, Pass.FWD, None, {"error": "InductorError: " + "x" * BB.ERROR_CHARS})
    whole = Record(case, Impl.FLEX, Pass.FWD, None, {"error": "InductorError: boom"})
    assert flex_error([cut]).endswith(" [...]") and flex_error([whole]) == "InductorError: boom"
