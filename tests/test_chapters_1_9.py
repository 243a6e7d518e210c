"""Chapters 1 and 9 on the CPU: their figures on synthetic recorded files (the crossover suite's row shapes, made
by pricing each point with the model and scaling it), the counts behind chapter 1's work ledger, the helpers the
notebooks call, and the exercises (solutions pass, scaffolds and typical mistakes are rejected)."""
import argparse
import math

import pytest
import torch

pytest.importorskip("plotly")

from sparseattn.bench import crossover as X  # noqa: E402
from sparseattn.bench.record import BenchFile, Impl, Pass, Record, load  # noqa: E402
from sparseattn.reference import tolerance  # noqa: E402
from sparseattn.roofline import cost  # noqa: E402
from sparseattn.roofline.cases import prefill_layout  # noqa: E402
from sparseattn.roofline.counts import Shape  # noqa: E402
from sparseattn.roofline.crossover import crossing, envelope_layout  # noqa: E402
from sparseattn.viz import COLORS  # noqa: E402
from sparseattn.viz import ch01_logical_sparsity as V1  # noqa: E402
from sparseattn.viz import ch09_roofline as V9  # noqa: E402

ENV = {"date": "2026-12-01T00:00:00+00:00", "torch": "2.11.0", "triton": "3.6.0", "device": "NVIDIA H200"}
SHAPE = Shape(B=1, Hq=16, D=128, dtype=torch.bfloat16)
#: measured = predicted x these factors (ours slower at short N, so the measured crossover moves)
SLOW = {Impl.OURS: lambda N: 1.3 if N <= 2048 else 1.05, Impl.FLEX: lambda N: 1.1, Impl.CUDNN: lambda N: 1.0}


def synthetic_crossover() -> BenchFile:
    """The crossover suite's rows at a small grid: length families at N = 1k, 2k, 4k, the kept-fraction
    families at N = 2k, fwd and bwd; decode at one shape; profiles in the meta block."""
    args = argparse.Namespace(n="1024,2048,4096", keep_n="2048", families=None, heads=16, head_dim=128)
    recs, seen = [], set()
    for pass_ in ("fwd", "bwd"):
        for pt in X.points(pass_, args):
            lay, env, case = X._layout_of(pt)
            N = pt["N"]
            case = {**X._base(N, args), **case}
            if (pass_, N, env) not in seen:
                seen.add((pass_, N, env))
                c = cost(envelope_layout(env, N, N), SHAPE, pass_, impl="cudnn")
                recs.append(Record({**X._base(N, args), "pattern": env, "envelope": env}, Impl.CUDNN, pass_,
                                   c.predicted_ms, {"predicted_ms": c.predicted_ms, "part": pass_}))
            for impl in (Impl.OURS, Impl.FLEX):
                c = cost(lay, SHAPE, pass_, impl=impl)
                recs.append(Record(case, impl, pass_, c.predicted_ms * SLOW[impl](N),
                                   {"predicted_ms": c.predicted_ms, "part": pass_}))
            if pass_ == "fwd" and pt["family"] in X.LENGTH_FAMILIES:
                recs.append(Record(case, Impl.NAIVE, pass_, 3.7 * (N / 4096) ** 2, {"part": pass_}))
    d = Shape(B=4, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, seq_len=65536, page_size=16)
    base = {"family": "decode", "N": 65536, "B": 4, "Hq": 32, "Hkv": 8, "D": 128, "dtype": "bf16", "page_size": 16}
    c = cost(None, d, "decode", impl="cudnn")
    recs.append(Record({**base, "pattern": "dense"}, Impl.CUDNN, Pass.DECODE_DENSE, c.predicted_ms,
                       {"predicted_ms": c.predicted_ms}))
    for keep in (0.1, 0.5, 1.0):
        c = cost(None, d, "decode", keep=keep, graph=True)
        case = {**base, "pattern": f"keep{keep:.2f}", "keep": keep, "kept": keep}
        recs.append(Record(case, Impl.OURS, Pass.DECODE_GRAPH, c.predicted_ms * 1.1, {"predicted_ms": c.predicted_ms}))
        recs.append(Record(case, Impl.OURS, Pass.SELECT_DECODE_GRAPH, c.predicted_ms * 1.1 + 0.02))
    profiles = {"train step": {"what": "a step", "wall_ms": 4.0, "device_busy_ms": 3.0, "device": "cuda",
                               "buckets": {"route": 0.0, "index": 0.5, "kernel": 2.5, "launch": 1.0}, "kernels": []}}
    return BenchFile.from_json({"suite": "crossover", **ENV, "profiles": profiles,
                                "results": [r.to_json() for r in recs]})


