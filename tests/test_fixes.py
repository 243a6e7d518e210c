"""Regression tests for the silent wrong answers and missing checks found at the package's edges (issue 11).

Each test is named after the item it guards and was run against the code before its fix, where it failed.
"""
import math
import warnings

import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, PagedKVCache, patterns as P
from sparseattn.reference import decode_reference, select_pages_reference

pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def rand(*shape, dtype=torch.float32, g=None):
    return torch.randn(*shape, dtype=dtype, generator=g)


def flex_eager(q, k, v, block_mask, **kw):
    from torch.nn.attention.flex_attention import flex_attention
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_attention(q, k, v, block_mask=block_mask, **kw)


def small_cache(lens=(100, 37), page_size=16, Hkv=2, D=32, num_pages=64, max_pages=16, dtype=torch.float32):
    c = PagedKVCache(num_pages, page_size, Hkv, D, dtype=dtype, device="cpu", max_seqs=len(lens) + 2,
                     max_pages_per_seq=max_pages)
    for s, L in enumerate(lens):
        c.append(s, rand(L, Hkv, D, dtype=dtype), rand(L, Hkv, D, dtype=dtype))
    return c


# ---- 1. from_dense(...).to_flex(): the mask_mod must allow the cells of full tiles --------------------------
def test_1_from_dense_to_flex_keeps_full_tiles():
    dense = torch.ones(32, 32, dtype=torch.bool).tril()[None, None]
    layout = BlockLayout.from_dense(dense, 16, 16)  # tile (1, 0) is full, the diagonal tiles partial
    bm = layout.to_flex()
    idx = torch.arange(32)
    cells = bm.mask_mod(torch.tensor(0), torch.tensor(0), idx[:, None], idx[None, :])
    assert torch.equal(cells, dense[0, 0]), "the Flex mask_mod must say what the layout says on every cell"
    q, k, v = (rand(1, 1, 32, 16) for _ in range(3))
    ref = sa.reference_attention(q, k, v, dense)
    torch.testing.assert_close(flex_eager(q, k, v, bm).double(), ref, atol=1e-5, rtol=1e-5)


# ---- 2. document ids that differ by a multiple of 2**32 must not collide in the kernel ---------------------
@pytest.mark.parametrize("base", [2**32, -(2**32), 2**40 + 2**32, 2**62])
def test_2_document_ids_beyond_int32_do_not_collide(base):
    # ids change inside a tile, so the kernel compares them cell by cell; 0 and base agree in their low 32 bits
    ids = torch.tensor(([0] * 8 + [base] * 8) * 4, dtype=torch.int64)
    mm = P.document(ids)
    layout = BlockLayout.from_mask_mod(mm, 64, 64, 16, 16, device="cpu")
    assert layout.to_dense()[0, 0, 0, 8:16].sum() == 0  # different documents: nothing allowed
    q, k, v = (rand(1, 1, 64, 16) for _ in range(3))
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True)
    ref_o, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True)
    torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, atol=1e-4, rtol=1e-5)


def test_2_document_ids_beyond_int32_backward():
    ids = torch.tensor([0] * 10 + [2**33] * 12 + [7] * 10, dtype=torch.int64)
    layout = BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(ids)), 32, 32, 16, 16, device="cpu")
    q, k, v = (rand(1, 1, 32, 16).requires_grad_() for _ in range(3))
    do = rand(1, 1, 32, 16)
    got = torch.autograd.grad(sa.sparse_attention(q, k, v, layout), (q, k, v), do)
    want = torch.autograd.grad(sa.reference_attention(q, k, v, layout.to_dense()), (q, k, v), do.double())
    for a, b in zip(got, want):  # dq, dk, dv
        torch.testing.assert_close(a.double(), b.double(), atol=3e-5, rtol=3e-5)


# ---- 3. sparse_decode checks scale like sparse_attention and refuses a q that needs a gradient --------------
@pytest.mark.parametrize("scale,exc", [(0.0, ValueError), (-1.0, ValueError), (float("nan"), ValueError),
                                       (float("inf"), ValueError), ("0.1", TypeError), (True, TypeError)])
