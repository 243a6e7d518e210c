"""Forward kernel vs the fp64 reference on the layout's dense mask, under the Triton interpreter on CPU."""

import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P
from sparseattn.ops import mask_path_name
from sparseattn.predicates import kernel_predicate
from sparseattn.reference import relative_error, tolerance
from conftest import dense_of

# elementwise bounds (catch one wrong element); the relative Frobenius bound is the package's table
TOL = {torch.float32: dict(atol=2e-5, rtol=2e-5), torch.float16: dict(atol=3e-3, rtol=3e-3)}
DOCS = torch.tensor([0] * 37 + [1] + [2] * 50 + [3] * 60 + [4] * 53)  # 201 positions, one length-1 doc

PATTERNS = {
    "causal": P.causal(),
    "window": P.sliding_window(37),
    "causal&window": P.and_masks(P.causal(), P.sliding_window(20)),
    "sinks+window": P.sinks_window(5, 29),
    "sinks|window (non-causal sinks)": P.or_masks(P.sinks(7), P.sliding_window(16)),
    "dilated": P.and_masks(P.causal(), P.dilated(3)),
    "block_random": P.or_masks(P.block_random(0.3, 32, seed=1), P.sliding_window(8)),
    "document": P.and_masks(P.causal(), P.document(DOCS)),
    "document bidirectional": P.document(DOCS),
    "prefix_lm": P.prefix_lm(20),
    "not": P.not_mask(P.sliding_window(40)),
    "user function": lambda b, h, q, k: ((q * 7 + k * 3) % 5) < 2,
}


def rand(*shape, dtype):
    return torch.randn(*shape, dtype=dtype)


def run_and_check(layout, q, k, v, **kw):
    out = torch.full_like(q, float("nan"))  # poison: unwritten elements fail
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True, out=out, **kw)
    assert o is out
    ref_o, ref_lse = sa.reference_attention(q, k, v, layout.to_dense(), return_lse=True, scale=kw.get("scale"))
    assert not torch.isnan(o).any(), "NaN or unwritten output"
    torch.testing.assert_close(o.double(), ref_o, **TOL[q.dtype])
    assert relative_error(o, ref_o) < tolerance(q.dtype), relative_error(o, ref_o)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite), "empty rows must have LSE -inf, others finite"
    torch.testing.assert_close(lse.double()[finite], ref_lse[finite], atol=1e-4, rtol=1e-5)
    assert (o[~finite.expand_as(o[..., 0])] == 0).all(), "empty rows must be 0"
    return o, lse


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_every_pattern(name, dtype):
    L = 150  # not a multiple of the block
    layout = BlockLayout.from_mask_mod(PATTERNS[name], L, L, 32, 32, device="cpu")
    run_and_check(layout, rand(1, 2, L, 32, dtype=dtype), rand(1, 2, L, 32, dtype=dtype), rand(1, 2, L, 32, dtype=dtype))


def test_mask_paths_are_the_documented_ones():
    def path(name):
        return mask_path_name(BlockLayout.from_mask_mod(PATTERNS[name], 150, 150, 32, 32, device="cpu"))
    for name in ["causal", "window", "causal&window", "sinks+window", "sinks|window (non-causal sinks)",
                 "document", "document bidirectional", "prefix_lm"]:
        assert path(name).startswith("predicate"), name
    for name in ["dilated", "block_random", "not", "user function"]:
        assert path(name).startswith("compiled: "), name


@pytest.mark.parametrize("name", ["causal&window", "sinks+window", "sinks|window (non-causal sinks)", "prefix_lm",
                                  "document"])
def test_predicate_algebra_matches_mask_mod(name):
    pred = kernel_predicate(PATTERNS[name])
    q = torch.arange(180).view(-1, 1)
    k = torch.arange(180).view(1, -1)
    d = q - k
    allowed = (d >= pred.band[0]) & (d <= pred.band[1])
    if pred.has_sinks:
        allowed |= (k < pred.sink_n) & (d >= pred.sink_band[0]) & (d <= pred.sink_band[1])
    if pred.doc_ids is not None:
        allowed &= pred.doc_ids[q] == pred.doc_ids[k]
    assert torch.equal(allowed, dense_of(PATTERNS[name], 180, 180)[0, 0])


@pytest.mark.parametrize("layout_heads", ["1", "Hkv", "Hq"])
def test_gqa_layout_heads(layout_heads):
    Hq, Hkv, L = 4, 2, 96
    H = {"1": 1, "Hkv": Hkv, "Hq": Hq}[layout_heads]
    mm = lambda b, h, q, k: (k <= q) & ((q - k) < 16 + 24 * h)  # noqa: E731  (head-dependent window)
    layout = BlockLayout.from_mask_mod(mm, L, L, 16, 32, H=H, device="cpu")
    run_and_check(layout, rand(1, Hq, L, 64, dtype=torch.float32), rand(1, Hkv, L, 64, dtype=torch.float32),
                  rand(1, Hkv, L, 64, dtype=torch.float32))


