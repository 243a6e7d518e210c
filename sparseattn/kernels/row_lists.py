"""Block-level class masks to the layout's row lists in two small launches (``_tiles.class_lists``).

A layout lists, for every query tile row, the key tiles it visits, ascending, once for partial and once for
full tiles, in arrays as wide as the longest row. The width is only known once every row is counted, so the
build needs one host synchronisation whatever does it; the torch version spends about 22 small launches
around it (sums, maxima, a cumsum, a scatter per class), which at N = 32k took longer on the host than the
classification kernel itself (``book/data/bench/checks/layout-build-profile-h200.json``).

Here the first launch (``WRITE=False``) counts every row of both classes and raises the two widths with an
atomic maximum; the host reads the widths (the one sync) and allocates the lists; the second launch
(``WRITE=True``) recounts and writes each kept column at ``count so far + cumsum - 1`` of its row, then zero
pads the tail. One program owns ``ROWS`` rows of one class (grid axis 1) and walks the columns ``COLS`` at a
time; a row's running count is a ``[ROWS]`` register vector, so the columns come out ascending with no sort
and no atomics on the lists: the result is the torch version's, bit for bit.
"""
import triton
import triton.language as tl


@triton.jit
def _row_list(BLOCKS, COUNT, INDEX, WIDTH, rows, row_ok, n_cols, W, ROWS: tl.constexpr, COLS: tl.constexpr,
              WRITE: tl.constexpr):
    row_off = rows.to(tl.int64)  # [RB]
    b_n = tl.zeros([ROWS], tl.int32)  # columns kept so far in each row
    for c0 in range(0, n_cols, COLS):
        cols = c0 + tl.arange(0, COLS)  # [CB]
        ok = row_ok[:, None] & (cols[None, :] < n_cols)  # [RB, CB]
        b_keep = tl.load(BLOCKS + row_off[:, None] * n_cols + cols[None, :], mask=ok, other=0).to(tl.int32)
        if WRITE:
            dest = b_n[:, None] + tl.cumsum(b_keep, 1) - 1  # [RB, CB] the kept column's slot in its row
            tl.store(INDEX + row_off[:, None] * W + dest, tl.broadcast_to(cols[None, :], [ROWS, COLS]),
                     mask=b_keep > 0)
        b_n += tl.sum(b_keep, 1)
    if WRITE:
        for w0 in range(0, W, COLS):  # the unused tail of every row is 0, as the torch version leaves it
            w = w0 + tl.arange(0, COLS)  # [CB]
            pad = row_ok[:, None] & (w[None, :] >= b_n[:, None]) & (w[None, :] < W)  # [RB, CB]
            tl.store(INDEX + row_off[:, None] * W + w[None, :], tl.zeros([ROWS, COLS], tl.int32), mask=pad)
    else:
        tl.store(COUNT + rows, b_n, mask=row_ok)
        tl.atomic_max(WIDTH, tl.max(b_n, 0))  # rows past the end counted 0


@triton.jit
def row_lists_kernel(PARTIAL, FULL, COUNT, FULL_COUNT, INDEX, FULL_INDEX, WIDTHS, n_rows, n_cols, W, FW,
                     ROWS: tl.constexpr, COLS: tl.constexpr, WRITE: tl.constexpr):
    """Grid ``(cdiv(n_rows, ROWS), 2)``: rows ``ROWS * pid ...`` of the partial (axis 1 = 0) or full class.
    ``PARTIAL``/``FULL`` uint8 ``[n_rows, n_cols]`` (0/1); counts int32 ``[n_rows]``; ``WIDTHS`` int32 ``[2]``
    zeroed before the counting launch; lists int32 ``[n_rows, W]`` and ``[n_rows, FW]``."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [RB]
    row_ok = rows < n_rows
    if tl.program_id(1) == 0:
        _row_list(PARTIAL, COUNT, INDEX, WIDTHS, rows, row_ok, n_cols, W, ROWS, COLS, WRITE)
    else:
        _row_list(FULL, FULL_COUNT, FULL_INDEX, WIDTHS + 1, rows, row_ok, n_cols, FW, ROWS, COLS, WRITE)
