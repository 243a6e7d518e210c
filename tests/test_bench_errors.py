"""The ``errors`` suite on the CPU: its measurement pieces checked against direct computations, and the whole
suite run through the Triton interpreter at tiny shapes with the GPU-only pieces replaced (see test_bench.py)."""
import json
import warnings

import pytest
import torch

import sparseattn as sa
from sparseattn.bench import errors as E
from sparseattn.bench.record import BenchFile, Impl, Pass
from test_bench import ENV, STAND_IN_WARNINGS, _args, _check_run, cpu_stand_ins  # noqa: F401 (fixture)


def test_sample_rows_cover_both_ends_sorted_and_distinct():
    assert torch.equal(E.sample_rows(100, 128), torch.arange(100))
    rows = E.sample_rows(100_000, 64, seed=3)
    assert rows[0] == 0 and rows[-1] == 99_999
    assert torch.equal(rows, torch.unique(rows)) and 40 <= rows.numel() <= 64
    assert torch.equal(rows, E.sample_rows(100_000, 64, seed=3))  # deterministic


@pytest.mark.parametrize("q_offset", [0, 17])
def test_reference_rows_equal_the_dense_reference_in_chunks(q_offset):
    q = torch.randn(1, 2, 40, 16)
    k, v = torch.randn(1, 2, 40 + q_offset, 16), torch.randn(1, 2, 40 + q_offset, 16)
    mm = sa.patterns.sinks_window(3, 9)
    rows = torch.tensor([0, 5, 6, 21, 39])
    o, lse = E.reference_rows(q, k, v, rows, mm, q_offset=q_offset, cells=2 * 2 * 57)  # 1 row per chunk
    dense = mm(0, 0, torch.arange(40)[:, None] + q_offset, torch.arange(40 + q_offset)[None, :])
    full_o, full_lse = sa.reference_attention(q, k, v, dense[None, None], return_lse=True)
    torch.testing.assert_close(o, full_o[:, :, rows], atol=1e-12, rtol=1e-12)  # fp64 sums in other orders
    torch.testing.assert_close(lse, full_lse[:, :, rows], atol=1e-12, rtol=1e-12)


def test_error_stats_by_hand():
    ref = torch.zeros(1, 1, 4, 2, dtype=torch.float64)
    ref[..., 0] = 1.0
    o = ref.clone()
    o[0, 0, 3, 1] = 0.5  # one row off by 0.5 in one element
    s = E.error_stats(o, ref, torch.tensor([[[0.0, 1.0, -float("inf"), 2.0]]]),
                      torch.tensor([[[0.0, 1.25, -float("inf"), 2.0]]], dtype=torch.float64))
    assert s["max_abs"] == 0.5 and s["rel_fro"] == pytest.approx(0.25)
    assert s["row_max_abs_p50"] == 0 and s["row_max_abs_p99"] == pytest.approx(0.485)
    assert s["row_rel_p99"] == pytest.approx(0.485)
    assert s["lse_max_abs"] == 0.25  # the -inf row is skipped
    assert s["rounding_max_abs"] == 0 and s["max_abs_vs_rounded"] == 0.5  # fp64 output: nothing to round


def test_error_against_the_rounded_reference_separates_kernels():
    """Two bf16 outputs with the same error against float64 (the rounding floor) but one of them a unit in
    the last place off the correctly rounded result: only the *_vs_rounded entries tell them apart."""
    ref = torch.tensor([1.0 + 2 ** -9, 3.0 + 2 ** -7], dtype=torch.float64).view(1, 1, 1, 2)
    good = ref.to(torch.bfloat16)  # correctly rounded (ties to even)
    ulp = torch.tensor([2 ** -7, 2 ** -6], dtype=torch.float64).view(1, 1, 1, 2)
    bad = (good.double() + ulp).to(torch.bfloat16)  # one unit in the last place above
    sg, sb = E.error_stats(good, ref), E.error_stats(bad, ref)
    assert sg["max_abs_vs_rounded"] == 0 and sb["max_abs_vs_rounded"] == 2 ** -6
    assert sg["rounding_max_abs"] == sb["rounding_max_abs"] == 2 ** -7  # 3 + 2^-7 is a tie: rounds to 3
    assert sg["max_abs"] == sb["max_abs"] == 2 ** -7  # against float64 the two look the same


