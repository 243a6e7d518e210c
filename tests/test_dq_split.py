"""The split dQ pass (``BwdConfig.dq_split``): the planner's tasks for the dQ pass's query tiles, partial dQ in
a float32 workspace summed in chunk order, against the unsplit dQ pass and the fp64 reference gradients on the
balance layouts (interpreter, small shapes, poisoned dQ and workspace)."""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P
from sparseattn.kernels import prefill_bwd
from sparseattn.ops import BwdConfig
from sparseattn.ops import backward as BW
from test_balance import BLK, LAYOUTS, L, _docs
from test_bench import _args, _check_run, cpu_stand_ins  # noqa: F401 - a fixture

TOL = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


@pytest.fixture
def poisoned(monkeypatch):
    """NaN in dQ and in the dQ workspace before the dQ kernel runs: a row that is never written, or a partial
    that is read but never written, fails the comparison. Records the dQ launches' grids."""
    real = BW.L.launch
    grids = []

    def launch(kernel, grid, **kw):
        if kernel is prefill_bwd.dq_kernel:
            kw["DQ"].fill_(float("nan"))
            if kw["WS_DQ"] is not None:
                kw["WS_DQ"].fill_(float("nan"))
            grids.append(grid)
        return real(kernel, grid, **kw)
    monkeypatch.setattr(BW.L, "launch", launch)
    return grids


def _cfg(dq_split, dq_block_m=BLK, chunk=None):
    return BwdConfig(block_m=BLK, block_n=BLK, dq_block_m=dq_block_m, dq_block_n=BLK, num_warps=4, num_stages=1,
                     chunk=chunk, dq_split=dq_split)


def _grads(layout, q, k, v, do, cfg):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = sa.sparse_attention(q, k, v, layout, bwd_config=cfg)
    grads = torch.autograd.grad(o, (q, k, v), do)
    for name, g in zip(("dq", "dk", "dv"), grads):
        assert not torch.isnan(g).any(), f"{name}: NaN or unwritten rows"
    return grads


def _ref_grads(layout, q, k, v, do):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sa.reference_attention(qd, kd, vd, layout.to_dense())
    return torch.autograd.grad(ref, (qd, kd, vd), do.double())


def _close(g, r, dtype, name):
    s = max(1.0, r.abs().max().item())
    torch.testing.assert_close(g.double() / s, r / s, **TOL[dtype], msg=lambda m: f"{name}: {m}")
    assert (r == 0).all() or sa.reference.relative_error(g, r) < sa.reference.tolerance(dtype, "bwd"), name


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_split_dq_equals_unsplit_and_reference(name, poisoned):
    layout = LAYOUTS[name]()
    q, k, v, do = (torch.randn(1, 2, L, 32) for _ in range(4))
    ref = _ref_grads(layout, q, k, v, do)
    base = _grads(layout, q, k, v, do, _cfg(None))
    for r, g, n in zip(ref, base, ("dq", "dk", "dv")):
        _close(g, r, torch.float32, n)
    for split in (1, 2, "auto"):
        dq, dk, dv = _grads(layout, q, k, v, do, _cfg(split))
        _close(dq, ref[0], torch.float32, f"dq, dq_split={split!r}")
        torch.testing.assert_close(dq, base[0], atol=2e-6, rtol=2e-6)
        assert torch.equal(dk, base[1]) and torch.equal(dv, base[2]), "dK/dV must not depend on dq_split"
    assert poisoned[0] != poisoned[1], "the split pass must launch the task list, not the plain grid"


def test_split_actually_splits_rows():
    """The test layouts do give split rows (else the reduction would go untested)."""
    layout = LAYOUTS["documents skewed"]()
    p = sa.balance.plan(layout, BLK, 1, 2, 4)
    assert int(p.n_merge[0]) > 0 and int(p.n_tasks[0]) > layout.nq


