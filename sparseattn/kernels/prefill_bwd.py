"""Block-sparse attention backward.

Deterministic path (7 tile matmuls): ``dkdv_kernel`` gives one program per (key sub-tile, chunk of its
column, batch * KV head) walking the *transposed* table (the query tiles that visit the key tile) for every
query head of the GQA group, recomputing ``P`` from the saved LSE; ``dq_kernel`` gives one program per
(query sub-tile, batch * query head) walking the forward table -- or, split (``SPLIT``, ``BwdConfig.dq_split``),
one program per task of :func:`sparseattn.balance.plan`: a long row's chunks write float32 partial dQ to a
workspace that ``dq_reduce_kernel`` sums in chunk order. No two programs write the same element, so repeated
runs are bitwise equal. ``Δ = rowsum(dO ∘ O)`` is computed before both. ``bwd_kernel`` runs both kinds of
program in one launch (``BwdConfig.overlap``); the kernels are thin entries around ``_dkdv_program`` and
``_dq_program``.

Atomic path (5 tile matmuls, ``DQ_ACC`` given): the dK/dV program also forms ``dQ_i += dS_ij K_j`` and adds
it into a float32 dQ with ``tl.atomic_add``; the order of those additions varies from run to run. ``DQ_ACC``
may be a tensor descriptor of the accumulator (``DQ_TMA``): then each tile's dQ goes out as one bulk
reduce-add by the copy engine (TMA), the way FlashAttention-3 accumulates dQ, instead of ``BM x D``
element atomics issued by the program's threads; rows past the sequence end are clipped by the copy engine.

Long columns (a sink key tile is visited by every query tile) are cut into chunks of at most ``chunk``
listed query tiles; chunks write partial dK/dV to a workspace that is summed in a fixed order afterwards.

Each pass walks partial tiles (token mask) and full tiles (no mask) through one helper with a ``MASKED`` flag.

Tile loads go through :func:`~sparseattn.kernels._common.load_rows`: with tensor descriptors (``USE_TMA``, set
when ``desc_q`` is given; Hopper and later) the copy engine fetches the rows and zero-fills past the sequence
end; without them (``desc_*`` None: older GPUs, the interpreter by default) plain masked loads. The dK/dV pass
loads K/V once per program and Q/dO at every step; the dQ pass loads Q/dO once and K/V at every step.
"""
import triton
import triton.language as tl

from ._common import (PREFILL_FLAGS, doc_ids, doc_row, load_lse_base2, load_merge_entry, load_rows, load_task,
                      row_slot_base, row_slot_rows, row_tile_mask, tile_mask)


