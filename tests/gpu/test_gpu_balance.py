"""GPU-only checks of the split forward (skipped without CUDA): real tiles and dtypes against the fp64 reference
and the plain grid, bitwise repeatability, the planner without a host sync, one CUDA graph on a dynamic layout
that follows ``copy_into``.

Run on the GPU machine with ``python -m pytest tests/gpu -q``.
"""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, balance, patterns as P
from sparseattn.ops import FwdConfig
from sparseattn.ops.prefill import fwd_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"


def _docs(L, seed=0):
    g = torch.Generator().manual_seed(seed)
    lens = torch.clamp((torch.randn(64, generator=g) * 1.2 + 6.5).exp().long(), min=1)
    ids = torch.repeat_interleave(torch.arange(64), lens)[:L]
    return torch.cat([ids, ids.new_full((max(0, L - ids.numel()),), 64)]).to(DEV)


def _layouts(L):
    return {"causal": P.causal(), "sinks64+window1024": P.sinks_window(64, 1024),
            "documents lognormal": P.and_masks(P.causal(), P.document(_docs(L)))}


def _cfg(q, layout, split):
    base = fwd_config(q, layout)
    return FwdConfig(**{**base.__dict__, "split": split})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("name", ["causal", "sinks64+window1024", "documents lognormal"])
def test_split_matches_reference_and_plain(name, dtype):
    torch.manual_seed(0)
    L, H, D = 5000, 2, 128  # few heads: "auto" splits (the grid alone does not fill the GPU)
    layout = BlockLayout.from_mask_mod(_layouts(L)[name], L, L, 128, 128, device=DEV)
    q, k, v = (torch.randn(1, H, L, D, device=DEV, dtype=dtype) for _ in range(3))
    plain = sa.sparse_attention(q, k, v, layout)
    ref = sa.reference_attention(q.double(), k.double(), v.double(), layout.to_dense())
    tol = 2e-2 if dtype == torch.bfloat16 else 2e-5
    for split in (1, 4, "auto"):
        out = torch.full_like(q, float("nan"))
        o = sa.sparse_attention(q, k, v, layout, out=out, config=_cfg(q, layout, split))
        assert not torch.isnan(o).any()
        assert ((o.double() - ref).norm() / ref.norm()).item() < tol, split
        assert ((o.float() - plain.float()).abs().max()).item() < (2e-2 if dtype == torch.bfloat16 else 1e-5)
        again = sa.sparse_attention(q, k, v, layout, config=_cfg(q, layout, split))
        assert torch.equal(o, again), f"split={split}: not bitwise repeatable"
    if name == "causal":
        auto = balance.plan(layout, fwd_config(q, layout).block_m, "auto", H,
                            torch.cuda.get_device_properties(0).multi_processor_count, D)
        assert int(auto.n_merge[0]) > 0, "two heads at 5000 tokens underfill an H200: auto should split"


