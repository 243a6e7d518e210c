"""CUDA-graph buckets by length (:class:`sparseattn.balance.GraphBuckets`) on the CPU: everything but the capture
(the choice of bucket, the padding of the lists, the refill of one bucket by layouts of different lengths,
the outputs against the eager op on the unpadded layout and the fp64 reference in the interpreter, the waste
report, refused arguments). The capture itself is checked on the GPU (tests/gpu/test_gpu_balance.py)."""
import math

import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, balance, patterns as P
from sparseattn.ops import FwdConfig

BLK = 32
EDGES = (64, 128, 256)
TOL = dict(atol=2e-5, rtol=2e-5)


def _routed(L, H=2, seed=0):
    """A skewed causal selection per head (diagonal tile partial under causal, earlier tiles full)."""
    g = torch.Generator().manual_seed(seed)
    nq = L // BLK
    blocks = torch.zeros(1, H, nq, nq, dtype=torch.bool)
    for h in range(H):
        for i in range(nq):
            keep = (i + 1) if (i + h) % 3 == 0 else 1
            blocks[0, h, i, torch.randperm(i + 1, generator=g)[:keep]] = True
            blocks[0, h, i, i] = True
    return BlockLayout.from_block_mask(blocks, L, L, BLK, BLK, mask_mod=P.causal())


def _buckets(split=None, H=2, D=16, **kw):
    cfg = FwdConfig(block_m=BLK, block_n=BLK, num_warps=4, num_stages=1, split=split)

    def step(layout, q, k, v, out):
        sa.sparse_attention(q, k, v, layout, out=out, config=cfg)

    def buffers(E):
        return {name: torch.zeros(1, H, E, D) for name in ("q", "k", "v", "out")}
    return balance.GraphBuckets(EDGES, step, buffers, H=H, block_q=BLK, block_k=BLK, mask_mod=P.causal(),
                                device="cpu", **kw), cfg


def test_bucket_for_picks_the_smallest_edge_that_holds_the_length():
    b, _ = _buckets()
    assert [b.bucket_for(n) for n in (1, 63, 64, 65, 128, 129, 256)] == [64, 64, 64, 128, 128, 256, 256]
    with pytest.raises(ValueError, match="largest bucket"):
        b.bucket_for(257)
    with pytest.raises(ValueError, match="length"):
        b.bucket_for(0)
    assert balance.pow2_edges(5000, 1024) == [1024, 2048, 4096, 8192]
    assert balance.pow2_edges(100, 1, block=128) == [128]
    with pytest.raises(ValueError, match="block"):
        balance.pow2_edges(100, block=96)


@pytest.mark.parametrize("L", [32, 96, 128, 160, 224])
def test_padding_keeps_the_mask_and_lists_nothing_past_the_end(L):
    b, _ = _buckets()
    layout = _routed(L)
    padded = b.pad(layout)
    E = b.bucket_for(L)
    assert padded.q_len == padded.kv_len == E and padded.dynamic
    dense = padded.to_dense()
    assert torch.equal(dense[..., :L, :L], layout.to_dense())
    assert not dense[..., L:, :].any() and not dense[..., :, L:].any()
    assert (padded.kv_count[..., layout.nq:] == 0).all() and (padded.full_count[..., layout.nq:] == 0).all()


def test_one_bucket_refilled_by_layouts_of_different_lengths_matches_the_eager_op():
    """Lengths 224, 160, 96 then 224 again: two share the bucket of 256, so stale inputs and lists of a longer
    layout are in the buffers when a shorter one is loaded. The output buffer is poisoned before each run."""
    b, cfg = _buckets()
    torch.manual_seed(0)
    for L in (224, 160, 96, 224):
        layout = _routed(L, seed=L)
        q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
        E = b.bucket_for(L)
        b.buffers(E)["out"].fill_(float("nan"))
        got = b.run(layout, q=q, k=k, v=v)["out"]
        assert got.shape == q.shape
        full = b.buffers(E)["out"]
        assert not torch.isnan(full).any(), "the step must write every row of the bucket, padded ones too"
        assert (full[..., L:, :] == 0).all(), "padded query rows list nothing: their output is 0"
        eager = sa.sparse_attention(q, k, v, layout, config=cfg)
        assert torch.equal(got, eager), f"L={L}: the bucket's output differs from the eager op's"
        ref = sa.reference_attention(q.double(), k.double(), v.double(), layout.to_dense())
        torch.testing.assert_close(got.double(), ref, **TOL)
    assert b.captured == ()  # no capture on the CPU


@pytest.mark.parametrize("split", [2, "auto"])
def test_split_plan_in_a_bucket_matches_the_reference(split):
    """The split forward plans on the padded table (its capacity from the bucket's shape): same result as the
    unpadded split call within rounding, and the fp64 reference."""
    b, cfg = _buckets(split=split)
    torch.manual_seed(1)
    L = 160
    layout = _routed(L, seed=3)
    q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
    got = b.run(layout, q=q, k=k, v=v)["out"]
    eager = sa.sparse_attention(q, k, v, layout, config=cfg)
    torch.testing.assert_close(got, eager, **TOL)
    ref = sa.reference_attention(q.double(), k.double(), v.double(), layout.to_dense())
    torch.testing.assert_close(got.double(), ref, **TOL)


