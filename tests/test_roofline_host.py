"""The cost model's eager host term (sparseattn.roofline.host): launch counts, disjointness, combination."""
import json

import pytest
import torch

import sparseattn as sa
import sparseattn.roofline as R
from sparseattn.ops import _launch
from sparseattn.roofline import calibrate, host as H
from sparseattn.roofline.ceilings import load_record
from sparseattn.roofline.model import host_params, predict, work_of


def _count_launches(monkeypatch, fn):
    """The kernels ``fn`` launches (their names), counted at the one place every op launches through."""
    calls = []
    real = _launch._launch_retrying

    def counting(kernel, grid, num_stages, kwargs):
        f = kernel
        while not hasattr(f, "__name__") and hasattr(f, "fn"):
            f = f.fn
        calls.append(getattr(f, "__name__", str(f)))
        return real(kernel, grid, num_stages, kwargs)

    with monkeypatch.context() as m:
        m.setattr(_launch, "_launch_retrying", counting)
        fn()
    return calls


@pytest.mark.parametrize("pattern", [sa.patterns.causal(), sa.patterns.sinks_window(16, 32)])
def test_model_launches_are_the_ops_launches(monkeypatch, pattern):
    L, D = 128, 16
    layout = sa.BlockLayout.from_mask_mod(pattern, L, L, 16, 16)
    q, k, v = (torch.randn(1, 2, L, D, requires_grad=True) for _ in range(3))
    shape = {"B": 1, "Hq": 2, "D": D, "dtype": "fp32"}
    sa.sparse_attention(q, k, v, layout).sum().backward()  # first calls: per-layout plans built once
    fwd = _count_launches(monkeypatch, lambda: sa.sparse_attention(q, k, v, layout))
    o = sa.sparse_attention(q, k, v, layout)
    bwd = _count_launches(monkeypatch, lambda: o.sum().backward())
    from sparseattn.ops.backward import bwd_config
    from sparseattn.ops.prefill import fwd_config
    assert len(fwd) == work_of(layout, shape, "fwd", fwd_config(q, layout)).launches, fwd
    assert len(bwd) == work_of(layout, shape, "bwd", bwd_config(q, layout)).launches, bwd


def test_host_calibration_is_disjoint_from_the_sweep():
    rec = load_record("h200")
    sec = rec["host"]
    points = calibrate.load_points()
    sweep = calibrate.sweep_fingerprints(points)
    rows = calibrate.host_rows(sec["recorded"], exclude=sweep)
    cal = [r for r in rows if r["role"] == "calibration"]
    assert cal and any(r["role"] == "excluded" for r in rows)
    from sparseattn.roofline.calibrate import _layout
    for r in cal:  # no calibration row is a call the sweep measured
        assert H.fingerprint(_layout(r["pattern"], r["N"]), {"B": 1, "H": 16, "D": 128, "dtype": "bf16"}) not in sweep
    # the packaged record was fitted on exactly these rows
    stored = [(r["impl"], r["pass"], r["pattern"], r["N"], r["role"]) for r in sec["paths"][sec["recorded"]]["rows"]]
    assert stored == [(r["impl"], r["pass"], r["pattern"], r["N"], r["role"]) for r in rows]
    # and the device-side models' calibration points are not sweep evaluation points either
    cal_ids = set(rec["calibration"]["calibration_points"])
    assert cal_ids.isdisjoint(rec["calibration"]["evaluation_points"])


def test_eager_call_takes_the_larger_of_device_and_host():
    rec = load_record("h200")
    layout = sa.BlockLayout.from_mask_mod(sa.patterns.causal(), 1024, 1024)
    w = work_of(layout, {"B": 1, "Hq": 16, "D": 128, "dtype": "bf16"}, "fwd")
    params = R.model.model_params("sparseattn", "fwd", record=rec)
    hp = host_params("sparseattn", "fwd", record=rec)
    ceil = R.ceilings()
    dev = predict(w, params, ceil, torch.bfloat16, graph=True)
    eager = predict(w, params, ceil, torch.bfloat16, host=hp)
    assert eager["host"] == pytest.approx(H.host_ms(hp, w.launches)) and eager["host"] > 0
    assert dev["kernels_ms"] + dev["launch"] + eager["host"] > eager["kernels_ms"] + eager["launch"]
    assert eager["kernels_ms"] + eager["launch"] == pytest.approx(
        max(dev["kernels_ms"] + dev["launch"], eager["host"]))
    c = R.cost(layout, {"B": 1, "Hq": 16, "D": 128, "dtype": "bf16"}, "fwd")
    assert c.t_host_ms == pytest.approx(eager["host"]) and c.bound == "overhead"


def test_host_term_grows_with_launches():
    p = {"host_ms": 0.1, "host_launch_ms": 0.02}
    assert H.host_ms(p, 1) == pytest.approx(0.1) and H.host_ms(p, 4) == pytest.approx(0.16)
    assert H.host_ms(None, 3) == 0.0


def test_max_fits_the_host_suite_better_than_sum():
    c = load_record("h200")["host"]["combination"]
    assert c["max"]["within_25pct"] > c["sum"]["within_25pct"]


