"""The ``crossover`` bench suite on the CPU (interpreter, tiny shapes, the GPU-only pieces replaced by the
stand-ins of test_bench), its time budget and merging of parts, and the measured-crossover analysis on
synthetic files."""
import argparse
import json
import math

import pytest
import torch

from sparseattn import BlockLayout, patterns as P
from sparseattn.bench import crossover as X
from sparseattn.bench.record import BenchFile, Impl, Pass, Record, load_path
from sparseattn.roofline import cost
from sparseattn.roofline.counts import Shape
from sparseattn.roofline.crossover import crossing, envelope_layout, family_layout
from test_bench import ENV, STAND_IN_WARNINGS, cpu_stand_ins  # noqa: F401  (a fixture)

pytestmark = [STAND_IN_WARNINGS[0], STAND_IN_WARNINGS[1]]


@pytest.fixture
def tiny(cpu_stand_ins, tmp_path):  # noqa: F811
    """The suite at tiny shapes: two lengths, one keep length, two kept fractions, one small decode shape."""
    m = cpu_stand_ins
    m.setattr(X, "KEEP_FAMILIES", {"block_random": (0.25, 1.0), "documents": (0.5, 1.0)})
    m.setattr(X, "DECODE_SHAPES", ((1, 256),))
    m.setattr(X, "DECODE_HQ", 4)
    m.setattr(X, "DECODE_HKV", 2)
    m.setattr(X, "DECODE_D", 32)
    m.setattr(X, "DECODE_KEEPS", (0.25, 1.0))
    m.setattr(X, "PROFILE", dict(N=256, heads=1, head_dim=32, batch=1, seq_len=256))
    m.setattr(X, "HOST_PROBE", ("window1024", 256))
    m.setattr(X, "HOST_PROBE_CALLS", 2)
    return tmp_path


def _args(out, **kw):
    base = dict(n="256,384", heads=1, head_dim=32, no_flex=False, naive_max_bytes=24e9, device="cpu", out=str(out),
                part="all", families=None, keep_n="256", budget_s=1e9, merge=None, meta={})
    return argparse.Namespace(**{**base, **kw})