@pytest.fixture(scope="module")
def xo():
    return synthetic_crossover()


# ---- chapter 1 ------------------------------------------------------------------------------------------------------
def test_four_ways_series_merges_the_two_suites(xo):
    from sparseattn.roofline.crossover import bracket
    pre = load("prefill")
    s = V1.four_ways_series(pre, xo, "sinks64+window1024")
    assert [n for n, _, src in s[Impl.OURS] if src == "crossover"] == [1024, 2048, 4096]
    assert [n for n, _, src in s[Impl.OURS] if src == "prefill"] == [8192, 16384, 32768, 65536]
    # at 4096 both measured it: the crossover run wins (one run for the short lengths)
    assert dict((n, ms) for n, ms, _ in s[Impl.OURS])[4096] == xo.one(Impl.OURS, Pass.FWD, pattern="sinks64+window1024",
                                                                      N=4096).ms
    # cuDNN on the envelope: causal for a pattern inside the causal triangle, from the same file as the pattern
    assert dict((n, ms) for n, ms, _ in s[Impl.CUDNN])[65536] == pre.ms(Impl.CUDNN, Pass.FWD, pattern="causal", N=65536)
    assert [n for n, _, _ in s[Impl.NAIVE]] == [1024, 2048, 4096, 8192]
    # a crossover is read from one run, as the two measured lengths that bracket it
    one = V1.one_run(xo, "sinks64+window1024")
    assert all(src == "crossover" for pts in one.values() for _, _, src in pts)
    b = V1.measured_crossover(one)
    cud = dict((n, ms) for n, ms, _ in one[Impl.CUDNN])
    pts = [(n, ms) for n, ms, _ in one[Impl.OURS] if n in cud]
    assert b == bracket([n for n, _ in pts], [ms for _, ms in pts], [cud[n] for n, _ in pts], "N")
    if b["state"] == "crosses":
        assert dict(pts)[b["lo"]] >= cud[b["lo"]] and dict(pts)[b["hi"]] < cud[b["hi"]]
    fig = V1.four_ways_figure(pre, xo, "sinks64+window1024")
    runs = V1.runs_of(pre, xo, "sinks64+window1024")
    assert [f.suite for f in runs] == ["crossover", "prefill"]
    # one curve per implementation and run, in the implementation's colour; no curve mixes runs
    assert {tr.line.color for tr in fig.data} <= {COLORS[i] for i, _ in V1.FOUR_WAYS}
    assert all(("crossover run" in tr.name) != ("prefill run" in tr.name) for tr in fig.data)
    assert fig.layout.xaxis.type == "log" and fig.layout.xaxis.title.text.startswith("sequence length")
    assert all("e" not in t or "e+" in t for t in fig.layout.yaxis.ticktext)  # full tick labels
    # the log axis ends at the labelled tick just past the data, not further
    top = max(v for v in fig.layout.xaxis.tickvals)
    assert top >= 65536 and 10 ** fig.layout.xaxis.range[1] < top * 1.1 and top < 65536 * 2.6
    assert "window2048" in V1.recorded_patterns(pre, xo) and "causal" not in V1.recorded_patterns(pre, xo)
    with pytest.raises(LookupError, match="no recorded"):
        V1.four_ways_series(pre, xo, "window4096")
    with pytest.raises(LookupError, match="N=3000"):
        V1.four_ways_bars(pre, xo, "window2048", 3000)
    assert len(V1.four_ways_bars(pre, xo, "window2048", 2048).data[0].x) == 4
    # the bars of one length come from one run: at 8192 both runs measured all four, and the newer (the
    # crossover run) is drawn; at 32768 only the prefill run measured ours
    rec = load("crossover")
    bars = V1.four_ways_bars(pre, rec, "sinks64+window1024", 8192)
    assert "crossover suite" in bars.layout.title.text and bars.data[0].type == "scatter"
    assert list(bars.data[0].y) == [rec.ms(i, Pass.FWD, pattern=p, N=8192) for i, p in (
        (Impl.NAIVE, "sinks64+window1024"), (Impl.FLEX, "sinks64+window1024"), (Impl.OURS, "sinks64+window1024"),
        (Impl.CUDNN, "causal"))]
    bars = V1.four_ways_bars(pre, rec, "sinks64+window1024", 32768)
    assert "prefill suite" in bars.layout.title.text
    assert list(bars.data[0].y)[-2:] == [pre.ms(i, Pass.FWD, pattern=p, N=32768) for i, p in (
        (Impl.OURS, "sinks64+window1024"), (Impl.CUDNN, "causal"))]



