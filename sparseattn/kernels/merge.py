"""Merge of a split forward: the partial states of a row's chunks, combined in chunk order.

``merge_rows_kernel``: one program per (split query sub-tile, batch * query head, slice of the head dim). The
chunks of a split row wrote their normalised ``o`` and natural-log ``lse`` (float32) to consecutive workspace
slots (:func:`sparseattn.balance.plan`); the program folds them one after another with the law of
:func:`sparseattn.reference.merge_states` (``lse = log sum exp lse_j``, ``o = sum exp(lse_j - lse) o_j``),
always in the same order, so the result is bitwise repeatable. A chunk with ``lse = -inf`` (no allowed key in
it) adds nothing, and its ``o`` is never read into the sum; a row with no allowed key in any chunk gets O = 0
and LSE = -inf. Entries past ``N_MERGE[0]`` (the fixed capacity's empty slots) return at once.
"""
import triton
import triton.language as tl

from ._common import load_merge_entry


@triton.jit
def merge_rows_kernel(WS_O, WS_LSE, MERGE, N_MERGE, O, LSE, stride_ob, stride_oh, stride_om, Hq, Lq, ws_cap,
                      HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_D: tl.constexpr):
    e = tl.program_id(0)
    bh = tl.program_id(1)
    dblk = tl.program_id(2)
    if e >= tl.load(N_MERGE):
        return
    m_tile, first, n_chunks = load_merge_entry(MERGE, e)
    offs_r = tl.arange(0, BLOCK_M)  # [BM] rows of the sub-tile
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)  # [BD]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    for j in range(0, n_chunks):
        p_ws = (bh.to(tl.int64) * ws_cap + first + j) * BLOCK_M + offs_r  # [BM]
        b_lse = tl.load(WS_LSE + p_ws)  # [BM]
        b_o = tl.load(WS_O + p_ws[:, None] * HEAD_DIM + offs_d[None, :])  # [BM, BD]
        m_new = tl.maximum(m_i, b_lse)
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: every weight is exp(-inf) = 0
        alpha = tl.exp(m_i - m_sub)
        w = tl.exp(b_lse - m_sub)  # [BM]
        acc = acc * alpha[:, None] + tl.where((b_lse == float("-inf"))[:, None], 0.0, w[:, None] * b_o)
        l_i = l_i * alpha + w
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    b_lse = tl.where(empty, float("-inf"), m_i + tl.log(l_safe))
    offs_m = m_tile * BLOCK_M + offs_r
    m_ok = offs_m < Lq
    b = bh // Hq
    hq = bh % Hq
    o_base = O + b.to(tl.int64) * stride_ob + hq.to(tl.int64) * stride_oh
    tl.store(o_base + offs_m[:, None] * stride_om + offs_d[None, :], (acc / l_safe[:, None]).to(O.dtype.element_ty),
             mask=m_ok[:, None])
    if dblk == 0:
        tl.store(LSE + bh.to(tl.int64) * Lq + offs_m, b_lse, mask=m_ok)