def test_batch_with_per_sequence_documents():
    docs = torch.stack([DOCS[:120], torch.sort(torch.randint(0, 5, (120,))).values])
    layout = BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(docs)), 120, 120, 32, 32, B=2,
                                       device="cpu")
    assert mask_path_name(layout).startswith("predicate")
    run_and_check(layout, *(rand(2, 2, 120, 32, dtype=torch.float32) for _ in range(3)))


@pytest.mark.parametrize("Lq,Lk", [(40, 150), (1, 150), (100, 129)])
def test_fewer_queries_than_keys_are_the_last_positions(Lq, Lk):
    layout = BlockLayout.from_mask_mod(PATTERNS["sinks+window"], Lq, Lk, 16, 32, device="cpu")
    run_and_check(layout, rand(1, 2, Lq, 32, dtype=torch.float32), rand(1, 2, Lk, 32, dtype=torch.float32),
                  rand(1, 2, Lk, 32, dtype=torch.float32))


@pytest.mark.parametrize("L", [31, 32, 33, 63, 64, 65, 5])
def test_lengths_around_block_boundaries(L):
    layout = BlockLayout.from_mask_mod(P.causal(), L, L, 32, 32, device="cpu")
    run_and_check(layout, *(rand(1, 1, L, 16, dtype=torch.float32) for _ in range(3)))