@triton.jit
def _dkdv_tiles(b_dk, b_dv, b_k, b_v, desc_q, desc_do, b, hq, q_base, do_base, lse_base, delta_base, dq_base,
                stride_qm, stride_dom, stride_dqm, COL_INDEX, SLOTS, col, col_width, lo, hi,
                offs_n, n_ok, n_start, doc_k, DOC_ROW, BITS, row_base, W, n_qtiles,
                Lq, q_offset, scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW,
                lb, lh, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
                BLOCK_N: tl.constexpr, MASKED: tl.constexpr, USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr,
                HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr, ATOMIC_DQ: tl.constexpr,
                DOT_PRECISION: tl.constexpr, USE_FN: tl.constexpr, USE_TMA: tl.constexpr, DQ_TMA: tl.constexpr,
                STAGES: tl.constexpr):
    """Accumulate dK, dV ``[BN, D]`` of one key sub-tile over the query tiles at positions ``[lo, hi)`` of its
    column list ``COL_INDEX[col]``. Tiles are handled transposed (``[BN keys, BM queries]``) so dK and dV
    come out of the dots without a transpose. ``STAGES``: the loop's software-pipeline depth (None: the
    launch's ``num_stages``)."""
    SUB_M: tl.constexpr = BLOCK_Q // BLOCK_M
    for it in tl.range(lo * SUB_M, hi * SUB_M, num_stages=STAGES):
        pos = it // SUB_M
        qi = tl.load(COL_INDEX + col * col_width + pos)
        m_start = qi * BLOCK_Q + (it % SUB_M) * BLOCK_M
        offs_m = m_start + tl.arange(0, BLOCK_M)  # [BM]
        if MASKED:  # the mask first: its loads (bit bytes, document ids) overlap the tile loads below
            offs_m_abs = offs_m + q_offset
            slot = tl.load(SLOTS + col * col_width + pos)  # where this tile's bits sit in the forward table
            bits_off = ((row_base + qi).to(tl.int64) * W + slot) * (BLOCK_Q * BLOCK_K // 8)
            row_in_tile = (m_start % BLOCK_Q) + tl.arange(0, BLOCK_M)  # [BM]
            col_in_tile = (n_start % BLOCK_K) + tl.arange(0, BLOCK_N)  # [BN]
            doc_q = doc_ids(DOC_ROW, offs_m_abs, HAS_DOC)  # [BM]
            rs_off = row_slot_rows(offs_m, Lq, W) + slot  # [BM] member bits of these rows for this tile
            allowed = tile_mask(offs_m_abs[None, :], offs_n[:, None], row_in_tile[None, :], col_in_tile[:, None],
                                BITS, bits_off, doc_q[None, :], doc_k[:, None],
                                band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_off[None, :],
                                lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                                BLOCK_K, USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT, USE_FN)  # [BN, BM]
            allowed = allowed & n_ok[:, None]
        m_ok = offs_m < Lq
        b_q = load_rows(desc_q, q_base, m_start, stride_qm, b, hq, Lq, BLOCK_M, HEAD_DIM, USE_TMA, True)  # [BM, D]
        b_do = load_rows(desc_do, do_base, m_start, stride_dom, b, hq, Lq, BLOCK_M, HEAD_DIM, USE_TMA, True)
        b_lse = load_lse_base2(lse_base, offs_m, m_ok)
        b_delta = tl.load(delta_base + offs_m, mask=m_ok, other=0.0)
        b_st = tl.dot(b_k, tl.trans(b_q), input_precision=DOT_PRECISION)  # [BN, BM] = (Q K^T)^T
        b_pt = tl.math.exp2(b_st * scale_log2 - b_lse[None, :])
        if MASKED:
            b_pt = tl.where(allowed, b_pt, 0.0)
        # full tiles: keys past Lk are zero rows of K and V, so they add nothing
        b_dv = tl.dot(b_pt.to(b_do.dtype), b_do, b_dv, input_precision=DOT_PRECISION)  # [BN, D]
        b_dpt = tl.dot(b_v, tl.trans(b_do), input_precision=DOT_PRECISION)  # [BN, BM]
        b_dst = b_pt * (b_dpt - b_delta[None, :])  # [BN, BM]
        b_dk = tl.dot(b_dst.to(b_q.dtype), b_q, b_dk, input_precision=DOT_PRECISION)  # [BN, D]
        if ATOMIC_DQ:
            b_dq = tl.dot(tl.trans(b_dst.to(b_k.dtype)), b_k, input_precision=DOT_PRECISION)  # [BM, D]
            if DQ_TMA:  # dq_base is the accumulator's descriptor: one bulk reduce-add, rows past Lq clipped
                dq_base.atomic_add([b, hq, m_start, 0], b_dq.reshape(1, 1, BLOCK_M, HEAD_DIM))
            else:
                p_dq = dq_base + offs_m[:, None] * stride_dqm + tl.arange(0, HEAD_DIM)[None, :]  # [BM, D]
                tl.atomic_add(p_dq, b_dq, mask=m_ok[:, None], sem="relaxed")
    return b_dk, b_dv


@triton.heuristics({**PREFILL_FLAGS, "ATOMIC_DQ": lambda a: a["DQ_ACC"] is not None,
                    "DQ_TMA": lambda a: type(a["DQ_ACC"]).__name__ == "TensorDescriptor"})
@triton.jit
def dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, WS_K, WS_V, desc_q, desc_k, desc_v, desc_do,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    Q_COUNT, Q_INDEX, Q_SLOT, FULL_Q_COUNT, FULL_Q_INDEX, WORK, BITS, DOC, stride_doc_b, ROW_SLOT,
    Hq, Hkv, group, LB, LH, lh_div, n_ktiles, WT, FWT, n_qtiles, W,
    Lq, Lk, q_offset, scale, scale_log2, chunk, n_ws,
    band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_FN: tl.constexpr, USE_TMA: tl.constexpr,
    DQ_TMA: tl.constexpr,
):
    """One program per (dK/dV work item, batch * KV head): :func:`_dkdv_program`."""
    _dkdv_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, WS_K, WS_V, desc_q, desc_k, desc_v, desc_do,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
        stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
        stride_dqb, stride_dqh, stride_dqm,
        Q_COUNT, Q_INDEX, Q_SLOT, FULL_Q_COUNT, FULL_Q_INDEX, WORK, BITS, DOC, stride_doc_b, ROW_SLOT,
        Hq, Hkv, group, LB, LH, lh_div, n_ktiles, WT, FWT, n_qtiles, W,
        Lq, Lk, q_offset, scale, scale_log2, chunk, n_ws,
        band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
        HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N,
        USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT, ATOMIC_DQ, DOT_PRECISION, USE_FN, USE_TMA, DQ_TMA, None)


