"""BlockLayout: the device block table that sparse kernels walk.

A layout cuts the ``Lq x Lk`` attention matrix into ``block_q x block_k`` tiles and lists, for every query
tile (a *row*), the key tiles it must visit, in two groups:

* ``full_index``: tiles where every in-range cell is allowed; a kernel runs them without mask work;
* ``kv_index``: *partial* tiles; a kernel applies a token mask inside them.

Empty tiles are never listed, a tile is listed at most once per row, indices in a row ascend. The transposed
lists (for every key tile, the query tiles that visit it) drive the backward pass's dK/dV kernels; they are
built on the device by a stable sort of the ``(column, row)`` pairs, in O(nnz).

Memory never grows with ``Lq x Lk``: tiles are classified from a pattern's tile rule where it has one, and
every undecided tile is evaluated cell by cell in chunks of tiles. Only ``to_dense`` materialises cells.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from ._checks import check_block, check_int
from .patterns import TileGrid, tile_rule_of

__all__ = ["BlockLayout", "TransposedLists"]

_INDEX_DTYPE = torch.int32


class TransposedLists(NamedTuple):
    """For every key tile, the query tiles that visit it (ascending): ``[B, H, nk]`` and ``[B, H, nk, W']``."""

    q_count: torch.Tensor
    q_index: torch.Tensor
    full_q_count: torch.Tensor
    full_q_index: torch.Tensor
    q_slot: torch.Tensor  # for each partial entry, its slot in the forward row (where its tile bits live)


# ---------------------------------------------------------------------------------------------------------
# small helpers
# ---------------------------------------------------------------------------------------------------------
def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _default_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def _cells_per_chunk(device: torch.device) -> int:
    # int64 index intermediates are 8 bytes a cell: 64M cells ~ 0.5 GB on a GPU, 16M ~ 128 MB on a CPU
    return 1 << 26 if device.type == "cuda" else 1 << 24


def _rows_to_lists(blocks: torch.Tensor, width: Optional[int] = None):
    """Block-level bool ``[..., n]`` -> (count ``[...]``, ascending index ``[..., W]``), padded with 0.

    One pass, no sort: each allowed column goes to slot ``cumsum - 1``; the rest land in a spill slot ``W``
    that is cut off afterwards.
    """
    n = blocks.shape[-1]
    count = blocks.sum(-1, dtype=torch.int32)
    if width is None:
        width = int(count.max()) if count.numel() else 0
    width = max(width, 1)
    slot = torch.cumsum(blocks, -1, dtype=torch.int64) - 1
    slot = torch.where(blocks, slot, torch.full_like(slot, width))
    index = torch.zeros(*blocks.shape[:-1], width + 1, dtype=torch.int64, device=blocks.device)
    cols = torch.arange(n, device=blocks.device, dtype=torch.int64).expand_as(slot)
    index.scatter_(-1, slot, torch.where(blocks, cols, torch.zeros_like(cols)))
    return count, index[..., :width].to(_INDEX_DTYPE).contiguous()


def _transpose_lists(count: torch.Tensor, index: torch.Tensor, n_cols: int, width: Optional[int] = None):
    """Transpose row lists ``count [B,H,nr], index [B,H,nr,W]`` into column lists over ``n_cols`` columns.

    O(nnz) on the device: every entry becomes a key ``(bh, column)``; a stable sort by that key keeps rows
    ascending inside each column (entries are generated in row order); the position of an entry within its
    column is its rank in the sorted order minus the column's start offset (an exclusive cumsum of counts).
    """
    B, H, n_rows, W = index.shape
    device = index.device
    BH = B * H
    valid = torch.arange(W, device=device).view(1, 1, 1, W) < count.unsqueeze(-1)  # [B, H, nr, W]
    bh = torch.arange(BH, device=device, dtype=torch.int64).view(B, H, 1, 1)
    n_keys = BH * n_cols
    key = torch.where(valid, bh * n_cols + index.long(), torch.full_like(bh, n_keys)).flatten()  # [B*H*nr*W]
    rows = torch.arange(n_rows, device=device, dtype=torch.int64).view(1, 1, n_rows, 1).expand(B, H, n_rows, W)
    key_sorted, order = torch.sort(key, stable=True)
    rows_sorted = rows.flatten()[order]
    slots_sorted = order % W  # entries were generated as (bh, row, slot) with slot fastest
    col_count = torch.bincount(key, minlength=n_keys + 1)[:n_keys]  # [BH * n_cols]
    start = torch.cumsum(col_count, 0) - col_count
    if width is None:
        width = int(col_count.max()) if col_count.numel() else 0
    width = max(width, 1)
    in_range = key_sorted < n_keys
    safe_key = torch.where(in_range, key_sorted, torch.zeros_like(key_sorted))
    pos = torch.arange(key_sorted.numel(), device=device) - start[safe_key]
    out = torch.zeros(n_keys * width + 1, dtype=torch.int64, device=device)  # last element is a spill slot
    dest = torch.where(in_range, safe_key * width + pos, torch.full_like(pos, n_keys * width))
    out.scatter_(0, dest, rows_sorted)
    q_index = out[:-1].view(B, H, n_cols, width).to(_INDEX_DTYPE)
    slot_out = torch.zeros_like(out)
    slot_out.scatter_(0, dest, slots_sorted)
    q_slot = slot_out[:-1].view(B, H, n_cols, width).to(_INDEX_DTYPE)
    return col_count.view(B, H, n_cols).to(_INDEX_DTYPE), q_index, q_slot


def _pack_bits(cells: torch.Tensor) -> torch.Tensor:
    """bool ``[..., bk]`` -> uint8 ``[..., bk // 8]``, bit j of byte i is cell ``8 i + j``."""
    weights = (1 << torch.arange(8, device=cells.device, dtype=torch.int32)).to(torch.uint8)
    c = cells.view(*cells.shape[:-1], cells.shape[-1] // 8, 8).to(torch.uint8)
    return (c * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(bits: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    cells = (bits.unsqueeze(-1) >> shifts) & 1
    return cells.view(*bits.shape[:-1], bits.shape[-1] * 8).bool()


class BlockLayout:
    """The block table of a sparse attention pattern, on one device.

    Fields (int32, on ``device``): ``kv_count [B,H,nq]``, ``kv_index [B,H,nq,W]`` (partial tiles),
    ``full_count``, ``full_index`` (full tiles), and the transposed lists ``q_count/q_index`` and
    ``full_q_count/full_q_index`` ``[B,H,nk,W']`` built on first use. ``B`` is 1 (shared by the batch) or
    the batch; ``H`` is 1, the number of KV heads (shared by a GQA group; the mask_mod's ``h`` is then the KV
    head) or the number of query heads.

    Partial tiles are made exact by ``mask_mod`` (evaluated at absolute positions) or by ``tile_bits``
    (uint8 ``[B,H,nq,W,block_q,block_k//8]``, aligned with ``kv_index``'s slots); at least one is needed
    when any tile is partial.

    When ``q_len < kv_len`` the queries are the last ``q_len`` positions: query row ``i`` is absolute
    position ``i + q_offset`` with ``q_offset = kv_len - q_len`` (0 otherwise).

    The constructor takes explicit lists and validates them; the ``from_*`` classmethods build them.
    """

    __slots__ = ("q_len", "kv_len", "block_q", "block_k", "kv_count", "kv_index", "full_count", "full_index",
                 "mask_mod", "tile_bits", "_plans")

    def __init__(self, kv_count, kv_index, full_count, full_index, *, q_len: int, kv_len: int,
                 block_q: int = 128, block_k: int = 128, mask_mod=None, tile_bits=None, validate: bool = True):
        self.q_len = check_int("q_len", q_len)
        self.kv_len = check_int("kv_len", kv_len)
        self.block_q = check_block("block_q", block_q)
        self.block_k = check_block("block_k", block_k)
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        self.kv_count, self.kv_index = kv_count, kv_index
        self.full_count, self.full_index = full_count, full_index
        self.mask_mod = mask_mod
        self.tile_bits = tile_bits
        # derived data (transposed lists, launch plans), built on first use and cached here only: the layout's
        # own fields never change after construction and stats() never sees this
        self._plans: dict = {}
        if validate:
            self.validate()

    # ---- shape facts ------------------------------------------------------------------------------------
    @property
    def q_offset(self) -> int:
        return max(self.kv_len - self.q_len, 0)

    @property
    def nq(self) -> int:
        return _cdiv(self.q_len, self.block_q)

    @property
    def nk(self) -> int:
        return _cdiv(self.kv_len, self.block_k)

    @property
    def B(self) -> int:
        return self.kv_count.shape[0]

    @property
    def H(self) -> int:
        return self.kv_count.shape[1]

    @property
    def device(self) -> torch.device:
        return self.kv_count.device

    @property
    def width(self) -> int:
        return self.kv_index.shape[-1]

    @property
    def full_width(self) -> int:
        return self.full_index.shape[-1]

    def __repr__(self) -> str:
        name = getattr(self.mask_mod, "__name__", None) if self.mask_mod is not None else (
            "tile_bits" if self.tile_bits is not None else "block-level")
        return (f"BlockLayout(B={self.B}, H={self.H}, q_len={self.q_len}, kv_len={self.kv_len}, "
                f"block=({self.block_q}, {self.block_k}), grid={self.nq}x{self.nk}, widths=(partial {self.width}, "
                f"full {self.full_width}), mask={name}, device={self.device})")

    # ---- constructors -----------------------------------------------------------------------------------
    @classmethod
    def _from_block_classes(cls, partial: torch.Tensor, full: torch.Tensor, *, q_len, kv_len, block_q, block_k,
                            mask_mod=None, tile_bits=None) -> "BlockLayout":
        """Lists from block-level class masks ``[B,H,nq,nk]`` (disjoint); correct by construction."""
        kv_count, kv_index = _rows_to_lists(partial)
        full_count, full_index = _rows_to_lists(full)
        return cls(kv_count, kv_index, full_count, full_index, q_len=q_len, kv_len=kv_len, block_q=block_q,
                   block_k=block_k, mask_mod=mask_mod, tile_bits=tile_bits, validate=False)

    @staticmethod
    def _check_dims(B, H):
        check_int("B", B)
        check_int("H", H)

    @classmethod
    def from_mask_mod(cls, mask_mod, q_len: int, kv_len: int, block_q: int = 128, block_k: int = 128,
                      B: int = 1, H: int = 1, device=None) -> "BlockLayout":
        """Classify every tile of ``mask_mod`` as empty / partial / full and list the non-empty ones.

        The pattern's tile rule decides what it can; the undecided tiles are evaluated cell by cell in
        chunks, so memory stays proportional to the number of tiles, never to ``q_len * kv_len``.
        """
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        check_int("q_len", q_len)
        check_int("kv_len", kv_len)
        check_block("block_q", block_q)
        check_block("block_k", block_k)
        cls._check_dims(B, H)
        device = _default_device(device)
        grid = TileGrid(max(kv_len - q_len, 0), q_len, kv_len, block_q, block_k, B, H, device)
        partial, full = _classify(mask_mod, grid, listed=None)
        return cls._from_block_classes(partial, full, q_len=q_len, kv_len=kv_len, block_q=block_q,
                                       block_k=block_k, mask_mod=mask_mod)

    @classmethod
    def from_block_mask(cls, block_mask: torch.Tensor, q_len: int, kv_len: int, block_q: int = 128,
                        block_k: int = 128, mask_mod=None) -> "BlockLayout":
        """Layout from a block-level bool ``[B, H, nq, nk]``. Without ``mask_mod`` every listed tile is full;
        with it, listed tiles are intersected with the mask_mod, reclassified, and dropped if empty."""
        check_int("q_len", q_len)
        check_int("kv_len", kv_len)
        check_block("block_q", block_q)
        check_block("block_k", block_k)
        if not isinstance(block_mask, torch.Tensor):
            raise TypeError(f"block_mask must be a torch.Tensor, got {type(block_mask).__name__}")
        if block_mask.dtype != torch.bool:
            raise TypeError(f"block_mask must be a bool tensor, got {block_mask.dtype}")
        nq, nk = _cdiv(q_len, block_q), _cdiv(kv_len, block_k)
        if block_mask.dim() != 4 or tuple(block_mask.shape[2:]) != (nq, nk):
            raise ValueError(f"block_mask must have shape [B, H, {nq}, {nk}] for q_len={q_len}, kv_len={kv_len}, "
                             f"blocks ({block_q}, {block_k}); got {tuple(block_mask.shape)}")
        B, H = block_mask.shape[:2]
        cls._check_dims(B, H)
        if mask_mod is None:
            return cls._from_block_classes(torch.zeros_like(block_mask), block_mask.contiguous(), q_len=q_len,
                                           kv_len=kv_len, block_q=block_q, block_k=block_k)
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        grid = TileGrid(max(kv_len - q_len, 0), q_len, kv_len, block_q, block_k, B, H, block_mask.device)
        partial, full = _classify(mask_mod, grid, listed=block_mask)
        return cls._from_block_classes(partial, full, q_len=q_len, kv_len=kv_len, block_q=block_q,
                                       block_k=block_k, mask_mod=mask_mod)

    @classmethod
    def from_dense(cls, mask: torch.Tensor, block_q: int = 128, block_k: int = 128) -> "BlockLayout":
        """Layout from a token-level bool ``[B, H, Lq, Lk]`` (query rows in local order). Partial tiles keep
        their cells as ``tile_bits``, so any mask round-trips exactly."""
        if not isinstance(mask, torch.Tensor):
            raise TypeError(f"mask must be a torch.Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {mask.dtype}")
        if mask.dim() != 4:
            raise ValueError(f"mask must have shape [B, H, Lq, Lk], got {tuple(mask.shape)}")
        check_block("block_q", block_q)
        check_block("block_k", block_k)
        B, H, Lq, Lk = mask.shape
        cls._check_dims(B, H)
        check_int("Lq (mask.shape[2])", Lq)
        check_int("Lk (mask.shape[3])", Lk)
        nq, nk = _cdiv(Lq, block_q), _cdiv(Lk, block_k)
        padded = torch.nn.functional.pad(mask, (0, nk * block_k - Lk, 0, nq * block_q - Lq))
        valid = torch.zeros(nq * block_q, nk * block_k, dtype=torch.bool, device=mask.device)
        valid[:Lq, :Lk] = True
        tiles = padded.view(B, H, nq, block_q, nk, block_k)
        valid_t = valid.view(1, 1, nq, block_q, nk, block_k)
        any_ = tiles.any(dim=(3, 5))
        all_ = (tiles | ~valid_t).all(dim=(3, 5))
        partial, full = any_ & ~all_, all_
        layout = cls._from_block_classes(partial, full, q_len=Lq, kv_len=Lk, block_q=block_q, block_k=block_k)
        # cells of the partial tiles, in kv_index slot order: [B, H, nq, W, bq, bk] -> packed bits
        by_tile = tiles.permute(0, 1, 2, 4, 3, 5)  # [B, H, nq, nk, bq, bk]
        idx = layout.kv_index.long()[..., None, None].expand(-1, -1, -1, -1, block_q, block_k)
        cells = torch.gather(by_tile, 3, idx)
        slot_valid = torch.arange(layout.width, device=mask.device).view(1, 1, 1, -1) < layout.kv_count[..., None]
        cells = cells & slot_valid[..., None, None]
        layout.tile_bits = _pack_bits(cells).contiguous()
        return layout

    @classmethod
    def from_flex(cls, block_mask) -> "BlockLayout":
        """Layout from a FlexAttention ``BlockMask``. Its full tiles stay full; its partial tiles are
        re-classified with its mask_mod (Flex's queries are local; the mask_mod is shifted accordingly)."""
        BlockMask = _flex_block_mask_class()
        if not isinstance(block_mask, BlockMask):
            raise TypeError(f"block_mask must be a FlexAttention BlockMask, got {type(block_mask).__name__}")
        q_len, kv_len = block_mask.seq_lengths
        block_q, block_k = block_mask.BLOCK_SIZE
        nq, nk = _cdiv(q_len, block_q), _cdiv(kv_len, block_k)
        listed_partial = _lists_to_blocks(block_mask.kv_num_blocks, block_mask.kv_indices, nk)[..., :nq, :]
        if block_mask.full_kv_num_blocks is not None:
            listed_full = _lists_to_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices, nk)[..., :nq, :]
        else:
            listed_full = torch.zeros_like(listed_partial)
        offset = max(kv_len - q_len, 0)
        flex_mm = block_mask.mask_mod

        def mask_mod(b, h, q_idx, kv_idx):
            return flex_mm(b, h, q_idx - offset, kv_idx)

        mask_mod.__name__ = getattr(flex_mm, "__name__", "flex_mask_mod")
        B, H = listed_partial.shape[:2]
        grid = TileGrid(offset, q_len, kv_len, block_q, block_k, B, H, listed_partial.device)
        partial, full_from_partial = _classify(mask_mod, grid, listed=listed_partial & ~listed_full)
        return cls._from_block_classes(partial, listed_full | full_from_partial, q_len=q_len, kv_len=kv_len,
                                       block_q=block_q, block_k=block_k, mask_mod=mask_mod)

    # ---- conversions --------------------------------------------------------------------------------------
    def to(self, device) -> "BlockLayout":
        """A copy of the layout on ``device`` (the mask_mod is shared)."""
        device = torch.device(device)
        moved = BlockLayout(self.kv_count.to(device), self.kv_index.to(device), self.full_count.to(device),
                            self.full_index.to(device), q_len=self.q_len, kv_len=self.kv_len,
                            block_q=self.block_q, block_k=self.block_k, mask_mod=self.mask_mod,
                            tile_bits=None if self.tile_bits is None else self.tile_bits.to(device),
                            validate=False)
        if "transposed" in self._plans:
            moved._plans["transposed"] = TransposedLists(*(t.to(device) for t in self._plans["transposed"]))
        return moved

    def block_classes(self):
        """Block-level ``(partial, full)`` bool ``[B, H, nq, nk]``."""
        return (_lists_to_blocks(self.kv_count, self.kv_index, self.nk),
                _lists_to_blocks(self.full_count, self.full_index, self.nk))

    def partial_cells(self, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Token mask of the listed partial tiles ``(b, h, qi, slot)`` (1-D index tensors, ``slot`` a position
        in ``kv_index``'s row): bool ``[t, block_q, block_k]``, False outside ``q_len``/``kv_len``."""
        ki = self.kv_index[b, h, qi, slot].long()
        if self.tile_bits is not None:
            cells = _unpack_bits(self.tile_bits[b, h, qi, slot])
            return cells & _tile_valid(qi, ki, self.block_q, self.block_k, self.q_len, self.kv_len)
        if self.mask_mod is None:
            raise ValueError("this layout has partial tiles but neither mask_mod nor tile_bits")
        return _eval_tiles(self.mask_mod, b, h, qi, ki, self.q_offset, self.q_len, self.kv_len,
                           self.block_q, self.block_k)

    def _partial_tiles(self):
        """All listed partial tiles as index tensors ``(b, h, qi, slot)``."""
        slot_valid = torch.arange(self.width, device=self.device).view(1, 1, 1, -1) < self.kv_count[..., None]
        return slot_valid.nonzero(as_tuple=True)

    def _for_partial_chunks(self):
        b, h, qi, slot = self._partial_tiles()
        step = max(1, _cells_per_chunk(self.device) // (self.block_q * self.block_k))
        for s in range(0, b.numel(), step):
            sl = slice(s, s + step)
            yield b[sl], h[sl], qi[sl], slot[sl], self.partial_cells(b[sl], h[sl], qi[sl], slot[sl])

    def to_dense(self) -> torch.Tensor:
        """The exact token mask, bool ``[B, H, q_len, kv_len]`` (query rows in local order)."""
        B, H, nq, nk, bq, bk = self.B, self.H, self.nq, self.nk, self.block_q, self.block_k
        _, full = self.block_classes()
        tiles = full[..., None, None].expand(B, H, nq, nk, bq, bk).contiguous()  # [B, H, nq, nk, bq, bk]
        for b, h, qi, slot, cells in self._for_partial_chunks():
            tiles[b, h, qi, self.kv_index[b, h, qi, slot].long()] = cells
        dense = tiles.permute(0, 1, 2, 4, 3, 5).reshape(B, H, nq * bq, nk * bk)
        return dense[:, :, : self.q_len, : self.kv_len].contiguous()

    def partial_tile_bits(self) -> torch.Tensor:
        """Packed token masks of the partial tiles, uint8 ``[B, H, nq, W, block_q, block_k // 8]`` aligned with
        ``kv_index`` slots: ``tile_bits`` when the layout has them, else computed from the mask_mod once and
        cached as a derived plan (``tile_bits`` itself stays None)."""
        if self.tile_bits is not None:
            return self.tile_bits

        def build():
            bits = torch.zeros(self.B, self.H, self.nq, self.width, self.block_q, self.block_k // 8,
                               dtype=torch.uint8, device=self.device)
            for b, h, qi, slot, cells in self._for_partial_chunks():
                bits[b, h, qi, slot] = _pack_bits(cells)
            return bits
        return self.plan("tile_bits", build)

    def to_bsr(self) -> dict:
        """Block-sparse rows as FlashInfer's BSR wrapper takes them, one matrix per ``(b, h)``:
        ``indptr [B, H, nq + 1]`` and ``indices [B, H, nnz_max]`` (full and partial tiles merged, ascending),
        ``is_full`` flags aligned with ``indices``, and the block size ``(R, C)``."""
        partial, full = self.block_classes()
        listed = partial | full
        count, indices = _rows_to_lists(listed)
        flags = torch.gather(full, -1, indices.long()) & (
            torch.arange(indices.shape[-1], device=self.device) < count[..., None])
        indptr = torch.zeros(self.B, self.H, self.nq + 1, dtype=_INDEX_DTYPE, device=self.device)
        indptr[..., 1:] = torch.cumsum(count, -1)
        # flatten each (b, h) row-list into the CSR column array
        slot_valid = torch.arange(indices.shape[-1], device=self.device) < count[..., None]
        nnz_max = int(indptr[..., -1].max())
        csr = torch.zeros(self.B, self.H, max(nnz_max, 1), dtype=_INDEX_DTYPE, device=self.device)
        csr_full = torch.zeros(self.B, self.H, max(nnz_max, 1), dtype=torch.bool, device=self.device)
        b, h, r, s = slot_valid.nonzero(as_tuple=True)
        pos = indptr[b, h, r].long() + s
        csr[b, h, pos] = indices[b, h, r, s]
        csr_full[b, h, pos] = flags[b, h, r, s]
        return {"indptr": indptr, "indices": csr, "is_full": csr_full, "R": self.block_q, "C": self.block_k,
                "nnz": indptr[..., -1]}

    def to_flex(self, num_heads: Optional[int] = None):
        """FlexAttention ``BlockMask`` with the same tiles. Flex indexes queries locally, so the mask_mod it
        gets adds ``q_offset``. ``num_heads`` expands a GQA layout (``H`` = KV heads) to the query heads."""
        BlockMask = _flex_block_mask_class()
        kv_count, kv_index, full_count, full_index = self.kv_count, self.kv_index, self.full_count, self.full_index
        group = 1
        if num_heads is not None and num_heads != self.H and self.H != 1:
            check_int("num_heads", num_heads)
            if num_heads % self.H:
                raise ValueError(f"num_heads={num_heads} is not a multiple of the layout's H={self.H}")
            group = num_heads // self.H
            kv_count, kv_index, full_count, full_index = (
                t.repeat_interleave(group, dim=1) for t in (kv_count, kv_index, full_count, full_index))
        nk = self.nk

        def widen(index):  # Flex's transposition wants the index width to be nk
            pad = nk - index.shape[-1]
            return torch.nn.functional.pad(index, (0, pad)) if pad > 0 else index[..., :nk]

        offset = self.q_offset
        # Flex passes the batch and query-head index; ours expects the layout's own (0 when broadcast)
        b_scale, h_scale = (0 if self.B == 1 else 1), (0 if self.H == 1 else 1)
        if self.mask_mod is not None:
            ours = self.mask_mod

            def mask_mod(b, h, q_idx, kv_idx):
                return ours(b * b_scale, (h // group) * h_scale, q_idx + offset, kv_idx)

            mask_mod.__name__ = getattr(ours, "__name__", "mask_mod")
        elif self.tile_bits is not None:
            slot_of = torch.full((self.B, self.H, self.nq, nk), -1, dtype=torch.int64, device=self.device)
            b, h, qi, slot = self._partial_tiles()
            slot_of[b, h, qi, self.kv_index[b, h, qi, slot].long()] = slot
            bits, bq, bk, one_b, one_h = self.tile_bits, self.block_q, self.block_k, self.B == 1, self.H == 1

            def mask_mod(b, h, q_idx, kv_idx):
                bb = torch.zeros_like(b) if one_b else b
                hh = torch.zeros_like(h) if one_h else h // group
                qi, ki = q_idx // bq, kv_idx // bk
                s = slot_of[bb, hh, qi, ki]
                byte = bits[bb, hh, qi, s.clamp(min=0), q_idx % bq, (kv_idx % bk) // 8]
                return (s >= 0) & (((byte >> (kv_idx % 8).to(torch.uint8)) & 1) == 1)

            mask_mod.__name__ = "tile_bits"
        else:
            mask_mod = None
        return BlockMask.from_kv_blocks(kv_count, widen(kv_index), full_count, widen(full_index),
                                        BLOCK_SIZE=(self.block_q, self.block_k), mask_mod=mask_mod,
                                        seq_lengths=(self.q_len, self.kv_len))

    # ---- transposed lists ----------------------------------------------------------------------------------
    def transpose(self, width: Optional[int] = None) -> TransposedLists:
        """Build the transposed lists on the device (O(nnz), no host loop). ``width`` fixes their capacity
        (no host sync for the maximum); by default it is the longest column."""
        q_count, q_index, q_slot = _transpose_lists(self.kv_count, self.kv_index, self.nk, width)
        full_q_count, full_q_index, _ = _transpose_lists(self.full_count, self.full_index, self.nk, width)
        return TransposedLists(q_count, q_index, full_q_count, full_q_index, q_slot)

    def plan(self, key, build):
        """``build()`` once per ``key``, cached on this layout (derived data only: transposed lists, launch
        plans). The layout's fields and ``stats()`` are unaffected."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def transposed_lists(self) -> TransposedLists:
        """The transposed lists, built on first use and cached."""
        return self.plan("transposed", self.transpose)

    @property
    def q_count(self) -> torch.Tensor:
        return self.transposed_lists().q_count

    @property
    def q_index(self) -> torch.Tensor:
        return self.transposed_lists().q_index

    @property
    def full_q_count(self) -> torch.Tensor:
        return self.transposed_lists().full_q_count

    @property
    def full_q_index(self) -> torch.Tensor:
        return self.transposed_lists().full_q_index

    # ---- statistics ----------------------------------------------------------------------------------------
    def stats(self) -> dict:
        """Counts over the layout's own ``B x H``: logical edges (allowed cells), physical edges (clipped
        areas of the listed tiles), tile amplification = physical / logical, tile counts, empty rows,
        densities and index bytes."""
        dev = self.device
        rows = (torch.clamp(self.q_len - torch.arange(self.nq, device=dev) * self.block_q, max=self.block_q))
        cols = (torch.clamp(self.kv_len - torch.arange(self.nk, device=dev) * self.block_k, max=self.block_k))

        def area(count, index):
            valid = torch.arange(index.shape[-1], device=dev) < count[..., None]
            a = rows.view(1, 1, -1, 1) * cols[index.long()] * valid
            return int(a.sum())

        full_area = area(self.full_count, self.full_index)
        partial_area = area(self.kv_count, self.kv_index)
        # per query token: allowed keys from full tiles (cheap) plus allowed cells inside partial tiles
        valid_full = torch.arange(self.full_width, device=dev) < self.full_count[..., None]
        full_keys = (cols[self.full_index.long()] * valid_full).sum(-1)  # [B, H, nq]
        keys_per_row = full_keys.repeat_interleave(self.block_q, dim=-1)[..., : self.q_len].clone()
        partial_allowed = 0
        for b, h, qi, slot, cells in self._for_partial_chunks():
            per_row = cells.sum(-1)  # [t, bq]
            partial_allowed += int(per_row.sum())
            r = qi[:, None] * self.block_q + torch.arange(self.block_q, device=dev)
            ok = r < self.q_len
            keys_per_row.index_put_((b[:, None].expand_as(r)[ok], h[:, None].expand_as(r)[ok], r[ok]),
                                    per_row[ok], accumulate=True)
        logical = full_area + partial_allowed
        physical = full_area + partial_area
        cells_total = self.B * self.H * self.q_len * self.kv_len
        tiles_total = self.B * self.H * self.nq * self.nk
        n_full, n_partial = int(self.full_count.sum()), int(self.kv_count.sum())
        t = self.transposed_lists()
        fwd_bytes = sum(x.numel() * x.element_size() for x in
                        (self.kv_count, self.kv_index, self.full_count, self.full_index))
        bwd_bytes = sum(x.numel() * x.element_size() for x in t[:4])
        bits_bytes = 0 if self.tile_bits is None else self.tile_bits.numel()
        if logical > 0:
            rho = physical / logical
        else:
            rho = 1.0 if physical == 0 else float("inf")
        return {
            "B": self.B, "H": self.H, "q_len": self.q_len, "kv_len": self.kv_len,
            "block_q": self.block_q, "block_k": self.block_k, "nq": self.nq, "nk": self.nk,
            "logical_edges": logical, "physical_edges": physical, "tile_amplification": rho,
            "full_tiles": n_full, "partial_tiles": n_partial, "listed_tiles": n_full + n_partial,
            "empty_rows": int((keys_per_row == 0).sum()),
            "empty_query_tiles": int(((self.kv_count + self.full_count) == 0).sum()),
            "logical_density": logical / cells_total, "physical_density": physical / cells_total,
            "tile_density": (n_full + n_partial) / tiles_total,
            "max_row_tiles": int((self.kv_count + self.full_count).max()),
            "max_col_tiles": int((t.q_count + t.full_q_count).max()),
            "index_bytes": fwd_bytes, "transposed_index_bytes": bwd_bytes, "tile_bits_bytes": bits_bytes,
        }

    # ---- validation ----------------------------------------------------------------------------------------
    def validate(self) -> "BlockLayout":
        """Check the lists; raise ValueError/TypeError naming the field and the broken rule."""
        names = ("kv_count", "kv_index", "full_count", "full_index")
        tensors = (self.kv_count, self.kv_index, self.full_count, self.full_index)
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != _INDEX_DTYPE:
                raise TypeError(f"{name} must be int32, got {t.dtype}")
            if t.device != self.kv_count.device:
                raise ValueError(f"{name} is on {t.device} but kv_count is on {self.kv_count.device}")
        nq, nk = self.nq, self.nk
        for cname, iname, count, index in (("kv_count", "kv_index", self.kv_count, self.kv_index),
                                           ("full_count", "full_index", self.full_count, self.full_index)):
            if count.dim() != 3 or count.shape[2] != nq:
                raise ValueError(f"{cname} must have shape [B, H, nq={nq}], got {tuple(count.shape)}")
            if index.dim() != 4 or tuple(index.shape[:3]) != tuple(count.shape) or index.shape[3] < 1:
                raise ValueError(f"{iname} must have shape [B, H, nq={nq}, W>=1] matching {cname} "
                                 f"{tuple(count.shape)}, got {tuple(index.shape)}")
            B, H = count.shape[:2]
            if B < 1 or H < 1:
                raise ValueError(f"{cname}: B and H must be >= 1, got B={B}, H={H}")
            W = index.shape[3]
            bad = (count < 0) | (count > W)
            if bad.any():
                where = tuple(bad.nonzero()[0].tolist())
                raise ValueError(f"{cname}{list(where)} = {int(count[where])} is outside [0, width {W}]")
            valid = torch.arange(W, device=index.device) < count[..., None]
            oob = valid & ((index < 0) | (index >= nk))
            if oob.any():
                where = tuple(oob.nonzero()[0].tolist())
                raise ValueError(f"{iname}{list(where)} = {int(index[where])} is out of range [0, nk={nk})")
            step_ok = index[..., 1:] > index[..., :-1]
            bad_order = valid[..., 1:] & ~step_ok
            if bad_order.any():
                where = tuple(bad_order.nonzero()[0].tolist())
                raise ValueError(f"{iname}: row {list(where[:3])} is not strictly ascending at slot {where[3] + 1} "
                                 f"(duplicate or unsorted tile index)")
        if tuple(self.kv_count.shape[:2]) != tuple(self.full_count.shape[:2]):
            raise ValueError(f"kv_count {tuple(self.kv_count.shape)} and full_count {tuple(self.full_count.shape)} "
                             f"must share B and H")
        partial, full = self.block_classes()
        both = partial & full
        if both.any():
            where = tuple(both.nonzero()[0].tolist())
            raise ValueError(f"tile {list(where)} is listed both as partial (kv_index) and full (full_index)")
        if self.tile_bits is not None:
            want = (self.B, self.H, nq, self.width, self.block_q, self.block_k // 8)
            if not isinstance(self.tile_bits, torch.Tensor) or self.tile_bits.dtype != torch.uint8:
                raise TypeError("tile_bits must be a uint8 tensor")
            if tuple(self.tile_bits.shape) != want:
                raise ValueError(f"tile_bits must have shape {list(want)}, got {tuple(self.tile_bits.shape)}")
            if self.tile_bits.device != self.device:
                raise ValueError(f"tile_bits is on {self.tile_bits.device} but the lists are on {self.device}")
        elif self.mask_mod is None and bool((self.kv_count > 0).any()):
            raise ValueError("partial tiles are listed (kv_count > 0) but the layout has neither mask_mod nor "
                             "tile_bits to make them exact; list them as full tiles or pass one of the two")
        return self


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def _flex_block_mask_class():
    try:
        from torch.nn.attention.flex_attention import BlockMask
    except ImportError as e:  # torch without FlexAttention
        raise RuntimeError(f"this torch ({torch.__version__}) has no FlexAttention BlockMask") from e
    return BlockMask


def _lists_to_blocks(count: torch.Tensor, index: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Row lists -> block-level bool ``[..., nr, n_cols]`` (spill column for padding)."""
    W = index.shape[-1]
    valid = torch.arange(W, device=index.device) < count[..., None]
    dest = torch.where(valid, index.long().clamp(0, n_cols - 1), torch.full_like(index, n_cols, dtype=torch.int64))
    out = torch.zeros(*index.shape[:-1], n_cols + 1, dtype=torch.bool, device=index.device)
    out.scatter_(-1, dest, valid)
    return out[..., :n_cols]


def _tile_valid(qi, ki, bq, bk, q_len, kv_len):
    r = qi[:, None, None] * bq + torch.arange(bq, device=qi.device).view(1, bq, 1)
    c = ki[:, None, None] * bk + torch.arange(bk, device=qi.device).view(1, 1, bk)
    return (r < q_len) & (c < kv_len)


def _eval_tiles(mask_mod, b, h, qi, ki, q_offset, q_len, kv_len, bq, bk) -> torch.Tensor:
    """Evaluate ``mask_mod`` on whole tiles: bool ``[t, bq, bk]``, False outside the clipped tile."""
    dev = qi.device
    r = qi.long()[:, None, None] * bq + torch.arange(bq, device=dev).view(1, bq, 1)  # [t, bq, 1] local rows
    c = ki.long()[:, None, None] * bk + torch.arange(bk, device=dev).view(1, 1, bk)  # [t, 1, bk]
    q_ok, k_ok = r < q_len, c < kv_len
    # clamp so a mask_mod that indexes a per-position table never reads past its end
    q_abs = r.clamp(max=q_len - 1) + q_offset
    kv = c.clamp(max=kv_len - 1)
    out = mask_mod(b.long()[:, None, None], h.long()[:, None, None], q_abs, kv)
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        raise TypeError(f"mask_mod {getattr(mask_mod, '__name__', mask_mod)!r} must return a bool tensor, "
                        f"got {getattr(out, 'dtype', type(out).__name__)}")
    return torch.broadcast_to(out, (qi.numel(), bq, bk)) & q_ok & k_ok


def _classify(mask_mod, grid: TileGrid, listed: Optional[torch.Tensor]):
    """Block-level ``(partial, full)`` for ``mask_mod`` (restricted to ``listed`` tiles when given)."""
    shape = (grid.B, grid.H, grid.nq, grid.nk)
    bounds = tile_rule_of(mask_mod)(grid)
    any_lo, any_hi, all_lo, all_hi = (torch.broadcast_to(x.to(grid.device), shape) for x in bounds)
    full = all_lo.clone()
    partial = any_lo & ~all_hi & ~full
    undecided = any_hi & ~full & ~partial
    if listed is not None:
        full, partial, undecided = full & listed, partial & listed, undecided & listed
    b, h, qi, ki = undecided.nonzero(as_tuple=True)
    step = max(1, _cells_per_chunk(grid.device) // (grid.block_q * grid.block_k))
    for s in range(0, b.numel(), step):
        sl = slice(s, s + step)
        cells = _eval_tiles(mask_mod, b[sl], h[sl], qi[sl], ki[sl], grid.q_start, grid.q_len, grid.kv_len,
                            grid.block_q, grid.block_k)
        valid = _tile_valid(qi[sl], ki[sl], grid.block_q, grid.block_k, grid.q_len, grid.kv_len)
        any_ = cells.flatten(1).any(1)
        all_ = (cells | ~valid).flatten(1).all(1)
        full[b[sl], h[sl], qi[sl], ki[sl]] = all_
        partial[b[sl], h[sl], qi[sl], ki[sl]] = any_ & ~all_
    return partial.contiguous(), full.contiguous()
