"""Paged KV cache, sparse decode and Quest page selection (Triton interpreter on CPU)."""
import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sparseattn as sa
from sparseattn import PagedKVCache, PageSelection
from sparseattn import routing
from sparseattn.reference import decode_reference, page_bounds_reference, select_pages_reference
from sparseattn.routing import page_bounds


def make_cache(page_size=16, Hkv=2, D=32, lens=(100, 37, 1), dtype=torch.float32, num_pages=64, max_pages=16):
    c = PagedKVCache(num_pages, page_size, Hkv, D, dtype=dtype, device="cpu", max_seqs=len(lens) + 2,
                     max_pages_per_seq=max_pages)
    for s, L in enumerate(lens):
        c.append(s, torch.randn(L, Hkv, D, dtype=dtype), torch.randn(L, Hkv, D, dtype=dtype))
    return c


def check(q, cache, seqs=None, pages=None):
    B = q.shape[0]
    seqs_list = list(range(B)) if seqs is None else list(seqs)
    o, lse = sa.sparse_decode(q, cache, pages=pages, seqs=seqs, return_lse=True)
    ref_o, ref_lse = decode_reference(q, cache, seqs_list, pages)
    tol = 2e-5 if q.dtype == torch.float32 else 3e-3
    assert not torch.isnan(o).any()
    torch.testing.assert_close(o.double(), ref_o, atol=tol, rtol=tol)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    torch.testing.assert_close(lse.double()[fin], ref_lse[fin], atol=1e-4, rtol=1e-5)
    return o, lse


@pytest.mark.parametrize("page_size", [16, 64, 128])
@pytest.mark.parametrize("group", [1, 4, 8])
def test_dense_decode(page_size, group):
    cache = make_cache(page_size=page_size, Hkv=2, lens=(150, 37, 1), max_pages=10)
    check(torch.randn(3, 2 * group, 32), cache)


@pytest.mark.parametrize("page_size", [16, 64])
def test_sparse_decode_with_selection(page_size):
    cache = make_cache(page_size=page_size, Hkv=2, lens=(200, 90), num_pages=64, max_pages=16)
    q = torch.randn(2, 8, 32)
    sel = sa.select_pages(q, cache, topk=2)
    check(q, cache, pages=sel)


def test_many_splits_and_empty_splits_merge_exactly():
    """One program per 64-token block (47 splits, merged 32 at a time); with a selection most splits are empty."""
    from sparseattn.ops import DecodeConfig
    cache = make_cache(page_size=16, Hkv=1, lens=(3000,), num_pages=200, max_pages=190)
    q = torch.randn(1, 4, 32)
    cfg = DecodeConfig(num_stages=1, programs_per_sm=64)
    for pages in (None, sa.select_pages(q, cache, topk=5)):
        o, lse = sa.sparse_decode(q, cache, pages=pages, return_lse=True, config=cfg)
        ref_o, ref_lse = decode_reference(q, cache, [0], pages)
        torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_fp16_decode_and_seqs_mapping():
    cache = make_cache(dtype=torch.float16, lens=(70, 20, 33))
    q = torch.randn(2, 4, 32, dtype=torch.float16)
    check(q, cache, seqs=[2, 0])


def test_user_selection_and_empty_selection():
    cache = make_cache(page_size=16, lens=(100, 37))
    q = torch.randn(2, 4, 32)
    index = torch.tensor([[[0, 2, 5], [1, 3, 0]], [[0, 2, 0], [0, 0, 0]]], dtype=torch.int32)
    count = torch.tensor([[3, 2], [2, 0]], dtype=torch.int32)  # (row 1, head 1) selects nothing
    sel = PageSelection(index, count, cache=cache, seqs=[0, 1])
    o, lse = check(q, cache, pages=sel)
    assert torch.isinf(lse[1, 2:]).all() and (o[1, 2:] == 0).all()  # heads 2, 3 read KV head 1


def test_unchecked_selection_past_the_end_selects_nothing():
    """A selection built without the cache is not range-checked; pages past a sequence's end (even past the
    page-table row) contribute nothing and are never looked up."""
    cache = make_cache(page_size=16, lens=(100, 37), max_pages=16)
    q = torch.randn(2, 4, 32)
    index = torch.tensor([[[0, 6, 7], [3, 15, 900]], [[1, 2, 40], [0, 0, 0]]], dtype=torch.int32)
    count = torch.tensor([[3, 3], [3, 1]], dtype=torch.int32)
    sel = PageSelection(index, count)  # no cache: only order and sign are checked
    check(q, cache, pages=sel)


def test_seqs_are_range_checked_on_the_host():
    cache = make_cache(lens=(10, 20))  # max_seqs = 4
    q = torch.randn(2, 4, 32)
    with pytest.raises(ValueError, match="max_seqs"):
        sa.sparse_decode(q, cache, seqs=[0, 4])
    with pytest.raises(ValueError, match="max_seqs"):
        sa.select_pages(q, cache, 2, seqs=torch.tensor([-1, 0]))
    with pytest.raises(TypeError, match="integers"):
        sa.sparse_decode(q, cache, seqs=torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="shape"):
        sa.sparse_decode(q, cache, seqs=[0])
    with pytest.raises(ValueError, match="max_seqs"):
        sa.sparse_decode(torch.randn(5, 4, 32), cache)


