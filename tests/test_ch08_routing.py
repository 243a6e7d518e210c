"""Chapter 8's figures and exercise: every figure builds from a small synthetic ``routing`` file in the
suite's record format (the H200 file is recorded by the lead) and fails loudly on a missing series; the
live figures run on the CPU; the exercise's check passes the solution and rejects the scaffold and a wrong
tie rule."""
import pytest
import torch

from sparseattn.bench.record import BenchFile, Impl, Pass

plotly = pytest.importorskip("plotly")

ENV = {"suite": "routing", "date": "2026-01-01T00:00:00+00:00", "torch": "2.11.0", "triton": "3.6.0",
       "device": "synthetic test data"}


def synthetic_routing_file() -> BenchFile:
    """Rows shaped like the suite's (not measurements): N sweep at top-16, top-k sweep at 32k, reuse rows."""
    rows = []

    def add(case, impl, pass_, ms, **extra):
        rows.append({"case": case, "impl": impl, "pass": pass_, "ms": ms, **extra})
    base = dict(pattern="routed", B=1, Hq=16, D=128, dtype="bf16", block=128, local=1, sinks=1, semantics="block")
    for N in (4096, 8192, 16384, 32768):
        c = dict(base, N=N, Hkv=16, topk=16, share="kv_head")
        scale = N / 32768
        add(c, Impl.OURS, Pass.ROUTE, 0.06 * scale + 0.01, recall=0.9, tiles=N // 8, recall_rows=512,
            **({"recall_drifted": {"0.1": 0.88, "0.3": 0.8, "0.5": 0.7}} if N == 32768 else {}))
        add(c, Impl.OURS, Pass.INDEX, 0.01)
        add(c, Impl.OURS, Pass.FWD, 1.0 * scale)
        add(c, Impl.OURS, Pass.STEP, 1.0 * scale + 0.2, sync_free=True)
        add(c, Impl.OURS, Pass.STEP_GRAPH, 1.1 * scale + 0.02, graph_equals_eager=True)
        for p, ms in ((Pass.ROUTE, 0.36 * scale), (Pass.INDEX, 0.54 * scale), (Pass.FWD, 1.5 * scale),
                      (Pass.STEP, 2.4 * scale), (Pass.STEP_GRAPH, None)):
            add(c, Impl.FLEX, p, ms, **({"error": "capture failed"} if ms is None else {}))
        add(dict(c, pattern="causal"), Impl.CUDNN, Pass.FWD, 4.0 * scale * scale + 0.05)
        if N == 32768:
            add(c, Impl.OURS, Pass.FWD_BWD, 3.0)
            add(c, Impl.OURS, Pass.TRAIN_STEP, 3.3, sync_free=True)
            add(c, Impl.OURS, Pass.TRAIN_STEP_GRAPH, 3.1, graph_equals_eager=True)
            add(c, Impl.FLEX, Pass.FWD_BWD, 4.5)
            add(c, Impl.FLEX, Pass.TRAIN_STEP, 5.5)
    for topk, recall in ((4, 0.6), (8, 0.75), (32, 0.95)):
        c = dict(base, N=32768, Hkv=16, topk=topk, share="kv_head")
        add(c, Impl.OURS, Pass.ROUTE, 0.07, recall=recall, tiles=1, recall_rows=512)
        add(c, Impl.OURS, Pass.INDEX, 0.01)
        add(c, Impl.OURS, Pass.FWD, topk / 16)
        add(c, Impl.OURS, Pass.STEP, topk / 16 + 0.2)
        add(c, Impl.OURS, Pass.STEP_GRAPH, topk / 16 + 0.08)
    for share, heads, recall in (("none", 16, 0.92), ("kv_head", 4, 0.88), ("all", 1, 0.7)):
        c = dict(base, N=32768, Hkv=4, topk=16, share=share)
        add(c, Impl.OURS, Pass.ROUTE, 0.05 + 0.01 * heads / 4, recall=recall, layout_heads=heads)
        add(c, Impl.OURS, Pass.STEP_GRAPH, 1.1)
    return BenchFile.from_json({**ENV, "results": rows})


def test_recorded_figures_build_and_read_the_right_rows():
    from sparseattn.viz import ch08_routing as viz
    doc = synthetic_routing_file()
    assert viz.main_case(doc) == {"N": 32768, "topk": 16, "Hkv": 16, "share": "kv_head"}
    fig = viz.split_figure(doc)
    bars = [t for t in fig.data if t.type == "bar" and t.xaxis == "x"]
    assert len(bars) == 5  # route + attention for ours (its forward step launches no index), 3 terms for Flex
    assert [t.y[0] for t in bars if t.x[0] == "ours"] == pytest.approx([0.07, 1.0])
    assert sorted(t.name for t in bars if t.showlegend) == sorted({t.name for t in bars})  # each term once
    make, topks = viz.split_at_topk(doc)
    assert topks == [4, 8, 16, 32]
    assert len([t for t in make(8).data if t.type == "bar" and t.xaxis == "x"]) == 2  # no Flex off the main top-k
    over = viz.overhead_figure(doc)
    ours_share = over.data[0]
    assert list(ours_share.x) == [4096, 8192, 16384, 32768]
    assert ours_share.y[-1] == pytest.approx(100 * 0.08 / 1.12)
    flex_share = over.data[2]
    assert flex_share.y[-1] == pytest.approx(100 * 0.9 / 2.4)
    rec = viz.recall_figure(doc)
    assert list(rec.data[0].x) == [4, 8, 16, 32] and list(rec.data[0].y) == [0.6, 0.75, 0.9, 0.95]
    reuse = viz.reuse_figure(doc)
    assert list(reuse.data[1].y) == [0.92, 0.88, 0.7]
    assert list(reuse.data[2].x) == ["fresh", "drift<br>0.1", "drift<br>0.3", "drift<br>0.5"]
    assert list(reuse.data[2].y) == [0.9, 0.88, 0.8, 0.7]


