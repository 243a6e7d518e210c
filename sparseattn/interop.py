"""Converters between :class:`~sparseattn.layout.BlockLayout` and other block-sparse formats: FlexAttention's
``BlockMask`` (both ways) and FlashInfer's BSR arrays. ``BlockLayout.from_flex`` / ``.to_flex`` / ``.to_bsr``
are thin methods over these functions; this module sits below ``layout`` and never imports it (a layout is
passed in, its ingredients are handed back)."""
from __future__ import annotations

from typing import Optional

import torch

from . import _tiles as T
from ._checks import check_int
from .patterns import TileGrid


def flex_block_mask_class():
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError as e:  # torch without FlexAttention
        raise RuntimeError(f"this torch ({torch.__version__}) has no FlexAttention BlockMask") from e
    return BlockMask


def from_flex(block_mask) -> dict:
    """The ingredients of a layout from a FlexAttention ``BlockMask``: block-level ``partial``/``full`` masks,
    lengths, tile sizes, the mask_mod and ``q_offset = 0``. Its full tiles stay full; its partial tiles are
    re-classified with its own mask_mod at Flex's local query indices (so it means what it means in Flex)."""
    BlockMask = flex_block_mask_class()
    if not isinstance(block_mask, BlockMask):
        raise TypeError(f"block_mask must be a FlexAttention BlockMask, got {type(block_mask).__name__}")
    q_len, kv_len = block_mask.seq_lengths
    block_q, block_k = block_mask.BLOCK_SIZE
    if any(b < 16 or b & (b - 1) for b in (block_q, block_k)):
        raise ValueError(f"block_mask.BLOCK_SIZE must be powers of two >= 16 to become a layout's tiles, got "
                         f"{(block_q, block_k)}; build the BlockMask with e.g. BLOCK_SIZE=128")
    nq, nk = T.cdiv(q_len, block_q), T.cdiv(kv_len, block_k)
    listed_partial = T.lists_to_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, nk)[..., :nq, :]
    if block_mask.full_kv_num_blocks is not None:
        listed_full = T.lists_to_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)[..., :nq, :]
    else:
        listed_full = torch.zeros_like(listed_partial)
    mask_mod = block_mask.mask_mod
    B, H = listed_partial.shape[:2]
    grid = TileGrid(0, q_len, kv_len, block_q, block_k, B, H, listed_partial.device)
    partial, full_from_partial = T.classify(mask_mod, grid, listed=listed_partial & ~listed_full)
    return dict(partial=partial, full=listed_full | full_from_partial, q_len=q_len, kv_len=kv_len,
                block_q=block_q, block_k=block_k, mask_mod=mask_mod, q_offset=0)


def to_bsr(layout) -> dict:
    """Block-sparse rows as FlashInfer's BSR wrapper takes them, one matrix per ``(b, h)``:
    ``indptr [B, H, nq + 1]`` and ``indices [B, H, nnz_max]`` (full and partial tiles merged, ascending),
    ``is_full`` flags aligned with ``indices``, and the block size ``(R, C)``."""
    partial, full = layout.block_classes()
    listed = partial | full
    count, indices = T.rows_to_lists(listed)
    flags = torch.gather(full, -1, indices.long()) & (
        torch.arange(indices.shape[-1], device=layout.device) < count[..., None])
    indptr = torch.zeros(layout.B, layout.H, layout.nq + 1, dtype=T.INDEX_DTYPE, device=layout.device)
    indptr[..., 1:] = torch.cumsum(count, -1)
    # flatten each (b, h) row-list into the CSR column array
    slot_valid = torch.arange(indices.shape[-1], device=layout.device) < count[..., None]
    nnz_max = int(indptr[..., -1].max())
    csr = torch.zeros(layout.B, layout.H, max(nnz_max, 1), dtype=T.INDEX_DTYPE, device=layout.device)
    csr_full = torch.zeros(layout.B, layout.H, max(nnz_max, 1), dtype=torch.bool, device=layout.device)
    b, h, r, s = slot_valid.nonzero(as_tuple=True)
    pos = indptr[b, h, r].long() + s
    csr[b, h, pos] = indices[b, h, r, s]
    csr_full[b, h, pos] = flags[b, h, r, s]
    return {"indptr": indptr, "indices": csr, "is_full": csr_full, "R": layout.block_q, "C": layout.block_k,
            "nnz": indptr[..., -1]}


