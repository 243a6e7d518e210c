"""The named patterns and setups that the suites measure and the book draws.

The recorded suites' layouts and setups (prefill, layout, decode) live in :mod:`sparseattn.roofline.cases`,
where the cost model's calibration rebuilds them too, and are re-exported here; the book's gallery of
patterns scaled with the length (chapter 3) is defined here. Names are the ones recorded in
``book/data/bench/*.json`` (``"window1024"``, ``"sinks64+window1024"``, ...), so a figure that asks for a
pattern by name and the suite that measured it agree by construction.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import patterns as P
from ..layout import BlockLayout
from ..roofline.cases import (LAYOUT_PATTERNS, MASKC_PATTERNS, PREFILL_PATTERNS, TABLE_PATTERNS, decode_setup,
                              dense_pattern_of, documents_ids, layout_mask_mod, prefill_layout, prefill_mask_mod,
                              stripes_mask)

__all__ = ["PREFILL_PATTERNS", "MASKC_PATTERNS", "TABLE_PATTERNS", "stripes_mask", "documents_ids",
           "prefill_mask_mod", "prefill_layout", "dense_pattern_of", "LAYOUT_PATTERNS",
           "layout_mask_mod", "decode_setup", "BOOK_PATTERNS", "book_layout", "token_topk_mask"]

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
