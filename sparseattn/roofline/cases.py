"""The named layouts and setups of the recorded benchmarks, in one place.

The benchmark suites measure these and the calibration rebuilds them to price the recorded rows, so both
read the definitions from here (:mod:`sparseattn.bench.cases` re-exports them; the bench sits above the
roofline in the layering). Names are the ones recorded in ``book/data/bench/*.json`` (``"window1024"``,
``"sinks64+window1024"``, ...): a figure that asks for a pattern by name, the suite that measured it and the
model that prices it agree by construction. The definitions must stay as they were when the data was
recorded; :func:`sparseattn.roofline.calibrate.point_work` checks each rebuilt layout against the tile
count its row carries.
"""
from __future__ import annotations

import math
from typing import Callable, Dict, Optional

import torch

from .. import patterns as P
from ..layout import BlockLayout
from ..paged import PagedKVCache

__all__ = ["PREFILL_PATTERNS", "MASKC_PATTERNS", "TABLE_PATTERNS", "stripes_mask", "documents_ids",
           "prefill_mask_mod", "prefill_layout", "random_diag_layout", "dense_pattern_of", "ENVELOPES",
           "LAYOUT_PATTERNS", "layout_mask_mod", "decode_setup"]

# ---------------------------------------------------------------------------------------------------------
# prefill and backward suites (block 128, the book's chapters 5 and 6)
# ---------------------------------------------------------------------------------------------------------
#: The prefill/backward suites' patterns, in the order the book shows them.
PREFILL_PATTERNS = ["causal", "window1024", "sinks64+window1024", "random10%+diag"]



