"""Chapter 10 exercises: cut long rows into tasks (the planner's job), and fold a split row's chunks back
together (the merge kernel's loop).

* :func:`split_tasks_scaffold` -- plain Python: from each row's listed tiles and a chunk size, the tasks
  ``(row, first slot, end slot)``; checked against :func:`sparseattn.balance.plan`.
* :func:`fold_chunk_scaffold` -- a Triton fragment: fold one chunk's partial state ``(o, lse)`` into the
  running ``(acc, m, l)`` of a row, as ``sparseattn.kernels.merge.merge_rows_kernel`` does; checked in the
  interpreter against :func:`sparseattn.reference.merge_states`.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from ..balance import plan
from ..layout import BlockLayout
from ..reference import merge_states
from . import Exercise, assert_close, blank, interpreted, passed, run

__all__ = ["split_tasks_scaffold", "split_tasks_solution", "check_split_tasks", "fold_chunk_scaffold",
           "fold_chunk_solution", "check_fold_chunk", "EXERCISES"]


def split_tasks_scaffold(lens, chunk: int):
    """Tasks ``(row, first slot, end slot)`` for rows of ``lens[row]`` listed tiles, longest first."""
    tasks = []
    for row, n in enumerate(lens):
        pieces = blank("how many tasks this row needs (an empty row still needs one: it writes O = 0)")
        for c in range(pieces):
            tasks.append((row, c * chunk, min((c + 1) * chunk, n)))
    return sorted(tasks, key=lambda t: t[2] - t[1], reverse=True)


def split_tasks_solution(lens, chunk: int):
    """Tasks ``(row, first slot, end slot)`` for rows of ``lens[row]`` listed tiles, longest first."""
    tasks = []
    for row, n in enumerate(lens):
        pieces = max(1, math.ceil(n / chunk))
        for c in range(pieces):
            tasks.append((row, c * chunk, min((c + 1) * chunk, n)))
    return sorted(tasks, key=lambda t: t[2] - t[1], reverse=True)


def _split_no_empty_task(lens, chunk):
    """An empty row gets no task: its O is never written (and its LSE never set to -inf)."""
    return sorted([(r, c * chunk, min((c + 1) * chunk, n)) for r, n in enumerate(lens)
                   for c in range(math.ceil(n / chunk))], key=lambda t: t[2] - t[1], reverse=True)


def _split_floor(lens, chunk):
    """Whole chunks only: the remainder of a row that is no multiple of the chunk is lost."""
    return sorted([(r, c * chunk, (c + 1) * chunk) for r, n in enumerate(lens)
                   for c in range(max(1, n // chunk))], key=lambda t: t[2] - t[1], reverse=True)


def check_split_tasks(fn) -> None:
    """Compare ``fn(lens, chunk)`` with the planner's task list on rows of 0 to 23 tiles, chunks 1, 4 and 7:
    the same tasks, each row's slots covered once, longest first."""
    lens = [5, 0, 23, 1, 8, 7, 14, 0, 3]
    nq, nk = len(lens), 24
    block = torch.zeros(1, 1, nq, nk, dtype=torch.bool)
    for i, n in enumerate(lens):
        block[0, 0, i, :n] = True
    layout = BlockLayout.from_block_mask(block, nq * 16, nk * 16, 16, 16)
    for chunk in (1, 4, 7):
        got = run("split_tasks", lambda: fn(list(lens), chunk))
        p = plan(layout, 16, chunk, 1, 4)
        want = [tuple(t) for t in p.tasks[:int(p.n_tasks[0]), :3].tolist()]
        if sorted(got) != sorted(want):
            missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
            raise AssertionError(f"split_tasks, chunk {chunk}: tasks differ from the planner's; missing {missing[:4]}, "
                                 f"unexpected {extra[:4]}")
        sizes = [hi - lo for _, lo, hi in got]
        if sizes != sorted(sizes, reverse=True):
            raise AssertionError(f"split_tasks, chunk {chunk}: tasks are not ordered longest first: {sizes}")
    passed("split_tasks", "9 rows of 0-23 tiles, chunks 1, 4, 7")


@triton.jit
def fold_chunk_scaffold(acc, m_i, l_i, b_o, b_lse):
    """Fold one chunk's state (b_o [M, D] normalised over its keys, b_lse [M] natural log, -inf: no key) into
    the running (acc [M, D], m_i [M], l_i [M]) of its rows."""
    m_new = tl.maximum(m_i, b_lse)  # [M]
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing so far: subtract 0, exp gives exact zeros
    alpha = blank("how much the running state shrinks when the maximum rises: exp(m_i - m_sub)")
    w = tl.exp(b_lse - m_sub)  # [M] this chunk's weight; 0 for an empty chunk
    acc = blank("the running sum, rescaled, plus this chunk's weighted o (never read an empty chunk's o)")
    l_i = l_i * alpha + w
    return acc, m_new, l_i