def test_flex_out_lse_is_the_natural_log_lse():
    pytest.importorskip("torch.nn.attention.flex_attention")
    from torch.nn.attention.flex_attention import flex_attention
    layout = sa.BlockLayout.from_mask_mod(sa.patterns.causal(), 64, 64, 16, 16, device="cpu")
    q, k, v = (torch.randn(1, 1, 64, 16) for _ in range(3))
    with warnings.catch_warnings():  # eager Flex warns (once per process) that it is not fused
        warnings.simplefilter("ignore")
        o, lse = E.flex_out_lse(flex_attention, q, k, v, layout.to_flex())
    ref_o, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-5, rtol=1e-5)


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_errors_suite_on_cpu(cpu_stand_ins, tmp_path):  # noqa: F811 (the fixture)
    from sparseattn.bench.__main__ import SUITES, write_outputs
    assert SUITES["errors"] == "errors"
    cpu_stand_ins.setattr(E, "DTYPES", {"fp32": torch.float32, "fp16": torch.float16})
    cpu_stand_ins.setattr(E, "FULL_ROWS", 128)  # N=256 samples its rows
    cpu_stand_ins.setattr(E, "SAMPLED_ROWS", 48)
    cpu_stand_ins.setattr(E, "REFERENCE_CELLS", 16 * 256)  # several reference chunks
    cpu_stand_ins.setattr(E, "REPEAT_N", 128)
    cpu_stand_ins.setattr(E, "REPEATS", 2)
    records, table, cols = E.run(_args(n="128,256"))
    bf = _check_run(E, records, table, cols, (Impl.OURS, Pass.FWD), (Impl.FLEX, Pass.FWD), (Impl.CUDNN, Pass.FWD),
                    (Impl.OURS, Pass.BWD), (Impl.OURS_ATOMIC, Pass.BWD))
    assert bf.distinct("N", check="error") == [128, 256]
    assert {r.case["rows"] for r in bf.select(Impl.OURS, Pass.FWD, check="error", N=256)} == {
        E.sample_rows(256, 48).numel()}
    for dname, tol in (("fp32", 2e-5), ("fp16", 3e-3)):
        for impl in (Impl.OURS, Impl.FLEX, Impl.CUDNN):
            r = bf.one(impl, Pass.FWD, check="error", N=256, dtype=dname)
            assert 0 < r.get("max_abs") < tol, (impl, dname, r.extra)
            assert r.get("row_max_abs_p50") <= r.get("row_max_abs_p99") <= r.get("max_abs")
        assert bf.one(Impl.OURS, Pass.FWD, check="error", N=256, dtype=dname).get("lse_max_abs") < 1e-4
        assert "lse_max_abs" not in bf.one(Impl.CUDNN, Pass.FWD, check="error", N=256, dtype=dname).extra
    for r in bf.select(Impl.OURS, Pass.BWD, check="repeat"):
        assert r.get("bitwise_repeatable") is True and r.get("dq_run_to_run_max_abs") == 0
    assert bf.one(Impl.OURS, Pass.FWD, check="repeat", dtype="fp32").get("bitwise_repeatable") is True
    assert "dq_run_to_run_max_abs" in bf.one(Impl.OURS_ATOMIC, Pass.BWD, check="repeat", dtype="fp32").extra
    path = write_outputs(E, records, str(tmp_path), ENV, sweep=False, family=None)[0]
    assert BenchFile.from_json(json.loads(open(path).read())).records == tuple(records)
    assert [r["dtype"] for r in E.summary(bf)] == ["fp16"] * 3 + ["fp32"] * 3


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_errors_suite_without_flex(cpu_stand_ins):  # noqa: F811 (the fixture)
    cpu_stand_ins.setattr(E, "DTYPES", {"fp32": torch.float32})
    cpu_stand_ins.setattr(E, "REPEATS", 2)
    records, table, cols = E.run(_args(n="64", no_flex=True))
    assert {r.impl for r in records} == {Impl.OURS, Impl.OURS_ATOMIC, Impl.CUDNN}
    assert "flex_max_abs" not in table[0]
