"""Block-sparse attention forward: one program per (query sub-tile, batch * query head).

A program walks only the key tiles its layout row lists: the partial tiles (token mask applied), then the
full tiles (no mask work). Each layout tile of ``BLOCK_K`` keys is visited in ``BLOCK_K // BLOCK_N`` steps of
``BLOCK_N``. Softmax is online in base 2: running max ``m_i``, running sum ``l_i`` and an unnormalised
accumulator ``acc``; one division at the end. Writes O and the natural-log LSE (float32).
"""
import triton
import triton.language as tl



@triton.jit
def _partial_mask(offs_m_abs, offs_n, n_start, row_in_tile, bits_ptr, doc_q, DOC_K,
                  band_lo, band_hi, sink_n, sink_lo, sink_hi,
                  BLOCK_K: tl.constexpr, BLOCK_N: tl.constexpr, USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr,
                  HAS_DOC: tl.constexpr):
    """Token mask of a [BLOCK_M, BLOCK_N] piece of a partial tile."""
    if USE_BITS:
        col_in_tile = (n_start % BLOCK_K) + tl.arange(0, BLOCK_N)  # [BN]
        b_byte = tl.load(bits_ptr + row_in_tile[:, None] * (BLOCK_K // 8) + (col_in_tile // 8)[None, :])
        allowed = ((b_byte.to(tl.int32) >> (col_in_tile % 8)[None, :]) & 1) != 0  # [BM, BN]
    else:
        d = offs_m_abs[:, None] - offs_n[None, :]  # [BM, BN] distance q - kv
        allowed = (d >= band_lo) & (d <= band_hi)
        if HAS_SINKS:
            allowed = allowed | ((offs_n[None, :] < sink_n) & (d >= sink_lo) & (d <= sink_hi))
        if HAS_DOC:
            doc_k = tl.load(DOC_K + offs_n)  # [BN]; in range: ops checks doc_ids covers every position
            allowed = allowed & (doc_q[:, None] == doc_k[None, :])
    return allowed


@triton.jit
def masked_softmax_step(b_s, b_v, m_i, l_i, acc, DOT_PRECISION: tl.constexpr):
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
def doc_table(DOC, b, stride_doc_b, positions, last, HAS_DOC: tl.constexpr, DOC_BATCHED: tl.constexpr):
    """``(row pointer, ids)``: this batch row's document-id table and the ids at ``positions`` (clamped to
    ``last``). Without documents, ``(DOC, positions)`` placeholders of the right shape."""
    row = DOC
    ids = positions
    if HAS_DOC:
        if DOC_BATCHED:
            row = DOC + b.to(tl.int64) * stride_doc_b
        ids = tl.load(row + tl.minimum(positions, last))
    return row, ids


@triton.jit
def _load_tile(desc, base, row0, stride_row, b, h, L, ROWS: tl.constexpr, HEAD_DIM: tl.constexpr,
               USE_TMA: tl.constexpr, CHECK: tl.constexpr):
    """Rows ``row0 .. row0 + ROWS`` of one (batch, head) as ``[ROWS, HEAD_DIM]``; rows >= L read as 0.
    With TMA the copy engine does the addressing and the zero fill; otherwise plain masked loads."""
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
def sparse_fwd_kernel(
    Q, K, V, O, LSE, desc_q, desc_k, desc_v,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX, ROW_ORDER, BITS, DOC,
    stride_doc_b,
    Hq, group, LB, LH, lh_div, n_qtiles, W, FW,
    Lq, Lk, q_offset, scale_log2,
    band_lo, band_hi, sink_n, sink_lo, sink_hi,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_BITS: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_DOC: tl.constexpr, DOC_BATCHED: tl.constexpr,
    EVEN_K: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, WARP_SPEC: tl.constexpr,
):
    # ---- which rows this program owns -----------------------------------------------------------------
    pid = tl.program_id(0)
    bh = tl.program_id(1)
    m_tile = tl.load(ROW_ORDER + pid)  # longest rows first: the tail of the launch is short rows
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
    b_q = _load_tile(desc_q, q_base, m_start, stride_qm, b, hq, Lq, BLOCK_M, HEAD_DIM, USE_TMA, True)  # [BM, D]

    DOC_K, doc_q = doc_table(DOC, b, stride_doc_b, offs_m_abs, q_offset + Lq - 1, HAS_DOC, DOC_BATCHED)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    SUB: tl.constexpr = BLOCK_K // BLOCK_N

    # ---- partial tiles: token mask inside the tile -------------------------------------------------------
    n_partial = tl.load(KV_COUNT + row)
    for it in tl.range(0, n_partial * SUB, warp_specialize=WARP_SPEC):
        slot = it // SUB
        kb = tl.load(KV_INDEX + row * W + slot)
        n_start = kb * BLOCK_K + (it % SUB) * BLOCK_N
        offs_n = n_start + tl.arange(0, BLOCK_N)  # [BN]
        b_k = _load_tile(desc_k, k_base, n_start, stride_kn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, True)
        b_v = _load_tile(desc_v, v_base, n_start, stride_vn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, True)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)  # [BM, BN] raw scores
        bits_ptr = BITS + (row.to(tl.int64) * W + slot) * (BLOCK_Q * BLOCK_K // 8)
        allowed = _partial_mask(offs_m_abs, offs_n, n_start, row_in_tile, bits_ptr, doc_q, DOC_K,
                                band_lo, band_hi, sink_n, sink_lo, sink_hi,
                                BLOCK_K, BLOCK_N, USE_BITS, HAS_SINKS, HAS_DOC)
        allowed = allowed & (offs_n < Lk)[None, :]
        b_s = tl.where(allowed, b_s * scale_log2, float("-inf"))
        m_i, l_i, acc = masked_softmax_step(b_s, b_v, m_i, l_i, acc, DOT_PRECISION)

    # ---- full tiles: no mask work (only the key-length edge when Lk is not a multiple of BLOCK_K) ------------
    n_full = tl.load(FULL_COUNT + row)
    for it in tl.range(0, n_full * SUB, warp_specialize=WARP_SPEC):
        kb = tl.load(FULL_INDEX + row * FW + it // SUB)
        n_start = kb * BLOCK_K + (it % SUB) * BLOCK_N
        b_k = _load_tile(desc_k, k_base, n_start, stride_kn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, not EVEN_K)
        b_v = _load_tile(desc_v, v_base, n_start, stride_vn, b, hkv, Lk, BLOCK_N, HEAD_DIM, USE_TMA, not EVEN_K)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION)
        if not EVEN_K:
            b_s = tl.where((n_start + tl.arange(0, BLOCK_N) < Lk)[None, :], b_s, float("-inf"))
        # a full tile has an allowed key in every row, so m_new is finite; scale and subtract in one FMA
        m_new = tl.maximum(m_i, tl.max(b_s, 1) * scale_log2)
        alpha = tl.math.exp2(m_i - m_new)
        b_p = tl.math.exp2(b_s * scale_log2 - m_new[:, None])
        l_i = l_i * alpha + tl.sum(b_p, 1)
        acc = tl.dot(b_p.to(b_v.dtype), b_v, acc * alpha[:, None], input_precision=DOT_PRECISION)
        m_i = m_new

    # ---- one normalisation; empty rows give O = 0 and LSE = -inf -------------------------------------------
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    b_o = acc / l_safe[:, None]
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    o_base = O + b.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], b_o.to(O.dtype.element_ty), mask=m_ok[:, None])
    tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, b_lse, mask=m_ok)
