"""Attention patterns as ``mask_mod`` functions.

A ``mask_mod(b, h, q_idx, kv_idx) -> bool tensor`` says whether query position ``q_idx`` may attend to key
position ``kv_idx`` in batch ``b`` and head ``h``. The signature is FlexAttention's, so attention-gym
mask_mods work with :class:`sparseattn.BlockLayout` and ours work in ``flex_attention``. Every function
here is elementwise over broadcast index tensors: call it with ``q_idx`` of shape ``[N, 1]`` and ``kv_idx``
of shape ``[1, M]`` and get an ``[N, M]`` mask.

``q_idx`` is the query's position as the layout defines it: by default an *absolute* position (when a layout
has fewer queries than keys, the queries are the last ones: ``q_idx = local_q + kv_len - q_len``), or
``local_q + q_offset`` for a layout built with ``q_offset=`` (``q_offset=0``: FlexAttention's local indices).
A mask_mod may also be evaluated the way Flex evaluates it (``torch.vmap`` over index scalars) when it does not
work on whole tiles; see :func:`sparseattn._tiles.eval_tiles`.

Tile rules
----------
A pattern may carry a *tile rule* (attribute ``tile_rule``) that classifies a whole rectangle of cells
without evaluating them. ``rule(tiles)`` receives a :class:`TileGrid` and returns :class:`TileBounds`:
four bool tensors broadcastable to ``[B, H, nq, nk]`` bounding the two facts that classify a tile,

* ``any``: the tile has at least one allowed cell, with ``any_lo <= any <= any_hi``;
* ``all``: every in-range cell of the tile is allowed, with ``all_lo <= all <= all_hi``.

A tile is *decided* when the bounds settle its class: empty (``not any_hi``), full (``all_lo``) or partial
(``any_lo and not all_hi``). Rules may be loose; :class:`BlockLayout` evaluates the cells of every tile the
rule leaves undecided, so a layout is exact either way. A mask_mod without a rule is "always undecided"
and is evaluated cell by cell, tile chunk by tile chunk.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, NamedTuple

import torch

from ._checks import check_int

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

__all__ = [
    "TileGrid",
    "TileBounds",
    "causal",
    "sliding_window",
    "sinks",
    "dilated",
    "block_random",
    "document",
    "prefix_lm",
    "sinks_window",
    "and_masks",
    "or_masks",
    "not_mask",
    "full",
    "tile_rule_of",
    "CATALOGUE",
]


@dataclass(frozen=True)
class TileGrid:
    """The tile rectangles a rule classifies, as broadcastable int64 tensors of absolute positions.

    ``q_lo``/``q_hi`` are ``[1, 1, nq, 1]`` (inclusive, clipped to the queries), ``k_lo``/``k_hi`` are
    ``[1, 1, 1, nk]``; ``b`` is ``[B, 1, 1, 1]`` and ``h`` is ``[1, H, 1, 1]``.
    """

    q_start: int  # absolute position of the first query
    q_len: int
    kv_len: int
    block_q: int
    block_k: int
    B: int
    H: int
    device: torch.device

    @property
    def nq(self) -> int:
        return -(-self.q_len // self.block_q)

    @property
    def nk(self) -> int:
        return -(-self.kv_len // self.block_k)

    def _ar(self, n: int) -> torch.Tensor:
        return torch.arange(n, device=self.device, dtype=torch.int64)

    @property
    def q_lo(self) -> torch.Tensor:
        return (self.q_start + self._ar(self.nq) * self.block_q).view(1, 1, -1, 1)

    @property
    def q_hi(self) -> torch.Tensor:
        hi = torch.clamp((self._ar(self.nq) + 1) * self.block_q, max=self.q_len) - 1
        return (self.q_start + hi).view(1, 1, -1, 1)

    @property
    def k_lo(self) -> torch.Tensor:
        return (self._ar(self.nk) * self.block_k).view(1, 1, 1, -1)

    @property
    def k_hi(self) -> torch.Tensor:
        return (torch.clamp((self._ar(self.nk) + 1) * self.block_k, max=self.kv_len) - 1).view(1, 1, 1, -1)

    @property
    def b(self) -> torch.Tensor:
        return self._ar(self.B).view(-1, 1, 1, 1)

    @property
    def h(self) -> torch.Tensor:
        return self._ar(self.H).view(1, -1, 1, 1)


class TileBounds(NamedTuple):
    any_lo: torch.Tensor
    any_hi: torch.Tensor
    all_lo: torch.Tensor
    all_hi: torch.Tensor


def _exact(any_: torch.Tensor, all_: torch.Tensor) -> TileBounds:
    return TileBounds(any_, any_, all_, all_)


def _ambiguous(tiles: TileGrid) -> TileBounds:
    t = torch.ones((), dtype=torch.bool, device=tiles.device)
    return TileBounds(~t, t, ~t, t)


def tile_rule_of(mask_mod: MaskMod):
    """The tile rule attached to ``mask_mod``, or the always-ambiguous rule for a plain function."""
    return getattr(mask_mod, "tile_rule", _ambiguous)


def _named(fn, name: str, rule=None, **attrs):
    fn.__name__ = name
    fn.__qualname__ = name
    if rule is not None:
        fn.tile_rule = rule
    for key, value in attrs.items():
        setattr(fn, key, value)
    return fn


def _distance_range(tiles: TileGrid):
    """Smallest and largest ``q - kv`` over each tile; every integer in between occurs in the tile."""
    return tiles.q_lo - tiles.k_hi, tiles.q_hi - tiles.k_lo


def _band_bounds(lo, hi, tiles: TileGrid) -> TileBounds:
    """Exact bounds for ``lo <= q - kv <= hi`` (``None`` = unbounded)."""
    d_min, d_max = _distance_range(tiles)
    t = torch.ones((), dtype=torch.bool, device=tiles.device)
    any_, all_ = t, t
    if lo is not None:
        any_, all_ = any_ & (d_max >= lo), all_ & (d_min >= lo)
    if hi is not None:
        any_, all_ = any_ & (d_min <= hi), all_ & (d_max <= hi)
    if lo is not None and hi is not None and lo > hi:
        any_, all_ = ~t, ~t
    return _exact(any_, all_)


def _and_of(parts) -> TileBounds:
    all_lo, all_hi, any_hi = parts[0].all_lo, parts[0].all_hi, parts[0].any_hi
    for p in parts[1:]:
        all_lo, all_hi, any_hi = all_lo & p.all_lo, all_hi & p.all_hi, any_hi & p.any_hi
    # surely some cell: one part surely has some and every other part surely allows everything
    any_lo = all_lo
    for i, p in enumerate(parts):
        others_full = p.any_lo
        for j, o in enumerate(parts):
            if j != i:
                others_full = others_full & o.all_lo
        any_lo = any_lo | others_full
    return TileBounds(any_lo, any_hi, all_lo, all_hi)


def _or_of(parts) -> TileBounds:
    any_lo, any_hi, all_lo = parts[0].any_lo, parts[0].any_hi, parts[0].all_lo
    for p in parts[1:]:
        any_lo, any_hi, all_lo = any_lo | p.any_lo, any_hi | p.any_hi, all_lo | p.all_lo
    # maybe everything: when at most one part can allow anything, the union is that part; when two or
    # more can, they might cover the tile together
    n_possible = sum(p.any_hi.to(torch.int8) for p in parts)
    all_hi = n_possible >= 2
    for p in parts:
        all_hi = all_hi | (p.all_hi & (n_possible == 1) & p.any_hi)
    return TileBounds(any_lo, any_hi, all_lo, all_hi)


def _and_rule(masks, tiles: TileGrid) -> TileBounds:
    """Bounds of and(masks): distance bands are intersected into one exact band, and one or-part is
    distributed (and(A, or(B, C)) = or(and(A, B), and(A, C))) so common compositions such as
    causal & (sinks | window) classify every tile without evaluating cells."""
    masks = list(masks)
    for i, m in enumerate(masks):
        if getattr(m, "combine", None) == "or":
            others = masks[:i] + masks[i + 1:]
            return _or_of([_and_rule(others + [p], tiles) for p in m.parts])
    bands = [m.band for m in masks if getattr(m, "band", None) is not None]
    bounds = [tile_rule_of(m)(tiles) for m in masks if getattr(m, "band", None) is None]
    if bands:
        los = [b[0] for b in bands if b[0] is not None]
        his = [b[1] for b in bands if b[1] is not None]
        bounds.append(_band_bounds(max(los) if los else None, min(his) if his else None, tiles))
    return _and_of(bounds)


# ---------------------------------------------------------------------------------------------------------
# Basic patterns
# ---------------------------------------------------------------------------------------------------------
def full() -> MaskMod:
    """Every key for every query (dense attention)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_idx >= 0) & (kv_idx >= 0)

    def rule(tiles):
        t = torch.ones((), dtype=torch.bool, device=tiles.device)
        return _exact(t, t)

    return _named(mask_mod, "full", rule, band=(None, None))


