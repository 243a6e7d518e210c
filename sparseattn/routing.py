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
import triton

from . import _runtime
from .paged import PagedKVCache, PageSelection

_TOPK_BLOCK = 8192  # pages of one row kept in registers by the top-k kernel

__all__ = ["page_bounds", "select_pages", "page_bounds_reference", "select_pages_reference"]


def _seqs_tensor(seqs, B: int, device, max_seqs: int) -> torch.Tensor:
    """Sequence of each query row as int32 on ``device``. Host values (lists, CPU tensors) are range-checked
    here; a tensor already on the GPU is trusted, since checking it would synchronise."""
    if seqs is None:
        if B > max_seqs:
            raise ValueError(f"q has {B} rows but the cache holds at most max_seqs={max_seqs} sequences")
        return torch.arange(B, device=device, dtype=torch.int32)
    if isinstance(seqs, torch.Tensor) and seqs.dtype.is_floating_point:
        raise TypeError(f"seqs must hold integers, got {seqs.dtype}")
    on_host = not (isinstance(seqs, torch.Tensor) and seqs.device.type != "cpu")
    seqs = torch.as_tensor(seqs)
    if seqs.shape != (B,):
        raise ValueError(f"seqs must have shape [{B}] (one sequence per query row), got {tuple(seqs.shape)}")
    if on_host and B and (int(seqs.min()) < 0 or int(seqs.max()) >= max_seqs):
        raise ValueError(f"seqs must be in [0, max_seqs={max_seqs}), got {seqs.tolist()}")
    return seqs.to(device=device, dtype=torch.int32)


