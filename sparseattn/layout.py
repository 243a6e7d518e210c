"""BlockLayout: the device block table that sparse kernels walk.

A layout cuts the ``Lq x Lk`` attention matrix into ``block_q x block_k`` tiles and lists, for every query
tile (a *row*), the key tiles it must visit, in two groups:

* ``full_index``: tiles where every in-range cell is allowed; a kernel runs them without mask work;
* ``kv_index``: *partial* tiles; a kernel applies a token mask inside them.

Empty tiles are never listed, a tile is listed at most once per row, indices in a row ascend. The transposed
lists (for every key tile, the query tiles that visit it) drive the backward pass's dK/dV kernels; they are
built on the device by one fused launch (:mod:`sparseattn.kernels.transpose`; CPU layouts on a machine whose
kernels run on a GPU use a stable sort of the ``(column, row)`` pairs instead), in O(nnz).

Memory never grows with ``Lq x Lk``: tiles are classified from a pattern's tile rule where it has one, and
every undecided tile is evaluated cell by cell in chunks of tiles. Only ``to_dense`` materialises cells.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch

from . import _tiles as T
from . import interop
from ._checks import check_block, check_int
from .patterns import TileGrid

__all__ = ["BlockLayout", "TransposedLists"]



class TransposedLists(NamedTuple):
    """For every key tile, the query tiles that visit it (ascending): ``[B, H, nk]`` and ``[B, H, nk, W']``."""

    q_count: torch.Tensor
    q_index: torch.Tensor
    full_q_count: torch.Tensor
    full_q_index: torch.Tensor
    q_slot: torch.Tensor  # for each partial entry, its slot in the forward row (where its tile bits live)


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

    Query positions: query row ``i`` is position ``i + q_offset`` for the mask_mod and the kernels. By default
    ``q_offset = max(kv_len - q_len, 0)``: with fewer queries than keys the queries are the *last* ``q_len``
    positions (chunked prefill, decode). ``q_offset=0`` is FlexAttention's (and attention-gym's) convention,
    local query indices; pass it to the constructors to use a mask_mod written for Flex (cross-attention, or a
    mask that indexes a table of length ``q_len``) with the meaning it has there.

    A routed layout with ``semantics="member"`` also has ``row_slot`` (uint8 ``[B,H,q_len,W]``): query row
    ``r`` uses the partial tile at slot ``s`` of its row only where ``row_slot[.., r, s]`` is 1 (AND'ed with the
    mask_mod). *Dynamic* layouts (:meth:`from_lists` with ``trusted=True``, :meth:`with_capacity`) have fixed
    widths and may have their contents replaced (:meth:`copy_into`); ops build no content-derived plan for
    them.

    The constructor takes explicit lists and validates them; the ``from_*`` classmethods build them.
    """

    __slots__ = ("q_len", "kv_len", "block_q", "block_k", "kv_count", "kv_index", "full_count", "full_index",
                 "mask_mod", "tile_bits", "row_slot", "dynamic", "_transposed_fixed", "_q_offset", "_plans")

    def __init__(self, kv_count, kv_index, full_count, full_index, *, q_len: int, kv_len: int,
                 block_q: int = 128, block_k: int = 128, mask_mod=None, tile_bits=None, row_slot=None,
                 validate: bool = True, q_offset: Optional[int] = None):
        self.q_len = check_int("q_len", q_len)
        self.kv_len = check_int("kv_len", kv_len)
        self._q_offset = self.default_q_offset(q_len, kv_len, q_offset)
        self.block_q = check_block("block_q", block_q)
        self.block_k = check_block("block_k", block_k)
        if mask_mod is not None and not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        self.kv_count, self.kv_index = kv_count, kv_index
        self.full_count, self.full_index = full_count, full_index
        self.mask_mod = mask_mod
        self.tile_bits = tile_bits
        self.row_slot = row_slot  # member selections: uint8 [B, H, q_len, W], query row x partial slot
        self.dynamic = False  # set by the trusted constructors: table contents may change (copy_into)
        self._transposed_fixed = (T.cdiv(self.q_len, self.block_q), True)  # a dynamic layout's (width, fast_launch)
        # derived data (transposed lists, launch plans), built on first use and cached here only: the layout's
        # own fields never change after construction and stats() never sees this
        self._plans: dict = {}
        if validate:
            self.validate()

    # ---- shape facts ------------------------------------------------------------------------------------
    @property
    def q_offset(self) -> int:
        """Position of query row 0 (what the mask_mod and the kernels see): ``max(kv_len - q_len, 0)`` unless
        the constructor was given another (0: FlexAttention's local query indices)."""
        return self._q_offset

    @staticmethod
    def default_q_offset(q_len: int, kv_len: int, q_offset: Optional[int] = None) -> int:
        """``q_offset`` checked, or the documented default ``max(kv_len - q_len, 0)`` when it is None."""
        if q_offset is None:
            return max(kv_len - q_len, 0)
        return check_int("q_offset", q_offset, 0)

    @property
    def nq(self) -> int:
        return T.cdiv(self.q_len, self.block_q)

    @property
    def nk(self) -> int:
        return T.cdiv(self.kv_len, self.block_k)

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
                            mask_mod=None, tile_bits=None, q_offset=None) -> "BlockLayout":
        """Lists from block-level class masks ``[B,H,nq,nk]`` (disjoint); correct by construction."""
        (kv_count, kv_index), (full_count, full_index) = T.class_lists(partial, full)
        return cls(kv_count, kv_index, full_count, full_index, q_len=q_len, kv_len=kv_len, block_q=block_q,
                   block_k=block_k, mask_mod=mask_mod, tile_bits=tile_bits, validate=False, q_offset=q_offset)

    @staticmethod
    def _check_dims(B, H):
        check_int("B", B)
        check_int("H", H)

    @classmethod
    def from_mask_mod(cls, mask_mod, q_len: int, kv_len: int, block_q: int = 128, block_k: int = 128,
                      B: int = 1, H: int = 1, device=None, q_offset: Optional[int] = None) -> "BlockLayout":
        """Classify every tile of ``mask_mod`` as empty / partial / full and list the non-empty ones.

        The pattern's tile rule decides what it can; the undecided tiles are evaluated cell by cell in
        chunks, so memory stays proportional to the number of tiles, never to ``q_len * kv_len``.

        ``mask_mod`` sees query row ``i`` as position ``i + q_offset``: by default ``max(kv_len - q_len, 0)``
        (the queries are the last positions), ``q_offset=0`` for FlexAttention's local query indices.
        """
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        check_int("q_len", q_len)
        check_int("kv_len", kv_len)
        check_block("block_q", block_q)
        check_block("block_k", block_k)
        cls._check_dims(B, H)
        q_offset = cls.default_q_offset(q_len, kv_len, q_offset)
        device = T.default_device(device)
        grid = TileGrid(q_offset, q_len, kv_len, block_q, block_k, B, H, device)
        partial, full = T.classify(mask_mod, grid, listed=None)
        return cls._from_block_classes(partial, full, q_len=q_len, kv_len=kv_len, block_q=block_q,
                                       block_k=block_k, mask_mod=mask_mod, q_offset=q_offset)

    @classmethod
    def from_block_mask(cls, block_mask: torch.Tensor, q_len: int, kv_len: int, block_q: int = 128,
                        block_k: int = 128, mask_mod=None, q_offset: Optional[int] = None) -> "BlockLayout":
        """Layout from a block-level bool ``[B, H, nq, nk]``. Without ``mask_mod`` every listed tile is full;
        with it, listed tiles are intersected with the mask_mod, reclassified, and dropped if empty.
        ``q_offset`` as in :meth:`from_mask_mod`."""
        check_int("q_len", q_len)
        check_int("kv_len", kv_len)
        check_block("block_q", block_q)
        check_block("block_k", block_k)
        if not isinstance(block_mask, torch.Tensor):
            raise TypeError(f"block_mask must be a torch.Tensor, got {type(block_mask).__name__}")
        if block_mask.dtype != torch.bool:
            raise TypeError(f"block_mask must be a bool tensor, got {block_mask.dtype}")
        nq, nk = T.cdiv(q_len, block_q), T.cdiv(kv_len, block_k)
        if block_mask.dim() != 4 or tuple(block_mask.shape[2:]) != (nq, nk):
            raise ValueError(f"block_mask must have shape [B, H, {nq}, {nk}] for q_len={q_len}, kv_len={kv_len}, "
                             f"blocks ({block_q}, {block_k}); got {tuple(block_mask.shape)}")
        B, H = block_mask.shape[:2]
        cls._check_dims(B, H)
        q_offset = cls.default_q_offset(q_len, kv_len, q_offset)
        if mask_mod is None:
            return cls._from_block_classes(torch.zeros_like(block_mask), block_mask.contiguous(), q_len=q_len,
                                           kv_len=kv_len, block_q=block_q, block_k=block_k, q_offset=q_offset)
        if not callable(mask_mod):
            raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
        grid = TileGrid(q_offset, q_len, kv_len, block_q, block_k, B, H, block_mask.device)
        partial, full = T.classify(mask_mod, grid, listed=block_mask)
        return cls._from_block_classes(partial, full, q_len=q_len, kv_len=kv_len, block_q=block_q,
                                       block_k=block_k, mask_mod=mask_mod, q_offset=q_offset)

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
        nq, nk = T.cdiv(Lq, block_q), T.cdiv(Lk, block_k)
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
        layout.tile_bits = T.pack_bits(cells).contiguous()
        return layout

    @classmethod
    def from_flex(cls, block_mask) -> "BlockLayout":
        """Layout from a FlexAttention ``BlockMask``. Its full tiles stay full; its partial tiles are
        re-classified with its mask_mod, which keeps Flex's meaning: the layout has ``q_offset = 0`` (local
        query indices, Flex's convention) and ``mask_mod`` is the BlockMask's own."""
        parts = interop.from_flex(block_mask)
        return cls._from_block_classes(parts.pop("partial"), parts.pop("full"), **parts)

    # ---- conversions --------------------------------------------------------------------------------------
    def to(self, device) -> "BlockLayout":
        """A copy of the layout on ``device`` (the mask_mod is shared)."""
        device = torch.device(device)
        moved = BlockLayout(self.kv_count.to(device), self.kv_index.to(device), self.full_count.to(device),
                            self.full_index.to(device), q_len=self.q_len, kv_len=self.kv_len,
                            block_q=self.block_q, block_k=self.block_k, mask_mod=self.mask_mod,
                            tile_bits=None if self.tile_bits is None else self.tile_bits.to(device),
                            row_slot=None if self.row_slot is None else self.row_slot.to(device),
                            validate=False, q_offset=self.q_offset)
        moved.dynamic, moved._transposed_fixed = self.dynamic, self._transposed_fixed
        if "transposed" in self._plans:
            moved._plans["transposed"] = TransposedLists(*(t.to(device) for t in self._plans["transposed"]))
        return moved

    def block_classes(self):
        """Block-level ``(partial, full)`` bool ``[B, H, nq, nk]``."""
        return (T.lists_to_blocks(self.kv_count, self.kv_index, self.nk),
                T.lists_to_blocks(self.full_count, self.full_index, self.nk))

    def partial_cells(self, b: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, slot: torch.Tensor) -> torch.Tensor:
        """Token mask of the listed partial tiles ``(b, h, qi, slot)`` (1-D index tensors, ``slot`` a position
        in ``kv_index``'s row): bool ``[t, block_q, block_k]``, False outside ``q_len``/``kv_len``."""
        ki = self.kv_index[b, h, qi, slot].long()
        if self.tile_bits is not None:
            cells = T.unpack_bits(self.tile_bits[b, h, qi, slot])
            cells = cells & T.tile_valid(qi, ki, self.block_q, self.block_k, self.q_len, self.kv_len)
        elif self.mask_mod is None:
            raise ValueError("this layout has partial tiles but neither mask_mod nor tile_bits")
        else:
            cells = T.eval_tiles(self.mask_mod, b, h, qi, ki, self.q_offset, self.q_len, self.kv_len,
                                 self.block_q, self.block_k)
        if self.row_slot is not None:  # member selections: only the rows that chose this slot use the tile
            rows = (qi.long()[:, None] * self.block_q + torch.arange(self.block_q, device=qi.device)).clamp(
                max=self.q_len - 1)  # [t, bq]; rows past q_len are already False
            chose = self.row_slot[b[:, None], h[:, None], rows, slot[:, None]] != 0  # [t, bq]
            cells = cells & chose[..., None]
        return cells

    def partial_tiles(self):
        """All listed partial tiles as index tensors ``(b, h, qi, slot)``."""
        slot_valid = torch.arange(self.width, device=self.device).view(1, 1, 1, -1) < self.kv_count[..., None]
        return slot_valid.nonzero(as_tuple=True)

    def _for_partial_chunks(self):
        b, h, qi, slot = self.partial_tiles()
        step = max(1, T.cells_per_chunk(self.device) // (self.block_q * self.block_k))
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
                bits[b, h, qi, slot] = T.pack_bits(cells)
            return bits
        return self.plan("tile_bits", build)

    def to_bsr(self) -> dict:
        """Block-sparse rows as FlashInfer's BSR wrapper takes them, one matrix per ``(b, h)``:
        ``indptr [B, H, nq + 1]`` and ``indices [B, H, nnz_max]`` (full and partial tiles merged, ascending),
        ``is_full`` flags aligned with ``indices``, and the block size ``(R, C)``."""
        return interop.to_bsr(self)

    def to_flex(self, num_heads: Optional[int] = None):
        """FlexAttention ``BlockMask`` with the same tiles. Flex indexes queries locally, so the mask_mod it
        gets adds ``q_offset``. ``num_heads`` expands a GQA layout (``H`` = KV heads) to the query heads."""
        return interop.to_flex(self, num_heads)

    # ---- transposed lists ----------------------------------------------------------------------------------
    def transpose(self, width: Optional[int] = None) -> TransposedLists:
        """Build the transposed lists on the device in one fused launch (:func:`sparseattn._tiles.transpose_lists`:
        rows ascending in every column, no sort, no atomics). ``width`` fixes their capacity (no host sync);
        by default each list's width is its longest column (a count-only launch and one host sync)."""
        q_count, q_index, q_slot, full_q_count, full_q_index = T.transpose_lists(
            self.kv_count, self.kv_index, self.full_count, self.full_index, self.nk, width, width)
        return TransposedLists(q_count, q_index, full_q_count, full_q_index, q_slot)

    def plan(self, key, build):
        """``build()`` once per ``key``, cached on this layout (derived data only: transposed lists, launch
        plans). The layout's fields and ``stats()`` are unaffected."""
        if key not in self._plans:
            self._plans[key] = build()
        return self._plans[key]

    def transposed_lists(self) -> TransposedLists:
        """The transposed lists, built on first use and cached (a dynamic layout's by one launch at its fixed
        width, no host sync: only the backward and a few conversions read them, so a forward-only step never
        pays for them)."""
        if self.dynamic:
            width, fast = self._transposed_fixed
            return self.plan("transposed", lambda: self.transpose_fixed(width, fast_launch=fast))
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

    # ---- dynamic layouts: run-time selections, fixed capacity, CUDA graphs -----------------------------------
    @classmethod
    def from_lists(cls, kv_count, kv_index, full_count, full_index, *, q_len: int, kv_len: int,
                   block_q: int = 128, block_k: int = 128, mask_mod=None, tile_bits=None, row_slot=None,
                   trusted: bool = False, transposed_width: Optional[int] = None) -> "BlockLayout":
        """A layout from explicit lists.

        ``trusted=False``: validated like the constructor (a host sync), a static layout. ``trusted=True``: the
        caller guarantees the list rules (``route`` builds them so): no validation pass and no host sync; only
        shapes, dtypes and devices are checked. The layout is *dynamic*: its widths are fixed, its transposed
        lists are built on first use (the backward) by one launch with the fixed width ``transposed_width``
        (default ``nq``, enough for any column), and ops derive no plan from its contents, so
        :meth:`copy_into` may replace them. Its partial tiles must be exact without looking at the contents:
        a mask_mod the kernels evaluate in registers (``causal``, bands, sinks, documents) or ``tile_bits``."""
        if trusted:
            return cls._dynamic(kv_count, kv_index, full_count, full_index, q_len=q_len, kv_len=kv_len,
                                block_q=block_q, block_k=block_k, mask_mod=mask_mod, tile_bits=tile_bits,
                                row_slot=row_slot, transposed_width=transposed_width)
        return cls(kv_count, kv_index, full_count, full_index, q_len=q_len, kv_len=kv_len, block_q=block_q,
                   block_k=block_k, mask_mod=mask_mod, tile_bits=tile_bits, row_slot=row_slot)

    @classmethod
    def _dynamic(cls, kv_count, kv_index, full_count, full_index, *, q_len: int, kv_len: int, block_q: int,
                 block_k: int, mask_mod=None, tile_bits=None, row_slot=None,
                 transposed_width: Optional[int] = None, checked: bool = False,
                 fast_launch: bool = True) -> "BlockLayout":
        """The trusted constructor's work (:meth:`from_lists` with ``trusted=True``). ``checked``: the caller
        built the lists itself with the right kinds, shapes, dtypes, device and a register mask path
        (``route`` does), so :meth:`_check_trusted` is skipped: the layout is rebuilt every step and those
        checks were about half of its host time besides the launch. ``fast_launch``: how the transposed lists'
        kernel is launched (:func:`sparseattn._tiles.transpose_lists`)."""
        layout = cls(kv_count, kv_index, full_count, full_index, q_len=q_len, kv_len=kv_len, block_q=block_q,
                     block_k=block_k, mask_mod=mask_mod, tile_bits=tile_bits, row_slot=row_slot, validate=False)
        if not checked:
            layout._check_trusted()
        layout.dynamic = True
        layout._transposed_fixed = (transposed_width or layout.nq, fast_launch)  # built on first use
        return layout

    @classmethod
    def with_capacity(cls, B: int, H: int, q_len: int, kv_len: int, block_q: int = 128, block_k: int = 128, *,
                      width: int, full_width: int = 1, mask_mod=None, member: bool = False,
                      transposed_width: Optional[int] = None, device=None) -> "BlockLayout":
        """An empty dynamic layout with fixed widths (every row lists nothing): the static target a CUDA graph is
        captured on, refilled by ``routed.copy_into(static)`` before each replay. ``member`` adds the row x
        slot bits of a ``semantics="member"`` routing."""
        for name, value in (("B", B), ("H", H), ("width", width), ("full_width", full_width)):
            check_int(name, value)
        check_block("block_q", block_q)
        check_block("block_k", block_k)
        nq = T.cdiv(check_int("q_len", q_len), block_q)
        check_int("kv_len", kv_len)
        device = T.default_device(device)

        def zeros(*shape, dtype=T.INDEX_DTYPE):
            return torch.zeros(*shape, dtype=dtype, device=device)
        row_slot = zeros(B, H, q_len, width, dtype=torch.uint8) if member else None
        return cls.from_lists(zeros(B, H, nq), zeros(B, H, nq, width), zeros(B, H, nq), zeros(B, H, nq, full_width),
                              q_len=q_len, kv_len=kv_len, block_q=block_q, block_k=block_k, mask_mod=mask_mod,
                              row_slot=row_slot, trusted=True, transposed_width=transposed_width)

    def transpose_fixed(self, width: int, *, fast_launch: bool = True) -> TransposedLists:
        """The transposed lists with both widths fixed to ``width``: one launch, no host sync, unused column
        tails left unwritten (never read); ``fast_launch`` as in :func:`sparseattn._tiles.transpose_lists`."""
        q_count, q_index, q_slot, full_q_count, full_q_index = T.transpose_lists(
            self.kv_count, self.kv_index, self.full_count, self.full_index, self.nk, width, width, zero_pad=False,
            fast_launch=fast_launch)
        return TransposedLists(q_count, q_index, full_q_count, full_q_index, q_slot)

    def _check_trusted(self) -> None:
        """What a trusted layout can check without reading its contents: kinds, shapes, dtypes, devices, and a
        mask path that needs no content-derived plan."""
        from .predicates import kernel_predicate
        self._check_list_shapes()
        self._check_row_slot()
        if self.tile_bits is None and self.mask_mod is not None and kernel_predicate(self.mask_mod) is None:
            raise ValueError(f"a trusted (dynamic) layout needs a mask_mod the kernels evaluate in registers "
                             f"(bands, sinks, documents) or tile_bits; {getattr(self.mask_mod, '__name__', '?')!r} "
                             f"would need bits derived from the contents")

    def _same_capacity(self, other: "BlockLayout") -> Optional[str]:
        """Why ``other`` cannot receive this layout's tables (None if it can)."""
        from .predicates import kernel_predicate
        for name in ("q_len", "kv_len", "block_q", "block_k"):
            if getattr(self, name) != getattr(other, name):
                return f"{name} differs ({getattr(self, name)} vs {getattr(other, name)})"
        for name in ("kv_count", "kv_index", "full_count", "full_index", "row_slot", "tile_bits"):
            a, b = getattr(self, name), getattr(other, name)
            if (a is None) != (b is None):
                return f"{name} is {'absent' if a is None else 'present'} here but not in the target"
            if a is not None and (a.shape != b.shape or a.dtype != b.dtype):
                return f"{name} has shape {tuple(a.shape)} here but {tuple(b.shape)} in the target"
        if self.device != other.device:
            return f"the target is on {other.device}, this layout on {self.device}"
        if self.mask_mod is not other.mask_mod:
            mine, theirs = kernel_predicate(self.mask_mod), kernel_predicate(other.mask_mod)
            if mine is None or theirs is None or mine != theirs:
                return "the mask_mods differ (the target's kernels would mask partial tiles differently)"
        return None

    def copy_into(self, static: "BlockLayout") -> "BlockLayout":
        """Copy this layout's tables (lists, member bits, tile bits, transposed lists) into the dynamic layout
        ``static`` of the same capacity, in place (device copies, no host sync), so a CUDA graph captured on
        ``static`` replays with this selection. Returns ``static``."""
        if not isinstance(static, BlockLayout):
            raise TypeError(f"static must be a BlockLayout, got {type(static).__name__}")
        if not static.dynamic:
            raise ValueError("copy_into needs a dynamic target (BlockLayout.with_capacity or a trusted from_lists): "
                             "a static layout caches plans derived from its contents")
        why = self._same_capacity(static)
        if why is not None:
            raise ValueError(f"copy_into: the target has another capacity or mask path: {why}")
        for name in ("kv_count", "kv_index", "full_count", "full_index", "row_slot", "tile_bits"):
            src = getattr(self, name)
            if src is not None:
                getattr(static, name).copy_(src)
        if "transposed" not in static._plans:  # built later from the lists just copied (in a capture, or eagerly)
            return static
        dst = static._plans["transposed"]
        width = dst.q_index.shape[-1]
        src = self._plans.get("transposed")
        if src is None or (src.q_index.shape[-1], src.full_q_index.shape[-1]) != (width, dst.full_q_index.shape[-1]):
            src = self.transpose_fixed(width)
        for a, b in zip(dst, src):
            a.copy_(b)
        return static

    def dense_rows(self, rows: torch.Tensor) -> torch.Tensor:
        """The exact token mask of some query rows: bool ``[B, H, len(rows), kv_len]`` for local query rows
        ``rows`` (1-D int tensor), equal to ``to_dense()[:, :, rows]`` but built from the rows' own lists, so it
        stays small when ``q_len x kv_len`` is not (member bits included)."""
        rows = torch.as_tensor(rows, device=self.device).long().flatten()
        if rows.numel() and (int(rows.min()) < 0 or int(rows.max()) >= self.q_len):
            raise ValueError(f"rows must be local query rows in [0, q_len={self.q_len})")
        B, H, bk, dev = self.B, self.H, self.block_k, self.device
        qi = rows // self.block_q  # [R]
        _, full = self.block_classes()
        keys = full[:, :, qi].repeat_interleave(bk, dim=-1)[..., : self.kv_len].clone()  # [B, H, R, Lk]
        idx = self.kv_index[:, :, qi].long()  # [B, H, R, W]
        listed = torch.arange(self.width, device=dev) < self.kv_count[:, :, qi, None]
        kv = idx[..., None] * bk + torch.arange(bk, device=dev)  # [B, H, R, W, bk]
        in_range = listed[..., None] & (kv < self.kv_len)
        if self.tile_bits is not None:
            r_in = (rows % self.block_q).view(1, 1, -1, 1)
            bits = self.tile_bits[torch.arange(B, device=dev).view(B, 1, 1, 1), torch.arange(H, device=dev).view(
                1, H, 1, 1), qi.view(1, 1, -1, 1), torch.arange(self.width, device=dev).view(1, 1, 1, -1), r_in]
            cells = T.unpack_bits(bits)  # [B, H, R, W, bk]
        elif self.mask_mod is not None:
            b = torch.arange(B, device=dev).view(B, 1, 1, 1, 1)
            h = torch.arange(H, device=dev).view(1, H, 1, 1, 1)
            q_abs = (rows + self.q_offset).view(1, 1, -1, 1, 1)
            cells = torch.broadcast_to(self.mask_mod(b, h, q_abs, kv.clamp(max=self.kv_len - 1)), kv.shape)
        else:
            cells = torch.zeros_like(in_range)
        cells = cells & in_range
        if self.row_slot is not None:
            cells = cells & (self.row_slot[:, :, rows] != 0)[..., None]
        flat = torch.where(in_range, kv, torch.full_like(kv, self.kv_len)).flatten(3)  # spill column Lk
        spill = torch.zeros(B, H, rows.numel(), self.kv_len + 1, dtype=torch.bool, device=dev)
        spill.scatter_(-1, flat, cells.flatten(3))
        return keys | spill[..., : self.kv_len]

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
            a = rows.view(1, 1, -1, 1) * cols[index.long().where(valid, 0)] * valid  # padding is never read
            return int(a.sum())

        full_area = area(self.full_count, self.full_index)
        partial_area = area(self.kv_count, self.kv_index)
        # per query token: allowed keys from full tiles (cheap) plus allowed cells inside partial tiles
        valid_full = torch.arange(self.full_width, device=dev) < self.full_count[..., None]
        full_keys = (cols[self.full_index.long().where(valid_full, 0)] * valid_full).sum(-1)  # [B, H, nq]
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
    def _check_list_shapes(self) -> None:
        """The checks of the four lists that read no contents (trusted and validated layouts alike): kinds,
        dtypes, devices and shapes."""
        names = ("kv_count", "kv_index", "full_count", "full_index")
        tensors = (self.kv_count, self.kv_index, self.full_count, self.full_index)
        for name, t in zip(names, tensors):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != T.INDEX_DTYPE:
                raise TypeError(f"{name} must be int32, got {t.dtype}")
            if t.device != self.kv_count.device:
                raise ValueError(f"{name} is on {t.device} but kv_count is on {self.kv_count.device}")
        nq = self.nq
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
        if tuple(self.kv_count.shape[:2]) != tuple(self.full_count.shape[:2]):
            raise ValueError(f"kv_count {tuple(self.kv_count.shape)} and full_count {tuple(self.full_count.shape)} "
                             f"must share B and H")

    def _check_row_slot(self) -> None:
        """A member selection's row x slot bits: uint8 ``[B, H, q_len, W]`` on the lists' device."""
        if self.row_slot is None:
            return
        want = (self.B, self.H, self.q_len, self.width)
        if not isinstance(self.row_slot, torch.Tensor) or self.row_slot.dtype != torch.uint8:
            raise TypeError("row_slot must be a uint8 tensor")
        if tuple(self.row_slot.shape) != want:
            raise ValueError(f"row_slot must have shape [B, H, q_len, W] = {list(want)}, got "
                             f"{tuple(self.row_slot.shape)}")
        if self.row_slot.device != self.device:
            raise ValueError(f"row_slot is on {self.row_slot.device} but the lists are on {self.device}")

    def validate(self) -> "BlockLayout":
        """Check the lists; raise ValueError/TypeError naming the field and the broken rule."""
        self._check_list_shapes()
        nq, nk = self.nq, self.nk
        for cname, iname, count, index in (("kv_count", "kv_index", self.kv_count, self.kv_index),
                                           ("full_count", "full_index", self.full_count, self.full_index)):
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
        partial, full = self.block_classes()
        both = partial & full
        if both.any():
            where = tuple(both.nonzero()[0].tolist())
            raise ValueError(f"tile {list(where)} is listed both as partial (kv_index) and full (full_index)")
        self._check_row_slot()
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


