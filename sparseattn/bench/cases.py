"""The named patterns and setups that the suites measure and the book draws, in one place.

Names are the ones recorded in ``book/data/bench/*.json`` (``"window1024"``, ``"sinks64+window1024"``, ...),
so a figure that asks for a pattern by name and the suite that measured it agree by construction.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

from .. import patterns as P
from ..layout import BlockLayout
from ..paged import PagedKVCache

__all__ = ["PREFILL_PATTERNS", "prefill_mask_mod", "prefill_layout", "dense_pattern_of", "LAYOUT_PATTERNS",
           "layout_mask_mod", "decode_setup", "BOOK_PATTERNS", "book_layout", "token_topk_mask"]

# ---------------------------------------------------------------------------------------------------------
# prefill and backward suites (block 128, the book's chapters 5 and 6)
# ---------------------------------------------------------------------------------------------------------
#: The prefill/backward suites' patterns, in the order the book shows them.
PREFILL_PATTERNS = ["causal", "window1024", "sinks64+window1024", "random10%+diag"]

_PREFILL_MASK_MODS: Dict[str, Callable] = {
    "causal": P.causal,
    "window1024": lambda: P.sliding_window(1024),
    "sinks64+window1024": lambda: P.sinks_window(64, 1024),
}


def prefill_mask_mod(pattern: str):
    """The mask_mod of a token-level prefill pattern (every pattern but the block-level ``random10%+diag``)."""
    if pattern not in _PREFILL_MASK_MODS:
        raise ValueError(f"pattern must be one of {sorted(_PREFILL_MASK_MODS)} (token-level prefill patterns), "
                         f"got {pattern!r}")
    return _PREFILL_MASK_MODS[pattern]()


def prefill_layout(pattern: str, N: int, block: int = 128, device="cuda") -> BlockLayout:
    """The block table of a prefill pattern at length ``N`` (queries and keys), tiles ``block x block``."""
    if pattern == "random10%+diag":
        # 10% of the blocks at random plus the diagonal, every listed tile full (a block-level pattern)
        n = math.ceil(N / block)
        g = torch.Generator(device="cpu").manual_seed(0)
        blocks = (torch.rand(n, n, generator=g) < 0.10) | torch.eye(n, dtype=torch.bool)
        return BlockLayout.from_block_mask(blocks.view(1, 1, n, n).to(device), N, N, block, block)
    if pattern not in _PREFILL_MASK_MODS:
        raise ValueError(f"pattern must be one of {PREFILL_PATTERNS}, got {pattern!r}")
    return BlockLayout.from_mask_mod(prefill_mask_mod(pattern), N, N, block, block, device=device)


def dense_pattern_of(pattern: str) -> str:
    """The dense baseline doing the same work as a pattern's envelope (the case pattern of the cuDNN/FA2
    rows): ``"causal"`` for every causal pattern (causal, and the causal windows with or without sinks),
    ``"dense"`` for the block-level ``random10%+diag``, which spans the whole grid."""
    return "causal" if pattern in _PREFILL_MASK_MODS else "dense"


# ---------------------------------------------------------------------------------------------------------
# layout suite: building the block table
# ---------------------------------------------------------------------------------------------------------
#: The layout suite's patterns: analytic tile rules of several kinds, and one mask with no rule.
LAYOUT_PATTERNS = ["causal", "window1024", "sinks64+window1024", "dilated4&causal", "documents&causal",
                   "block_random10%", "arbitrary(no rule)"]


def layout_mask_mod(pattern: str, N: int, device="cuda"):
    """The mask_mod of a layout-suite pattern at length ``N`` (``documents&causal`` draws 32 documents)."""
    if pattern in _PREFILL_MASK_MODS:
        return prefill_mask_mod(pattern)
    if pattern == "dilated4&causal":
        return P.and_masks(P.causal(), P.dilated(4))
    if pattern == "documents&causal":
        docs = torch.sort(torch.randint(0, 32, (N,), device=device, generator=None)).values
        return P.and_masks(P.causal(), P.document(docs))
    if pattern == "block_random10%":
        return P.block_random(0.1, 128, seed=0)
    if pattern == "arbitrary(no rule)":
        return lambda b, h, q, k: (k <= q) & ((q - k) % 7 != 3)
    raise ValueError(f"pattern must be one of {LAYOUT_PATTERNS}, got {pattern!r}")


# ---------------------------------------------------------------------------------------------------------
# decode suites
# ---------------------------------------------------------------------------------------------------------
def decode_setup(B: int, L: int, ps: int, Hq: int, Hkv: int, D: int, dtype, device="cuda"):
    """Seeded random K/V ``[B, Hkv, L, D]`` (contiguous, for the baselines), the same tokens in a full paged
    cache of page size ``ps``, and one query per sequence ``[B, Hq, D]``."""
    torch.manual_seed(0)
    kd = torch.randn(B, Hkv, L, D, device=device, dtype=dtype)
    vd = torch.randn_like(kd)
    cache = PagedKVCache(B * (L // ps), ps, Hkv, D, dtype=dtype, device=device, max_seqs=B,
                         max_pages_per_seq=L // ps)
    for b in range(B):
        cache.append(b, kd[b].transpose(0, 1), vd[b].transpose(0, 1))
    return kd, vd, cache, torch.randn(B, Hq, D, device=device, dtype=dtype)


# ---------------------------------------------------------------------------------------------------------
# the book's gallery (chapter 3): patterns scaled with the length L
# ---------------------------------------------------------------------------------------------------------
BOOK_PATTERNS = ["sliding window", "sinks + window", "dilated", "block-random", "documents", "token top-k"]


def token_topk_mask(L: int, k: int, seed: int = 0) -> torch.Tensor:
    """Token-level routing: each query keeps its top-``k`` earlier keys by a random score ([1, 1, L, L])."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(L, L, generator=g)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, -1.0)
    idx = scores.topk(min(k, L), dim=-1).indices
    mask = torch.zeros(L, L, dtype=torch.bool).scatter_(1, idx, True) & causal
    return mask.view(1, 1, L, L)


def book_layout(pattern: str, L: int, block_q: int, block_k: int, window: Optional[int] = None) -> BlockLayout:
    """The chapter's patterns at length ``L``, scaled with it (window L/8, 4 sinks, ...), on the CPU."""
    w = window or max(L // 8, 1)
    if pattern == "sliding window":
        mm = P.sliding_window(w)
    elif pattern == "sinks + window":
        mm = P.sinks_window(4, w)
    elif pattern == "dilated":
        mm = P.and_masks(P.causal(), P.dilated(4), P.sliding_window(4 * w))
    elif pattern == "block-random":
        mm = P.or_masks(P.and_masks(P.causal(), P.block_random(0.15, 64, seed=1)), P.sliding_window(16))
    elif pattern == "documents":
        g = torch.Generator().manual_seed(2)
        lengths = torch.randint(L // 16, L // 3, (32,), generator=g)
        ids = torch.repeat_interleave(torch.arange(32), lengths)[:L]
        ids = torch.cat([ids, ids.new_full((max(L - ids.numel(), 0),), 32)])
        mm = P.and_masks(P.causal(), P.document(ids))
    elif pattern == "token top-k":
        return BlockLayout.from_dense(token_topk_mask(L, max(w // 4, 1)), block_q, block_k)
    else:
        raise ValueError(f"unknown pattern {pattern!r}; choose from {BOOK_PATTERNS}")
    return BlockLayout.from_mask_mod(mm, L, L, block_q, block_k, device="cpu")
