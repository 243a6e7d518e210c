"""Load balance: the on-device task planner, the split forward + merge against the unsplit kernel and the fp64
reference (interpreter, small shapes, poisoned outputs and workspace), the makespan and the report."""
import json
import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

import sparseattn as sa
from sparseattn import BlockLayout, balance, patterns as P
from sparseattn.ops import FwdConfig
from sparseattn.ops import split as S

TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
L = 192  # 6 layout tiles of 32: short enough for the interpreter, long enough for several chunks
BLK = 32


def _docs(lengths):
    return torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))


def _routed_like(H=2, seed=3):
    """Skewed routing-like rows: query tile i keeps a different number of random earlier key tiles per head
    (head 1 keeps about half of head 0's), plus the diagonal tile, causal inside; bits path."""
    g = torch.Generator().manual_seed(seed)
    nq = L // BLK
    blocks = torch.zeros(1, H, nq, nq, dtype=torch.bool)
    for h in range(H):
        for i in range(nq):
            keep = max(1, (i + 1) // (1 + h)) if i % 2 == 0 else 1  # every other row long: skew
            blocks[0, h, i, torch.randperm(i + 1, generator=g)[:keep]] = True
            blocks[0, h, i, i] = True
    dense = blocks.repeat_interleave(BLK, 2).repeat_interleave(BLK, 3) & torch.ones(L, L, dtype=torch.bool).tril()
    return BlockLayout.from_dense(dense, BLK, BLK)


LAYOUTS = {
    "causal": lambda: BlockLayout.from_mask_mod(P.causal(), L, L, BLK, BLK, device="cpu"),
    "documents skewed": lambda: BlockLayout.from_mask_mod(
        P.and_masks(P.causal(), P.document(_docs([150, 5, 20, 3, 14]))), L, L, BLK, BLK, device="cpu"),
    "sinks+window": lambda: BlockLayout.from_mask_mod(P.sinks_window(8, 40), L, L, BLK, BLK, device="cpu"),
    "routed-like (bits, per-head rows)": _routed_like,
    "empty rows": lambda: BlockLayout.from_mask_mod(lambda b, h, q, k: (q >= 70) & (k <= q), L, L, BLK, BLK,
                                                    device="cpu"),
}


def _cfg(split, block_m=BLK, persistent=False):
    return FwdConfig(block_m=block_m, block_n=BLK, num_warps=4, num_stages=1, split=split, persistent=persistent)


@pytest.fixture
def poisoned_workspace(monkeypatch):
    """Fill the split workspace with NaN before the kernel runs: a partial state that is read but never
    written fails the comparison."""
    real = S.prepare

    def prepare(*a, **kw):
        s = real(*a, **kw)
        s.ws_o.fill_(float("nan"))
        s.ws_lse.fill_(float("nan"))
        return s
    monkeypatch.setattr(S, "prepare", prepare)


def _run(layout, q, k, v, split, block_m=BLK, persistent=False):
    out = torch.full_like(q, float("nan"))  # poison: unwritten elements fail
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True, out=out,
                                 config=_cfg(split, block_m, persistent))
    assert not torch.isnan(o).any(), f"split={split!r}, persistent={persistent}: NaN or unwritten output"
    return o, lse


@pytest.fixture
def persistent_grids(monkeypatch):
    """Count the persistent launches' programs against their live (task, head) items; ``many`` makes the grid
    larger than the plan's whole capacity (programs with nothing to do must write nothing)."""
    real = S.grid
    seen = []
    state = {"many": False}

    def grid(s, persistent, sms):
        g = real(s, persistent, sms)
        if persistent:
            if state["many"]:
                g = (s.plan.capacity * s.ws_o.shape[0] + 3,)
            seen.append((g[0], int(s.plan.n_tasks[0]) * s.ws_o.shape[0]))
        return g
    monkeypatch.setattr(S, "grid", grid)
    return seen, state


