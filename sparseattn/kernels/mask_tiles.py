"""A compiled mask_mod evaluated on whole tiles: one program per listed tile ``(b, h, q tile, k tile)``.

The layout build classifies the tiles its tile rule leaves undecided by reducing the compiled predicate
(:mod:`sparseattn.maskc`) over each tile to two facts, *some cell allowed* and *every in-range cell allowed*;
no cell is ever written to memory, so the cost is the evaluation itself and memory stays O(tiles). With
``CELLS`` given the program also writes the tile's cells (int8 ``[T, BLOCK_Q, BLOCK_K]``, 0 outside the
sequences): what tests compare cell by cell against the eager mask_mod. Without it, a tile whose first
``ROWS`` rows already hold an allowed and a masked cell is partial and its other rows are never evaluated.
Without a tile list (``TB`` None) the launch covers every tile of the ``[B, H, nq, nk]`` grid, program ``t``
its ``t``-th tile in row-major order: a mask with no tile rule leaves every tile undecided, and listing them
would cost a ``nonzero`` (a host sync) and four index tensors for nothing. ``BOUNDS_FN`` (the compiled mask's
interval bounds, :func:`sparseattn.maskc.generate_bounds`) decides a tile from its corner positions before
any cell is evaluated: a tile above a causal diagonal is empty in a few scalar operations instead of
``BLOCK_Q x BLOCK_K`` predicate evaluations.
"""
import triton
import triton.language as tl


@triton.jit
def _rows(b, h, q0, r0, k_pos, k_ok, q_offset, q_len, MASK_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
          ROWS: tl.constexpr):
    """The predicate on rows ``q0 + r0 .. + ROWS`` of the tile: ``(allowed, in range)``, both ``[R, BK]``."""
    rows = q0 + r0 + tl.arange(0, ROWS)  # [R] local query rows
    ok = (rows < q_len)[:, None] & k_ok[None, :]  # [R, BK]
    allowed = MASK_FN(b, h, (rows + q_offset)[:, None], k_pos[None, :], CAP0, CAP1, CAP2, CAP3, CAP_SHAPE)
    return allowed, ok


@triton.heuristics({"WRITE_CELLS": lambda a: a["CELLS"] is not None, "EVERY_TILE": lambda a: a["TB"] is None})
@triton.jit
def mask_tiles_kernel(TB, TH, TQ, TK, ANY, ALL, CELLS, q_offset, q_len, kv_len, n_heads, n_q, n_k,
                      MASK_FN: tl.constexpr, BOUNDS_FN: tl.constexpr, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE,
                      BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, ROWS: tl.constexpr,
                      WRITE_CELLS: tl.constexpr, EVERY_TILE: tl.constexpr):
    t = tl.program_id(0)
    if EVERY_TILE:  # no list: program t is tile t of the whole [B, H, nq, nk] grid, row-major
        ki = t % n_k
        qi = (t // n_k) % n_q
        h = (t // (n_k * n_q)) % n_heads
        b = t // (n_k * n_q * n_heads)
    else:
        b = tl.load(TB + t)
        h = tl.load(TH + t)
        qi = tl.load(TQ + t)
        ki = tl.load(TK + t)
    q0 = qi * BLOCK_Q
    k_pos = ki * BLOCK_K + tl.arange(0, BLOCK_K)  # [BK]
    k_ok = k_pos < kv_len
    if WRITE_CELLS:  # every cell is needed: all rows
        some = tl.zeros([ROWS, BLOCK_K], tl.int32)
        every = tl.full([ROWS, BLOCK_K], 1, tl.int32)
        for r0 in range(0, BLOCK_Q, ROWS):
            allowed, ok = _rows(b, h, q0, r0, k_pos, k_ok, q_offset, q_len, MASK_FN, CAP0, CAP1, CAP2, CAP3,
                                CAP_SHAPE, ROWS)
            some = some | (allowed & ok).to(tl.int32)
            every = every & (allowed | ~ok).to(tl.int32)
            local = (r0 + tl.arange(0, ROWS))[:, None] * BLOCK_K + tl.arange(0, BLOCK_K)[None, :]
            tl.store(CELLS + t.to(tl.int64) * (BLOCK_Q * BLOCK_K) + local, (allowed & ok).to(tl.int8))
        tl.store(ANY + t, tl.max(tl.max(some, 1), 0).to(tl.int8))
        tl.store(ALL + t, tl.min(tl.min(every, 1), 0).to(tl.int8))
    else:
        if BOUNDS_FN is not None:  # the mask's interval bounds over the whole tile (maskc.generate_bounds)
            q_lo = q0 + q_offset
            q_hi = tl.minimum(q0 + BLOCK_Q, q_len) - 1 + q_offset
            k_lo = ki * BLOCK_K
            k_hi = tl.minimum(k_lo + BLOCK_K, kv_len) - 1
            may_true, may_false = BOUNDS_FN(b, h, q_lo, q_hi, k_lo, k_hi)
            if (may_true == 0) | (may_false == 0):  # empty or full whatever its cells: none is evaluated
                tl.store(ANY + t, may_true.to(tl.int8))
                tl.store(ALL + t, (may_false == 0).to(tl.int8))
                return
        # the first rows alone settle most partial tiles (one allowed and one masked cell make a tile
        # partial); only a tile still all-allowed or all-masked there reads its other rows
        allowed, ok = _rows(b, h, q0, 0, k_pos, k_ok, q_offset, q_len, MASK_FN, CAP0, CAP1, CAP2, CAP3,
                            CAP_SHAPE, ROWS)
        some = (allowed & ok).to(tl.int32)  # [R, BK]
        every = (allowed | ~ok).to(tl.int32)
        any_ = tl.max(tl.max(some, 1), 0)
        all_ = tl.min(tl.min(every, 1), 0)
        if (any_ == 0) | (all_ == 1):
            for r0 in range(ROWS, BLOCK_Q, ROWS):
                allowed, ok = _rows(b, h, q0, r0, k_pos, k_ok, q_offset, q_len, MASK_FN, CAP0, CAP1, CAP2,
                                    CAP3, CAP_SHAPE, ROWS)
                some = some | (allowed & ok).to(tl.int32)
                every = every & (allowed | ~ok).to(tl.int32)
            any_ = tl.max(tl.max(some, 1), 0)
            all_ = tl.min(tl.min(every, 1), 0)
        tl.store(ANY + t, any_.to(tl.int8))
        tl.store(ALL + t, all_.to(tl.int8))