def test_3_decode_checks_scale(scale, exc):
    cache = small_cache()
    with pytest.raises(exc, match="scale"):
        sa.sparse_decode(rand(2, 4, 32), cache, scale=scale)


def test_3_decode_scale_is_applied():
    cache = small_cache()
    q = rand(2, 4, 32)
    o = sa.sparse_decode(q, cache, scale=0.3)
    ref, _ = decode_reference(q, cache, [0, 1], scale=0.3)
    torch.testing.assert_close(o.double(), ref, atol=2e-5, rtol=2e-5)


def test_3_decode_refuses_q_that_requires_grad():
    cache = small_cache()
    q = rand(2, 4, 32).requires_grad_()
    with pytest.raises(ValueError, match="requires_grad"):
        sa.sparse_decode(q, cache)
    with torch.no_grad():
        assert sa.sparse_decode(q, cache).shape == (2, 4, 32)
    assert not sa.sparse_decode(q.detach(), cache).requires_grad


# ---- 4. merge_states with an LSE of +inf -------------------------------------------------------------------
@pytest.mark.parametrize("side", ["a", "b"])
def test_4_merge_states_rejects_positive_infinite_lse(side):
    o = rand(3, 4)
    lse_ok = torch.zeros(3)
    lse_bad = torch.tensor([0.0, float("inf"), 1.0])
    args = (o, lse_bad, o, lse_ok) if side == "a" else (o, lse_ok, o, lse_bad)
    with pytest.raises(ValueError, match=f"lse_{side}.*\\+inf"):
        sa.merge_states(*args)


# ---- 5. select_pages_reference keeps the lowest forced pages when topk is smaller --------------------------
@pytest.mark.parametrize("topk,first,last", [(1, 1, 1), (2, 2, 1), (3, 2, 3), (1, 0, 3), (4, 3, 3)])
def test_5_reference_keeps_lowest_forced_pages(topk, first, last):
    cache = small_cache(lens=(200, 130), page_size=16, max_pages=16)
    q = rand(2, 4, 32)
    ref = select_pages_reference(q, cache, topk, always_first=first, always_last=last)
    got = sa.select_pages(q, cache, topk, always_first=first, always_last=last)
    for b, L in enumerate((200, 130)):
        n_pages = math.ceil(L / 16)
        forced = sorted(set(range(min(first, n_pages))) | set(range(max(0, n_pages - last), n_pages)))
        want = forced[:topk] if len(forced) >= topk else None
        for h in range(2):
            r = ref.index[b, h, : int(ref.count[b, h])].tolist()
            assert r == got.index[b, h, : int(got.count[b, h])].tolist()
            if want is not None:
                assert r == want, (b, h, r, want)


def test_5_reference_ties_go_to_lower_pages():
    cache = PagedKVCache(16, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=1, max_pages_per_seq=16)
    page = torch.randint(-4, 5, (16, 1, 16)).float()
    cache.append(0, page.repeat(12, 1, 1), page.repeat(12, 1, 1))  # 12 identical pages: every bound ties
    q = torch.randint(-4, 5, (1, 2, 16)).float()
    ref = select_pages_reference(q, cache, topk=5, always_first=0, always_last=1)
    assert ref.index[0, 0].tolist() == [0, 1, 2, 3, 11]


# ---- 7. mask_mods mean the same with the int32 indices of Flex's compiled kernels -------------------------
def catalogue_instances():
    docs = torch.arange(4096) // 700
    return {
        "full": P.full(), "causal": P.causal(), "sliding_window": P.sliding_window(300), "sinks": P.sinks(4),
        "sinks_window": P.sinks_window(4, 300), "dilated": P.dilated(3),
        "block_random": P.block_random(0.05, 128, 7), "document": P.document(docs), "prefix_lm": P.prefix_lm(100),
        "issue": P.and_masks(P.causal(), P.or_masks(P.block_random(0.05, 128, 7), P.sliding_window(512))),
    }


def test_7_every_catalogue_pattern_has_an_instance():
    assert set(P.CATALOGUE) <= set(catalogue_instances())