@triton.jit
def _dkdv_program(w, bh, Q, K, V, DO, LSE, DELTA, DK, DV, DQ_ACC, WS_K, WS_V, desc_q, desc_k, desc_v, desc_do,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    Q_COUNT, Q_INDEX, Q_SLOT, FULL_Q_COUNT, FULL_Q_INDEX, WORK, BITS, DOC, stride_doc_b, ROW_SLOT,
    Hq, Hkv, group, LB, LH, lh_div, n_ktiles, WT, FWT, n_qtiles, W,
    Lq, Lk, q_offset, scale, scale_log2, chunk, n_ws,
    band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr,
    ATOMIC_DQ: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_FN: tl.constexpr, USE_TMA: tl.constexpr,
    DQ_TMA: tl.constexpr, STAGES: tl.constexpr,
):
    """dK and dV of work item ``w`` (a key sub-tile and a chunk of its column) for batch * KV head ``bh``."""
    # ---- work item: key sub-tile, which chunk of its column, where the result goes --------------------------
    b = bh // Hkv
    hkv = bh % Hkv
    n_sub = tl.load(WORK + w * 3)  # kernel key sub-tile
    c = tl.load(WORK + w * 3 + 1)  # chunk of the column
    ws_slot = tl.load(WORK + w * 3 + 2)  # -1: write dK/dV directly; else a workspace slot
    n_start = n_sub * BLOCK_N
    kj = n_start // BLOCK_K  # layout column
    lb = b % LB
    offs_n = n_start + tl.arange(0, BLOCK_N)  # [BN]
    offs_d = tl.arange(0, HEAD_DIM)
    n_ok = offs_n < Lk
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    b_k = load_rows(desc_k, k_base, n_start, stride_kn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, True)  # [BN, D]
    b_v = load_rows(desc_v, v_base, n_start, stride_vn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, True)
    b_dk = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    b_dv = tl.zeros([BLOCK_N, HEAD_DIM], tl.float32)
    DOC_ROW = doc_row(DOC, b, stride_doc_b, HAS_DOC)
    doc_k = doc_ids(DOC_ROW, offs_n, HAS_DOC)  # [BN]

    for g in range(0, group):  # the query heads that share this KV head; dK/dV sum over them
        hq = hkv * group + g
        lh = (hq // lh_div) % LH
        col = (lb * LH + lh) * n_ktiles + kj
        n_partial = tl.load(Q_COUNT + col)
        n_full = tl.load(FULL_Q_COUNT + col)
        lo = c * chunk  # this chunk covers list positions [lo, hi) of partial-then-full
        hi = tl.minimum(lo + chunk, n_partial + n_full)
        q_base = Q + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh
        do_base = DO + b.to(tl.int64) * stride_dob + hq.to(tl.int64) * stride_doh
        dq_base = DQ_ACC  # None on the deterministic path; the descriptor itself with DQ_TMA
        if ATOMIC_DQ and not DQ_TMA:
            dq_base = DQ_ACC + b.to(tl.int64) * stride_dqb + hq.to(tl.int64) * stride_dqh
        lse_base = LSE + (b * Hq + hq).to(tl.int64) * Lq
        delta_base = DELTA + (b * Hq + hq).to(tl.int64) * Lq
        row_base = (lb * LH + lh) * n_qtiles
        RS_ROW = row_slot_base(ROW_SLOT, lb, lh, LH, Lq, W, HAS_ROW_SLOT)  # member bits of this layout head
        b_dk, b_dv = _dkdv_tiles(b_dk, b_dv, b_k, b_v, desc_q, desc_do, b, hq, q_base, do_base, lse_base,
                                 delta_base, dq_base,
                                 stride_qm, stride_dom, stride_dqm, Q_INDEX, Q_SLOT, col, WT,
                                 tl.minimum(lo, n_partial), tl.minimum(hi, n_partial),
                                 offs_n, n_ok, n_start, doc_k, DOC_ROW, BITS, row_base, W, n_qtiles,
                                 Lq, q_offset, scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW,
                                 lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                                 HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N, True, USE_BITS, HAS_SINKS,
                                 HAS_DOC, HAS_ROW_SLOT, ATOMIC_DQ, DOT_PRECISION, USE_FN, USE_TMA, DQ_TMA, STAGES)
        b_dk, b_dv = _dkdv_tiles(b_dk, b_dv, b_k, b_v, desc_q, desc_do, b, hq, q_base, do_base, lse_base,
                                 delta_base, dq_base,
                                 stride_qm, stride_dom, stride_dqm, FULL_Q_INDEX, Q_SLOT, col, FWT,
                                 tl.maximum(lo, n_partial) - n_partial, tl.maximum(hi, n_partial) - n_partial,
                                 offs_n, n_ok, n_start, doc_k, DOC_ROW, BITS, row_base, W, n_qtiles,
                                 Lq, q_offset, scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW,
                                 lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                                 HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N, False, USE_BITS, HAS_SINKS,
                                 HAS_DOC, HAS_ROW_SLOT, ATOMIC_DQ, DOT_PRECISION, USE_FN, USE_TMA, DQ_TMA, STAGES)

    b_dk = b_dk * scale
    if ws_slot < 0:
        dk_ptrs = DK + b.to(tl.int64) * stride_dkb + hkv.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn
        dv_ptrs = DV + b.to(tl.int64) * stride_dvb + hkv.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn
        tl.store(dk_ptrs + offs_d[None, :], b_dk.to(DK.dtype.element_ty), mask=n_ok[:, None])
        tl.store(dv_ptrs + offs_d[None, :], b_dv.to(DV.dtype.element_ty), mask=n_ok[:, None])
    else:  # a chunk of a split column: partial sums, reduced in a fixed order afterwards
        ws = (bh.to(tl.int64) * n_ws + ws_slot) * (BLOCK_N * HEAD_DIM)
        local = tl.arange(0, BLOCK_N)[:, None] * HEAD_DIM + offs_d[None, :]
        tl.store(WS_K + ws + local, b_dk)
        tl.store(WS_V + ws + local, b_dv)


@triton.jit
def _dq_tiles(b_dq, b_q, b_do, b_lse, b_delta, desc_k, desc_v, b, hkv, k_base, v_base, stride_kn, stride_vn,
              COUNT, INDEX, row, width,
              lo, hi, offs_m_abs, row_in_tile, doc_q, DOC_ROW, BITS, Lk, scale_log2,
              band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_rows,
              lb, lh, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
              HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr,
              HAS_ROW_SLOT: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_FN: tl.constexpr,
              USE_TMA: tl.constexpr, STAGES: tl.constexpr):
    """Accumulate dQ ``[BM, D]`` over the key tiles listed at positions ``[lo, hi)`` of ``INDEX[row]``, clipped
    to the ``COUNT[row]`` tiles this head lists (a split task's range follows the longest head). ``STAGES`` as
    for :func:`_dkdv_tiles`."""
    SUB: tl.constexpr = BLOCK_K // BLOCK_N
    n_tiles = tl.minimum(tl.load(COUNT + row), hi)
    for it in tl.range(lo * SUB, n_tiles * SUB, num_stages=STAGES):
        slot = it // SUB
        kb = tl.load(INDEX + row * width + slot)
        n_start = kb * BLOCK_K + (it % SUB) * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)  # [BN]
        n_ok = offs_n < Lk
        b_k = load_rows(desc_k, k_base, n_start, stride_kn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, True)  # [BN, D]
        b_v = load_rows(desc_v, v_base, n_start, stride_vn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, True)
        if MASKED:  # the mask first: its loads overlap the dot below
            allowed = row_tile_mask(offs_m_abs, row_in_tile, doc_q, offs_n, n_start, row.to(tl.int64) * width + slot,
                                    BITS, DOC_ROW, Lk, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_rows,
                                    slot, lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                                    BLOCK_Q, BLOCK_K, BLOCK_N, USE_BITS, HAS_SINKS, HAS_DOC,
                                    HAS_ROW_SLOT, USE_FN)  # [BM, BN]
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BM, BN]
        b_p = tl.math.exp2(b_s * scale_log2 - b_lse[:, None])
        if MASKED:
            b_p = tl.where(allowed, b_p, 0.0)
        else:
            b_p = tl.where(n_ok[None, :], b_p, 0.0)
        b_dp = tl.dot(b_do, tl.trans(b_v), input_precision=DOT_PRECISION)  # [BM, BN]
        b_ds = b_p * (b_dp - b_delta[:, None])
        b_dq = tl.dot(b_ds.to(b_k.dtype), b_k, b_dq, input_precision=DOT_PRECISION)  # [BM, D]
    return b_dq