def _check_ref(layout, q, k, v, o, lse):
    ref_o, ref_lse = sa.reference_attention(q.double(), k.double(), v.double(), layout.to_dense(), return_lse=True)
    torch.testing.assert_close(o.double(), ref_o, **TOL[q.dtype])
    assert sa.reference.relative_error(o, ref_o) < sa.reference.tolerance(q.dtype)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "empty rows must have LSE -inf, others finite"
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
    assert (o[~finite.expand_as(o[..., 0])] == 0).all(), "empty rows must be 0"


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_split_equals_unsplit_and_reference_for_every_chunk(name, poisoned_workspace, persistent_grids):
    """... and the persistent grid equals the split grid bit for bit, with fewer programs than (task, head)
    items (each program loops over several) and with more programs than the plan's capacity."""
    layout = LAYOUTS[name]()
    longest = int((layout.kv_count + layout.full_count).max())
    q, k, v = (torch.randn(1, 2, L, 32) for _ in range(3))
    o0, lse0 = _run(layout, q, k, v, None)
    _check_ref(layout, q, k, v, o0, lse0)
    seen, state = persistent_grids
    for split in (1, 2, 3, longest, "auto"):
        o, lse = _run(layout, q, k, v, split)
        _check_ref(layout, q, k, v, o, lse)
        torch.testing.assert_close(o, o0, atol=2e-6, rtol=2e-6)
        torch.testing.assert_close(lse, lse0, atol=2e-6, rtol=2e-6)
        if split == longest:  # the whole row is one task: the plain kernel's arithmetic, bit for bit
            assert torch.equal(o, o0) and torch.equal(lse, lse0)
        for many in ((False, True) if split == 1 else (False,)):
            state["many"] = many
            op, lsep = _run(layout, q, k, v, split, persistent=True)
            programs, items = seen[-1]
            assert programs > items if many else programs < items, (split, many, seen[-1])
            assert torch.equal(op, o) and torch.equal(lsep, lse), f"persistent != split at split={split!r}"
            _check_ref(layout, q, k, v, op, lsep)


@pytest.mark.parametrize("pull", [True, False])
def test_persistent_grid_pulls_or_deals_its_items(pull, poisoned_workspace, persistent_grids, monkeypatch):
    """``split.PERSISTENT_PULL``: the persistent grid's programs take their (task, head) items from a counter
    (it ends at items + programs: each item taken once, then one failed take per program) or have them dealt
    (no counter); the same bits as the split grid either way, with fewer and with more programs than items."""
    monkeypatch.setattr(S, "PERSISTENT_PULL", pull)
    kwargs = []
    real = S.kernel_kwargs
    monkeypatch.setattr(S, "kernel_kwargs",
                        lambda s, persistent=False: kwargs.append(real(s, persistent)) or kwargs[-1])
    seen, state = persistent_grids
    layout = LAYOUTS["documents skewed"]()
    q, k, v = (torch.randn(1, 2, L, 32) for _ in range(3))
    o, lse = _run(layout, q, k, v, 1)
    for many in (False, True):
        state["many"] = many
        op, lsep = _run(layout, q, k, v, 1, persistent=True)
        assert torch.equal(op, o) and torch.equal(lsep, lse)
        programs, items = seen[-1]
        counter = kwargs[-1]["COUNTER"]
        assert (int(counter) == items + programs) if pull else counter is None