def to_flex(layout, num_heads: Optional[int] = None):
    """FlexAttention ``BlockMask`` with the same tiles. Flex indexes queries locally, so the mask_mod it
    gets adds ``q_offset``. ``num_heads`` expands a GQA layout (``H`` = KV heads) to the query heads."""
    BlockMask = flex_block_mask_class()
    kv_count, kv_index, full_count, full_index = layout.kv_count, layout.kv_index, layout.full_count, layout.full_index
    group = 1
    if num_heads is not None and num_heads != layout.H and layout.H != 1:
        check_int("num_heads", num_heads)
        if num_heads % layout.H:
            raise ValueError(f"num_heads={num_heads} is not a multiple of the layout's H={layout.H}")
        group = num_heads // layout.H
        kv_count, kv_index, full_count, full_index = (
            t.repeat_interleave(group, dim=1) for t in (kv_count, kv_index, full_count, full_index))
    nk = layout.nk

    def widen(index):  # Flex's transposition wants the index width to be nk
        pad = nk - index.shape[-1]
        return torch.nn.functional.pad(index, (0, pad)) if pad > 0 else index[..., :nk]

    offset = layout.q_offset
    # Flex passes the batch and query-head index; ours expects the layout's own (0 when broadcast)
    b_scale, h_scale = (0 if layout.B == 1 else 1), (0 if layout.H == 1 else 1)
    if layout.mask_mod is not None:
        ours = layout.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return ours(b * b_scale, (h // group) * h_scale, q_idx + offset, kv_idx)

        mask_mod.__name__ = getattr(ours, "__name__", "mask_mod")
    elif layout.tile_bits is not None:
        # per tile: its slot in kv_index (partial: read the bits), FULL (every cell allowed) or EMPTY. Flex's
        # eager path evaluates the mask_mod on every cell, full tiles included, so they must say True there
        FULL, EMPTY = -1, -2
        slot_of = torch.full((layout.B, layout.H, layout.nq, nk), EMPTY, dtype=torch.int64, device=layout.device)
        b, h, qi, slot = layout.partial_tiles()
        slot_of[b, h, qi, layout.kv_index[b, h, qi, slot].long()] = slot
        _, full = layout.block_classes()
        slot_of[full] = FULL
        bits, bq, bk, one_b, one_h = layout.tile_bits, layout.block_q, layout.block_k, layout.B == 1, layout.H == 1

        def mask_mod(b, h, q_idx, kv_idx):
            bb = torch.zeros_like(b) if one_b else b
            hh = torch.zeros_like(h) if one_h else h // group
            qi, ki = q_idx // bq, kv_idx // bk
            s = slot_of[bb, hh, qi, ki]
            byte = bits[bb, hh, qi, s.clamp(min=0), q_idx % bq, (kv_idx % bk) // 8]
            return (s == FULL) | ((s >= 0) & (((byte >> (kv_idx % 8).to(torch.uint8)) & 1) == 1))

        mask_mod.__name__ = "tile_bits"
    else:
        mask_mod = None
    if layout.row_slot is not None:
        mask_mod = _with_member_bits(layout, mask_mod, group)
    if mask_mod is not None:
        # one eager call on the layout's device before Flex traces it: a mask_mod that keeps per-device copies
        # of its captured tensors (``patterns.document``) makes them now, outside the compiled graph
        z = torch.zeros((), dtype=torch.int32, device=layout.device)
        try:
            mask_mod(z, z, z, z)
        except Exception:  # noqa: BLE001 - a warm-up only: Flex's own evaluation reports a mask_mod's errors
            pass
    return BlockMask.from_kv_blocks(kv_count, widen(kv_index), full_count, widen(full_index),
                                    BLOCK_SIZE=(layout.block_q, layout.block_k), mask_mod=mask_mod,
                                    seq_lengths=(layout.q_len, layout.kv_len))


def _with_member_bits(layout, inner, group: int):
    """``inner`` (a Flex mask_mod of the layout, local query indices) AND'ed with a routed layout's member
    bits: query row ``q`` uses the tile at slot ``s`` of its row only where ``row_slot[.., q, s]`` is set."""
    nk, bq, bk = layout.nk, layout.block_q, layout.block_k
    slot_of = torch.full((layout.B, layout.H, layout.nq, nk), -1, dtype=torch.int64, device=layout.device)
    b, h, qi, slot = layout.partial_tiles()
    slot_of[b, h, qi, layout.kv_index[b, h, qi, slot].long()] = slot
    rows, one_b, one_h, last = layout.row_slot, layout.B == 1, layout.H == 1, layout.q_len - 1

    def mask_mod(b, h, q_idx, kv_idx):
        bb = torch.zeros_like(b) if one_b else b
        hh = torch.zeros_like(h) if one_h else h // group
        s = slot_of[bb, hh, q_idx // bq, kv_idx // bk]
        chose = rows[bb, hh, q_idx.clamp(max=last), s.clamp(min=0)] != 0
        return inner(b, h, q_idx, kv_idx) & (s >= 0) & chose

    mask_mod.__name__ = f"{getattr(inner, '__name__', 'mask_mod')}&member_bits"
    return mask_mod
