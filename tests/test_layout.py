import subprocess
import sys
import textwrap
from unittest import mock

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparseattn import BlockLayout, patterns as P
from conftest import brute_classes, dense_of

DOC_IDS = torch.tensor([0] * 37 + [1] + [2] * 50 + [3] * 60)  # includes a length-1 document

PATTERNS = {
    "causal": P.causal(),
    "window": P.sliding_window(37),
    "sinks+window": P.sinks_window(5, 29),
    "dilated": P.and_masks(P.causal(), P.dilated(3)),
    "block_random": P.or_masks(P.block_random(0.2, 32, seed=1), P.sliding_window(16)),
    "block_random_unaligned": P.block_random(0.3, 24, seed=2),
    "document": P.and_masks(P.causal(), P.document(DOC_IDS)),
    "document_unsorted": P.document(torch.randint(0, 3, (148,), generator=torch.Generator().manual_seed(3))),
    "prefix_lm": P.prefix_lm(20),
    "not_causal": P.not_mask(P.causal()),
    "plain_function": lambda b, h, q, k: ((q * 7 + k * 3) % 5) < 2,  # no tile rule: every tile evaluated
}


def lists_as_sets(count, index):
    out = {}
    B, H, n, _ = index.shape
    for b in range(B):
        for h in range(H):
            for i in range(n):
                out[(b, h, i)] = index[b, h, i, : count[b, h, i]].tolist()
    return out


def check_layout_against_dense(layout, dense):
    bq, bk = layout.block_q, layout.block_k
    partial, full = brute_classes(dense, bq, bk)
    got_partial, got_full = layout.block_classes()
    assert torch.equal(got_full, full), "full tiles differ from brute force"
    assert torch.equal(got_partial, partial), "partial tiles differ from brute force"
    assert torch.equal(layout.to_dense(), dense)
    layout.validate()
    # indices ascending, padding never needed
    for (count, index) in ((layout.kv_count, layout.kv_index), (layout.full_count, layout.full_index)):
        for row in lists_as_sets(count, index).values():
            assert row == sorted(set(row))


@pytest.mark.parametrize("name", list(PATTERNS))
@pytest.mark.parametrize("Lq,Lk,bq,bk", [(148, 148, 16, 16), (100, 148, 32, 16), (147, 147, 16, 32),
                                         (15, 148, 16, 16), (148, 148, 64, 64)])
def test_from_mask_mod_exact(name, Lq, Lk, bq, bk):
    mm = PATTERNS[name]
    layout = BlockLayout.from_mask_mod(mm, Lq, Lk, bq, bk, device="cpu")
    check_layout_against_dense(layout, dense_of(mm, Lq, Lk))


def test_from_mask_mod_batched_heads():
    ids = torch.stack([DOC_IDS[:100], torch.sort(torch.randint(0, 4, (100,))).values])
    mm = P.and_masks(P.causal(), P.document(ids), lambda b, h, q, k: (q - k) < 40 + 20 * h)
    layout = BlockLayout.from_mask_mod(mm, 100, 100, 16, 16, B=2, H=3, device="cpu")
    check_layout_against_dense(layout, dense_of(mm, 100, 100, B=2, H=3))


@settings(max_examples=25, deadline=None)
@given(st.integers(1, 70), st.integers(1, 70), st.sampled_from([16, 32]), st.sampled_from([16, 32]),
       st.floats(0.0, 1.0), st.integers(0, 2**31 - 1))
def test_from_dense_round_trip(Lq, Lk, bq, bk, p, seed):
    g = torch.Generator().manual_seed(seed)
    # mix of random cells and whole-tile runs so full tiles occur
    dense = torch.rand(2, 1, Lq, Lk, generator=g) < p
    dense[:, :, : Lq // 2] |= torch.rand(2, 1, 1, Lk, generator=g) < 0.5
    layout = BlockLayout.from_dense(dense, bq, bk)
    check_layout_against_dense(layout, dense)


def test_from_block_mask_without_and_with_mask_mod():
    g = torch.Generator().manual_seed(1)
    blocks = torch.rand(1, 2, 5, 6, generator=g) < 0.5
    layout = BlockLayout.from_block_mask(blocks, 70, 90, 16, 16)
    dense = blocks.repeat_interleave(16, 2).repeat_interleave(16, 3)[:, :, :70, :90]
    check_layout_against_dense(layout, dense)
    mm = P.sliding_window(20)
    layout = BlockLayout.from_block_mask(blocks, 70, 90, 16, 16, mask_mod=mm)
    check_layout_against_dense(layout, dense & dense_of(mm, 70, 90))


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 3), st.integers(1, 40), st.integers(1, 300), st.floats(0.0, 1.0), st.booleans(),
       st.integers(0, 2**31 - 1))
