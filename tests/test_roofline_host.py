"""The cost model's eager host term (sparseattn.roofline.host): launch counts, disjointness, combination."""
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
