"""Chapter 2 exercise: merge two partial softmax states in Triton (what split-KV decoding does at the end).

A state is ``(o [M, D], lse [M])``: the normalised output over some keys and the natural-log sum of their
exponentiated scores (``-inf``: no key yet). The fragment must give the state of the union of the two key
sets, without overflow for large LSEs and without NaN when one or both states are empty.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from ..reference import merge_states
from . import Exercise, assert_close, blank, interpreted, passed, run

__all__ = ["merge_pair_scaffold", "merge_pair_solution", "check_merge_pair", "EXERCISES"]


@triton.jit
def merge_pair_scaffold(b_o_a, b_lse_a, b_o_b, b_lse_b):
    """Merge the states (b_o_a [M, D], b_lse_a [M]) and (b_o_b, b_lse_b) of disjoint key sets."""
    m = tl.maximum(b_lse_a, b_lse_b)  # [M] the larger LSE: subtract it so no exp overflows
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both empty: any finite shift will do
    w_a = blank("the weight of state a relative to the shift: exp(lse_a - m_safe)")
    w_b = blank("the same for state b")
    l = w_a + w_b  # [M]
    l_safe = tl.where(l == 0.0, 1.0, l)
    b_o = (w_a[:, None] * b_o_a + w_b[:, None] * b_o_b) / l_safe[:, None]  # [M, D]
    b_lse = tl.where(l == 0.0, float("-inf"), m_safe + tl.log(l_safe))
    return b_o, b_lse


@triton.jit
def merge_pair_solution(b_o_a, b_lse_a, b_o_b, b_lse_b):
    """Merge the states (b_o_a [M, D], b_lse_a [M]) and (b_o_b, b_lse_b) of disjoint key sets."""
    m = tl.maximum(b_lse_a, b_lse_b)  # [M] the larger LSE: subtract it so no exp overflows
    m_safe = tl.where(m == float("-inf"), 0.0, m)  # both empty: any finite shift will do
    w_a = tl.exp(b_lse_a - m_safe)  # [M] in (0, 1]; exactly 0 for an empty state
    w_b = tl.exp(b_lse_b - m_safe)
    l = w_a + w_b  # [M]
    l_safe = tl.where(l == 0.0, 1.0, l)
    b_o = (w_a[:, None] * b_o_a + w_b[:, None] * b_o_b) / l_safe[:, None]  # [M, D]
    b_lse = tl.where(l == 0.0, float("-inf"), m_safe + tl.log(l_safe))
    return b_o, b_lse


def _mistake_no_shift(b_o_a, b_lse_a, b_o_b, b_lse_b):
    """Weights exp(lse) without the shift: overflows to inf for an LSE above ~88 in fp32."""
    w_a = tl.exp(b_lse_a)
    w_b = tl.exp(b_lse_b)
    l = w_a + w_b
    b_o = (w_a[:, None] * b_o_a + w_b[:, None] * b_o_b) / l[:, None]
    return b_o, tl.log(l)


def _mistake_unguarded_empty(b_o_a, b_lse_a, b_o_b, b_lse_b):
    """Shifted, but two empty states give exp(-inf - (-inf)) = NaN."""
    m = tl.maximum(b_lse_a, b_lse_b)
    w_a = tl.exp(b_lse_a - m)
    w_b = tl.exp(b_lse_b - m)
    l = w_a + w_b
    b_o = (w_a[:, None] * b_o_a + w_b[:, None] * b_o_b) / l[:, None]
    return b_o, m + tl.log(l)


def _harness(O_A, LSE_A, O_B, LSE_B, O, LSE, FRAG, M: tl.constexpr, D: tl.constexpr):
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    idx = offs_m[:, None] * D + offs_d[None, :]  # [M, D]
    b_o, b_lse = FRAG(tl.load(O_A + idx), tl.load(LSE_A + offs_m), tl.load(O_B + idx), tl.load(LSE_B + offs_m))
    tl.store(O + idx, b_o)
    tl.store(LSE + offs_m, b_lse)


def _cases(M: int = 16, D: int = 16):
    g = torch.Generator().manual_seed(0)
    o_a, o_b = torch.randn(M, D, generator=g), torch.randn(M, D, generator=g)
    lse_a = torch.randn(M, generator=g) * 3
    lse_b = torch.randn(M, generator=g) * 3
    lse_a[0:2], lse_b[0:2] = 300.0, 299.0  # large LSEs (long rows of large scores): exp would overflow
    lse_a[2], lse_b[3] = -math.inf, -math.inf  # one side empty
    lse_a[4] = lse_b[4] = -math.inf  # both empty: the merged state is empty too
    o_a[2] = 0.0  # an empty state's output is 0 by the package's rule
    o_b[3] = 0.0
    o_a[4] = o_b[4] = 0.0
    return o_a, lse_a, o_b, lse_b


def check_merge_pair(fn) -> None:
    """Run ``fn`` in the interpreter on 16 rows (random states, LSEs near 300, one side empty, both empty)
    against :func:`sparseattn.reference.merge_states` in fp64. Raises AssertionError when wrong."""
    o_a, lse_a, o_b, lse_b = _cases()
    M, D = o_a.shape
    o = torch.full((M, D), float("nan"))  # poisoned: every element must be written
    lse = torch.full((M,), float("nan"))
    run("merge_pair", lambda: interpreted(_harness)[(1,)](o_a, lse_a, o_b, lse_b, o, lse, FRAG=interpreted(fn),
                                                           M=M, D=D))
    want_o, want_lse = merge_states(o_a.double(), lse_a.double(), o_b.double(), lse_b.double())
    assert_close(lse, want_lse, "merge_pair: merged LSE", atol=1e-4)
    assert_close(o, want_o, "merge_pair: merged output", atol=1e-5)
    passed("merge_pair", "16 rows: large LSEs, one side empty, both empty")


EXERCISES = [Exercise("merge_pair", merge_pair_scaffold, merge_pair_solution, check_merge_pair,
                      mistakes=(_mistake_no_shift, _mistake_unguarded_empty),
                      prompt="the weights of the two states, shifted by the larger LSE")]