def test_class_lists_kernel_equals_torch(BH, nq, nk, p, gpu_blocks, seed):
    """The row-list kernel (two launches, interpreter here) gives the torch version's lists bit for bit, with
    the GPU's block sizes too (16 rows a program, 256 columns a step: rows and columns in several steps)."""
    from sparseattn import _tiles as T
    g = torch.Generator().manual_seed(seed)
    r = torch.rand(BH, 1, nq, nk, generator=g)
    r[:, :, : nq // 3] = 1.0  # some empty rows
    partial, full = r < p / 2, (r >= p / 2) & (r < p)
    want = T.class_lists(partial, full, use_kernel=False)
    blocks = T.row_lists_blocks(BH * nq, nk, interpreter=not gpu_blocks)
    with mock.patch.object(T, "row_lists_blocks", lambda *a: blocks):
        got = T.class_lists(partial, full, use_kernel=True)
    for (wc, wi), (gc, gi) in zip(want, got):
        assert gc.dtype == wc.dtype == torch.int32 and gi.dtype == wi.dtype == torch.int32
        assert torch.equal(gc, wc) and torch.equal(gi, wi)


def test_transposed_lists_equal_brute_force():
    mm = PATTERNS["sinks+window"]
    layout = BlockLayout.from_mask_mod(mm, 150, 180, 16, 32, H=2, device="cpu")
    partial, full = layout.block_classes()
    for blocks, count, index in ((partial, layout.q_count, layout.q_index),
                                 (full, layout.full_q_count, layout.full_q_index)):
        want = blocks.transpose(-1, -2)
        got = lists_as_sets(count, index)
        for (b, h, j), rows in got.items():
            assert rows == want[b, h, j].nonzero().flatten().tolist()
    assert layout.q_count.dtype == torch.int32 and layout.q_index.dtype == torch.int32


def test_transpose_fixed_width():
    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 16, 16, device="cpu")
    t = layout.transpose(width=8)
    assert t.q_index.shape[-1] == 8 and t.full_q_index.shape[-1] == 8
    assert torch.equal(t.full_q_count, layout.full_q_count)


@pytest.mark.parametrize("name", ["causal", "sinks+window", "document", "block_random_unaligned", "not_causal"])
def test_stats_against_brute_force(name):
    Lq, Lk, bq, bk = 147, 147, 16, 32  # not multiples of the blocks
    mm = PATTERNS[name]
    layout = BlockLayout.from_mask_mod(mm, Lq, Lk, bq, bk, device="cpu")
    dense = dense_of(mm, Lq, Lk)
    partial, full = brute_classes(dense, bq, bk)
    listed = partial | full
    cells = listed.repeat_interleave(bq, 2).repeat_interleave(bk, 3)[:, :, :Lq, :Lk]
    s = layout.stats()
    assert s["logical_edges"] == int(dense.sum())
    assert s["physical_edges"] == int(cells.sum())
    assert s["tile_amplification"] == pytest.approx(int(cells.sum()) / int(dense.sum()))
    assert s["full_tiles"] == int(full.sum()) and s["partial_tiles"] == int(partial.sum())
    assert s["empty_rows"] == int((~dense.any(-1)).sum())
    assert s["logical_density"] == pytest.approx(int(dense.sum()) / (Lq * Lk))


def test_stats_empty_rows_and_empty_layout():
    mm = lambda b, h, q, k: (q % 2 == 0) & (k <= q)  # odd rows empty
    layout = BlockLayout.from_mask_mod(mm, 40, 40, 16, 16, device="cpu")
    assert layout.stats()["empty_rows"] == 20
    empty = BlockLayout.from_block_mask(torch.zeros(1, 1, 2, 2, dtype=torch.bool), 32, 32, 16, 16)
    s = empty.stats()
    assert s["logical_edges"] == 0 and s["tile_amplification"] == 1.0 and s["empty_rows"] == 32
    assert not empty.to_dense().any()


def test_to_bsr():
    layout = BlockLayout.from_mask_mod(PATTERNS["sinks+window"], 100, 100, 16, 16, device="cpu")
    bsr = layout.to_bsr()
    partial, full = layout.block_classes()
    indptr, indices, is_full = bsr["indptr"][0, 0], bsr["indices"][0, 0], bsr["is_full"][0, 0]
    for i in range(layout.nq):
        cols = indices[indptr[i]:indptr[i + 1]].tolist()
        assert cols == (partial | full)[0, 0, i].nonzero().flatten().tolist()
        assert is_full[indptr[i]:indptr[i + 1]].tolist() == full[0, 0, i, cols].tolist()




@pytest.mark.parametrize("name", ["sinks+window", "document", "plain_function"])
def test_flex_round_trip(name):
    pytest.importorskip("torch.nn.attention.flex_attention")
    mm = PATTERNS[name]
    layout = BlockLayout.from_mask_mod(mm, 100, 148, 16, 16, device="cpu")
    bm = layout.to_flex()
    back = BlockLayout.from_flex(bm)
    assert torch.equal(back.to_dense(), layout.to_dense())
    assert torch.equal(back.kv_count, layout.kv_count) and torch.equal(back.full_count, layout.full_count)


