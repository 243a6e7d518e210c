"""Chapter 8 exercise: the top-k of a row of block scores, with the tie rule, as a Triton fragment.

``route`` finds the k-th best score of a row by bisection on the float's bits (``_kth_key``); what remains is
to keep the right blocks: every candidate above that score, and the candidates *equal* to it in block order
until k are kept. :func:`top_k_scaffold` keeps only the first part; :data:`top_k_solution` is the package's
own fragment (:func:`sparseattn.kernels.route._top_k`). :func:`check_top_k` runs a fragment on rows with and
without ties and compares it with ``torch.sort``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..kernels import route as K  # imported first: chooses the interpreter when there is no GPU

__all__ = ["top_k_scaffold", "top_k_solution", "check_top_k"]


@triton.jit
def top_k_scaffold(b_key, pool, k):
    """Per row of ``b_key [R, N]`` (sortable int32 keys of the scores): the ``k [R]`` best members of ``pool``
    (bool ``[R, N]``); ties at the k-th key go to the lower column."""
    t = K._kth_key(b_key, pool, k)  # [R, 1]: each row's k-th largest key among its pool
    # ---- fill in: keep every member above t, and members equal to t in column order until k are kept ----
    take = pool & (b_key > t)  # a start: when the k-th score is tied, this keeps fewer than k
    # ------------------------------------------------------------------------------------------------------
    return take


#: the package's fragment, used by ``route`` and the member bits
top_k_solution = K._top_k


@triton.jit
def _harness(S, TAKE, n, k, FN: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    ok = offs < n
    b_s = tl.load(S + offs, mask=ok, other=float("-inf"))[None, :]  # [1, BLOCK]: one row
    take = FN(K._sort_key(b_s), ok[None, :], tl.full([1], k, tl.int32))
    tl.store(TAKE + offs[None, :], take.to(tl.int8), mask=ok[None, :])


def _reference(scores: torch.Tensor, k: int) -> torch.Tensor:
    order = torch.sort(scores, descending=True, stable=True).indices  # stable: lower block first among equals
    take = torch.zeros_like(scores, dtype=torch.bool)
    take[order[:k]] = True
    return take


def check_top_k(fn) -> str:
    """Run the fragment ``fn`` on rows of block scores (with and without ties, k from 0 to the row length) and
    compare with ``torch.sort``; raise AssertionError saying what went wrong."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(0)
    rows = [(torch.randn(13, generator=g), 5),
            (torch.tensor([3., 1., 2., 2., 2., 0., 2., 5.]), 3),  # the 3rd best score (2.0) is shared by four
            (torch.tensor([1., 1., 1., 1.]), 2),  # everything tied
            (torch.randint(0, 3, (20,), generator=g).float(), 7),
            (torch.randn(9, generator=g), 0), (torch.randn(9, generator=g), 9)]
    for scores, k in rows:
        s = scores.to(device)
        take = torch.zeros(s.numel(), dtype=torch.int8, device=device)
        _harness[(1,)](S=s, TAKE=take, n=s.numel(), k=k, FN=fn, BLOCK=max(16, triton.next_power_of_2(s.numel())))
        got, want = take.bool().cpu(), _reference(scores, k)
        if int(got.sum()) != min(k, scores.numel()):
            raise AssertionError(f"scores {scores.tolist()}, k={k}: kept {int(got.sum())} blocks, expected {k}. "
                                 f"Kept: {got.nonzero().flatten().tolist()}. Ties at the k-th score must fill up "
                                 "to k blocks.")
        if not torch.equal(got, want):
            raise AssertionError(f"scores {scores.tolist()}, k={k}: kept blocks {got.nonzero().flatten().tolist()}, "
                                 f"expected {want.nonzero().flatten().tolist()} (ties go to the lower block index)")
    return "correct: the k best blocks, ties to the lower block, on every row"