@triton.jit
def fold_chunk_solution(acc, m_i, l_i, b_o, b_lse):
    """Fold one chunk's state (b_o [M, D] normalised over its keys, b_lse [M] natural log, -inf: no key) into
    the running (acc [M, D], m_i [M], l_i [M]) of its rows."""
    m_new = tl.maximum(m_i, b_lse)  # [M]
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing so far: subtract 0, exp gives exact zeros
    alpha = tl.exp(m_i - m_sub)  # [M]
    w = tl.exp(b_lse - m_sub)  # [M] this chunk's weight; 0 for an empty chunk
    acc = acc * alpha[:, None] + tl.where((b_lse == float("-inf"))[:, None], 0.0, w[:, None] * b_o)  # [M, D]
    l_i = l_i * alpha + w
    return acc, m_new, l_i


def _fold_no_rescale(acc, m_i, l_i, b_o, b_lse):
    """Forgets to rescale the running sum when a later chunk raises the maximum."""
    m_new = tl.maximum(m_i, b_lse)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_sub)
    w = tl.exp(b_lse - m_sub)
    acc = acc + tl.where((b_lse == float("-inf"))[:, None], 0.0, w[:, None] * b_o)
    return acc, m_new, l_i * alpha + w


def _fold_reads_empty_o(acc, m_i, l_i, b_o, b_lse):
    """Multiplies an empty chunk's o by its zero weight: a NaN left in its workspace slot leaks in."""
    m_new = tl.maximum(m_i, b_lse)
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp(m_i - m_sub)
    w = tl.exp(b_lse - m_sub)
    return acc * alpha[:, None] + w[:, None] * b_o, m_new, l_i * alpha + w


def _fold_harness(WS_O, WS_LSE, O, LSE, n_chunks, FRAG, M: tl.constexpr, D: tl.constexpr):
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    acc = tl.zeros([M, D], tl.float32)
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    for j in range(0, n_chunks):  # chunk order: the merge is deterministic
        b_lse = tl.load(WS_LSE + j * M + offs_m)
        b_o = tl.load(WS_O + (j * M + offs_m)[:, None] * D + offs_d[None, :])
        acc, m_i, l_i = FRAG(acc, m_i, l_i, b_o, b_lse)
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], acc / l_safe[:, None])
    tl.store(LSE + offs_m, tl.where(empty, float("-inf"), m_i + tl.log(l_safe)))


def check_fold_chunk(fn) -> None:
    """Merge 4 chunks of 16 rows in the interpreter (LSEs near 300 that rise from chunk to chunk, an empty
    first chunk for some rows, a row empty in every chunk, NaN in the workspace slots of empty chunks) and
    compare with :func:`sparseattn.reference.merge_states` applied chunk after chunk in fp64."""
    C, M, D = 4, 16, 16
    g = torch.Generator().manual_seed(0)
    ws_o = torch.randn(C, M, D, generator=g)
    ws_lse = torch.randn(C, M, generator=g) * 3 + torch.arange(C).view(C, 1) * 4.0  # later chunks dominate
    ws_lse[:, 0:2] += 300.0
    ws_lse[0, 2:6] = -math.inf  # rows whose first chunk saw no key
    ws_lse[:, 6] = -math.inf  # a row with no key at all: O = 0, LSE = -inf
    ws_o[ws_lse == -math.inf] = float("nan")  # what an empty chunk's slot may hold: it must not be read
    o = torch.full((M, D), float("nan"))
    lse = torch.full((M,), float("nan"))
    run("fold_chunk", lambda: interpreted(_fold_harness)[(1,)](ws_o, ws_lse, o, lse, C, FRAG=interpreted(fn),
                                                                M=M, D=D))
    want_o = torch.where(torch.isinf(ws_lse[0])[:, None], 0.0, ws_o[0].double())
    want_lse = ws_lse[0].double()
    for j in range(1, C):
        o_j = torch.where(torch.isinf(ws_lse[j])[:, None], 0.0, ws_o[j].double())
        want_o, want_lse = merge_states(want_o, want_lse, o_j, ws_lse[j].double())
    assert_close(lse, want_lse, "fold_chunk: merged LSE", atol=1e-4)
    assert_close(o, want_o, "fold_chunk: merged output", atol=1e-5)
    passed("fold_chunk", "4 chunks x 16 rows: rising LSEs near 300, empty chunks, an empty row")


EXERCISES = [
    Exercise("split_tasks", split_tasks_scaffold, split_tasks_solution, check_split_tasks,
             mistakes=(_split_no_empty_task, _split_floor), prompt="how many tasks a row needs"),
    Exercise("fold_chunk", fold_chunk_scaffold, fold_chunk_solution, check_fold_chunk,
             mistakes=(_fold_no_rescale, _fold_reads_empty_o), prompt="rescale the running state, add the chunk"),
]
