"""Content routing (route, block_scores, member bits, selection_recall, routed_attention), the fused transpose
and dynamic layouts, on the CPU through the Triton interpreter: device routing equals the eager torch.sort
reference, invariants hold on random inputs, attention on routed layouts equals the fp64 reference on their
dense masks (forward and backward, both semantics), and a captured-graph style refill (copy_into) changes
what the ops compute."""
import itertools

import pytest
import torch
from hypothesis import HealthCheck, given, settings, strategies as st

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P
from sparseattn import _tiles as T
from sparseattn import routing
from sparseattn.reference import (route_reference, route_scores_reference, selection_recall_reference)
from sparseattn.routing import block_scores, route, selection_recall

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
GRAD_TOL = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}
LISTS = ("kv_count", "kv_index", "full_count", "full_index")


def qk(B=1, Hq=4, Hkv=2, Lq=64, Lk=80, D=32, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, Hq, Lq, D, generator=g).to(dtype), torch.randn(B, Hkv, Lk, D, generator=g).to(dtype))


def assert_same_layout(a: BlockLayout, b: BlockLayout):
    for name in LISTS:
        x, y = getattr(a, name), getattr(b, name)
        assert x.shape == y.shape, (name, x.shape, y.shape)
        assert torch.equal(x, y), f"{name} differs:\n{x}\n{y}"
    assert (a.row_slot is None) == (b.row_slot is None)
    if a.row_slot is not None:
        assert torch.equal(a.row_slot, b.row_slot), "member bits differ"


# ---------------------------------------------------------------------------------------------------------
# the device routing is its eager specification
# ---------------------------------------------------------------------------------------------------------
# every pair of (share, pool, semantics, causal) values appears in some config (a covering array of the 24)
CONFIGS = [("kv_head", "mean", "block", True), ("kv_head", "bound", "member", False), ("all", "mean", "member", True),
           ("all", "bound", "block", False), ("none", "mean", "block", False), ("none", "bound", "member", True),
           ("kv_head", "bound", "block", True), ("none", "mean", "member", False), ("all", "bound", "member", True)]


def _poisoned_empty(monkeypatch):
    """``torch.empty`` that fills what it returns with garbage (NaN, or -7 for integers): a kernel that leaves
    any element of its output unwritten shows up."""
    real = torch.empty

    def empty(*args, **kwargs):
        t = real(*args, **kwargs)
        return t.fill_(float("nan") if t.is_floating_point() else -7)
    monkeypatch.setattr(torch, "empty", empty)


# a third launch choice besides the first version and the current one: several [16, D] loads a block, element-wise
# accumulation, three blocks a program (not a divisor of the block count), unsplit scores, Triton's own binding
OTHER = routing.RouteKernels(pool_sub=16, pool_blocks=3, pool_row_acc=True, pool_warps=4, scores_split=False,
                             select_zero_pad=True, fast_launch=False, index_checked=True)
KERNELS = {"current": routing.CURRENT, "first": routing.FIRST, "other": OTHER, "fused": routing.FUSED}


def _no_score_matrix(monkeypatch):
    """Make the two-kernel path (score matrix, then select) fail: a test that means the fused launch shows
    that it ran."""
    def refuse(*args, **kwargs):
        raise AssertionError("the fused path must not build a score matrix")
    monkeypatch.setattr(routing, "_score_parts", refuse)


@pytest.mark.parametrize("share,pool,semantics,causal,kernels", [(*c, kn) for c in CONFIGS for kn in ("current", "fused")]
                         + [(*c, kn) for c in CONFIGS[:4] for kn in ("first", "other")])
def test_route_equals_reference(share, pool, semantics, causal, kernels, monkeypatch):
    n = CONFIGS.index((share, pool, semantics, causal))
    q, k = qk(B=1 + n % 2, seed=n)
    kw = dict(topk=3, share=share, pool=pool, semantics=semantics, causal=causal, local=1, sinks=1,
              member_topk=2 if semantics == "member" else None)
    want = route_reference(q, k, 32, 16, **kw)
    _poisoned_empty(monkeypatch)  # every buffer route allocates starts as garbage: the kernels write it all
    if KERNELS[kernels].fused_select:
        _no_score_matrix(monkeypatch)
    with routing.route_kernels(KERNELS[kernels]):
        got = route(q, k, 32, 16, **kw)
    assert_same_layout(got, want)
    assert got.dynamic and got.H == {"kv_head": 2, "all": 1, "none": 4}[share]


@pytest.mark.parametrize("kw", [dict(threshold=0.5), dict(threshold=0.9, topk=5), dict(threshold=1.0, capacity=6),
                                dict(threshold=0.3, semantics="member", member_topk=1),
                                dict(threshold=0.7, local=2, sinks=0, pool="bound")])
def test_threshold_equals_reference(kw):
    q, k = qk(seed=11)
    got = route(q, k, 16, 16, **kw)
    assert_same_layout(got, route_reference(q, k, 16, 16, **kw))


@pytest.mark.parametrize("bq,bk,Lq,Lk", [(16, 16, 100, 100), (64, 16, 130, 170), (16, 64, 120, 200),
                                         (32, 32, 40, 200), (16, 16, 1, 70)])
def test_block_shapes_and_chunked_prefill(bq, bk, Lq, Lk):
    q, k = qk(Lq=Lq, Lk=Lk, seed=bq + bk + Lq)
    for semantics in ("block", "member"):
        kw = dict(topk=2, local=2, sinks=1, semantics=semantics, member_topk=1 if semantics == "member" else None)
        assert_same_layout(route(q, k, bq, bk, **kw), route_reference(q, k, bq, bk, **kw))