@pytest.mark.parametrize("index,count,match", [
    ([[[0, 2, 2]]], [[3]], "ascending"),
    ([[[3, 1, 0]]], [[2]], "ascending"),
    ([[[0, -1, 0]]], [[2]], "negative"),
    ([[[0, 1, 0]]], [[4]], "count"),
    ([[[0, 9, 0]]], [[2]], "past the end"),
])
def test_bad_user_selection_rejected(index, count, match):
    cache = make_cache(page_size=16, Hkv=1, lens=(100,))
    with pytest.raises(ValueError, match=match):
        PageSelection(torch.tensor(index, dtype=torch.int32), torch.tensor(count, dtype=torch.int32), cache=cache)


def test_forked_sequences_share_pages_and_copy_on_write():
    cache = make_cache(page_size=16, lens=(40,))
    cache.fork(0, 1)
    assert cache.pages_of(0) == cache.pages_of(1)
    used = cache.num_pages - cache.free_pages
    cache.append(1, torch.randn(5, 2, 32), torch.randn(5, 2, 32))  # last page (8 of 16 filled) is shared
    assert cache.pages_of(0)[:2] == cache.pages_of(1)[:2] and cache.pages_of(0)[2] != cache.pages_of(1)[2]
    assert cache.num_pages - cache.free_pages == used + 1
    k0, _ = cache.gather_dense(0)
    k1, _ = cache.gather_dense(1)
    assert k0.shape[1] == 40 and k1.shape[1] == 45 and torch.equal(k0, k1[:, :40])
    check(torch.randn(2, 4, 32), cache)
    cache.free(1)
    assert cache.num_pages - cache.free_pages == used
    cache.free(0)
    assert cache.free_pages == cache.num_pages


def test_append_across_page_boundaries_and_pool_exhaustion():
    cache = PagedKVCache(4, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=2)
    k = torch.randn(70, 1, 16)
    for a, b in ((0, 10), (10, 16), (16, 33), (33, 40)):
        cache.append(0, k[a:b], k[a:b])
    assert cache.seq_len(0) == 40 and len(cache.pages_of(0)) == 3
    kd, _ = cache.gather_dense(0)
    assert torch.equal(kd[0], k[:40, 0])
    with pytest.raises(ValueError, match="pool is full"):
        cache.append(1, torch.randn(17, 1, 16), torch.randn(17, 1, 16))
    assert cache.seq_len(1) == 0 and cache.free_pages == 1  # nothing changed
    cache.append(1, torch.randn(16, 1, 16), torch.randn(16, 1, 16))
    assert cache.free_pages == 0


