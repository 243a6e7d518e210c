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

from .paged import PagedKVCache, PageSelection

__all__ = ["page_bounds", "select_pages"]


def _seqs_tensor(seqs, B: int, device) -> torch.Tensor:
    if seqs is None:
        return torch.arange(B, device=device, dtype=torch.int32)
    seqs = torch.as_tensor(seqs, device=device).to(torch.int32)
    if seqs.shape != (B,):
        raise ValueError(f"seqs must have shape [{B}] (one sequence per query row), got {tuple(seqs.shape)}")
    return seqs


def page_bounds(q: torch.Tensor, cache: PagedKVCache, seqs=None) -> torch.Tensor:
    """Upper bound of ``scale``-free ``q . k`` per (row, KV head, logical page): float32 ``[B, Hkv, P_max]``;
    pages past a sequence's end get ``-inf``."""
    B, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    seqs_t = _seqs_tensor(seqs, B, q.device)
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


def select_pages(q: torch.Tensor, cache: PagedKVCache, topk: int, seqs=None, always_first: int = 1,
                 always_last: int = 1) -> PageSelection:
    """The ``topk`` pages of highest bound per (row, KV head), always including the first ``always_first``
    and last ``always_last`` pages of each sequence (they count towards ``topk``; with ``topk`` below their
    number, which forced pages are kept is unspecified); clamped to the sequence's page count. Capacity (the selection's P)
    is ``min(topk, max_pages_per_seq)``, fixed by shapes; no host synchronisation."""
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
    for name, val in (("topk", topk), ("always_first", always_first), ("always_last", always_last)):
        if isinstance(val, bool) or not isinstance(val, int) or val < (1 if name == "topk" else 0):
            raise ValueError(f"{name} must be an int >= {1 if name == 'topk' else 0}, got {val!r}")
    seqs_t = _seqs_tensor(seqs, B, q.device)
    bound = page_bounds(q, cache, seqs_t)  # [B, Hkv, P_max]
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