def causal() -> MaskMod:
    """``kv <= q``."""

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx <= q_idx

    return _named(mask_mod, "causal", lambda tiles: _band_bounds(0, None, tiles), band=(0, None))


def sliding_window(window: int) -> MaskMod:
    """``0 <= q - kv < window``: the query and the ``window - 1`` keys before it."""
    check_int("window", window, 1)

    def mask_mod(b, h, q_idx, kv_idx):
        d = q_idx - kv_idx
        return (d >= 0) & (d < window)

    return _named(mask_mod, f"sliding_window_{window}", lambda tiles: _band_bounds(0, window - 1, tiles),
                  band=(0, window - 1))


def sinks(num_sinks: int) -> MaskMod:
    """``kv < num_sinks``: the first keys (attention sinks / global tokens). Not causal by itself."""
    check_int("num_sinks", num_sinks, 0)

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx < num_sinks) & (q_idx >= 0)

    def rule(tiles):
        return _exact(tiles.k_lo < num_sinks, tiles.k_hi < num_sinks)

    return _named(mask_mod, f"sinks_{num_sinks}", rule, num_sinks=num_sinks)


def dilated(stride: int) -> MaskMod:
    """``(q - kv) % stride == 0``. Not causal by itself."""
    check_int("stride", stride, 1)

    def mask_mod(b, h, q_idx, kv_idx):
        return torch.remainder(q_idx - kv_idx, stride) == 0

    def rule(tiles):
        d_min, d_max = _distance_range(tiles)
        # some multiple of stride lies in [d_min, d_max]  <=>  floor(d_max / stride) * stride >= d_min
        any_ = torch.div(d_max, stride, rounding_mode="floor") * stride >= d_min
        all_ = (d_min == d_max) & (torch.remainder(d_min, stride) == 0) if stride > 1 else any_
        return _exact(any_, all_)

    return _named(mask_mod, f"dilated_{stride}", rule)