@pytest.mark.parametrize("name", list(catalogue_instances()))
def test_7_int32_indices_give_the_same_cells(name):
    mm = catalogue_instances()[name]
    q = torch.arange(0, 4096, 7).view(-1, 1)
    k = torch.arange(0, 4096, 5).view(1, -1)
    zero = torch.zeros((), dtype=torch.int64)
    want = mm(zero, zero, q, k)
    got = mm(zero.int(), zero.int(), q.int(), k.int())
    assert torch.equal(torch.broadcast_to(got, want.shape), want)


# ---- 8. CPU tensors on a machine with a GPU: one clear rule for every op ----------------------------------
@pytest.fixture
def gpu_present(monkeypatch):
    from sparseattn import _runtime
    monkeypatch.setattr(_runtime, "_BACKEND", "cuda")
    return monkeypatch


def test_8_every_op_refuses_cpu_tensors_when_a_gpu_runs_the_kernels(gpu_present):
    layout = BlockLayout.from_mask_mod(P.causal(), 32, 32, 16, 16, device="cpu")
    q = rand(1, 2, 32, 16)
    cache = small_cache()
    qd = rand(2, 4, 32)
    calls = {
        "sparse_attention": lambda: sa.sparse_attention(q, q, q, layout),
        "sparse_decode": lambda: sa.sparse_decode(qd, cache),
        "select_pages": lambda: sa.select_pages(qd, cache, topk=2),
        "page_bounds": lambda: sa.routing.page_bounds(qd, cache),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="on the CPU but a GPU is present"):
            call()


def test_8_layouts_and_references_run_anywhere(gpu_present):
    layout = BlockLayout.from_mask_mod(P.causal(), 32, 32, 16, 16, device="cpu")
    q = rand(1, 2, 32, 16)
    sa.reference_attention(q, q, q, layout.to_dense())
    sa.merge_states(q, q[..., 0], q, q[..., 0])
    cache = small_cache()
    qd = rand(2, 4, 32)
    select_pages_reference(qd, cache, topk=2)
    decode_reference(qd, cache, [0, 1])
    BlockLayout.from_dense(layout.to_dense(), 16, 16).stats()


