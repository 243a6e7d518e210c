"""Chapter 9 exercises: price a launch on the roofline, schedule its programs, and stream bytes.

* :func:`roofline_ms_scaffold` -- the time of one launch from its FLOPs and bytes and the ceilings:
  ``max(F / P, D / W) + T_launch``.
* :func:`makespan_scaffold` -- the finish time of the last program when programs, in dispatch order, go to
  the SM that frees first (the wave tail the cost model prices; checked against
  :func:`sparseattn.roofline.model.makespan`).
* :func:`read_scaffold` -- a ``@triton.jit`` fragment: each program sums ``BLOCK`` elements of a vector, the
  streaming read whose bandwidth is the memory ceiling. Checked in the Triton interpreter.

A blank is a call of :func:`sparseattn.exercises.blank`; replace it with your code.
"""
from __future__ import annotations

import heapq
import math

import numpy as np
import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from ..roofline.model import makespan
from . import Exercise, blank, interpreted, passed, run

__all__ = ["roofline_ms_scaffold", "roofline_ms_solution", "check_roofline_ms", "makespan_scaffold",
           "makespan_solution", "check_makespan", "read_scaffold", "read_solution", "check_read", "EXERCISES"]


# ---------------------------------------------------------------------------------------------------------
# 1. one launch on the roofline
# ---------------------------------------------------------------------------------------------------------
def roofline_ms_scaffold(flops: float, hbm_bytes: float, peak_tflops: float, hbm_tbps: float,
                         launch_ms: float) -> float:
    """Milliseconds of one launch: the slower of its compute and its memory traffic, plus the launch."""
    compute_ms = flops / (peak_tflops * 1e12) * 1e3
    memory_ms = hbm_bytes / (hbm_tbps * 1e12) * 1e3
    return blank("combine compute_ms, memory_ms and launch_ms")


def roofline_ms_solution(flops: float, hbm_bytes: float, peak_tflops: float, hbm_tbps: float,
                         launch_ms: float) -> float:
    """Milliseconds of one launch: the slower of its compute and its memory traffic, plus the launch."""
    compute_ms = flops / (peak_tflops * 1e12) * 1e3
    memory_ms = hbm_bytes / (hbm_tbps * 1e12) * 1e3
    return max(compute_ms, memory_ms) + launch_ms  # the two overlap: the slower one sets the pace


def check_roofline_ms(fn) -> None:
    """A compute-bound prefill tile set, a memory-bound decode read and a tiny launch-bound call."""
    cases = [("prefill, compute-bound", 2e12, 4e9, 740, 4.6, 0.04), ("decode, memory-bound", 1.7e10, 4.3e9, 740, 4.6,
                                                                       0.02), ("tiny call", 1e6, 1e6, 740, 4.6, 0.04)]
    for name, F, Dh, P, W, T in cases:
        got = run("roofline_ms", lambda: fn(F, Dh, P, W, T))
        want = roofline_ms_solution(F, Dh, P, W, T)
        if not isinstance(got, (int, float)) or not math.isclose(got, want, rel_tol=1e-9):
            raise AssertionError(f"roofline_ms, {name}: got {got}, expected {want:.4g} ms (compute "
                                 f"{F / P / 1e9:.4g} ms, memory {Dh / W / 1e9:.4g} ms, launch {T} ms: compute and "
                                 f"memory overlap, the launch does not)")
    passed("roofline_ms", "compute-bound, memory-bound and launch-bound calls")


# ---------------------------------------------------------------------------------------------------------
# 2. the block scheduler's greedy assignment
# ---------------------------------------------------------------------------------------------------------
def makespan_scaffold(units, slots: int) -> float:
    """Finish time of the last program: ``units[i]`` is the time of program i (dispatch order), each program
    goes to the SM (of ``slots``) that frees first."""
    free = [0.0] * slots  # when each SM is free again
    heapq.heapify(free)
    for u in units:
        blank("give program u to the SM that frees first: update the heap")
    return max(free) if len(units) else 0.0


def makespan_solution(units, slots: int) -> float:
    """Finish time of the last program: ``units[i]`` is the time of program i (dispatch order), each program
    goes to the SM (of ``slots``) that frees first."""
    free = [0.0] * slots  # when each SM is free again
    heapq.heapify(free)
    for u in units:
        heapq.heapreplace(free, free[0] + float(u))  # the earliest-free SM runs it, then frees u later
    return max(free) if len(units) else 0.0