def test_one_run_on_device_time():
    """``timing="device"`` reads each row's CUDA-graph replay (``device_ms``) instead of its event time; the
    naive rows and runs recorded before graph replays have none, so they drop out."""
    rec = load("crossover")
    d = V1.one_run(rec, "sinks64+window1024", timing="device")
    e = V1.one_run(rec, "sinks64+window1024")
    assert d[Impl.NAIVE] == [] and e[Impl.NAIVE]
    for impl, pattern in ((Impl.OURS, "sinks64+window1024"), (Impl.CUDNN, "causal")):
        rows = {r.case["N"]: r for r in rec.select(impl, Pass.FWD, pattern=pattern) if r.ms is not None}
        assert [ms for _, ms, _ in d[impl]] == [rows[n].get("device_ms") for n, _, _ in d[impl]]
        assert [ms for _, ms, _ in e[impl]] == [rows[n].ms for n, _, _ in e[impl]]
    # a short, host-bound call loses its host time in the replay: in the recorded run the backward's (which
    # calls are host-bound moves between runs and with each implementation's host path)
    db = V1.one_run(rec, "sinks64+window1024", Pass.BWD, timing="device")
    eb = V1.one_run(rec, "sinks64+window1024", Pass.BWD)
    assert any(dm < em / 1.5 for impl in (Impl.OURS, Impl.FLEX)
               for (n, dm, _), (_, em, _) in zip(db[impl], eb[impl]) if n <= 4096)
    pre = V1.one_run(load("prefill"), "sinks64+window1024", timing="device")
    assert all(v == [] for v in pre.values())
    assert V1.measured_crossover(pre)["state"] == "not measured"
    with pytest.raises(ValueError, match="timing must be"):
        V1.one_run(rec, "sinks64+window1024", timing="wall")