# ---- 6. NaN in K/V reaches only rows that visit its tile; the input range of fp32 scores -------------------
def _block_diagonal_layout(L=96, block=32):
    # causal inside three diagonal 32x32 tiles plus tile (2, 0): query tile 1 never visits key tile 0
    dense = torch.zeros(1, 1, L, L, dtype=torch.bool)
    for t in range(L // block):
        s = slice(t * block, (t + 1) * block)
        dense[0, 0, s, s] = torch.ones(block, block, dtype=torch.bool).tril()
    dense[0, 0, 2 * block:, :block] = True
    return dense, BlockLayout.from_dense(dense, block, block)


@pytest.mark.parametrize("where", ["k", "v"])
def test_6_nan_reaches_only_rows_that_visit_its_tile(where):
    dense, layout = _block_diagonal_layout()
    q, k, v = (rand(1, 2, 96, 16) for _ in range(3))
    clean_o = sa.reference_attention(q, k, v, dense)
    bad = {"k": k.clone(), "v": v.clone()}
    bad[where][0, 0, 5, 3] = float("nan")  # key 5 lies in key tile 0; query tile 1 (rows 32..63) skips it
    kk, vv = bad["k"], bad["v"]
    o = sa.sparse_attention(q, kk, vv, layout)
    ref = sa.reference_attention(q, kk, vv, dense)
    rows_skipping = torch.zeros(96, dtype=torch.bool)
    rows_skipping[32:64] = True
    for out in (o.double(), ref):
        # head 1 never sees the NaN; in head 0 the rows of query tile 1 do not visit key tile 0
        torch.testing.assert_close(out[0, 1], clean_o[0, 1], atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out[0, 0, rows_skipping], clean_o[0, 0, rows_skipping], atol=2e-5, rtol=2e-5)
    # the reference is exact per cell: exactly the rows whose mask allows key 5 are NaN
    allows = dense[0, 0, :, 5]
    assert torch.isnan(ref[0, 0, allows]).any(-1).all() and torch.isfinite(ref[0, 0, ~allows]).all()
    # the kernel may spread it inside a visited tile, never outside: rows allowing key 5 are NaN
    assert torch.isnan(o[0, 0, allows]).any(-1).all()


def test_6_nan_in_decode_reaches_only_rows_that_select_its_page():
    cache = small_cache(lens=(100, 100), Hkv=2)
    page = cache.pages_of(0)[1]
    cache.v_pages[page, 3, 0, 0] = float("nan")  # sequence 0, logical page 1, KV head 0
    q = rand(2, 4, 32)
    index = torch.tensor([[[0, 2], [0, 1]], [[1, 2], [0, 1]]], dtype=torch.int32)  # row 0, head 0 skips page 1
    sel = sa.PageSelection(index, torch.full((2, 2), 2, dtype=torch.int32), cache=cache)
    o = sa.sparse_decode(q, cache, pages=sel)
    ref, _ = decode_reference(q, cache, [0, 1], sel)
    assert torch.isfinite(ref[0, :2]).all() and torch.isfinite(o[0, :2]).all()  # query heads of KV head 0
    torch.testing.assert_close(o[0, :2].double(), ref[0, :2], atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(o[1].double(), ref[1], atol=2e-5, rtol=2e-5)  # sequence 1 has its own pages
    full = sa.sparse_decode(q, cache)  # all pages: KV head 0 of sequence 0 reads the NaN
    assert torch.isnan(full[0, :2]).any(-1).all() and torch.isfinite(full[0, 2:]).all()


@pytest.mark.parametrize("magnitude", [1e4, 1e17])
def test_6_huge_finite_scores_inside_the_documented_range(magnitude):
    """Scaled scores up to ~1e36 (fp32 overflows at 3.4e38): the online softmax keeps them finite and exact."""
    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 32, 32, device="cpu")
    q, k, v = (rand(1, 1, 64, 16) for _ in range(3))
    q = q * magnitude
    k = k * magnitude
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True)
    ref_o, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True)
    assert torch.isfinite(o).all() and torch.isfinite(lse).all()
    torch.testing.assert_close(o.double(), ref_o, atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(lse.double(), ref_lse, rtol=1e-5, atol=0)


def test_6_input_range_is_documented():
    for fn in (sa.sparse_attention, sa.sparse_decode, sa.reference_attention):
        doc = " ".join(fn.__doc__.split())
        assert "NaN" in doc and "visit" in doc, fn.__name__
        assert "2**127" in doc or "fp32" in doc or "float32" in doc, fn.__name__


# ---- 9. mask_mods written for Flex's one-cell-at-a-time evaluation (attention-gym's flamingo mask) ----------
def flamingo_style(intervals: torch.Tensor, image_tokens: int):
    """Cross-attention of text queries to image keys, written the way attention-gym writes it: correct on the
    index scalars Flex's vmap passes, wrong-shaped or failing on whole tiles (``interval[0]`` picks a tile)."""
    image_of_key = torch.repeat_interleave(torch.arange(intervals.shape[0]), image_tokens)

    def vision_cross_attention(b, h, q_idx, kv_idx):
        interval = intervals[image_of_key[kv_idx]]
        return (q_idx >= interval[0]) & (q_idx < interval[1])
    return vision_cross_attention


def flex_dense(mask_mod, Lq, Lk, B=1, H=1):
    from torch.nn.attention.flex_attention import create_mask
    return create_mask(mask_mod, B, H, Lq, Lk, device="cpu")


FLAMINGO = flamingo_style(torch.tensor([[0, 90], [20, 150], [150, 200]]), 48)  # 200 text x 144 image tokens


@pytest.mark.parametrize("block", [16, 32, 64])
def test_9_flamingo_from_mask_mod(block):
    layout = BlockLayout.from_mask_mod(FLAMINGO, 200, 144, block, block, device="cpu")
    assert torch.equal(layout.to_dense(), flex_dense(FLAMINGO, 200, 144))


def test_9_flamingo_from_flex_and_the_kernel():
    from torch.nn.attention.flex_attention import create_block_mask
    bm = create_block_mask(FLAMINGO, None, None, 200, 144, device="cpu", BLOCK_SIZE=32)
    layout = BlockLayout.from_flex(bm)
    want = flex_dense(FLAMINGO, 200, 144)
    assert torch.equal(layout.to_dense(), want)
    q, k, v = rand(1, 2, 200, 16), rand(1, 2, 144, 16), rand(1, 2, 144, 16)
    o = sa.sparse_attention(q, k, v, layout)
    torch.testing.assert_close(o.double(), sa.reference_attention(q, k, v, want), atol=2e-5, rtol=2e-5)
    torch.testing.assert_close(o, flex_eager(q, k, v, bm), atol=2e-5, rtol=2e-5)


def test_9_wrong_shape_without_an_error_falls_back_to_flex_evaluation():
    t, bq, bk = 3, 16, 16
    # on whole tiles the flamingo mask does not raise when bq == bk: it silently returns the wrong shape
    q = torch.arange(t * bq).view(t, bq, 1)
    kv = torch.arange(t * bk).view(t, 1, bk) % 144
    assert FLAMINGO(torch.zeros(t, 1, 1, dtype=torch.long), torch.zeros(t, 1, 1, dtype=torch.long), q, kv).shape \
        == (t, bq, 2)
    layout = BlockLayout.from_mask_mod(FLAMINGO, 200, 144, bq, bk, device="cpu")
    assert torch.equal(layout.to_dense(), flex_dense(FLAMINGO, 200, 144))


def test_9_a_mask_mod_that_fails_both_ways_names_itself():
    def broken(b, h, q_idx, kv_idx):
        raise KeyError("no such table")
    with pytest.raises(ValueError, match="broken.*vmap"):
        BlockLayout.from_mask_mod(broken, 32, 32, 16, 16, device="cpu")


# ---- 10. q_offset: the package's absolute query positions by default, Flex's local ones on request ---------
def test_10_default_is_absolute_and_q_offset_0_is_flex():
    Lq, Lk = 200, 333
    default = BlockLayout.from_mask_mod(P.causal(), Lq, Lk, 32, 32, device="cpu")
    local = BlockLayout.from_mask_mod(P.causal(), Lq, Lk, 32, 32, device="cpu", q_offset=0)
    assert default.q_offset == Lk - Lq and local.q_offset == 0
    rows = torch.arange(Lq)[:, None]
    cols = torch.arange(Lk)[None, :]
    assert torch.equal(default.to_dense()[0, 0], cols <= rows + Lk - Lq)
    assert torch.equal(local.to_dense(), flex_dense(P.causal(), Lq, Lk))
    assert (default.to_dense() != local.to_dense()).sum() == 26600  # the count


@pytest.mark.parametrize("path", ["predicate", "bits"])
def test_10_kernels_follow_the_layouts_q_offset(path):
    Lq, Lk = 72, 130
    mm = P.sinks_window(4, 40) if path == "predicate" else P.and_masks(P.causal(), P.dilated(3))
    layout = BlockLayout.from_mask_mod(mm, Lq, Lk, 32, 32, device="cpu", q_offset=5)
    assert torch.equal(layout.to_dense()[0, 0], mm(0, 0, torch.arange(Lq)[:, None] + 5, torch.arange(Lk)[None]))
    q = rand(1, 2, Lq, 32).requires_grad_()
    k, v = (rand(1, 2, Lk, 32).requires_grad_() for _ in range(2))
    do = rand(1, 2, Lq, 32)
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True)
    ref, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True)
    torch.testing.assert_close(o.double(), ref.detach(), atol=2e-5, rtol=2e-5)
    fin = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), fin)
    got = torch.autograd.grad(o, (q, k, v), do)
    want = torch.autograd.grad(ref, (q, k, v), do.double())
    for a, b in zip(got, want):
        torch.testing.assert_close(a.double(), b.double(), atol=3e-5, rtol=3e-5)