def test_suite_on_cpu_every_series_with_predictions(tiny):
    args = _args(tiny)
    records, table, cols = X.run(args)
    bf = load_path(tiny / "crossover-cpu.json")  # written as it went, and complete at the end
    assert [r.to_json() for r in bf.records] == [r.to_json() for r in records]
    have = {(r.impl, r.pass_) for r in records}
    for series in [(Impl.OURS, Pass.FWD), (Impl.FLEX, Pass.FWD), (Impl.CUDNN, Pass.FWD), (Impl.NAIVE, Pass.FWD),
                   (Impl.OURS, Pass.BWD), (Impl.FLEX, Pass.BWD), (Impl.CUDNN, Pass.BWD),
                   (Impl.OURS, Pass.DECODE_GRAPH), (Impl.CUDNN, Pass.DECODE_DENSE),
                   (Impl.OURS, Pass.SELECT_DECODE_GRAPH)]:
        assert series in have, series
    # every row of ours, Flex and cuDNN carries the model's prediction; naive, the selected step and routing
    # itself do not (the model takes the routing time as its input T_route, it does not predict it)
    assert (Impl.OURS, Pass.ROUTE) in have and bf.select(Impl.OURS, Pass.FWD, family="routing")
    for r in records:
        modelled = r.impl in (Impl.OURS, Impl.FLEX, Impl.CUDNN) and r.pass_ not in (Pass.SELECT_DECODE_GRAPH,
                                                                                    Pass.ROUTE)
        assert (r.get("predicted_ms") is not None) == modelled, (r.impl, r.pass_)
        assert r.ms is not None
    # our prefill rows also carry the back-to-back loop time (no L2 flush between calls)
    assert all(r.get("loop_ms") is not None for r in bf.select(Impl.OURS, Pass.FWD) + bf.select(Impl.OURS, Pass.BWD)
               if r.case.get("family") != "routing")
    # ... and it is the model's number for that row's layout and shape
    # (the eager call with the host time the part measured first for the op; and its CUDA-graph replay)
    host = bf.meta["parts"]["bwd"]["host_ms"]
    assert set(host) == {"sparseattn/bwd", "flex/bwd", "cudnn/bwd"} and all(x > 0 for x in host.values())
    assert bf.meta["parts"]["fwd"]["host_probe"] == {"pattern": "window1024", "N": 256}
    assert bf.meta["parts"]["fwd"]["host_path"] == "fast-launch"
    row = bf.one(Impl.OURS, Pass.BWD, family="sinks_window", N=384)
    lay, env, kept = family_layout("sinks_window", 384, sinks=64, window=1024)
    assert row.case["kept"] == kept and row.case["envelope"] == env == "causal"
    shape = Shape(B=1, Hq=1, D=32)
    assert row.get("predicted_ms") == pytest.approx(
        cost(lay, shape, "bwd", host_ms=host["sparseattn/bwd"]).predicted_ms)
    assert row.get("device_predicted_ms") == pytest.approx(cost(lay, shape, "bwd", graph=True).predicted_ms)
    dense = bf.one(Impl.CUDNN, Pass.FWD, pattern="dense", N=256)
    assert dense.get("predicted_ms") == pytest.approx(
        cost(envelope_layout("dense", 256, 256), shape, "fwd", impl="cudnn",
             host_ms=bf.meta["parts"]["fwd"]["host_ms"]["cudnn/fwd"]).predicted_ms)
    # kept fractions: block_random from the drawn tiles (diagonal included), documents of the causal triangle
    assert [r.case["kept"] for r in bf.select(Impl.OURS, Pass.FWD, family="block_random")] == [
        family_layout("block_random", x, N=256)[2] for x in (0.25, 1.0)]
    assert bf.one(Impl.OURS, Pass.FWD, family="documents", keep=0.5).case["kept"] == pytest.approx(
        2 * (128 * 129 / 2) / (256 * 257 / 2))
    # naive only on the length families; FlexAttention points record their first call
    assert {r.case["family"] for r in bf.select(Impl.NAIVE)} == {"window", "sinks_window"}
    assert all(r.get("first_call_s") >= 0 for r in bf.select(Impl.FLEX))
    assert set(bf.meta["parts"]) == {"fwd", "bwd", "decode"} and set(bf.meta["profiles"]) == {
        "train_step_sinks64+window1024_N256", "decode_step_keep0.10_L256"}
    assert args.meta["profiles"] == bf.meta["profiles"]  # what main() writes at the end
    # the table: one line per family and pass (and keep length), decode per batch, and the summary last
    assert [(t["family"], t["pass"]) for t in table[:-1]] == [
        ("window2048", "fwd"), ("sinks64+window1024", "fwd"), ("block_random", "fwd"), ("documents", "fwd"),
        ("routing", "fwd"), ("window2048", "bwd"), ("sinks64+window1024", "bwd"), ("block_random", "bwd"),
        ("documents", "bwd"), ("routing", "bwd"), ("decode", "decode")]
    assert [X.part_of(r) for r in records][:3] == ["decode"] * 3  # decode runs first
    assert table[-1]["family"] == "all rows" and table[-1]["points"] == len(X.prediction_ratios(bf))
    assert all(set(t) <= set(cols) for t in table)


def test_budget_skips_flexattention_and_keeps_the_rest(tiny, monkeypatch):
    ticks = iter(range(10**6))
    orig = X.Budget.__init__
    # one second passes per look at the clock: enough for every point of ours, not for a FlexAttention compile
    monkeypatch.setattr(X.Budget, "__init__", lambda self, seconds: orig(self, seconds, lambda: float(next(ticks))))
    records, table, _ = X.run(_args(tiny, part="fwd", families="window,block_random", budget_s=X.RESERVE_S + 20))
    flex = [r for r in records if r.impl == Impl.FLEX]
    assert flex and all(r.ms is None and "time budget" in r.get("error") for r in flex)
    assert all(r.ms is not None for r in records if r.impl != Impl.FLEX)  # ours, cuDNN, naive all measured
    assert {r.case["family"] for r in records if r.impl == Impl.OURS} == {"window", "block_random"}
    assert all(t["flex"] == "not measured" for t in table[:-1])


