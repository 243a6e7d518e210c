"""Tile-level machinery under :class:`~sparseattn.layout.BlockLayout` and its converters: row lists from block
masks and back, the O(nnz) transpose, packed tile bits, and the classification of tiles by a mask_mod (tile rule
first, cells only for undecided tiles, in chunks so memory never grows with ``Lq x Lk``)."""
from __future__ import annotations

import contextlib
import dataclasses
from typing import Optional

import torch

from .patterns import TileGrid, tile_rule_of

INDEX_DTYPE = torch.int32


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def default_device(device) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def cells_per_chunk(device: torch.device) -> int:
    # int64 index intermediates are 8 bytes a cell: 64M cells ~ 0.5 GB on a GPU, 16M ~ 128 MB on a CPU
    return 1 << 26 if device.type == "cuda" else 1 << 24


def rows_to_lists(blocks: torch.Tensor, width: Optional[int] = None, count: Optional[torch.Tensor] = None):
    """Block-level bool ``[..., n]`` -> (count ``[...]``, ascending index ``[..., W]``), padded with 0.

    One pass, no sort: each allowed column goes to slot ``cumsum`` (1-based), the rest to a spill slot 0 that
    is cut off afterwards. ``count``: the rows' counts when the caller has them (``blocks.sum(-1)``, int32);
    ``width`` None is the longest row (one host sync).
    """
    n = blocks.shape[-1]
    if count is None:
        count = blocks.sum(-1, dtype=torch.int32)
    if width is None:
        width = int(count.max()) if count.numel() else 0
    width = max(width, 1)
    slot = torch.where(blocks, torch.cumsum(blocks, -1, dtype=torch.int64), 0)  # [..., n]
    index = torch.zeros(*blocks.shape[:-1], width + 1, dtype=torch.int64, device=blocks.device)
    cols = torch.arange(n, device=blocks.device, dtype=torch.int64)
    index.scatter_(-1, slot, torch.where(blocks, cols, 0))
    return count, index[..., 1:].to(INDEX_DTYPE).contiguous()


def row_lists_blocks(n_rows: int, n_cols: int, interpreter: bool):
    """``(ROWS, COLS)`` of :mod:`sparseattn.kernels.row_lists`: on a GPU 16 rows a program, columns 256 at a
    step (the grid's rows spread over many programs); in the interpreter, as for the transpose, few large
    steps (every tile operation there is one numpy call)."""
    if not interpreter:
        return 16, max(16, min(_pow2_at_least(n_cols), 256))
    return _interpreter_steps(n_rows, n_cols)


def class_lists(partial: torch.Tensor, full: torch.Tensor, use_kernel: Optional[bool] = None):
    """:func:`rows_to_lists` of both tile classes ``[B, H, nq, nk]`` with one host sync for both widths.

    ``use_kernel`` (default: for CUDA tensors): two launches of :mod:`sparseattn.kernels.row_lists` around
    the sync instead of about 22 torch launches; the same lists."""
    from .kernels import BACKEND
    if use_kernel is None:
        use_kernel = partial.device.type == "cuda"
    if use_kernel and (partial.device.type == "cuda" or BACKEND == "interpreter") and partial.numel():
        return _class_lists_kernel(partial, full, BACKEND == "interpreter")
    counts = [x.sum(-1, dtype=torch.int32) for x in (partial, full)]
    widths = torch.stack([c.max() for c in counts]).tolist() if counts[0].numel() else [0, 0]
    return [rows_to_lists(x, int(w), c) for x, w, c in zip((partial, full), widths, counts)]


