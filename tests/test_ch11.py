"""Chapter 11's figures and tables on synthetic records (the recorded errors file comes from the GPU), its
exercises (solutions pass, scaffolds and the usual mistakes are rejected)."""
import pytest

from sparseattn.bench.record import BenchFile, Impl, Pass, Record

pytest.importorskip("plotly")
from sparseattn.viz import ch11_correctness as V  # noqa: E402
from sparseattn.exercises import ch11_correctness as X  # noqa: E402

META = {"suite": "errors", "device": "NVIDIA H200", "date": "2026-01-01T00:00:00+00:00", "torch": "2.11.0",
        "triton": "3.6.0"}


def synthetic(drop=None):
    recs = []
    for dtype, base in (("bf16", 1e-2), ("fp16", 1e-3)):
        for i, N in enumerate((1024, 4096, 131072)):
            for j, impl in enumerate((Impl.OURS, Impl.FLEX, Impl.CUDNN)):
                if (impl, N) == drop:
                    continue
                err = base * (1 + 0.5 * i) * (1 + 0.1 * j)
                extra = {"max_abs": err, "rel_fro": err / 10, "row_max_abs_p50": err / 4,
                         "row_max_abs_p90": err / 2, "row_max_abs_p99": err / 1.5, "row_rel_p50": 1e-3,
                         "row_rel_p90": 2e-3, "row_rel_p99": 3e-3}
                case = dict(pattern="causal", N=N, B=1, H=16, D=128, dtype=dtype, rows=min(N, 1024), check="error")
                recs.append(Record(case, impl, Pass.FWD, 0.5 * (i + 1), extra))
        rep = dict(pattern="causal", N=4096, B=1, H=16, D=128, dtype=dtype, rows=1024, check="repeat", runs=5)
        recs.append(Record(rep, Impl.OURS, Pass.FWD, 0.4, {"bitwise_repeatable": True}))
        recs.append(Record(rep, Impl.OURS, Pass.BWD, 1.4, {"bitwise_repeatable": True, "dq_run_to_run_max_abs": 0.0}))
        recs.append(Record(rep, Impl.OURS_ATOMIC, Pass.BWD, 1.1, {"bitwise_repeatable": False,
                                                                   "dq_run_to_run_max_abs": 2e-3}))
    return BenchFile(META, tuple(recs))


def test_error_growth_figure_and_summary():
    bf = synthetic()
    fig = V.error_growth_figure(bf, "bf16")
    assert len(fig.data) == 9  # 3 implementations x (max, p99, p50)
    assert all(t.mode == "markers" for t in fig.data)  # few lengths, measured unlike: no line implies a trend
    assert len({t.marker.color for t in fig.data}) == 3  # one colour per implementation
    assert [tuple(t.customdata) for t in fig.data[:1]] == [(1024, 4096, 131072)]  # drawn offset along N
    assert fig.layout.xaxis.type == "log" and "N" in fig.layout.xaxis.title.text
    lo, hi = fig.layout.xaxis.range
    assert 10 ** lo < 1024 and 10 ** hi > 131072 and 10 ** lo > 512 and 10 ** hi < 2 * 131072  # never past the data
    from sparseattn.bench import errors as E
    s = {(r["dtype"], r["impl"]): r for r in E.summary(bf)}
    assert s[("bf16", Impl.OURS)]["growth"] == pytest.approx(2.0)
    with pytest.raises(LookupError, match="cudnn"):
        V.error_growth_figure(BenchFile(META, tuple(r for r in bf.records if r.impl != Impl.CUDNN)), "bf16")


def test_repeat_rows():
    rows = V.repeat_rows(synthetic())
    assert len(rows) == 6
    atomic = [r for r in rows if r["impl"] == Impl.OURS_ATOMIC]
    assert all(r["bitwise"] is False and r["dq_spread"] == 2e-3 for r in atomic)


def test_baselines_figure_from_given_errors():
    errs = {"correct kernel": {"baseline 1: fp64 on the same edges": 1e-7, "baseline 2: fp64 dense causal attention": 0.5},
            "kernel that skips one tile": {"baseline 1: fp64 on the same edges": 0.1,
                                           "baseline 2: fp64 dense causal attention": 0.52},
            "pattern alone": {"baseline 2: fp64 dense causal attention": 0.5}}
    fig = V.baselines_figure(window=24, errors=errs)
    assert [t.name for t in fig.data] == list(V.BASELINE_COLORS)
    assert fig.layout.yaxis.type == "log" and fig.layout.yaxis.title.text


def test_two_baselines_separates_the_bug():
    e = V.two_baselines(window=24, L=64)
    b1 = "baseline 1: fp64 on the same edges"
    assert e["correct kernel"][b1] < 2e-5 < 1e-3 < e["kernel that skips one tile"][b1]


def test_tables():
    html = V.edge_case_table()._repr_html_()
    assert html.count("<tr>") == len(V.EDGE_CASES) + 1
    # every test file the table names exists, and a test_fixes.py row names the tests (test_N_*) it means
    from pathlib import Path
    import re
    here = Path(__file__).parent
    for *_, where in V.EDGE_CASES:
        for name in re.findall(r"tests/(\w+\.py)", where):
            assert (here / name).exists(), name
        for n in re.findall(r"test_(\d+)_\*", where):
            assert re.search(rf"^def test_{n}_", (here / "test_fixes.py").read_text(), re.M), n
    from sparseattn import _catalogue
    t = V.bad_input_table(_catalogue.table(_catalogue.catalogue()[:3]))
    assert len(t.rows) == 3 and "TypeError" in t.column("raises")
    assert t._repr_html_().count("<tr>") == 4


def test_drop_one_tile_removes_exactly_one_tile():
    from sparseattn import BlockLayout, patterns as P
    layout = BlockLayout.from_mask_mod(P.sinks_window(4, 20), 96, 96, 32, 32, device="cpu")
    broken = X.drop_one_tile(layout)
    assert int((layout.kv_count + layout.full_count).sum()) - int((broken.kv_count + broken.full_count).sum()) == 1
    assert (layout.to_dense() & ~broken.to_dense()).any() and not (broken.to_dense() & ~layout.to_dense()).any()
