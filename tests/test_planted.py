"""Four classes of real bugs that once survived the whole CPU suite (issue 11, item 11). Each was planted in a
copy of the code and confirmed to give wrong results; each test here fails on its planted bug:

* a tile missing exactly one allowed cell classified as full (tile rules, cell classification, from_dense);
* the bit-table path when the kernel's tiles are smaller than the layout's (row/column offset inside a tile);
* the decode merge across more than one chunk of splits (needs more splits than one merge step holds);
* the pages' stored key min/max against the true min/max of their filled rows.
"""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, PagedKVCache, patterns as P
from sparseattn.ops import BwdConfig, FwdConfig
from conftest import brute_classes, dense_of


# ---- a tile missing exactly one allowed cell is partial, never full -----------------------------------------
def _classes(layout):
    partial, full = layout.block_classes()
    return partial, full


def _check_classes(layout, dense):
    partial, full = _classes(layout)
    want_partial, want_full = brute_classes(dense, layout.block_q, layout.block_k)
    assert torch.equal(full, want_full), "a tile's full/partial class is wrong"
    assert torch.equal(partial, want_partial)
    assert torch.equal(layout.to_dense(), dense)


@pytest.mark.parametrize("block", [16, 32])
def test_band_rules_where_one_cell_is_missing(block):
    """Geometries where a tile misses exactly one cell of a band: causal with the queries ``block - 2`` ahead
    (one cell above the diagonal), windows whose far edge cuts one corner cell, sinks+window, prefix-LM."""
    cases = []
    for extra in range(0, 2 * block):  # q_offset = extra: every alignment of the diagonal against the tiles
        cases.append((P.causal(), 3 * block, 3 * block + extra))
    for w in (block + 1, 2 * block + 1, 2 * block - 1, 3 * block):
        cases.append((P.sliding_window(w), 4 * block, 4 * block))
        cases.append((P.sinks_window(3, w), 4 * block, 4 * block))
    cases.append((P.prefix_lm(block + 1), 3 * block, 3 * block))
    one_cell_tiles = 0
    for mm, Lq, Lk in cases:
        layout = BlockLayout.from_mask_mod(mm, Lq, Lk, block, block, device="cpu")
        dense = dense_of(mm, Lq, Lk)
        _check_classes(layout, dense)
        tiles = dense[0, 0].view(Lq // block, block, -1, block) if Lk % block == 0 else None
        if tiles is not None:
            one_cell_tiles += int(((~tiles).sum(dim=(1, 3)) == 1).sum())
    assert one_cell_tiles > 0, "the geometries must include tiles missing exactly one cell"


@pytest.mark.parametrize("Lq,Lk", [(32, 32), (40, 37)])  # whole tiles, and clipped edge tiles
def test_every_single_missing_cell(Lq, Lk):
    """All-but-one-cell masks, for every cell of a 16x16 tile (and of clipped edge tiles), through every
    constructor: from_mask_mod (cell classification), from_dense, from_block_mask with a mask_mod, from_flex."""
    from torch.nn.attention.flex_attention import create_block_mask
    bq = bk = 16
    for r in range(0, Lq, 3):
        for c in range(0, Lk, 3):
            def all_but(b, h, q, k, r=r, c=c):
                return ~((q == r) & (k == c))
            dense = dense_of(all_but, Lq, Lk)
            _check_classes(BlockLayout.from_mask_mod(all_but, Lq, Lk, bq, bk, device="cpu"), dense)
            _check_classes(BlockLayout.from_dense(dense, bq, bk), dense)
            nq, nk = -(-Lq // bq), -(-Lk // bk)
            listed = torch.ones(1, 1, nq, nk, dtype=torch.bool)
            _check_classes(BlockLayout.from_block_mask(listed, Lq, Lk, bq, bk, mask_mod=all_but), dense)
            if (r, c) in ((0, 0), (Lq - 1, Lk - 1)):
                bm = create_block_mask(all_but, None, None, Lq, Lk, device="cpu", BLOCK_SIZE=16)
                _check_classes(BlockLayout.from_flex(bm), dense)


def test_one_missing_cell_reaches_the_kernel():
    """The kernel skips the missing cell only if its tile is listed as partial."""
    L = 48
    mm = P.and_masks(P.causal(), P.not_mask(lambda b, h, q, k: (q == 40) & (k == 17)))
    layout = BlockLayout.from_mask_mod(mm, L, L, 16, 16, device="cpu")
    q, k, v = (torch.randn(1, 1, L, 16) for _ in range(3))
    o = sa.sparse_attention(q, k, v, layout)
    torch.testing.assert_close(o.double(), sa.reference_attention(q, k, v, dense_of(mm, L, L)), atol=2e-5,
                               rtol=2e-5)


# ---- the bit-table path with kernel tiles smaller than the layout's -------------------------------------------
def _bits_layout(L, block, seed):
    g = torch.Generator().manual_seed(seed)
    dense = torch.rand(1, 2, L, L, generator=g) < 0.35  # every row and column of a tile differs
    dense |= torch.eye(L, dtype=torch.bool)
    return BlockLayout.from_dense(dense, block, block), dense


@pytest.mark.parametrize("deterministic", [True, False])
def test_bits_path_with_kernel_tiles_inside_layout_tiles(deterministic):
    L, block = 96, 64  # layout tiles 64x64; kernel tiles 16 or 32: row and column offsets inside a tile
    layout, dense = _bits_layout(L, block, seed=3)
    q, k, v = (torch.randn(1, 2, L, 32, requires_grad=True) for _ in range(3))
    do = torch.randn(1, 2, L, 32)
    ref = sa.reference_attention(q, k, v, dense)
    want = torch.autograd.grad(ref, (q, k, v), do.double())
    fwd = FwdConfig(block_m=16, block_n=32, num_warps=4, num_stages=1)
    bwd = BwdConfig(block_m=16, block_n=32, dq_block_m=32, dq_block_n=16, num_warps=4, num_stages=1)
    out = torch.full((1, 2, L, 32), float("nan"))
    o = sa.sparse_attention(q, k, v, layout, config=fwd, bwd_config=bwd, deterministic=deterministic, out=out)
    torch.testing.assert_close(o.detach().double(), ref.detach(), atol=2e-5, rtol=2e-5)
    got = torch.autograd.grad(o, (q, k, v), do)
    for name, a, b in zip(("dq", "dk", "dv"), got, want):
        assert (a.double() - b.double()).abs().max() < 5e-5, name


# ---- the decode merge over more than one chunk of splits --------------------------------------------------------
def test_decode_merge_over_several_chunks_of_splits(monkeypatch):
    """With many SMs the decode cuts one row into more splits than one merge step holds (64), so the merge
    folds several chunks; the CPU has 4 stand-in SMs, raised here."""
    from sparseattn.ops import _launch, decode as D
    from sparseattn.reference import decode_reference
    monkeypatch.setattr(_launch, "CPU_SM_COUNT", 512)
    cache = PagedKVCache(160, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=2, max_pages_per_seq=160)
    q = torch.randn(2, 2, 16)
    for s, n in enumerate((1200, 700)):
        # scores that grow along sequence 0 and shrink along sequence 1: the running max of the merge changes
        # from chunk to chunk in one row and stays in the first chunk in the other (both rescalings matter)
        ramp = torch.linspace(0, 1, n) if s == 0 else torch.linspace(1, 0, n)
        k = torch.randn(n, 1, 16) * 0.5 + 4 * ramp.view(n, 1, 1) * q[s].mean(0) / q[s].mean(0).norm()
        cache.append(s, k, torch.randn(n, 1, 16))
    cfg = sa.DecodeConfig(block_n=16, num_stages=1)
    sms = _launch.num_sms(torch.device("cpu"))
    n_splits, _ = D.decode_splits(2, 1, 160 * 16, 16, sms, D.decode_programs_per_sm(cfg, 2, 1, sms))
    assert n_splits > 2 * 64, n_splits  # three merge chunks
    o, lse = sa.sparse_decode(q, cache, return_lse=True, config=cfg)
    ref_o, ref_lse = decode_reference(q, cache, [0, 1])
    torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_cpu_sm_count_default_is_unchanged():
    from sparseattn.ops import _launch
    assert _launch.CPU_SM_COUNT == 4 and _launch.num_sms(torch.device("cpu")) == 4


# ---- pages' stored key bounds equal the min/max of their filled rows --------------------------------------------
def _check_page_bounds(cache, seqs):
    for s in seqs:
        k, _ = cache.gather_dense(s)  # [Hkv, L, D]
        L = k.shape[1]
        for i, page in enumerate(cache.pages_of(s)):
            rows = k[:, i * cache.page_size: min(L, (i + 1) * cache.page_size)]  # the filled rows of this page
            assert torch.equal(cache.k_min[page], rows.amin(1)), (s, i)
            assert torch.equal(cache.k_max[page], rows.amax(1)), (s, i)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_page_key_bounds_are_the_filled_rows_min_max(dtype):
    g = torch.Generator().manual_seed(1)
    cache = PagedKVCache(40, 16, 2, 8, dtype=dtype, device="cpu", max_seqs=4, max_pages_per_seq=12)

    def kv(n):  # positive keys: an unfilled row (zeros) would lower the min if it were counted
        return (torch.rand(n, 2, 8, generator=g) + 1).to(dtype), torch.randn(n, 2, 8, generator=g).to(dtype)
    for n in (5, 16, 11, 1, 30):  # partial pages filled in several appends, page boundaries crossed
        cache.append(0, *kv(n))
        _check_page_bounds(cache, [0])
    cache.append(1, *(-x for x in kv(20)))  # negative keys: unfilled zeros would raise the max
    cache.fork(0, 2)  # shared pages; the fork's next write copies the partly filled page
    cache.append(2, *kv(7))
    cache.append(0, *kv(3))
    _check_page_bounds(cache, [0, 1, 2])
    cache.free(1)
    cache.append(3, *kv(9))  # reuses freed pages that still hold old rows
    _check_page_bounds(cache, [0, 2, 3])
