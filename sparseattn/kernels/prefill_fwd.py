"""Block-sparse attention forward: one program per (query sub-tile, batch * query head), or, split (``SPLIT``),
one per (task, batch * query head) where a task is a range of slots of a row (:mod:`sparseattn.balance`), or,
persistent (``PERSISTENT``, split only), a fixed 1-D grid of about (SMs x a few) programs, each looping over the
flattened (task, batch * query head) items, task outer, so the items go out longest task first: with a
``COUNTER`` (``PULL``) a program takes the next item from it whenever it is free, as the hardware scheduler
hands out the programs of a plain grid; without, items ``pid, pid + P, ...`` are dealt in advance. All run
one per-task body, :func:`_fwd_task`.

A program walks only the key tiles its layout row lists: the partial tiles (token mask applied), then the
full tiles (no mask work), through one inner-loop helper with a ``MASKED`` flag. Each layout tile of
``BLOCK_K`` keys is visited in ``BLOCK_K // BLOCK_N`` steps of ``BLOCK_N``. Softmax is online in base 2:
running max ``m_i``, running sum ``l_i`` and an unnormalised accumulator ``acc``; one division at the end.
Writes O and the natural-log LSE (float32).
"""
import triton
import triton.language as tl

from ._common import (PREFILL_FLAGS, doc_ids, doc_row, finalize, load_rows, load_task, online_softmax_step,
                      row_slot_base, row_slot_rows, row_tile_mask)


@triton.jit
def _fwd_tiles(acc, m_i, l_i, b_q, desc_k, desc_v, k_base, v_base, stride_kn, stride_vn, b, hkv,
               COUNT, INDEX, row, width, slot_lo, slot_hi, offs_m_abs, row_in_tile, doc_q, DOC_ROW, BITS,
               Lk, scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_rows,
               lb, lh, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
               BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
               HEAD_DIM: tl.constexpr, MASKED: tl.constexpr, USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr,
               HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr, EVEN_K: tl.constexpr, USE_TMA: tl.constexpr,
               DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr, USE_FN: tl.constexpr):
    """Fold the key tiles listed in ``INDEX[row, slot_lo:min(slot_hi, COUNT[row])]`` into (acc, m, l) (a split
    task's share of the row; the whole row is ``0, width``). ``MASKED``: partial tiles, token mask applied;
    otherwise full tiles, where only the key-length edge can cut a row."""
    SUB: tl.constexpr = BLOCK_K // BLOCK_N
    n_tiles = tl.minimum(tl.load(COUNT + row), slot_hi)
    CHECK: tl.constexpr = MASKED or not EVEN_K  # partial tiles may end past Lk; full ones only at the edge
    for it in tl.range(slot_lo * SUB, n_tiles * SUB, warp_specialize=WARP_SPEC):
        slot = it // SUB
        kb = tl.load(INDEX + row * width + slot)
        n_start = kb * BLOCK_K + (it % SUB) * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)  # [BN]
        b_k = load_rows(desc_k, k_base, n_start, stride_kn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, CHECK)
        b_v = load_rows(desc_v, v_base, n_start, stride_vn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, CHECK)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BM, BN] raw scores
        if MASKED:
            allowed = row_tile_mask(offs_m_abs, row_in_tile, doc_q, offs_n, n_start, row.to(tl.int64) * width + slot,
                                    BITS, DOC_ROW, Lk, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW, rs_rows,
                                    slot, lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                                    BLOCK_Q, BLOCK_K, BLOCK_N, USE_BITS, HAS_SINKS, HAS_DOC,
                                    HAS_ROW_SLOT, USE_FN)  # [BM, BN]
            b_s = tl.where(allowed, b_s * scale_log2, float("-inf"))
            m_i, l_i, acc = online_softmax_step(b_s, b_v, m_i, l_i, acc, DOT_PRECISION)
        else:
            if not EVEN_K:
                b_s = tl.where((offs_n < Lk)[None, :], b_s, float("-inf"))
            # a full tile has an allowed key in every row, so m_new is finite; scale and subtract in one FMA
            m_new = tl.maximum(m_i, tl.max(b_s, 1) * scale_log2)
            alpha = tl.math.exp2(m_i - m_new)
            b_p = tl.math.exp2(b_s * scale_log2 - m_new[:, None])  # [BM, BN]
            l_i = l_i * alpha + tl.sum(b_p, 1)
            acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PRECISION)
            m_i = m_new
    return acc, m_i, l_i


@triton.heuristics({**PREFILL_FLAGS, "EVEN_K": lambda a: a["Lk"] % a["BLOCK_K"] == 0,
                    "SPLIT": lambda a: a["TASKS"] is not None, "PULL": lambda a: a["COUNTER"] is not None})