def test_split_fp16_gqa_batch_and_subtiles(poisoned_workspace):
    """fp16, GQA (4 query heads on 2 KV heads, a layout per KV head), batch 2 sharing the layout, kernel
    query tiles of 16 inside layout tiles of 32 (two sub-tiles per row), a length that is no multiple of it."""
    n = 100
    mm = P.and_masks(P.causal(), P.document(_docs([70, 7, 23])))
    layout = BlockLayout.from_mask_mod(lambda b, h, q, k: mm(b, h, q, k) & ((h == 0) | (q - k < 40)), n, n, BLK,
                                       BLK, B=1, H=2, device="cpu")
    q = torch.randn(2, 4, n, 16, dtype=torch.float16)
    k, v = (torch.randn(2, 2, n, 16, dtype=torch.float16) for _ in range(2))
    o0, lse0 = _run(layout, q, k, v, None, block_m=16)
    for split in (1,):
        o, lse = _run(layout, q, k, v, split, block_m=16)
        ref_o, ref_lse = sa.reference_attention(q.double(), k.double(), v.double(), layout.to_dense(),
                                                return_lse=True)
        torch.testing.assert_close(o.double(), ref_o, **TOL[torch.float16])
        assert sa.reference.relative_error(o, ref_o) < sa.reference.tolerance(torch.float16)
        torch.testing.assert_close(o, o0, **TOL[torch.float16])


def test_merge_is_bitwise_repeatable_and_matches_merge_states():
    layout = LAYOUTS["documents skewed"]()
    q, k, v = (torch.randn(1, 2, L, 32) for _ in range(3))
    a = _run(layout, q, k, v, 1)
    b = _run(layout, q, k, v, 1)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    for _ in range(2):  # the persistent grid: the same tasks, so the same bits, run after run
        c = _run(layout, q, k, v, 1, persistent=True)
        assert torch.equal(a[0], c[0]) and torch.equal(a[1], c[1])
    # the merge law of the reference, chunk by chunk: the first document's last query tile is split in 5
    dense = layout.to_dense()
    rows = slice(128, 160)
    parts = []
    for kt in range(5):
        m = torch.zeros_like(dense)
        m[..., rows, kt * BLK:(kt + 1) * BLK] = dense[..., rows, kt * BLK:(kt + 1) * BLK]
        parts.append(sa.reference_attention(q.double(), k.double(), v.double(), m, return_lse=True))
    o_m, lse_m = parts[0][0][..., rows, :], parts[0][1][..., rows]
    for o_p, lse_p in parts[1:]:
        o_m, lse_m = sa.merge_states(o_m, lse_m, o_p[..., rows, :], lse_p[..., rows])
    torch.testing.assert_close(a[0][..., rows, :].double(), o_m, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(a[1][..., rows].double(), lse_m, atol=1e-5, rtol=1e-5)


def _causal_lists(keep):
    """A causal layout from lists: row i lists its diagonal tile (partial) and the earlier tiles ``keep[i]``
    (full), widths fixed (1 and nq) so any such layout fits one dynamic capacity."""
    nq = L // BLK
    kv_count = torch.ones(1, 1, nq, dtype=torch.int32)
    kv_index = torch.arange(nq, dtype=torch.int32).view(1, 1, nq, 1)
    full_count = torch.tensor([len(r) for r in keep], dtype=torch.int32).view(1, 1, nq)
    full_index = torch.zeros(1, 1, nq, nq, dtype=torch.int32)
    for i, r in enumerate(keep):
        full_index[0, 0, i, :len(r)] = torch.tensor(sorted(r), dtype=torch.int32)
    return BlockLayout.from_lists(kv_count, kv_index, full_count, full_index, q_len=L, kv_len=L, block_q=BLK,
                                  block_k=BLK, mask_mod=P.causal())


def test_dynamic_layout_plans_on_the_device_and_refills(poisoned_workspace):
    """A dynamic layout (a CUDA graph's static target) is planned again at each call from its live counts."""
    nq = L // BLK
    static = BlockLayout.with_capacity(1, 1, L, L, BLK, BLK, width=1, full_width=nq, mask_mod=P.causal(),
                                       device="cpu")
    q, k, v = (torch.randn(1, 2, L, 32) for _ in range(3))
    for keep in ([list(range(i)) for i in range(nq)], [[0] if i else [] for i in range(nq)],
                 [list(range(i)) if i == nq - 1 else [] for i in range(nq)]):
        src = _causal_lists(keep)
        src.copy_into(static)
        o, lse = _run(static, q, k, v, 2)
        _check_ref(src, q, k, v, o, lse)


# ---- the planner ---------------------------------------------------------------------------------------------
def _check_plan(layout, block_m, split, heads, sms):
    p = balance.plan(layout, block_m, split, heads, sms)
    cap, ws_cap, merge_cap = balance.capacity(layout, block_m, split, heads, sms)
    assert (p.capacity, p.ws_capacity, p.merge_capacity) == (cap, ws_cap, merge_cap)
    n = int(p.n_tasks[0])
    assert p.tasks.shape == (cap, 4) and 1 <= n <= cap
    lens = balance._row_tiles(layout, block_m).tolist()
    n_m = len(lens)
    # every row's slots [0, len) covered exactly once, by consecutive chunks
    covered = [[] for _ in range(n_m)]
    for m, lo, hi, ws in p.tasks[:n].tolist():
        covered[m].append((lo, hi, ws))
    chunk = int(p.chunk)
    for m in range(n_m):
        spans = sorted(covered[m])
        assert spans, f"row {m} has no task"
        assert spans[0][0] == 0 and spans[-1][1] == lens[m]
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:])), f"row {m}: gaps or overlaps {spans}"
        assert all(hi - lo <= chunk for lo, hi, _ in spans)
        if len(spans) == 1:
            assert spans[0][2] == -1, "a whole row writes O directly"
        else:
            slots = [ws for _, _, ws in spans]
            assert slots == list(range(slots[0], slots[0] + len(spans))) and slots[-1] < ws_cap
    length = (p.tasks[:n, 2] - p.tasks[:n, 1]).tolist()
    assert length == sorted(length, reverse=True), "tasks must be ordered longest first"
    assert (p.tasks[n:, 2] == p.tasks[n:, 1]).all(), "empty slots hold no work"
    split_rows = [m for m in range(n_m) if len(covered[m]) > 1]
    nm = int(p.n_merge[0])
    assert nm == len(split_rows) <= merge_cap
    assert p.merge[:nm, 0].tolist() == split_rows
    assert p.merge[:nm, 2].tolist() == [len(covered[m]) for m in split_rows]
    return p


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("split", [1, 2, 5, "auto"])
@pytest.mark.parametrize("heads,sms", [(1, 132), (2, 4), (16, 132), (1, 1)])
def test_plan_covers_each_row_once_within_capacity(name, split, heads, sms):
    layout = LAYOUTS[name]()
    for block_m in (BLK, 16):
        _check_plan(layout, block_m, split, heads, sms)