def _class_lists_kernel(partial: torch.Tensor, full: torch.Tensor, interpreter: bool):
    from .kernels.row_lists import row_lists_kernel
    *lead, n_cols = partial.shape
    n_rows = partial.numel() // n_cols
    device = partial.device
    flat = [x.reshape(n_rows, n_cols).contiguous().view(torch.uint8) for x in (partial, full)]
    count, full_count = (torch.empty(n_rows, dtype=INDEX_DTYPE, device=device) for _ in range(2))
    widths = torch.zeros(2, dtype=torch.int32, device=device)
    rows, cols = row_lists_blocks(n_rows, n_cols, interpreter)
    grid = (cdiv(n_rows, rows), 2)
    kwargs = dict(PARTIAL=flat[0], FULL=flat[1], COUNT=count, FULL_COUNT=full_count, WIDTHS=widths,
                  n_rows=n_rows, n_cols=n_cols, ROWS=rows, COLS=cols, num_warps=4)
    # the counting launch writes no list: its list arguments are placeholders
    launch_kernel(row_lists_kernel, grid, dict(kwargs, INDEX=count, FULL_INDEX=full_count, W=1, FW=1, WRITE=False))
    W, FW = (max(int(w), 1) for w in widths.tolist())  # the one host sync
    index = torch.empty(n_rows, W, dtype=INDEX_DTYPE, device=device)
    full_index = torch.empty(n_rows, FW, dtype=INDEX_DTYPE, device=device)
    launch_kernel(row_lists_kernel, grid, dict(kwargs, INDEX=index, FULL_INDEX=full_index, W=W, FW=FW, WRITE=True))
    return [(count.view(lead), index.view(*lead, W)), (full_count.view(lead), full_index.view(*lead, FW))]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (int(n) - 1).bit_length())


def transpose_blocks(n_rows: int, n_cols: int, width: int, interpreter: bool):
    """``(ROWS, COLS, W_POW2)`` of the fused transpose: ``W_POW2 > width`` is the binary search's range. On a
    GPU: ``[32, 32]`` (row, column) pairs a step over many programs. In the interpreter every tile operation is
    one numpy call, so the fewer and larger the steps, the faster: all columns of a head in one program and
    as many rows a step as Triton's largest block allows."""
    w_pow2 = _pow2_at_least(width + 1)
    return (32, 32, w_pow2) if not interpreter else (*_interpreter_steps(n_rows, n_cols), w_pow2)


