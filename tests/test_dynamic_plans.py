"""Launch plans of dynamic layouts (sparseattn/ops/_launch.py ``dynamic_plan``): layouts of one shape share
one cached plan, every call reads its own layout's tables, forward and backward, against the fp64 reference
on each layout's dense mask; the mask path decides ``BITS``; document predicates fall back to per-call
arguments; the shape-only row order."""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P
from sparseattn.ops import _launch as L


def _grads(q, k, v, layout, do):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = sa.sparse_attention(qg, kg, vg, layout)
    o.backward(do)
    return o.detach(), qg.grad, kg.grad, vg.grad


def _reference(q, k, v, layout, do):
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    o = sa.reference_attention(qd, kd, vd, layout.to_dense())
    o.backward(do.double())
    return o.detach(), qd.grad, kd.grad, vd.grad


def test_routed_layouts_of_one_shape_share_a_plan_and_use_their_own_tables():
    torch.manual_seed(0)
    N, D = 512, 32
    q = torch.randn(1, 2, N, D)
    k, v = torch.randn(1, 2, N, D), torch.randn(1, 2, N, D)
    do = torch.randn_like(q)
    first = sa.route(q, k, 64, 64, topk=1, sinks=0, causal=True)
    second = sa.route(-q, k, 64, 64, topk=1, sinks=0, causal=True)
    assert not torch.equal(first.full_index, second.full_index)  # two different selections of one shape
    L._SHAPE_PLANS.clear()
    for layout in (first, second, first):
        got = _grads(q, k, v, layout, do)
        want = _reference(q, k, v, layout, do)
        for g, w in zip(got, want):
            assert g.isfinite().all()
            assert ((g.double() - w).norm() / w.norm()).item() < 1e-4
    plans = [key for key in L._SHAPE_PLANS if isinstance(key[0], tuple)]
    assert len(plans) == 2, plans  # one forward plan, one backward plan, for both layouts


def test_a_dynamic_layout_with_a_predicate_passes_no_bits():
    layout = sa.route(torch.randn(1, 1, 128, 16), torch.randn(1, 1, 128, 16), 64, 64, topk=1)
    with_bits = BlockLayout.from_lists(layout.kv_count, layout.kv_index, layout.full_count, layout.full_index,
                                       q_len=128, kv_len=128, block_q=64, block_k=64, mask_mod=P.causal(),
                                       tile_bits=torch.zeros(1, 1, 2, layout.width, 64 * 64 // 8, dtype=torch.uint8),
                                       trusted=True)
    assert L.mask_path(with_bits).pred is not None
    assert L.layout_tables(with_bits)["BITS"]() is None


def test_document_predicates_build_their_plan_per_call():
    docs = torch.tensor([0] * 100 + [1] * 156)
    static = BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(docs)), 256, 256, 64, 64)
    layout = BlockLayout.from_lists(static.kv_count, static.kv_index, static.full_count, static.full_index,
                                    q_len=256, kv_len=256, block_q=64, block_k=64, mask_mod=static.mask_mod,
                                    trusted=True)
    assert L.shape_key(layout) is None
    plan, per_call = L.dynamic_plan(layout, "k", lambda: {"kwargs": L.Static(DOC=1, KV_COUNT=2), "grid": (1,)},
                                    L.layout_tables(layout))
    assert plan == {"kwargs": None, "grid": (1,)} and per_call == {"kwargs": {"DOC": 1, "KV_COUNT": 2}}
    torch.manual_seed(1)
    q, k, v = (torch.randn(1, 1, 256, 16) for _ in range(3))
    do = torch.randn_like(q)
    for g, w in zip(_grads(q, k, v, layout, do), _reference(q, k, v, layout, do)):
        assert ((g.double() - w).norm() / w.norm()).item() < 1e-4


