"""Chapter 11 exercises: the empty-row rule of the kernels' epilogue (a Triton fragment), and the comparison
that catches a kernel bug (the reference on the same edges, not full attention).

Each exercise (:class:`sparseattn.exercises.Exercise`) has a scaffold (one or two lines replaced by
:func:`~sparseattn.exercises.blank`), its solution, a ``check_<name>`` that raises AssertionError with a
helpful message when a candidate is wrong, and the mistakes people make (wrong variants the check must
reject; the tests run them). Triton fragments run in the interpreter on CPU tensors, on any machine.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from .. import kernels  # noqa: F401  (chooses the Triton backend before the fragments below are defined)
from .. import patterns as P
from ..layout import BlockLayout
from ..reference import reference_attention
from . import Exercise, blank, interpreted, passed, run

__all__ = ["finalize_scaffold", "finalize_solution", "check_finalize", "same_edges_error_scaffold",
           "same_edges_error_solution", "check_same_edges_error", "drop_one_tile", "EXERCISES"]


# ---------------------------------------------------------------------------------------------------------
# 1. the epilogue's empty-row rule (Triton)
# ---------------------------------------------------------------------------------------------------------
@triton.jit
def finalize_scaffold(m_i, l_i, acc):
    """``(o [M, D], lse [M])`` from the online-softmax state in base 2: running max ``m_i`` (``-inf`` while a row
    has seen no allowed key), running sum ``l_i`` and accumulator ``acc``. A row that saw no allowed key
    must give o = 0 and lse = -inf (the natural-log LSE), never NaN."""
    empty = l_i == 0.0  # [M]
    l_safe = blank("a divisor that is l_i, except 1.0 where the row is empty")
    b_o = acc / l_safe[:, None]  # [M, D]
    b_lse = blank("-inf for empty rows, else the natural log of the sum: (m_i + log2(l_safe)) * ln(2)")
    return b_o, b_lse


@triton.jit
def finalize_solution(m_i, l_i, acc):
    """``(o [M, D], lse [M])`` from the online-softmax state in base 2: running max ``m_i`` (``-inf`` while a row
    has seen no allowed key), running sum ``l_i`` and accumulator ``acc``. A row that saw no allowed key
    must give o = 0 and lse = -inf (the natural-log LSE), never NaN."""
    empty = l_i == 0.0  # [M]
    l_safe = tl.where(empty, 1.0, l_i)  # 0 / 0 would be NaN; acc is 0 there, so o = 0
    b_o = acc / l_safe[:, None]  # [M, D]
    b_lse = tl.where(empty, float("-inf"), (m_i + tl.math.log2(l_safe)) * 0.6931471805599453)
    return b_o, b_lse


def _finalize_unguarded(m_i, l_i, acc):
    """No guard: an empty row divides 0 by 0 (NaN) and takes log2(0) + (-inf)."""
    return acc / l_i[:, None], (m_i + tl.math.log2(l_i)) * 0.6931471805599453


def _finalize_base2(m_i, l_i, acc):
    """Guarded, but the LSE stays in base 2: every other op returns natural logs."""
    empty = l_i == 0.0
    l_safe = tl.where(empty, 1.0, l_i)
    return acc / l_safe[:, None], tl.where(empty, float("-inf"), m_i + tl.math.log2(l_safe))


def _finalize_harness(M_I, L_I, ACC, O, LSE, FRAG, M: tl.constexpr, D: tl.constexpr):
    offs_m = tl.arange(0, M)
    idx = offs_m[:, None] * D + tl.arange(0, D)[None, :]  # [M, D]
    b_o, b_lse = FRAG(tl.load(M_I + offs_m), tl.load(L_I + offs_m), tl.load(ACC + idx))
    tl.store(O + idx, b_o)
    tl.store(LSE + offs_m, b_lse)


def check_finalize(fn) -> None:
    """Run ``fn`` in the interpreter on 16 rows, 4 of them empty (m = -inf, l = 0, acc = 0), against the exact
    epilogue. Raises AssertionError when wrong."""
    M, D = 16, 16
    g = torch.Generator().manual_seed(0)
    m_i = torch.randn(M, generator=g) * 4
    l_i = torch.rand(M, generator=g) * 9 + 1
    acc = torch.randn(M, D, generator=g)
    empty = torch.zeros(M, dtype=torch.bool)
    empty[[0, 5, 6, 15]] = True
    m_i[empty], l_i[empty], acc[empty] = -math.inf, 0.0, 0.0
    o = torch.full((M, D), float("nan"))  # poisoned: every element must be written
    lse = torch.full((M,), float("nan"))
    run("finalize", lambda: interpreted(_finalize_harness)[(1,)](m_i, l_i, acc, o, lse, FRAG=interpreted(fn),
                                                                 M=M, D=D))
    if torch.isnan(o).any() or torch.isnan(lse).any():
        rows = sorted(set((torch.isnan(o).any(1) | torch.isnan(lse)).nonzero().flatten().tolist()))
        raise AssertionError(f"finalize: NaN in rows {rows} (empty rows: {empty.nonzero().flatten().tolist()}); "
                             f"an empty row must give o = 0 and lse = -inf")
    if not (o[empty] == 0).all() or not torch.isneginf(lse[empty]).all():
        raise AssertionError("finalize: an empty row must give o = 0 and lse = -inf exactly")
    want_o = acc[~empty].double() / l_i[~empty].double()[:, None]
    want_lse = (m_i[~empty].double() + torch.log2(l_i[~empty].double())) * math.log(2)
    if not torch.allclose(o[~empty].double(), want_o, atol=1e-5, rtol=1e-5):
        raise AssertionError("finalize: the output of a non-empty row is acc / l")
    if not torch.allclose(lse[~empty].double(), want_lse, atol=1e-4, rtol=1e-5):
        raise AssertionError("finalize: the LSE is a natural log: (m_i + log2(l)) * ln(2)")
    passed("finalize", "16 rows, 4 of them empty")


# ---------------------------------------------------------------------------------------------------------
# 2. the comparison that catches a kernel bug
# ---------------------------------------------------------------------------------------------------------
def same_edges_error_scaffold(o: torch.Tensor, q, k, v, layout: BlockLayout) -> float:
    """Relative Frobenius error of a kernel's output ``o`` against the float64 reference of attention over
    exactly the edges ``layout`` stands for."""
    ref = blank("reference_attention(...) in float64 on the layout's own token mask")
    return float((o.double() - ref).norm() / ref.norm())


def same_edges_error_solution(o: torch.Tensor, q, k, v, layout: BlockLayout) -> float:
    """Relative Frobenius error of a kernel's output ``o`` against the float64 reference of attention over
    exactly the edges ``layout`` stands for."""
    ref = reference_attention(q, k, v, layout.to_dense(), dtype=torch.float64)
    return float((o.double() - ref).norm() / ref.norm())


def _error_vs_full(o, q, k, v, layout):
    """Against full attention: the pattern's own effect (baseline 2) swamps any kernel bug."""
    ref = reference_attention(q, k, v)
    return float((o.double() - ref).norm() / ref.norm())


