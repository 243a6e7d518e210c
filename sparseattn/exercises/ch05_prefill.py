"""Chapter 5 exercise: the online-softmax step, the heart of the prefill kernel's inner loop.

The fragment folds one tile of scores into the running state of its query rows. Scores ``b_s [M, N]`` are
already scaled to base 2 and masked (``-inf`` where a cell is not allowed); ``b_v [N, D]`` are the tile's
values; the state is the running maximum ``m_i [M]``, the running sum ``l_i [M]`` and the unnormalised
output ``acc [M, D]``. A row that has seen no allowed key yet has ``m_i = -inf`` and must stay NaN-free.
The package's own version is ``sparseattn.kernels._common.online_softmax_step``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from .._checks import LOG2E
from ..kernels._common import finalize
from ..reference import reference_attention
from . import Exercise, assert_close, blank, interpreted, passed, run

__all__ = ["online_softmax_step_scaffold", "online_softmax_step_solution", "check_online_softmax_step",
           "EXERCISES"]


@triton.jit
def online_softmax_step_scaffold(b_s, b_v, m_i, l_i, acc):
    """Fold base-2 scores b_s [M, N] (-inf = masked) and values b_v [N, D] into (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # [M] the new running maximum
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: subtract 0, never -inf
    alpha = blank("how much the old state shrinks now that the maximum is m_sub")
    b_p = blank("this tile's unnormalised probabilities, relative to m_sub")  # [M, N]
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)  # [M, D]
    return m_new, l_i, acc


@triton.jit
def online_softmax_step_solution(b_s, b_v, m_i, l_i, acc):
    """Fold base-2 scores b_s [M, N] (-inf = masked) and values b_v [N, D] into (m_i, l_i, acc)."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))  # [M] the new running maximum
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)  # no key yet: subtract 0, never -inf
    alpha = tl.math.exp2(m_i - m_sub)  # [M] 1 when the maximum did not move; 0 for a row with no key yet
    b_p = tl.math.exp2(b_s - m_sub[:, None])  # [M, N] in [0, 1]; masked cells give exactly 0
    l_i = l_i * alpha + tl.sum(b_p, 1)
    acc = acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)  # [M, D]
    return m_new, l_i, acc


def _mistake_no_rescale(b_s, b_v, m_i, l_i, acc):
    """The sum is rescaled but the accumulator is not: earlier tiles keep weights of an old maximum."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.math.exp2(m_i - m_sub)
    b_p = tl.math.exp2(b_s - m_sub[:, None])
    return m_new, l_i * alpha + tl.sum(b_p, 1), acc + tl.dot(b_p.to(b_v.dtype), b_v)


def _mistake_unguarded(b_s, b_v, m_i, l_i, acc):
    """No guard: a row whose first tile is fully masked computes 2^(-inf - (-inf)) = NaN."""
    m_new = tl.maximum(m_i, tl.max(b_s, 1))
    alpha = tl.math.exp2(m_i - m_new)
    b_p = tl.math.exp2(b_s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(b_p, 1), acc * alpha[:, None] + tl.dot(b_p.to(b_v.dtype), b_v)


def _mistake_no_max(b_s, b_v, m_i, l_i, acc):
    """Plain 2^s without the running maximum: large scores overflow to inf."""
    b_p = tl.math.exp2(b_s)
    return m_i, l_i + tl.sum(b_p, 1), acc + tl.dot(b_p.to(b_v.dtype), b_v)


def _harness(Q, K, V, MASK, O, LSE, Lk, scale_log2, FRAG, FINALIZE,
             M: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    # one program: M query rows against Lk keys, N keys per step, the token mask read from MASK [M, Lk]
    offs_m = tl.arange(0, M)
    offs_d = tl.arange(0, D)
    b_q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])  # [M, D]
    m_i = tl.full([M], float("-inf"), tl.float32)
    l_i = tl.zeros([M], tl.float32)
    acc = tl.zeros([M, D], tl.float32)
    for start in range(0, Lk, N):
        offs_n = start + tl.arange(0, N)
        b_k = tl.load(K + offs_n[:, None] * D + offs_d[None, :])  # [N, D]
        b_v = tl.load(V + offs_n[:, None] * D + offs_d[None, :])
        b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2  # [M, N] base-2 scores
        allowed = tl.load(MASK + offs_m[:, None] * Lk + offs_n[None, :]) != 0
        b_s = tl.where(allowed, b_s, float("-inf"))
        m_i, l_i, acc = FRAG(b_s, b_v, m_i, l_i, acc)
    b_o, b_lse = FINALIZE(m_i, l_i, acc)
    tl.store(O + offs_m[:, None] * D + offs_d[None, :], b_o)
    tl.store(LSE + offs_m, b_lse)


def check_online_softmax_step(fn) -> None:
    """Run ``fn`` as the inner step of a small forward pass in the interpreter (16 rows, 64 keys in 4 steps
    of 16) against ``reference_attention`` in fp64. The rows include one with no allowed key, one whose
    first two steps are fully masked, and scores up to ~300 (exp would overflow without the running max)."""
    M, Lk, N, D = 16, 64, 16, 16
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(n, D, generator=g) for n in (M, Lk, Lk))
    q[2:4] *= 40.0  # large scores
    mask = torch.rand(M, Lk, generator=g) < 0.6
    mask[0] = False  # a row with no allowed key: o = 0, lse = -inf
    mask[1, : 2 * N] = False  # its first two steps see nothing
    mask[1, 2 * N + 3] = True
    scale = 1.0 / math.sqrt(D)
    o = torch.full((M, D), float("nan"))  # poisoned: every element must be written
    lse = torch.full((M,), float("nan"))
    run("online_softmax_step", lambda: interpreted(_harness)[(1,)](
        q, k, v, mask.to(torch.int8), o, lse, Lk, scale * LOG2E, FRAG=interpreted(fn),
        FINALIZE=interpreted(finalize), M=M, N=N, D=D))
    want_o, want_lse = reference_attention(q.view(1, 1, M, D), k.view(1, 1, Lk, D), v.view(1, 1, Lk, D),
                                           mask.view(1, 1, M, Lk), scale=scale, return_lse=True)
    assert_close(lse, want_lse.view(M), "online_softmax_step: log-sum-exp per row", atol=1e-4, rtol=1e-5)
    assert_close(o, want_o.view(M, D), "online_softmax_step: output", atol=2e-5, rtol=1e-4)
    passed("online_softmax_step", "an empty row, a late-starting row, scores near 300, 4 steps")


EXERCISES = [Exercise("online_softmax_step", online_softmax_step_scaffold, online_softmax_step_solution,
                      check_online_softmax_step, mistakes=(_mistake_no_rescale, _mistake_unguarded, _mistake_no_max),
                      prompt="the rescale factor of the old state and the tile's probabilities")]