def test_one_valid_key_per_row_and_empty_rows():
    L = 80
    mm = lambda b, h, q, k: (k == q // 2) & (q % 3 != 0)  # noqa: E731  (rows q % 3 == 0 are empty)
    layout = BlockLayout.from_mask_mod(mm, L, L, 16, 16, device="cpu")
    q, k, v = (rand(1, 1, L, 32, dtype=torch.float32) for _ in range(3))
    o, lse = run_and_check(layout, q, k, v)
    rows = torch.arange(L)
    assert torch.isinf(lse[0, 0, rows % 3 == 0]).all()
    torch.testing.assert_close(o[0, 0, rows % 3 != 0], v[0, 0, (rows // 2)[rows % 3 != 0]])


def test_fully_empty_layout_and_empty_query_tiles():
    blocks = torch.zeros(1, 1, 3, 3, dtype=torch.bool)
    blocks[0, 0, 2, :2] = True
    layout = BlockLayout.from_block_mask(blocks, 48, 48, 16, 16)
    o, lse = run_and_check(layout, *(rand(1, 1, 48, 16, dtype=torch.float32) for _ in range(3)))
    assert (o[0, 0, :32] == 0).all() and torch.isinf(lse[0, 0, :32]).all()


def test_random_block_layouts_from_dense():
    g = torch.Generator().manual_seed(3)
    for _ in range(3):
        dense = torch.rand(2, 2, 70, 90, generator=g) < 0.15
        dense[:, :, :, :16] |= torch.rand(2, 2, 70, 1, generator=g) < 0.5  # some full tiles
        layout = BlockLayout.from_dense(dense, 16, 32)
        run_and_check(layout, *(rand(2, 2, 70, 32, dtype=torch.float32)[..., :] for _ in range(1)),
                      rand(2, 2, 90, 32, dtype=torch.float32), rand(2, 2, 90, 32, dtype=torch.float32))


def test_large_scores_and_custom_scale():
    L = 64
    layout = BlockLayout.from_mask_mod(P.causal(), L, L, 32, 32, device="cpu")
    q, k, v = (rand(1, 1, L, 32, dtype=torch.float32) * 30 for _ in range(3))
    run_and_check(layout, q, k, v, scale=0.9)


def test_noncontiguous_inputs():
    L = 64
    layout = BlockLayout.from_mask_mod(P.causal(), L, L, 32, 32, device="cpu")
    q = rand(1, L, 2, 32, dtype=torch.float32).transpose(1, 2)  # [B, H, L, D] view with odd strides
    k = rand(1, L, 2, 32, dtype=torch.float32).transpose(1, 2)
    v = rand(1, 2, 32, L, dtype=torch.float32).transpose(-1, -2)  # last dim not contiguous
    run_and_check(layout, q, k, v)


def test_nan_in_unlisted_tiles_is_never_read():
    L = 128
    layout = BlockLayout.from_mask_mod(P.sliding_window(20), L, L, 32, 32, device="cpu")
    q, k, v = (rand(1, 1, L, 32, dtype=torch.float32) for _ in range(3))
    partial, full = layout.block_classes()
    listed_cols = (partial | full)[0, 0].any(0)
    k2, v2 = k.clone(), v.clone()
    o = sa.sparse_attention(q, k, v, layout)
    # poison key rows outside any listed tile of *each* query tile, one query tile at a time
    for i in range(layout.nq):
        rows = (partial | full)[0, 0, i]
        kk, vv = k2.clone(), v2.clone()
        for j in range(layout.nk):
            if not rows[j]:
                kk[..., j * 32:(j + 1) * 32, :] = float("nan")
                vv[..., j * 32:(j + 1) * 32, :] = float("nan")
        o2 = sa.sparse_attention(q, kk, vv, layout)
        torch.testing.assert_close(o2[..., i * 32:(i + 1) * 32, :], o[..., i * 32:(i + 1) * 32, :], rtol=0, atol=0)
    assert listed_cols.any()


# ---- bad input ---------------------------------------------------------------------------------------------
def _ok():
    layout = BlockLayout.from_mask_mod(P.causal(), 32, 32, 16, 16, device="cpu")
    q, k, v = (rand(1, 2, 32, 16, dtype=torch.float32) for _ in range(3))
    return q, k, v, layout


@pytest.mark.parametrize("mutate,exc,match", [
    (lambda q, k, v, l: (q.double(), k.double(), v.double(), l), TypeError, "float16, bfloat16 or float32"),
    (lambda q, k, v, l: (q.half(), k, v, l), TypeError, "share a dtype"),
    (lambda q, k, v, l: (q[..., :12], k[..., :12], v[..., :12], l), ValueError, "head dim"),
    (lambda q, k, v, l: (q, k[:, :, :16], v[:, :, :16], l), ValueError, "kv_len"),
    (lambda q, k, v, l: (q, k, v, "causal"), TypeError, "BlockLayout"),
    (lambda q, k, v, l: (q, k, v, BlockLayout.from_mask_mod(P.causal(), 32, 32, 16, 16, H=3, device="cpu")),
     ValueError, "H=3"),
    (lambda q, k, v, l: (q, k, v, BlockLayout.from_mask_mod(P.causal(), 32, 32, 16, 16, B=2, device="cpu")),
     ValueError, "B=2"),
])
def test_bad_inputs(mutate, exc, match):
    with pytest.raises(exc, match=match):
        sa.sparse_attention(*mutate(*_ok()))


def test_bad_out_and_scale():
    q, k, v, layout = _ok()
    with pytest.raises(ValueError, match="out must be"):
        sa.sparse_attention(q, k, v, layout, out=torch.empty(1, 2, 32, 8))
    with pytest.raises(ValueError, match="scale"):
        sa.sparse_attention(q, k, v, layout, scale=float("nan"))
    with pytest.raises(TypeError, match="deterministic"):
        sa.sparse_attention(q, k, v, layout, deterministic="yes")


@pytest.mark.parametrize("name", ["sinks+window", "dilated", "document"])
@pytest.mark.parametrize("tma", [False, True])
def test_pointer_and_descriptor_paths(name, tma):
    from sparseattn.ops import FwdConfig
    L = 100
    layout = BlockLayout.from_mask_mod(PATTERNS[name], L, L, 32, 32, device="cpu")
    q, k, v = (rand(1, 2, L, 32, dtype=torch.float32) for _ in range(3))
    cfg = FwdConfig(block_m=32, block_n=16, num_warps=4, num_stages=1, tma=tma)  # kernel tiles smaller than the layout's: 2 steps per tile
    run_and_check(layout, q, k, v, config=cfg)


def test_interpreter_works_when_triton_was_imported_first():
    from conftest import run_fresh_python
    code = ("import os, torch, triton\n"  # triton imported before sparseattn chose the interpreter
            "import sparseattn as sa\n"
            "lay = sa.BlockLayout.from_mask_mod(sa.patterns.causal(), 32, 32, 16, 16, device='cpu')\n"
            "q = torch.randn(1, 1, 32, 16)\n"
            "err = (sa.sparse_attention(q, q, q, lay).double() - sa.reference_attention(q, q, q, lay.to_dense())).abs().max()\n"
            "assert err < 1e-5, err\n")
    run_fresh_python(code)


def test_tile_fallback_when_shared_memory_runs_out(monkeypatch):
    """A GPU with little shared memory (Colab's T4) rejects the big tiles at compile time: smaller ones are tried."""
    import triton
    from sparseattn.ops import prefill
    real, seen = prefill._forward_with, []

    def fake(q, k, v, layout, scale, out, cfg):
        seen.append((cfg.block_m, cfg.block_n))
        if len(seen) == 1:
            raise triton.runtime.errors.OutOfResources(300000, 232448, "shared memory")
        return real(q, k, v, layout, scale, out, cfg)

    monkeypatch.setattr(prefill, "_forward_with", fake)
    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 32, 32, device="cpu")
    run_and_check(layout, *(rand(1, 1, 64, 16, dtype=torch.float32) for _ in range(3)))
    assert len(seen) == 2 and seen[1][0] <= 32


def test_ops_leave_the_layout_unchanged():
    """Derived plans are cached in the layout's declared slot: an op on a bits-path layout changes neither its
    fields nor stats(), and a layout accepts no new attributes."""
    layout = BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.dilated(3)), 64, 64, 32, 32, device="cpu")
    before = layout.stats()
    assert before["tile_bits_bytes"] == 0 and layout.tile_bits is None
    sa.sparse_attention(*(rand(1, 1, 64, 16, dtype=torch.float32) for _ in range(3)), layout)
    assert layout.stats() == before and layout.tile_bits is None
    with pytest.raises(AttributeError):
        layout._kernel_cache = {}