@triton.heuristics({**PREFILL_FLAGS, "SPLIT": lambda a: a["TASKS"] is not None})
@triton.jit
def dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ, TASKS, N_TASKS, WS_DQ, ws_cap, desc_q, desc_k, desc_v, desc_do,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, BITS, DOC, stride_doc_b, ROW_SLOT,
    Hq, group, LB, LH, lh_div, n_qtiles, W, FW, Lq, Lk, q_offset, scale, scale_log2,
    band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_FN: tl.constexpr, SPLIT: tl.constexpr, USE_TMA: tl.constexpr,
):
    """One program per (query sub-tile or split task, batch * query head): :func:`_dq_program`."""
    _dq_program(
        tl.program_id(0), tl.program_id(1),
        Q, K, V, DO, LSE, DELTA, DQ, TASKS, N_TASKS, WS_DQ, ws_cap, desc_q, desc_k, desc_v, desc_do,
        stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
        stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
        stride_dqb, stride_dqh, stride_dqm,
        KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, BITS, DOC, stride_doc_b, ROW_SLOT,
        Hq, group, LB, LH, lh_div, n_qtiles, W, FW, Lq, Lk, q_offset, scale, scale_log2,
        band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
        HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N,
        USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT, DOT_PRECISION, USE_FN, SPLIT, USE_TMA, None)