def check_makespan(fn) -> None:
    """Against :func:`sparseattn.roofline.model.makespan` on random program lists, and on the case that tells
    the greedy schedule from an even split: one long program and many short ones."""
    rng = np.random.default_rng(0)
    cases = [("one long, many short", np.array([10.0] + [1.0] * 12), 4), ("equal programs, 2.5 waves", np.ones(10), 4)]
    cases += [(f"random #{i}", rng.integers(1, 30, size=int(rng.integers(1, 60))).astype(float),
               int(rng.integers(1, 9))) for i in range(20)]
    for name, units, slots in cases:
        got = run("makespan", lambda: fn(units, slots))
        want = makespan(units, slots)
        if not math.isclose(float(got), want, rel_tol=1e-12):
            raise AssertionError(f"makespan, {name} ({len(units)} programs on {slots} SMs): got {got}, expected "
                                 f"{want} (the even split would be {units.sum() / slots:.3g})")
    passed("makespan", f"{len(cases)} program lists")


# ---------------------------------------------------------------------------------------------------------
# 3. the streaming read
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def read_scaffold(X, OUT, n, BLOCK: tl.constexpr):
    """Program p writes OUT[p] = sum of X[p * BLOCK : (p + 1) * BLOCK] (elements at or past ``n`` count 0)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    b_x = blank("load the block of X; lanes at or past n must not be read")
    tl.store(OUT + pid, tl.sum(b_x.to(tl.float32), 0))


@triton.jit
def read_solution(X, OUT, n, BLOCK: tl.constexpr):
    """Program p writes OUT[p] = sum of X[p * BLOCK : (p + 1) * BLOCK] (elements at or past ``n`` count 0)."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    b_x = tl.load(X + offs, mask=offs < n, other=0.0)  # the last block is cut at n
    tl.store(OUT + pid, tl.sum(b_x.to(tl.float32), 0))


def check_read(fn) -> None:
    """Sum 1000 values in blocks of 64 (the last block cut short); the buffer holds NaN past element 1000,
    so a load that ignores ``n`` shows."""
    n, block = 1000, 64
    x = torch.full((n + 2 * block,), float("nan"))
    x[:n] = torch.randn(n, generator=torch.Generator().manual_seed(0))
    programs = math.ceil(n / block)
    out = torch.full((programs,), float("nan"))
    run("read", lambda: interpreted(fn)[(programs,)](x, out, n, BLOCK=block))
    want = torch.nn.functional.pad(x[:n], (0, programs * block - n)).view(programs, block).sum(1)
    if not torch.isfinite(out).all():
        raise AssertionError(f"read: programs {torch.nonzero(~torch.isfinite(out)).flatten().tolist()} summed NaN: "
                             f"they read past n = {n} (mask the load)")
    if not torch.allclose(out, want, atol=1e-4):
        raise AssertionError(f"read: block sums differ from torch by up to {float((out - want).abs().max()):.3g}")
    passed("read", f"{programs} programs, {n * 4} bytes")


# ---------------------------------------------------------------------------------------------------------
# the mistakes people make (the tests show that each check rejects them)
# ---------------------------------------------------------------------------------------------------------
def _roofline_ms_sum(flops, hbm_bytes, peak_tflops, hbm_tbps, launch_ms):
    """Adds compute and memory time: a kernel overlaps them, so this over-predicts every call."""
    return flops / (peak_tflops * 1e12) * 1e3 + hbm_bytes / (hbm_tbps * 1e12) * 1e3 + launch_ms


def _roofline_ms_no_launch(flops, hbm_bytes, peak_tflops, hbm_tbps, launch_ms):
    """Forgets the launch: a tiny call is predicted to take no time at all."""
    return max(flops / (peak_tflops * 1e12) * 1e3, hbm_bytes / (hbm_tbps * 1e12) * 1e3)


def _makespan_even_split(units, slots):
    """The total work split evenly over the SMs: no program is ever cut in pieces, so this misses the tail."""
    return float(np.sum(units)) / slots if len(units) else 0.0


def _makespan_round_robin(units, slots):
    """Program i to SM i mod slots, whatever is free: a long program stalls its SM's later programs."""
    busy = [0.0] * slots
    for i, u in enumerate(units):
        busy[i % slots] += float(u)
    return max(busy) if len(units) else 0.0


def _read_unmasked(X, OUT, n, BLOCK: tl.constexpr):
    """Loads the whole last block: the lanes past ``n`` read whatever lies there."""
    pid = tl.program_id(0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    tl.store(OUT + pid, tl.sum(tl.load(X + offs).to(tl.float32), 0))


EXERCISES = [
    Exercise("roofline_ms", roofline_ms_scaffold, roofline_ms_solution, check_roofline_ms,
             mistakes=(_roofline_ms_sum, _roofline_ms_no_launch), prompt="the slower of compute and memory, plus the launch"),
    Exercise("makespan", makespan_scaffold, makespan_solution, check_makespan,
             mistakes=(_makespan_even_split, _makespan_round_robin), prompt="the SM that frees first runs the next program"),
    Exercise("read", read_scaffold, read_solution, check_read, mistakes=(_read_unmasked,),
             prompt="a masked load of one block"),
]
