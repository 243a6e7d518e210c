"""Chapter 6 exercise: the dK/dV contribution of one tile in the backward pass.

A dK/dV program owns one key tile and walks the query tiles of its column. For each it recomputes the
probabilities from the saved log-sum-exp (nothing of size ``Lq x Lk`` was kept from the forward pass) and adds
the tile's share of dV and dK. Inputs of one step: ``b_q``, ``b_do`` ``[M, D]`` (queries and output
gradients of the query tile), ``b_k``, ``b_v`` ``[N, D]``, the saved LSE in base 2 ``b_lse2 [M]`` (``+inf``
for a row with no key, so its probabilities are exactly 0), ``b_delta = rowsum(dO * O)`` ``[M]``, the
tile's ``allowed`` mask ``[M, N]``, and the softmax scale (``scale_log2`` for the base-2 scores,
``sm_scale`` for the chain rule). The package's kernel is ``sparseattn.kernels.prefill_bwd._dkdv_tiles``.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from .._checks import LOG2E
from ..reference import reference_attention
from . import Exercise, assert_close, blank, interpreted, passed, run

__all__ = ["dkdv_step_scaffold", "dkdv_step_solution", "check_dkdv_step", "EXERCISES"]


@triton.jit
def dkdv_step_scaffold(b_q, b_k, b_v, b_do, b_lse2, b_delta, allowed, scale_log2, sm_scale):
    """dK and dV [N, D] of one (query tile, key tile) pair, from the saved base-2 LSE."""
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2  # [M, N] base-2 scores
    b_p = tl.where(allowed, tl.math.exp2(b_s - b_lse2[:, None]), 0.0)  # [M, N] the forward's probabilities
    b_dv = tl.dot(tl.trans(b_p), b_do)  # [N, D]
    b_dp = tl.dot(b_do, tl.trans(b_v))  # [M, N] gradient of the probabilities
    b_ds = blank("the gradient of the scores: P times (dP minus each row's delta)")  # [M, N]
    b_dk = blank("this tile's dK: dS^T Q, with the softmax scale of the chain rule")  # [N, D]
    return b_dk, b_dv


@triton.jit
def dkdv_step_solution(b_q, b_k, b_v, b_do, b_lse2, b_delta, allowed, scale_log2, sm_scale):
    """dK and dV [N, D] of one (query tile, key tile) pair, from the saved base-2 LSE."""
    b_s = tl.dot(b_q, tl.trans(b_k)) * scale_log2  # [M, N] base-2 scores
    b_p = tl.where(allowed, tl.math.exp2(b_s - b_lse2[:, None]), 0.0)  # [M, N] the forward's probabilities
    b_dv = tl.dot(tl.trans(b_p), b_do)  # [N, D]
    b_dp = tl.dot(b_do, tl.trans(b_v))  # [M, N] gradient of the probabilities
    b_ds = b_p * (b_dp - b_delta[:, None])  # [M, N] softmax backward: rowsum(P * dP) = delta
    b_dk = tl.dot(tl.trans(b_ds), b_q) * sm_scale  # [N, D]
    return b_dk, b_dv


def _mistake_no_delta(b_q, b_k, b_v, b_do, b_lse2, b_delta, allowed, scale_log2, sm_scale):
    """dS = P * dP: forgets that the softmax's rows sum to one (the -delta term)."""
    b_p = tl.where(allowed, tl.math.exp2(tl.dot(b_q, tl.trans(b_k)) * scale_log2 - b_lse2[:, None]), 0.0)
    b_dp = tl.dot(b_do, tl.trans(b_v))
    return tl.dot(tl.trans(b_p * b_dp), b_q) * sm_scale, tl.dot(tl.trans(b_p), b_do)


def _mistake_no_scale(b_q, b_k, b_v, b_do, b_lse2, b_delta, allowed, scale_log2, sm_scale):
    """dK without the softmax scale: S = scale * Q K^T, so dK carries the scale too."""
    b_p = tl.where(allowed, tl.math.exp2(tl.dot(b_q, tl.trans(b_k)) * scale_log2 - b_lse2[:, None]), 0.0)
    b_ds = b_p * (tl.dot(b_do, tl.trans(b_v)) - b_delta[:, None])
    return tl.dot(tl.trans(b_ds), b_q), tl.dot(tl.trans(b_p), b_do)