def test_a_layout_shared_by_the_heads_is_repeated_for_each():
    b, cfg = _buckets()
    layout = BlockLayout.from_mask_mod(P.sinks_window(8, 40), 96, 96, BLK, BLK, device="cpu")
    pre = BlockLayout.from_mask_mod(P.causal(), 96, 96, BLK, BLK, device="cpu")
    padded = b.pad(pre)
    assert padded.H == 2 and torch.equal(padded.to_dense()[:, :, :96, :96], pre.to_dense().expand(1, 2, 96, 96))
    q, k, v = (torch.randn(1, 2, 96, 16) for _ in range(3))
    with pytest.raises(ValueError, match="mask_mods differ"):
        b.run(layout, q=q, k=k, v=v)  # sinks | window is another predicate than the buckets' causal
    got = b.run(pre, q=q, k=k, v=v)["out"]
    assert torch.equal(got, sa.sparse_attention(q, k, v, pre, config=cfg))


def test_waste_counts_what_the_bucket_allots_against_what_the_layout_uses():
    b, _ = _buckets(width=lambda E: E // BLK, full_width=lambda E: E // BLK)
    layout = _routed(160)
    w = b.waste(layout, block_m=BLK, split=2, heads=2, sms=4)
    assert (w.length, w.bucket) == (160, 256)
    assert math.isclose(w.tokens_waste, 1 - 160 / 256)
    assert (w.rows_used, w.rows_allotted) == (5, 8) and math.isclose(w.rows_waste, 3 / 8)
    listed = int(layout.kv_count.sum() + layout.full_count.sum())  # the layout has the buckets' 2 heads
    assert (w.slots_used, w.slots_allotted) == (listed, 2 * 8 * (8 + 8))
    p = balance.plan(b.pad(layout), BLK, 2, 2, 4)
    assert (w.tasks_used, w.tasks_allotted) == (int(p.n_tasks[0]), p.capacity)
    assert w.tasks_used < w.tasks_allotted and 0 < w.tasks_waste < 1
    # the padded rows add one empty task each: what the fixed capacity spends on padding
    unpadded = balance.plan(layout, BLK, 2, 2, 4)
    assert w.tasks_used == int(unpadded.n_tasks[0]) + (8 - 5)
    assert set(w.to_json()) >= {"tokens_waste", "slots_waste", "tasks_waste"}
    assert b.waste(layout).tasks_used is None


def test_refused_arguments_name_the_rule():
    step, bufs = (lambda layout, **kw: None), (lambda E: {})
    for edges in ((128, 64), (), (64, 100), (0,)):
        with pytest.raises(ValueError, match="edges"):
            balance.GraphBuckets(edges, step, bufs, block_q=BLK, block_k=BLK, device="cpu")
    with pytest.raises(TypeError, match="step"):
        balance.GraphBuckets(EDGES, None, bufs, block_q=BLK, block_k=BLK, device="cpu")
    with pytest.raises(ValueError, match="width"):
        balance.GraphBuckets(EDGES, step, bufs, block_q=BLK, block_k=BLK, width=0, device="cpu")
    ids = torch.zeros(256, dtype=torch.long)
    with pytest.raises(ValueError, match="mask_mod"):
        balance.GraphBuckets(EDGES, step, bufs, block_q=BLK, block_k=BLK, mask_mod=P.document(ids), device="cpu")
    with pytest.raises(ValueError, match="capture"):
        balance.GraphBuckets(EDGES, step, bufs, block_q=BLK, block_k=BLK, device="cpu", capture=True)
    b, _ = _buckets()
    with pytest.raises(ValueError, match="multiple of the tiles"):  # a tile across the end would read padding
        b.pad(BlockLayout.from_mask_mod(P.causal(), 100, 100, BLK, BLK, device="cpu"))
    with pytest.raises(ValueError, match="q_len == kv_len"):
        b.pad(BlockLayout.from_mask_mod(P.causal(), 64, 128, BLK, BLK, device="cpu"))
    with pytest.raises(ValueError, match="H="):
        b.pad(_routed(64, H=3))
    with pytest.raises(ValueError, match="width"):
        small, _ = _buckets(width=1, full_width=1)
        small.pad(_routed(128))
    with pytest.raises(ValueError, match="mask_mods differ"):  # copy_into's own check
        b.load(BlockLayout.from_mask_mod(P.sliding_window(40), 64, 64, BLK, BLK, device="cpu"))
    with pytest.raises(ValueError, match="input 'x'"):
        b.load(_routed(64), x=torch.zeros(1, 2, 64, 16))
    with pytest.raises(ValueError, match="dimension -2"):
        b.load(_routed(64), q=torch.zeros(1, 2, 32, 16))
    with pytest.raises(TypeError, match="layout"):
        b.pad("causal")
