"""The ``versus`` suite (issue 13's table in one run) on the CPU: its rows name the issue's masks (dense
compare at small N), its estimate fits one 10-minute GPU slot, ``--rows`` picks rows, and a dry run through
the Triton interpreter with the GPU-only timers replaced (tests/test_bench.py's stand-ins) records every
series, writes the file after each row, and computes the ratios and targets the table prints."""
import dataclasses
import json

import pytest
import torch

from conftest import dense_of
from sparseattn.bench import versus as V
from sparseattn.bench.record import BenchFile, Impl, Pass, load_path
from test_bench import ENV, STAND_IN_WARNINGS, _args, cpu_stand_ins  # noqa: F401 - the fixture

# the masks the issue's rows name, written out independently of sparseattn.patterns
MASKS = {
    "causal": lambda b, h, q, k: k <= q,
    "window1024": lambda b, h, q, k: (q - k >= 0) & (q - k < 1024),
    "sinks64+window1024": lambda b, h, q, k: (k <= q) & ((k < 64) | (q - k < 1024)),
    "window333": lambda b, h, q, k: (q - k >= 0) & (q - k < 333),
    "causal&(window256|dilated8)": lambda b, h, q, k: (k <= q) & ((q - k < 256) | ((q - k) % 8 == 0)),
    "stripes(plain lambda)": lambda b, h, q, k: (k <= q) & ((q - k) // 32 % 3 == 0),
}


@pytest.mark.parametrize("row", V.ROWS, ids=lambda r: r.key)
def test_each_row_measures_the_mask_it_names(row):
    N = 1536 if row.pattern != "documents64" else 512  # past the 1024 window; documents: 64 in 512 tokens
    dense = V.row_layout(row, N=N).to_dense()[0, 0]
    if row.pattern in MASKS:
        assert torch.equal(dense, dense_of(MASKS[row.pattern], N, N)[0, 0])
        return
    # 64 documents packed in order, causal inside each: a query sees exactly the keys from its document's
    # start to itself, and a new document starts only where the previous row's start does not continue
    q = torch.arange(N)
    start = dense.int().argmax(dim=1)
    k = torch.arange(N)[None]
    assert torch.equal(dense, (k <= q[:, None]) & (k >= start[:, None]))
    assert bool(((start[1:] == start[:-1]) | (start[1:] == q[1:])).all()) and int(start[0]) == 0
    assert len(set(start.tolist())) == 64


def test_rows_follow_the_issue():
    keys = [r.key for r in V.ROWS]
    assert len(set(keys)) == len(keys) == 14
    assert [r.kind for r in V.ROWS[:5]] == ["bwd"] * 5  # the backward rows lead, in the issue's order
    assert {r.N for r in V.ROWS if r.kind != "fwd+bwd" and not r.cudnn_causal} == {32768}
    assert [r.N for r in V.ROWS if r.cudnn_causal] == [1024, 2048]
    other = [r for r in V.ROWS if r.kind == "fwd+bwd"]
    assert {(r.H, r.Hkv, r.D, r.dtype) for r in other} == {(32, 32, 64, "bf16"), (32, 8, 128, "bf16"),
                                                         (16, 16, 128, "fp16")}
    for r in V.ROWS:  # every line has the issue's target; every issue ratio belongs to a line of the row
        kinds = [k for k, *_ in V.LINES[r.kind]]
        assert set(r.targets) == set(kinds) and set(r.issue) <= set(kinds), r.key


def test_the_whole_suite_fits_one_gpu_run():
    """Estimated compiles + timings of every row leave room for the interpreter start and the last row inside
    the 10-minute cap and the default --budget-s."""
    total = sum(V.estimate_s(r) for r in V.ROWS)
    assert total <= 500 - 15, total
    assert max(V.estimate_s(r) for r in V.ROWS) < 600 - 500  # a row started at the budget's end still ends in time


def test_select_rows():
    from sparseattn.bench.__main__ import SUITES, parser
    args = parser().parse_args(["versus", "--rows", "bwd-causal"])
    assert SUITES["versus"] == "versus" and args.rows == "bwd-causal" and args.budget_s == 500.0
    assert V.select_rows(None) == V.ROWS == V.select_rows("all")
    assert [r.key for r in V.select_rows("fp16-window1024,bwd-causal")] == ["bwd-causal", "fp16-window1024"]
    with pytest.raises(ValueError, match="--rows"):
        V.select_rows("bwd-causal,bwd-dense")
    with pytest.raises(ValueError, match="--rows"):
        V.select_rows(",")


def test_targets_and_lines():
    t = V.Target(1.25, max_ms=25.0)
    assert t.text() == ">=1.25x, <=25 ms"
    assert t.met(20.0, 1.3) is True and t.met(26.0, 1.3) is False and t.met(20.0, 1.2) is False
    assert t.met(None, 1.3) is None and t.met(20.0, None) is None
    assert V.Target(max_ms=5.0).met(4.0, None) is True
    row = V.ROWS[0]  # bwd causal: deterministic >= 1.0x, atomic >= 1.25x and <= 25 ms
    lines = V.row_lines(row, {"ours bwd": 30.0, "atomic bwd": 22.0, "flex bwd": 27.5, "err bwd": 0.01})
    assert [ln["line"] for ln in lines] == ["bwd causal", "bwd causal, atomic"]
    assert [ln["flex/ours"] for ln in lines] == [round(27.5 / 30.0, 2), round(27.5 / 22.0, 2)]
    assert [ln["met"] for ln in lines] == ["no", "yes"] and lines[0]["issue"] == 0.86
    assert lines[0]["err_vs_flex"] == "1.0e-02" and lines[1]["err_vs_flex"] == ""
    assert [ln["met"] for ln in V.row_lines(row, {"ours bwd": 1.0})] == ["", ""]  # no Flex: no ratio, no verdict
    assert {ln["met"] for ln in V.row_lines(row, {}, skipped="skipped")} == {"skipped"}


def _tiny(row):
    """The row at a shape the interpreter runs in seconds (fp16: the interpreter's bf16 arithmetic is wrong)."""
    return dataclasses.replace(row, N=min(row.N, 512 if row.pattern == "documents64" else 256),
                               H=row.H // 8, Hkv=row.Hkv // 8, D=row.D // 4, dtype="fp16")


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_versus_dry_run_on_cpu(cpu_stand_ins, tmp_path):
    keys = ["bwd-documents64", "fwd-stripes", "layout-stripes", "fwd-window1024-n2048", "gqa-window1024"]
    cpu_stand_ins.setattr(V, "ROWS", [_tiny(r) for r in V.ROWS])
    cpu_stand_ins.setattr(V, "FLEX_MASK_MODES", (False,))  # compiled: the layout suite's test runs it
    args = _args(n=V.DEFAULT_N, rows=",".join(keys), out=str(tmp_path), budget_s=500.0, meta={})
    records, table, cols = V.run(args)
    bf = BenchFile.from_json({"suite": V.NAME, **ENV, **args.meta, "results": [r.to_json() for r in records]})
    assert bf.distinct("row") == sorted(keys)
    for series in [(Impl.OURS, Pass.BWD), (Impl.OURS_ATOMIC, Pass.BWD), (Impl.FLEX, Pass.BWD), (Impl.OURS, Pass.FWD),
                   (Impl.FLEX, Pass.FWD), (Impl.CUDNN, Pass.FWD), (Impl.OURS, Pass.LAYOUT), (Impl.FLEX, Pass.LAYOUT)]:
        assert bf.select(*series), series
    assert all(r.ms is not None and r.get("first_call_s") >= 0 for r in bf.records), \
        [r.extra for r in bf.records if r.ms is None]
    # the forward's FlexAttention (eager here) ran on the same block mask: same output to fp16 rounding
    assert bf.one(Impl.FLEX, Pass.FWD, row="fwd-stripes").ms > 0
    stripes = next(ln for ln in table if ln["row"] == "fwd-stripes")
    assert float(stripes["err_vs_flex"]) < 2e-3
    assert bf.one(Impl.OURS, Pass.FWD, row="fwd-stripes").get("mask_path").startswith("compiled: ")
    assert bf.one(Impl.CUDNN, Pass.FWD, row="fwd-window1024-n2048").case["pattern"] == "causal"
    lay = bf.one(Impl.OURS, Pass.LAYOUT, row="layout-stripes")
    assert lay.get("tiles") == V.row_layout(V.ROWS[7]).stats()["listed_tiles"] and "peak_mb" in lay.extra
    assert bf.one(Impl.FLEX, Pass.LAYOUT, row="layout-stripes").get("compiled") is False
    gqa = bf.select(Impl.OURS, Pass.FWD, row="gqa-window1024")[0].case
    assert (gqa["H"], gqa["Hkv"]) == (4, 1) and gqa["listed_tiles"] == V.row_layout(V.ROWS[12]).stats()["listed_tiles"]
    # the table: one line per line kind of each row, the ratio flex/ours from the recorded medians
    assert [ln["row"] for ln in table] == ["bwd-documents64"] * 2 + ["fwd-stripes"] + ["layout-stripes"] * 2 + \
        ["fwd-window1024-n2048"] + ["gqa-window1024"] * 3
    for ln in table:  # create_block_mask compiled was left out here: its line has no ratio and no verdict
        compiled = ln["kind"] == "layout compiled"
        assert set(cols) <= set(ln) and ln["target"] and (ln["met"] == "" if compiled else ln["met"] in ("yes", "no"))
    ln = table[0]
    ours, flex = (bf.one(i, Pass.BWD, row="bwd-documents64").ms for i in (Impl.OURS, Impl.FLEX))
    assert ln["flex/ours"] == round(flex / ours, 2) and ln["ours_ms"] == round(ours, 3)
    assert set(args.meta["rows"]) == set(keys) and args.meta["lines"] == table
    # the file, rewritten after every row, holds the whole run
    saved = load_path(tmp_path / "versus-cpu.json")
    assert len(saved.records) == len(records) and saved.meta["lines"] == table


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_versus_skips_rows_the_budget_cannot_cover(cpu_stand_ins, tmp_path):
    """With less time left than a backward row's estimate, it is recorded as skipped; the cheaper short forward
    row after it still runs."""
    bwd, fwd = V.select_rows("bwd-window333,fwd-window1024-n1024")
    left = (V.estimate_s(bwd) + V.estimate_s(fwd)) / 2
    assert V.estimate_s(fwd) + 5 < left < V.estimate_s(bwd)
    cpu_stand_ins.setattr(V, "ROWS", [_tiny(r) for r in V.ROWS])
    args = _args(n=V.DEFAULT_N, rows="bwd-window333,fwd-window1024-n1024", out=str(tmp_path),
                 budget_s=V.C.RESERVE_S + left, meta={})
    records, table, _ = V.run(args)
    skipped = [r for r in records if r.ms is None]
    assert {(r.impl, r.pass_) for r in skipped} == {(Impl.OURS, Pass.BWD), (Impl.OURS_ATOMIC, Pass.BWD)}
    assert all("skipped" in r.get("error") for r in skipped)
    assert [ln["met"] for ln in table[:2]] == ["skipped", "skipped"] and table[2]["met"] in ("yes", "no")
    assert list(args.meta["rows"]) == ["fwd-window1024-n1024"]
    doc = json.loads((tmp_path / "versus-cpu.json").read_text())
    assert doc["suite"] == "versus" and len(doc["results"]) == len(records)


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_versus_merge_keeps_the_rows_not_remeasured(cpu_stand_ins, tmp_path):
    """``--merge``: a run of one row over an earlier file of two keeps the other row (records, line, meta,
    stamped with the earlier date), re-measures its own, orders the lines as :data:`ROWS` and names the source;
    ``merged_doc`` builds the same file from a run that was written apart."""
    cpu_stand_ins.setattr(V, "ROWS", [_tiny(r) for r in V.ROWS])
    first, again = "fwd-window1024-n1024", "fwd-window1024-n2048"
    old_dir, new_dir, apart_dir = (tmp_path / d for d in ("old", "new", "apart"))
    V.run(_args(n=V.DEFAULT_N, rows=f"{first},{again}", out=str(old_dir), budget_s=500.0, meta={}))
    old = load_path(old_dir / "versus-cpu.json")
    # tell the runs apart; an older file's rows carry no date of their own
    rows = {k: {n: x for n, x in v.items() if n != "date"} for k, v in old.meta["rows"].items()}
    old = BenchFile.from_json({**old.to_json(), "date": "2000-01-01T00:00:00+00:00", "rows": rows})
    (old_dir / "versus-cpu.json").write_text(json.dumps(old.to_json()))
    args = _args(n=V.DEFAULT_N, rows=again, out=str(new_dir), budget_s=500.0, meta={},
                 merge=str(old_dir / "versus-cpu.json"))
    records, table, _ = V.run(args)
    merged = load_path(new_dir / "versus-cpu.json")
    assert [ln["row"] for ln in table] == [first, again] == [ln["row"] for ln in merged.meta["lines"]]
    kept = [r.to_json() for r in old.records if r.case["row"] == first]
    assert [r.to_json() for r in merged.records if r.case["row"] == first] == kept
    new_ours = merged.one(Impl.OURS, Pass.FWD, row=again)
    assert new_ours.to_json() != old.one(Impl.OURS, Pass.FWD, row=again).to_json()  # measured again
    assert merged.meta["rows"][first]["date"] == old.meta["date"] != merged.meta["rows"][again]["date"]
    assert merged.meta["merged_from"] == {"date": old.meta["date"], "rows": [first]}
    # the same row run apart, then merged afterwards
    V.run(_args(n=V.DEFAULT_N, rows=again, out=str(apart_dir), budget_s=500.0, meta={}))
    apart = load_path(apart_dir / "versus-cpu.json")
    doc = V.merged_doc(old, apart)
    assert [ln["row"] for ln in doc["lines"]] == [first, again] and doc["merged_from"]["rows"] == [first]
    assert len(doc["results"]) == len(kept) + len(apart.records) and doc["date"] == apart.meta["date"]
    # merged twice: the kept row keeps its own date (chapter 6's caption and claim read it), not the date of
    # the file it was kept from
    from sparseattn.viz.ch06_backward import versus_caption, versus_row_dates
    hhmm = "04:05" if apart.meta["date"][11:16] != "04:05" else "05:06"  # never the run's own time of day
    stamp = f"2001-02-03T{hhmm}:00+00:00"
    later = {**apart.to_json(), "date": stamp,
             "rows": {k: {**v, "date": stamp} for k, v in apart.meta["rows"].items()}}
    twice = BenchFile.from_json(V.merged_doc(BenchFile.from_json(doc), BenchFile.from_json(later)))
    assert twice.meta["merged_from"]["date"] == apart.meta["date"]
    assert versus_row_dates(twice) == {first: old.meta["date"], again: stamp}
    caption = versus_caption(twice)
    assert "00:00 UTC" in caption and f"{hhmm} UTC" in caption and apart.meta["date"][11:16] + " UTC" not in caption
    with pytest.raises(ValueError, match="--merge expects"):
        V.kept_rows(BenchFile.from_json({**old.to_json(), "suite": "prefill"}), [again], old.meta["device"])
    with pytest.raises(ValueError, match="measured on"):
        V.kept_rows(old, [again], "another GPU")


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_prefill_and_backward_suites_measure_the_table_patterns(cpu_stand_ins):
    """documents64 and window333 are patterns the prefill and backward suites know (``--patterns``), with the
    causal envelope for their dense baselines; not in their defaults."""
    from sparseattn.bench import backward, cases, prefill
    assert cases.TABLE_PATTERNS == ["documents64", "window333"]
    assert all(cases.dense_pattern_of(p) == "causal" for p in cases.TABLE_PATTERNS)
    assert not set(cases.TABLE_PATTERNS) & set(prefill.setup(_args())[-1])
    for suite, pass_, pats in ((prefill, Pass.FWD, cases.TABLE_PATTERNS), (backward, Pass.BWD, ["documents64"])):
        records, _, _ = suite.run(_args(patterns=",".join(pats)))
        bf = BenchFile.from_json({"suite": suite.NAME, **ENV, "results": [r.to_json() for r in records]})
        for p in pats:
            assert bf.ms(Impl.OURS, pass_, pattern=p) > 0 and bf.ms(Impl.FLEX, pass_, pattern=p) > 0
    with pytest.raises(ValueError, match="length N"):
        cases.prefill_mask_mod("documents64")
    with pytest.raises(ValueError, match="n_docs"):
        cases.prefill_layout("documents64", 32, device="cpu")
    a, b = cases.documents_ids(4096), cases.documents_ids(4096)
    assert torch.equal(a, b) and int(a.max()) == 63 and bool((a[1:] >= a[:-1]).all())


def test_versus_caption_prints_the_cudnn_version_dotted():
    """``torch.backends.cudnn.version()`` records 91900 for cuDNN 9.19.0; the figure caption says the latter."""
    import re
    from sparseattn import book
    from sparseattn.viz.ch06_backward import versus_caption
    doc = book.load_bench("versus")
    v = doc.meta["cudnn"]
    assert re.search(rf"cuDNN {v // 10000}\.{v % 10000 // 100}\.{v % 100}\b", versus_caption(doc))