def test_cache_bad_arguments():
    with pytest.raises(ValueError, match="power of two"):
        PagedKVCache(4, 24, 1, 16, device="cpu")
    cache = PagedKVCache(4, 16, 2, 16, dtype=torch.float32, device="cpu", max_seqs=2)
    with pytest.raises(ValueError, match="shape"):
        cache.append(0, torch.randn(3, 1, 16), torch.randn(3, 1, 16))
    with pytest.raises(ValueError, match="max_seqs"):
        cache.append(5, torch.randn(3, 2, 16), torch.randn(3, 2, 16))
    with pytest.raises(TypeError, match="cache holds"):
        sa.sparse_decode(torch.randn(1, 2, 16, dtype=torch.float16), cache)
    with pytest.raises(ValueError, match="multiple"):
        sa.sparse_decode(torch.randn(1, 3, 16), cache)


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 80), st.sampled_from([16, 32]), st.integers(0, 2**31 - 1))
def test_bound_is_at_least_every_score_of_its_page(L, page_size, seed):
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(16, page_size, 2, 16, dtype=torch.float32, device="cpu", max_seqs=1, max_pages_per_seq=8)
    cache.append(0, torch.randn(L, 2, 16, generator=g) * 3, torch.randn(L, 2, 16, generator=g))
    q = torch.randn(1, 4, 16, generator=g) * 2
    bound = page_bounds(q, cache)  # [1, Hkv, P]
    k, _ = cache.gather_dense(0)  # [Hkv, L, D]
    for h in range(2):
        scores = torch.einsum("gd,ld->gl", q[0, 2 * h:2 * h + 2], k[h]).amax(0)  # best over the group
        for p in range(-(-L // page_size)):
            assert bound[0, h, p] >= scores[p * page_size:(p + 1) * page_size].max() - 1e-4


def test_select_pages_is_the_top_k_of_its_bound_plus_forced_pages():
    cache = make_cache(page_size=16, Hkv=2, lens=(200, 60), max_pages=16)
    q = torch.randn(2, 4, 32)
    sel = sa.select_pages(q, cache, topk=5, always_first=1, always_last=1)
    bound = page_bounds(q, cache)
    for b, L in enumerate((200, 60)):
        n = -(-L // 16)
        for h in range(2):
            chosen = sel.index[b, h, : sel.count[b, h]].tolist()
            assert chosen == sorted(set(chosen)) and all(0 <= p < n for p in chosen)
            assert 0 in chosen and n - 1 in chosen
            rest = [p for p in range(1, n - 1)]
            want = sorted(sorted(rest, key=lambda p: -float(bound[b, h, p]))[: min(5, n) - 2])
            assert chosen == sorted({0, n - 1, *want})
    PageSelection(sel.index, sel.count, cache=cache)  # valid by construction


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group", [1, 4])
def test_page_bound_kernel_matches_its_reference(dtype, group):
    cache = make_cache(page_size=16, Hkv=2, lens=(150, 37, 1, 0), dtype=dtype, max_pages=12)
    q = torch.randn(3, 2 * group, 32, dtype=dtype)
    got = page_bounds(q, cache, seqs=[0, 2, 3])
    want = page_bounds_reference(q, cache, seqs=[0, 2, 3])
    assert torch.equal(torch.isinf(got), torch.isinf(want))
    fin = torch.isfinite(want)
    assert fin.sum() == 2 * (10 + 1)  # 10 pages of sequence 0, 1 of sequence 2, none of the empty one
    torch.testing.assert_close(got[fin], want[fin], atol=1e-4, rtol=1e-5)


def _same_selection(a, b):
    assert torch.equal(a.count, b.count), (a.count, b.count)
    for r in range(a.count.shape[0]):
        for h in range(a.count.shape[1]):
            c = int(a.count[r, h])
            assert torch.equal(a.index[r, h, :c], b.index[r, h, :c]), (r, h)


@pytest.mark.parametrize("one_block", [True, False])
def test_select_pages_kernel_matches_topk_and_sort(one_block, monkeypatch):
    if not one_block:  # rows longer than the register block: the kernel streams the row in chunks
        monkeypatch.setattr(routing, "_TOPK_BLOCK", 16)
    cache = make_cache(page_size=16, Hkv=2, lens=(600, 60, 0, 17), num_pages=64, max_pages=40)
    q = torch.randn(4, 4, 32)
    for topk in (1, 2, 3, 7, 39, 40, 100) if one_block else (3, 39):
        for first, last in ((1, 1), (0, 0), (3, 2)):
            if topk < first + last:  # which forced pages stay is unspecified then
                continue
            got = sa.select_pages(q, cache, topk, always_first=first, always_last=last)
            assert got.capacity == min(topk, 40)
            _same_selection(got, select_pages_reference(q, cache, topk, always_first=first, always_last=last))
            got.validate(cache)


def test_select_pages_ties_go_to_lower_pages():
    """Identical pages have identical bounds: the threshold falls inside the tie, lower pages win."""
    cache = PagedKVCache(16, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=1, max_pages_per_seq=16)
    page = torch.randint(-4, 5, (16, 1, 16)).float()  # small integers: every bound is exact, so ties are exact
    cache.append(0, page.repeat(10, 1, 1), page.repeat(10, 1, 1))  # 10 equal pages
    q = torch.randint(-4, 5, (1, 2, 16)).float()
    assert (page_bounds(q, cache)[0, 0, :10] == page_bounds(q, cache)[0, 0, 0]).all()
    sel = sa.select_pages(q, cache, topk=4, always_first=0, always_last=1)
    assert sel.count.tolist() == [[4]] and sel.index[0, 0].tolist() == [0, 1, 2, 9]


@settings(max_examples=12, deadline=None)
@given(st.lists(st.integers(0, 300), min_size=1, max_size=3), st.sampled_from([16, 32]), st.integers(1, 30),
       st.integers(0, 2), st.integers(0, 2), st.integers(0, 2**31 - 1))
def test_select_pages_property(lens, page_size, topk, first, last, seed):
    """Random lengths (empty sequences too), page sizes, k and forced pages: the kernel's selection is the
    eager top-k + sort of the eager bound (random keys: no ties)."""
    if topk < first + last:
        topk = first + last
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(64, page_size, 2, 16, dtype=torch.float32, device="cpu", max_seqs=len(lens),
                         max_pages_per_seq=20)
    for s, n in enumerate(lens):
        cache.append(s, torch.randn(n, 2, 16, generator=g), torch.randn(n, 2, 16, generator=g))
    q = torch.randn(len(lens), 4, 16, generator=g)
    got = sa.select_pages(q, cache, topk, always_first=first, always_last=last)
    _same_selection(got, select_pages_reference(q, cache, topk, always_first=first, always_last=last))


def test_more_forced_pages_than_topk_keeps_the_lowest():
    cache = make_cache(page_size=16, Hkv=2, lens=(200,), max_pages=16)
    q = torch.randn(1, 4, 32)
    assert sa.select_pages(q, cache, 1, always_first=1, always_last=1).index[0, :, :1].tolist() == [[0], [0]]
    sel = sa.select_pages(q, cache, 2, always_first=2, always_last=1)
    assert sel.index[0].tolist() == [[0, 1], [0, 1]] and sel.count.tolist() == [[2, 2]]