def test_flex_from_dense_bits_and_gqa_heads():
    pytest.importorskip("torch.nn.attention.flex_attention")
    dense = torch.rand(1, 2, 40, 40) < 0.3
    layout = BlockLayout.from_dense(dense, 16, 16)
    bm = layout.to_flex(num_heads=4)
    assert bm.kv_num_blocks.shape[1] == 4
    back = BlockLayout.from_flex(bm)
    assert torch.equal(back.to_dense(), dense.repeat_interleave(2, 1))


def test_to_device_copy_keeps_lists():
    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 16, 16, device="cpu")
    moved = layout.to("cpu")
    assert moved is not layout and torch.equal(moved.kv_index, layout.kv_index)
    assert torch.equal(moved.to_dense(), layout.to_dense())


# ---- bad input ------------------------------------------------------------------------------------------
def _lists():
    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 16, 16, device="cpu")
    return [t.clone() for t in (layout.kv_count, layout.kv_index, layout.full_count, layout.full_index)]


def _build(kv_count, kv_index, full_count, full_index, **kw):
    args = dict(q_len=64, kv_len=64, block_q=16, block_k=16, mask_mod=P.causal())
    args.update(kw)
    return BlockLayout(kv_count, kv_index, full_count, full_index, **args)


def test_valid_explicit_lists_accepted():
    _build(*_lists())


@pytest.mark.parametrize("mutate,match", [
    (lambda l: l[1].__setitem__((0, 0, 3, 0), 9), "out of range"),
    (lambda l: l[3].__setitem__((0, 0, 3, 1), 0), "strictly ascending"),
    (lambda l: l[2].__setitem__((0, 0, 3), 7), "outside"),
    (lambda l: l[2].__setitem__((0, 0, 0), -1), "outside"),
    (lambda l: l[1].__setitem__((0, 0, 3, 0), 0), "both as partial"),
])
def test_bad_lists_rejected(mutate, match):
    lists = _lists()
    mutate(lists)
    with pytest.raises(ValueError, match=match):
        _build(*lists)


def test_bad_list_dtype_and_shape():
    lists = _lists()
    with pytest.raises(TypeError, match="int32"):
        _build(lists[0].long(), *lists[1:])
    with pytest.raises(ValueError, match="shape"):
        _build(lists[0][..., :2], *lists[1:])
    with pytest.raises(ValueError, match="neither mask_mod nor tile_bits"):
        _build(*lists, mask_mod=None)


@pytest.mark.parametrize("kw,exc", [
    (dict(block_q=24), ValueError), (dict(block_q=8), ValueError), (dict(block_k=0), ValueError),
    (dict(q_len=0), ValueError), (dict(kv_len=-3), ValueError), (dict(q_len=3.0), TypeError),
    (dict(B=0), ValueError),
])
def test_from_mask_mod_bad_args(kw, exc):
    args = dict(q_len=64, kv_len=64, block_q=16, block_k=16)
    args.update(kw)
    with pytest.raises(exc):
        BlockLayout.from_mask_mod(P.causal(), device="cpu", **args)


def test_from_dense_and_block_mask_bad_args():
    with pytest.raises(TypeError, match="bool"):
        BlockLayout.from_dense(torch.zeros(1, 1, 4, 4), 16, 16)
    with pytest.raises(ValueError, match="shape"):
        BlockLayout.from_dense(torch.zeros(4, 4, dtype=torch.bool), 16, 16)
    with pytest.raises(ValueError, match="shape"):
        BlockLayout.from_block_mask(torch.zeros(1, 1, 3, 3, dtype=torch.bool), 64, 64, 16, 16)
    with pytest.raises(TypeError, match="callable"):
        BlockLayout.from_mask_mod("causal", 64, 64, device="cpu")


def test_document_rule_checks_length():
    with pytest.raises(ValueError, match="doc_ids covers"):
        BlockLayout.from_mask_mod(P.document(torch.zeros(10, dtype=torch.long)), 64, 64, 16, 16, device="cpu")


def test_long_window_layout_never_allocates_lq_by_lk():
    # 512k x 512k bools would be 256 GiB; the layout must build in a few hundred MB
    code = textwrap.dedent("""
        import resource, torch
        from sparseattn import BlockLayout, patterns as P
        before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        L = 1 << 19
        layout = BlockLayout.from_mask_mod(P.sliding_window(1024), L, L, 128, 128, device="cpu")
        t = layout.transpose()
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        print((peak - before) / 1024, int(layout.kv_count.sum()), int(layout.full_count.sum()))
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    grow_mb, n_partial, n_full = float(out[0]), int(out[1]), int(out[2])
    assert grow_mb < 3000, f"layout build grew memory by {grow_mb:.0f} MB"
    # window 1024 at block 128: query tile i sees full tiles i-7..i-1, a partial diagonal tile and, from
    # i = 8 on, a partial tile i-8 at the window's far edge
    assert n_partial == 4096 + (4096 - 8)
    assert n_full == sum(min(i, 7) for i in range(4096))