@triton.jit
def _dq_program(pid, bh, Q, K, V, DO, LSE, DELTA, DQ, TASKS, N_TASKS, WS_DQ, ws_cap, desc_q, desc_k, desc_v, desc_do,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, BITS, DOC, stride_doc_b, ROW_SLOT,
    Hq, group, LB, LH, lh_div, n_qtiles, W, FW, Lq, Lk, q_offset, scale, scale_log2,
    band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_FN: tl.constexpr, SPLIT: tl.constexpr, USE_TMA: tl.constexpr,
    STAGES: tl.constexpr,
):
    """dQ of query sub-tile (or split task) ``pid`` for batch * query head ``bh``."""
    if SPLIT:  # a task of sparseattn.balance.plan: (sub-tile, first slot, end slot, workspace slot)
        if pid >= tl.load(N_TASKS):
            return  # an empty slot of the fixed-capacity task list
        m_tile, slot_lo, slot_hi, ws = load_task(TASKS, pid)
    else:
        m_tile = pid
        slot_lo = 0
        slot_hi = W + FW
    b = bh // Hq
    hq = bh % Hq
    hkv = hq // group
    lb = b % LB
    lh = (hq // lh_div) % LH
    m_start = m_tile * BLOCK_M
    qi = m_start // BLOCK_Q
    row = (lb * LH + lh) * n_qtiles + qi
    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BM]
    offs_m_abs = offs_m + q_offset
    offs_d = tl.arange(0, HEAD_DIM)
    row_in_tile = (m_start % BLOCK_Q) + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Lq
    q_base = Q + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh
    do_base = DO + b.to(tl.int64) * stride_dob + hq.to(tl.int64) * stride_doh
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    b_q = load_rows(desc_q, q_base, m_start, stride_qm, b, hq, Lq, BLOCK_M, HEAD_DIM, USE_TMA, True)  # [BM, D]
    b_do = load_rows(desc_do, do_base, m_start, stride_dom, b, hq, Lq, BLOCK_M, HEAD_DIM, USE_TMA, True)
    b_lse = load_lse_base2(LSE + bh.to(tl.int64) * Lq, offs_m, m_ok)
    b_delta = tl.load(DELTA + bh.to(tl.int64) * Lq + offs_m, mask=m_ok, other=0.0)
    b_dq = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    DOC_ROW = doc_row(DOC, b, stride_doc_b, HAS_DOC)
    doc_q = doc_ids(DOC_ROW, offs_m_abs, HAS_DOC)  # [BM]
    RS_ROW = row_slot_base(ROW_SLOT, lb, lh, LH, Lq, W, HAS_ROW_SLOT)  # member bits of this layout head
    rs_rows = row_slot_rows(offs_m, Lq, W)  # [BM]
    # slots count the partial list, then the full list: slot s >= KV_COUNT[row] is full tile s - KV_COUNT[row]
    kv_n = tl.load(KV_COUNT + row)

    b_dq = _dq_tiles(b_dq, b_q, b_do, b_lse, b_delta, desc_k, desc_v, b, hkv, k_base, v_base, stride_kn, stride_vn,
                     KV_COUNT, KV_INDEX,
                     row, W, slot_lo, slot_hi, offs_m_abs, row_in_tile, doc_q, DOC_ROW, BITS, Lk, scale_log2,
                     band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_rows,
                     lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                     HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_N, True, USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT,
                     DOT_PRECISION, USE_FN, USE_TMA, STAGES)
    b_dq = _dq_tiles(b_dq, b_q, b_do, b_lse, b_delta, desc_k, desc_v, b, hkv, k_base, v_base, stride_kn, stride_vn,
                     FULL_COUNT, FULL_INDEX,
                     row, FW, tl.maximum(slot_lo - kv_n, 0), slot_hi - kv_n, offs_m_abs, row_in_tile, doc_q,
                     DOC_ROW, BITS, Lk, scale_log2,
                     band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_rows,
                     lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                     HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_N, False, USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT,
                     DOT_PRECISION, USE_FN, USE_TMA, STAGES)

    dq_ptrs = DQ + b.to(tl.int64) * stride_dqb + hq.to(tl.int64) * stride_dqh + offs_m[:, None] * stride_dqm
    if SPLIT:
        if ws >= 0:  # a chunk of a split row: its unscaled float32 partial, summed by dq_reduce_kernel
            p_ws = (bh.to(tl.int64) * ws_cap + ws) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] workspace rows
            tl.store(WS_DQ + p_ws[:, None] * HEAD_DIM + offs_d[None, :], b_dq)
        else:
            tl.store(dq_ptrs + offs_d[None, :], (b_dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None])
    else:
        tl.store(dq_ptrs + offs_d[None, :], (b_dq * scale).to(DQ.dtype.element_ty), mask=m_ok[:, None])


