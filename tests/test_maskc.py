"""The mask_mod compiler (sparseattn.maskc): traced predicate == eager mask_mod cell by cell, the fallback to
per-tile bits, the cache, the kernels on the compiled path, and the layout build's device path (interpreter)."""
import warnings

import pytest
import torch
from hypothesis import given, settings, strategies as st

import sparseattn as sa
from sparseattn import BlockLayout, _tiles as T, maskc, patterns as P
from sparseattn.ops import forced_mask_path, mask_path_name
from sparseattn.patterns import TileGrid
from test_prefill_bwd import check_grads
from test_prefill_fwd import rand, run_and_check

FAST = settings(max_examples=6, deadline=None, derandomize=True)


def eager_cells(mask_mod, B, H, Lq, Lk, q_offset):
    """The mask_mod on every cell, eagerly (int64 index tensors): bool [B, H, Lq, Lk]."""
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = (torch.arange(Lq) + q_offset).view(1, 1, Lq, 1)
    k = torch.arange(Lk).view(1, 1, 1, Lk)
    return torch.broadcast_to(mask_mod(b, h, q, k), (B, H, Lq, Lk))


def compiled_cells(mask_mod, B, H, Lq, Lk, q_offset):
    """The compiled predicate on every cell: one 128 x 128 tile per (b, h) of the mask_tiles kernel."""
    assert Lq <= 128 and Lk <= 128
    c = maskc.compile_mask(mask_mod)
    b, h = (x.flatten() for x in torch.meshgrid(torch.arange(B), torch.arange(H), indexing="ij"))
    zero = torch.zeros_like(b)
    cells = T.eval_tiles_compiled(c, b, h, zero, zero, q_offset, Lq, Lk, 128, 128)
    return cells.view(B, H, 128, 128)[:, :, :Lq, :Lk]


def assert_compiles_exactly(mask_mod, B=2, H=3, Lq=97, Lk=120, q_offset=23):
    want = eager_cells(mask_mod, B, H, Lq, Lk, q_offset)
    got = compiled_cells(mask_mod, B, H, Lq, Lk, q_offset)
    bad = (got != want).nonzero()
    assert not bad.numel(), f"{len(bad)} cells differ, first (b, h, q, kv) = {bad[0].tolist()}"


shapes = st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 128), st.integers(1, 128),
                   st.integers(0, 300))


def catalogue_mask(draw, name):
    L = 450  # covers q_offset + Lq for every drawn shape
    if name in ("full", "causal"):
        return P.CATALOGUE[name]()
    if name == "sliding_window":
        return P.sliding_window(draw(st.integers(1, 90)))
    if name == "sinks":
        return P.sinks(draw(st.integers(0, 40)))
    if name == "sinks_window":
        return P.sinks_window(draw(st.integers(0, 40)), draw(st.integers(1, 90)))
    if name == "dilated":
        return P.dilated(draw(st.integers(1, 9)))
    if name == "block_random":
        return P.block_random(draw(st.floats(0, 1)), draw(st.integers(1, 40)), draw(st.integers(0, 5)))
    if name == "document":
        n = draw(st.integers(1, 12))
        g = torch.Generator().manual_seed(draw(st.integers(0, 99)))
        ids = torch.randint(0, n, (draw(st.sampled_from([1, 2])), L), generator=g)
        if draw(st.booleans()):
            ids = ids.sort(-1).values
        ids = ids[0] if draw(st.booleans()) else ids
        return P.document(ids.to(draw(st.sampled_from([torch.int64, torch.int32, torch.int16]))))
    if name == "prefix_lm":
        return P.prefix_lm(draw(st.integers(0, 60)))
    raise AssertionError(name)


@pytest.mark.parametrize("name", sorted(P.CATALOGUE))
@FAST
@given(data=st.data(), shape=shapes)
def test_every_catalogue_pattern_compiles_cell_by_cell(name, data, shape):
    B, H, Lq, Lk, q_offset = shape
    mm = catalogue_mask(data.draw, name)
    if name == "document" and getattr(mm, "doc_ids").dim() == 2 and mm.doc_ids.shape[0] != B:
        B = mm.doc_ids.shape[0]
    assert_compiles_exactly(mm, B, H, Lq, Lk, q_offset)