def test_recorded_figures_fail_loudly_on_a_missing_series():
    from sparseattn.viz import ch08_routing as viz
    doc = synthetic_routing_file()
    no_index = BenchFile(doc.meta, tuple(r for r in doc.records if not (r.impl == Impl.FLEX and r.pass_ == Pass.INDEX)))
    with pytest.raises(LookupError, match="flex"):
        viz.split_figure(no_index)
    no_train = BenchFile(doc.meta, tuple(r for r in doc.records if r.pass_ != Pass.TRAIN_STEP_GRAPH))
    with pytest.raises(LookupError):
        viz.main_case(no_train)


def test_live_figures_on_the_cpu():
    from sparseattn.routing import route
    from sparseattn.viz import ch08_routing as viz
    q, k, v = viz.toy_inputs(N=128, block=32)
    block = route(q, k, 32, 32, topk=1)
    member = route(q, k, 32, 32, topk=1, semantics="member", member_topk=1)
    assert len(viz.selection_figure(block).data) == 4
    assert len(viz.member_figure(block, member).data) == 2
    res = viz.reroute_errors(eps=(0.0, 0.3), N=64, block=16, topk=1)
    assert res[0][1] == 0 and max(res[0][2].values()) < 1e-5, "routing again on the same inputs: same gradient"
    assert res[1][1] > 0 and max(res[1][2].values()) > 1e-3, "a different selection: a different gradient"
    assert len(viz.reroute_figure(res).data) == 3
    fig = viz.live_step(topk=1, block=16, N=64, repeat=1)
    assert "interpreter" in fig.layout.title.text and len(fig.data) == 3


def test_overhead_against_n_from_the_crossover_sweep():
    """The crossover suite's routing family: route and attention per length beside causal cuDNN; a length
    missing a series is left out; no routing rows at all is an error."""
    from sparseattn.viz import ch08_routing as viz
    env = dict(ENV, suite="crossover")
    rows = []
    for N, route, attn, cud in ((2048, 0.5, 0.6, 0.05), (4096, 0.5, 0.6, 0.15), (8192, 0.45, None, 0.5)):
        c = dict(N=N, B=1, H=16, D=128, dtype="bf16", family="routing", pattern="route_top2", keep=0.1, topk=2)
        rows.append({"case": c, "impl": Impl.OURS, "pass": Pass.ROUTE, "ms": route})
        rows.append({"case": c, "impl": Impl.OURS, "pass": Pass.FWD, "ms": attn, "predicted_ms": 0.1})
        rows.append({"case": dict(N=N, B=1, H=16, D=128, dtype="bf16", pattern="causal"), "impl": Impl.CUDNN,
                     "pass": Pass.FWD, "ms": cud, "predicted_ms": 0.1})
    # the backward part times route() again: its row is not the forward's
    c = dict(rows[0]["case"])
    rows.append({"case": c, "impl": Impl.OURS, "pass": Pass.ROUTE, "ms": 9.0, "part": "bwd"})
    rows.append({"case": c, "impl": Impl.FLEX, "pass": Pass.FWD, "ms": 0.2, "predicted_ms": 0.1})
    xo = BenchFile.from_json({**env, "results": rows})
    pts = viz.sweep_overhead(xo)
    assert [p["N"] for p in pts] == [2048, 4096] and pts[0] == {"N": 2048, "topk": 2, "route": 0.5,
                                                               "attention": 0.6, "flex": 0.2, "cudnn": 0.05}
    assert pts[1]["flex"] is None
    fig = viz.sweep_overhead_figure(xo)
    assert list(fig.data[3].y) == pytest.approx([100 * 0.5 / 1.1] * 2)
    assert list(fig.data[4].x) == [2048] and list(fig.data[4].y) == [0.2]
    # two forward-part route rows at one length: ambiguous, an error
    rows.append({"case": c, "impl": Impl.OURS, "pass": Pass.ROUTE, "ms": 0.4, "part": "fwd"})
    with pytest.raises(LookupError, match="2 forward-part route rows"):
        viz.sweep_overhead(BenchFile.from_json({**env, "results": rows}))
    with pytest.raises(LookupError, match="no routing rows"):
        viz.sweep_overhead(xo, keep=0.3)