def test_10_a_mask_that_indexes_a_table_of_length_q_len():
    Lq, Lk = 48, 96
    first_key = torch.randint(0, Lk, (Lq,))  # each query attends from its own first key on

    def from_first(b, h, q_idx, kv_idx):
        return kv_idx >= first_key[q_idx]
    layout = BlockLayout.from_mask_mod(from_first, Lq, Lk, 16, 16, device="cpu", q_offset=0)
    assert torch.equal(layout.to_dense(), flex_dense(from_first, Lq, Lk))
    with pytest.raises(ValueError, match="from_first"):  # absolute positions run past the table
        BlockLayout.from_mask_mod(from_first, Lq, Lk, 16, 16, device="cpu")


def test_10_from_block_mask_to_flex_from_flex_and_to_keep_q_offset():
    Lq, Lk = 40, 100
    blocks = torch.ones(1, 1, 3, 7, dtype=torch.bool)
    layout = BlockLayout.from_block_mask(blocks, Lq, Lk, 16, 16, mask_mod=P.causal(), q_offset=0)
    assert torch.equal(layout.to_dense(), flex_dense(P.causal(), Lq, Lk))
    assert layout.to("cpu").q_offset == 0
    back = BlockLayout.from_flex(layout.to_flex())
    assert back.q_offset == 0 and torch.equal(back.to_dense(), layout.to_dense())
    shifted = BlockLayout.from_block_mask(blocks, Lq, Lk, 16, 16, mask_mod=P.causal())
    assert shifted.q_offset == 60 and torch.equal(BlockLayout.from_flex(shifted.to_flex()).to_dense(),
                                                  shifted.to_dense())


