"""The correctness specification: dense attention in high precision, and the softmax merge law.

Every kernel in this package is tested against :func:`reference_attention` on ``layout.to_dense()``. It is
written for clarity, not speed: it materialises the ``Lq x Lk`` score matrix.

Fixed semantics (shared by every op): a query row with no allowed key has output 0 and LSE ``-inf`` and
passes zero gradient; nothing produces NaN unless the inputs hold NaN, and then only in the affected rows.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

__all__ = ["reference_attention", "merge_states", "check_qkv"]


def _check_tensor(name: str, t, dims: int):
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")


def check_qkv(q, k, v):
    """Validate q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (Hq % Hkv == 0); return ``(B, Hq, Hkv, Lq, Lk, D)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_tensor(name, t, 4)
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    B, Hq, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if tuple(v.shape[:3]) != (Bk, Hkv, Lk):
        raise ValueError(f"v must match k in [B, Hkv, Lk], got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if Bk != B:
        raise ValueError(f"q and k must have the same batch size, got {B} and {Bk}")
    if Dk != D:
        raise ValueError(f"q and k must have the same head dim, got {D} and {Dk}")
    if min(B, Hq, Lq, D, Hkv, Lk) < 1:
        raise ValueError(f"every dimension must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv}) for GQA")
    return B, Hq, Hkv, Lq, Lk, D


def _expand_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, h, ...] -> [B, heads, ...]: head i of the result reads head i // (heads // h)."""
    h = x.shape[1]
    return x if h == heads else x.repeat_interleave(heads // h, dim=1)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Optional[torch.Tensor] = None,
                        scale: Optional[float] = None, dtype: torch.dtype = torch.float64,
                        return_lse: bool = False):
    """Dense masked attention computed in ``dtype`` (fp64 by default); differentiable through autograd.

    ``mask`` is bool ``[B|1, H|1, Lq, Lk]`` with ``H`` in {Hkv, Hq} (KV-head masks apply to their query-head
    group), True = allowed, so ``layout.to_dense()`` can be passed directly. Returns ``o [B, Hq, Lq, Dv]`` in
    ``dtype`` and, with ``return_lse``, the natural-log LSE ``[B, Hq, Lq]`` in ``dtype``.
    """
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool) or not math.isfinite(scale):
        raise TypeError(f"scale must be a finite float, got {scale!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    qf = q.to(dtype)
    kf = _expand_heads(k.to(dtype), Hq)
    vf = _expand_heads(v.to(dtype), Hq)
    s = torch.matmul(qf, kf.transpose(-1, -2)) * scale  # [B, Hq, Lq, Lk]
    if mask is not None:
        if not isinstance(mask, torch.Tensor) or mask.dtype != torch.bool:
            raise TypeError(f"mask must be a bool tensor, got {getattr(mask, 'dtype', type(mask).__name__)}")
        if mask.dim() != 4 or mask.shape[0] not in (1, B) or mask.shape[1] not in (1, Hkv, Hq) \
                or tuple(mask.shape[2:]) != (Lq, Lk):
            raise ValueError(f"mask must have shape [1|{B}, 1|{Hkv}|{Hq}, {Lq}, {Lk}], got {tuple(mask.shape)}")
        if mask.device != q.device:
            raise ValueError(f"mask is on {mask.device} but q is on {q.device}")
        if mask.shape[1] not in (1, Hq):
            mask = _expand_heads(mask, Hq)
        s = s.masked_fill(~mask, float("-inf"))
    # Subtract the row max (a constant per row: no gradient flows through it). An empty row has max -inf;
    # use 0 there so exp gives exact zeros instead of NaN.
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    nonempty = l > 0
    safe_l = torch.where(nonempty, l, torch.ones_like(l))
    o = torch.matmul(p, vf) / safe_l
    if not return_lse:
        return o
    lse = torch.where(nonempty, m + torch.log(safe_l), torch.full_like(l, float("-inf"))).squeeze(-1)
    return o, lse


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attention results over disjoint key sets into the result over their union.

    ``o`` is ``[..., D]`` (each normalised over its own keys), ``lse`` is ``[...]`` (natural log). The law:
    ``lse = log(e^lse_a + e^lse_b)``, ``o = (e^(lse_a - lse) o_a + e^(lse_b - lse) o_b)``. It is
    associative and commutative, so any split of a row, merged in any order, gives the whole row. An empty
    state (``lse = -inf``) contributes nothing; two empty states give ``o = 0, lse = -inf``.
    Computed in at least float32; returns ``o`` in ``o_a``'s dtype and ``lse`` in ``lse_a``'s dtype.
    """
    for name, t in (("o_a", o_a), ("lse_a", lse_a), ("o_b", o_b), ("lse_b", lse_b)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    if lse_a.shape != lse_b.shape or tuple(lse_a.shape) != tuple(o_a.shape[:-1]):
        raise ValueError(f"lse_a and lse_b must have shape {tuple(o_a.shape[:-1])} (o without its last dim), "
                         f"got {tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    work = torch.promote_types(torch.promote_types(o_a.dtype, o_b.dtype), torch.float32)
    la, lb = lse_a.to(work), lse_b.to(work)
    m = torch.maximum(la, lb)
    empty = m == float("-inf")
    m_safe = torch.where(empty, torch.zeros_like(m), m)
    wa, wb = torch.exp(la - m_safe), torch.exp(lb - m_safe)  # exp(-inf) = 0 for an empty side
    total = wa + wb
    safe_total = torch.where(empty, torch.ones_like(total), total)
    # an empty side's o is ignored outright (not multiplied by 0), so whatever it holds cannot leak in
    part_a = torch.where((la == float("-inf"))[..., None], 0.0, wa[..., None] * o_a.to(work))
    part_b = torch.where((lb == float("-inf"))[..., None], 0.0, wb[..., None] * o_b.to(work))
    o = (part_a + part_b) / safe_total[..., None]
    lse = torch.where(empty, torch.full_like(m, float("-inf")), m_safe + torch.log(safe_total))
    return o.to(o_a.dtype), lse.to(lse_a.dtype)