def test_block_scores_equal_reference():
    q, k = qk(B=2, dtype=torch.float16)
    for share, pool, causal in [("kv_head", "mean", True), ("all", "bound", True), ("none", "bound", False),
                                ("kv_head", "bound", False), ("none", "mean", True)]:
        got = block_scores(q, k, 32, 16, causal=causal, share=share, pool=pool, scale=0.3)
        ref = route_scores_reference(q, k, 32, 16, causal=causal, share=share, pool=pool, scale=0.3)
        visible = torch.isfinite(ref)
        assert torch.equal(torch.isfinite(got), visible)
        torch.testing.assert_close(got[visible], ref[visible], atol=1e-5, rtol=1e-5)
        if causal:  # query block 0 (positions 16..47) sees key blocks 0..2, the last one sees every block
            assert visible[..., -1, :].all() and visible[..., 0, :3].all() and not visible[..., 0, 3:].any()


@pytest.mark.parametrize("share,pool,semantics,kernels", [("all", "mean", "block", "current"),
                                                          ("all", "bound", "block", "first"),
                                                          ("all", "mean", "member", "fused")])
def test_many_key_blocks_on_poisoned_buffers(kernels, share, pool, semantics, monkeypatch):
    """More than one 64-block column range (nk = 65), a 16-query-block group that cannot see the second range
    (the split scores grid skips that GEMM), the shared heads in parts, clipped last blocks, and every
    buffer route allocates poisoned: each launch choice still writes every element and equals the
    reference."""
    q, k = qk(Hq=2, Hkv=1, Lq=1040, Lk=1040, D=16, seed=21)
    bq, bk = 64, 16  # 16 query blocks = 1,024 positions: the first group ends before key block 64 starts
    kw = dict(topk=3, share=share, pool=pool, semantics=semantics, member_topk=1 if semantics == "member" else None)
    spec = routing.check_route(q, k, bq, bk, 3, None, True, 1, 1, share, pool, semantics, None, kw["member_topk"],
                               None)
    _, cols, parts = routing.scores_grid(spec, KERNELS[kernels].scores_split)
    if KERNELS[kernels].scores_split:  # the paths this test is for
        assert -(-spec.nk // cols) == 2 and parts == spec.n_shared > 1
    want = route_reference(q, k, bq, bk, **kw)
    _poisoned_empty(monkeypatch)
    with routing.route_kernels(KERNELS[kernels]):
        got = route(q, k, bq, bk, **kw)
        scores = block_scores(q, k, bq, bk, share=share, pool=pool)
    assert_same_layout(got, want)
    t_got, t_want = got.transposed_lists(), want.transpose(width=got.nq)
    for count, index in (("q_count", "q_index"), ("full_q_count", "full_q_index")):
        c = getattr(t_got, count)
        assert torch.equal(c, getattr(t_want, count)), count
        listed = torch.arange(got.nq) < c[..., None]  # the column tails are never written (nor read)
        assert torch.equal(getattr(t_got, index)[listed], getattr(t_want, index)[listed]), index
    ref = route_scores_reference(q, k, bq, bk, share=share, pool=pool)
    assert torch.equal(torch.isfinite(scores), torch.isfinite(ref))
    torch.testing.assert_close(scores[torch.isfinite(ref)], ref[torch.isfinite(ref)], atol=1e-5, rtol=1e-5)


def test_split_scores_grid_is_bitwise_the_unsplit_one():
    """Column ranges and head parts on the grid (max over the parts taken later) give the very same scores as
    one program looping over every key block and head: each head's dot is the same, and max is exact."""
    q, k = qk(Hq=2, Hkv=1, Lq=1040, Lk=1040, D=16, seed=22)
    for share, pool in (("all", "bound"),):
        spec = routing.check_route(q, k, 64, 16, 3, None, True, 1, 1, share, pool, "block", None, None, None)
        pooled = routing._pool(q, k, spec)
        parts = routing._score_parts(pooled, spec, routing.CURRENT)
        assert parts.shape[0] > 1
        assert torch.equal(parts.amax(0), routing._scores(pooled, spec, routing.FIRST)), share


def test_pool_choices_agree():
    """Every pooling launch choice gives the reference's mean (to rounding: the sum order differs) and exactly
    its min and max, with clipped last blocks of Q and K of different lengths."""
    from sparseattn.reference import _pooled_blocks
    q, k = qk(Hq=4, Hkv=2, Lq=150, Lk=200, D=32, seed=23)
    spec = routing.check_route(q, k, 32, 16, 3, None, True, 1, 1, "kv_head", "bound", "block", None, None, None)
    q_ref, _, _ = _pooled_blocks(q, 32)
    k_ref = _pooled_blocks(k, 16)
    for kernels in KERNELS.values():
        q_mean, k_mean, k_min, k_max = routing._pool(q, k, spec, kernels)
        torch.testing.assert_close(q_mean, q_ref, atol=1e-6, rtol=1e-6)
        torch.testing.assert_close(k_mean, k_ref[0], atol=1e-6, rtol=1e-6)
        assert torch.equal(k_min, k_ref[1]) and torch.equal(k_max, k_ref[2])


def _pool_variants():
    from sparseattn.bench.routing import POOL_VARIANTS
    return POOL_VARIANTS


@pytest.mark.parametrize("name", list(_pool_variants()))
def test_pool_variant_equals_reference(name, monkeypatch):
    """Every pool variant the routing suite's --pool-sweep times (joint loads, persistent grids, TMA rows):
    the eager reference's mean (fp32, to rounding) and exactly its min and max, with clipped last blocks of
    Q and K of different lengths, on poisoned buffers; and ``route`` under it selects the reference's blocks
    (both semantics, both pools)."""
    from sparseattn.reference import _pooled_blocks
    kn = _pool_variants()[name]
    q, k = qk(Hq=4, Hkv=2, Lq=150, Lk=200, D=32, seed=24)
    spec = routing.check_route(q, k, 32, 16, 3, None, True, 1, 1, "kv_head", "bound", "block", None, None, None)
    q_ref, _, _ = _pooled_blocks(q, 32)
    k_ref = _pooled_blocks(k, 16)
    want = [route_reference(q, k, 32, 16, topk=3, **kw) for kw in CASES_POOL]
    _poisoned_empty(monkeypatch)
    q_mean, k_mean, k_min, k_max = routing._pool(q, k, spec, kn)
    torch.testing.assert_close(q_mean, q_ref, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(k_mean, k_ref[0], atol=1e-6, rtol=1e-6)
    assert torch.equal(k_min, k_ref[1]) and torch.equal(k_max, k_ref[2])
    with routing.route_kernels(kn):
        for kw, w in zip(CASES_POOL, want):
            assert_same_layout(route(q, k, 32, 16, topk=3, **kw), w)


CASES_POOL = [dict(share="kv_head", pool="mean"), dict(share="all", pool="bound", semantics="member", member_topk=1)]


def test_pool_variants_cover_the_new_paths():
    """The sweep holds each new launch path at least once (else the test above checks nothing new): joint
    loads, persistent grids with and without TMA, a pipelined TMA loop, and the interpreter really takes
    the descriptor path (TMA rows)."""
    v = list(_pool_variants().values())
    assert any(kn.pool_joint for kn in v) and any(kn.pool_tma and not kn.pool_persistent for kn in v)
    assert any(kn.pool_persistent and not kn.pool_tma for kn in v)
    assert any(kn.pool_persistent and kn.pool_tma and kn.pool_stages > 1 for kn in v)
    assert any(kn.pool_prefetch for kn in v)
    assert _pool_variants()["current"] is routing.CURRENT and _pool_variants()["first"] is routing.FIRST
    q, k = qk(D=32)
    tma = routing.CURRENT._replace(pool_tma=True)
    assert all(d is not None for d in routing._pool_descriptors(q, k, 16, 32, tma))
    assert routing._pool_descriptors(q, k, 16, 32, routing.CURRENT) == (None, None)
    assert routing._pool_descriptors(q[..., ::2], k[..., ::2], 16, 16, tma) == (None, None)  # strided: plain loads


@pytest.mark.parametrize("field,value,rule", [("pool_blocks", 0, ">= 1"), ("pool_sub", 24, "power of two"),
                                              ("pool_persistent", -1, ">= 0"), ("pool_stages", 0, ">= 1")])
def test_pool_fields_are_checked(field, value, rule):
    q, k = qk()
    with pytest.raises(ValueError, match=f"{field}.*{rule}"):
        with routing.route_kernels(routing.CURRENT._replace(**{field: value})):
            route(q, k, 16, 16, topk=2)
    with pytest.raises(ValueError, match="pool_blocks must be a power of two with pool_joint"):
        routing.check_pool_kernels(routing.CURRENT._replace(pool_joint=True, pool_blocks=3))
    with pytest.raises(ValueError, match="pool_tma .* pool_joint"):
        routing.check_pool_kernels(routing.CURRENT._replace(pool_joint=True, pool_tma=True))
    with pytest.raises(ValueError, match="pool_prefetch needs pool_persistent"):
        routing.check_pool_kernels(routing.CURRENT._replace(pool_prefetch=True))  # not persistent, two blocks


def test_scores_grid_at_the_issue_shape():
    """At the issue's shape (nq = nk = 256, 16 heads): one selection per KV head keeps whole column ranges on
    the grid (1,024 programs), one selection for all heads splits its 16 heads into 8 parts (512 programs
    instead of the first version's 16)."""
    from types import SimpleNamespace
    kv_head = SimpleNamespace(nq=256, nk=256, B=1, LH=16, n_shared=1)
    every = SimpleNamespace(nq=256, nk=256, B=1, LH=1, n_shared=16)
    assert routing.scores_grid(kv_head, split=True) == (64, 64, 1)
    assert routing.scores_grid(every, split=True) == (64, 64, 8)
    assert routing.scores_grid(every, split=False) == (64, 256, 1)  # one program per 16 query blocks


def test_route_kernels_switch_is_scoped_and_checked():
    assert routing._KERNELS[0] is routing.CURRENT
    with routing.route_kernels(routing.FIRST):
        assert routing._KERNELS[0] is routing.FIRST
        with pytest.raises(TypeError, match="RouteKernels"):
            with routing.route_kernels({"pool_sub": 32}):
                pass
        assert routing._KERNELS[0] is routing.FIRST
    assert routing._KERNELS[0] is routing.CURRENT


# the fused scores + select launch: every selection rule, ragged shapes, several D slices, against the two launches
FUSED_CASES = [
    dict(topk=3),
    dict(topk=2, threshold=0.6, share="none", D=64),  # two D slices of the pooled dot
    dict(threshold=0.9, pool="bound", share="all", D=128, Hq=4, Hkv=1),  # four slices, bound, every head
    dict(topk=4, capacity=5, local=3, sinks=0, causal=False, B=2),
    dict(topk=1, local=0, sinks=2, Lq=37, Lk=141, bq=16, bk=32),  # queries are the last 37 positions: q_offset
    dict(topk=2, semantics="member", member_topk=1, pool="bound", Lq=100, Lk=100, bq=64, bk=16),  # clipped blocks
    dict(threshold=0.5, topk=3, semantics="member", member_topk=2, share="none", causal=False, Lq=50, Lk=90),
    dict(topk=5, Lq=1, Lk=70),  # one query row
]


@pytest.mark.parametrize("case", range(len(FUSED_CASES)))
def test_fused_select_equals_the_two_launches(case, monkeypatch):
    """FUSED (scores computed inside the select program, no score matrix) gives the very lists and member bits
    of CURRENT (scores kernel, then select) and of the eager reference, on poisoned buffers."""
    kw = dict(FUSED_CASES[case])
    shape = {n: kw.pop(n) for n in ("B", "Hq", "Hkv", "Lq", "Lk", "D", "bq", "bk") if n in kw}
    bq, bk = shape.pop("bq", 16), shape.pop("bk", 16)
    q, k = qk(**{"Lq": 64, "Lk": 80, **shape}, seed=30 + case)
    want = route_reference(q, k, bq, bk, **kw)
    _poisoned_empty(monkeypatch)
    two = route(q, k, bq, bk, **kw)
    spec = routing.check_route(q, k, bq, bk, kw.get("topk"), kw.get("threshold"), kw.get("causal", True),
                               kw.get("local", 1), kw.get("sinks", 1), kw.get("share", "kv_head"),
                               kw.get("pool", "mean"), kw.get("semantics", "block"), kw.get("capacity"),
                               kw.get("member_topk"), None)
    assert routing.fused_fits(spec, routing.FUSED) and not routing.fused_fits(spec)
    _no_score_matrix(monkeypatch)
    with routing.route_kernels(routing.FUSED):
        fused = route(q, k, bq, bk, **kw)
    assert_same_layout(fused, two)
    assert_same_layout(fused, want)


def test_fused_select_falls_back_past_its_key_block_limit(monkeypatch):
    """Past FUSED_MAX_NK key blocks (a row of scores no longer fits one program's registers) FUSED launches the
    scores kernel and the select kernel, and the result is still the reference's."""
    from types import SimpleNamespace
    assert routing.FUSED == routing.CURRENT._replace(fused_select=True)
    assert not routing.CURRENT.fused_select and not routing.FIRST.fused_select  # the default stays two launches
    assert routing.fused_fits(SimpleNamespace(nk=routing.FUSED_MAX_NK), routing.FUSED)
    assert not routing.fused_fits(SimpleNamespace(nk=routing.FUSED_MAX_NK + 1), routing.FUSED)
    calls = []
    real = routing._fused_select
    monkeypatch.setattr(routing, "_fused_select", lambda *a, **kw: calls.append(1) or real(*a, **kw))
    monkeypatch.setattr(routing, "FUSED_MAX_NK", 16)  # a cheap shape past the limit: 20 key blocks
    q, k = qk(Lq=64, Lk=320, D=16, seed=40)
    for Lk, fused in ((256, True), (320, False)):  # 16 key blocks fit, 20 do not
        with routing.route_kernels(routing.FUSED):
            got = route(q, k[:, :, :Lk], 16, 16, topk=3, threshold=0.8)
        assert len(calls) == fused, (Lk, calls)
        calls.clear()
        assert_same_layout(got, route_reference(q, k[:, :, :Lk], 16, 16, topk=3, threshold=0.8))


def test_ties_go_to_the_lower_block():
    """Identical key blocks score exactly alike: the lowest visible non-forced blocks win."""
    q = torch.randn(1, 1, 128, 16)
    k = torch.randn(1, 1, 16, 16).repeat(1, 1, 8, 1)  # 8 identical blocks of 16 keys
    lay = route(q, k, 16, 16, topk=2, local=1, sinks=1, share="none")
    want = {i: sorted({0, i} | set(range(1, min(i, 3)))) for i in range(8)}  # sink 0, diagonal i, then 1, 2
    for i in range(8):
        got = sorted(lay.kv_index[0, 0, i, :lay.kv_count[0, 0, i]].tolist()
                     + lay.full_index[0, 0, i, :lay.full_count[0, 0, i]].tolist())
        assert got == want[i], (i, got)
    assert_same_layout(lay, route_reference(q, k, 16, 16, topk=2, local=1, sinks=1, share="none"))


def test_shared_selection_equals_per_head_routing_when_heads_are_identical():
    q1, k1 = qk(Hq=1, Hkv=1, seed=3)
    q = q1.repeat(1, 4, 1, 1)
    k = k1.repeat(1, 2, 1, 1)
    per_head = route(q, k, 16, 16, topk=3, share="none")
    for share in ("kv_head", "all"):
        shared = route(q, k, 16, 16, topk=3, share=share)
        for name in LISTS:
            x = getattr(shared, name)
            assert torch.equal(x.repeat_interleave(4 // x.shape[1], dim=1), getattr(per_head, name)), (share, name)
    o = sa.sparse_attention(q, k, k, route(q, k, 16, 16, topk=3, share="all"))
    torch.testing.assert_close(o, sa.sparse_attention(q, k, k, per_head), atol=0, rtol=0)


# ---------------------------------------------------------------------------------------------------------
# invariants on random inputs
# ---------------------------------------------------------------------------------------------------------
@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(Lq=st.integers(1, 120), extra=st.integers(0, 60), bq=st.sampled_from([16, 32]), bk=st.sampled_from([16, 32]),
       topk=st.integers(0, 6), local=st.integers(0, 3), sinks=st.integers(0, 2), causal=st.booleans(),
       semantics=st.sampled_from(["block", "member"]), threshold=st.sampled_from([None, 0.5, 0.95]),
       fused=st.booleans(), seed=st.integers(0, 2**16))
def test_routing_invariants(Lq, extra, bq, bk, topk, local, sinks, causal, semantics, threshold, fused, seed):
    Lk = Lq + extra
    q, k = qk(Lq=Lq, Lk=Lk, D=16, seed=seed)
    member_topk = 1 if semantics == "member" else None
    with routing.route_kernels(routing.FUSED if fused else routing.CURRENT):
        lay = route(q, k, bq, bk, topk=topk, threshold=threshold, local=local, sinks=sinks, causal=causal,
                    semantics=semantics, member_topk=member_topk)
    # the trusted lists obey every rule the validating constructor checks (ascending, unique, in range, ...)
    BlockLayout.from_lists(*(getattr(lay, n) for n in LISTS), q_len=Lq, kv_len=Lk, block_q=bq, block_k=bk,
                           mask_mod=lay.mask_mod, row_slot=lay.row_slot)
    off = max(Lk - Lq, 0)
    i = torch.arange(lay.nq)[:, None]
    j = torch.arange(lay.nk)[None, :]
    q_last = torch.clamp((i + 1) * bq, max=Lq) - 1 + off
    # forced: the sinks, and for every query row the `local` key blocks ending at the row's own block
    own = torch.zeros(lay.nq, lay.nk, dtype=torch.bool)
    for r in range(Lq):
        jr = min((r + off) // bk, lay.nk - 1)
        own[r // bq, max(jr - local + 1, 0):jr + 1] = local > 0
    span = int(own.sum(1).max()) - local + 1 if local else 0
    total = lay.kv_count + lay.full_count
    assert int(total.max()) <= min(lay.nk, topk + sinks + (local + span - 1 if local else 0)), "capacity exceeded"
    assert int(lay.kv_count.max()) <= lay.width and int(lay.full_count.max()) <= lay.full_width
    partial, full = lay.block_classes()
    chosen = partial | full  # [B, H, nq, nk]
    visible = (j * bk <= q_last) if causal else torch.ones_like(j * i, dtype=torch.bool)
    forced = visible & ((j < sinks) | own)
    assert (chosen >= forced).all(), "a forced block is missing"
    assert not (chosen & ~visible).any(), "a block the query block cannot see was chosen"
    dense = lay.to_dense()
    if causal:
        qa = torch.arange(Lq)[:, None] + off
        assert not (dense & (torch.arange(Lk)[None, :] > qa)).any(), "causality violated"
    if local >= 1 and causal:  # every row sees its own position (its own block is forced, member bits too)
        assert dense[..., torch.arange(Lq), torch.arange(Lq) + off].all()
    assert_same_layout(lay, route_reference(q, k, bq, bk, topk=topk, threshold=threshold, local=local, sinks=sinks,
                                            causal=causal, semantics=semantics, member_topk=member_topk))


# ---------------------------------------------------------------------------------------------------------
# attention on routed layouts, both semantics
# ---------------------------------------------------------------------------------------------------------
def check_attention(layout, q, k, v, deterministic=True):
    out = torch.full_like(q, float("nan"))  # poison: unwritten elements fail
    o = sa.sparse_attention(q, k, v, layout, out=out)
    ref = sa.reference_attention(q, k, v, layout.to_dense())
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.double(), ref, **TOL[q.dtype])
    assert sa.reference.relative_error(o, ref) < sa.reference.tolerance(q.dtype)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    og = sa.sparse_attention(qg, kg, vg, layout, deterministic=deterministic)
    do = torch.randn_like(og)
    grads = torch.autograd.grad(og, (qg, kg, vg), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref_grads = torch.autograd.grad(sa.reference_attention(qd, kd, vd, layout.to_dense()), (qd, kd, vd), do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        s = max(1.0, r.abs().max().item())
        torch.testing.assert_close(g.double() / s, r / s, **GRAD_TOL[q.dtype], msg=lambda m: f"{name}: {m}")
        assert (r == 0).all() or sa.reference.relative_error(g, r) < sa.reference.tolerance(q.dtype, "bwd"), name
    return o


@pytest.mark.parametrize("semantics,share,deterministic", [("block", "kv_head", True), ("block", "none", False),
                                                          ("member", "kv_head", False), ("member", "none", True)])
def test_attention_on_routed_layouts(semantics, share, deterministic):
    q, k = qk(Hq=2, Hkv=1, Lq=64, Lk=90, seed=7)
    v = torch.randn_like(k)
    lay = route(q, k, 32, 16, topk=2, share=share, semantics=semantics,
                member_topk=1 if semantics == "member" else None)
    check_attention(lay, q, k, v, deterministic)


def test_attention_fp16_member_bound():
    q, k = qk(Hq=2, Hkv=1, Lq=64, Lk=64, dtype=torch.float16, seed=9)
    lay = route(q, k, 32, 32, topk=1, pool="bound", semantics="member", member_topk=1, local=1, sinks=1)
    check_attention(lay, q, k, torch.randn_like(k))


def test_block_and_member_read_the_same_tiles_but_differ():
    q, k = qk(Hq=2, Hkv=1, Lq=96, Lk=96, seed=5)
    v = torch.randn_like(k)
    block = route(q, k, 32, 16, topk=3)
    member = route(q, k, 32, 16, topk=3, semantics="member", member_topk=1)
    pb, fb = block.block_classes()
    pm, fm = member.block_classes()
    assert torch.equal(pb | fb, pm | fm), "the same tiles are loaded"
    assert not fm.any(), "member tiles are all masked per row"
    db, dm = block.to_dense(), member.to_dense()
    assert (dm <= db).all() and (dm != db).any(), "member rows use a subset of the block's cells"
    ob, om = sa.sparse_attention(q, k, v, block), sa.sparse_attention(q, k, v, member)
    assert (ob - om).abs().max() > 1e-3, "different outputs"
    assert block.stats()["listed_tiles"] == member.stats()["listed_tiles"]


# ---------------------------------------------------------------------------------------------------------
# the fused transpose
# ---------------------------------------------------------------------------------------------------------
def brute_transpose(count, index, n_cols):
    """Column lists by looping over every listed entry, rows in order: (col_count, {(b, h, col): [(row, slot)]})."""
    B, H, nr, _ = index.shape
    cols = {}
    for b, h, r in itertools.product(range(B), range(H), range(nr)):
        for slot in range(int(count[b, h, r])):
            cols.setdefault((b, h, int(index[b, h, r, slot])), []).append((r, slot))
    col_count = torch.zeros(B, H, n_cols, dtype=torch.int32)
    for (b, h, c), entries in cols.items():
        col_count[b, h, c] = len(entries)
    return col_count, cols


@settings(max_examples=20, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(B=st.integers(1, 2), H=st.integers(1, 3), Lq=st.integers(1, 200), Lk=st.integers(1, 200),
       density=st.floats(0.0, 1.0), bq=st.sampled_from([16, 32]), bk=st.sampled_from([16, 32]),
       fixed=st.booleans(), seed=st.integers(0, 2**16))
def test_fused_transpose_equals_brute_force(B, H, Lq, Lk, density, bq, bk, fixed, seed):
    g = torch.Generator().manual_seed(seed)
    layout = BlockLayout.from_dense(torch.rand(B, H, Lq, Lk, generator=g) < density, bq, bk)
    width = layout.nq if fixed else None
    q_count, q_index, q_slot, full_q_count, full_q_index = T.transpose_lists(
        layout.kv_count, layout.kv_index, layout.full_count, layout.full_index, layout.nk, width, width)
    for count, index, slots, (c_want, cols) in (
            (q_count, q_index, q_slot, brute_transpose(layout.kv_count, layout.kv_index, layout.nk)),
            (full_q_count, full_q_index, None, brute_transpose(layout.full_count, layout.full_index, layout.nk))):
        assert torch.equal(count, c_want)
        assert index.shape[-1] == (width or max(1, int(c_want.max())))
        for (b, h, c), entries in cols.items():
            assert index[b, h, c, :len(entries)].tolist() == [r for r, _ in entries], "rows ascending, complete"
            if slots is not None:
                assert slots[b, h, c, :len(entries)].tolist() == [s for _, s in entries], "forward slots"
        assert (index[torch.arange(index.shape[-1]) >= count[..., None]] == 0).all(), "zero padding"


def test_transpose_of_a_too_narrow_fixed_width_never_writes_past_it():
    layout = BlockLayout.from_mask_mod(P.causal(), 128, 128, 16, 16, device="cpu")
    q_count, q_index, _, full_q_count, full_q_index = T.transpose_lists(
        layout.kv_count, layout.kv_index, layout.full_count, layout.full_index, layout.nk, 3, 3, zero_pad=False)
    assert full_q_index.shape[-1] == 3 and int(full_q_count[0, 0, 0]) == 7  # the count stays true
    assert full_q_index[0, 0, 0].tolist() == [1, 2, 3]


# ---------------------------------------------------------------------------------------------------------
# dynamic layouts: trusted constructor, fixed capacity, copy_into
# ---------------------------------------------------------------------------------------------------------
def test_copy_into_refills_a_static_layout_and_ops_follow():
    q, k = qk(Hq=2, Hkv=1, Lq=64, Lk=64, seed=1)
    v = torch.randn_like(k)
    a = route(q, k, 32, 16, topk=2, semantics="member", member_topk=1)
    b = route(q.flip(2), k.flip(2), 32, 16, topk=2, semantics="member", member_topk=1)
    static = BlockLayout.with_capacity(1, 1, 64, 64, 32, 16, width=a.width, full_width=a.full_width,
                                       mask_mod=P.causal(), member=True, device="cpu")
    assert static.dynamic and int(static.kv_count.sum()) == 0
    assert (sa.sparse_attention(q, k, v, static) == 0).all(), "an empty selection gives zeros"
    for src in (a, b):  # plans must not be cached from the previous contents
        assert src.copy_into(static) is static
        assert_same_layout(static, src)
        torch.testing.assert_close(sa.sparse_attention(q, k, v, static), sa.sparse_attention(q, k, v, src),
                                   atol=0, rtol=0)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    g_static = torch.autograd.grad(sa.sparse_attention(qg, kg, vg, static).sum(), (qg, kg, vg))
    g_src = torch.autograd.grad(sa.sparse_attention(qg, kg, vg, b).sum(), (qg, kg, vg))
    for x, y in zip(g_static, g_src):
        torch.testing.assert_close(x, y, atol=0, rtol=0)
    assert {k if isinstance(k, str) else k[0] for k in static._plans} <= {"transposed", "mask_path"}, \
        static._plans.keys()


def test_copy_into_refuses_a_different_capacity_or_a_static_target():
    q, k = qk(Lq=64, Lk=64)
    a = route(q, k, 16, 16, topk=2)
    with pytest.raises(ValueError, match="dynamic target"):
        a.copy_into(BlockLayout.from_mask_mod(P.causal(), 64, 64, 16, 16, H=2, device="cpu"))
    with pytest.raises(ValueError, match="full_index"):
        a.copy_into(BlockLayout.with_capacity(1, 2, 64, 64, 16, 16, width=a.width, full_width=a.full_width + 1,
                                              mask_mod=P.causal(), device="cpu"))
    with pytest.raises(ValueError, match="mask"):
        a.copy_into(BlockLayout.with_capacity(1, 2, 64, 64, 16, 16, width=a.width, full_width=a.full_width,
                                              mask_mod=P.sliding_window(8), device="cpu"))
    with pytest.raises(ValueError, match="row_slot"):
        a.copy_into(BlockLayout.with_capacity(1, 2, 64, 64, 16, 16, width=a.width, full_width=a.full_width,
                                              mask_mod=P.causal(), member=True, device="cpu"))
    with pytest.raises(TypeError, match="static"):
        a.copy_into("layout")


def test_trusted_layouts_need_a_register_mask_path():
    lists = route(*qk(Lq=64, Lk=64), 16, 16, topk=1)
    args = [getattr(lists, n) for n in LISTS]
    with pytest.raises(ValueError, match="in registers"):
        BlockLayout.from_lists(*args, q_len=64, kv_len=64, block_q=16, block_k=16, mask_mod=P.dilated(2),
                               trusted=True)
    with pytest.raises(TypeError, match="int32"):
        BlockLayout.from_lists(args[0].long(), *args[1:], q_len=64, kv_len=64, block_q=16, block_k=16,
                               mask_mod=P.causal(), trusted=True)
    with pytest.raises(ValueError, match="nq=5"):
        BlockLayout.from_lists(*args, q_len=80, kv_len=64, block_q=16, block_k=16, mask_mod=P.causal(), trusted=True)


def test_dynamic_plans_come_from_the_shape_and_are_not_kept_on_the_layout():
    from sparseattn.ops import column_work
    from sparseattn.ops._launch import row_order
    lay = route(*qk(Lq=64, Lk=64), 16, 16, topk=1)
    other = route(*qk(Lq=64, Lk=64, seed=9), 16, 16, topk=1)
    plan = column_work(lay, 16)
    assert plan.n_ws == 0 and plan.chunk == lay.nq and plan.work.shape == (4, 3)
    assert plan.work[:, 0].tolist() == [0, 1, 2, 3] and (plan.work[:, 2] == -1).all()
    assert column_work(other, 16) is plan and row_order(other, 16) is row_order(lay, 16)
    assert row_order(lay, 16).tolist() == [3, 2, 1, 0]
    assert not any(isinstance(key, tuple) for key in lay._plans), lay._plans.keys()


def test_dynamic_plan_splits_the_first_columns_with_a_shape_only_size():
    """A routed layout's sink column is listed by every query tile: the dynamic dK/dV plan cuts the first key
    sub-tiles (the sinks, and under a causal mask the columns the most rows can see) into ceil(nq / chunk)
    chunks (a size fixed by the shapes, for graphs), and the gradients still match the fp64 reference,
    bitwise repeatable."""
    from sparseattn.ops import column_work
    from sparseattn.ops.backward import DYNAMIC_SPLIT_COLUMNS
    q, k = qk(Hq=4, Hkv=2, Lq=256, Lk=256, seed=5)
    lay = route(q, k, 16, 16, topk=1, local=1, sinks=1)
    plan = column_work(lay, 16)
    per = -(-lay.nq // plan.chunk)
    assert plan.chunk == max(8, 2 * -(-lay.nq * (lay.width + lay.full_width) // lay.nk)) and per > 1
    R = DYNAMIC_SPLIT_COLUMNS
    assert plan.n_ws == R * per and plan.work.shape == (R * per + lay.nk - R, 3)
    assert plan.reduce.shape == (R, 3) and (plan.reduce[:, 2] == per).all()
    assert plan.reduce[:, 0].tolist() == list(range(R))  # the sink column (every row lists it) among them
    assert sorted(plan.work[:, 2].tolist()) == [-1] * (lay.nk - R) + list(range(R * per))
    v = torch.randn_like(k)
    check_attention(lay, q, k, v)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    first = torch.autograd.grad(sa.sparse_attention(qg, kg, vg, lay), (qg, kg, vg), do)
    again = torch.autograd.grad(sa.sparse_attention(qg, kg, vg, lay), (qg, kg, vg), do)
    assert all(torch.equal(a, b) for a, b in zip(first, again))


# ---------------------------------------------------------------------------------------------------------
# routed_attention: one routing per forward + backward
# ---------------------------------------------------------------------------------------------------------
def test_routed_attention_routes_once_and_backward_uses_the_forward_layout(monkeypatch):
    calls = []
    real = routing.route

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)
    monkeypatch.setattr(routing, "route", counting)
    q, k = qk(Hq=2, Hkv=1, Lq=64, Lk=64, seed=2)
    v = torch.randn_like(k)
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    o, layout = sa.routed_attention(qg, kg, vg, 16, 16, topk=2, return_layout=True)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (qg, kg, vg), do)
    assert len(calls) == 1, "one router call per forward + backward"
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = sa.reference_attention(qd, kd, vd, layout.to_dense())
    for g, r in zip(grads, torch.autograd.grad(ref, (qd, kd, vd), do.double())):
        torch.testing.assert_close(g.double(), r, atol=5e-5, rtol=5e-5)
    # reuse: a passed layout is not routed again, and gives the same output
    o2 = sa.routed_attention(q, k, v, layout=layout)
    assert len(calls) == 1
    torch.testing.assert_close(o2, o.detach(), atol=0, rtol=0)
    o3, lse = sa.routed_attention(q, k, v, 16, 16, topk=2, return_lse=True)
    assert lse.shape == (1, 2, 64) and len(calls) == 2
    with pytest.raises(TypeError, match="layout"):
        sa.routed_attention(q, k, v, layout="x")


# ---------------------------------------------------------------------------------------------------------
# selection_recall
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("semantics", ["block", "member"])
def test_selection_recall_equals_reference(semantics):
    q, k = qk(B=2, Lq=100, Lk=120, seed=4)
    lay = route(q, k, 32, 16, topk=2, semantics=semantics, member_topk=1 if semantics == "member" else None)
    ref = selection_recall_reference(q, k, lay)
    full = selection_recall(q, k, lay)
    assert full.rows.tolist() == list(range(100))
    torch.testing.assert_close(full.recall.double(), ref, atol=1e-5, rtol=1e-5)
    sampled = selection_recall(q, k, lay, sample=7)
    assert sampled.rows.numel() == 7 and sampled.rows[0] == 0 and sampled.rows[-1] == 99
    torch.testing.assert_close(sampled.recall.double(), ref[:, :, sampled.rows], atol=1e-5, rtol=1e-5)
    assert 0 < full.mean() < 1


def test_recall_is_one_when_everything_visible_is_kept_and_grows_with_topk():
    q, k = qk(Lq=96, Lk=96, seed=8)
    everything = route(q, k, 16, 16, topk=6)
    assert torch.allclose(selection_recall(q, k, everything).recall, torch.ones(1), atol=1e-5)
    recalls = [selection_recall(q, k, route(q, k, 16, 16, topk=t)).mean() for t in (0, 1, 2)]
    assert recalls[0] < recalls[1] < recalls[2] < 1
    rows = torch.tensor([0, 64])
    with pytest.raises(ValueError, match="rows"):
        everything.dense_rows(torch.tensor([128]))
    assert torch.equal(everything.dense_rows(rows), everything.to_dense()[:, :, rows])


# ---------------------------------------------------------------------------------------------------------
# bad arguments name the argument and the rule
# ---------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("kw,err,match", [
    (dict(), ValueError, "topk"),
    (dict(topk=-1), ValueError, "topk"),
    (dict(topk=1.5), TypeError, "topk"),
    (dict(threshold=0.0), ValueError, "threshold"),
    (dict(threshold="0.5"), TypeError, "threshold"),
    (dict(topk=2, share="group"), ValueError, "share"),
    (dict(topk=2, pool="max"), ValueError, "pool"),
    (dict(topk=2, semantics="token"), ValueError, "semantics"),
    (dict(topk=2, semantics="member"), ValueError, "member_topk"),
    (dict(topk=2, member_topk=1), ValueError, "member_topk"),
    (dict(topk=2, capacity=1, local=1, sinks=1), ValueError, "capacity"),
    (dict(topk=2, local=-1), ValueError, "local"),
    (dict(topk=2, causal=1), TypeError, "causal"),
    (dict(topk=2, block_q=24), ValueError, "block_q"),
])
def test_bad_arguments(kw, err, match):
    q, k = qk(Lq=32, Lk=32)
    with pytest.raises(err, match=match):
        route(q, k, **{"block_q": 16, "block_k": 16, **kw})


def test_bad_shapes():
    q, k = qk(Lq=32, Lk=32)
    with pytest.raises(ValueError, match="multiple"):
        route(q[:, :3], k, topk=1)
    with pytest.raises(ValueError, match="share B and D"):
        route(q, k[..., :16], topk=1)
    with pytest.raises(ValueError, match="key blocks"):
        route(q[:, :, :16], torch.randn(1, 2, 16 * 8193, 32), 16, 16, topk=1)
    with pytest.raises(TypeError, match="q must be"):
        route(q.long(), k, topk=1)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_member_layouts_convert_to_flex_with_their_bits():
    from torch.nn.attention.flex_attention import flex_attention
    q, k = qk(Hq=2, Hkv=2, Lq=64, Lk=80, seed=12)
    v = torch.randn_like(k)
    member = route(q, k, 16, 16, topk=2, semantics="member", member_topk=1, share="none")
    ours = sa.sparse_attention(q, k, v, member)
    flex = flex_attention(q, k, v, block_mask=member.to_flex())
    torch.testing.assert_close(flex, ours, atol=2e-5, rtol=2e-5)
