"""Chapter 8 exercise: the top-k of a row of block scores, with the tie rule, as a Triton fragment.

``route`` finds the k-th best score of each row by bisection on the float's bits
(:func:`sparseattn.kernels.route._kth_key`); what remains is to keep the right blocks: every candidate above
that score, and the candidates *equal* to it in block order until k are kept. The fragment receives the k-th
key ``t``; its solution is the body of the package's own :func:`sparseattn.kernels.route._top_k`.
:func:`check_top_k` runs a fragment in the Triton interpreter on rows with and without ties and compares it
with ``torch.sort`` (stable: the lower block first among equals).
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import route as K  # imported first: chooses the interpreter when there is no GPU
from . import Exercise, blank, interpreted, passed, run

__all__ = ["top_k_scaffold", "top_k_solution", "check_top_k", "EXERCISES"]


@triton.jit
def top_k_scaffold(b_key, pool, k, t):
    """Bool ``[R, N]``: the ``k [R]`` best members of ``pool`` per row, given each row's k-th largest key
    ``t [R, 1]`` (sortable int32 keys of the scores); ties at ``t`` go to the lower column."""
    above = pool & (b_key > t)  # [R, N] kept whatever the ties: strictly better than the k-th
    ties = blank("the members of the pool whose key equals t")  # [R, N]
    tie_rank = blank("each tie's rank among its row's ties, 0 for the lowest column (a prefix sum)")
    return above | (ties & (tie_rank < (k - tl.sum(above.to(tl.int32), 1))[:, None]))


@triton.jit
def top_k_solution(b_key, pool, k, t):
    """Bool ``[R, N]``: the ``k [R]`` best members of ``pool`` per row, given each row's k-th largest key
    ``t [R, 1]`` (sortable int32 keys of the scores); ties at ``t`` go to the lower column."""
    above = pool & (b_key > t)  # [R, N] kept whatever the ties: strictly better than the k-th
    ties = pool & (b_key == t)  # [R, N]
    tie_rank = tl.cumsum(ties.to(tl.int32), 1) - 1  # [R, N] 0 for the first tie of the row
    return above | (ties & (tie_rank < (k - tl.sum(above.to(tl.int32), 1))[:, None]))


def _mistake_no_ties(b_key, pool, k, t):
    """Keeps only the blocks strictly above the k-th score: with a tie at it, fewer than k are kept."""
    return pool & (b_key > t)


def _mistake_all_ties(b_key, pool, k, t):
    """Keeps every block at or above the k-th score: with a tie at it, more than k are kept."""
    return pool & (b_key >= t)


def _mistake_last_ties(b_key, pool, k, t):
    """Fills up with the ties of the *highest* columns: the count is right, the rule is not."""
    above = pool & (b_key > t)
    ties = pool & (b_key == t)
    rank_from_end = tl.sum(ties.to(tl.int32), 1)[:, None] - tl.cumsum(ties.to(tl.int32), 1)
    return above | (ties & (rank_from_end < (k - tl.sum(above.to(tl.int32), 1))[:, None]))


def _harness(S, TAKE, n, k, FN, KTH, SORT_KEY, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    b_s = tl.load(S + offs, mask=ok, other=float("-inf"))[None, :]  # [1, BLOCK]: one row
    b_key = SORT_KEY(b_s)
    kk = tl.full([1], k, tl.int32)
    take = FN(b_key, ok[None, :], kk, KTH(b_key, ok[None, :], kk))
    tl.store(TAKE + offs[None, :], take.to(tl.int8), mask=ok[None, :])


def _reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(scores, descending=True, stable=True).indices  # stable: lower block first among equals
    take = torch.zeros_like(scores, dtype=torch.bool)
    take[order[:k]] = True
    return take


def check_top_k(fn) -> None:
    """Run the fragment ``fn`` in the interpreter on rows of block scores (with and without ties, k from 0 to
    the row length) and compare with ``torch.sort``; raise AssertionError saying what went wrong."""
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(13, generator=g), 5),
            (torch.tensor([3., 1., 2., 2., 2., 0., 2., 5.]), 3),  # the 3rd best score (2.0) is shared by four
            (torch.tensor([1., 1., 1., 1.]), 2),  # everything tied
            (torch.randint(0, 3, (20,), generator=g).float(), 7),
            (torch.randn(9, generator=g), 0), (torch.randn(9, generator=g), 9)]
    for scores, k in rows:
        take = torch.full((scores.numel(),), -1, dtype=torch.int8)  # poisoned: every entry must be written
        run("top_k", lambda: interpreted(_harness)[(1,)](
            scores, take, scores.numel(), k, FN=interpreted(fn), KTH=interpreted(K._kth_key),
            SORT_KEY=interpreted(K._sort_key), BLOCK=max(16, triton.next_power_of_2(scores.numel()))))
        got, want = take.bool(), _reference(scores, k)
        if int(got.sum()) != min(k, scores.numel()):
            raise AssertionError(f"top_k: scores {scores.tolist()}, k={k}: kept {int(got.sum())} blocks, expected "
                                 f"{k}. Kept: {got.nonzero().flatten().tolist()}. Ties at the k-th score must fill "
                                 "up to k blocks.")
        if not torch.equal(got, want):
            raise AssertionError(f"top_k: scores {scores.tolist()}, k={k}: kept blocks "
                                 f"{got.nonzero().flatten().tolist()}, expected {want.nonzero().flatten().tolist()} "
                                 "(ties go to the lower block index)")
    passed("top_k", f"{len(rows)} rows, ties at the k-th score filled from the lower block")


EXERCISES = [Exercise("top_k", top_k_scaffold, top_k_solution, check_top_k,
                      mistakes=(_mistake_no_ties, _mistake_all_ties, _mistake_last_ties),
                      prompt="the ties at the k-th score, lowest block first")]