@settings(max_examples=40, deadline=None)
@given(lens=st.lists(st.integers(0, 64), min_size=1, max_size=24), heads=st.integers(1, 32),
       sms=st.integers(1, 200))
def test_auto_plan_within_capacity_on_random_rows(lens, heads, sms):
    nq, nk = len(lens), 64
    block = torch.zeros(1, 1, nq, nk, dtype=torch.bool)
    for i, n in enumerate(lens):
        block[0, 0, i, :n] = True
    layout = BlockLayout.from_block_mask(block, nq * 16, nk * 16, 16, 16)
    p = _check_plan(layout, 16, "auto", heads, sms)
    chunk, total = int(p.chunk), sum(lens)
    assert chunk >= balance.MIN_CHUNK
    share = heads * total / (balance.TAIL_PARTS_LPT * sms)  # the tail rule's bound, one layout head
    if heads * nq > balance.FILL_WAVES * sms and max(lens) <= max(balance.MIN_CHUNK, share / 2):
        assert int(p.n_merge[0]) == 0, "many waves and no row over half its share: nothing to split"
    if max(lens) > max(chunk, balance.MIN_CHUNK):
        assert int(p.n_merge[0]) > 0


def test_auto_splits_an_underfilled_grid_and_keeps_a_full_one_whole():
    layout = BlockLayout.from_mask_mod(P.causal(), 4096, 4096, 128, 128, device="cpu")  # rows of 1..32 tiles
    few = balance.plan(layout, 128, "auto", heads=1, sms=132)  # 32 programs on 132 SMs: split
    assert int(few.n_merge[0]) > 0 and int(few.chunk) < 32
    assert int(few.n_tasks[0]) * 1 <= balance.FILL_WAVES * 132
    many = balance.plan(layout, 128, "auto", heads=64, sms=132)  # 2048 programs, longest row 32 tiles: whole
    assert int(many.n_merge[0]) == 0 and int(many.n_tasks[0]) == 32


