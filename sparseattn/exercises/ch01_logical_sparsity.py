"""Chapter 1 exercises: count the work a pattern keeps, and walk only the listed tiles.

* :func:`tile_work_scaffold` -- from a token mask, the allowed cells (logical work), the cells of the tiles
  that hold at least one allowed cell (physical work: what a block-sparse kernel multiplies) and how many
  such tiles there are. Checked against :meth:`sparseattn.BlockLayout.stats`.
* :func:`visit_scaffold` -- a ``@triton.jit`` fragment: one program per query tile sums the key rows of the
  key tiles its row of the block table lists, and of no other tile (the loop of
  ``sparseattn.kernels.prefill_fwd._fwd_tiles``, without the attention). Checked in the Triton interpreter.

A blank is a call of :func:`sparseattn.exercises.blank`; replace it with your code.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from ..layout import BlockLayout
from . import Exercise, blank, interpreted, passed, run

__all__ = ["tile_work_scaffold", "tile_work_solution", "check_tile_work", "visit_scaffold", "visit_solution",
           "check_visit", "EXERCISES"]


# ---------------------------------------------------------------------------------------------------------
# 1. logical and physical work of a mask
# ---------------------------------------------------------------------------------------------------------
def tile_work_scaffold(mask: torch.Tensor, block: int) -> dict:
    """``mask``: bool ``[L, L]`` (queries x keys). Returns ``{"logical", "physical", "tiles"}``: allowed cells,
    cells of the ``block x block`` tiles holding an allowed cell (clipped at the edge), and those tiles."""
    L_q, L_k = mask.shape
    nq, nk = math.ceil(L_q / block), math.ceil(L_k / block)
    padded = torch.zeros(nq * block, nk * block, dtype=torch.bool)
    padded[:L_q, :L_k] = mask
    tiles = padded.view(nq, block, nk, block)  # [nq, block, nk, block]
    listed = blank("bool [nq, nk]: True where the tile holds at least one allowed cell")
    rows = torch.clamp(L_q - torch.arange(nq) * block, max=block)  # [nq] in-range rows per tile row
    cols = torch.clamp(L_k - torch.arange(nk) * block, max=block)  # [nk]
    physical = int((listed * rows[:, None] * cols[None, :]).sum())
    return {"logical": int(mask.sum()), "physical": physical, "tiles": int(listed.sum())}


def tile_work_solution(mask: torch.Tensor, block: int) -> dict:
    """``mask``: bool ``[L, L]`` (queries x keys). Returns ``{"logical", "physical", "tiles"}``: allowed cells,
    cells of the ``block x block`` tiles holding an allowed cell (clipped at the edge), and those tiles."""
    L_q, L_k = mask.shape
    nq, nk = math.ceil(L_q / block), math.ceil(L_k / block)
    padded = torch.zeros(nq * block, nk * block, dtype=torch.bool)
    padded[:L_q, :L_k] = mask
    tiles = padded.view(nq, block, nk, block)  # [nq, block, nk, block]
    listed = tiles.any(dim=3).any(dim=1)  # [nq, nk]
    rows = torch.clamp(L_q - torch.arange(nq) * block, max=block)  # [nq] in-range rows per tile row
    cols = torch.clamp(L_k - torch.arange(nk) * block, max=block)  # [nk]
    physical = int((listed * rows[:, None] * cols[None, :]).sum())
    return {"logical": int(mask.sum()), "physical": physical, "tiles": int(listed.sum())}


def _masks():
    g = torch.Generator().manual_seed(1)
    L = 200  # not a multiple of the tile: edge tiles are clipped
    q, k = torch.arange(L)[:, None], torch.arange(L)[None, :]
    return {"causal": k <= q, "window 40": (q - k >= 0) & (q - k < 40), "sinks 8 + window 24":
            (k <= q) & ((k < 8) | (q - k < 24)), "random 3%": torch.rand(L, L, generator=g) < 0.03}


def check_tile_work(fn) -> None:
    """Run ``fn(mask, block)`` on four masks of 200 x 200 tokens at tiles of 32 and 64 against
    ``BlockLayout.from_dense(...).stats()``; print what it found."""
    for name, mask in _masks().items():
        for block in (32, 64):
            got = run("tile_work", lambda: fn(mask, block))
            st = BlockLayout.from_dense(mask.view(1, 1, *mask.shape), block, block).stats()
            want = {"logical": st["logical_edges"], "physical": st["physical_edges"], "tiles": st["listed_tiles"]}
            for key in want:
                if got.get(key) != want[key]:
                    raise AssertionError(f"tile_work, {name}, tiles {block}: {key} = {got.get(key)}, expected "
                                         f"{want[key]} (BlockLayout.from_dense(...).stats())")
    mask = _masks()["window 40"]
    r = tile_work_solution(mask, 64)
    passed("tile_work", f"a 40-token window, 64 x 64 tiles: {r['tiles']} tiles, physical / logical = "
                        f"{r['physical'] / r['logical']:.2f}")


# ---------------------------------------------------------------------------------------------------------
# 2. a loop over the listed tiles only
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def visit_scaffold(K, COUNT, INDEX, OUT, width, Lk, BLOCK_K: tl.constexpr, D: tl.constexpr):
    """One program per query tile ``row``: OUT[row] = sum of the key rows of the tiles listed in
    INDEX[row, :COUNT[row]] (keys past ``Lk`` are zero)."""
    row = tl.program_id(0)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    n_tiles = tl.load(COUNT + row)  # how many key tiles this query tile lists
    for slot in range(0, n_tiles):
        kb = blank("which key tile: entry `slot` of this row of INDEX (rows are `width` apart)")
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        b_k = tl.load(K + offs_k[:, None] * D + offs_d[None, :], mask=(offs_k < Lk)[:, None], other=0.0)  # [BK, D]
        acc += tl.sum(b_k, 0)
    tl.store(OUT + row * D + offs_d, acc)


@triton.jit
def visit_solution(K, COUNT, INDEX, OUT, width, Lk, BLOCK_K: tl.constexpr, D: tl.constexpr):
    """One program per query tile ``row``: OUT[row] = sum of the key rows of the tiles listed in
    INDEX[row, :COUNT[row]] (keys past ``Lk`` are zero)."""
    row = tl.program_id(0)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    n_tiles = tl.load(COUNT + row)  # how many key tiles this query tile lists
    for slot in range(0, n_tiles):
        kb = tl.load(INDEX + row * width + slot)  # the slot-th listed key tile; padding past COUNT is never read
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
        b_k = tl.load(K + offs_k[:, None] * D + offs_d[None, :], mask=(offs_k < Lk)[:, None], other=0.0)  # [BK, D]
        acc += tl.sum(b_k, 0)
    tl.store(OUT + row * D + offs_d, acc)


def check_visit(fn) -> None:
    """Run the fragment on the block table of a 200-token sliding window (tiles of 32; the padding past each
    row's count names a real tile the row does not list) and compare each query tile's sum with the listed
    tiles' keys."""
    L, block, D = 200, 32, 16
    q, k = torch.arange(L)[:, None], torch.arange(L)[None, :]
    layout = BlockLayout.from_dense(((q - k >= 0) & (q - k < 40)).view(1, 1, L, L), block, block)
    partial, full = layout.block_classes()
    listed = (partial | full)[0, 0]  # [nq, nk]
    nq, nk = listed.shape
    count = listed.sum(1).to(torch.int32)
    width = nk
    index = torch.zeros((nq, width), dtype=torch.int32)
    for r in range(nq):
        cols = listed[r].nonzero().flatten()
        index[r, :len(cols)] = cols.to(torch.int32)
        index[r, len(cols):] = int((~listed[r]).nonzero()[0])  # padding: a real tile this row does not list
    keys = torch.randn(L, D, generator=torch.Generator().manual_seed(0))
    out = torch.full((nq, D), float("nan"))
    run("visit", lambda: interpreted(fn)[(nq,)](keys, count, index, out, width, L, BLOCK_K=block, D=D))
    tile_of_key = torch.arange(L) // block
    want = torch.stack([keys[listed[r][tile_of_key]].sum(0) for r in range(nq)])
    err = (out - want).abs()
    if not torch.isfinite(out).all() or float(err.max()) > 1e-4:
        bad = int(torch.nan_to_num(err, nan=float("inf")).amax(1).argmax())
        raise AssertionError(f"visit: query tile {bad} lists key tiles {listed[bad].nonzero().flatten().tolist()}; its "
                             f"sum is off by {float(torch.nan_to_num(err[bad], nan=float('inf')).max()):.3g} (did the "
                             f"loop read past COUNT, or the wrong row of INDEX?)")
    passed("visit", f"{int(count.sum())} of {nq * nk} tiles visited")


# ---------------------------------------------------------------------------------------------------------
# the mistakes people make (the tests show that each check rejects them)
# ---------------------------------------------------------------------------------------------------------
def _tile_work_full_tiles_only(mask: torch.Tensor, block: int) -> dict:
    """Counts only the tiles whose every cell is allowed: the partial tiles on a pattern's edge are work too."""
    L_q, L_k = mask.shape
    nq, nk = math.ceil(L_q / block), math.ceil(L_k / block)
    padded = torch.ones(nq * block, nk * block, dtype=torch.bool)
    padded[:L_q, :L_k] = mask
    listed = padded.view(nq, block, nk, block).all(dim=3).all(dim=1)
    rows = torch.clamp(L_q - torch.arange(nq) * block, max=block)
    cols = torch.clamp(L_k - torch.arange(nk) * block, max=block)
    return {"logical": int(mask.sum()), "physical": int((listed * rows[:, None] * cols[None, :]).sum()),
            "tiles": int(listed.sum())}


def _tile_work_unclipped(mask: torch.Tensor, block: int) -> dict:
    """Every listed tile counted as ``block x block`` cells, also past the end of the sequence."""
    r = tile_work_solution(mask, block)
    return {**r, "physical": r["tiles"] * block * block}


def _visit_whole_row(K, COUNT, INDEX, OUT, width, Lk, BLOCK_K: tl.constexpr, D: tl.constexpr):
    """Walks the whole row of INDEX, padding included: the padding names tiles the row does not list."""
    row = tl.program_id(0)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    for slot in range(0, width):
        kb = tl.load(INDEX + row * width + slot)
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        b_k = tl.load(K + offs_k[:, None] * D + offs_d[None, :], mask=(offs_k < Lk)[:, None], other=0.0)
        acc += tl.sum(b_k, 0)
    tl.store(OUT + row * D + offs_d, acc)


def _visit_first_row(K, COUNT, INDEX, OUT, width, Lk, BLOCK_K: tl.constexpr, D: tl.constexpr):
    """Reads entry ``slot`` of the first row for every program (forgets ``row * width``)."""
    row = tl.program_id(0)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([D], tl.float32)
    n_tiles = tl.load(COUNT + row)
    for slot in range(0, n_tiles):
        kb = tl.load(INDEX + slot)
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        b_k = tl.load(K + offs_k[:, None] * D + offs_d[None, :], mask=(offs_k < Lk)[:, None], other=0.0)
        acc += tl.sum(b_k, 0)
    tl.store(OUT + row * D + offs_d, acc)


EXERCISES = [
    Exercise("tile_work", tile_work_scaffold, tile_work_solution, check_tile_work,
             mistakes=(_tile_work_full_tiles_only, _tile_work_unclipped),
             prompt="the tiles that hold at least one allowed cell"),
    Exercise("visit", visit_scaffold, visit_solution, check_visit, mistakes=(_visit_whole_row, _visit_first_row),
             prompt="the key tile of slot `slot` of this row of the block table"),
]