def test_split_forward_in_one_graph_follows_copy_into_without_host_sync():
    torch.manual_seed(1)
    L, H, D = 8192, 4, 128
    first = BlockLayout.from_mask_mod(P.causal(), L, L, 128, 128, device=DEV)
    nq = L // 128
    keep = (torch.rand(1, 1, nq, nq) < 0.3) | torch.eye(nq, dtype=torch.bool)  # a causal selection, skewed below
    keep[..., : nq // 8, :] = True  # the first rows keep every earlier tile; the rest about 30%
    second = BlockLayout.from_block_mask(keep & torch.ones(nq, nq, dtype=torch.bool).tril(), L, L, 128, 128,
                                         mask_mod=P.causal()).to(DEV)
    width = max(first.width, second.width)
    full_width = max(first.full_width, second.full_width)
    static = BlockLayout.with_capacity(1, 1, L, L, 128, 128, width=width, full_width=full_width,
                                       mask_mod=P.causal(), device=DEV)
    q, k, v = (torch.randn(1, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
    cfg = _cfg(q, first, "auto")

    def pad(src):  # the same lists at the static capacity's widths
        kv_index = torch.zeros(1, 1, src.nq, width, dtype=torch.int32, device=DEV)
        kv_index[..., :src.width] = src.kv_index
        full_index = torch.zeros(1, 1, src.nq, full_width, dtype=torch.int32, device=DEV)
        full_index[..., :src.full_width] = src.full_index
        return BlockLayout.from_lists(src.kv_count, kv_index, src.full_count, full_index, q_len=L, kv_len=L,
                                      block_q=128, block_k=128, mask_mod=P.causal())
    pad(first).copy_into(static)
    out = torch.empty_like(q)
    step = lambda: sa.sparse_attention(q, k, v, static, config=cfg, out=out)  # noqa: E731
    step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        step()  # the planner and both launches: any host synchronisation raises
    finally:
        torch.cuda.set_sync_debug_mode(0)
    graph = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(graph):
        step()
    for src in (first, second):
        pad(src).copy_into(static)
        graph.replay()
        torch.cuda.synchronize()
        eager = sa.sparse_attention(q, k, v, src, config=cfg)
        assert torch.equal(out, eager), "graph replay differs from the eager split forward"


def _routed_gpu(L, H, seed):
    """A skewed causal selection per head: every fourth row keeps all its earlier tiles, the rest about 10%."""
    g = torch.Generator().manual_seed(seed)
    nq = L // 128
    keep = (torch.rand(1, H, nq, nq, generator=g) < 0.1) | torch.eye(nq, dtype=torch.bool)
    keep[:, :, ::4, :] = True
    keep &= torch.ones(nq, nq, dtype=torch.bool).tril()
    return BlockLayout.from_block_mask(keep, L, L, 128, 128, mask_mod=P.causal()).to(DEV)


def test_graph_buckets_capture_replays_eager_bits_without_host_sync():
    """GraphBuckets on the GPU: one graph per bucket, captured on first use; a replay equals the eager split
    forward on the same static buffers bit for bit, and the unpadded eager call within bf16 rounding; once
    captured, loading a new layout and replaying makes no host sync."""
    torch.manual_seed(2)
    H, D = 4, 128
    cfg = None

    def step(layout, q, k, v, out):
        sa.sparse_attention(q, k, v, layout, out=out, config=cfg)

    def buffers(E):
        return {n: torch.zeros(1, H, E, D, device=DEV, dtype=torch.bfloat16) for n in ("q", "k", "v", "out")}
    buckets = balance.GraphBuckets(balance.pow2_edges(8192, 2048), step, buffers, H=H, mask_mod=P.causal(),
                                   device=DEV)
    assert buckets.edges == (2048, 4096, 8192) and buckets.capture
    lengths = (6144, 3072, 7168, 1536, 6144)
    data = {}
    for i, L in enumerate(lengths):
        layout = _routed_gpu(L, H, seed=i)
        q, k, v = (torch.randn(1, H, L, D, device=DEV, dtype=torch.bfloat16) for _ in range(3))
        if cfg is None:
            cfg = _cfg(q, layout, "auto")
        data[i] = (layout, q, k, v)
    for i, L in enumerate(lengths):
        layout, q, k, v = data[i]
        E = buckets.bucket_for(L)
        first = E not in buckets.captured
        if first:
            got = buckets.run(layout, q=q, k=k, v=v)["out"].clone()  # captures this bucket
        else:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
            try:
                got = buckets.run(layout, q=q, k=k, v=v)["out"].clone()  # pad, copy_into, replay: no host sync
            finally:
                torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()
        bufs = buckets.buffers(E)
        assert (bufs["out"][..., L:, :] == 0).all(), "padded rows list nothing: output 0"
        eager_static = sa.sparse_attention(bufs["q"], bufs["k"], bufs["v"], buckets.static(E), config=cfg)
        assert torch.equal(got, eager_static[..., :L, :]), f"L={L}: replay differs from the eager call"
        eager = sa.sparse_attention(q, k, v, layout, config=cfg)
        assert (got.float() - eager.float()).abs().max().item() < 2e-2, f"L={L}: bucket vs unpadded layout"
    assert buckets.captured == (2048, 4096, 8192)
    w = buckets.waste(data[1][0], block_m=cfg.block_m, split="auto", heads=H,
                      sms=torch.cuda.get_device_properties(0).multi_processor_count)
    assert w.bucket == 4096 and w.tokens_waste == 0.25 and w.tasks_used <= w.tasks_allotted