@triton.jit
def sparse_fwd_kernel(
    Q, K, V, O, LSE, desc_q, desc_k, desc_v,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
    KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, ROW_ORDER, BITS, DOC, stride_doc_b, ROW_SLOT,
    TASKS, N_TASKS, WS_O, WS_LSE, ws_cap, n_bh, COUNTER,
    Hq, group, LB, LH, lh_div, n_qtiles, W, FW, Lq, Lk, q_offset, scale_log2,
    band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr,
    USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr,
    USE_FN: tl.constexpr, PERSISTENT: tl.constexpr, PULL: tl.constexpr,
):
    # ---- which rows (and, split, which slots of them) this program owns --------------------------------------
    pid = tl.program_id(0)
    if PERSISTENT:  # a fixed grid walks the (task, head) items, task outer: longest tasks of every head first
        n_items = tl.load(N_TASKS) * n_bh  # live tasks only: the capacity's empty slots are never visited
        if PULL:  # the first free program takes the next item: no program waits behind a long one dealt to it
            item = tl.atomic_add(COUNTER, 1)
        else:
            item = pid
        while item < n_items:
            m_tile, slot_lo, slot_hi, ws = load_task(TASKS, item // n_bh)
            _fwd_task(Q, K, V, O, LSE, desc_q, desc_k, desc_v, stride_qb, stride_qh, stride_qm, stride_kb,
                      stride_kh, stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                      KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, BITS, DOC, stride_doc_b, ROW_SLOT, WS_O, WS_LSE,
                      ws_cap, m_tile, slot_lo, slot_hi, ws, item % n_bh, Hq, group, LB, LH, lh_div, n_qtiles, W, FW,
                      Lq, Lk, q_offset, scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN, CAP0, CAP1,
                      CAP2, CAP3, CAP_SHAPE, HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N, WARP_SPEC, USE_BITS,
                      HAS_SINKS, HAS_DOC, HAS_ROW_SLOT, EVEN_K, USE_TMA, DOT_PRECISION, True, USE_FN)
            if PULL:
                item = tl.atomic_add(COUNTER, 1)
            else:
                item += tl.num_programs(0)
    else:
        bh = tl.program_id(1)
        if SPLIT:  # a task of sparseattn.balance.plan: (sub-tile, first slot, end slot, workspace slot)
            if pid >= tl.load(N_TASKS):
                return  # an empty slot of the fixed-capacity task list
            m_tile, slot_lo, slot_hi, ws = load_task(TASKS, pid)
        else:
            m_tile = tl.load(ROW_ORDER + pid)  # longest rows first: the tail of the launch is short rows
            slot_lo = 0
            slot_hi = W + FW
            ws = -1
        _fwd_task(Q, K, V, O, LSE, desc_q, desc_k, desc_v, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
                  stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
                  KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, BITS, DOC, stride_doc_b, ROW_SLOT, WS_O, WS_LSE, ws_cap,
                  m_tile, slot_lo, slot_hi, ws, bh, Hq, group, LB, LH, lh_div, n_qtiles, W, FW, Lq, Lk, q_offset,
                  scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                  HEAD_DIM, BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N, WARP_SPEC, USE_BITS, HAS_SINKS, HAS_DOC,
                  HAS_ROW_SLOT, EVEN_K, USE_TMA, DOT_PRECISION, SPLIT, USE_FN)


@triton.jit
def _fwd_task(Q, K, V, O, LSE, desc_q, desc_k, desc_v, stride_qb, stride_qh, stride_qm, stride_kb, stride_kh,
              stride_kn, stride_vb, stride_vh, stride_vn, stride_ob, stride_oh, stride_om,
              KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, BITS, DOC, stride_doc_b, ROW_SLOT, WS_O, WS_LSE, ws_cap,
              m_tile, slot_lo, slot_hi, ws, bh, Hq, group, LB, LH, lh_div, n_qtiles, W, FW, Lq, Lk, q_offset,
              scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3,
              CAP_SHAPE, HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, WARP_SPEC: tl.constexpr, USE_BITS: tl.constexpr,
              HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, HAS_ROW_SLOT: tl.constexpr, EVEN_K: tl.constexpr,
              USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, SPLIT: tl.constexpr, USE_FN: tl.constexpr):
    """One task: query sub-tile ``m_tile`` of head ``bh`` over slots ``[slot_lo, slot_hi)`` of its row (the whole
    row: ``0, W + FW``). ``SPLIT``: ``ws >= 0`` writes the partial state to workspace slot ``ws`` (merged
    later), ``ws = -1`` writes O; otherwise always O. The plain, split and persistent grids all run this body."""
    # ---- the layout row of this (batch, head) and the task's query sub-tile ----------------------------------
    b = bh // Hq
    hq = bh % Hq
    hkv = hq // group
    lb = b % LB  # layout dims broadcast when 1
    lh = (hq // lh_div) % LH
    m_start = m_tile * BLOCK_M
    qi = m_start // BLOCK_Q  # layout row
    row = (lb * LH + lh) * n_qtiles + qi

    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BM] local query rows
    offs_m_abs = offs_m + q_offset  # [BM] absolute positions
    offs_d = tl.arange(0, HEAD_DIM)
    row_in_tile = (m_start % BLOCK_Q) + tl.arange(0, BLOCK_M)  # [BM] for the bits path

    q_base = Q + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh
    k_base = K + b.to(tl.int64) * stride_kb + hkv.to(tl.int64) * stride_kh
    v_base = V + b.to(tl.int64) * stride_vb + hkv.to(tl.int64) * stride_vh
    m_ok = offs_m < Lq
    b_q = load_rows(desc_q, q_base, m_start, stride_qm, b, hq, Lq, BLOCK_M, HEAD_DIM, USE_TMA, True)  # [BM, D]
    DOC_ROW = doc_row(DOC, b, stride_doc_b, HAS_DOC)  # this batch row's document-id table
    doc_q = doc_ids(DOC_ROW, offs_m_abs, HAS_DOC)  # [BM]
    RS_ROW = row_slot_base(ROW_SLOT, lb, lh, LH, Lq, W, HAS_ROW_SLOT)  # member bits of this layout head
    rs_rows = row_slot_rows(offs_m, Lq, W)  # [BM]

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)

    # ---- partial tiles (token mask), then full tiles (no mask work) --------------------------------------
    if SPLIT:  # the task's slots past this head's partial list are its full tiles
        kv_n = tl.load(KV_COUNT + row)
        full_lo = tl.maximum(slot_lo - kv_n, 0)
        full_hi = slot_hi - kv_n
    else:
        full_lo = 0
        full_hi = FW
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, b_q, desc_k, desc_v, k_base, v_base, stride_kn, stride_vn, b, hkv,
                               KV_COUNT, KV_INDEX, row, W, slot_lo, slot_hi, offs_m_abs, row_in_tile, doc_q,
                               DOC_ROW, BITS, Lk, scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW,
                               rs_rows, lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                               BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N, HEAD_DIM, True, USE_BITS, HAS_SINKS, HAS_DOC,
                               HAS_ROW_SLOT, EVEN_K, USE_TMA, DOT_PRECISION, WARP_SPEC, USE_FN)
    acc, m_i, l_i = _fwd_tiles(acc, m_i, l_i, b_q, desc_k, desc_v, k_base, v_base, stride_kn, stride_vn, b, hkv,
                               FULL_COUNT, FULL_INDEX, row, FW, full_lo, full_hi, offs_m_abs, row_in_tile, doc_q,
                               DOC_ROW, BITS, Lk, scale_log2, band_lo, band_hi, sink_n, sink_lo, sink_hi, RS_ROW,
                               rs_rows, lb, lh, MASK_FN, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                               BLOCK_Q, BLOCK_K, BLOCK_M, BLOCK_N, HEAD_DIM, False, USE_BITS, HAS_SINKS, HAS_DOC,
                               HAS_ROW_SLOT, EVEN_K, USE_TMA, DOT_PRECISION, WARP_SPEC, USE_FN)

    # ---- one normalisation; empty rows give O = 0 and LSE = -inf -------------------------------------------
    b_o, b_lse = finalize(m_i, l_i, acc)
    if SPLIT:
        if ws >= 0:  # a chunk of a split row: its float32 state, merged by kernels.merge in chunk order
            p_ws = (bh.to(tl.int64) * ws_cap + ws) * BLOCK_M + tl.arange(0, BLOCK_M)  # [BM] workspace rows
            tl.store(WS_O + p_ws[:, None] * HEAD_DIM + offs_d[None, :], b_o)
            tl.store(WS_LSE + p_ws, b_lse)
        else:
            _store_out(O, LSE, b_o, b_lse, b, hq, bh, stride_ob, stride_oh, stride_om, offs_m, offs_d, m_ok, Lq)
    else:
        _store_out(O, LSE, b_o, b_lse, b, hq, bh, stride_ob, stride_oh, stride_om, offs_m, offs_d, m_ok, Lq)




@triton.jit
def _store_out(O, LSE, b_o, b_lse, b, hq, bh, stride_ob, stride_oh, stride_om, offs_m, offs_d, m_ok, Lq):
    """O (in its dtype) and the natural-log LSE of one query sub-tile; rows past Lq are not stored."""
    o_base = O + b.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], b_o.to(O.dtype.element_ty), mask=m_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, b_lse, mask=m_ok)
