"""Decode attention over a paged KV cache, split across programs (flash-decoding), then merged.

``decode_split_kernel``: one program per (split, KV head, sequence). The query heads of the GQA group share
the program (they are the rows of the score tile), so K and V of a page are read once per group. A program
walks a fixed range of *virtual* tokens: the concatenation of the selected pages (or of all pages), and
translates each token to its physical page inside the load (virtual page -> logical page via the selection
-> physical page via the page table): no gathered copy of K/V is ever made. Page size and tile size are
independent: a tile may span several pages or part of one.

``merge_splits_kernel``: one program per (sequence, query head, slice of D) merges the splits' (o, lse)
states with the online-softmax law, a chunk of splits at a time (any split count fits); empty splits
(lse = -inf) add nothing.
"""
import torch
import triton
import triton.language as tl

from ._common import finalize, online_softmax_step


@triton.heuristics({
    "USE_SEL": lambda a: a["SEL_INDEX"] is not None,
    "DOT_PRECISION": lambda a: "ieee" if a["Q"].dtype == torch.float32 else "tf32",
})
@triton.jit
def decode_split_kernel(
    Q, K_PAGES, V_PAGES, PAGE_TABLE, SEQ_LENS, SEQS, SEL_INDEX, SEL_COUNT, O_PART, LSE_PART,
    stride_qb, stride_qh,
    stride_kp, stride_kr, stride_kh,
    stride_vp, stride_vr, stride_vh,
    stride_pt, max_pages,
    Hq, Hkv, group, n_splits, blocks_per_split, sel_capacity, scale_log2,
    HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_SEL: tl.constexpr, HEAD_FASTEST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    if HEAD_FASTEST:  # neighbouring programs read the other heads of the same token rows
        hkv = tl.program_id(0)
        split = tl.program_id(1)
    else:  # neighbouring programs read the next token ranges of the same head
        split = tl.program_id(0)
        hkv = tl.program_id(1)
    b = tl.program_id(2)
    seq = tl.load(SEQS + b)
    seq_len = tl.load(SEQ_LENS + seq)
    if USE_SEL:
        n_sel = tl.load(SEL_COUNT + b * Hkv + hkv)
        n_virtual = n_sel * PAGE_SIZE
        sel_row = SEL_INDEX + (b * Hkv + hkv).to(tl.int64) * sel_capacity
    else:
        n_virtual = seq_len
        sel_row = SEL_INDEX  # no selection: every page of the sequence, in order
    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, HEAD_DIM)
    g_ok = offs_g < group
    heads = hkv * group + offs_g  # [BG] query heads of this KV head
    b_q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                  mask=g_ok[:, None], other=0.0)  # [BG, D]
    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    pt_row = PAGE_TABLE + seq.to(tl.int64) * stride_pt
    first = split * blocks_per_split
    last = tl.minimum(first + blocks_per_split, tl.cdiv(n_virtual, BLOCK_N))
    for blk in range(first, last):
        offs_v = blk * BLOCK_N + tl.arange(0, BLOCK_N)  # [BN] virtual tokens
        vpage = offs_v // PAGE_SIZE
        row = offs_v % PAGE_SIZE
        in_range = offs_v < n_virtual
        if USE_SEL:
            logical = tl.load(sel_row + vpage, mask=in_range, other=0)
            # a selected page past the end of the table row is never looked up; past the sequence's end it
            # selects nothing (valid below is False, so no K/V is read)
            pt_ok = in_range & (logical < max_pages)
        else:
            logical = vpage
            pt_ok = in_range
        phys = tl.load(pt_row + logical, mask=pt_ok, other=0).to(tl.int64)
        valid = in_range & (logical * PAGE_SIZE + row < seq_len)  # the last page may be partly filled
        k_ptrs = K_PAGES + phys[:, None] * stride_kp + row[:, None] * stride_kr + hkv * stride_kh + offs_d[None, :]
        v_ptrs = V_PAGES + phys[:, None] * stride_vp + row[:, None] * stride_vr + hkv * stride_vh + offs_d[None, :]
        b_k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)  # [BN, D]
        b_v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k), input_precision=DOT_PRECISION) * scale_log2  # [BG, BN]
        b_s = tl.where(valid[None, :], b_s, float("-inf"))
        m_i, l_i, acc = online_softmax_step(b_s, b_v, m_i, l_i, acc, DOT_PRECISION)
    b_o, b_lse = finalize(m_i, l_i, acc)
    part = ((b * Hq + heads).to(tl.int64) * n_splits + split)  # [BG]
    tl.store(O_PART + part[:, None] * HEAD_DIM + offs_d[None, :], b_o, mask=g_ok[:, None])
    tl.store(LSE_PART + part, b_lse, mask=g_ok)


@triton.jit
def merge_splits_kernel(O_PART, LSE_PART, O, LSE, stride_ob, stride_oh, Hq, n_splits,
                        HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr):
    bh = tl.program_id(0)
    dblk = tl.program_id(1)  # a slice of the head dim: at batch 1 there are only Hq rows to merge
    b = bh // Hq
    h = bh % Hq
    offs_d = dblk * BLOCK_D + tl.arange(0, BLOCK_D)
    # online merge over chunks of splits, so any split count fits in registers
    m_i = tl.full([], float("-inf"), tl.float32)
    l_i = tl.full([], 0.0, tl.float32)
    acc = tl.zeros([BLOCK_D], tl.float32)
    for start in range(0, n_splits, BLOCK_S):
        offs_s = start + tl.arange(0, BLOCK_S)
        s_ok = offs_s < n_splits
        b_lse = tl.load(LSE_PART + bh.to(tl.int64) * n_splits + offs_s, mask=s_ok, other=float("-inf"))  # [BS]
        m_new = tl.maximum(m_i, tl.max(b_lse, 0))
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # all empty so far: weights exp(-inf) = 0
        alpha = tl.exp(m_i - m_sub)
        w = tl.exp(b_lse - m_sub)  # [BS]; empty splits (lse = -inf) weigh 0
        b_o = tl.load(O_PART + (bh.to(tl.int64) * n_splits + offs_s)[:, None] * HEAD_DIM + offs_d[None, :],
                      mask=s_ok[:, None], other=0.0)  # [BS, BD]
        acc = acc * alpha + tl.sum(w[:, None] * b_o, 0)
        l_i = l_i * alpha + tl.sum(w, 0)
        m_i = m_new
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    lse = tl.where(empty, float("-inf"), tl.where(m_i == float("-inf"), 0.0, m_i) + tl.log(l_safe))
    tl.store(O + b.to(tl.int64) * stride_ob + h * stride_oh + offs_d, (acc / l_safe).to(O.dtype.element_ty))
    if dblk == 0:
        tl.store(LSE + bh, lse)
