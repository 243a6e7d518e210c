"""``sparse_decode``: one new query per sequence against a paged KV cache, split across programs
(flash-decoding) and merged. Split counts come from shapes only, so one CUDA graph serves every step."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _runtime
from .._checks import check_device, LOG2E, check_query_fits_cache, check_scale, seqs_tensor
from ..paged import PagedKVCache, PageSelection
from . import _launch as L
from .config import DecodeConfig, layout_default

DECODE_MAX_SPLITS = 64  # per row, unless fewer would leave SMs idle: the merge then reads one chunk per row


def decode_programs_per_sm(cfg: DecodeConfig, B: int, Hkv: int, num_sms: int) -> int:
    """The config's split target, or the default rule (see :class:`DecodeConfig`)."""
    return cfg.programs_per_sm or (8 if B * Hkv >= num_sms else 16)


def decode_splits(B: int, Hkv: int, capacity_tokens: int, block_n: int, num_sms: int, programs_per_sm: int):
    """``(n_splits, blocks_per_split)`` from shapes and capacity only (never from data), so one CUDA graph
    serves every step: about ``programs_per_sm`` programs per SM (many short programs also shrink the last,
    partly filled wave), at most ``DECODE_MAX_SPLITS`` per row while that still gives two programs per SM
    (at batch 1 the merge of hundreds of splits per row costs more than the tail it trims: see the decode
    entries of book/perf-notes.md), never more splits than key blocks."""
    rows = B * Hkv
    max_blocks = max(1, math.ceil(capacity_tokens / block_n))
    want = math.ceil(programs_per_sm * num_sms / rows)
    n_splits = min(max_blocks, max(1, min(want, DECODE_MAX_SPLITS), math.ceil(2 * num_sms / rows)))
    per_split = math.ceil(max_blocks / n_splits)
    return math.ceil(max_blocks / per_split), per_split


def sparse_decode(q: torch.Tensor, cache: PagedKVCache, pages: Optional[PageSelection] = None, seqs=None,
                  scale: Optional[float] = None, return_lse: bool = False, *,
                  config: Optional[DecodeConfig] = None):
    """One new query per sequence against its paged KV cache.

    q ``[B, Hq, D]``; row b is sequence ``seqs[b]`` (default b). ``pages=None`` attends to every page;
    a :class:`PageSelection` restricts each (row, KV head) to its listed logical pages. Returns ``o [B, Hq, D]``
    (q's dtype) and, with ``return_lse``, the natural-log LSE ``[B, Hq]`` float32. Checks shapes and dtypes
    only: no host synchronisation, so it can run inside a CUDA graph. Not differentiable: a ``q`` that
    requires grad is refused rather than silently cut from the graph.

    Input range and NaN rule as in :func:`~sparseattn.sparse_attention`: float32 scores (``|q . k|`` and the
    scaled score below ``2**127``); a NaN in a page's K or V reaches the rows (sequence, GQA group) that read
    that page, never a row that does not visit it (another sequence, another KV head, a page not selected)."""
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    check_query_fits_cache(q, cache)
    if q.requires_grad and torch.is_grad_enabled():
        raise ValueError("sparse_decode is not differentiable: q.requires_grad is True; call it under "
                         "torch.no_grad() or pass q.detach()")
    B, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    if pages is not None:
        if not isinstance(pages, PageSelection):
            raise TypeError(f"pages must be a PageSelection or None, got {type(pages).__name__}")
        if tuple(pages.index.shape[:2]) != (B, Hkv) or pages.index.device != q.device:
            raise ValueError(f"pages must be [B={B}, Hkv={Hkv}, P] on {q.device}, got {tuple(pages.index.shape)} "
                             f"on {pages.index.device}")
    if config is not None:
        if not isinstance(config, DecodeConfig):
            raise TypeError(f"config must be a DecodeConfig or None, got {type(config).__name__}")
        bn, pps = config.block_n, config.programs_per_sm
        if isinstance(bn, bool) or not isinstance(bn, int) or bn < 16 or bn & (bn - 1):
            raise ValueError(f"config: block_n must be a power of two >= 16, got {bn!r}")
        if pps is not None and (isinstance(pps, bool) or not isinstance(pps, int) or pps < 1):
            raise ValueError(f"config: programs_per_sm must be None or an int >= 1, got {pps!r}")
    scale = check_scale(scale, D)
    check_device(q, what="q (and the cache)")
    seqs_t = seqs_tensor(seqs, B, q.device, cache.max_seqs)
    from ..kernels import decode
    q = L.last_dim_contiguous(q)
    group = Hq // Hkv
    cfg = config or layout_default("decode", q.device, _runtime.is_interpreter(), q.dtype, D, 0, 0)
    cap_pages = pages.capacity if pages is not None else cache.max_pages_per_seq
    sms = L.num_sms(q.device)
    n_splits, per_split = decode_splits(B, Hkv, cap_pages * cache.page_size, cfg.block_n, sms,
                                        decode_programs_per_sm(cfg, B, Hkv, sms))
    o_part = torch.empty(B, Hq, n_splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, Hq, n_splits, device=q.device, dtype=torch.float32)
    kp, vp = cache.k_pages, cache.v_pages
    grid = (Hkv, n_splits, B) if cfg.head_fastest else (n_splits, Hkv, B)
    L.launch(
        decode.decode_split_kernel, grid, Q=q, K_PAGES=kp, V_PAGES=vp, PAGE_TABLE=cache.page_table,
        SEQ_LENS=cache.seq_lens, SEQS=seqs_t,
        SEL_INDEX=pages.index if pages is not None else None, SEL_COUNT=pages.count if pages is not None else None,
        O_PART=o_part, LSE_PART=lse_part, stride_qb=q.stride(0), stride_qh=q.stride(1),
        stride_kp=kp.stride(0), stride_kr=kp.stride(1), stride_kh=kp.stride(2),
        stride_vp=vp.stride(0), stride_vr=vp.stride(1), stride_vh=vp.stride(2),
        stride_pt=cache.page_table.stride(0), max_pages=cache.max_pages_per_seq, Hq=Hq, Hkv=Hkv, group=group,
        n_splits=n_splits, blocks_per_split=per_split, sel_capacity=cap_pages, scale_log2=scale * LOG2E,
        HEAD_DIM=D, PAGE_SIZE=cache.page_size, BLOCK_G=max(16, 1 << (group - 1).bit_length()),
        BLOCK_N=cfg.block_n, HEAD_FASTEST=cfg.head_fastest, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    o = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, device=q.device, dtype=torch.float32)
    block_d = min(D, 32)
    L.launch(  # Triton's default warps and stages, as before the cached launch path
        decode.merge_splits_kernel, (B * Hq, D // block_d), O_PART=o_part, LSE_PART=lse_part, O=o, LSE=lse,
        stride_ob=o.stride(0), stride_oh=o.stride(1), Hq=Hq, n_splits=n_splits, HEAD_DIM=D, BLOCK_D=block_d,
        BLOCK_S=min(64, max(2, 1 << (n_splits - 1).bit_length())), num_warps=4, num_stages=3)
    return (o, lse) if return_lse else o