def _hash_keep(qb: torch.Tensor, kb: torch.Tensor, seed: int, threshold: int) -> torch.Tensor:
    # A 32-bit integer hash (murmur3 finaliser) of (seed, qb, kb) computed in int64 so it runs on any device
    # and traces under FlexAttention's vmap. Low 32 bits of products are exact under int64 wrap-around.
    # The indices are widened first: FlexAttention's compiled kernels pass int32 indices, and int32 products
    # wrap (and shift right with the sign) differently, which kept other squares than eager evaluation did.
    # (``.to`` rather than ``torch.as_tensor(...)``: the mask compiler's traced indices have ``.to``, and
    # as_tensor cannot see through them)
    qb, kb = (x.to(torch.int64) if hasattr(x, "to") else torch.as_tensor(x, dtype=torch.int64) for x in (qb, kb))
    m = 0xFFFFFFFF
    x = (qb * 0x9E3779B1 + kb * 0x85EBCA77 + (seed * 0xC2B2AE3D & m)) & m
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & m
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & m
    x = x ^ (x >> 16)
    return x < threshold


def block_random(density: float, block: int = 128, seed: int = 0) -> MaskMod:
    """Whole ``block x block`` squares kept at random with probability ``density`` (a fixed hash of
    ``seed`` and the square's coordinates, so the same squares are kept on every device). Not causal."""
    if not isinstance(density, (int, float)) or isinstance(density, bool):
        raise TypeError(f"density must be a float, got {type(density).__name__}")
    if not 0.0 <= float(density) <= 1.0:
        raise ValueError(f"density must be in [0, 1], got {density}")
    check_int("block", block, 1)
    check_int("seed", seed, 0)
    threshold = int(round(float(density) * 2**32))

    def mask_mod(b, h, q_idx, kv_idx):
        return _hash_keep(torch.div(q_idx, block, rounding_mode="floor"),
                          torch.div(kv_idx, block, rounding_mode="floor"), seed, threshold)

    def rule(tiles):
        qb_lo, qb_hi = tiles.q_lo // block, tiles.q_hi // block
        kb_lo, kb_hi = tiles.k_lo // block, tiles.k_hi // block
        single = (qb_lo == qb_hi) & (kb_lo == kb_hi)  # the tile lies inside one square: exact
        keep = _hash_keep(qb_lo, kb_lo, seed, threshold)
        return TileBounds(keep & single, keep | ~single, keep & single, keep | ~single)

    return _named(mask_mod, f"block_random_{density:g}_{block}_s{seed}", rule)