@pytest.mark.parametrize("bad,exc", [(-1, ValueError), (1.5, TypeError), ("0", TypeError), (True, TypeError)])
def test_10_bad_q_offset(bad, exc):
    with pytest.raises(exc, match="q_offset"):
        BlockLayout.from_mask_mod(P.causal(), 32, 64, 16, 16, device="cpu", q_offset=bad)
    with pytest.raises(exc, match="q_offset"):
        BlockLayout.from_block_mask(torch.ones(1, 1, 2, 4, dtype=torch.bool), 32, 64, 16, 16, q_offset=bad)


# ---- found while building the bad-input catalogue: backward tiles that straddle layout tiles ---------------
@pytest.mark.parametrize("cfg", [dict(block_m=32, block_n=16, dq_block_m=16, dq_block_n=16),
                                 dict(block_m=16, block_n=16, dq_block_m=32, dq_block_n=16),
                                 dict(block_m=16, block_n=16, dq_block_m=16, dq_block_n=32)])
def test_bwd_config_tiles_larger_than_the_layouts_are_refused(cfg):
    """They used to run and return wrong gradients (a kernel tile read two layout rows' lists as one)."""
    from sparseattn.ops import BwdConfig
    layout = BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.dilated(3)), 64, 64, 16, 16, device="cpu")
    q, k, v = (rand(1, 1, 64, 16).requires_grad_() for _ in range(3))
    with pytest.raises(ValueError, match="bwd_config: kernel tiles"):
        sa.sparse_attention(q, k, v, layout, bwd_config=BwdConfig(**cfg, num_warps=4, num_stages=1))


def test_fast_launch_key_separates_what_triton_specialises_on():
    """The cached launch path's key (sparseattn/_fast_launch.py) keeps apart what would pick a different
    compiled variant: pointer alignment, dtype, bool vs int, exact int values; the interpreter never uses it."""
    from sparseattn import _fast_launch as F
    x = torch.zeros(16)
    assert F._arg_key(x) != F._arg_key(x[1:])  # 4 bytes off a 16-byte boundary
    assert F._arg_key(x) != F._arg_key(x.half())
    assert F._arg_key(True) != F._arg_key(1) and F._arg_key(16) != F._arg_key(17)
    assert F._arg_key(None) is None
    assert not F._hooks_set()  # Triton's empty hook chains do not turn the cache off
    with pytest.raises(F._Uncacheable):
        F._arg_key(object())
    import sparseattn as sa
    from sparseattn import BlockLayout, patterns as P
    layout = BlockLayout.from_mask_mod(P.causal(), 128, 128, 64, 64)
    q = torch.randn(1, 1, 128, 16)
    before = dict(F.stats)
    sa.sparse_attention(q, q, q, layout)
    assert F.stats == before  # interpreted launches never reach the cache
