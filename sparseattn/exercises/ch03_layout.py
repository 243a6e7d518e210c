"""Chapter 3 exercise: the token mask of a partial tile, evaluated in registers.

A kernel that meets a *partial* tile must know which of its cells are allowed. For patterns built from
distance bands and sinks it computes that from positions alone, with no mask in memory. The fragment gets the
absolute query positions ``q_pos [M, 1]`` and key positions ``k_pos [1, N]`` of one tile and returns the
allowed cells ``[M, N]`` of ``sinks_window(num_sinks, window)``: causal, and either one of the last
``window`` keys or one of the first ``num_sinks``.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from .. import patterns as P
from . import Exercise, blank, interpreted, passed, run

__all__ = ["sinks_window_mask_scaffold", "sinks_window_mask_solution", "check_sinks_window_mask", "EXERCISES"]


@triton.jit
def sinks_window_mask_scaffold(q_pos, k_pos, num_sinks, window):
    """Allowed cells [M, N] of sinks_window(num_sinks, window) for positions q_pos [M, 1], k_pos [1, N]."""
    d = q_pos - k_pos  # [M, N] how far back each key is from its query
    causal = d >= 0
    in_window = blank("the key is one of the last `window` keys up to the query (d counts from 0)")
    is_sink = blank("the key is one of the first num_sinks keys")
    return causal & (in_window | is_sink)


@triton.jit
def sinks_window_mask_solution(q_pos, k_pos, num_sinks, window):
    """Allowed cells [M, N] of sinks_window(num_sinks, window) for positions q_pos [M, 1], k_pos [1, N]."""
    d = q_pos - k_pos  # [M, N] how far back each key is from its query
    causal = d >= 0
    in_window = d < window  # d = 0 is the query's own key, so the window holds d = 0 .. window - 1
    is_sink = k_pos < num_sinks
    return causal & (in_window | is_sink)


def _mistake_window_off_by_one(q_pos, k_pos, num_sinks, window):
    """``d <= window`` keeps window + 1 keys."""
    d = q_pos - k_pos
    return (d >= 0) & ((d <= window) | (k_pos < num_sinks))


def _mistake_sinks_not_causal(q_pos, k_pos, num_sinks, window):
    """Sinks OR'ed outside the causal test: early queries see sink keys from their future."""
    d = q_pos - k_pos
    return ((d >= 0) & (d < window)) | (k_pos < num_sinks)


def _harness(OUT, L, num_sinks, window, FRAG, BM: tl.constexpr, BN: tl.constexpr):
    # one program per (query tile, key tile) of an L x L grid
    qi = tl.program_id(0)
    kj = tl.program_id(1)
    q_pos = qi * BM + tl.arange(0, BM)  # [BM]
    k_pos = kj * BN + tl.arange(0, BN)  # [BN]
    allowed = FRAG(q_pos[:, None], k_pos[None, :], num_sinks, window)  # [BM, BN]
    tl.store(OUT + q_pos[:, None] * L + k_pos[None, :], allowed.to(tl.int8))


def check_sinks_window_mask(fn) -> None:
    """Evaluate ``fn`` tile by tile over a 64 x 64 grid for three (num_sinks, window) settings and compare
    every cell with ``patterns.sinks_window``. Raises AssertionError naming the first wrong cell."""
    L, B = 64, 16
    for n, w in ((4, 16), (0, 1), (20, 24)):
        out = torch.full((L, L), -1, dtype=torch.int8)  # poisoned: every cell must be written
        run("sinks_window_mask", lambda: interpreted(_harness)[(L // B, L // B)](
            out, L, n, w, FRAG=interpreted(fn), BM=B, BN=B))
        q = torch.arange(L).view(L, 1)
        k = torch.arange(L).view(1, L)
        want = P.sinks_window(n, w)(0, 0, q, k)
        bad = (out != want.to(torch.int8)).nonzero()
        if len(bad):
            i, j = (int(x) for x in bad[0])
            raise AssertionError(f"sinks_window_mask(num_sinks={n}, window={w}): cell (q={i}, kv={j}) is "
                                 f"{'allowed' if out[i, j] == 1 else 'masked'}, should be "
                                 f"{'allowed' if want[i, j] else 'masked'} ({len(bad)} wrong cells)")
    passed("sinks_window_mask", "every cell of a 64 x 64 grid, three settings")


EXERCISES = [Exercise("sinks_window_mask", sinks_window_mask_scaffold, sinks_window_mask_solution,
                      check_sinks_window_mask, mistakes=(_mistake_window_off_by_one, _mistake_sinks_not_causal),
                      prompt="the window and sink tests of a partial tile")]