def document(doc_ids: torch.Tensor) -> MaskMod:
    """Attend only within the same document. ``doc_ids`` is ``[L]`` (shared by the batch) or ``[B, L]``
    integer ids indexed by absolute position; ids need not be sorted (sorted ids classify tiles exactly
    without cell evaluation, unsorted ones fall back to evaluating the ambiguous tiles). Not causal."""
    if not isinstance(doc_ids, torch.Tensor):
        raise TypeError(f"doc_ids must be a torch.Tensor, got {type(doc_ids).__name__}")
    if doc_ids.dim() not in (1, 2):
        raise ValueError(f"doc_ids must have shape [L] or [B, L], got {tuple(doc_ids.shape)}")
    if doc_ids.dtype.is_floating_point or doc_ids.dtype == torch.bool or doc_ids.is_complex():
        raise TypeError(f"doc_ids must be an integer tensor, got {doc_ids.dtype}")
    if doc_ids.shape[-1] < 1:
        raise ValueError("doc_ids must cover at least one position")
    ids2d = doc_ids.view(1, -1) if doc_ids.dim() == 1 else doc_ids
    batched = doc_ids.dim() == 2

    # the ids on the device of the last call, copied on first use there: a copy made inside a traced mask_mod
    # (compiled FlexAttention) would be a new buffer in the mask's pointwise graph, which Inductor refuses to lower
    held = [ids2d]

    def mask_mod(b, h, q_idx, kv_idx):
        ids = held[0]
        if ids.device != q_idx.device:
            ids = held[0] = ids2d.to(q_idx.device)
        if batched:
            return ids[b, q_idx] == ids[b, kv_idx]
        return ids[0][q_idx] == ids[0][kv_idx]

    def rule(tiles):
        ids = ids2d.to(tiles.device).long()
        L = ids.shape[1]
        if tiles.q_start + tiles.q_len > L or tiles.kv_len > L:
            raise ValueError(f"doc_ids covers {L} positions but the layout needs "
                             f"{max(tiles.q_start + tiles.q_len, tiles.kv_len)}")

        def block_min_max(start, length, block):
            n = -(-length // block)
            seg = ids[:, start:start + length]
            # pad the ragged last block by repeating the last real id (padding must not change min/max)
            seg = torch.cat([seg, seg[:, -1:].expand(-1, n * block - length)], dim=1).view(-1, n, block)
            return seg.amin(-1), seg.amax(-1)  # [Bd, n]

        q_min, q_max = block_min_max(tiles.q_start, tiles.q_len, tiles.block_q)
        k_min, k_max = block_min_max(0, tiles.kv_len, tiles.block_k)
        q_min, q_max = q_min[:, None, :, None], q_max[:, None, :, None]
        k_min, k_max = k_min[:, None, None, :], k_max[:, None, None, :]
        overlap = (q_min <= k_max) & (k_min <= q_max)
        single = (q_min == q_max) & (k_min == k_max) & (q_min == k_min)
        if batched and ids.shape[0] != tiles.B:
            raise ValueError(f"doc_ids has batch {ids.shape[0]} but the layout has B={tiles.B}")
        # With ids non-decreasing along each sequence, overlapping id ranges share an id present in both
        # tiles, so overlap is exact; otherwise it is only an upper bound.
        is_sorted = (ids[:, 1:] >= ids[:, :-1]).all(dim=1).view(-1, 1, 1, 1)
        return TileBounds(overlap & is_sorted, overlap, single, single)

    return _named(mask_mod, "document", rule, doc_ids=doc_ids)


def prefix_lm(prefix: int) -> MaskMod:
    """``kv < prefix or kv <= q``: bidirectional over a prefix, causal after it."""
    check_int("prefix", prefix, 0)
    inner = or_masks(sinks(prefix), causal())
    return _named(lambda b, h, q, kv: inner(b, h, q, kv), f"prefix_lm_{prefix}", inner.tile_rule,
                  parts=inner.parts, combine="or")


# ---------------------------------------------------------------------------------------------------------
# Combinators
# ---------------------------------------------------------------------------------------------------------
def _check_mask_mods(masks):
    if not masks:
        raise ValueError("at least one mask_mod is required")
    for i, m in enumerate(masks):
        if not callable(m):
            raise TypeError(f"mask_mod #{i} is not callable: {type(m).__name__}")


def and_masks(*masks: MaskMod) -> MaskMod:
    """Allowed where every mask allows."""
    _check_mask_mods(masks)

    def mask_mod(b, h, q_idx, kv_idx):
        out = masks[0](b, h, q_idx, kv_idx)
        for m in masks[1:]:
            out = out & m(b, h, q_idx, kv_idx)
        return out

    def rule(tiles):
        return _and_rule(masks, tiles)

    name = "and(" + ", ".join(m.__name__ for m in masks) + ")"
    return _named(mask_mod, name, rule, parts=masks, combine="and")


def or_masks(*masks: MaskMod) -> MaskMod:
    """Allowed where any mask allows."""
    _check_mask_mods(masks)

    def mask_mod(b, h, q_idx, kv_idx):
        out = masks[0](b, h, q_idx, kv_idx)
        for m in masks[1:]:
            out = out | m(b, h, q_idx, kv_idx)
        return out

    def rule(tiles):
        return _or_of([tile_rule_of(m)(tiles) for m in masks])

    name = "or(" + ", ".join(m.__name__ for m in masks) + ")"
    return _named(mask_mod, name, rule, parts=masks, combine="or")


def not_mask(mask: MaskMod) -> MaskMod:
    """Allowed where ``mask`` is not."""
    _check_mask_mods((mask,))

    def mask_mod(b, h, q_idx, kv_idx):
        return ~mask(b, h, q_idx, kv_idx)

    def rule(tiles):
        p = tile_rule_of(mask)(tiles)
        return TileBounds(~p.all_hi, ~p.all_lo, ~p.any_hi, ~p.any_lo)

    return _named(mask_mod, f"not({mask.__name__})", rule, parts=(mask,), combine="not")


# ---------------------------------------------------------------------------------------------------------
# Named compositions and the catalogue
# ---------------------------------------------------------------------------------------------------------
def sinks_window(num_sinks: int, window: int) -> MaskMod:
    """``causal and (sinks(num_sinks) or sliding_window(window))``: a causal window plus the first
    ``num_sinks`` keys for every query (StreamingLLM's attention sinks)."""
    check_int("num_sinks", num_sinks, 0)
    check_int("window", window, 1)
    inner = and_masks(causal(), or_masks(sinks(num_sinks), sliding_window(window)))
    return _named(lambda b, h, q, kv: inner(b, h, q, kv), f"sinks_window_{num_sinks}_{window}", inner.tile_rule,
                  parts=inner.parts, combine="and")


#: Every pattern generator under its one canonical name (what the book's gallery and the tests iterate).
CATALOGUE = {
    "full": full,
    "causal": causal,
    "sliding_window": sliding_window,
    "sinks": sinks,
    "sinks_window": sinks_window,
    "dilated": dilated,
    "block_random": block_random,
    "document": document,
    "prefix_lm": prefix_lm,
}
