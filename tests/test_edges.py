"""The edge cases of the source material, one test each (the rest live where named): block boundary +-1, a length
below one block, one valid key, sinks overlapping the window, duplicate and out-of-range indices (rejected),
empty rows, pages shared by forked sequences, ties in top-k (test_fixes.py, item 5), NaN and huge logits
(test_fixes.py, item 6), dQ, dK and dV checked separately (here and test_properties.py)."""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, PagedKVCache, PageSelection, patterns as P
from sparseattn.reference import decode_reference


def fwd_bwd_check(layout, Hq=2, Hkv=1, D=16, dtype=torch.float32):
    Lq, Lk = layout.q_len, layout.kv_len
    q = torch.randn(1, Hq, Lq, D, dtype=dtype, requires_grad=True)
    k, v = (torch.randn(1, Hkv, Lk, D, dtype=dtype, requires_grad=True) for _ in range(2))
    out = torch.full((1, Hq, Lq, D), float("nan"), dtype=dtype)
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True, out=out)
    ref, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True)
    torch.testing.assert_close(o.detach().double(), ref.detach(), atol=2e-5, rtol=2e-5)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse.double()[fin], ref_lse.detach()[fin], atol=1e-4, rtol=1e-5)
    do = torch.randn_like(o)
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do.double())
    for name, a, b in zip(("dQ", "dK", "dV"), got, want):
        assert (a.double() - b.double()).abs().max() < 5e-5 * max(1.0, float(b.abs().max())), name
    return o, lse, got


@pytest.mark.parametrize("L,mm", [(15, P.causal()), (17, P.causal()), (31, P.and_masks(P.causal(), P.dilated(2))),
                                  (33, P.and_masks(P.causal(), P.dilated(2)))], ids=["15", "17", "31bits", "33bits"])
def test_block_boundary_plus_minus_one(L, mm):
    """One row or column past a tile edge (a clipped tile; the multiple itself is everywhere else)."""
    fwd_bwd_check(BlockLayout.from_mask_mod(mm, L, L, 16, 16, device="cpu"))


@pytest.mark.parametrize("Lq,Lk", [(1, 1), (5, 7), (7, 3)])
def test_length_below_one_block(Lq, Lk):
    fwd_bwd_check(BlockLayout.from_mask_mod(P.causal(), Lq, Lk, 32, 32, device="cpu", q_offset=0))


def test_one_valid_key_per_row():
    L = 40
    for mm in (P.sliding_window(1), P.and_masks(P.causal(), P.sinks(1))):  # the diagonal; key 0 (another tile)
        layout = BlockLayout.from_mask_mod(mm, L, L, 16, 16, device="cpu")
        assert (layout.to_dense().sum(-1) == 1).all()
        o, _, _ = fwd_bwd_check(layout, Hkv=2)


@pytest.mark.parametrize("n,w", [(4, 20), (20, 4), (40, 1)])
def test_sinks_overlapping_the_window_count_once(n, w):
    """Keys that are both sinks and in the window are one edge: counted twice, the output would move."""
    L = 64
    layout = BlockLayout.from_mask_mod(P.sinks_window(n, w), L, L, 16, 16, device="cpu")
    dense = layout.to_dense()
    q = torch.arange(L)[:, None]
    k = torch.arange(L)[None, :]
    assert torch.equal(dense[0, 0], (k <= q) & ((k < n) | (q - k < w)))
    partial, full = layout.block_classes()
    assert not (partial & full).any()  # a tile is listed once
    fwd_bwd_check(layout)


def test_duplicate_and_out_of_range_indices_are_rejected():
    ok = BlockLayout.from_mask_mod(P.causal(), 48, 48, 16, 16, device="cpu")
    dup = ok.full_index.clone()
    dup[0, 0, 2, :2] = torch.tensor([0, 0], dtype=torch.int32)
    with pytest.raises(ValueError, match="duplicate"):
        BlockLayout(ok.kv_count, ok.kv_index, ok.full_count, dup, q_len=48, kv_len=48, block_q=16, block_k=16,
                    mask_mod=ok.mask_mod)
    oor = ok.kv_index.clone()
    oor[0, 0, 0, 0] = 3
    with pytest.raises(ValueError, match="out of range"):
        BlockLayout(ok.kv_count, oor, ok.full_count, ok.full_index, q_len=48, kv_len=48, block_q=16, block_k=16,
                    mask_mod=ok.mask_mod)
    cache = PagedKVCache(8, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=2, max_pages_per_seq=4)
    cache.append(0, torch.randn(40, 1, 16), torch.randn(40, 1, 16))
    with pytest.raises(ValueError, match="duplicate"):
        PageSelection(torch.tensor([[[1, 1]]], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int32))
    with pytest.raises(ValueError, match="past the end"):
        PageSelection(torch.tensor([[[0, 3]]], dtype=torch.int32), torch.tensor([[2]], dtype=torch.int32),
                      cache=cache)