def test_a_dynamic_layouts_rows_run_last_tile_first():
    layout = sa.route(torch.randn(1, 1, 300, 16), torch.randn(1, 1, 300, 16), 64, 64, topk=2)
    assert L.row_order(layout, 32).tolist() == list(range(9, -1, -1))
    static = BlockLayout.from_mask_mod(P.causal(), 300, 300, 64, 64)
    assert L.row_order(static, 64).tolist() == [4, 3, 2, 1, 0]


def _gqa_split_case(seed):
    """GQA inputs (4 query, 2 KV heads, N = 256), a backward config that splits columns (chunk=2), and two
    layouts: sinks + window (static) and a routed one (dynamic)."""
    from sparseattn import BwdConfig
    torch.manual_seed(seed)
    N, D = 256, 32
    q = torch.randn(1, 4, N, D)
    k, v = torch.randn(1, 2, N, D), torch.randn(1, 2, N, D)
    cfg = BwdConfig(block_m=32, block_n=64, dq_block_m=64, dq_block_n=32, num_warps=4, num_stages=1, chunk=2)
    layouts = [BlockLayout.from_mask_mod(P.sinks_window(16, 64), N, N, 64, 64),
               sa.route(q, k, 64, 64, topk=1, causal=True)]
    return q, k, v, torch.randn_like(q), cfg, layouts


def test_one_launch_backward_is_bitwise_the_two_launch_backward():
    """``BwdConfig.overlap`` runs the dK/dV and dQ programs in one launch (``bwd_kernel``); the gradients are
    the bits of the two kernels launched apart, for GQA, split columns, a dynamic layout, tensor descriptors and
    a dQ pipeline depth other than the dK/dV pass's, and match the fp64 reference."""
    from dataclasses import replace
    q, k, v, do, cfg, layouts = _gqa_split_case(3)
    launched = []
    real = L.launch

    def recording(kernel, grid, **kw):
        launched.append(getattr(getattr(kernel, "fn", kernel), "__name__", ""))
        return real(kernel, grid, **kw)
    L.launch = recording
    try:
        for layout in layouts:
            # a dQ pipeline depth of its own stays in the one launch (each kind of program its own loop depth)
            for c in (cfg, replace(cfg, tma=True), replace(cfg, dq_num_stages=cfg.num_stages + 1)):
                got = {}
                for overlap in (True, False):
                    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
                    o = sa.sparse_attention(qg, kg, vg, layout, bwd_config=replace(c, overlap=overlap))
                    launched.clear()
                    got[overlap] = torch.autograd.grad(o, (qg, kg, vg), do)
                    assert ("bwd_kernel" in launched) == overlap and ("dq_kernel" in launched) != overlap
                assert all(torch.equal(a, b) for a, b in zip(got[True], got[False]))
                for g, w in zip(got[True], _reference(q, k, v, layout, do)[1:]):
                    assert ((g.double() - w).norm() / w.norm()).item() < 1e-4
    finally:
        L.launch = real


def test_small_eager_calls_keep_pointer_loads():
    """``tma=None``: an eager call with fewer visited tile pairs than ``TMA_MIN_PAIRS[pass]`` (over batch x query
    heads; a dynamic layout counts its capacity) keeps pointer loads on a GPU; ``tma=True``/``False`` and the
    interpreter are not affected."""
    from types import SimpleNamespace
    window = BlockLayout.from_mask_mod(P.sliding_window(1024), 2048, 2048, 128, 128)  # 108 listed tiles
    gpu = lambda B, H: SimpleNamespace(is_cuda=True, shape=(B, H, 2048, 128))  # noqa: E731
    tiles = int(window.kv_count.sum() + window.full_count.sum())
    for pass_, limit in L.TMA_MIN_PAIRS.items():
        if limit == 0:  # no rule for this pass: descriptors from the first tile pair
            assert not L.too_small_for_tma(pass_, None, window, gpu(1, 1))
            continue
        heads_below = (limit - 1) // tiles
        assert L.too_small_for_tma(pass_, None, window, gpu(1, heads_below))
        assert not L.too_small_for_tma(pass_, None, window, gpu(1, heads_below + 1))
        assert not L.too_small_for_tma(pass_, True, window, gpu(1, 1))
        assert not L.too_small_for_tma(pass_, False, window, gpu(1, 1))
        assert not L.too_small_for_tma(pass_, None, window, torch.zeros(1, 1, 2048, 128))  # not on a GPU
    routed = sa.route(torch.randn(1, 2, 2048, 16), torch.randn(1, 2, 2048, 16), 128, 128, topk=4)
    capacity = routed.nq * (routed.width + routed.full_width)
    heads_below = (L.TMA_MIN_PAIRS["bwd"] - 1) // capacity
    assert L.too_small_for_tma("bwd", None, routed, gpu(1, heads_below))
    assert not L.too_small_for_tma("bwd", None, routed, gpu(1, heads_below + 1))


