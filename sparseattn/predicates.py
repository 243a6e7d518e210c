"""Which token-mask path a layout's partial tiles take inside a kernel.

Partial tiles need a token mask. Two paths keep it exact:

* **predicate** — patterns built from distance bands (``causal``, ``sliding_window``, ``full``), ``sinks``
  and ``document`` combine into one in-register test evaluated from the row and column positions alone::

      allowed = (lo <= q - kv <= hi)  or  (kv < n_sinks and s_lo <= q - kv <= s_hi),   and  doc[q] == doc[kv]

  No mask bytes are read. ``and_masks``/``or_masks``/``prefix_lm`` of those reduce to this form when the
  algebra allows (see :func:`kernel_predicate`).
* **bits** — every other mask_mod (``dilated``, ``block_random``, user functions) and layouts built from a
  dense mask read a packed bit per cell (``BlockLayout.partial_tile_bits()``: ``block_q * block_k / 8``
  bytes per partial tile, 2 KiB at 128 x 128), so any mask stays exact.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

import torch

INF = 1 << 30  # "unbounded" distance, far beyond any sequence length a kernel addresses


@dataclass(frozen=True)
class Predicate:
    band: tuple  # (lo, hi) on q - kv; lo > hi means empty
    sink_n: int = 0
    sink_band: tuple = (-INF, INF)
    doc_ids: Optional[torch.Tensor] = None

    @property
    def has_sinks(self) -> bool:
        return self.sink_n > 0 and self.sink_band[0] <= self.sink_band[1]

    def describe(self) -> str:
        parts = [f"{self.band[0]} <= q-kv <= {self.band[1]}"]
        if self.has_sinks:
            parts.append(f"or (kv < {self.sink_n} and {self.sink_band[0]} <= q-kv <= {self.sink_band[1]})")
        if self.doc_ids is not None:
            parts.append("and same document")
        return " ".join(parts)


_ALL = (-INF, INF)
_EMPTY = (1, 0)


def _meet(a: tuple, b: tuple) -> tuple:
    return max(a[0], b[0]), min(a[1], b[1])


def _is_empty(band: tuple) -> bool:
    return band[0] > band[1]


def kernel_predicate(mask_mod) -> Optional[Predicate]:
    """The in-register predicate equivalent to ``mask_mod``, or None when it needs the bits path."""
    if mask_mod is None:
        return None
    band = getattr(mask_mod, "band", None)
    if band is not None:
        lo, hi = band
        return Predicate(band=(-INF if lo is None else lo, INF if hi is None else hi))
    n = getattr(mask_mod, "num_sinks", None)
    if n is not None:
        return Predicate(band=_EMPTY, sink_n=n)
    doc = getattr(mask_mod, "doc_ids", None)
    if doc is not None:
        return Predicate(band=_ALL, doc_ids=doc)
    combine, parts = getattr(mask_mod, "combine", None), getattr(mask_mod, "parts", None)
    if combine not in ("and", "or") or not parts:
        return None
    preds = [kernel_predicate(p) for p in parts]
    if any(p is None for p in preds):
        return None
    out = preds[0]
    for p in preds[1:]:
        out = _and(out, p) if combine == "and" else _or(out, p)
        if out is None:
            return None
    return out


def _same_doc(a, b):
    if a is None or b is None:
        return a if b is None else b, True
    return a, a is b


def _and(a: Predicate, b: Predicate) -> Optional[Predicate]:
    doc, ok = _same_doc(a.doc_ids, b.doc_ids)
    if not ok:
        return None
    if a.has_sinks and b.has_sinks:
        return None
    if b.has_sinks:
        a, b = b, a
    # (Ba or Sa) and Bb  =  (Ba and Bb) or (Sa and Bb)
    return Predicate(band=_meet(a.band, b.band), sink_n=a.sink_n if a.has_sinks else 0,
                     sink_band=_meet(a.sink_band, b.band) if a.has_sinks else _ALL, doc_ids=doc)


def _or(a: Predicate, b: Predicate) -> Optional[Predicate]:
    if a.doc_ids is not None or b.doc_ids is not None:
        return None  # (x and doc) or y is not of the form
    if a.has_sinks and b.has_sinks:
        return None
    if not _is_empty(a.band) and not _is_empty(b.band):
        lo, hi = sorted([a.band, b.band])
        if hi[0] > lo[1] + 1:
            return None  # two disjoint bands
        band = (lo[0], max(lo[1], hi[1]))
    else:
        band = a.band if not _is_empty(a.band) else b.band
    s = a if a.has_sinks else b
    return replace(s, band=band) if s.has_sinks else Predicate(band=band)