@triton.heuristics({**PREFILL_FLAGS, "HAS_ORDER": lambda a: a["ORDER"] is not None})
@triton.jit
def bwd_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV, DQ, WS_K, WS_V, desc_q, desc_k, desc_v, desc_do,
    dq_desc_q, dq_desc_k, dq_desc_v, dq_desc_do,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
    stride_dqb, stride_dqh, stride_dqm,
    Q_COUNT, Q_INDEX, Q_SLOT, FULL_Q_COUNT, FULL_Q_INDEX, WORK, KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX,
    BITS, DOC, stride_doc_b, ROW_SLOT,
    Hq, Hkv, group, LB, LH, lh_div, n_ktiles, WT, FWT, n_qtiles, W, FW,
    Lq, Lk, q_offset, scale, scale_log2, chunk, n_ws, n_items, n_dq_m, ORDER,
    band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DQ_BLOCK_M: tl.constexpr, DQ_BLOCK_N: tl.constexpr,
    USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_FN: tl.constexpr, USE_TMA: tl.constexpr, HAS_ORDER: tl.constexpr,
    DKDV_STAGES: tl.constexpr, DQ_STAGES: tl.constexpr,
):
    """Both passes of the deterministic backward in one launch (FlexAttention's layout of the work): on the
    grid ``(n_items + group * n_dq_m, batch * KV heads)``, the first ``n_items`` programs of a KV head are
    its dK/dV work items (:func:`_dkdv_program`, tiles ``BLOCK_M x BLOCK_N``), the others the dQ rows of
    its GQA group's query heads (:func:`_dq_program`, tiles ``DQ_BLOCK_M x DQ_BLOCK_N``, with their own
    tensor descriptors ``dq_desc_*``). The two kinds share no output, so the result is bitwise that of the two
    kernels launched apart; what one launch saves is the second launch's host work and the cross-stream
    fork and join that let dQ programs fill the dK/dV pass's tail. ``DKDV_STAGES`` and ``DQ_STAGES``: each
    kind's loop pipeline depth (``BwdConfig.num_stages`` and ``dq_num_stages``; the launch takes the larger).

    ``ORDER`` (a 1-D grid of ``batch * KV heads * (n_items + group * n_dq_m)`` programs): program ``p`` runs
    the program ``ORDER[p] = bh * per_head + pid`` of the 2-D grid -- the host's dispatch order
    (:func:`sparseattn.ops.backward.dispatch_order`: by estimated cost, or the split chunks of every head
    first), which decides only when a program starts, not what it writes."""
    per_head = n_items + group * n_dq_m
    if HAS_ORDER:
        code = tl.load(ORDER + tl.program_id(0))
        bh = code // per_head
        pid = code % per_head
    else:
        pid = tl.program_id(0)
        bh = tl.program_id(1)
    if pid < n_items:
        _dkdv_program(
            pid, bh, Q, K, V, DO, LSE, DELTA, DK, DV, None, WS_K, WS_V, desc_q, desc_k, desc_v, desc_do,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
            stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh, stride_dvn,
            0, 0, 0,
            Q_COUNT, Q_INDEX, Q_SLOT, FULL_Q_COUNT, FULL_Q_INDEX, WORK, BITS, DOC, stride_doc_b, ROW_SLOT,
            Hq, Hkv, group, LB, LH, lh_div, n_ktiles, WT, FWT, n_qtiles, W,
            Lq, Lk, q_offset, scale, scale_log2, chunk, n_ws,
            band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
            HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N,
            USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT, False, DOT_PRECISION, USE_FN, USE_TMA, False, DKDV_STAGES)
    else:
        j = pid - n_items
        b = bh // Hkv
        hq = (bh % Hkv) * group + j // n_dq_m  # a query head of this KV head's group
        _dq_program(
            j % n_dq_m, b * Hq + hq,
            Q, K, V, DO, LSE, DELTA, DQ, None, None, None, 0, dq_desc_q, dq_desc_k, dq_desc_v, dq_desc_do,
            stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
            stride_vb, stride_vh, stride_vn, stride_dob, stride_doh, stride_dom,
            stride_dqb, stride_dqh, stride_dqm,
            KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, BITS, DOC, stride_doc_b, ROW_SLOT,
            Hq, group, LB, LH, lh_div, n_qtiles, W, FW, Lq, Lk, q_offset, scale, scale_log2,
            band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
            HEAD_DIM, BLOCK_Q, BLOCK_K, DQ_BLOCK_M, DQ_BLOCK_N,
            USE_BITS, HAS_SINKS, HAS_DOC, HAS_ROW_SLOT, DOT_PRECISION, USE_FN, False, USE_TMA, DQ_STAGES)