@FAST
@given(data=st.data(), shape=shapes)
def test_compositions_compile_cell_by_cell(data, shape):
    B, H, Lq, Lk, q_offset = shape
    names = [n for n in sorted(P.CATALOGUE) if n != "document"]

    def leaf():
        return catalogue_mask(data.draw, data.draw(st.sampled_from(names)))

    def node(depth):
        if depth == 0 or data.draw(st.booleans()):
            return leaf()
        kind = data.draw(st.sampled_from(["and", "or", "not"]))
        if kind == "not":
            return P.not_mask(node(depth - 1))
        parts = [node(depth - 1) for _ in range(data.draw(st.integers(2, 3)))]
        return (P.and_masks if kind == "and" else P.or_masks)(*parts)
    assert_compiles_exactly(node(2), B, H, Lq, Lk, q_offset)


def test_captured_tables_per_batch_and_head_any_integer_dtype():
    g = torch.Generator().manual_seed(0)
    tab = torch.randint(-5, 9, (3, 130), generator=g)  # [H, L]
    per_b = torch.randint(0, 4, (2, 130), generator=g).to(torch.int8)  # [B, L]
    win = torch.tensor([3, 17, 40], dtype=torch.int16)  # per-head window
    keep = torch.rand(130, generator=g) < 0.5
    u8 = torch.randint(0, 255, (130,), generator=g, dtype=torch.uint8)
    masks = {
        "per-head table, floor // and % of negatives": lambda b, h, q, kv: ((tab[h, q] - tab[h, kv]) // 3) % 4 == 1,
        "per-batch ids, bool table": lambda b, h, q, kv: (per_b[b, q] == per_b[b, kv]) | keep[kv],
        "per-head window": lambda b, h, q, kv: (kv <= q) & (q - kv < win[h].long()),
        "uint8 and int16 arithmetic wraps as in eager torch": lambda b, h, q, kv: ((u8[q] + u8[kv]) > 200) ^ (
            u8[q] * 3 - 1 < u8[kv].int() * 2) | ((tab.int()[h, q] * 2**30 + 5).to(torch.int16) > 0),
        "negative indices wrap like torch": lambda b, h, q, kv: keep[kv - 130] & keep[-1 - q],
        "where, minimum, maximum, abs, shifts, xor": lambda b, h, q, kv: torch.where(
            q > kv, torch.minimum(q, kv * 2) % 5 == 0, (abs(q - kv) ^ (kv >> 2)) < torch.maximum(q, kv) // 3),
        "truncating division": lambda b, h, q, kv: torch.div(kv - q, 7, rounding_mode="trunc") % 2 == 0,
        "logical ops and bool arithmetic": lambda b, h, q, kv: torch.logical_xor(q > kv, keep[q]) & ~(
            (q + (kv > 5)) % 3 == 0),
        "wide integer arithmetic (int64 wrap)": lambda b, h, q, kv: ((q * 0x1E3779B97F4A7C15 + kv) >> 60) == 3,
        "constant 0-d tensor": lambda b, h, q, kv: (q - kv) < torch.tensor(9),
        "one position only": lambda b, h, q, kv: keep[kv],
        "the head only": lambda b, h, q, kv: win[h] > 10,
        "a constant": lambda b, h, q, kv: torch.ones_like(q) > 0,
        "a variable shift": lambda b, h, q, kv: ((q << (kv % 40)) >> 33) % 2 == 0,
        "powers of two: shift and mask floor for negatives": lambda b, h, q, kv: ((q - kv) // 16 + (kv - q) % 8) > 1,
    }
    for name, mm in masks.items():
        B = 2 if "batch" in name else 1
        assert_compiles_exactly(mm, B=B, H=3, Lq=128, Lk=128, q_offset=2), name


def test_broadcasting_and_q_offset_through_layouts():
    """GQA and a layout over 1 / KV / query heads, q_offset != 0 (fewer queries than keys)."""
    win = torch.tensor([5, 30, 9, 60])
    mm = lambda b, h, q, k: (k <= q) & ((q - k) < win[h]) | (k % 16 == 3)  # noqa: E731
    for H in (1, 2, 4):
        layout = BlockLayout.from_mask_mod(mm, 70, 100, 32, 32, H=H, device="cpu")
        assert layout.q_offset == 30 and mask_path_name(layout).startswith("compiled: ")
        run_and_check(layout, rand(1, 4, 70, 32, dtype=torch.float32), rand(1, 2, 100, 32, dtype=torch.float32),
                      rand(1, 2, 100, 32, dtype=torch.float32))


@pytest.mark.parametrize("deterministic", [True, False])
def test_forward_and_backward_on_the_compiled_path(deterministic):
    ids = torch.sort(torch.randint(0, 6, (2, 120))).values
    heads = torch.tensor([[0, 1], [1, 0]], dtype=torch.int32)  # [B, H] per-batch, per-head switch
    mm = lambda b, h, q, k: (k <= q) & ((ids[b, q] == ids[b, k]) | (((q - k) // 8) % 3 == heads[b, h]))  # noqa: E731
    layout = BlockLayout.from_mask_mod(mm, 120, 120, 32, 32, B=2, H=2, device="cpu")
    assert mask_path_name(layout).startswith("compiled: ")
    q, k, v = (rand(2, 2, 120, 32, dtype=torch.float32) for _ in range(3))
    o, _ = run_and_check(layout, q, k, v)
    check_grads(layout, q, k, v, deterministic=deterministic)
    if deterministic:
        with forced_mask_path("bits"):  # the path it replaces gives the same output
            assert mask_path_name(layout) == "bits"
            torch.testing.assert_close(sa.sparse_attention(q, k, v, layout), o, atol=1e-6, rtol=1e-6)
            check_grads(layout, q, k, v)


def test_forced_compiled_path_on_a_predicate_pattern():
    layout = BlockLayout.from_mask_mod(P.sinks_window(4, 24), 96, 96, 32, 32, device="cpu")
    assert mask_path_name(layout).startswith("predicate")
    q, k, v = (rand(1, 2, 96, 32, dtype=torch.float32) for _ in range(3))
    with forced_mask_path("compiled"):
        assert mask_path_name(layout).startswith("compiled: (kv_idx <= q_idx)")
        run_and_check(layout, q, k, v)
    with pytest.raises(ValueError, match="kind must be"):
        with forced_mask_path("fast"):
            pass
    dense = BlockLayout.from_dense(torch.rand(1, 1, 96, 96) < 0.3, 32, 32)
    assert mask_path_name(dense) == "bits"
    with forced_mask_path("compiled"), pytest.raises(ValueError, match="does not compile"):
        mask_path_name(dense)


# ---- what does not compile: one warning naming the operation, then the exact bits path --------------------------
UNSUPPORTED = {
    "true division": (lambda b, h, q, k: (q / 2).floor() >= k, "true division"),
    "a float table": (lambda b, h, q, k: SCORES[q, k] > 0.5, "float32 tensor"),
    "five captured tensors": (lambda b, h, q, k: T5[0][q] & T5[1][q] & T5[2][k] & T5[3][k] & T5[4][q], "more than 4"),
    "torch.as_tensor": (lambda b, h, q, k: torch.as_tensor(q) >= k, r"len\(\) of a traced value \(torch.as_tensor"),
    "an attribute": (lambda b, h, q, k: k < q.shape[-1], "attribute or method .shape"),
}
SCORES = torch.rand(96, 96)
T5 = [torch.rand(96) < 0.8 for _ in range(5)]


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_masks_warn_once_and_stay_exact(name):
    mm, op = UNSUPPORTED[name]
    layout = BlockLayout.from_mask_mod(mm, 96, 96, 32, 32, device="cpu")
    with pytest.warns(maskc.MaskCompileWarning, match=op) as record:
        assert mask_path_name(layout) == "bits"
    assert len(record) == 1 and "partial tiles use per-tile bits" in str(record[0].message)
    assert "\n" not in str(record[0].message)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # the same mask again: no second warning
        assert mask_path_name(BlockLayout.from_mask_mod(mm, 96, 96, 32, 32, device="cpu")) == "bits"
    if name == "a float table":
        run_and_check(layout, *(rand(1, 1, 96, 16, dtype=torch.float32) for _ in range(3)))


@pytest.mark.parametrize("mm,op", [
    (lambda b, h, q, k: (k <= q) if q > 3 else k >= 0, "bool()"),
    (lambda b, h, q, k: (q >= 0) and (k <= q), "bool()"),
    (lambda b, h, q, k: min(q, k) > 2, "bool()"),
    (lambda b, h, q, k: k <= int(q), "int()"),
    (lambda b, h, q, k: 3, "returned int"),
    (lambda b, h, q, k: q - k, "integer value"),
    (lambda b, h, q, k: (q << k) > 0, "shift"),
])
def test_data_dependent_control_flow_does_not_trace(mm, op):
    with pytest.raises(maskc.Unsupported, match=op.replace("(", r"\(").replace(")", r"\)")):
        maskc.trace(mm)
    with pytest.warns(maskc.MaskCompileWarning, match="is not compiled"):
        assert maskc.compile_or_none(mm) is None


def test_bad_input_names_the_argument():
    with pytest.raises(TypeError, match="mask_mod must be callable"):
        maskc.trace(3)
    with pytest.raises(ValueError, match="pos_bound"):
        maskc.trace(P.causal(), pos_bound=0)
    tab = torch.arange(20).view(2, 10)
    with pytest.raises(TypeError, match="float32 tensor; indices must be integers"):
        maskc.trace(lambda b, h, q, k: tab[torch.tensor(1.0), q] > k)
    with pytest.raises(TypeError, match="float32 tensor; indices must be integers"):
        maskc.compile_or_none(lambda b, h, q, k: tab[torch.tensor(1.0), k] > q)


# ---- the cache ----------------------------------------------------------------------------------------------------
def test_cache_hits_for_an_equal_structure_with_other_captured_data(tmp_path, monkeypatch):
    monkeypatch.setenv("SPARSEATTN_CACHE_DIR", str(tmp_path))
    a, b = torch.sort(torch.randint(0, 5, (2, 200))).values
    first, second = P.and_masks(P.causal(), P.document(a)), P.and_masks(P.causal(), P.document(b))
    ca = maskc.compile_mask(first)
    hits = maskc.STATS["hits"]
    cb = maskc.compile_mask(second)
    assert maskc.STATS["hits"] == hits + 1 and ca.key == cb.key and ca.fn is cb.fn
    # the data is an argument, not part of the code
    assert ca.captures[0].data_ptr() == a.data_ptr() and cb.captures[0].data_ptr() == b.data_ptr()
    assert ca.key == maskc.compile_mask(P.and_masks(P.causal(), P.document(a.int()))).key  # a load is a load
    assert ca.key != maskc.compile_mask(P.and_masks(P.causal(), P.document(a.to(torch.int8)))).key  # widened
    assert ca.key != maskc.compile_mask(P.and_masks(P.causal(), P.sliding_window(7))).key
    for mm in (first, second):
        assert_compiles_exactly(mm, B=1, H=1, Lq=100, Lk=128, q_offset=70)
    # the generated module is a real file Triton can read the source of
    files = list(tmp_path.glob("sa_mask_*.py"))
    assert files and all("@triton.jit" in f.read_text() for f in files)
    assert maskc.generate(maskc.trace(first)) == maskc.generate(maskc.trace(second)) == ca.source


def test_int32_unless_the_range_needs_int64():
    """The cell predicate computes in int32 unless a node's range needs int64 (the tile bounds, a few scalar
    operations per tile, are int64 throughout)."""
    def pred(mm, **kw):
        return maskc.compile_mask(mm, **kw).source.split("def bounds")[0]
    narrow = pred(lambda b, h, q, k: (q - k) % 7 < 3)
    assert "int64" not in narrow and "_mod(" in narrow  # q - k may be negative: floor modulo helper
    nonneg = pred(lambda b, h, q, k: (q + k) % 7 < 3)
    assert "_mod(" not in nonneg  # both operands non-negative: Triton's % agrees with torch's
    assert "tl.int64" in pred(lambda b, h, q, k: q * k > 1 << 40)
    assert "tl.int64" in pred(lambda b, h, q, k: q * k > 5, pos_bound=1 << 31)


# ---- the layout build's device path ---------------------------------------------------------------------------------
@pytest.mark.parametrize("case", ["plain lambda", "tables per batch and head", "listed tiles", "undecided docs"])
def test_layout_device_path_equals_the_torch_path(case):
    g = torch.Generator().manual_seed(1)
    tab = torch.randint(0, 3, (2, 3, 200), generator=g)[0]  # [3, 200]: rows per head, then per batch row
    B, H, listed = 1, 1, None
    if case == "plain lambda":
        mm = lambda b, h, q, k: (k <= q) & (((q - k) // 32) % 3 == 0)  # noqa: E731
    elif case == "tables per batch and head":
        mm, B, H = (lambda b, h, q, k: (tab[h, q] == tab[2 - h, k]) | (tab[b, k] == 2)), 2, 3
    elif case == "listed tiles":
        mm = P.dilated(5)
        listed = torch.rand(1, 1, 5, 7, generator=g) < 0.6
    else:  # unsorted ids: the tile rule leaves the tiles undecided
        mm = P.document(torch.randint(0, 4, (200,), generator=g))
    grid = TileGrid(40, 150, 200, 32, 32, B, H, torch.device("cpu"))
    got = T.classify(mm, grid, listed, use_kernel=True)
    want = T.classify(mm, grid, listed, use_kernel=False)
    assert got[0].any() and all(torch.equal(x, y) for x, y in zip(got, want))
    with T.classify_kernel(True):
        a = BlockLayout.from_mask_mod(mm, 150, 200, 32, 32, B=B, H=H, device="cpu")
    b = BlockLayout.from_mask_mod(mm, 150, 200, 32, 32, B=B, H=H, device="cpu")
    for name in ("kv_count", "kv_index", "full_count", "full_index"):
        assert torch.equal(getattr(a, name), getattr(b, name)), name


# ---- tile bounds from the traced graph --------------------------------------------------------------------------
def exact_classes(mask_mod, grid):
    """(some cell allowed, every in-range cell allowed) per tile, from every cell evaluated eagerly."""
    cells = eager_cells(mask_mod, grid.B, grid.H, grid.q_len, grid.kv_len, grid.q_start)
    nq, nk, bq, bk = grid.nq, grid.nk, grid.block_q, grid.block_k
    pad = torch.nn.functional.pad(cells, (0, nk * bk - grid.kv_len, 0, nq * bq - grid.q_len))
    ok = torch.nn.functional.pad(torch.ones(grid.q_len, grid.kv_len, dtype=torch.bool),
                                 (0, nk * bk - grid.kv_len, 0, nq * bq - grid.q_len))
    tiles = pad.view(grid.B, grid.H, nq, bq, nk, bk)
    return tiles.any(dim=(3, 5)), (tiles | ~ok.view(1, 1, nq, bq, nk, bk)).all(dim=(3, 5))


def assert_bounds_sound(mask_mod, grid):
    """The traced bounds never contradict the cells: a tile they empty has no allowed cell, a tile they fill
    has every in-range cell allowed. Returns how many tiles they decided."""
    tb = maskc.tile_bounds(mask_mod, grid)
    some, every = exact_classes(mask_mod, grid)
    assert not (~tb.any_hi & some).any(), "a tile bounded empty has an allowed cell"
    assert not (tb.all_lo & ~every).any(), "a tile bounded full has a masked cell"
    return int((~tb.any_hi).sum() + tb.all_lo.sum())


LAMBDAS = {
    "stripes": lambda b, h, q, k: (k <= q) & (((q - k) // 32) % 3 == 0),
    "band": lambda b, h, q, k: (k <= q) & (q - k < 70),
    "where": lambda b, h, q, k: torch.where(q > 100, k < q - 30, k >= q // 2),
    "min/max": lambda b, h, q, k: torch.maximum(q - 50, torch.zeros_like(q)) <= torch.minimum(k * 2, q),
    "negated mod": lambda b, h, q, k: ~((q + 3 * k) % 5 == 1) & (k - q <= 40),
    "heads": lambda b, h, q, k: (k < q + 8 * h) | (b == 1) & (k % 64 < 16),
    "int cast": lambda b, h, q, k: ((q - k).to(torch.int16) >= 0) & ((q * k) % 7 != 3),
}


@pytest.mark.parametrize("name", sorted(LAMBDAS))
@FAST
@given(shape=st.tuples(st.integers(1, 2), st.integers(1, 3), st.integers(1, 300), st.integers(1, 300),
                       st.integers(0, 200), st.sampled_from([16, 32, 64])))
def test_traced_tile_bounds_are_sound(name, shape):
    """Interval bounds from the traced graph (maskc.tile_bounds), on plain lambdas mixing comparisons,
    floor division and modulo, where/min/max, negation, heads and batches, a narrowing cast: never wrong on
    any tile of random grids (lengths that end inside a tile, query offsets)."""
    B, H, Lq, Lk, off, blk = shape
    assert_bounds_sound(LAMBDAS[name], TileGrid(off, Lq, Lk, blk, blk, B, H, torch.device("cpu")))


def draw_composition(data):
    """Two catalogue patterns (documents aside) under ``and``/``or``, negated or not."""
    names = [n for n in sorted(P.CATALOGUE) if n != "document"]
    parts = [catalogue_mask(data.draw, data.draw(st.sampled_from(names))) for _ in range(2)]
    mm = data.draw(st.sampled_from([P.and_masks, P.or_masks]))(*parts)
    return P.not_mask(mm) if data.draw(st.booleans()) else mm


@FAST
@given(data=st.data(), shape=shapes)
def test_traced_tile_bounds_of_compositions_are_sound(data, shape):
    """The same on compositions of catalogue patterns (the traced graph of each pattern's own predicate)."""
    B, H, Lq, Lk, q_offset = shape
    assert_bounds_sound(draw_composition(data), TileGrid(q_offset, Lq, Lk, 16, 16, B, H, torch.device("cpu")))


def test_traced_bounds_decide_the_tiles_a_plain_lambda_leaves():
    """A plain lambda has no tile rule: the traced bounds empty every tile above the diagonal of causal &
    stripes and fill a band's inner tiles; the layouts equal the ones built from every cell."""
    grid = TileGrid(0, 1000, 1000, 64, 64, 1, 1, torch.device("cpu"))
    stripes, band = LAMBDAS["stripes"], LAMBDAS["band"]
    tb = maskc.tile_bounds(stripes, grid)
    above = torch.ones(grid.nq, grid.nk, dtype=torch.bool).triu(1)
    assert torch.equal(~tb.any_hi[0, 0], above) and not tb.all_lo.any()
    wide = lambda b, h, q, k: (k <= q) & (q - k < 200)  # noqa: E731 - full: the two tiles below the diagonal
    assert maskc.tile_bounds(wide, grid).all_lo.sum() == 2 * grid.nq - 3
    assert maskc.tile_bounds(lambda b, h, q, k: q > k if q > 3 else k, grid) is None  # does not trace
    for mm in (stripes, band):
        with_bounds = BlockLayout.from_mask_mod(mm, 1000, 1000, 64, 64, device="cpu")
        dense = BlockLayout.from_dense(eager_cells(mm, 1, 1, 1000, 1000, 0), 64, 64)
        for name in ("kv_count", "kv_index", "full_count", "full_index"):
            assert torch.equal(getattr(with_bounds, name), getattr(dense, name)), name


@pytest.mark.parametrize("rows", [8, 16])
def test_classification_kernel_reads_further_rows_only_when_it_must(rows, monkeypatch):
    """The classification kernel a few rows a step (as on a GPU): a tile settled partial by its first rows
    stops there, one still all-allowed or all-masked reads the rest (a tile masked only in its last rows, a
    tile allowed only there); the classes equal the torch path's, with tiles of every kind present."""
    monkeypatch.setattr(T, "MASK_TILE_ROWS", rows)
    cases = [LAMBDAS["stripes"], lambda b, h, q, k: (q % 32) < 24,  # rows 24-31 of each 32 masked
             lambda b, h, q, k: ((q % 32) >= 28) & (k < 40),  # allowed only in the last rows
             lambda b, h, q, k: (q - k) % 97 != 5]
    grid = TileGrid(13, 150, 200, 32, 32, 1, 2, torch.device("cpu"))
    for mm in cases:
        got = T.classify(mm, grid, None, use_kernel=True)
        want = T.classify(mm, grid, None, use_kernel=False)
        assert all(torch.equal(x, y) for x, y in zip(got, want))
    kinds = torch.stack([(p | f).sum() for p, f in (T.classify(mm, grid, None, use_kernel=False) for mm in cases)])
    assert (kinds > 0).all()



@pytest.mark.parametrize("least", [None, 0, 60, 10**6])
def test_traced_bounds_run_before_the_kernel_only_from_their_tile_count(least, monkeypatch):
    """Before the classification kernel the traced bounds run only when at least TRACED_BOUNDS_MIN_TILES
    tiles are undecided (None: never); on the torch path always. The classes are the same either way."""
    monkeypatch.setattr(T, "TRACED_BOUNDS_MIN_TILES", least)
    calls = []
    real = maskc.tile_bounds
    monkeypatch.setattr(maskc, "tile_bounds", lambda mm, grid: calls.append(grid) or real(mm, grid))
    grid = TileGrid(0, 320, 320, 32, 32, 1, 1, torch.device("cpu"))  # 100 tiles, none decided by a rule
    stripes = LAMBDAS["stripes"]
    got = T.classify(stripes, grid, None, use_kernel=True)
    assert len(calls) == (least is not None and least <= 100)
    want = T.classify(stripes, grid, None, use_kernel=False)
    assert len(calls) == (least is not None and least <= 100) + 1  # the torch path bounds first
    assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_a_mask_without_a_rule_sends_every_tile_to_the_kernel_unlisted(monkeypatch):
    """A plain function (no tile rule) on a grid below the bounds' gate: one launch over every tile of the
    [B, H, nq, nk] grid, program t its t-th tile in row-major order, no list; classes equal the torch
    path's on a mask that depends on b and h (a wrong unravelling of t would move them)."""
    seen = []
    real = T._mask_tiles_launch
    monkeypatch.setattr(T, "_mask_tiles_launch", lambda *a, **k: seen.append(k.get("whole_grid")) or real(*a, **k))
    mm = lambda b, h, q, k: (((q + 3 * h + 5 * b) // 16) % 3 == 0) | (k == q + b)  # noqa: E731
    grid = TileGrid(7, 100, 130, 32, 32, 2, 3, torch.device("cpu"))  # 2 x 3 x 4 x 5 tiles
    got = T.classify(mm, grid, None, use_kernel=True)
    assert seen == [(2, 3, 4, 5)]
    want = T.classify(mm, grid, None, use_kernel=False)
    assert all(torch.equal(x, y) for x, y in zip(got, want))
    assert want[0].any() and want[1].any() and not (want[0] | want[1]).all()  # every class present


@pytest.mark.parametrize("gate, cells, whole", [(1 << 17, 1 << 28, True), (None, 1 << 28, False),
                                                 (16, 1 << 28, False), (1 << 17, 40000, "window only")])
def test_rule_masks_go_to_the_kernel_whole_on_small_grids(monkeypatch, gate, cells, whole):
    """A mask with a tile rule below ``RULE_MASKS_WHOLE_GRID_BELOW`` tiles skips its rule (one launch over the
    whole grid) while the kernel's bounds leave at most ``RULE_MASKS_WHOLE_GRID_CELLS`` cells open; at or
    above the gate, with it off, or with more cells open (the document ids are unknown to the bounds), the
    rule decides first and the kernel gets the listed undecided tiles. Every way, the classes are the torch
    path's."""
    seen = []
    real = T._mask_tiles_launch
    monkeypatch.setattr(T, "_mask_tiles_launch", lambda *a, **k: seen.append(k.get("whole_grid")) or real(*a, **k))
    monkeypatch.setattr(T, "RULE_MASKS_WHOLE_GRID_BELOW", gate)
    monkeypatch.setattr(T, "RULE_MASKS_WHOLE_GRID_CELLS", cells)
    ids = torch.tensor([0] * 70 + [1] * 60 + [2] * 70)
    grid = TileGrid(0, 200, 200, 32, 32, 1, 2, torch.device("cpu"))  # 1 x 2 x 7 x 7 tiles
    for mm, name, open_ in ((P.and_masks(P.causal(), P.sliding_window(50)), "window", 34816),
                            (P.and_masks(P.causal(), P.document(ids)), "documents", 57344)):
        seen.clear()
        got = T.classify(mm, grid, None, use_kernel=True)
        goes_whole = whole is True or (whole == "window only" and name == "window")
        assert (seen == [(1, 2, 7, 7)]) == goes_whole and all(s is None for s in seen[goes_whole:])
        if gate is not None and gate > 16:  # the open cells: the partial or undecided tiles' cells, 1024 a tile
            assert T.open_cells(T.compiled_mask_for(mm, grid), mm, grid) == open_
        want = T.classify(mm, grid, None, use_kernel=False)
        assert want[0].any() and want[1].any()
        assert all(torch.equal(x, y) for x, y in zip(got, want))


def test_open_cells_do_not_depend_on_a_tables_values():
    """The count is cached per traced expression and grid: it must be the same for any document ids (the
    bounds treat a captured table's entries as unknown), and a hash decides no tile."""
    grid = TileGrid(0, 256, 256, 32, 32, 1, 1, torch.device("cpu"))
    counts = set()
    for seed in range(3):
        ids = torch.sort(torch.randint(0, 4, (256,), generator=torch.Generator().manual_seed(seed))).values
        mm = P.and_masks(P.causal(), P.document(ids))
        T._OPEN_CELLS.clear()
        counts.add(T.open_cells(T.compiled_mask_for(mm, grid), mm, grid))
    assert counts == {36 * 1024}  # the 36 tiles on and below the diagonal of 8 x 8
    hashed = P.block_random(0.3, 32, seed=1)
    assert T.open_cells(T.compiled_mask_for(hashed, grid), hashed, grid) == 64 * 1024


# ---- the tile bounds inside the classification kernel ----------------------------------------------------------------
def kernel_bounds(mask_mod, grid):
    """``(may_true, may_false)`` per tile from the compiled module's ``bounds`` (what the classification kernel
    calls), run over every tile of ``grid`` by a probe kernel; bool ``[B, H, nq, nk]`` each."""
    import triton
    import triton.language as tl
    from sparseattn import _runtime
    _runtime.select_backend()

    @triton.jit
    def probe(MAY_T, MAY_F, q_offset, q_len, kv_len, n_heads, n_q, n_k, BOUNDS_FN: tl.constexpr,
              BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
        t = tl.program_id(0)
        ki = t % n_k
        qi = (t // n_k) % n_q
        h = (t // (n_k * n_q)) % n_heads
        b = t // (n_k * n_q * n_heads)
        q0 = qi * BLOCK_Q
        k0 = ki * BLOCK_K
        may_t, may_f = BOUNDS_FN(b, h, q0 + q_offset, tl.minimum(q0 + BLOCK_Q, q_len) - 1 + q_offset, k0,
                                 tl.minimum(k0 + BLOCK_K, kv_len) - 1)
        tl.store(MAY_T + t, may_t.to(tl.int8))
        tl.store(MAY_F + t, may_f.to(tl.int8))

    c = maskc.compile_mask(mask_mod, pos_bound=maskc.pos_bound_for(max(grid.q_start + grid.q_len, grid.kv_len)))
    shape = (grid.B, grid.H, grid.nq, grid.nk)
    may_t, may_f = (torch.empty(shape, dtype=torch.int8) for _ in range(2))
    probe[(may_t.numel(),)](may_t, may_f, grid.q_start, grid.q_len, grid.kv_len, grid.H, grid.nq, grid.nk,
                            BOUNDS_FN=c.bounds, BLOCK_Q=grid.block_q, BLOCK_K=grid.block_k)
    return may_t.bool(), may_f.bool()


def test_a_mask_of_a_bool_table_alone_leaves_every_tile_to_its_cells():
    """A mask that only reads a captured bool table: the generated bounds know nothing (may be either, as
    constants the kernel still takes), every tile goes to the cells, and the classes equal every cell."""
    g = torch.Generator().manual_seed(3)
    table = torch.rand(90, 70, generator=g) < 0.5
    mm = lambda b, h, q, k: table[q, k]  # noqa: E731
    grid = TileGrid(0, 90, 70, 16, 16, 1, 1, torch.device("cpu"))
    may_t, may_f = kernel_bounds(mm, grid)
    assert may_t.all() and may_f.all()
    partial, full = T.classify(mm, grid, None, use_kernel=True)
    some, every = exact_classes(mm, grid)
    assert torch.equal(full, every & some) and torch.equal(partial, some & ~every)


@pytest.mark.parametrize("name", sorted(LAMBDAS))
def test_generated_tile_bounds_equal_the_traced_ones(name):
    """The generated ``bounds`` (scalar int64 intervals, one per node) decide exactly the tiles the traced torch
    bounds decide, on a grid with a query offset and lengths ending inside a tile."""
    grid = TileGrid(37, 300, 260, 32, 32, 2, 3, torch.device("cpu"))
    may_t, may_f = kernel_bounds(LAMBDAS[name], grid)
    tb = maskc.tile_bounds(LAMBDAS[name], grid)
    assert torch.equal(may_t, tb.any_hi) and torch.equal(~may_f, tb.all_lo)


@FAST
@given(data=st.data(), shape=shapes)
def test_classification_with_tile_bounds_equals_every_cell(data, shape):
    """The classification kernel with its tile bounds on (``_tiles.TILE_BOUNDS``, the default) gives the
    classes of every cell evaluated eagerly, on compositions of catalogue patterns and their negation."""
    B, H, Lq, Lk, q_offset = shape
    mm = draw_composition(data)
    grid = TileGrid(q_offset, Lq, Lk, 16, 16, B, H, torch.device("cpu"))
    partial, full = T.classify(mm, grid, None, use_kernel=True)
    some, every = exact_classes(mm, grid)
    assert torch.equal(full, every & some) and torch.equal(partial, some & ~every)


def test_tile_bounds_change_no_class_and_decide_the_tiles_above_the_diagonal(monkeypatch):
    """Switching the kernel's tile bounds off (``_tiles.TILE_BOUNDS``) changes no class, and on the stripes
    mask (no tile rule of its own) they empty every tile above the causal diagonal, the tiles whose cells the
    kernel would otherwise evaluate row by row to the end."""
    grid = TileGrid(0, 320, 320, 32, 32, 1, 1, torch.device("cpu"))
    stripes = LAMBDAS["stripes"]
    monkeypatch.setattr(T, "TILE_BOUNDS", False)
    without = T.classify(stripes, grid, None, use_kernel=True)
    monkeypatch.setattr(T, "TILE_BOUNDS", True)
    with_ = T.classify(stripes, grid, None, use_kernel=True)
    assert all(torch.equal(x, y) for x, y in zip(without, with_))
    may_t, may_f = kernel_bounds(stripes, grid)
    above = torch.ones(grid.nq, grid.nk, dtype=torch.bool).triu(1)
    assert bool((~may_t[0, 0])[above].all())  # (and some below it: a tile inside one masked stripe)