def test_flush_rule_of_a_do_bench_timed_call():
    """``cost(l2_flush=True)``: a call timed by ``do_bench`` (an L2 flush of 256 MiB on the device before each
    call) costs its device time while its host time fits in the flush and the device time, and the slower of
    the two past that; ``flush_ms`` is the memset at the ceilings' HBM rate, not a fitted number."""
    layout = sa.BlockLayout.from_mask_mod(sa.patterns.causal(), 1024, 1024)
    shape = {"B": 1, "Hq": 16, "D": 128, "dtype": "bf16"}
    dev = R.cost(layout, shape, "fwd", graph=True).predicted_ms
    ceil = R.Ceilings.from_json(load_record("h200")["ceilings"])
    flush = H.flush_ms(ceil)
    assert flush == pytest.approx(256 * 2 ** 20 / (ceil.hbm_read_tbps * 1e12) * 1e3)
    for host in (0.0, dev, flush + dev * 0.99):
        assert R.cost(layout, shape, "fwd", host_ms=host, l2_flush=True).predicted_ms == pytest.approx(dev)
    for host in (flush + dev * 1.01, flush + dev + 0.3):
        assert R.cost(layout, shape, "fwd", host_ms=host, l2_flush=True).predicted_ms == pytest.approx(host)
        assert R.cost(layout, shape, "fwd", host_ms=host).predicted_ms == pytest.approx(host)
    assert R.cost(layout, shape, "fwd", host_ms=flush, l2_flush=True, graph=True).predicted_ms == \
        pytest.approx(dev)
    with pytest.raises(TypeError, match="l2_flush"):
        R.cost(layout, shape, "fwd", l2_flush=1)
    # the rule itself, as repredict and the host-suite check use it
    assert H.eager_ms(0.03, 0.08) == 0.08 and H.eager_ms(0.03, 0.02) == 0.03
    assert H.eager_ms(0.03, 0.08, 0.058) == 0.03 and H.eager_ms(0.03, 0.09, 0.058) == 0.09


def test_the_flush_rule_fits_the_host_suite_about_as_well_as_max():
    """On the host suite (host and event times measured one after the other) the flush rule and ``max`` are
    within a few points of each other; both far ahead of the sum."""
    c = load_record("h200")["host"]["combination"]
    assert abs(c["flush"]["within_25pct"] - c["max"]["within_25pct"]) < 0.05
    assert c["flush"]["within_25pct"] > c["sum"]["within_25pct"] + 0.3


def test_a_measured_host_time_replaces_the_recorded_one():
    """``cost(host_ms=...)``: the host time of this machine (the crossover suite measures it per part); an eager
    call takes the slower of device and host, a CUDA-graph replay has no host term."""
    layout = sa.BlockLayout.from_mask_mod(sa.patterns.causal(), 1024, 1024)
    shape = {"B": 1, "Hq": 16, "D": 128, "dtype": "bf16"}
    dev = R.cost(layout, shape, "fwd", graph=True).predicted_ms
    for host in (0.0, dev / 2, dev, dev + 0.2):
        c = R.cost(layout, shape, "fwd", host_ms=host)
        assert c.predicted_ms == pytest.approx(max(dev, host)) and c.t_host_ms == pytest.approx(host)
    assert R.cost(layout, shape, "fwd", host_ms=0.5, graph=True).predicted_ms == pytest.approx(dev)
    for bad in (-1.0, "0.1", True):
        with pytest.raises(TypeError, match="host_ms"):
            R.cost(layout, shape, "fwd", host_ms=bad)


def test_short_end_device_points_calibrate_and_sweep_rows_bring_graph_points():
    """The host suites' CUDA-graph replays are calibration points of the device-side models (none of them a call
    the sweep measured), and a sweep row's ``device_ms`` is an evaluation point of its own, priced without a
    host term; a part's measured host time prices its eager rows."""
    points = calibrate.load_points()
    dev = [p for p in points if p.id.startswith(calibrate.HOST_DEVICE_PREFIX)]
    assert dev and all(p.graph for p in dev)
    assert {p.role for p in dev} <= {"calibration", "repeat"} and any(p.role == "calibration" for p in dev)
    sweep = calibrate.sweep_fingerprints(points)
    for p in dev:
        inside = H.fingerprint(calibrate._layout(p.pattern, p.N), p.case) in sweep
        assert (p.role == "repeat") == inside, p.id
    row = {"case": {"N": 4096, "B": 1, "H": 16, "D": 128, "dtype": "bf16", "family": "window", "window": 2048,
                    "pattern": "window2048", "envelope": "causal", "kept": 0.5, "block": 128},
           "impl": "sparseattn", "pass": "fwd", "ms": 0.2, "device_ms": 0.15, "part": "fwd"}
    doc = {"suite": "crossover", "device": "NVIDIA H200", "results": [row],
           "parts": {"fwd": {"host_ms": {"sparseattn/fwd": 0.3}, "host_path": "fast-launch"}}}
    docs = {name: json.loads((calibrate.BENCH_DIR / name).read_text()) for name in calibrate.FILES}
    docs.update({name: json.loads((calibrate.BENCH_DIR / name).read_text())
                 for name in calibrate.HOST_DEVICE_FILES})
    docs["crossover-h200.json"] = doc
    got = [p for p in calibrate.load_points(docs=docs) if p.id.startswith("crossover")]
    assert [(p.id, p.graph, p.ms) for p in got] == [("crossover-h200.json#0", False, 0.2),
                                                     ("crossover-h200.json#0:graph", True, 0.15)]
    rec = load_record("h200")
    ceil = R.Ceilings.from_json(rec["ceilings"])
    eager, graph = calibrate.evaluate(got, rec["model"], ceil, rec["host"])
    assert eager["predicted_ms"] == pytest.approx(max(graph["predicted_ms"], 0.3))
    assert graph["label"].endswith("graph (crossover)")
