"""Pieces every attention kernel shares: the partial-tile mask, the online-softmax step, the epilogue, tile and
LSE loads, the document-id lookup, and the constants of base-2 softmax. One copy each.

Shapes: ``M`` query rows, ``N`` key columns of one step, ``D`` the head dim. The mask helper takes index
tensors already shaped for the caller's orientation — ``[M, 1]`` and ``[1, N]`` for the forward and dQ
passes, ``[1, M]`` and ``[N, 1]`` for the dK/dV pass (which works on transposed tiles) — and returns an
allowed-mask of the broadcast shape, so no tile is ever transposed in registers.
"""
import torch
import triton
import triton.language as tl


#: The ``@triton.heuristics`` flags every prefill kernel derives from its mask and load arguments (one home
#: for the forward, both backward passes and the one-launch backward): which mask path its partial tiles take,
#: whether it loads through tensor descriptors, and the dot precision of its dtype.
PREFILL_FLAGS = {
    "USE_BITS": lambda a: a["BITS"] is not None,
    "HAS_DOC": lambda a: a["DOC"] is not None,
    "HAS_SINKS": lambda a: a["sink_n"] > 0,
    "HAS_ROW_SLOT": lambda a: a["ROW_SLOT"] is not None,
    "USE_FN": lambda a: a["MASK_FN"] is not None,
    "USE_TMA": lambda a: a["desc_q"] is not None,
    "DOT_PRECISION": lambda a: "ieee" if a["Q"].dtype == torch.float32 else "tf32",
}

LOG2E = tl.constexpr(1.4426950408889634)  # softmax runs in base 2: exp(x) = exp2(x * log2(e))
LN2 = tl.constexpr(0.6931471805599453)  # back to the natural-log LSE every op returns