def test_eager_times_are_retimed_in_interleaved_rounds(tiny, monkeypatch):
    """At the end of a part, every point up to ``RETIME_MAX_N`` is timed again, ours, FlexAttention and cuDNN in
    turn: ``ms`` becomes the median of the rounds, the first timing stays as ``ms_first``; a point above the
    limit keeps its one timing; a cuDNN row shared by two points is timed in both points' rounds."""
    monkeypatch.setattr(X, "RETIME_MAX_N", 256)
    records, _, _ = X.run(_args(tiny, part="fwd", families="window,block_random", n="256,384"))
    bf = BenchFile.from_json({"suite": "crossover", **ENV, "results": [r.to_json() for r in records]})
    for impl in (Impl.OURS, Impl.FLEX):
        for r in bf.select(impl, Pass.FWD):
            if r.case["N"] > 256:
                assert r.get("eager_rounds") is None and r.get("ms_first") is None
                continue
            rounds = r.get("eager_rounds")
            assert len(rounds) == X.RETIME_ROUNDS and r.get("ms_first") < min(rounds)  # the stand-in timer counts up
            assert r.ms == pytest.approx(sorted(rounds)[len(rounds) // 2], abs=1e-5)
    causal = bf.one(Impl.CUDNN, Pass.FWD, pattern="causal", N=256)  # the window point's envelope
    dense = bf.one(Impl.CUDNN, Pass.FWD, pattern="dense", N=256)  # both block-random points'
    assert len(causal.get("eager_rounds")) == X.RETIME_ROUNDS
    assert len(dense.get("eager_rounds")) == 2 * X.RETIME_ROUNDS
    assert bf.one(Impl.CUDNN, Pass.FWD, pattern="causal", N=384).get("eager_rounds") is None


def test_retimed_calls_run_their_own_point(tiny, monkeypatch):
    """The callable kept for the re-timing runs the point's own layout and inputs, also for the routing family,
    whose points come from one loop (a closure over the loop's names timed the last point's layout: the
    first GPU run with re-timing recorded every routed forward at the cost of the last one)."""
    kept = {}
    monkeypatch.setattr(X, "retime", lambda run, pass_: kept.update(run.eager))
    seen = []
    real = X.sparse_attention
    monkeypatch.setattr(X, "sparse_attention", lambda q, k, v, lay, **kw: seen.append((q.shape[2], lay)) or
                        real(q, k, v, lay, **kw))
    X.run(_args(tiny, part="fwd", families="routing", keep_n="256,384", no_flex=True))
    ours = {key: g[Impl.OURS] for key, g in kept.items() if Impl.OURS in g}
    assert len(ours) == len(X.ROUTING_KEEPS) * 2
    layouts = []
    for (pass_, family, x, N), (_, timed) in ours.items():
        seen.clear()
        timed()
        (n, lay), = seen
        nk = math.ceil(N / 128)
        assert family == "routing" and n == N and lay.width >= max(1, round(x * nk)) and lay.q_len == N
        layouts.append(lay)
    assert len({id(lay) for lay in layouts}) == len(layouts)


def test_retiming_stops_when_the_budget_cannot_cover_a_round(tiny, capsys):
    run = X._Run(_args(tiny), dict(ENV), [], {"parts": {}})
    calls = []
    for impl in (Impl.OURS, Impl.FLEX):
        run.add(Record({"N": 256}, impl, Pass.FWD, 1.0), lambda impl=impl: calls.append(impl), ("fwd", "w", 256, 256))
    run.budget = X.Budget(X.RESERVE_S + 0.1)
    X.retime(run, "fwd")
    assert not calls and all(r.get("eager_rounds") is None for r in run.records)
    assert "re-timing stopped after 0 of" in capsys.readouterr().err


def test_parts_merge_into_one_file(tiny):
    first = tiny / "first"
    X.run(_args(first, part="fwd", families="window", n="256"))
    second = tiny / "second"
    records, table, _ = X.run(_args(second, part="bwd", families="window", n="256",
                                    merge=str(first / "crossover-cpu.json")))
    bf = load_path(second / "crossover-cpu.json")
    assert {X.part_of(r) for r in bf.records} == {"fwd", "bwd"}
    assert "profiles" not in bf.meta  # no decode part in either
    third = tiny / "third"
    X.run(_args(third, part="decode"))
    X.run(_args(third / "merged", part="bwd", families="window", n="256", merge=str(third / "crossover-cpu.json")))
    assert set(load_path(third / "merged" / "crossover-cpu.json").meta["profiles"]) == set(
        load_path(third / "crossover-cpu.json").meta["profiles"])  # the decode part's profiles are kept
    assert len(bf.select(Impl.OURS, Pass.FWD)) == len(bf.select(Impl.OURS, Pass.BWD)) == 1
    assert set(bf.meta["parts"]) == {"fwd", "bwd"}
    # measuring a part again replaces that part's rows
    records, _, _ = X.run(_args(second / "again", part="bwd", families="window", n="256",
                                merge=str(second / "crossover-cpu.json")))
    assert len([r for r in records if r.pass_ == Pass.BWD and r.impl == Impl.OURS]) == 1
    doc = json.loads((first / "crossover-cpu.json").read_text())
    doc["device"] = "NVIDIA H200"
    (tiny / "other.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="measured on"):
        X.run(_args(tiny / "x", part="bwd", families="window", n="256", merge=str(tiny / "other.json")))
    doc["suite"], doc["device"] = "prefill", "cpu"
    (tiny / "prefill.json").write_text(json.dumps(doc))
    with pytest.raises(ValueError, match="crossover"):
        X.run(_args(tiny / "x", part="bwd", families="window", n="256", merge=str(tiny / "prefill.json")))


def test_routing_family_with_a_stand_in_router(tiny, monkeypatch):
    """The hook for sparseattn.routing.route (issue 14): a stand-in router with the documented signature."""
    from sparseattn import routing

    def route(q, k, block_q, block_k, topk, causal=True):
        n = math.ceil(q.shape[2] / block_q)
        scores = torch.rand(n, n, generator=torch.Generator().manual_seed(topk))
        scores = scores.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(), -1)
        keep = torch.zeros(n, n, dtype=torch.bool).scatter_(1, scores.topk(min(topk, n), -1).indices, True)
        keep &= torch.ones(n, n, dtype=torch.bool).tril()
        return BlockLayout.from_block_mask(keep.view(1, 1, n, n), q.shape[2], k.shape[2], block_q, block_k,
                                           mask_mod=P.causal())  # causal inside the diagonal tiles
    monkeypatch.setattr(routing, "route", route, raising=False)
    records, _, _ = X.run(_args(tiny, part="fwd", families="routing", keep_n="384", no_flex=True))
    routed = [r for r in records if r.case.get("family") == "routing"]
    assert {r.pass_ for r in routed} == {Pass.ROUTE, Pass.FWD}
    fwd = [r for r in routed if r.pass_ == Pass.FWD]
    assert [r.case["topk"] for r in fwd] == [max(1, round(x * 3)) for x in X.ROUTING_KEEPS]
    assert all(r.get("predicted_ms") > 0 and r.case["envelope"] == "causal" for r in fwd)


def test_routing_family_is_skipped_without_a_router(tiny, capsys):
    from sparseattn import routing
    if hasattr(routing, "route"):
        pytest.skip("sparseattn.routing.route exists: the family runs")
    records, _, _ = X.run(_args(tiny, part="fwd", families="routing", no_flex=True))
    assert not records and "no route()" in capsys.readouterr().err


def test_bad_options():
    with pytest.raises(ValueError, match="--part"):
        X.parts_of("forward")
    assert X.parts_of("all") == ["decode", "fwd", "bwd"] and X.parts_of("bwd,decode") == ["decode", "bwd"]
    with pytest.raises(ValueError, match="--families"):
        X.run(_args("/nonexistent", families="window,windows"))


def test_spread_order_covers_the_grid_evenly():
    for n in range(12):
        order = X.spread_order(n)
        assert sorted(order) == list(range(n))
        if n > 2:
            assert order[:2] == [0, n - 1] and order[2] == (n - 1) // 2


# ---- the measured crossovers, on a synthetic file ---------------------------------------------------------------
def _synthetic() -> BenchFile:
    """Ours crosses causal cuDNN between N=2048 and 4096 (window), Flex between 4096 and 8192; block_random at one
    length crosses at kept 0.4 (ours = 2 x kept x cuDNN); decode crosses at kept 0.5."""
    rows = []
    base = {"B": 1, "H": 16, "D": 128, "dtype": "bf16"}
    for N, ours, flex, dense in ((1024, 2.0, 4.0, 1.0), (2048, 1.5, 2.0, 1.0), (4096, 0.5, 1.5, 1.0),
                                 (8192, 0.25, 0.5, 1.0)):
        case = {**base, "N": N, "family": "window", "pattern": "window2048", "envelope": "causal", "kept": 0.5}
        # device times (graph replays): the kernels alone; ours' host made its short calls slower than its kernels
        rows.append(Record(case, Impl.OURS, Pass.FWD, ours, {"predicted_ms": ours * 1.1, "device_ms": ours * 0.6}))
        rows.append(Record(case, Impl.FLEX, Pass.FWD, flex, {"predicted_ms": flex, "device_ms": flex}))
        rows.append(Record({**base, "N": N, "pattern": "causal", "envelope": "causal"}, Impl.CUDNN, Pass.FWD, dense,
                           {"predicted_ms": dense, "device_ms": dense}))
    rows.append(Record({**base, "N": 4096, "pattern": "dense", "envelope": "dense"}, Impl.CUDNN, Pass.FWD, 2.0,
                       {"predicted_ms": 2.0}))
    for kept in (0.1, 0.2, 0.4, 0.8, 0.8):  # a repeated kept fraction is counted once
        case = {**base, "N": 4096, "family": "block_random", "pattern": f"random{kept}+diag", "envelope": "dense",
                "kept": kept, "keep": kept}
        rows.append(Record(case, Impl.OURS, Pass.FWD, 2 * kept * 2.0, {"predicted_ms": 2 * kept * 2.0}))
    dcase = {"family": "decode", "N": 65536, "B": 4, "Hq": 32, "Hkv": 8, "D": 128, "dtype": "bf16", "page_size": 16}
    rows.append(Record({**dcase, "pattern": "dense"}, Impl.CUDNN, Pass.DECODE_DENSE, 1.0, {"predicted_ms": 1.0}))
    for kept in (0.25, 0.5, 1.0):
        case = {**dcase, "pattern": f"keep{kept:.2f}", "keep": kept, "kept": kept}
        rows.append(Record(case, Impl.OURS, Pass.DECODE_GRAPH, 2 * kept, {"predicted_ms": 2 * kept}))
        rows.append(Record(case, Impl.OURS, Pass.SELECT_DECODE_GRAPH, 2 * kept + 0.25))
    return BenchFile.from_json({"suite": "crossover", **ENV, "results": [r.to_json() for r in rows]})


def test_measured_crossovers_on_a_synthetic_file():
    bf = _synthetic()
    entries = {(e["family"], e["pass"], e["N"]): e for e in X.measured_crossovers(bf)}
    w = entries[("window", "fwd", None)]
    assert w["grid"] == [1024, 2048, 4096, 8192]
    assert w["ours"] == crossing(w["grid"], [2.0, 1.5, 0.5, 0.25], [1.0] * 4, "N")
    assert 2048 < w["ours"][0] < 4096 and 4096 < w["flex"][0] < 8192
    assert w["ours_predicted"][1] == "crosses" and w["ours_predicted"][0] > w["ours"][0]  # predicted 10% slower
    # the same crossings on the device times: ours' kernels cross between 1024 and 2048, Flex's as measured
    assert w["ours_device"] == crossing(w["grid"], [1.2, 0.9, 0.3, 0.15], [1.0] * 4, "N")
    assert 1024 < w["ours_device"][0] < 2048 and w["flex_device"] == w["flex"]
    b = entries[("block_random", "fwd", 4096)]
    assert b["ours_device"] == b["flex_device"] == (None, "not measured")  # rows without device times
    b = entries[("block_random", "fwd", 4096)]
    assert b["grid"] == [0.1, 0.2, 0.4, 0.8] and b["ours"][0] == pytest.approx(0.5)  # ours = cuDNN at kept 0.5
    assert b["flex"] == (None, "not measured")
    d = entries[("decode", "decode", 65536)]
    assert d["ours"][0] == pytest.approx(0.5) and d["step"][1] == "crosses" and d["step"][0] < 0.5
    table = X.crossover_table(bf)
    assert table[0]["ours"] == f"{w['ours'][0]:.0f}" and table[-1]["points"] == len(X.prediction_ratios(bf))
    ratios = sorted(x["ratio"] for x in X.prediction_ratios(bf))
    assert X.ratio_summary(ratios)["within_25pct"] == 1.0 and X.ratio_summary([])["n"] == 0


def test_main_passes_the_crossover_options_and_writes_the_suite_meta(monkeypatch, tmp_path):
    """main() on a 'GPU' with a stand-in suite: the crossover options reach run(), and what run() puts in
    args.meta lands in the file's meta block."""
    import types

    from sparseattn.bench import __main__ as M
    from sparseattn.bench import _common as BC
    from sparseattn.ops import config
    seen = {}

    def run(args):
        seen.update(part=args.part, families=args.families, keep_n=args.keep_n, budget=args.budget_s,
                    merge=args.merge, n=args.n)
        args.meta["profiles"] = {"step": {"wall_ms": 1.0}}
        return [Record({"N": 1, "pattern": "causal"}, Impl.CUDNN, Pass.FWD, 1.0)], [{"family": "x"}], X.COLUMNS
    fake = types.SimpleNamespace(NAME="crossover", DEFAULT_N=X.DEFAULT_N, CONFIG_KIND=None, run=run)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(M, "suite_module", lambda name: fake)
    monkeypatch.setattr(BC, "environment", lambda: dict(ENV))
    monkeypatch.setattr(config, "gpu_family", lambda device, interpreter: "sm90")
    assert M.main(["crossover", "--out", str(tmp_path), "--part", "bwd", "--families", "window", "--keep-n", "4096",
                   "--budget-s", "300", "--merge", "old.json"]) == 0
    assert seen == {"part": "bwd", "families": "window", "keep_n": "4096", "budget": 300.0, "merge": "old.json",
                    "n": X.DEFAULT_N}
    doc = json.loads((tmp_path / "crossover-h200.json").read_text())
    assert doc["profiles"] == {"step": {"wall_ms": 1.0}} and len(doc["results"]) == 1
    assert "crossover" in M.SUITES and M.parser().parse_args(["crossover"]).part == "all"


def test_bracket_gives_the_measured_points_around_a_crossing():
    from sparseattn.roofline.crossover import bracket, describe_bracket
    b = bracket([1024, 2048, 4096, 8192], [2.0, 2.0, 1.0, 1.0], [1.0, 1.5, 1.5, 3.0], "N")
    assert (b["state"], b["lo"], b["hi"], b["n"]) == ("crosses", 2048, 4096, 4)
    assert describe_bracket(b) == "between N = 2048 and 4096"
    one = bracket([4096], [1.0], [2.0], "N")
    assert one["state"] == "too few" and describe_bracket(one) == "not enough points (n=1)"
    assert describe_bracket(bracket([1, 2], [1, 1], [2, 2], "N")) == "ahead at all 2 lengths"
    late = bracket([1, 2, 4], [1, 3, 3], [2, 2, 2], "N")  # ahead early, behind at the end: not "behind at all"
    assert describe_bracket(late) == "behind at the longest length (ahead at 1 of 3)"
    k = bracket([0.1, 0.2, 0.5], [1, 1, 3], [2, 2, 2], "keep")
    assert (k["lo"], k["hi"]) == (0.2, 0.5) and describe_bracket(k, "keep") == "between kept 0.2 and 0.5"