def page_bounds_reference(q: torch.Tensor, cache: PagedKVCache, seqs=None) -> torch.Tensor:
    """Eager reference of :func:`page_bounds` (the spec the kernel is tested against): upper bound of
    ``scale``-free ``q . k`` per (row, KV head, logical page), float32 ``[B, Hkv, P_max]``; pages past a
    sequence's end get ``-inf``."""
    B, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    seqs_t = _seqs_tensor(seqs, B, q.device, cache.max_seqs)
    phys = cache.page_table[seqs_t.long()].long()  # [B, P]
    kmin = cache.k_min[phys].float()  # [B, P, Hkv, D]
    kmax = cache.k_max[phys].float()
    qg = q.float().view(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    # sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min: two batched GEMMs, no [.., D] temporary
    bound = (torch.einsum("bhgd,bphd->bhgp", qg.clamp(min=0), kmax)
             + torch.einsum("bhgd,bphd->bhgp", qg.clamp(max=0), kmin)).amax(2)  # max over the group: [B, Hkv, P]
    n_pages = (cache.seq_lens[seqs_t.long()] + cache.page_size - 1) // cache.page_size  # [B]
    live = torch.arange(cache.max_pages_per_seq, device=q.device)[None, :] < n_pages[:, None]
    return torch.where(live[:, None, :], bound, torch.full_like(bound, float("-inf")))


def _check_select_args(q, cache, topk, always_first, always_last) -> int:
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [B, Hq, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    B, Hq, D = q.shape
    if D != cache.head_dim or Hq % cache.num_kv_heads:
        raise ValueError(f"q [B, Hq={Hq}, D={D}] does not fit the cache (Hkv={cache.num_kv_heads}, "
                         f"D={cache.head_dim})")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {cache.device}")
    if q.dtype != cache.dtype:
        raise TypeError(f"q is {q.dtype} but the cache holds {cache.dtype}")
    from .ops import SUPPORTED_HEAD_DIMS
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {D} is not supported (one of {SUPPORTED_HEAD_DIMS})")
    for name, val in (("topk", topk), ("always_first", always_first), ("always_last", always_last)):
        if isinstance(val, bool) or not isinstance(val, int) or val < (1 if name == "topk" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'topk' else 0}, got {val!r}")
    return B


def page_bounds(q: torch.Tensor, cache: PagedKVCache, seqs=None) -> torch.Tensor:
    """Upper bound of ``scale``-free ``q . k`` per (row, KV head, logical page): float32 ``[B, Hkv, P_max]``,
    the max over the query heads of each GQA group; pages past a sequence's end get ``-inf``. One Triton
    launch that reads the per-page key bounds through the page table (:func:`page_bounds_reference` is the
    eager spec)."""
    B = _check_select_args(q, cache, 1, 0, 0)
    return _page_bounds(q, cache, _seqs_tensor(seqs, B, q.device, cache.max_seqs))


def _page_bounds(q: torch.Tensor, cache: PagedKVCache, seqs_t: torch.Tensor) -> torch.Tensor:
    """:func:`page_bounds` on checked arguments (``select_pages`` has checked them already)."""
    B, Hq, D = q.shape
    Hkv, P_max = cache.num_kv_heads, cache.max_pages_per_seq
    kernels = _runtime.load_kernels("select")
    group = Hq // Hkv
    bound = torch.empty(B, Hkv, P_max, device=q.device, dtype=torch.float32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_p = 64
    kernels.page_bound_kernel[(triton.cdiv(P_max, block_p), B, Hkv)](
        q, cache.k_min, cache.k_max, cache.page_table, cache.seq_lens, seqs_t, bound,
        q.stride(0), q.stride(1), cache.k_min.stride(0), cache.k_min.stride(1), cache.page_table.stride(0),
        Hkv, group, P_max, HEAD_DIM=D, PAGE_SIZE=cache.page_size, BLOCK_G=max(16, triton.next_power_of_2(group)),
        BLOCK_P=block_p, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", num_warps=4)
    return bound


def select_pages(q: torch.Tensor, cache: PagedKVCache, topk: int, seqs=None, always_first: int = 1,
                 always_last: int = 1) -> PageSelection:
    """The ``topk`` pages of highest bound per (row, KV head), always including the first ``always_first``
    and last ``always_last`` pages of each sequence (they count towards ``topk``; with ``topk`` below their
    number the lowest-numbered forced pages are kept), clamped to the sequence's page count; ties go to the
    lower page. Capacity (the selection's P) is ``min(topk, max_pages_per_seq)``, fixed by shapes. Two
    Triton launches, no host synchronisation (:func:`select_pages_reference` is the eager spec)."""
    B = _check_select_args(q, cache, topk, always_first, always_last)
    seqs_t = _seqs_tensor(seqs, B, q.device, cache.max_seqs)
    capacity = min(topk, cache.max_pages_per_seq)
    bound = _page_bounds(q, cache, seqs_t)  # [B, Hkv, P_max]
    kernels = _runtime.load_kernels("select")
    Hkv, P_max = cache.num_kv_heads, cache.max_pages_per_seq
    index = torch.zeros(B, Hkv, capacity, device=q.device, dtype=torch.int32)
    count = torch.empty(B, Hkv, device=q.device, dtype=torch.int32)
    block_p = min(_TOPK_BLOCK, max(16, triton.next_power_of_2(P_max)))
    kernels.topk_pages_kernel[(B, Hkv)](bound, cache.seq_lens, seqs_t, index, count, Hkv, P_max, capacity,
                                        always_first, always_last, PAGE_SIZE=cache.page_size, BLOCK_P=block_p,
                                        ONE_BLOCK=P_max <= block_p, num_warps=8 if block_p >= 4096 else 4)
    return PageSelection(index, count, trusted=True)


def select_pages_reference(q: torch.Tensor, cache: PagedKVCache, topk: int, seqs=None, always_first: int = 1,
                           always_last: int = 1) -> PageSelection:
    """Eager reference of :func:`select_pages` (torch.topk and sort): same pages, same order."""
    B = _check_select_args(q, cache, topk, always_first, always_last)
    seqs_t = _seqs_tensor(seqs, B, q.device, cache.max_seqs)
    bound = page_bounds_reference(q, cache, seqs_t)  # [B, Hkv, P_max]
    P_max = cache.max_pages_per_seq
    n_pages = ((cache.seq_lens[seqs_t.long()] + cache.page_size - 1) // cache.page_size).long()  # [B]
    pages = torch.arange(P_max, device=q.device)[None, :]
    forced = (pages < always_first) | ((pages >= n_pages[:, None] - always_last) & (pages >= 0))
    forced = forced & (pages < n_pages[:, None])
    score = torch.where(forced[:, None, :], torch.full_like(bound, float("inf")), bound)
    k = min(topk, P_max)
    top, idx = torch.topk(score, k, dim=-1)  # [B, Hkv, k]
    ok = top > float("-inf")
    idx = torch.where(ok, idx, torch.full_like(idx, P_max))  # invalid entries sort last
    idx, _ = torch.sort(idx, dim=-1)
    count = ok.sum(-1).to(torch.int32)
    index = torch.where(idx < P_max, idx, torch.zeros_like(idx)).to(torch.int32)
    return PageSelection(index.contiguous(), count, trusted=True)