def test_bad_split_is_refused():
    layout = LAYOUTS["causal"]()
    q = torch.randn(1, 1, L, 32)
    for bad in (0, -2, "fast", 2.5, True):
        with pytest.raises(ValueError, match="split"):
            sa.sparse_attention(q, q, q, layout, config=_cfg(bad))
    with pytest.raises(ValueError, match="split"):
        balance.plan(layout, BLK, 0, 1, 4)
    with pytest.raises(ValueError, match="persistent=True needs split"):
        sa.sparse_attention(q, q, q, layout, config=_cfg(None, persistent=True))
    for bad in (1, "yes", None):
        with pytest.raises(ValueError, match="persistent must be a bool"):
            sa.sparse_attention(q, q, q, layout, config=_cfg(2, persistent=bad))
    with pytest.raises(ValueError, match="block_m"):
        balance.plan(layout, 24, 2, 1, 4)


# ---- makespan and the report -----------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(units=st.lists(st.integers(0, 50), min_size=1, max_size=60), slots=st.integers(1, 16))
def test_makespan_bounds(units, slots):
    u = np.array(units, dtype=float)
    ms = balance.makespan(u, slots)
    assert ms >= u.max() - 1e-9
    assert ms >= u.sum() / slots - 1e-9
    assert ms <= u.sum() / slots + u.max() + 1e-9


def test_makespan_is_roofline_makespan():
    from sparseattn.roofline import model
    assert model.makespan is balance.makespan


