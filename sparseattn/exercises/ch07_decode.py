"""Chapter 7 exercise: address translation inside the decode kernel's loads.

The decode kernel walks *virtual* tokens: the selected pages of a sequence laid end to end. For each virtual
token offset it must find the physical page and the row inside it, through two tables: the selection ``SEL``
(ascending *logical* page numbers of this sequence) and the page table row ``PT`` (logical page -> physical
page of the pool). No gathered copy of K/V is ever made. ``in_range`` marks the offsets that fall inside the
selection (the last step of a loop may run past it); lanes outside it must not read the tables. The package's
kernel is ``sparseattn.kernels.decode.decode_split_kernel``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from .._checks import LOG2E
from ..kernels._common import finalize, online_softmax_step
from ..paged import PagedKVCache
from ..reference import reference_attention
from . import Exercise, assert_close, blank, interpreted, passed, run

__all__ = ["translate_scaffold", "translate_solution", "check_translate", "EXERCISES"]


@triton.jit
def translate_scaffold(offs_v, in_range, SEL, PT, PAGE_SIZE: tl.constexpr):
    """Virtual token offsets [BN] -> (physical page [BN], row in the page [BN], logical page [BN])."""
    vpage = offs_v // PAGE_SIZE  # [BN] which selected page each token falls in
    row = offs_v % PAGE_SIZE  # [BN] its row inside that page
    logical = blank("the logical page: entry vpage of the selection SEL (only for lanes in range)")
    phys = blank("the physical page: entry `logical` of the page table row PT (only for lanes in range)")
    return phys, row, logical


@triton.jit
def translate_solution(offs_v, in_range, SEL, PT, PAGE_SIZE: tl.constexpr):
    """Virtual token offsets [BN] -> (physical page [BN], row in the page [BN], logical page [BN])."""
    vpage = offs_v // PAGE_SIZE  # [BN] which selected page each token falls in
    row = offs_v % PAGE_SIZE  # [BN] its row inside that page
    logical = tl.load(SEL + vpage, mask=in_range, other=0)  # [BN] selection: virtual -> logical page
    phys = tl.load(PT + logical, mask=in_range, other=0)  # [BN] page table: logical -> physical page
    return phys, row, logical


def _mistake_no_page_table(offs_v, in_range, SEL, PT, PAGE_SIZE: tl.constexpr):
    """Uses the logical page as if it were physical: right only while pages happen to be in order."""
    vpage = offs_v // PAGE_SIZE
    logical = tl.load(SEL + vpage, mask=in_range, other=0)
    return logical, offs_v % PAGE_SIZE, logical


def _mistake_no_selection(offs_v, in_range, SEL, PT, PAGE_SIZE: tl.constexpr):
    """Skips the selection: reads the first pages of the sequence instead of the selected ones."""
    vpage = offs_v // PAGE_SIZE
    phys = tl.load(PT + vpage, mask=in_range, other=0)
    return phys, offs_v % PAGE_SIZE, vpage


def _harness(Q, K_PAGES, V_PAGES, PT, SEL, n_sel, seq_len, O, LSE, scale_log2, FRAG, STEP, FINALIZE,
             PAGE_SIZE: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, D: tl.constexpr):
    # one decode program: the G query heads of one KV head against the selected pages of one sequence
    offs_g = tl.arange(0, G)
    offs_d = tl.arange(0, D)
    b_q = tl.load(Q + offs_g[:, None] * D + offs_d[None, :])  # [G, D]
    m_i = tl.full([G], float("-inf"), tl.float32)
    l_i = tl.zeros([G], tl.float32)
    acc = tl.zeros([G, D], tl.float32)
    n_virtual = n_sel * PAGE_SIZE
    for start in range(0, n_virtual, BN):
        offs_v = start + tl.arange(0, BN)  # [BN] virtual tokens
        in_range = offs_v < n_virtual
        phys, row, logical = FRAG(offs_v, in_range, SEL, PT, PAGE_SIZE)
        valid = in_range & (logical * PAGE_SIZE + row < seq_len)  # the last page may be partly filled
        off = (phys.to(tl.int64) * PAGE_SIZE + row)[:, None] * D + offs_d[None, :]  # [BN, D] (one KV head)
        b_k = tl.load(K_PAGES + off, mask=valid[:, None], other=0.0)
        b_v = tl.load(V_PAGES + off, mask=valid[:, None], other=0.0)
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2  # [G, BN]
        b_s = tl.where(valid[None, :], b_s, float("-inf"))
        m_i, l_i, acc = STEP(b_s, b_v, m_i, l_i, acc, "ieee")
    b_o, b_lse = FINALIZE(m_i, l_i, acc)
    tl.store(O + offs_g[:, None] * D + offs_d[None, :], b_o)
    tl.store(LSE + offs_g, b_lse)


def check_translate(fn) -> None:
    """Decode one query (4 heads sharing a KV head) over 4 selected pages of a sequence whose pages are
    scattered in the pool (another sequence was appended in between) and whose last page is partly filled,
    in the interpreter; compare with ``reference_attention`` on exactly the selected tokens."""
    ps, D, G = 4, 16, 4
    g = torch.Generator().manual_seed(0)
    cache = PagedKVCache(num_pages=32, page_size=ps, num_kv_heads=1, head_dim=D, dtype=torch.float32,
                         device="cpu", max_seqs=2, max_pages_per_seq=16)
    for n0, n1 in ((10, 7), (9, 6), (26, 3)):  # interleaved appends scatter both sequences' pages
        cache.append(0, torch.randn(n0, 1, D, generator=g), torch.randn(n0, 1, D, generator=g))
        cache.append(1, torch.randn(n1, 1, D, generator=g), torch.randn(n1, 1, D, generator=g))
    seq_len = cache.seq_len(0)  # 45 tokens: 12 pages, the last holds one token
    sel = torch.tensor([0, 3, 5, (seq_len - 1) // ps], dtype=torch.int32)
    q = torch.randn(G, D, generator=g)
    o = torch.full((G, D), float("nan"))  # poisoned: every element must be written
    lse = torch.full((G,), float("nan"))
    scale = 1.0 / math.sqrt(D)
    run("translate", lambda: interpreted(_harness)[(1,)](
        q, cache.k_pages, cache.v_pages, cache.page_table[0].contiguous(), sel, len(sel), seq_len, o, lse,
        scale * LOG2E, FRAG=interpreted(fn), STEP=interpreted(online_softmax_step), FINALIZE=interpreted(finalize),
        PAGE_SIZE=ps, BN=8, G=G, D=D))
    k, v = cache.gather_dense(0)  # [1, L, D] in logical order: the reference reads the selected rows
    keep = torch.cat([torch.arange(p * ps, min((p + 1) * ps, seq_len)) for p in sel.tolist()])
    want_o, want_lse = reference_attention(q.view(1, G, 1, D), k[:, keep].view(1, 1, -1, D),
                                           v[:, keep].view(1, 1, -1, D), scale=scale, return_lse=True)
    assert_close(lse, want_lse.view(G), "translate: log-sum-exp per head (which tokens were read)", atol=1e-4)
    assert_close(o, want_o.view(G, D), "translate: output", atol=2e-5, rtol=1e-4)
    passed("translate", f"4 selected pages of 12, scattered in the pool, last page {seq_len % ps} token(s)")


EXERCISES = [Exercise("translate", translate_scaffold, translate_solution, check_translate,
                      mistakes=(_mistake_no_page_table, _mistake_no_selection),
                      prompt="the two table lookups: selection, then page table")]