def test_empty_rows_give_zero_output_minus_inf_lse_zero_gradient():
    L = 48
    dense = torch.zeros(1, 1, L, L, dtype=torch.bool)
    dense[0, 0, 20:, :10] = True  # rows 0..19 see nothing; so do keys 10.. (zero dK/dV)
    layout = BlockLayout.from_dense(dense, 16, 16)
    o, lse, (dq, dk, dv) = fwd_bwd_check(layout)
    assert (o[:, :, :20] == 0).all() and torch.isneginf(lse[:, :, :20]).all()
    assert (dq[:, :, :20] == 0).all() and (dk[:, :, 10:] == 0).all() and (dv[:, :, 10:] == 0).all()
    empty = BlockLayout.from_dense(torch.zeros(1, 1, L, L, dtype=torch.bool), 16, 16)  # nothing at all
    o, lse, grads = fwd_bwd_check(empty)
    assert (o == 0).all() and torch.isneginf(lse).all() and all((g == 0).all() for g in grads)


def test_empty_sequence_and_empty_selection_in_decode():
    cache = PagedKVCache(16, 16, 2, 16, dtype=torch.float32, device="cpu", max_seqs=3, max_pages_per_seq=6)
    cache.append(1, torch.randn(30, 2, 16), torch.randn(30, 2, 16))  # sequence 0 stays empty
    q = torch.randn(2, 4, 16)
    o, lse = sa.sparse_decode(q, cache, return_lse=True)
    assert (o[0] == 0).all() and torch.isneginf(lse[0]).all() and torch.isfinite(lse[1]).all()
    sel = PageSelection(torch.zeros(2, 2, 1, dtype=torch.int32), torch.tensor([[0, 0], [0, 1]], dtype=torch.int32))
    o, lse = sa.sparse_decode(q, cache, pages=sel, return_lse=True)
    ref_o, ref_lse = decode_reference(q, cache, [0, 1], sel)
    assert torch.isneginf(lse[1, :2]).all() and (o[1, :2] == 0).all()  # KV head 0 of row 1 selects nothing
    torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)


def test_pages_shared_by_forked_sequences():
    cache = PagedKVCache(16, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=3, max_pages_per_seq=8)
    cache.append(0, torch.randn(40, 1, 16), torch.randn(40, 1, 16))  # 2.5 pages
    cache.fork(0, 1)
    cache.fork(0, 2)
    assert cache.pages_of(1) == cache.pages_of(0) == cache.pages_of(2)
    cache.append(1, torch.randn(10, 1, 16), torch.randn(10, 1, 16))  # copies the shared partial page first
    cache.append(2, torch.randn(30, 1, 16), torch.randn(30, 1, 16))
    assert cache.pages_of(1)[:2] == cache.pages_of(0)[:2] and cache.pages_of(1)[2] != cache.pages_of(0)[2]
    q = torch.randn(3, 2, 16)
    for pages in (None, sa.select_pages(q, cache, topk=2, seqs=[0, 1, 2])):
        o, lse = sa.sparse_decode(q, cache, pages=pages, seqs=[0, 1, 2], return_lse=True)
        ref_o, ref_lse = decode_reference(q, cache, [0, 1, 2], pages)
        torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)
    k0, _ = cache.gather_dense(0)
    assert k0.shape[1] == 40  # the source never sees its forks' writes


@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_huge_logits_of_either_sign(sign):
    layout = BlockLayout.from_mask_mod(P.sinks_window(2, 20), 48, 48, 16, 16, device="cpu")
    q = torch.randn(1, 1, 48, 16) * 1e15 * sign
    k, v = torch.randn(1, 1, 48, 16) * 1e3, torch.randn(1, 1, 48, 16)
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True)
    ref_o, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
