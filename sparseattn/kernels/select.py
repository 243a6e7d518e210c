"""Quest page selection on the device: a bound per page, then an exact top-k per row, in two launches.

``page_bound_kernel``: one program per (block of pages, row, KV head). For a query q and a page whose keys
lie element-wise in [k_min, k_max], ``q . k <= relu(q) . k_max + min(q, 0) . k_min``: two small dots per page
(the query heads of the GQA group are the rows), then the max over the group, so the group shares one
selection. It reads 2 D values per page instead of page_size D.

``topk_pages_kernel``: one program per (row, KV head). It finds the k-th largest bound by bisection on the
bits of the float (a float's bits, with the negative ones flipped, sort like the float), then writes the
chosen pages in ascending order with a running prefix sum. No sort, no host sync; ties at the threshold go
to the lower page numbers, so the result is deterministic.
"""
import torch
import triton
import triton.language as tl


@triton.heuristics({"DOT_PRECISION": lambda a: "ieee" if a["Q"].dtype == torch.float32 else "tf32"})
@triton.jit
def page_bound_kernel(
    Q, K_MIN, K_MAX, PAGE_TABLE, SEQ_LENS, SEQS, BOUND,
    stride_qb, stride_qh, stride_mp, stride_mh, stride_pt,
    Hkv, group, P_max,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_P: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pblk = tl.program_id(0)
    b = tl.program_id(1)
    hkv = tl.program_id(2)
    seq = tl.load(SEQS + b)
    n_pages = tl.cdiv(tl.load(SEQ_LENS + seq), PAGE_SIZE)
    offs_p = pblk * BLOCK_P + tl.arange(0, BLOCK_P)  # [BP] logical pages
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    live = offs_p < n_pages
    g_ok = offs_g < group
    b_q = tl.load(Q + b.to(tl.int64) * stride_qb + (hkv * group + offs_g)[:, None] * stride_qh + offs_d[None, :],
                  mask=g_ok[:, None], other=0.0)  # [BG, D]
    phys = tl.load(PAGE_TABLE + seq.to(tl.int64) * stride_pt + offs_p, mask=live, other=0).to(tl.int64)  # [BP]
    off_m = phys[:, None] * stride_mp + hkv * stride_mh + offs_d[None, :]
    b_kmax = tl.load(K_MAX + off_m, mask=live[:, None], other=0.0)  # [BP, D]
    b_kmin = tl.load(K_MIN + off_m, mask=live[:, None], other=0.0)
    # relu(q) and min(q, 0) are exact in q's dtype (Triton computes bf16 max/min in fp32: cast back)
    b_qpos = tl.where(b_q > 0, b_q, 0.0).to(b_kmax.dtype)
    b_qneg = tl.where(b_q < 0, b_q, 0.0).to(b_kmin.dtype)
    b_b = tl.dot(b_qpos, tl.trans(b_kmax), input_precision=DOT_PRECISION)  # [BG, BP]
    b_b = tl.dot(b_qneg, tl.trans(b_kmin), b_b, input_precision=DOT_PRECISION)
    b_b = tl.where(g_ok[:, None], b_b, float("-inf"))
    b_bound = tl.where(live, tl.max(b_b, 0), float("-inf"))  # [BP]
    tl.store(BOUND + (b * Hkv + hkv).to(tl.int64) * P_max + offs_p, b_bound, mask=offs_p < P_max)


@triton.jit
def _sort_key(x):
    # float32 -> int32 with the same order: flip the magnitude bits of negative floats
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _row_keys(BOUND, row, start, n_pages, P_max, always_first, always_last, BLOCK_P: tl.constexpr):
    """Sort keys of pages [start, start + BLOCK_P) of one row: forced pages get the key of +inf."""
    offs_p = start + tl.arange(0, BLOCK_P)  # [BP]
    live = offs_p < n_pages
    forced = live & ((offs_p < always_first) | (offs_p >= n_pages - always_last))
    b_x = tl.load(BOUND + row * P_max + offs_p, mask=live, other=float("-inf"))
    b_x = tl.where(forced, float("inf"), b_x)
    return offs_p, live, _sort_key(b_x)


@triton.heuristics({"ONE_BLOCK": lambda a: a["P_max"] <= a["BLOCK_P"]})
@triton.jit
def topk_pages_kernel(
    BOUND, SEQ_LENS, SEQS, INDEX, COUNT,
    Hkv, P_max, capacity, always_first, always_last,
    PAGE_SIZE: tl.constexpr, BLOCK_P: tl.constexpr, ONE_BLOCK: tl.constexpr,
):
    b = tl.program_id(0)
    hkv = tl.program_id(1)
    row = (b * Hkv + hkv).to(tl.int64)
    n_pages = tl.cdiv(tl.load(SEQ_LENS + tl.load(SEQS + b)), PAGE_SIZE)
    k_eff = tl.minimum(capacity, n_pages)
    offs_p, live, b_key = _row_keys(BOUND, row, 0, n_pages, P_max, always_first, always_last, BLOCK_P)
    # bisection for the largest threshold t with #{live pages with key >= t} >= k_eff. Every live key lies in
    # [key(-inf) + 1, key(+inf)]; 33 halvings close a 2^32 range. lo, hi in int64 so lo + hi cannot overflow.
    lo = tl.full([], -2139095041 + 1, tl.int64)  # _sort_key(-inf) + 1  (-inf is 0xFF800000 -> 0x807FFFFF)
    hi = tl.full([], 2139095040, tl.int64)  # _sort_key(+inf) = 0x7F800000
    for _step in range(33):
        mid = lo + (hi - lo + 1) // 2
        mid32 = mid.to(tl.int32)
        if ONE_BLOCK:  # the row stays in registers
            cnt = tl.sum((live & (b_key >= mid32)).to(tl.int32), 0)
        else:
            cnt = 0
            for start in range(0, P_max, BLOCK_P):
                _offs, c_live, c_key = _row_keys(BOUND, row, start, n_pages, P_max, always_first, always_last,
                                                 BLOCK_P)
                cnt += tl.sum((c_live & (c_key >= mid32)).to(tl.int32), 0)
        ok = cnt >= k_eff
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    t = lo.to(tl.int32)
    # pages above the threshold are all kept; ties at it are kept in page order until k_eff is reached
    if ONE_BLOCK:
        n_above = tl.sum((live & (b_key > t)).to(tl.int32), 0)
    else:
        n_above = 0
        for start in range(0, P_max, BLOCK_P):
            _offs, c_live, c_key = _row_keys(BOUND, row, start, n_pages, P_max, always_first, always_last,
                                             BLOCK_P)
            n_above += tl.sum((c_live & (c_key > t)).to(tl.int32), 0)
    ties_left = k_eff - n_above
    written = 0
    for start in range(0, P_max, BLOCK_P):
        if not ONE_BLOCK:
            offs_p, live, b_key = _row_keys(BOUND, row, start, n_pages, P_max, always_first, always_last,
                                            BLOCK_P)
        b_tie = live & (b_key == t)
        tie_rank = tl.cumsum(b_tie.to(tl.int32), 0) - 1  # [BP]
        b_take = (live & (b_key > t)) | (b_tie & (tie_rank < ties_left))
        pos = written + tl.cumsum(b_take.to(tl.int32), 0) - 1  # ascending output slots
        tl.store(INDEX + row * capacity + pos, offs_p.to(tl.int32), mask=b_take)
        written += tl.sum(b_take.to(tl.int32), 0)
        ties_left -= tl.sum(b_tie.to(tl.int32), 0)
    tl.store(COUNT + row, written.to(tl.int32))