def test_split_dq_fp16_gqa_batch_and_subtiles(poisoned):
    """fp16, GQA (4 query heads on 2 KV heads, a layout head per KV head with different rows), batch 2 sharing
    the layout, dQ tiles of 16 inside layout tiles of 32, a length that is no multiple of either."""
    n = 100
    mm = P.and_masks(P.causal(), P.document(_docs([70, 7, 23])))
    layout = BlockLayout.from_mask_mod(lambda b, h, q, k: mm(b, h, q, k) & ((h == 0) | (q - k < 40)), n, n, BLK,
                                       BLK, B=1, H=2, device="cpu")
    q, do = (torch.randn(2, 4, n, 16, dtype=torch.float16) for _ in range(2))
    k, v = (torch.randn(2, 2, n, 16, dtype=torch.float16) for _ in range(2))
    ref = _ref_grads(layout, q, k, v, do)
    base = _grads(layout, q, k, v, do, _cfg(None, dq_block_m=16))
    for split in (1, 2, "auto"):
        dq, dk, dv = _grads(layout, q, k, v, do, _cfg(split, dq_block_m=16))
        _close(dq, ref[0], torch.float16, f"dq, dq_split={split!r}")
        torch.testing.assert_close(dq, base[0], **TOL[torch.float16])
        assert torch.equal(dk, base[1]) and torch.equal(dv, base[2])


def test_split_dq_is_bitwise_repeatable():
    layout = LAYOUTS["sinks+window"]()
    q, k, v, do = (torch.randn(1, 2, L, 32) for _ in range(4))
    for split in (2, "auto"):
        first = _grads(layout, q, k, v, do, _cfg(split))[0]
        assert torch.equal(first, _grads(layout, q, k, v, do, _cfg(split))[0])


def test_whole_row_tasks_are_the_plain_arithmetic():
    """A chunk as long as the longest row makes every row one task writing dQ directly: bit for bit the plain
    pass (the same tiles in the same order)."""
    layout = LAYOUTS["routed-like (bits, per-head rows)"]()
    longest = int((layout.kv_count + layout.full_count).max())
    q, k, v, do = (torch.randn(1, 2, L, 32) for _ in range(4))
    assert torch.equal(_grads(layout, q, k, v, do, _cfg(longest))[0], _grads(layout, q, k, v, do, _cfg(None))[0])


def test_atomic_path_ignores_dq_split():
    layout = LAYOUTS["causal"]()
    q, k, v = (torch.randn(1, 2, L, 32, requires_grad=True) for _ in range(3))
    o = sa.sparse_attention(q, k, v, layout, deterministic=False, bwd_config=_cfg(2))
    o.sum().backward()
    assert not torch.isnan(q.grad).any()


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, "fast", "2"])
def test_bad_dq_split_is_refused(bad):
    layout = LAYOUTS["causal"]()
    q, k, v = (torch.randn(1, 2, L, 32) for _ in range(3))
    with pytest.raises(ValueError, match="dq_split"):
        sa.sparse_attention(q, k, v, layout, bwd_config=_cfg(bad))


def test_balance_bwd_suite_on_cpu(cpu_stand_ins):
    """The ``balance_bwd`` suite end to end on the CPU (timers stand in): a plain, a split-dQ and a Flex
    backward row per case, the equal-rows calibration, and the split rows' checks recorded true."""
    from sparseattn.bench import balance as BF, balance_bwd as BB
    from sparseattn.bench.record import Impl, Pass
    cpu_stand_ins.setattr(BF, "CASES", {"documents lognormal": (2, 1), "causal H=1 N/4": (1, 0.25)})
    cpu_stand_ins.setattr(BB, "DQ_SPLIT", 1)
    records, table, cols = BB.run(_args(n="512"))
    bf = _check_run(BB, records, table, cols, (Impl.OURS, Pass.BWD), (Impl.OURS_SPLIT, Pass.BWD),
                    (Impl.FLEX, Pass.BWD))
    assert [r["case"] for r in table] == list(BF.CASES)
    for name in BF.CASES:
        assert bf.one(Impl.OURS, Pass.BWD, case=name).get("ideal_ms") > 0
        r = bf.one(Impl.OURS_SPLIT, Pass.BWD, case=name)
        assert r.ms > 0 and r.get("dkdv_equal_plain") is True and r.get("bitwise_repeatable") is True
        assert r.get("max_abs_dq_vs_plain") < 1e-4 and r.get("dq_tasks") <= r.get("dq_capacity")
    assert bf.one(Impl.OURS_SPLIT, Pass.BWD, case="documents lognormal").get("dq_split_rows") > 0
    assert {(r.case["N"], r.case["for_heads"]) for r in bf.select(Impl.OURS, Pass.BWD, case="equal rows")} == \
        {(512, 2), (128, 1)}