@triton.jit
def tile_mask(q_pos, k_pos, q_row, k_col, BITS, bits_off, doc_q, doc_k,
              band_lo, band_hi, sink_n, sink_lo, sink_hi, RS, rs_off,
              lb, lh, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
              BLOCK_K: tl.constexpr, USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr,
              HAS_ROW_SLOT: tl.constexpr, USE_FN: tl.constexpr):
    """Allowed cells of one piece of a partial tile.

    Predicate path (absolute positions ``q_pos``, ``k_pos``)::

        (band_lo <= q - kv <= band_hi)  or  (kv < sink_n and sink_lo <= q - kv <= sink_hi),  and  doc[q] == doc[kv]

    Compiled path (``USE_FN``): the mask_mod's generated predicate ``MASK_FN(lb, lh, q_pos, k_pos, captures)``
    (:mod:`sparseattn.maskc`) on the layout's batch row and head, whatever orientation the positions have.

    Bits path: bit ``k_col % 8`` of byte ``q_row * BLOCK_K/8 + k_col // 8`` of the tile's packed mask at
    ``BITS + bits_off`` (``q_row``/``k_col`` are positions inside the layout tile).

    Member selections (``HAS_ROW_SLOT``, a routed layout with ``semantics="member"``) AND either path with the
    query row's bit for this tile's slot, ``RS[rs_off]`` (``rs_off`` = row * W + slot, shaped like the rows
    of the caller's orientation): the query block loads the tile, only the rows that chose it use it.
    """
    if USE_BITS:
        b_byte = tl.load(BITS + bits_off + q_row * (BLOCK_K // 8) + k_col // 8)
        allowed = ((b_byte.to(tl.int32) >> (k_col % 8)) & 1) != 0
    elif USE_FN:
        allowed = MASK_FN(lb, lh, q_pos, k_pos, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE)
    else:
        d = q_pos - k_pos  # distance q - kv
        allowed = (d >= band_lo) & (d <= band_hi)
        if HAS_SINKS:
            allowed = allowed | ((k_pos < sink_n) & (d >= sink_lo) & (d <= sink_hi))
        if HAS_DOC:
            allowed = allowed & (doc_q == doc_k)
    if HAS_ROW_SLOT:
        allowed = allowed & (tl.load(RS + rs_off) != 0)
    return allowed


@triton.jit
def row_tile_mask(offs_m_abs, row_in_tile, doc_q, offs_n, n_start, tile_id, BITS, DOC_ROW, Lk,
                  band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_rows, slot,
                  lb, lh, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                  BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
                  USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr,
                  HAS_ROW_SLOT: tl.constexpr, USE_FN: tl.constexpr):
    """:func:`tile_mask` in the row orientation of the forward and dQ passes: allowed ``[BM, BN]`` for query
    rows ``offs_m_abs`` and keys ``offs_n`` of the partial tile stored at ``slot`` of its row (``tile_id`` =
    row * W + slot in the forward table), keys past ``Lk`` cut. ``rs_rows`` [BM]: the rows' offsets in the
    member bits (:func:`row_slot_rows`)."""
    doc_k = doc_ids(DOC_ROW, offs_n, HAS_DOC)  # [BN]
    col_in_tile = (n_start % BLOCK_K) + tl.arange(0, BLOCK_N)  # [BN]
    allowed = tile_mask(offs_m_abs[:, None], offs_n[None, :], row_in_tile[:, None], col_in_tile[None, :],
                        BITS, tile_id * (BLOCK_Q * BLOCK_K // 8), doc_q[:, None], doc_k[None, :],
                        band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, (rs_rows + slot)[:, None],
                        lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                        BLOCK_K, USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT, USE_FN)
    return allowed & (offs_n < Lk)[None, :]


@triton.jit
def row_slot_base(ROW_SLOT, lb, lh, LH, Lq, W, HAS_ROW_SLOT: tl.constexpr):
    """The member bits ``[Lq, W]`` of layout head ``(lb, lh)`` (uint8 ``[LB, LH, Lq, W]``: query row x slot of
    the row's partial list); the pointer itself when the layout has none."""
    base = ROW_SLOT
    if HAS_ROW_SLOT:
        base = ROW_SLOT + (lb * LH + lh).to(tl.int64) * Lq * W
    return base


@triton.jit
def row_slot_rows(offs_m, Lq, W):
    """Offsets of query rows ``offs_m`` in the member bits: ``row * W``, rows past ``Lq`` clamped to the last
    row (they are never stored and their P is zero), so the load needs no mask."""
    return tl.minimum(offs_m, Lq - 1) * W


@triton.jit
def doc_row(DOC, b, stride_doc_b, HAS_DOC: tl.constexpr):
    """Batch row ``b``'s document-id table (``stride_doc_b = 0`` when one table serves every row); computed
    once per program, outside the tile loops."""
    row = DOC
    if HAS_DOC:
        row = DOC + b.to(tl.int64) * stride_doc_b
    return row


@triton.jit
def doc_ids(DOC_ROW, positions, HAS_DOC: tl.constexpr):
    """Document ids at ``positions``. The table is padded to whole tiles on the host (ops), so the padding
    rows of the last tile read -1 without a mask or a clamp and the load stays contiguous (it vectorises).
    Without documents, ``positions`` itself: a placeholder of the right shape."""
    ids = positions
    if HAS_DOC:
        ids = tl.load(DOC_ROW + positions)
    return ids


@triton.jit
def online_softmax_step(b_s, b_v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
    """Fold one tile of base-2 scores ``b_s [M, N]`` (masked cells = -inf) and values ``b_v [N, D]`` into the
    running state (m, l, acc). A row with nothing allowed so far keeps m = -inf; it subtracts 0 instead, so
    exp2 gives exact zeros rather than NaN."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_sub)
    b_p = tl.math.exp2(b_s - m_sub[:, None])  # [M, N]
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def finalize(m_i, l_i, acc):
    """``(o [M, D], lse [M])`` from the running state: one division per row, natural-log LSE. A row that saw
    no allowed key gives o = 0 and lse = -inf."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * LN2)
    return b_o, b_lse


@triton.jit
def load_rows(desc, base, row0, stride_row, b, h, L, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
              USE_TMA: tl.constexpr, CHECK: tl.constexpr):
    """Rows ``row0 .. row0 + ROWS`` of one (batch, head) as ``[ROWS, HEAD_DIM]``; rows >= L read as 0.
    With TMA the copy engine does the addressing and the zero fill; otherwise plain loads (masked when
    ``CHECK``)."""
    if USE_TMA:
        b_x = desc.load([b, h, row0, 0]).reshape(ROWS, HEAD_DIM)
    else:
        offs = row0 + tl.arange(0, ROWS)
        ptrs = base + offs[:, None] * stride_row + tl.arange(0, HEAD_DIM)[None, :]
        if CHECK:
            b_x = tl.load(ptrs, mask=(offs < L)[:, None], other=0.0)
        else:
            b_x = tl.load(ptrs)
    return b_x


@triton.jit
def load_lse_base2(lse_row, offs_m, m_ok):
    """Saved natural-log LSE in base 2. Rows past Lq and rows with no key (LSE = -inf) get +inf, so every P
    recomputed from them is exactly 0."""
    b_lse = tl.load(lse_row + offs_m, mask=m_ok, other=float("inf"))
    return tl.where(b_lse == float("-inf"), float("inf"), b_lse) * LOG2E


@triton.jit
def load_task(TASKS, t):
    """Task ``t`` of a :func:`sparseattn.balance.plan` task list (int32 ``[capacity, 4]``): ``(query sub-tile,
    first slot, end slot, workspace slot)``; the workspace slot is -1 when the task is its row's only one."""
    p_task = TASKS + t * 4
    return tl.load(p_task), tl.load(p_task + 1), tl.load(p_task + 2), tl.load(p_task + 3)


@triton.jit
def load_merge_entry(MERGE, e):
    """Entry ``e`` of a plan's merge list (int32 ``[n, 3]``): ``(query sub-tile, first workspace slot, number
    of chunks)`` of a split row, whose chunks sit in consecutive workspace slots in chunk order."""
    p_entry = MERGE + e * 3
    return tl.load(p_entry), tl.load(p_entry + 1), tl.load(p_entry + 2)