@triton.jit
def dq_reduce_kernel(WS_DQ, MERGE, N_MERGE, DQ, stride_dqb, stride_dqh, stride_dqm, Hq, Lq, ws_cap, scale,
                     HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    """dQ of the split rows of a split dQ pass: one program per (split query sub-tile, batch * query head, slice
    of the head dim) adds the row's chunk partials (consecutive workspace slots) in chunk order -- a fixed
    order and no atomics, so the result is bitwise repeatable. dQ is linear in the tiles, so a plain sum is
    the whole merge (no max or LSE to carry, unlike the forward's). Entries past ``N_MERGE[0]`` return."""
    e = tl.program_id(0)
    bh = tl.program_id(1)
    dblk = tl.program_id(2)
    if e >= tl.load(N_MERGE):
        return
    m_tile, first, n_chunks = load_merge_entry(MERGE, e)
    offs_r = tl.arange(0, BLOCK_M)  # [BM] rows of the sub-tile
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, n_chunks):
        p_ws = (bh.to(tl.int64) * ws_cap + first + j) * BLOCK_M + offs_r  # [BM]
        acc += tl.load(WS_DQ + p_ws[:, None] * HEAD_DIM + offs_d[None, :])  # [BM, BD]
    offs_m = m_tile * BLOCK_M + offs_r
    b = bh // Hq
    hq = bh % Hq
    dq_base = DQ + b.to(tl.int64) * stride_dqb + hq.to(tl.int64) * stride_dqh
    tl.store(dq_base + offs_m[:, None] * stride_dqm + offs_d[None, :], (acc * scale).to(DQ.dtype.element_ty),
             mask=(offs_m < Lq)[:, None])