def _interpreter_steps(n_rows: int, n_cols: int):
    """``(ROWS, COLS)`` of a rows x columns kernel in the interpreter, where every tile operation is one numpy
    call: every column (up to 4096) and as many rows a step as Triton's largest block allows."""
    cols = min(_pow2_at_least(n_cols), 1 << 12)
    return max(1, min(_pow2_at_least(n_rows), (1 << 20) // cols)), cols


def longest_column(count: torch.Tensor, index: torch.Tensor, n_cols: int) -> int:
    """The most rows any column of the lists ``count [B,H,nr]``, ``index [B,H,nr,W]`` has (at least 1): a
    bincount of the listed entries, O(nnz), and one host sync (static layouts size their transposes by it)."""
    B, H, _, W = index.shape
    listed = torch.arange(W, device=index.device) < count[..., None]  # [B, H, nr, W]
    bh = torch.arange(B * H, device=index.device).view(B, H, 1, 1) * n_cols
    keys = (bh + index.long())[listed]
    return max(int(torch.bincount(keys, minlength=1).max()), 1) if keys.numel() else 1


def _transpose_one_torch(count: torch.Tensor, index: torch.Tensor, n_cols: int, width: int):
    """One list transposed with torch ops (a stable sort of ``(bh, column)`` keys, O(nnz)): the path for CPU
    tensors on a machine whose kernels run on the GPU (a CUDA launch cannot read them)."""
    B, H, n_rows, W = index.shape
    device = index.device
    BH = B * H
    valid = torch.arange(W, device=device).view(1, 1, 1, W) < count.unsqueeze(-1)  # [B, H, nr, W]
    bh = torch.arange(BH, device=device, dtype=torch.int64).view(B, H, 1, 1)
    n_keys = BH * n_cols
    key = torch.where(valid, bh * n_cols + index.long(), torch.full_like(bh, n_keys)).flatten()
    rows = torch.arange(n_rows, device=device, dtype=torch.int64).view(1, 1, n_rows, 1).expand(B, H, n_rows, W)
    key_sorted, order = torch.sort(key, stable=True)  # entries were generated in row order: rows stay ascending
    rows_sorted = rows.flatten()[order]
    slots_sorted = order % W
    col_count = torch.bincount(key, minlength=n_keys + 1)[:n_keys]  # [BH * n_cols]
    start = torch.cumsum(col_count, 0) - col_count
    in_range = key_sorted < n_keys
    safe_key = torch.where(in_range, key_sorted, torch.zeros_like(key_sorted))
    pos = torch.arange(key_sorted.numel(), device=device) - start[safe_key]
    dest = torch.where(in_range & (pos < width), safe_key * width + pos, torch.full_like(pos, n_keys * width))
    out = torch.zeros(n_keys * width + 1, dtype=torch.int64, device=device)  # the last element is a spill slot
    out.scatter_(0, dest, rows_sorted)
    slot_out = torch.zeros_like(out)
    slot_out.scatter_(0, dest, slots_sorted)
    as_lists = lambda t: t[:-1].view(B, H, n_cols, width).to(INDEX_DTYPE)  # noqa: E731
    return col_count.view(B, H, n_cols).to(INDEX_DTYPE), as_lists(out), as_lists(slot_out)


def transpose_lists(kv_count: torch.Tensor, kv_index: torch.Tensor, full_count: torch.Tensor,
                    full_index: torch.Tensor, n_cols: int, width: Optional[int] = None,
                    full_width: Optional[int] = None, zero_pad: bool = True,
                    fast_launch: bool = True):
    """Transpose both row lists of a layout (``count [B,H,nr]``, ``index [B,H,nr,W]``; partial and full) into
    column lists over ``n_cols`` columns: ``(q_count, q_index, q_slot, full_q_count, full_q_index)``, rows
    ascending in every column, ``q_slot`` the slot of each partial entry in its forward row.

    One Triton launch (:mod:`sparseattn.kernels.transpose`) when both widths are given: no host sync, fixed
    shapes. A width left None is the longest column of that list (at least 1; :func:`longest_column`, one
    host sync). ``zero_pad`` fills the unused tail of each column with 0. ``fast_launch``: on the GPU, the
    launch skips Triton's argument binding after the first call of its kind (:mod:`sparseattn._fast_launch`;
    the same compiled kernel, the same result)."""
    from .kernels import BACKEND
    B, H, n_rows, W = kv_index.shape
    FW = full_index.shape[-1]
    device = kv_index.device
    kv_count, kv_index, full_count, full_index = (t if t.is_contiguous() else t.contiguous()
                                                  for t in (kv_count, kv_index, full_count, full_index))
    rows, cols, w_pow2 = transpose_blocks(n_rows, n_cols, max(W, FW), BACKEND == "interpreter")
    grid = (cdiv(n_cols, cols), B * H, 2)
    if width is None:
        width = longest_column(kv_count, kv_index, n_cols)
    if full_width is None:
        full_width = longest_column(full_count, full_index, n_cols)
    if device.type == "cpu" and BACKEND == "cuda":  # kernels run on the GPU: a CPU layout transposes with torch
        q_count, q_index, q_slot = _transpose_one_torch(kv_count, kv_index, n_cols, width)
        full_q_count, full_q_index, _ = _transpose_one_torch(full_count, full_index, n_cols, full_width)
        return q_count, q_index, q_slot, full_q_count, full_q_index
    from .kernels.transpose import transpose_kernel
    q_count = torch.empty(B, H, n_cols, dtype=INDEX_DTYPE, device=device)
    full_q_count = torch.empty_like(q_count)
    q_index = torch.empty(B, H, n_cols, width, dtype=INDEX_DTYPE, device=device)
    q_slot = torch.empty_like(q_index)
    full_q_index = torch.empty(B, H, n_cols, full_width, dtype=INDEX_DTYPE, device=device)
    kwargs = dict(
        COUNT=kv_count, INDEX=kv_index, FULL_COUNT=full_count, FULL_INDEX=full_index, OUT_COUNT=q_count,
        OUT_INDEX=q_index, OUT_SLOT=q_slot, OUT_FULL_COUNT=full_q_count, OUT_FULL_INDEX=full_q_index,
        n_rows=n_rows, n_cols=n_cols, W=W, FW=FW, WT=width, FWT=full_width,
        ROWS=rows, COLS=cols, W_POW2=w_pow2, ZERO_PAD=zero_pad, num_warps=4)
    launch_kernel(transpose_kernel, grid, kwargs, fast_launch)
    return q_count, q_index, q_slot, full_q_count, full_q_index


def launch_kernel(kernel, grid: tuple, kwargs: dict, fast_launch: bool = True):
    """``kernel[grid](**kwargs)``; on the GPU with ``fast_launch``, through the cached launch path
    (:mod:`sparseattn._fast_launch`: Triton binds the arguments once per specialisation, later calls go
    straight to the compiled kernel). The launch of the layout and routing kernels, which run every step."""
    from . import _fast_launch
    from .kernels import BACKEND  # the backend the kernels were defined for (as the callers' checks read it)
    if not fast_launch or BACKEND == "interpreter":
        return kernel[grid](**kwargs)
    return _fast_launch.launch(kernel, grid, None, kwargs, lambda kw: kernel[grid](**kw))


def tma_ok(*tensors) -> bool:
    """Tensor descriptors need 16-byte aligned bases and strides (and a unit last stride)."""
    return tma_bases_ok(*tensors) and tma_strides_ok(*tensors)


def tma_bases_ok(*tensors) -> bool:
    """16-byte aligned base addresses: the part of :func:`tma_ok` a call checks (a launch plan checks the
    strides once)."""
    return all(t.data_ptr() % 16 == 0 for t in tensors)


def tma_strides_ok(*tensors) -> bool:
    """:func:`tma_ok` less the base addresses: a unit last stride and 16-byte aligned other strides."""
    for t in tensors:
        if t.stride(-1) != 1 or any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def pack_bits(cells: torch.Tensor) -> torch.Tensor:
    """bool ``[..., bk]`` -> uint8 ``[..., bk // 8]``, bit j of byte i is cell ``8 i + j``."""
    weights = (1 << torch.arange(8, device=cells.device, dtype=torch.int32)).to(torch.uint8)
    c = cells.view(*cells.shape[:-1], cells.shape[-1] // 8, 8).to(torch.uint8)
    return (c * weights).sum(-1, dtype=torch.int32).to(torch.uint8)


def unpack_bits(bits: torch.Tensor) -> torch.Tensor:
    shifts = torch.arange(8, device=bits.device, dtype=torch.uint8)
    cells = (bits.unsqueeze(-1) >> shifts) & 1
    return cells.view(*bits.shape[:-1], bits.shape[-1] * 8).bool()


def lists_to_blocks(count: torch.Tensor, index: torch.Tensor, n_cols: int) -> torch.Tensor:
    """Row lists -> block-level bool ``[..., nr, n_cols]`` (spill column for padding)."""
    W = index.shape[-1]
    valid = torch.arange(W, device=index.device) < count[..., None]
    dest = torch.where(valid, index.long().clamp(0, n_cols - 1), torch.full_like(index, n_cols, dtype=torch.int64))
    out = torch.zeros(*index.shape[:-1], n_cols + 1, dtype=torch.bool, device=index.device)
    out.scatter_(-1, dest, valid)
    return out[..., :n_cols]


def tile_valid(qi, ki, bq, bk, q_len, kv_len):
    r = qi[:, None, None] * bq + torch.arange(bq, device=qi.device).view(1, bq, 1)
    c = ki[:, None, None] * bk + torch.arange(bk, device=qi.device).view(1, 1, bk)
    return (r < q_len) & (c < kv_len)


def _mask_name(mask_mod) -> str:
    return repr(getattr(mask_mod, "__name__", mask_mod))


def _check_bool(mask_mod, out) -> torch.Tensor:
    if not isinstance(out, torch.Tensor) or out.dtype != torch.bool:
        raise TypeError(f"mask_mod {_mask_name(mask_mod)} must return a bool tensor, "
                        f"got {getattr(out, 'dtype', type(out).__name__)}")
    return out


def _fits(shape, want) -> bool:
    """``shape`` broadcasts to ``want`` without changing it (a whole-tile result of the right shape)."""
    try:
        return tuple(torch.broadcast_shapes(tuple(shape), want)) == want
    except RuntimeError:
        return False


def eval_cells_vmap(mask_mod, b, h, q_abs, kv) -> torch.Tensor:
    """``mask_mod`` evaluated the way FlexAttention evaluates it: one cell at a time under ``torch.vmap``
    (index scalars), batched over tiles ``b, h [t]``, rows ``q_abs [t, bq]`` and columns ``kv [t, bk]``:
    bool ``[t, bq, bk]``. Mask_mods written for Flex (attention-gym's flamingo mask, say) may index with
    their arguments in ways that only mean the intended thing on scalars."""
    fn = torch.vmap(mask_mod, in_dims=(None, None, None, 0))  # over the columns of one row
    fn = torch.vmap(fn, in_dims=(None, None, 0, None))  # over the rows of one tile
    fn = torch.vmap(fn, in_dims=(0, 0, 0, 0))  # over tiles
    return fn(b, h, q_abs, kv)


def eval_tiles(mask_mod, b, h, qi, ki, q_offset, q_len, kv_len, bq, bk) -> torch.Tensor:
    """Evaluate ``mask_mod`` on whole tiles: bool ``[t, bq, bk]``, False outside the clipped tile.

    First vectorised (the mask_mod gets broadcasting index tensors ``[t, 1, 1]``, ``[t, bq, 1]``,
    ``[t, 1, bk]``); when that raises or returns a result that is not one value per cell, the way FlexAttention
    evaluates it (:func:`eval_cells_vmap`), so every mask_mod Flex accepts is accepted here, meaning the same."""
    dev = qi.device
    t = qi.numel()
    r = qi.long()[:, None, None] * bq + torch.arange(bq, device=dev).view(1, bq, 1)  # [t, bq, 1] local rows
    c = ki.long()[:, None, None] * bk + torch.arange(bk, device=dev).view(1, 1, bk)  # [t, 1, bk]
    q_ok, k_ok = r < q_len, c < kv_len
    # clamp so a mask_mod that indexes a per-position table never reads past its end
    q_abs = r.clamp(max=q_len - 1) + q_offset
    kv = c.clamp(max=kv_len - 1)
    bb, hh = b.long(), h.long()
    try:
        out, first = mask_mod(bb[:, None, None], hh[:, None, None], q_abs, kv), None
    except Exception as e:  # noqa: BLE001 (any failure: try Flex's way before reporting)
        out, first = None, e
    if isinstance(out, torch.Tensor) and not _fits(out.shape, (t, bq, bk)):
        # e.g. ``table[kv][0]`` picks a tile where it meant an element
        out, first = None, ValueError(f"returned shape {tuple(out.shape)} for tiles {(t, bq, bk)}")
    if out is None:
        try:
            out = eval_cells_vmap(mask_mod, bb, hh, q_abs[:, :, 0], kv[:, 0, :])
        except Exception as e:
            raise ValueError(f"mask_mod {_mask_name(mask_mod)} fails on broadcasting index tensors "
                             f"({type(first).__name__}: {first}) and under torch.vmap, as FlexAttention "
                             f"evaluates it ({type(e).__name__}: {e})") from e
    return torch.broadcast_to(_check_bool(mask_mod, out), (t, bq, bk)) & q_ok & k_ok


def compiled_mask_for(mask_mod, grid: TileGrid, warn: bool = True):
    """The compiled predicate of ``mask_mod`` for positions of ``grid`` (None when it does not trace; then one
    warning line, once per mask_mod)."""
    from . import maskc
    bound = maskc.pos_bound_for(max(grid.q_start + grid.nq * grid.block_q, grid.nk * grid.block_k))
    return maskc.compiled_for(mask_mod, pos_bound=bound, device=grid.device, warn=warn)


#: Rows of a tile the classification kernel evaluates a step (None: by backend, below); tests set a few to run
#: the kernel's early exit (a tile found partial in its first rows) in the interpreter.
MASK_TILE_ROWS: Optional[int] = None


def _mask_tiles_launch(compiled, b, h, qi, ki, q_offset, q_len, kv_len, bq, bk, cells: bool, whole_grid=None,
                       device=None):
    """Run :mod:`sparseattn.kernels.mask_tiles` over the listed tiles, or, with ``whole_grid = (B, H, nq, nk)``
    and no list (``b``, ``h``, ``qi``, ``ki`` None, ``device`` given), over every tile of that grid in row-major
    order: ``(any [t], all [t], cells or None)``."""
    from .kernels import BACKEND
    from .kernels.mask_tiles import mask_tiles_kernel
    if whole_grid is None:
        dev, t, n_heads, n_q, n_k = b.device, b.numel(), 1, 1, 1
        i32 = lambda x: x.to(torch.int32).contiguous()  # noqa: E731
        tiles = dict(TB=i32(b), TH=i32(h), TQ=i32(qi), TK=i32(ki))
    else:
        (B, n_heads, n_q, n_k), dev = whole_grid, device
        t = B * n_heads * n_q * n_k
        tiles = dict(TB=None, TH=None, TQ=None, TK=None)
    some = torch.empty(t, dtype=torch.int8, device=dev)
    every = torch.empty_like(some)
    out = torch.empty(t, bq, bk, dtype=torch.int8, device=dev) if cells else None
    if t:
        # the interpreter runs a whole tile per step (one numpy call per operation); a GPU a few rows a step
        rows = MASK_TILE_ROWS or (bq if BACKEND == "interpreter" else max(1, min(bq, 4096 // bk)))
        mask_tiles_kernel[(t,)](**tiles, ANY=some, ALL=every, CELLS=out, q_offset=q_offset, q_len=q_len,
                                kv_len=kv_len, n_heads=n_heads, n_q=n_q, n_k=n_k, **compiled.kernel_args(dev),
                                BOUNDS_FN=TILE_BOUNDS and compiled.bounds or None, BLOCK_Q=bq, BLOCK_K=bk,
                                ROWS=rows, num_warps=4)
    return some.bool(), every.bool(), None if out is None else out.bool()


#: The classification kernel first decides each tile from the compiled mask's interval bounds
#: (:func:`sparseattn.maskc.generate_bounds`) and skips the cells of the tiles they decide (False: every
#: tile's cells). Measured on the H200 (``book/data/bench/checks/layout-tile-bounds-1-h200.json`` and
#: ``-h200.json``, 2026-12-01 16:33 and 17:11 UTC, host ms of a build, stripes from a plain lambda, no bounds
#: -> the kernel's): 1.08 -> 0.63 and 1.16 -> 0.72 at N = 32k, 11.39 -> 4.25 and 11.29 -> 4.21 at 128k; at 8k
#: 0.77 -> 0.88 and 0.66 -> 0.63 (the host timer's spread there).
TILE_BOUNDS = True


def eval_tiles_compiled(compiled, b, h, qi, ki, q_offset, q_len, kv_len, bq, bk) -> torch.Tensor:
    """:func:`eval_tiles` by the compiled predicate on the device: bool ``[t, bq, bk]``."""
    return _mask_tiles_launch(compiled, b, h, qi, ki, q_offset, q_len, kv_len, bq, bk, cells=True)[2]


#: Before the classification kernel, the traced bounds run only when at least this many tiles are undecided
#: (None: never; 0: always). They cost 0.64-0.73 ms on the H200 whatever the size (70-odd small tensor
#: launches). Before :data:`TILE_BOUNDS` they paid from about 60 000 tiles (stripes from a plain lambda: 1.62
#: ms without them and 2.38 with them at N = 32k, 11.96 and 4.97 ms at 128k; the gate was 2^17); the kernel
#: now asks the same bounds itself, and the host's only repeat its work: at 128k 4.25 ms with the kernel's
#: bounds alone, 5.35 with both, 4.63 with the host's alone (``checks/layout-tile-bounds-1-h200.json``);
#: never is the default since, measured at 4.05 ms (``-h200.json``, 17:11). Kept for the A/B:
#: ``book/data/bench/checks/layout-traced-bounds.py``.
TRACED_BOUNDS_MIN_TILES: Optional[int] = None

_CLASSIFY_KERNEL: Optional[bool] = None  # None: the kernel on CUDA devices, torch elsewhere


#: A mask with a tile rule on a grid of fewer tiles than this goes to the classification kernel whole, as a
#: plain lambda does (its rule's torch ops, the ``nonzero`` and its host sync skipped; the kernel's compiled
#: bounds decide the tiles the rule would). None: never. Measured on the H200
#: (``book/data/bench/checks/layout-rule-vs-kernel-h200.json``, host ms of a build, whole grid / rule): at
#: N = 8k (4k tiles) 0.19-0.55 on the six rule patterns, at 32k (64k tiles) 0.19-0.59 except a block table's
#: lookup (1.32: the bounds cannot see into the table, so every cell of the empty tiles is evaluated), at
#: 131k (1M tiles) 1.2-18 but for sinks + window (0.47).
RULE_MASKS_WHOLE_GRID_BELOW: Optional[int] = 1 << 17
#: ... and only while the kernel would evaluate at most this many cells one by one: those of the tiles its
#: compiled bounds leave undecided (:func:`open_cells`; the bounds know nothing of a captured table's entries
#: nor see through a hash). Same record, whole grid / rule at N = 32k: dilated 4 in a causal mask (2^29 open
#: cells) 0.27, documents in a causal mask (2^29) 0.39, the block-random hash (2^30, no tile decided) 1.32;
#: at 8k every rule pattern won (at most 2^26).
RULE_MASKS_WHOLE_GRID_CELLS = 3 << 28
_OPEN_CELLS: dict = {}
_MAX_OPEN_CELLS = 256  # kept counts; a process building many lengths starts over rather than grow


def open_cells(compiled, mask_mod, grid: TileGrid) -> int:
    """Cells the whole-grid classification kernel evaluates one by one for ``mask_mod`` (``compiled`` its
    compiled form) on ``grid``: those of the tiles the traced bounds (:func:`sparseattn.maskc.tile_bounds`,
    which, like the kernel's, treat a captured table's entries as unknown) leave undecided. They follow from
    the traced expression and the grid, not from a table's values, so the count is computed once per
    expression and grid, on the CPU (0.7 ms for a causal mask of documents at 32k, then a dictionary lookup)."""
    from . import maskc
    key = (compiled.key, grid.q_start, grid.q_len, grid.kv_len, grid.block_q, grid.block_k, grid.B, grid.H)
    if key not in _OPEN_CELLS:
        bounds = maskc.tile_bounds(mask_mod, dataclasses.replace(grid, device=torch.device("cpu")))
        undecided = bounds.any_hi & ~bounds.all_lo
        if len(_OPEN_CELLS) >= _MAX_OPEN_CELLS:
            _OPEN_CELLS.clear()
        _OPEN_CELLS[key] = int(undecided.sum()) * grid.block_q * grid.block_k
    return _OPEN_CELLS[key]


@contextlib.contextmanager
def classify_kernel(use: Optional[bool]):
    """Within the block, layout builds reduce undecided tiles with the compiled predicate (``True``), with
    eager torch (``False``) or by device (None, the default): the layout suite's A/B and the tests."""
    global _CLASSIFY_KERNEL
    before, _CLASSIFY_KERNEL = _CLASSIFY_KERNEL, use
    try:
        yield
    finally:
        _CLASSIFY_KERNEL = before


def classify(mask_mod, grid: TileGrid, listed: Optional[torch.Tensor], use_kernel: Optional[bool] = None):
    """Block-level ``(partial, full)`` for ``mask_mod`` (restricted to ``listed`` tiles when given).

    The tile rule decides what it can. The undecided tiles are reduced on the device by the compiled
    predicate (:mod:`sparseattn.maskc`, one program per tile, nothing per cell stored) when ``use_kernel``
    (default: on a CUDA device) and the mask compiles; else evaluated with torch in chunks, and then first
    the traced mask's interval bounds (:func:`sparseattn.maskc.tile_bounds`) empty or fill what they can (a
    plain lambda has no rule of its own). The bounds pay only there: torch evaluates every cell of an
    undecided tile, while the kernel proves a tile in one program and its early exit settles a partial one
    in its first rows, so before the kernel the bounds' few dozen small tensor launches pay only on large
    grids (:data:`TRACED_BOUNDS_MIN_TILES`). The kernel itself first asks the same bounds, compiled to scalar
    code, about each tile it is given (:data:`TILE_BOUNDS`), and evaluates no cell of a tile they decide. A
    mask with no rule at all (a plain function) on a smaller grid sends every tile to the kernel without
    listing them: no ``nonzero``, no host sync."""
    from . import maskc
    shape = (grid.B, grid.H, grid.nq, grid.nk)
    if use_kernel is None:
        use_kernel = _CLASSIFY_KERNEL if _CLASSIFY_KERNEL is not None else grid.device.type == "cuda"
    n_tiles = grid.B * grid.H * grid.nq * grid.nk
    least = TRACED_BOUNDS_MIN_TILES
    has_rule = getattr(mask_mod, "tile_rule", None) is not None
    if has_rule:
        whole = RULE_MASKS_WHOLE_GRID_BELOW is not None and n_tiles < RULE_MASKS_WHOLE_GRID_BELOW
    else:
        whole = least is None or n_tiles < least
    if whole and listed is None and use_kernel:
        # a rule mask that does not compile keeps its rule quietly (it warns below only if tiles stay open)
        compiled = compiled_mask_for(mask_mod, grid, warn=not has_rule)
        # a rule mask goes whole only while the kernel's bounds leave few cells open (a plain lambda has no
        # rule to fall back on)
        few = not has_rule or compiled is None or \
            open_cells(compiled, mask_mod, grid) <= RULE_MASKS_WHOLE_GRID_CELLS
        if compiled is not None and few:  # every tile to the kernel, no list of them
            any_, all_, _ = _mask_tiles_launch(compiled, None, None, None, None, grid.q_start, grid.q_len,
                                               grid.kv_len, grid.block_q, grid.block_k, cells=False,
                                               whole_grid=shape, device=grid.device)
            full = all_.view(shape)
            return any_.view(shape) & ~full, full
    bounds = tile_rule_of(mask_mod)(grid)
    any_lo, any_hi, all_lo, all_hi = (torch.broadcast_to(x.to(grid.device), shape) for x in bounds)
    full = all_lo.clone()
    partial = any_lo & ~all_hi & ~full
    undecided = any_hi & ~full & ~partial
    if listed is not None:
        full, partial, undecided = full & listed, partial & listed, undecided & listed
    b, h, qi, ki = undecided.nonzero(as_tuple=True)
    compiled = compiled_mask_for(mask_mod, grid) if use_kernel and b.numel() else None
    bound_first = compiled is None or (least is not None and b.numel() >= least)
    traced = maskc.tile_bounds(mask_mod, grid) if b.numel() and bound_first else None
    if traced is not None:  # a few elementwise ops per node of the expression over the tile grid
        surely_full = traced.all_lo.to(grid.device)
        surely_empty = ~traced.any_hi.to(grid.device)
        full = full | (undecided & surely_full)
        undecided = undecided & ~surely_full & ~surely_empty
        b, h, qi, ki = undecided.nonzero(as_tuple=True)
    if compiled is not None:
        any_, all_, _ = _mask_tiles_launch(compiled, b, h, qi, ki, grid.q_start, grid.q_len, grid.kv_len,
                                           grid.block_q, grid.block_k, cells=False)
        full[b, h, qi, ki] = all_
        partial[b, h, qi, ki] = any_ & ~all_
        return partial.contiguous(), full.contiguous()
    step = max(1, cells_per_chunk(grid.device) // (grid.block_q * grid.block_k))
    for s in range(0, b.numel(), step):
        sl = slice(s, s + step)
        cells = eval_tiles(mask_mod, b[sl], h[sl], qi[sl], ki[sl], grid.q_start, grid.q_len, grid.kv_len,
                            grid.block_q, grid.block_k)
        valid = tile_valid(qi[sl], ki[sl], grid.block_q, grid.block_k, grid.q_len, grid.kv_len)
        any_ = cells.flatten(1).any(1)
        all_ = (cells | ~valid).flatten(1).all(1)
        full[b[sl], h[sl], qi[sl], ki[sl]] = all_
        partial[b[sl], h[sl], qi[sl], ki[sl]] = any_ & ~all_
    return partial.contiguous(), full.contiguous()