def _harness(Q, K, V, DO, LSE2, DELTA, MASK, DK, DV, Lq, Lk, scale_log2, sm_scale, FRAG,
             M: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    # one program per key tile: walk every query tile of its column (the whole column here)
    j = tl.program_id(0)
    offs_n = j * N + tl.arange(0, N)
    offs_d = tl.arange(0, D)
    b_k = tl.load(K + offs_n[:, None] * D + offs_d[None, :])  # [N, D]
    b_v = tl.load(V + offs_n[:, None] * D + offs_d[None, :])
    b_dk = tl.zeros([N, D], tl.float32)
    b_dv = tl.zeros([N, D], tl.float32)
    for start in range(0, Lq, M):
        offs_m = start + tl.arange(0, M)
        b_q = tl.load(Q + offs_m[:, None] * D + offs_d[None, :])  # [M, D]
        b_do = tl.load(DO + offs_m[:, None] * D + offs_d[None, :])
        allowed = tl.load(MASK + offs_m[:, None] * Lk + offs_n[None, :]) != 0  # [M, N]
        dk, dv = FRAG(b_q, b_k, b_v, b_do, tl.load(LSE2 + offs_m), tl.load(DELTA + offs_m), allowed,
                      scale_log2, sm_scale)
        b_dk += dk
        b_dv += dv
    tl.store(DK + offs_n[:, None] * D + offs_d[None, :], b_dk)
    tl.store(DV + offs_n[:, None] * D + offs_d[None, :], b_dv)


def check_dkdv_step(fn) -> None:
    """Run ``fn`` inside a small dK/dV pass in the interpreter (64 queries and keys, tiles of 16, a causal
    mask with gaps and one query with no key) and compare dK and dV with autograd through
    ``reference_attention`` in fp64."""
    L, T, D = 64, 16, 16
    g = torch.Generator().manual_seed(0)
    q, k, v, do = (torch.randn(L, D, generator=g, dtype=torch.float64) for _ in range(4))
    mask = torch.ones(L, L, dtype=torch.bool).tril() & (torch.rand(L, L, generator=g) < 0.7)
    mask[5] = False  # a query with no key: zero gradient, never NaN
    mask.diagonal().copy_(torch.arange(L) != 5)
    scale = 1.0 / math.sqrt(D)
    q.requires_grad_(True)
    k.requires_grad_(True)
    v.requires_grad_(True)
    o, lse = reference_attention(q.view(1, 1, L, D), k.view(1, 1, L, D), v.view(1, 1, L, D),
                                 mask.view(1, 1, L, L), scale=scale, return_lse=True)
    dq, dk_want, dv_want = torch.autograd.grad(o, (q, k, v), do.view(1, 1, L, D))
    lse2 = torch.where(torch.isinf(lse), torch.full_like(lse, math.inf), lse * LOG2E).view(L)
    delta = (do * o.view(L, D)).sum(-1).detach()
    f32 = lambda t: t.detach().float().contiguous()  # noqa: E731
    dk = torch.full((L, D), float("nan"))  # poisoned: every element must be written
    dv = torch.full((L, D), float("nan"))
    run("dkdv_step", lambda: interpreted(_harness)[(L // T,)](
        f32(q), f32(k), f32(v), f32(do), f32(lse2), f32(delta), mask.to(torch.int8), dk, dv, L, L,
        scale * LOG2E, scale, FRAG=interpreted(fn), M=T, N=T, D=D))
    assert_close(dv, dv_want, "dkdv_step: dV", atol=1e-4, rtol=1e-4)
    assert_close(dk, dk_want, "dkdv_step: dK", atol=1e-4, rtol=1e-4)
    passed("dkdv_step", "4 key tiles x 4 query tiles, causal with gaps, one query with no key")


EXERCISES = [Exercise("dkdv_step", dkdv_step_scaffold, dkdv_step_solution, check_dkdv_step,
                      mistakes=(_mistake_no_delta, _mistake_no_scale),
                      prompt="the score gradient dS and the tile's dK")]