def test_every_dispatch_order_gives_the_same_bits(monkeypatch):
    """``ops.backward.DISPATCH`` (the one-launch backward's program order: by estimated cost, split chunks
    first, head by head on a 2-D grid, or the "auto" choice among them) changes only the order programs start
    in: the gradients are the same bits, with split columns, GQA and a dynamic layout."""
    from sparseattn.ops import backward as B
    q, k, v, do, cfg, layouts = _gqa_split_case(4)
    for layout in layouts:
        got = {}
        for order in ("head", "lead", "cost", "auto"):
            monkeypatch.setattr(B, "DISPATCH", order)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            got[order] = torch.autograd.grad(sa.sparse_attention(qg, kg, vg, layout, bwd_config=cfg), (qg, kg, vg),
                                             do)
        for order in ("lead", "cost", "auto"):
            assert all(torch.equal(a, b) for a, b in zip(got["head"], got[order])), order
        for g, w in zip(got["cost"], _reference(q, k, v, layout, do)[1:]):
            assert ((g.double() - w).norm() / w.norm()).item() < 1e-4


def test_a_dynamic_layouts_order_by_this_calls_costs_gives_the_same_bits(monkeypatch):
    """``ops.backward.DYNAMIC_ORDER = "cost"``: a routed layout's one-launch backward ordered by the costs of
    the call's own lists (computed per call, passed as the plan's ``ORDER``) gives the bits of the "lead"
    order, and a second selection through the same cached plan gets its own order (the gradients of the
    second layout equal its "lead" gradients too); a bad value is a ValueError naming it."""
    from sparseattn.ops import backward as B
    q, k, v, do, cfg, layouts = _gqa_split_case(4)
    dynamic = [lay for lay in layouts if lay.dynamic]
    assert dynamic
    torch.manual_seed(2)
    other = sa.route(torch.randn_like(q), torch.randn_like(k), 64, 64, topk=1, causal=True)  # same shape
    assert other.width == dynamic[0].width and not torch.equal(other.full_index, dynamic[0].full_index)
    orders = []
    real = L.launch

    def spy(kernel, grid, **kw):
        if getattr(getattr(kernel, "fn", kernel), "__name__", "") == "bwd_kernel" and B.DYNAMIC_ORDER == "cost":
            orders.append(kw["ORDER"].clone())
        return real(kernel, grid, **kw)
    monkeypatch.setattr(L, "launch", spy)
    for layout in (*dynamic, other):
        got = {}
        for mode in ("lead", "cost"):
            monkeypatch.setattr(B, "DYNAMIC_ORDER", mode)
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            got[mode] = torch.autograd.grad(sa.sparse_attention(qg, kg, vg, layout, bwd_config=cfg),
                                            (qg, kg, vg), do)
        assert all(torch.equal(a, b) for a, b in zip(got["lead"], got["cost"]))
        # the order this call passed: its own lists' costs, most expensive first
        cost = B.program_costs(layout, B.dynamic_column_work(layout, cfg.block_n), cfg, 1, q.shape[1], k.shape[1],
                               q.shape[1] // k.shape[1]).flatten()
        assert torch.equal(orders[-1], torch.argsort(cost, descending=True, stable=True).to(torch.int32))
    assert len(orders) == 2 and not torch.equal(orders[0], orders[1])  # one cached plan, two orders
    monkeypatch.setattr(B, "DYNAMIC_ORDER", "longest")
    with pytest.raises(ValueError, match="DYNAMIC_ORDER"):
        B.dispatch_order(dynamic[0], B.dynamic_column_work(dynamic[0], cfg.block_n), cfg, 1, q.shape[1],
                         k.shape[1], 1, 0)


def test_the_cost_order_is_a_permutation_that_starts_the_longest_programs_first(monkeypatch):
    """:func:`~sparseattn.ops.backward.dispatch_order`: under ``"cost"`` every program of the 2-D grid once,
    costs never rising along the order (a dQ row of query tile i lists i + 1 tiles; a chunk at most 4);
    ``"lead"`` puts the split chunks of every head first, item by item; ``"head"`` has no table; ``"auto"``
    sorts by cost while the heads' inputs fit the L2 (``L2_SHARE``), else takes "lead" when columns are
    split and "head" when none is; an unknown name is a ValueError naming it."""
    from sparseattn.ops import backward as B
    from sparseattn.ops.config import BwdConfig
    H, N = 3, 1024
    lay = sa.BlockLayout.from_mask_mod(sa.patterns.causal(), N, N, 64, 64)
    cfg = BwdConfig(block_m=32, block_n=64, dq_block_m=64, dq_block_n=32, num_warps=4, num_stages=2, chunk=4)
    plan = B.column_work(lay, cfg.block_n, cfg.chunk, H)
    cost = B.program_costs(lay, plan, cfg, 1, H, H, 1)
    per_head = plan.work.shape[0] + lay.nq
    assert cost.shape == (H, per_head)
    assert cost[0, plan.work.shape[0]:].tolist() == [i + 1 + B.PROGRAM_COST for i in range(lay.nq)]
    assert cost[0, :plan.work.shape[0]].max().item() == pytest.approx(4 * B.DKDV_TILE_COST + B.PROGRAM_COST)

    def order(how, nbytes=0, p=plan):
        monkeypatch.setattr(B, "DISPATCH", how)
        return B.dispatch_order(lay, p, cfg, 1, H, H, 1, nbytes)

    by_cost = order("cost")
    assert sorted(by_cost.tolist()) == list(range(H * per_head))
    flat = cost.flatten()[by_cost.long()]
    assert bool((flat[1:] <= flat[:-1]).all())
    lead = order("lead").tolist()
    n_lead = min(plan.n_ws, plan.work.shape[0])
    assert n_lead > 0 and lead[:n_lead * H] == [(p % H) * per_head + p // H for p in range(n_lead * H)]
    assert sorted(lead) == list(range(H * per_head))
    assert order("head") is None
    l2 = B.L2_SHARE * L.l2_bytes(lay.device)
    assert torch.equal(order("auto", int(l2)), by_cost)
    assert not B.uneven_programs(cost)  # these programs are short: past the L2, no cost order
    assert order("auto", int(l2) + 1).tolist() == lead
    far = int(B.COST_ORDER_MAX_L2 * l2 / B.L2_SHARE) + 1  # further past the L2: never by cost
    whole = B.column_work(lay, cfg.block_n, 10**6, H)  # no column split: whole columns, long and uneven
    assert whole.n_ws == 0 and order("auto", far, whole) is None
    assert B.uneven_programs(B.program_costs(lay, whole, cfg, 1, H, H, 1))
    assert torch.equal(order("auto", int(l2) + 1, whole), order("cost", 0, whole))  # just past the L2: by cost
    monkeypatch.setattr(B, "COST_ORDER_MIN_CV", 0.0)  # any programs uneven enough: just past the L2, by cost
    monkeypatch.setattr(B, "COST_ORDER_MIN_MEAN", 0.0)
    assert torch.equal(order("auto", int(l2) + 1), by_cost)
    assert order("auto", far).tolist() == lead and order("auto", far, whole) is None
    l2_all = int(B.L2_SHARE * L.l2_bytes(lay.device) * 1.5)  # two of the three heads' inputs fit together
    grouped = order("group", l2_all)
    assert sorted(grouped.tolist()) == list(range(H * per_head))
    heads = grouped.long() // per_head
    assert set(heads[:2 * per_head].tolist()) == {0, 1} and set(heads[2 * per_head:].tolist()) == {2}
    for part in (grouped[:2 * per_head], grouped[2 * per_head:]):  # by cost within each group
        c = cost.flatten()[part.long()]
        assert bool((c[1:] <= c[:-1]).all())
    assert torch.equal(order("group", 0), by_cost)  # every head fits: one group, the cost order
    with pytest.raises(ValueError, match="DISPATCH"):
        order("longest")


def test_uneven_programs_needs_both_spread_and_length():
    """``uneven_programs``: the programs' coefficient of variation (``COST_ORDER_MIN_CV``) and their mean cost
    (``COST_ORDER_MIN_MEAN``), both needed."""
    from sparseattn.ops import backward as B
    cv, mean = B.COST_ORDER_MIN_CV, B.COST_ORDER_MIN_MEAN
    flat = torch.full((100,), 2 * mean)
    assert not B.uneven_programs(flat)  # long, no spread
    spread = 2 * mean * (1 + 1.2 * cv * torch.tensor([1.0, -1.0]).repeat(50))  # std = 1.2 cv x the mean
    assert B.uneven_programs(spread)
    assert not B.uneven_programs(spread / (4 * mean))  # same spread, programs too short on average
    narrow = 2 * mean * (1 + 0.8 * cv * torch.tensor([1.0, -1.0]).repeat(50))
    assert not B.uneven_programs(narrow)


def test_a_routed_layout_builds_its_transposed_lists_only_when_the_backward_needs_them():
    """A forward-only step on a routed layout launches no transpose; the backward builds the lists once, at
    the layout's fixed width, equal to the static layout's; ``copy_into`` a target that never built them
    leaves them to be built from the copied lists, and the target's gradients equal the source's."""
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 256, 16, requires_grad=True) for _ in range(3))
    routed = sa.route(q.detach(), k.detach(), 32, 32, topk=2)
    assert "transposed" not in routed._plans
    o = sa.sparse_attention(q, k, v, routed)
    assert "transposed" not in routed._plans  # the forward reads the row lists only
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    t = routed._plans["transposed"]
    assert t.q_index.shape[-1] == routed.nq  # the fixed width, not the contents' longest column
    static = BlockLayout.from_lists(routed.kv_count, routed.kv_index, routed.full_count, routed.full_index,
                                    q_len=256, kv_len=256, block_q=32, block_k=32, mask_mod=routed.mask_mod)
    assert torch.equal(routed.q_count, static.q_count) and torch.equal(routed.full_q_count, static.full_q_count)
    target = BlockLayout.with_capacity(1, routed.H, 256, 256, 32, 32, width=routed.width,
                                       full_width=routed.full_width, mask_mod=routed.mask_mod)
    routed.copy_into(target)
    assert "transposed" not in target._plans
    o2 = sa.sparse_attention(q, k, v, target)
    assert torch.equal(o2, o)
    for a, b in zip(torch.autograd.grad(o2, (q, k, v), do), grads):
        assert torch.equal(a, b)
    # once built, the target's lists are refilled by the next copy_into
    other = sa.route(torch.randn(1, 2, 256, 16), torch.randn(1, 2, 256, 16), 32, 32, topk=2)
    other.copy_into(target)
    assert torch.equal(target.q_count, other.q_count)
    used = torch.arange(other.q_index.shape[-1]) < other.q_count.unsqueeze(-1)  # the tails are never read
    assert torch.equal(target.q_index[used], other.q_index[used])
