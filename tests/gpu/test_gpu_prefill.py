"""GPU-only checks (skipped without CUDA): bf16/fp16 at real tile sizes, reads outside the layout, determinism.

Run on the GPU machine with ``python -m pytest tests/gpu -q``.
"""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

TOL = {dt: sa.reference.tolerance(dt) for dt in (torch.bfloat16, torch.float16, torch.float32)}  # the one table
_rel = sa.reference.relative_error


def _patterns(L):
    docs = torch.sort(torch.randint(0, 6, (L,), device="cuda")).values
    return {
        "causal": P.causal(),
        "window1024": P.sliding_window(1024),
        "sinks64+window1024": P.sinks_window(64, 1024),
        "dilated": P.and_masks(P.causal(), P.dilated(4)),
        "block_random": P.or_masks(P.block_random(0.1, 128, seed=0), P.sliding_window(128)),
        "documents": P.and_masks(P.causal(), P.document(docs)),
        "user_fn": lambda b, h, q, k: (k <= q) & (((q ^ k) & 7) != 0),
    }


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("D", [64, 128])
@pytest.mark.parametrize("name", ["causal", "window1024", "sinks64+window1024", "dilated", "block_random",
                                  "documents", "user_fn"])
def test_real_sizes_against_fp64_reference(name, D, dtype):
    torch.manual_seed(0)
    L, H = 3000, 4  # 3000: not a multiple of 128
    mm = _patterns(L)[name]
    layout = BlockLayout.from_mask_mod(mm, L, L, 128, 128, device="cuda")
    q, k, v = (torch.randn(1, H, L, D, device="cuda", dtype=dtype) for _ in range(3))
    out = torch.full_like(q, float("nan"))
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True, out=out)
    ref_o, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True)
    assert not torch.isnan(o).any()
    assert _rel(o, ref_o) < TOL[dtype], _rel(o, ref_o)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    assert (lse.double()[fin] - ref_lse[fin]).abs().max().item() < 1e-2


def test_gqa_and_chunked_prefill_bf16():
    torch.manual_seed(1)
    Lq, Lk, Hq, Hkv, D = 1000, 4100, 8, 2, 128
    layout = BlockLayout.from_mask_mod(P.sinks_window(64, 512),
                                       Lq, Lk, 128, 128, H=Hkv, device="cuda")
    q = torch.randn(2, Hq, Lq, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, Hkv, Lk, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    o = sa.sparse_attention(q, k, v, layout)
    assert _rel(o, sa.reference_attention(q, k, v, layout.to_dense())) < TOL[torch.bfloat16]


@pytest.mark.parametrize("name", ["window1024", "block_random", "documents"])
def test_nan_outside_listed_tiles_is_never_read(name):
    torch.manual_seed(2)
    L, H, D, bs = 4096, 2, 128, 128
    layout = BlockLayout.from_mask_mod(_patterns(L)[name], L, L, bs, bs, device="cuda")
    q, k, v = (torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    o = sa.sparse_attention(q, k, v, layout)
    partial, full = layout.block_classes()
    listed = (partial | full)[0, 0]  # [nq, nk]
    # for a sample of query tiles, NaN every key tile that the row does not list; its output must not change
    for i in [0, 1, layout.nq // 2, layout.nq - 1]:
        kk, vv = k.clone(), v.clone()
        cols = (~listed[i]).repeat_interleave(bs)[:L]
        kk[:, :, cols] = float("nan")
        vv[:, :, cols] = float("nan")
        o2 = sa.sparse_attention(q, kk, vv, layout)
        assert torch.equal(o2[:, :, i * bs:(i + 1) * bs], o[:, :, i * bs:(i + 1) * bs])


def test_forward_is_bitwise_deterministic():
    torch.manual_seed(3)
    L = 8192
    layout = BlockLayout.from_mask_mod(_patterns(L)["sinks64+window1024"], L, L, device="cuda")
    q, k, v = (torch.randn(1, 16, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    first = sa.sparse_attention(q, k, v, layout)
    for _ in range(5):
        assert torch.equal(sa.sparse_attention(q, k, v, layout), first)


def test_layout_built_on_gpu_equals_cpu():
    for name, mm in _patterns(2048).items():
        if name == "documents":
            continue  # its doc ids live on the GPU
        g = BlockLayout.from_mask_mod(mm, 2048, 2048, 128, 128, device="cuda")
        c = BlockLayout.from_mask_mod(mm, 2048, 2048, 128, 128, device="cpu")
        assert torch.equal(g.kv_index.cpu(), c.kv_index) and torch.equal(g.full_index.cpu(), c.full_index), name
        assert torch.equal(g.q_index.cpu(), c.q_index), name