def test_work_ledger_counts_and_prices(xo):
    for name in ("sinks64+window1024", "random10%+diag"):
        lay = prefill_layout(name, 4096, device="cpu")
        led = V1.work_ledger(lay)
        f, t = led["flops"], led["tiles"]
        per_tile = 4 * 128 * 128 * 128 * 16
        assert f["envelope"] == t["envelope"] * per_tile and f["remaining"] == t["listed"] * per_tile
        assert f["removed"] == pytest.approx(f["envelope"] - f["remaining"])
        assert f["useful"] == pytest.approx(lay.stats()["logical_edges"] * 4 * 128 * 16)
        assert sum(led["time_ms"].values()) == pytest.approx(led["ours"].predicted_ms)
        assert led["envelope"] == ("causal" if name.startswith("sinks") else "dense")
        assert t["envelope"] == (32 * 33 // 2 if led["envelope"] == "causal" else 32 * 32)
    rebuilt = V1.work_ledger(lay, index_rebuilt=True)
    assert rebuilt["time_ms"]["layout build (index)"] == pytest.approx(rebuilt["index_build_ms"])
    assert rebuilt["index_build_ms"] > 0
    fig = V1.work_figure(led, {"sparseattn": 0.2, "cudnn": 0.3})
    measured = [tr for tr in fig.data if tr.type == "scatter"]
    assert fig.layout.barmode == "stack" and len(measured) == 1 and list(measured[0].x) == [0.2, 0.3]


def test_pattern_layout_names():
    assert V1.pattern_layout("window2048", 1024).stats()["logical_edges"] == 1024 * 1025 // 2  # the causal mask
    lay = V1.pattern_layout("sinks64+window1024", 2048)
    assert torch.equal(lay.to_dense(), prefill_layout("sinks64+window1024", 2048, device="cpu").to_dense())
    with pytest.raises(ValueError, match="pattern"):
        V1.pattern_layout("window 1024", 1024)


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_four_ways_small_on_the_cpu():
    rows = {r["impl"]: r for r in V1.four_ways_small(L=128, heads=1, head_dim=16, block=32)}
    assert rows[Impl.NAIVE]["scores"] == 128 * 128 and rows[Impl.OURS]["scores"] == rows[Impl.FLEX]["scores"] < 128 * 128
    assert all(rows[i]["max_err"] < 1e-5 for i in (Impl.NAIVE, Impl.OURS, Impl.FLEX))
    assert all(rows[i]["rel_err"] < tolerance(torch.float32) for i in (Impl.NAIVE, Impl.OURS, Impl.FLEX))
    assert not rows[Impl.CUDNN]["ran"] or torch.cuda.is_available()


# ---- chapter 9 ------------------------------------------------------------------------------------------------------
def test_prediction_figures(xo):
    """Predicted vs measured from the calibration record, split by timing: the points of each timing are the
    record's own class counts, each panel has one colour per implementation, the table reads the record."""
    from sparseattn.roofline import calibrate
    from sparseattn.roofline.ceilings import load_record
    cal = load_record("h200")["calibration"]
    pts = V9.sweep_points(cal)
    acc = cal["accuracy"]
    for t, name in V9.TIMINGS.items():
        assert sum(p["timing"] == t for p in pts) == acc[name]["n"] > 0
    assert all(p["id"].startswith(calibrate.EVALUATION_FILES) and p["role"] == "evaluation" for p in pts)
    assert all(p["timing"] == "device" for p in pts if p["id"].endswith(":graph"))
    fig = V9.timing_scatter(pts, "caption")
    marks = [tr for tr in fig.data if tr.mode == "markers"]
    assert {tr.xaxis for tr in marks} == {"x", "x2"}
    assert all(tr.marker.color == COLORS[tr.name.split()[0]] for tr in marks)
    assert sum(len(tr.x) for tr in marks) == len(pts)
    dev = X.ratio_summary([p["ratio"] for p in pts if p["timing"] == "device"])
    assert f"{dev['within_25pct']:.0%} within 25%" in fig.layout.annotations[0].text
    assert fig.layout.xaxis.type == fig.layout.yaxis.type == fig.layout.xaxis2.type == "log"
    box = V9.timing_ratio_figure(pts)
    assert sum(len(tr.y) for tr in box.data) == len(pts) and box.layout.xaxis.type == "log"
    table = str(V9.accuracy_table(acc))
    assert "crossover sweep: device (all)" in table and f"{acc['crossover sweep (all)']['n']}" in table
    with pytest.raises(LookupError, match="no evaluation point"):
        V9.sweep_points({"points": [p for p in cal["points"] if not p["id"].startswith("crossover")]})
    # the host table reads each part's host_ms; a run recorded before the probe has none
    rec = load("crossover")
    host_us = rec.meta["parts"]["bwd"]["host_ms"]["sparseattn/bwd"] * 1e3
    assert f"{host_us:.0f}" in str(V9.host_table(rec))
    with pytest.raises(LookupError, match="no host_ms"):
        V9.host_table(xo)
    # brackets on device time need device_ms (the synthetic run has none), eager ones do not
    assert {e["timing"] for e in V9.length_brackets(xo)} == {"eager"}
    with pytest.raises(LookupError, match="device times"):
        V9.length_brackets(xo, "device")
    dev_b = V9.length_brackets(rec, "device")
    assert {(e["pattern"], e["pass"]) for e in dev_b} >= {("sinks64+window1024", "fwd"), ("window2048", "bwd")}
    rows = X.prediction_ratios(xo)
    worst = V9.worst_points(xo, 5)
    assert [abs(math.log(r["ratio"])) for r in worst] == sorted((abs(math.log(r["ratio"])) for r in worst), reverse=True)
    assert abs(math.log(worst[0]["ratio"])) == max(abs(math.log(r["ratio"])) for r in rows)


def test_crossover_figures(xo):
    entries = X.measured_crossovers(xo)
    assert {(e["family"], e["pass"]) for e in entries} >= {("window", "fwd"), ("sinks_window", "bwd"),
                                                           ("block_random", "fwd"), ("documents", "bwd"),
                                                           ("decode", "decode")}
    for e in entries:
        fig = V9.crossover_figure(xo, e["family"], e["pass"], e["N"])
        names = [tr.name for tr in fig.data]
        assert names[:3] == ["ours, measured", "FlexAttention, measured", "ours, predicted"] or e["family"] == "decode"
        ours = fig.data[0]
        assert list(ours.y) == pytest.approx([c / o for c, o in zip(e["cudnn_ms"], e["ours_ms"])])
        assert e["ours"] == crossing(e["grid"], e["ours_ms"], e["cudnn_ms"], e["variable"])
        assert e["ours_predicted"] == crossing(e["grid"], e["ours_predicted_ms"], e["cudnn_predicted_ms"], e["variable"])
    table = V9.crossover_table(xo)
    assert len(table.rows) == len(entries) and table.column("family") == [e["pattern"] for e in entries]
    with pytest.raises(LookupError, match="no crossover data"):
        V9.crossover_figure(xo, "routing", "fwd")


def test_roofline_tails_profiles_and_explorer(xo):
    pts = V9.intensity_points(N=4096)
    ridge = V9.recorded_ceilings().ridge("bfloat16")
    assert all(p["intensity"] < ridge for p in pts if p["pass"] == "decode")
    assert all(p["intensity"] >= p["requested_intensity"] for p in pts)
    fig = V9.roofline_figure(pts)
    lo, hi = (10 ** x for x in fig.layout.xaxis.range)
    assert lo <= min(p["requested_intensity"] for p in pts) and hi >= max(p["intensity"] for p in pts)
    assert len(V9.ceilings_table().rows) == 4 + len(V9.recorded_ceilings().matmul_tflops)
    tails = V9.tail_points("window", "fwd", grid=(1024, 4096, 16384), window=2048)
    assert [t["launch_share"] for t in tails] == sorted((t["launch_share"] for t in tails), reverse=True)
    V9.tail_figure(tails)
    prof = V9.profile_figure(xo.meta["profiles"])
    assert [tr.name for tr in prof.data] == ["kernel", "index", "route", "host / idle"]
    with pytest.raises(LookupError):
        V9.profile_figure({})
    for fam in V9.EXPLORER_FAMILIES:
        lay = V9.explorer_layout(fam, 4096, 0.2)
        kept = lay.stats()["logical_edges"] / (4096 * 4097 / 2 if fam != "block_random" else 4096 ** 2)
        assert 0.1 < kept < 0.4, (fam, kept)
    t = V9.terms_figure("documents", 4096, 0.2, "fp16")
    assert "verdict" not in t.layout.title.text and ("faster here" in t.layout.title.text
                                                     or "tie (within the model's error" in t.layout.title.text)
    assert [tr.name for tr in t.data] == ["compute", "memory", "launch", "predicted total"]  # no index: built once


# ---- exercises -------------------------------------------------------------------------------------------------------
def test_chapter_1_exercises():
    from sparseattn.exercises import ch01_logical_sparsity as E
    E.check_tile_work(E.tile_work_solution)
    E.check_visit(E.visit_solution)
    for check, scaffold in ((E.check_tile_work, E.tile_work_scaffold), (E.check_visit, E.visit_scaffold)):
        with pytest.raises(AssertionError, match="blank"):
            check(scaffold)

    def no_clip(mask, block):  # physical cells as whole tiles: wrong at the ragged edge
        r = E.tile_work_solution(mask, block)
        return {**r, "physical": r["tiles"] * block * block}
    with pytest.raises(AssertionError, match="physical"):
        E.check_tile_work(no_clip)
    import triton.language as tl

    def first_row(K, COUNT, INDEX, OUT, width, Lk, BLOCK_K: tl.constexpr, D: tl.constexpr):  # reads row 0's list
        row = tl.program_id(0)
        offs_d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        for slot in range(0, tl.load(COUNT + row)):
            offs_k = tl.load(INDEX + slot) * BLOCK_K + tl.arange(0, BLOCK_K)
            acc += tl.sum(tl.load(K + offs_k[:, None] * D + offs_d[None, :], mask=(offs_k < Lk)[:, None], other=0.0), 0)
        tl.store(OUT + row * D + offs_d, acc)

    def whole_width(K, COUNT, INDEX, OUT, width, Lk, BLOCK_K: tl.constexpr, D: tl.constexpr):  # reads the padding
        row = tl.program_id(0)
        offs_d = tl.arange(0, D)
        acc = tl.zeros([D], tl.float32)
        for slot in range(0, width):
            offs_k = tl.load(INDEX + row * width + slot) * BLOCK_K + tl.arange(0, BLOCK_K)
            acc += tl.sum(tl.load(K + offs_k[:, None] * D + offs_d[None, :], mask=(offs_k < Lk)[:, None], other=0.0), 0)
        tl.store(OUT + row * D + offs_d, acc)
    for wrong in (first_row, whole_width):
        with pytest.raises(AssertionError, match="visit: query tile"):
            E.check_visit(wrong)


def test_chapter_9_exercises():
    import heapq

    import triton.language as tl
    from sparseattn.exercises import ch09_roofline as E
    E.check_roofline_ms(E.roofline_ms_solution)
    E.check_makespan(E.makespan_solution)
    E.check_read(E.read_solution)
    for check, scaffold in ((E.check_roofline_ms, E.roofline_ms_scaffold), (E.check_makespan, E.makespan_scaffold),
                            (E.check_read, E.read_scaffold)):
        with pytest.raises(AssertionError, match="blank"):
            check(scaffold)
    with pytest.raises(AssertionError, match="overlap"):
        E.check_roofline_ms(lambda F, D, P, W, T: F / P / 1e9 + D / W / 1e9 + T)  # adds compute and memory
    with pytest.raises(AssertionError, match="even split"):
        E.check_makespan(lambda units, slots: float(sum(units)) / slots)  # no tail

    def round_robin(units, slots):
        free = [0.0] * slots
        for i, u in enumerate(units):
            free[i % slots] += float(u)
        return max(free)
    with pytest.raises(AssertionError, match="makespan"):
        E.check_makespan(round_robin)
    assert heapq  # the solution's module uses it

    def unmasked(X, OUT, n, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        tl.store(OUT + tl.program_id(0), tl.sum(tl.load(X + offs).to(tl.float32), 0))
    with pytest.raises(AssertionError, match="past n"):
        E.check_read(unmasked)
