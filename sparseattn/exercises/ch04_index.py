"""Chapter 4 exercise: transpose a block table in O(nnz) with a stable sort, as ``BlockLayout`` does on the
device (eager PyTorch; no loop over rows or columns, no ``nq x nk`` matrix)."""
from __future__ import annotations

import torch

from .. import patterns as P
from ..layout import BlockLayout
from . import Exercise, blank, passed, run

__all__ = ["transpose_rows_scaffold", "transpose_rows_solution", "check_transpose_rows", "EXERCISES"]


def transpose_rows_scaffold(count: torch.Tensor, index: torch.Tensor, nk: int):
    """Rows (``count [nq]``, ``index [nq, W]``: row i lists key tiles ``index[i, :count[i]]``, ascending) to
    columns (``col_count [nk]``, ``col_index [nk, nq]``: column j lists its query tiles, ascending)."""
    nq, W = index.shape
    valid = torch.arange(W)[None, :] < count[:, None]  # [nq, W] slots that hold an entry
    rows = torch.arange(nq)[:, None].expand(nq, W)[valid]  # every entry's row, row by row
    cols = index[valid].long()  # its column
    order = blank("sort the entries by column so that rows stay ascending inside a column")
    col_count = torch.bincount(cols, minlength=nk)
    start = torch.cumsum(col_count, 0) - col_count  # exclusive prefix sum: where each column begins
    pos = blank("each sorted entry's place in its column: its rank minus its column's start")
    col_index = torch.full((nk, nq), -1, dtype=index.dtype)
    col_index[cols[order], pos] = rows[order].to(index.dtype)
    return col_count.to(count.dtype), col_index


def transpose_rows_solution(count: torch.Tensor, index: torch.Tensor, nk: int):
    """Rows (``count [nq]``, ``index [nq, W]``: row i lists key tiles ``index[i, :count[i]]``, ascending) to
    columns (``col_count [nk]``, ``col_index [nk, nq]``: column j lists its query tiles, ascending)."""
    nq, W = index.shape
    valid = torch.arange(W)[None, :] < count[:, None]  # [nq, W] slots that hold an entry
    rows = torch.arange(nq)[:, None].expand(nq, W)[valid]  # every entry's row, row by row
    cols = index[valid].long()  # its column
    order = torch.sort(cols, stable=True).indices  # entries come row by row, so stable = rows ascending
    col_count = torch.bincount(cols, minlength=nk)
    start = torch.cumsum(col_count, 0) - col_count  # exclusive prefix sum: where each column begins
    pos = torch.arange(order.numel()) - start[cols[order]]
    col_index = torch.full((nk, nq), -1, dtype=index.dtype)
    col_index[cols[order], pos] = rows[order].to(index.dtype)
    return col_count.to(count.dtype), col_index


def _mistake_no_start(count, index, nk):
    """Positions are global ranks, not ranks inside the column."""
    nq, W = index.shape
    valid = torch.arange(W)[None, :] < count[:, None]
    rows = torch.arange(nq)[:, None].expand(nq, W)[valid]
    cols = index[valid].long()
    order = torch.sort(cols, stable=True).indices
    col_index = torch.full((nk, max(nq, order.numel())), -1, dtype=index.dtype)
    col_index[cols[order], torch.arange(order.numel())] = rows[order].to(index.dtype)
    return torch.bincount(cols, minlength=nk).to(count.dtype), col_index


def _mistake_descending_rows(count, index, nk):
    """Sorted by column, but with rows taken from the bottom up: each column lists its rows descending."""
    nq, W = index.shape
    valid = torch.arange(W)[None, :] < count[:, None]
    rows = torch.arange(nq)[:, None].expand(nq, W)[valid].flip(0)
    cols = index[valid].long().flip(0)
    order = torch.sort(cols, stable=True).indices
    col_count = torch.bincount(cols, minlength=nk)
    start = torch.cumsum(col_count, 0) - col_count
    col_index = torch.full((nk, nq), -1, dtype=index.dtype)
    col_index[cols[order], torch.arange(order.numel()) - start[cols[order]]] = rows[order].to(index.dtype)
    return col_count.to(count.dtype), col_index


def check_transpose_rows(fn) -> None:
    """Transpose the partial-tile rows of three layouts with ``fn`` and compare every listed entry with the
    package's own transposed lists. Raises AssertionError naming the first wrong column."""
    cpu = dict(device="cpu")  # the check is about the algorithm: eager PyTorch on the CPU, on any machine
    cases = {"sinks + window": BlockLayout.from_mask_mod(P.sinks_window(8, 100), 512, 512, 32, 32, **cpu),
             "dilated": BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.dilated(3)), 256, 256, 32, 32, **cpu),
             "block-random": BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.block_random(0.3, 32, seed=2)),
                                                       384, 384, 32, 32, **cpu)}
    for name, lay in cases.items():
        for count, index, q_count, q_index in ((lay.kv_count, lay.kv_index, lay.q_count, lay.q_index),
                                               (lay.full_count, lay.full_index, lay.full_q_count, lay.full_q_index)):
            c, i = run("transpose_rows", lambda: fn(count[0, 0].cpu(), index[0, 0].cpu(), lay.nk))
            want_c = q_count[0, 0].cpu()
            if not torch.equal(c.long(), want_c.long()):
                j = int((c.long() != want_c.long()).nonzero()[0])
                raise AssertionError(f"transpose_rows ({name}): column {j} has count {int(c[j])}, "
                                     f"expected {int(want_c[j])}")
            for j in range(lay.nk):
                n = int(want_c[j])
                got, want = i[j, :n].tolist(), q_index[0, 0, j, :n].tolist()
                if got != want:
                    raise AssertionError(f"transpose_rows ({name}): column {j} lists {got}, expected {want}")
    passed("transpose_rows", "partial and full lists of three layouts")


EXERCISES = [Exercise("transpose_rows", transpose_rows_scaffold, transpose_rows_solution, check_transpose_rows,
                      mistakes=(_mistake_no_start, _mistake_descending_rows),
                      prompt="the stable sort and the place inside each column")]