def stripes_mask():
    """Issue 13's plain-lambda mask: causal, and one diagonal stripe of 32 in every 96 (``(q - kv) // 32 % 3
    == 0``), so about a third of the causal triangle is allowed and every causal tile is partial (tile
    amplification about 3.0). A plain function: no tile rule, no hand-written predicate; before the mask
    compiler it took per-tile bits."""
    return lambda b, h, q_idx, kv_idx: (kv_idx <= q_idx) & (((q_idx - kv_idx) // 32) % 3 == 0)


#: Patterns with no hand-written in-register predicate, measured with the compiled mask_mod
#: (:mod:`sparseattn.maskc`) against per-tile bits and FlexAttention (issue 13's table); not in the recorded
#: figures' pattern list, so the chapters' figures and the calibration are unchanged by them.
MASKC_PATTERNS = ["stripes(plain lambda)", "causal&(window256|dilated8)"]

#: Issue 13's other table patterns (band and document predicates, no compiler needed): measured by the
#: ``versus`` suite and, on request (``--patterns``), by the prefill and backward suites; not in their defaults
#: (a backward run over them at both lengths would not fit its 10 minutes) nor in the recorded figures.
TABLE_PATTERNS = ["documents64", "window333"]


def documents_ids(N: int, n_docs: int = 64, seed: int = 0, device="cpu") -> torch.Tensor:
    """Document ids ``[N]`` of ``n_docs`` documents packed into ``N`` tokens, with random lengths: the
    ``n_docs - 1`` boundaries are distinct positions in ``[1, N)`` drawn uniformly by a CPU generator seeded with
    ``seed`` (so every device draws the same documents; lengths average ``N / n_docs``, none is empty)."""
    if N < n_docs:
        raise ValueError(f"N must be at least n_docs={n_docs} (every document holds a token), got N={N}")
    g = torch.Generator(device="cpu").manual_seed(seed)
    starts = torch.zeros(N, dtype=torch.int32)
    starts[torch.randperm(N - 1, generator=g)[:n_docs - 1] + 1] = 1  # a document starts at each marked position
    return torch.cumsum(starts, 0, dtype=torch.int32).to(device)


_PREFILL_MASK_MODS: Dict[str, Callable] = {
    "dense": P.full,
    "causal": P.causal,
    "window1024": lambda: P.sliding_window(1024),
    "sinks64+window1024": lambda: P.sinks_window(64, 1024),
    "stripes(plain lambda)": stripes_mask,
    "causal&(window256|dilated8)": lambda: P.and_masks(P.causal(), P.or_masks(P.sliding_window(256),
                                                                              P.dilated(8))),
    "window333": lambda: P.sliding_window(333),
}
#: Patterns whose mask_mod depends on the length (captured tensors): factories of ``(N, device)``.
_PREFILL_MASK_MODS_N: Dict[str, Callable] = {
    "documents64": lambda N, device: P.and_masks(P.causal(), P.document(documents_ids(N, 64, device=device))),
}


def prefill_mask_mod(pattern: str, N: Optional[int] = None, device="cpu"):
    """The mask_mod of a token-level prefill pattern (``dense`` and every pattern but the block-level
    ``random10%+diag``). ``documents64`` (64 documents of random lengths, causal inside each; see
    :func:`documents_ids`) captures its ids: it needs the length ``N`` and puts them on ``device``."""
    if pattern in _PREFILL_MASK_MODS_N:
        if N is None:
            raise ValueError(f"pattern {pattern!r} captures per-token document ids: pass its length N")
        return _PREFILL_MASK_MODS_N[pattern](N, device)
    if pattern not in _PREFILL_MASK_MODS:
        raise ValueError(f"pattern must be one of {sorted({**_PREFILL_MASK_MODS, **_PREFILL_MASK_MODS_N})} "
                         f"(token-level prefill patterns), got {pattern!r}")
    return _PREFILL_MASK_MODS[pattern]()


def random_diag_layout(N: int, density: float, block: int = 128, seed: int = 0, device="cpu") -> BlockLayout:
    """Whole ``block x block`` tiles kept at random with probability ``density`` (a CPU generator seeded
    with ``seed``, so every device draws the same tiles) plus the diagonal, every listed tile full: a
    block-level pattern with no mask_mod (FlexAttention gets its no-op mask and compiles once per length)."""
    n = math.ceil(N / block)
    g = torch.Generator(device="cpu").manual_seed(seed)
    blocks = (torch.rand(n, n, generator=g) < density) | torch.eye(n, dtype=torch.bool)
    return BlockLayout.from_block_mask(blocks.view(1, 1, n, n).to(device), N, N, block, block)


def prefill_layout(pattern: str, N: int, block: int = 128, device="cuda") -> BlockLayout:
    """The block table of a prefill pattern at length ``N`` (queries and keys), tiles ``block x block``
    (``"dense"`` too: the envelope the dense baselines cover)."""
    if pattern == "random10%+diag":
        return random_diag_layout(N, 0.10, block, seed=0, device=device)
    if pattern not in _PREFILL_MASK_MODS and pattern not in _PREFILL_MASK_MODS_N:
        raise ValueError(f"pattern must be one of {['dense'] + PREFILL_PATTERNS + MASKC_PATTERNS + TABLE_PATTERNS}, "
                         f"got {pattern!r}")
    return BlockLayout.from_mask_mod(prefill_mask_mod(pattern, N, device), N, N, block, block, device=device)


#: The envelope of each recorded prefill pattern: the cheapest dense problem covering it
#: (:func:`sparseattn.roofline.crossover.envelope_of` of its layout; a test checks the two agree).
ENVELOPES = {"dense": "dense", "causal": "causal", "window1024": "causal", "sinks64+window1024": "causal",
             "random10%+diag": "dense"}


def dense_pattern_of(pattern: str) -> str:
    """The dense baseline doing the same work as a pattern's envelope: ``"causal"`` for the patterns inside the
    causal triangle (causal, windows, sinks + window), else ``"dense"`` (the case pattern of the cuDNN/FA2
    rows)."""
    if pattern in MASKC_PATTERNS or pattern in TABLE_PATTERNS:  # all lie inside the causal triangle
        return "causal"
    if pattern not in ENVELOPES:
        raise ValueError(f"pattern must be one of {sorted(ENVELOPES)}, got {pattern!r}")
    return ENVELOPES[pattern]


# ---------------------------------------------------------------------------------------------------------
# layout suite: building the block table
# ---------------------------------------------------------------------------------------------------------
#: The layout suite's patterns: analytic tile rules of several kinds, and one mask with no rule.
LAYOUT_PATTERNS = ["causal", "window1024", "sinks64+window1024", "dilated4&causal", "documents&causal",
                   "block_random10%", "arbitrary(no rule)"]


def layout_mask_mod(pattern: str, N: int, device="cuda", generator: Optional[torch.Generator] = None):
    """The mask_mod of a layout-suite pattern at length ``N``. ``documents&causal`` draws 32 documents: sorted
    random ids from ``generator`` (a generator on ``device``; None: the global one). Only how many tiles the
    ids leave undecided matters to the build time, and that depends on their distribution, not the draw."""
    if pattern in ("causal", "window1024", "sinks64+window1024"):
        return prefill_mask_mod(pattern)
    if pattern == "dilated4&causal":
        return P.and_masks(P.causal(), P.dilated(4))
    if pattern == "documents&causal":
        docs = torch.sort(torch.randint(0, 32, (N,), device=device, generator=generator)).values
        return P.and_masks(P.causal(), P.document(docs))
    if pattern == "block_random10%":
        return P.block_random(0.1, 128, seed=0)
    if pattern == "arbitrary(no rule)":
        return lambda b, h, q, k: (k <= q) & ((q - k) % 7 != 3)
    raise ValueError(f"pattern must be one of {LAYOUT_PATTERNS}, got {pattern!r}")


# ---------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------
def decode_setup(B: int, L: int, ps: int, Hq: int, Hkv: int, D: int, dtype, device="cuda", seed: int = 0):
    """Seeded random K/V ``[B, Hkv, L, D]`` (contiguous, for the dense baselines), the same tokens in a full
    paged cache of page size ``ps`` (the last page partly filled when ``ps`` does not divide ``L``), and one
    query per sequence ``[B, Hq, D]``."""
    torch.manual_seed(seed)
    kd = torch.randn(B, Hkv, L, D, device=device, dtype=dtype)
    vd = torch.randn_like(kd)
    pages = math.ceil(L / ps)
    cache = PagedKVCache(B * pages, ps, Hkv, D, dtype=dtype, device=device, max_seqs=B, max_pages_per_seq=pages)
    for b in range(B):
        cache.append(b, kd[b].transpose(0, 1), vd[b].transpose(0, 1))
    return kd, vd, cache, torch.randn(B, Hq, D, device=device, dtype=dtype)
