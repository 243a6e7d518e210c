"""A paged KV cache and page selections for sparse decoding.

The pool holds ``num_pages`` pages of ``page_size`` tokens: ``k_pages``/``v_pages`` are
``[num_pages, page_size, Hkv, D]`` (a token's heads are adjacent, so one append writes one contiguous row).
Each sequence owns a row of ``page_table [max_seqs, max_pages_per_seq]`` mapping its logical pages to
physical ones, and a length in ``seq_lens``. Per page the cache keeps the element-wise minimum and maximum of
its keys (``k_min``/``k_max``, ``[num_pages, Hkv, D]``), which bound ``q . k`` for page selection.

Page allocation is host-side bookkeeping (a free list and reference counts); the device tensors are what
kernels read. ``fork`` shares pages between sequences; writing into a shared, partly filled page copies it
first (copy-on-write), so a fork never sees the other sequence's new tokens.
"""
from __future__ import annotations

from typing import List, Optional

import torch

from ._checks import check_int, check_query_fits_cache

__all__ = ["PagedKVCache", "PageSelection"]


class PagedKVCache:
    def __init__(self, num_pages: int, page_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.bfloat16, device=None, max_seqs: int = 64,
                 max_pages_per_seq: Optional[int] = None):
        check_int("num_pages", num_pages)
        check_int("page_size", page_size)
        check_int("num_kv_heads", num_kv_heads)
        check_int("head_dim", head_dim)
        check_int("max_seqs", max_seqs)
        if page_size & (page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {page_size}")
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        max_pages_per_seq = num_pages if max_pages_per_seq is None else check_int("max_pages_per_seq",
                                                                                    max_pages_per_seq)
        device = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
        self.num_pages, self.page_size, self.num_kv_heads, self.head_dim = num_pages, page_size, num_kv_heads, head_dim
        self.dtype, self.device, self.max_seqs, self.max_pages_per_seq = dtype, device, max_seqs, max_pages_per_seq
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.k_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.v_pages = torch.zeros(shape, dtype=dtype, device=device)
        self.device = device = self.k_pages.device  # "cuda" -> "cuda:0", so comparisons with q.device hold
        self.k_min = torch.zeros(num_pages, num_kv_heads, head_dim, dtype=dtype, device=device)
        self.k_max = torch.zeros_like(self.k_min)
        self.page_table = torch.zeros(max_seqs, max_pages_per_seq, dtype=torch.int32, device=device)
        self.seq_lens = torch.zeros(max_seqs, dtype=torch.int32, device=device)
        # host bookkeeping
        self._free: List[int] = list(range(num_pages - 1, -1, -1))  # pop() hands out page 0 first
        self._refs = [0] * num_pages
        self._pages: List[List[int]] = [[] for _ in range(max_seqs)]
        self._lens = [0] * max_seqs

    # ---- bookkeeping ------------------------------------------------------------------------------------
    def _check_seq(self, seq) -> int:
        check_int("seq", seq, 0)
        if seq >= self.max_seqs:
            raise ValueError(f"seq must be in [0, max_seqs={self.max_seqs}), got {seq}")
        return seq

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def seq_len(self, seq: int) -> int:
        return self._lens[self._check_seq(seq)]

    def pages_of(self, seq: int) -> List[int]:
        return list(self._pages[self._check_seq(seq)])

    def _sync_row(self, seq: int) -> None:
        pages = self._pages[seq]
        row = torch.zeros(self.max_pages_per_seq, dtype=torch.int32)
        if pages:
            row[: len(pages)] = torch.tensor(pages, dtype=torch.int32)
        self.page_table[seq] = row.to(self.device)
        self.seq_lens[seq] = self._lens[seq]

    # ---- writes -----------------------------------------------------------------------------------------
    def append(self, seq: int, k: torch.Tensor, v: torch.Tensor) -> None:
        """Append ``L`` tokens (``k``, ``v``: ``[L, Hkv, D]``) to sequence ``seq``, allocating pages as needed.
        Raises ValueError, changing nothing, when the pool or the sequence's page row is full."""
        seq = self._check_seq(seq)
        want = (self.num_kv_heads, self.head_dim)
        for name, t in (("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3 or tuple(t.shape[1:]) != want:
                raise ValueError(f"{name} must have shape [L, {want[0]}, {want[1]}], got {tuple(t.shape)}")
            if not t.dtype.is_floating_point:
                raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if k.shape[0] != v.shape[0]:
            raise ValueError(f"k and v must have the same length, got {k.shape[0]} and {v.shape[0]}")
        L = k.shape[0]
        if L == 0:
            return
        ps, old_len, pages = self.page_size, self._lens[seq], self._pages[seq]
        new_len = old_len + L
        n_new = -(-new_len // ps) - len(pages)
        shared_tail = old_len % ps != 0 and self._refs[pages[-1]] > 1
        need = n_new + (1 if shared_tail else 0)
        if -(-new_len // ps) > self.max_pages_per_seq:
            raise ValueError(f"k, v: appending {L} tokens to sequence {seq} would need {-(-new_len // ps)} pages, "
                             f"more than max_pages_per_seq={self.max_pages_per_seq}")
        if need > len(self._free):
            raise ValueError(f"KV pool is full: appending {L} tokens (k, v) to sequence {seq} needs {need} free "
                             f"pages, {len(self._free)} left")
        if shared_tail:  # copy-on-write: the partly filled last page is shared with a fork
            old = pages[-1]
            new = self._free.pop()
            for t in (self.k_pages, self.v_pages, self.k_min, self.k_max):
                t[new] = t[old]
            self._refs[old] -= 1
            self._refs[new] = 1
            pages[-1] = new
        for _ in range(n_new):
            p = self._free.pop()
            self._refs[p] = 1
            pages.append(p)
        # scatter the tokens into their pages
        pos = torch.arange(old_len, new_len)
        page_ids = torch.tensor(pages, dtype=torch.long)[pos // ps].to(self.device)
        rows = (pos % ps).to(self.device)
        self.k_pages[page_ids, rows] = k.to(device=self.device, dtype=self.dtype)
        self.v_pages[page_ids, rows] = v.to(device=self.device, dtype=self.dtype)
        # refresh the key bounds of the touched pages over their filled rows
        first, last = old_len // ps, (new_len - 1) // ps
        touched = torch.tensor(pages[first:last + 1], dtype=torch.long, device=self.device)
        filled = torch.clamp(new_len - torch.arange(first, last + 1, device=self.device) * ps, max=ps)  # [n]
        kp = self.k_pages[touched].float()  # [n, ps, Hkv, D]
        valid = (torch.arange(ps, device=self.device)[None, :] < filled[:, None])[..., None, None]
        self.k_min[touched] = torch.where(valid, kp, float("inf")).amin(1).to(self.dtype)
        self.k_max[touched] = torch.where(valid, kp, float("-inf")).amax(1).to(self.dtype)
        self._lens[seq] = new_len
        self._sync_row(seq)

    def fork(self, src: int, dst: int) -> None:
        """``dst`` becomes a copy of ``src`` that shares its pages (reference counted)."""
        src, dst = self._check_seq(src), self._check_seq(dst)
        if src == dst:
            raise ValueError("fork needs two different sequences")
        if self._lens[dst] or self._pages[dst]:
            raise ValueError(f"sequence {dst} is not empty: free it before forking into it")
        self._pages[dst] = list(self._pages[src])
        for p in self._pages[dst]:
            self._refs[p] += 1
        self._lens[dst] = self._lens[src]
        self._sync_row(dst)

    def free(self, seq: int) -> None:
        """Release the sequence's pages (those no fork still uses return to the pool)."""
        seq = self._check_seq(seq)
        for p in self._pages[seq]:
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)
        self._pages[seq] = []
        self._lens[seq] = 0
        self._sync_row(seq)

    # ---- reads (reference only) ---------------------------------------------------------------------------
    def gather_dense(self, seq: int):
        """``(k, v)`` of one sequence as contiguous ``[Hkv, L, D]`` copies, for reference checks."""
        seq = self._check_seq(seq)
        L, ps = self._lens[seq], self.page_size
        pos = torch.arange(L)
        page_ids = torch.tensor(self._pages[seq], dtype=torch.long)[pos // ps].to(self.device) if L else \
            torch.zeros(0, dtype=torch.long, device=self.device)
        rows = (pos % ps).to(self.device)
        return (self.k_pages[page_ids, rows].transpose(0, 1).contiguous(),
                self.v_pages[page_ids, rows].transpose(0, 1).contiguous())


class PageSelection:
    """Pages each (sequence, KV head) attends to: ``index int32 [B, Hkv, P]`` logical page numbers, ascending,
    the first ``count int32 [B, Hkv]`` of each row valid. Built by a user it is validated here (ValueError
    for duplicates, unsorted or negative pages; pass ``cache`` and ``seqs`` to also reject pages past a
    sequence's end, which otherwise select nothing); ``select_pages`` builds valid ones directly with
    ``trusted=True`` (no host sync)."""

    def __init__(self, index: torch.Tensor, count: torch.Tensor, cache: Optional[PagedKVCache] = None,
                 seqs=None, trusted: bool = False):
        self.index, self.count = index, count
        if not trusted:
            self.validate(cache, seqs)

    @property
    def capacity(self) -> int:
        return self.index.shape[-1]

    def validate(self, cache: Optional[PagedKVCache] = None, seqs=None) -> "PageSelection":
        index, count = self.index, self.count
        for name, t in (("index", index), ("count", count)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"PageSelection.{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.int32:
                raise TypeError(f"PageSelection.{name} must be int32, got {t.dtype}")
        if index.dim() != 3 or count.dim() != 2 or tuple(count.shape) != tuple(index.shape[:2]):
            raise ValueError(f"PageSelection needs index [B, Hkv, P] and count [B, Hkv], got {tuple(index.shape)} "
                             f"and {tuple(count.shape)}")
        if index.shape[2] < 1:
            raise ValueError("PageSelection.index needs a capacity P >= 1")
        if index.device != count.device:
            raise ValueError(f"index is on {index.device}, count on {count.device}")
        P = index.shape[2]
        if bool(((count < 0) | (count > P)).any()):
            raise ValueError(f"PageSelection.count must be in [0, {P}]")
        valid = torch.arange(P, device=index.device) < count[..., None]
        if bool((valid & (index < 0)).any()):
            raise ValueError("PageSelection.index has a negative page")
        if bool((valid[..., 1:] & (index[..., 1:] <= index[..., :-1])).any()):
            raise ValueError("PageSelection.index rows must be strictly ascending (duplicate or unsorted page)")
        if cache is not None:
            B = index.shape[0]
            seqs_t = torch.arange(B) if seqs is None else torch.as_tensor(seqs).cpu().long()
            n_pages = torch.tensor([-(-cache.seq_len(int(s)) // cache.page_size) for s in seqs_t],
                                   device=index.device)
            if bool((valid & (index >= n_pages.view(-1, 1, 1))).any()):
                raise ValueError("PageSelection.index selects a page past the end of its sequence")
        return self


def check_select_args(q, cache, topk, always_first, always_last) -> int:
    """Arguments of :func:`select_pages` (and its reference); returns B."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    check_query_fits_cache(q, cache)
    check_int("topk", topk, 1)
    check_int("always_first", always_first, 0)
    check_int("always_last", always_last, 0)
    return q.shape[0]
