"""The transposed block lists in one launch: for every key tile, the query tiles that list it, rows ascending.

One program per (block of ``COLS`` key columns, batch * layout head, which list). It walks the rows in order,
``ROWS`` at a time. For every (row, column) pair it finds the column in the row's ascending list by a binary
search of ``log2(W)`` loads (no compare against all ``W`` entries, so a wide static layout costs
``O(rows x cols x log W)``, not ``O(rows x cols x W)``); the slot where it is found is the entry's slot in its
forward row (where its tile bits and member bits live). That gives a hit matrix ``[ROWS, COLS]`` of 0/1
(a row lists a column at most once). A column's next free position is a ``[COLS]`` register vector ``pos``;
the chunk's hits land at ``pos + cumsum(hit over rows) - 1`` and ``pos`` advances by the chunk's hits. Rows
are visited in order, so every column comes out ascending, with no sort, no atomics and no dynamic register
indexing: the result is deterministic and, with a fixed output width, needs no host synchronisation.

Both lists of a layout (partial and full tiles) go through one launch (grid axis 2), counts included.
``ZERO_PAD`` writes 0 into the unused tail of every column (the static layouts' historic output; a dynamic
layout skips it: padding is never read).
"""
import triton
import triton.language as tl


@triton.jit
def _transpose_list(COUNT, INDEX, W, OUT_COUNT, OUT_INDEX, OUT_SLOT, WT, bh, col0, n_rows, n_cols,
                    ROWS: tl.constexpr, COLS: tl.constexpr, W_POW2: tl.constexpr, HAS_SLOT: tl.constexpr,
                    ZERO_PAD: tl.constexpr):
    LOG_W: tl.constexpr = W_POW2.bit_length() - 1
    cols = col0 + tl.arange(0, COLS)  # [CB] the columns this program owns
    c_ok = cols < n_cols
    pos = tl.zeros([COLS], tl.int32)  # next free position of each column
    row_base = bh * n_rows
    for r0 in range(0, n_rows, ROWS):
        rows = r0 + tl.arange(0, ROWS)  # [RB]
        n_listed = tl.load(COUNT + row_base + rows, mask=rows < n_rows, other=0)  # [RB]
        row_ptr = INDEX + (row_base + rows[:, None]).to(tl.int64) * W  # [RB, 1]
        # lower bound of every column in every row's ascending list, by binary lifting: after the loop
        # ``lo`` = number of listed tiles below the column (W_POW2 > W, so the steps reach any count)
        lo = tl.zeros([ROWS, COLS], tl.int32)
        for i in tl.static_range(LOG_W):
            probe = lo + (W_POW2 >> (i + 1))  # [RB, CB]
            inside = probe <= n_listed[:, None]
            b_v = tl.load(row_ptr + probe - 1, mask=inside, other=0)
            lo = tl.where(inside & (b_v < cols[None, :]), probe, lo)
        b_at = tl.load(row_ptr + lo, mask=lo < n_listed[:, None], other=-1)  # [RB, CB]
        hit = (b_at == cols[None, :]).to(tl.int32)  # the row lists the column (at slot lo)
        dest = pos[None, :] + tl.cumsum(hit, 0) - 1  # [RB, CB] ascending rows within each column
        ok = (hit > 0) & (dest < WT)  # a fixed width too small for a column drops entries, never overflows
        out = (bh * n_cols + cols[None, :]).to(tl.int64) * WT + dest  # [RB, CB]
        tl.store(OUT_INDEX + out, tl.broadcast_to(rows[:, None], [ROWS, COLS]), mask=ok)
        if HAS_SLOT:
            tl.store(OUT_SLOT + out, lo, mask=ok)
        pos += tl.sum(hit, 0)
    tl.store(OUT_COUNT + bh * n_cols + cols, pos, mask=c_ok)
    if ZERO_PAD:
        offs_w = tl.arange(0, ROWS)
        for w0 in range(0, WT, ROWS):
            w = w0 + offs_w  # [RB]
            pad = c_ok[:, None] & (w[None, :] >= pos[:, None]) & (w[None, :] < WT)  # [CB, RB]
            out = (bh * n_cols + cols[:, None]).to(tl.int64) * WT + w[None, :]
            tl.store(OUT_INDEX + out, tl.zeros([COLS, ROWS], tl.int32), mask=pad)
            if HAS_SLOT:
                tl.store(OUT_SLOT + out, tl.zeros([COLS, ROWS], tl.int32), mask=pad)


@triton.heuristics({"HAS_SLOT": lambda a: a["OUT_SLOT"] is not None})
@triton.jit
def transpose_kernel(
    COUNT, INDEX, FULL_COUNT, FULL_INDEX, OUT_COUNT, OUT_INDEX, OUT_SLOT, OUT_FULL_COUNT, OUT_FULL_INDEX,
    n_rows, n_cols, W, FW, WT, FWT,
    ROWS: tl.constexpr, COLS: tl.constexpr, W_POW2: tl.constexpr, HAS_SLOT: tl.constexpr,
    ZERO_PAD: tl.constexpr,
):
    col0 = tl.program_id(0) * COLS
    bh = tl.program_id(1)
    if tl.program_id(2) == 0:  # partial tiles: also the slot each entry has in its forward row (its bits)
        _transpose_list(COUNT, INDEX, W, OUT_COUNT, OUT_INDEX, OUT_SLOT, WT, bh, col0, n_rows, n_cols,
                        ROWS, COLS, W_POW2, HAS_SLOT, ZERO_PAD)
    else:
        _transpose_list(FULL_COUNT, FULL_INDEX, FW, OUT_FULL_COUNT, OUT_FULL_INDEX, OUT_SLOT, FWT, bh, col0,
                        n_rows, n_cols, ROWS, COLS, W_POW2, False, ZERO_PAD)
