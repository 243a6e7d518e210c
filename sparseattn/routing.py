"""Dynamic selection on the device.

``select_pages`` is Quest-style page selection for decoding: for every page the cache keeps the element-wise
min and max of its keys, so for a query q

    q . k  <=  sum_d max(q_d * min_d, q_d * max_d)     for every key k of the page,

an upper bound on the page's best score that costs ``2 D`` multiply-adds per page instead of ``page_size D``.
Pages are ranked by that bound (the max over the query heads of a GQA group, so the group shares one
selection), the forced first/last pages are added, and the top ``topk`` are returned ascending. Everything
stays on the device with fixed shapes, so a decode step with selection can be captured in a CUDA graph.
"""
from __future__ import annotations

import torch

from ._checks import check_device, seqs_tensor
from .paged import PagedKVCache, PageSelection, check_select_args

_TOPK_BLOCK = 8192  # pages of one row kept in registers by the top-k kernel

__all__ = ["page_bounds", "select_pages"]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def page_bounds(q: torch.Tensor, cache: PagedKVCache, seqs=None) -> torch.Tensor:
    """Upper bound of ``scale``-free ``q . k`` per (row, KV head, logical page): float32 ``[B, Hkv, P_max]``,
    the max over the query heads of each GQA group; pages past a sequence's end get ``-inf``. One Triton
    launch that reads the per-page key bounds through the page table (:func:`sparseattn.reference.page_bounds_reference` is the
    eager spec)."""
    B = check_select_args(q, cache, 1, 0, 0)
    check_device(q, what="q (and the cache)")
    return _page_bounds(q, cache, seqs_tensor(seqs, B, q.device, cache.max_seqs))


def _page_bounds(q: torch.Tensor, cache: PagedKVCache, seqs_t: torch.Tensor) -> torch.Tensor:
    """:func:`page_bounds` on checked arguments (``select_pages`` has checked them already)."""
    B, Hq, D = q.shape
    Hkv, P_max = cache.num_kv_heads, cache.max_pages_per_seq
    from .kernels import select
    group = Hq // Hkv
    bound = torch.empty(B, Hkv, P_max, device=q.device, dtype=torch.float32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_p = 64
    select.page_bound_kernel[(-(-P_max // block_p), B, Hkv)](
        Q=q, K_MIN=cache.k_min, K_MAX=cache.k_max, PAGE_TABLE=cache.page_table, SEQ_LENS=cache.seq_lens,
        SEQS=seqs_t, BOUND=bound, stride_qb=q.stride(0), stride_qh=q.stride(1), stride_mp=cache.k_min.stride(0),
        stride_mh=cache.k_min.stride(1), stride_pt=cache.page_table.stride(0), Hkv=Hkv, group=group, P_max=P_max,
        HEAD_DIM=D, PAGE_SIZE=cache.page_size, BLOCK_G=max(16, _pow2_at_least(group)), BLOCK_P=block_p,
        num_warps=4)
    return bound


def select_pages(q: torch.Tensor, cache: PagedKVCache, topk: int, seqs=None, always_first: int = 1,
                 always_last: int = 1) -> PageSelection:
    """The ``topk`` pages of highest bound per (row, KV head), always including the first ``always_first``
    and last ``always_last`` pages of each sequence (they count towards ``topk``; with ``topk`` below their
    number the lowest-numbered forced pages are kept), clamped to the sequence's page count; ties go to the
    lower page. Capacity (the selection's P) is ``min(topk, max_pages_per_seq)``, fixed by shapes. Two
    Triton launches, no host synchronisation (:func:`sparseattn.reference.select_pages_reference` is the eager spec)."""
    B = check_select_args(q, cache, topk, always_first, always_last)
    check_device(q, what="q (and the cache)")
    seqs_t = seqs_tensor(seqs, B, q.device, cache.max_seqs)
    capacity = min(topk, cache.max_pages_per_seq)
    bound = _page_bounds(q, cache, seqs_t)  # [B, Hkv, P_max]
    from .kernels import select
    Hkv, P_max = cache.num_kv_heads, cache.max_pages_per_seq
    index = torch.zeros(B, Hkv, capacity, device=q.device, dtype=torch.int32)
    count = torch.empty(B, Hkv, device=q.device, dtype=torch.int32)
    block_p = min(_TOPK_BLOCK, max(16, _pow2_at_least(P_max)))
    select.topk_pages_kernel[(B, Hkv)](
        BOUND=bound, SEQ_LENS=cache.seq_lens, SEQS=seqs_t, INDEX=index, COUNT=count, Hkv=Hkv, P_max=P_max,
        capacity=capacity, always_first=always_first, always_last=always_last, PAGE_SIZE=cache.page_size,
        BLOCK_P=block_p, num_warps=8 if block_p >= 4096 else 4)
    return PageSelection(index, count, trusted=True)