def drop_one_tile(layout: BlockLayout, row: int = -1) -> BlockLayout:
    """The same layout with the first listed tile of one query-tile row removed: what a kernel bug that skips
    a tile computes (rows lose some of their keys)."""
    row = row % layout.nq
    kv_count, kv_index = layout.kv_count.clone(), layout.kv_index.clone()
    full_count, full_index = layout.full_count.clone(), layout.full_index.clone()
    count, index = (full_count, full_index) if int(full_count[0, 0, row]) else (kv_count, kv_index)
    n = int(count[0, 0, row])
    if n == 0:
        raise ValueError(f"query-tile row {row} lists no tile to drop")
    index[0, 0, row, : n - 1] = index[0, 0, row, 1:n].clone()
    count[0, 0, row] = n - 1
    return BlockLayout(kv_count, kv_index, full_count, full_index, q_len=layout.q_len, kv_len=layout.kv_len,
                       block_q=layout.block_q, block_k=layout.block_k, mask_mod=layout.mask_mod,
                       tile_bits=layout.tile_bits, q_offset=layout.q_offset)


def check_same_edges_error(fn) -> None:
    """A correct kernel must score below 1e-5 and a kernel that skips one tile above 1e-3 (sinks + window,
    96 tokens). The two kernels' outputs are stood in for by float32 attention over the edges each one
    walks (the layout, and the layout with one tile dropped), so the check runs on any machine. Raises
    AssertionError when ``fn`` cannot tell them apart."""
    g = torch.Generator().manual_seed(1)
    L = 96
    layout = BlockLayout.from_mask_mod(P.sinks_window(4, 20), L, L, 32, 32, device="cpu")
    q, k, v = (torch.randn(1, 2, L, 16, generator=g) for _ in range(3))
    right = reference_attention(q, k, v, layout.to_dense(), dtype=torch.float32)
    wrong = reference_attention(q, k, v, drop_one_tile(layout).to_dense(), dtype=torch.float32)
    e_right = run("same_edges_error", lambda: fn(right, q, k, v, layout))
    e_wrong = run("same_edges_error", lambda: fn(wrong, q, k, v, layout))
    if not e_right < 1e-5:
        raise AssertionError(f"same_edges_error: the correct kernel scores {e_right:.2e}; compare against the "
                             f"reference over the layout's own edges (layout.to_dense()), not full attention")
    if not e_wrong > 1e-3:
        raise AssertionError(f"same_edges_error: the kernel that skips a tile scores {e_wrong:.2e}, "
                             f"indistinguishable from a correct one")
    passed("same_edges_error", f"right kernel {e_right:.1e}, kernel skipping a tile {e_wrong:.1e}")


EXERCISES = [
    Exercise("finalize", finalize_scaffold, finalize_solution, check_finalize,
             mistakes=(_finalize_unguarded, _finalize_base2),
             prompt="the empty-row guard of the epilogue: o = 0 and lse = -inf, never NaN"),
    Exercise("same_edges_error", same_edges_error_scaffold, same_edges_error_solution, check_same_edges_error,
             mistakes=(_error_vs_full,), prompt="the reference on the layout's own edges"),
]