@triton.jit
def delta_kernel(O, DO, DELTA, stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom, Hq, Lq,
                 HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr):
    """``Δ = rowsum(dO ∘ O)`` in float32 (the backward's preprocess): one program per (query rows, batch *
    query head); ``DELTA`` is a contiguous ``[B, Hq, Lq]``. One launch instead of the four eager ops (two
    casts, a product, a sum) it replaces."""
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // Hq
    hq = bh % Hq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM]
    offs_d = tl.arange(0, HEAD_DIM)  # [D]
    m_ok = (offs_m < Lq)[:, None]
    p_o = O + b.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh + offs_m[:, None] * stride_om + offs_d[None, :]
    p_do = DO + b.to(tl.int64) * stride_dob + hq.to(tl.int64) * stride_doh + offs_m[:, None] * stride_dom \
        + offs_d[None, :]
    b_o = tl.load(p_o, mask=m_ok, other=0.0).to(tl.float32)  # [BM, D]
    b_do = tl.load(p_do, mask=m_ok, other=0.0).to(tl.float32)  # [BM, D]
    tl.store(DELTA + bh.to(tl.int64) * Lq + offs_m, tl.sum(b_o * b_do, axis=1), mask=offs_m < Lq)


@triton.jit
def column_reduce_kernel(WS_K, WS_V, REDUCE, DK, DV, stride_dkb, stride_dkh, stride_dkn, stride_dvb, stride_dvh,
                         stride_dvn, Hkv, Lk, ws_cap, HEAD_DIM: tl.constexpr, BLOCK_N: tl.constexpr,
                         BLOCK_D: tl.constexpr):
    """dK and dV of the key sub-tiles whose column the dK/dV pass cut into chunks: one program per (split
    sub-tile, batch * KV head, slice of the head dim) adds the chunks' partials (``REDUCE[e] = (sub-tile,
    first workspace slot, chunks)``; a sub-tile's slots are consecutive) in chunk order -- fixed order, no
    atomics, bitwise repeatable. The partials already carry the scale, so the sum is the gradient."""
    e = tl.program_id(0)
    bh = tl.program_id(1)
    dblk = tl.program_id(2)
    sub, first, n_chunks = load_merge_entry(REDUCE, e)  # the same [n, 3] entry as a plan's merge list
    offs_r = tl.arange(0, BLOCK_N)  # [BN] rows of the sub-tile
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    acc_k = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    acc_v = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    for j in range(0, n_chunks):
        p_ws = ((bh.to(tl.int64) * ws_cap + first + j) * BLOCK_N + offs_r)[:, None] * HEAD_DIM + offs_d[None, :]
        acc_k += tl.load(WS_K + p_ws)  # [BN, BD]
        acc_v += tl.load(WS_V + p_ws)  # [BN, BD]
    offs_n = sub * BLOCK_N + offs_r
    n_ok = (offs_n < Lk)[:, None]
    b = bh // Hkv
    hk = bh % Hkv
    p_dk = DK + b.to(tl.int64) * stride_dkb + hk.to(tl.int64) * stride_dkh + offs_n[:, None] * stride_dkn \
        + offs_d[None, :]
    p_dv = DV + b.to(tl.int64) * stride_dvb + hk.to(tl.int64) * stride_dvh + offs_n[:, None] * stride_dvn \
        + offs_d[None, :]
    tl.store(p_dk, acc_k.to(DK.dtype.element_ty), mask=n_ok)
    tl.store(p_dv, acc_v.to(DV.dtype.element_ty), mask=n_ok)