def test_report_counts_and_json():
    layout = LAYOUTS["documents skewed"]()
    r = balance.report(layout, B=1, Hq=2, block_m=BLK, split=1, sms=4)
    listed = int((layout.kv_count + layout.full_count).sum()) * 2  # two heads share the layout
    assert r.total_tiles == listed
    assert sum(k * v for k, v in r.hist_plain.items()) == listed == sum(k * v for k, v in r.hist_split.items())
    assert sum(r.hist_plain.values()) == r.programs_plain == 2 * (L // BLK)
    assert sum(r.hist_split.values()) == 2 * r.tasks_split
    assert r.longest_split == 1 and r.makespan_split <= r.makespan_plain
    assert r.ideal == listed / 4 and r.makespan_plain >= r.ideal and r.makespan_split >= r.ideal
    assert math.isclose(r.tail_plain, (r.makespan_plain - r.ideal) / r.makespan_plain)
    d = r.to_json()
    assert json.loads(json.dumps(d)) == d and d["hist_split"] == {"1": listed}
    # the plain grid's per-program work is the layout's rows in the kernel's order
    plain = balance.program_tiles(layout, 1, 2, BLK, None, 4)
    assert sorted(plain.tolist()) == sorted(((layout.kv_count + layout.full_count)[0, 0].tolist()) * 2)
    with pytest.raises(ValueError, match="Hq"):
        balance.report(layout, B=1, Hq=0)
    with pytest.raises(TypeError, match="layout"):
        balance.report("causal")


def test_persistent_grid_from_shapes_only():
    """About PERSISTENT_PROGRAMS_PER_SM programs per SM, never more than the capacity's (task, head) items, at
    least one; the split grid is (capacity, heads)."""
    layout = LAYOUTS["documents skewed"]()
    s = S.prepare(layout, BLK, 1, 1, 2, 32, torch.device("cpu"))
    items = s.plan.capacity * 2
    assert S.grid(s, False, 4) == (s.plan.capacity, 2)
    assert S.grid(s, True, 4) == (S.PERSISTENT_PROGRAMS_PER_SM * 4,) and S.PERSISTENT_PROGRAMS_PER_SM * 4 < items
    assert S.grid(s, True, 10_000) == (items,)


def test_persistent_fp16_gqa_batch_subtiles_and_dynamic_layout(poisoned_workspace):
    """The persistent grid's head decoding (batch 2, GQA 4 on 2, kernel tiles of 16 in layout tiles of 32) and a
    dynamic layout refilled between calls (the live task count changes, the grid does not)."""
    n = 100
    mm = P.and_masks(P.causal(), P.document(_docs([70, 7, 23])))
    layout = BlockLayout.from_mask_mod(lambda b, h, q, k: mm(b, h, q, k) & ((h == 0) | (q - k < 40)), n, n, BLK,
                                       BLK, B=1, H=2, device="cpu")
    q = torch.randn(2, 4, n, 16, dtype=torch.float16)
    k, v = (torch.randn(2, 2, n, 16, dtype=torch.float16) for _ in range(2))
    o, lse = _run(layout, q, k, v, 1, block_m=16)
    op, lsep = _run(layout, q, k, v, 1, block_m=16, persistent=True)
    assert torch.equal(o, op) and torch.equal(lse, lsep)
    nq = L // BLK
    static = BlockLayout.with_capacity(1, 1, L, L, BLK, BLK, width=1, full_width=nq, mask_mod=P.causal(),
                                       device="cpu")
    q, k, v = (torch.randn(1, 2, L, 32) for _ in range(3))
    for keep in ([list(range(i)) for i in range(nq)], [[0] if i else [] for i in range(nq)]):
        src = _causal_lists(keep)
        src.copy_into(static)
        o, lse = _run(static, q, k, v, 2, persistent=True)
        _check_ref(src, q, k, v, o, lse)


def test_split_chunked_prefill_queries_are_the_last_positions(poisoned_workspace):
    """Lq < Lk: the queries are the last Lq positions; a split row's chunks still cover its whole row."""
    lq, lk = 80, L
    layout = BlockLayout.from_mask_mod(P.sinks_window(8, 100), lq, lk, BLK, BLK, device="cpu")
    q = torch.randn(1, 2, lq, 32)
    k, v = (torch.randn(1, 2, lk, 32) for _ in range(2))
    o0, lse0 = _run(layout, q, k, v, None)
    for split in (1, 2):
        o, lse = _run(layout, q, k, v, split)
        _check_ref(layout, q, k, v, o, lse)
        torch.testing.assert_close(o, o0, atol=2e-6, rtol=2e-6)


def test_roofline_prices_the_split_plan():
    """The cost model's split forward: the same tile steps as the plain grid, dealt as the plan's tasks, plus
    the workspace traffic and a merge launch; on one head of causal attention at 16k (128 programs on 132
    SMs) it predicts the split faster."""
    import sparseattn.roofline as R
    from sparseattn.roofline.counts import fwd_work
    layout = BlockLayout.from_mask_mod(P.causal(), 16384, 16384, 128, 128, device="cpu")
    shape = dict(B=1, Hq=1, Hkv=1, D=128, dtype=torch.bfloat16)
    base = FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
    plain = fwd_work(layout, shape, base)
    split = fwd_work(layout, shape, _cfg_like(base, "auto"), sms=132)
    assert [k.name for k in split.kernels] == ["sparse_fwd_kernel (split)", "merge_rows_kernel"]
    assert split.kernels[0].steps == plain.kernels[0].steps and split.hbm["workspace"] > 0
    p = balance.plan(layout, 128, "auto", 1, 132)
    assert split.kernels[0].programs == int(p.n_tasks[0])
    ms_plain = R.cost(layout, shape, "fwd", config=base).predicted_ms
    ms_split = R.cost(layout, shape, "fwd", config=_cfg_like(base, "auto")).predicted_ms
    assert ms_split < 0.8 * ms_plain


def _cfg_like(cfg, split):
    return FwdConfig(**{**cfg.__dict__, "split": split})
