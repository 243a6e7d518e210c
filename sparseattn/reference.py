"""The correctness specification: dense attention in high precision, and the softmax merge law.

Every kernel in this package is tested against :func:`reference_attention` on ``layout.to_dense()``. It is
written for clarity, not speed: it materialises the ``Lq x Lk`` score matrix.

Fixed semantics (shared by every op): a query row with no allowed key has output 0 and LSE ``-inf`` and
passes zero gradient; nothing produces NaN unless the inputs hold NaN, and a NaN in K or V reaches only rows
that visit it (here: exactly the rows whose mask allows that key; in a tiled kernel: rows whose visited tiles
hold it).

How close a kernel must come to this reference is one table, :data:`TOLERANCES`, read by :func:`tolerance`
and measured by :func:`relative_error`; the tests, the chapters and the book's pages all use it.
"""
from __future__ import annotations

import math
from typing import Optional

import torch

from ._checks import check_qkv, seqs_tensor
from .paged import PagedKVCache, PageSelection, check_select_args

__all__ = ["reference_attention", "merge_states", "decode_reference", "page_bounds_reference",
           "select_pages_reference", "route_scores_reference", "route_reference", "select_blocks_reference",
           "selection_recall_reference", "TOLERANCES", "tolerance", "relative_error"]


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

    NaN rule: a NaN (or inf) in K or V reaches exactly the rows whose mask allows that key (a masked key is
    left out, not multiplied by zero); the kernels may spread it further, but only inside a tile the row
    visits, never to a row that does not visit it. A NaN in q stays in its row. Scores are computed in
    ``dtype``: in float64 the range is wide, while the float32 kernels need ``|q . k|`` and the scaled scores
    below ``2**127``, so inputs beyond that are finite here and NaN there.
    """
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise TypeError(f"scale must be a finite float or None, got {type(scale).__name__}")
    elif not math.isfinite(scale):  # any finite scale is a spec (zero and negative ones too)
        raise ValueError(f"scale must be a finite float, got {scale!r}")
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
    o = torch.matmul(p, _finite_or_zero(vf))
    o = _with_nonfinite_values(o, p, vf) / safe_l
    if not return_lse:
        return o
    lse = torch.where(nonempty, m + torch.log(safe_l), torch.full_like(l, float("-inf"))).squeeze(-1)
    return o, lse


def _finite_or_zero(v: torch.Tensor) -> torch.Tensor:
    return torch.where(torch.isfinite(v), v, torch.zeros_like(v))


def _with_nonfinite_values(o: torch.Tensor, p: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``o = p @ v`` computed on the finite values of ``v``; put back the elements that a NaN or inf value reaches
    through an allowed key (``p > 0``). A masked key has ``p = 0`` exactly, and ``0 * NaN`` would otherwise
    spread a NaN value to every row, allowed or not."""
    bad = ~torch.isfinite(v)  # [B, H, Lk, D]
    if not bool(bad.any()):
        return o
    reached = torch.matmul((p > 0).to(p.dtype).detach(), bad.to(p.dtype)) > 0  # [B, H, Lq, D]
    b, h, i, d = reached.nonzero(as_tuple=True)
    pv = p[b, h, i, :] * v.transpose(-1, -2)[b, h, d, :]  # [n, Lk]: each reached element's products
    exact = torch.where(p[b, h, i, :] > 0, pv, torch.zeros_like(pv)).sum(-1)  # IEEE sum over the allowed keys
    return o.index_put((b, h, i, d), exact)


def _check_floating(**tensors) -> None:
    """Each named argument must be a floating-point torch tensor (TypeError naming it otherwise)."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if not t.dtype.is_floating_point:
            raise TypeError(f"{name} must be floating point, got {t.dtype}")


def merge_states(o_a: torch.Tensor, lse_a: torch.Tensor, o_b: torch.Tensor, lse_b: torch.Tensor):
    """Merge two partial attention results over disjoint key sets into the result over their union.

    ``o`` is ``[..., D]`` (each normalised over its own keys), ``lse`` is ``[...]`` (natural log). The law:
    ``lse = log(e^lse_a + e^lse_b)``, ``o = (e^(lse_a - lse) o_a + e^(lse_b - lse) o_b)``. It is
    associative and commutative, so any split of a row, merged in any order, gives the whole row. An empty
    state (``lse = -inf``) contributes nothing; two empty states give ``o = 0, lse = -inf``.
    Computed in at least float32; returns ``o`` in ``o_a``'s dtype and ``lse`` in ``lse_a``'s dtype.

    An LSE of ``+inf`` is no state any attention produces (a finite score sum has a finite log) and its weight
    against anything is undefined, so it raises ValueError (this reads the LSEs once on the host). NaN inputs
    are the caller's: a NaN in a state reaches only the merged rows that hold it.
    """
    _check_floating(o_a=o_a, lse_a=lse_a, o_b=o_b, lse_b=lse_b)
    if o_a.shape != o_b.shape:
        raise ValueError(f"o_a and o_b must have the same shape, got {tuple(o_a.shape)} and {tuple(o_b.shape)}")
    if lse_a.shape != lse_b.shape or tuple(lse_a.shape) != tuple(o_a.shape[:-1]):
        raise ValueError(f"lse_a and lse_b must have shape {tuple(o_a.shape[:-1])} (o without its last dim), "
                         f"got {tuple(lse_a.shape)} and {tuple(lse_b.shape)}")
    for name, t in (("lse_a", lse_a), ("lse_b", lse_b)):
        if bool(torch.isposinf(t).any()):
            raise ValueError(f"{name} holds +inf, which no attention state has (an empty state is -inf); the "
                             f"merge of a +inf state is undefined")
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


# ---------------------------------------------------------------------------------------------------------
# The accuracy the kernels promise against this reference: one table, used by the tests, chapters and pages.
# ---------------------------------------------------------------------------------------------------------
TOLERANCES = {
    ("fp32", "fwd"): 1e-5,
    ("fp32", "bwd"): 5e-5,
    ("fp16", "fwd"): 2e-3,
    ("fp16", "bwd"): 1e-2,
    ("bf16", "fwd"): 1e-2,
    ("bf16", "bwd"): 2e-2,
}
"""Bound on :func:`relative_error` of a kernel's result against the float64 reference on the same edge set,
keyed by ``(dtype, pass)``: dtype ``"fp32"``, ``"fp16"`` or ``"bf16"`` (the inputs' dtype), pass ``"fwd"`` for
the output ``o`` and ``"bwd"`` for each of ``dq``, ``dk``, ``dv`` (autograd through the fp64 reference with
the same ``do``). Read it through :func:`tolerance`.

======  ======  ======  ==========================================================================
dtype   fwd     bwd     evidence (relative Frobenius error measured; the bound sits above it)
======  ======  ======  ==========================================================================
fp32    1e-5    5e-5    Triton interpreter on CPU, the test patterns at L=201, D=32: fwd 1.0e-7 to
                        1.7e-7, bwd 2.0e-7 to 3.2e-7 (60x and 150x margin)
fp16    2e-3    1e-2    same CPU runs: fwd 2.2e-4 to 2.6e-4, bwd 3.0e-4 to 3.4e-4; H200
                        (``book/data/bench/errors-h200.json``, causal, D=128): fwd 1.6e-4 at N=32k,
                        2.5e-4 at N=1k (8x margin forward)
bf16    1e-2    2e-2    H200 records: fwd 1.3e-3 at N=32k, 2.0e-3 at N=1k (5x margin), the same as
                        FlexAttention's and cuDNN's; the GPU tests (``tests/gpu``) check gradients at
                        2e-2 (bf16 cannot be checked on CPU: the interpreter's bf16 arithmetic is wrong)
======  ======  ======  ==========================================================================

What a real bug gives: a kernel that skips one listed tile is off by more than 5e-2 (``tests/test_tolerance.py``
plants one and checks that it exceeds every bound here), and an unwritten element is NaN, which no bound
accepts. The low-precision bounds are a few units of the format's rounding (fp16 ``2**-11``, bf16 ``2**-8``):
the output is rounded once to the storage dtype and ``P`` once before the ``P @ V`` product, with float32
accumulation.

The fp32 bounds assume IEEE-exact float32 dots. The interpreter computes them so, and on the GPU every kernel
picks ``input_precision="ieee"`` for float32 inputs (the ``DOT_PRECISION`` heuristic in
``kernels/prefill_fwd.py``, ``prefill_bwd.py``, ``decode.py`` and ``select.py``), so the fp32 bounds cover the
GPU too; a kernel run with tf32 dots (10-bit mantissa) would need the fp16-sized bound instead. For 16-bit
inputs the dot's precision setting does not apply (products of 16-bit values are exact in float32).
"""

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
_PASSES = ("fwd", "bwd")


def tolerance(dtype, pass_: str = "fwd") -> float:
    """The bound from :data:`TOLERANCES` on :func:`relative_error` against the float64 reference.

    ``dtype`` is the kernel inputs' dtype: ``torch.float32``, ``torch.float16`` or ``torch.bfloat16``, or
    its short name ``"fp32"``, ``"fp16"``, ``"bf16"``; ``pass_`` is ``"fwd"`` (the output) or ``"bwd"``
    (each gradient). Example: ``relative_error(o, ref) < tolerance(q.dtype)``.
    """
    if isinstance(dtype, torch.dtype):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype must be one of torch.float32, torch.float16, torch.bfloat16 (the dtypes the "
                             f"kernels run in), got {dtype}")
        name = _DTYPE_NAMES[dtype]
    elif isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES.values():
            raise ValueError(f"dtype must be one of 'fp32', 'fp16', 'bf16' (or a torch.dtype), got {dtype!r}")
        name = dtype
    else:
        raise TypeError(f"dtype must be a torch.dtype or one of 'fp32', 'fp16', 'bf16', got {type(dtype).__name__}")
    if not isinstance(pass_, str):
        raise TypeError(f"pass_ must be 'fwd' or 'bwd', got {type(pass_).__name__}")
    if pass_ not in _PASSES:
        raise ValueError(f"pass_ must be 'fwd' (outputs) or 'bwd' (gradients), got {pass_!r}")
    return TOLERANCES[(name, pass_)]


def relative_error(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative Frobenius error ``||x - ref|| / ||ref||``, computed in float64 (on ``x``'s device).

    ``x`` and ``ref`` must be floating tensors of the same shape. If ``ref`` is all zeros the result is 0.0
    when ``x`` is too and ``inf`` otherwise; a NaN in either gives NaN, which fails every ``< bound`` test.
    The ratio is meaningful when ``ref`` is not itself a cancellation to about zero: a gradient that is zero
    in exact arithmetic (dQ when every row sees a single key) is rounding noise in float64, and there only an
    absolute bound makes sense.
    """
    _check_floating(x=x, ref=ref)
    if x.shape != ref.shape:
        raise ValueError(f"x and ref must have the same shape, got {tuple(x.shape)} and {tuple(ref.shape)}")
    xd = x.detach().to(torch.float64)
    rd = ref.detach().to(device=x.device, dtype=torch.float64)
    diff, norm = float(torch.linalg.vector_norm(xd - rd)), float(torch.linalg.vector_norm(rd))
    if norm == 0.0 and diff == 0.0:
        return 0.0
    return diff / norm if norm > 0.0 else (diff if math.isnan(diff) else math.inf)


def page_bounds_reference(q: torch.Tensor, cache: PagedKVCache, seqs=None) -> torch.Tensor:
    """Eager reference of :func:`sparseattn.routing.page_bounds` (the spec the kernel is tested against): upper bound of
    ``scale``-free ``q . k`` per (row, KV head, logical page), float32 ``[B, Hkv, P_max]``; pages past a
    sequence's end get ``-inf``."""
    B, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    seqs_t = seqs_tensor(seqs, B, q.device, cache.max_seqs)
    phys = cache.page_table[seqs_t.long()].long()  # [B, P]
    kmin = cache.k_min[phys].float()  # [B, P, Hkv, D]
    kmax = cache.k_max[phys].float()
    qg = q.float().view(B, Hkv, Hq // Hkv, D)  # [B, Hkv, G, D]
    # sum_d max(q_d min_d, q_d max_d) = relu(q) . max + min(q, 0) . min: two batched GEMMs, no [.., D] temporary
    bound = (torch.einsum("bhgd,bphd->bhgp", qg.clamp(min=0), kmax)
             + torch.einsum("bhgd,bphd->bhgp", qg.clamp(max=0), kmin)).amax(2)  # max over the group: [B, Hkv, P]
    n_pages = (cache.seq_lens[seqs_t.long()] + cache.page_size - 1) // cache.page_size  # [B]
    live = torch.arange(cache.max_pages_per_seq, device=q.device)[None, :] < n_pages[:, None]
    return torch.where(live[:, None, :], bound, torch.full_like(bound, float("-inf")))


def select_pages_reference(q: torch.Tensor, cache: PagedKVCache, topk: int, seqs=None, always_first: int = 1,
                           always_last: int = 1) -> PageSelection:
    """Eager reference of :func:`sparseattn.select_pages` (a stable sort by bound, then the chosen pages sorted):
    same pages, same order, same tie rule (equal bounds go to the lower page; with ``topk`` below the number
    of forced pages, the lowest forced pages are kept)."""
    B = check_select_args(q, cache, topk, always_first, always_last)
    seqs_t = seqs_tensor(seqs, B, q.device, cache.max_seqs)
    bound = page_bounds_reference(q, cache, seqs_t)  # [B, Hkv, P_max]
    P_max = cache.max_pages_per_seq
    n_pages = ((cache.seq_lens[seqs_t.long()] + cache.page_size - 1) // cache.page_size).long()  # [B]
    pages = torch.arange(P_max, device=q.device)[None, :]
    forced = (pages < always_first) | ((pages >= n_pages[:, None] - always_last) & (pages >= 0))
    forced = forced & (pages < n_pages[:, None])
    score = torch.where(forced[:, None, :], torch.full_like(bound, float("inf")), bound)
    k = min(topk, P_max)
    # a stable descending sort, not torch.topk: among equal scores (forced pages are all +inf) the lower page
    # comes first, the documented tie rule (torch.topk leaves the order of ties unspecified)
    top, idx = torch.sort(score, dim=-1, descending=True, stable=True)
    top, idx = top[..., :k], idx[..., :k]  # [B, Hkv, k]
    ok = top > float("-inf")
    idx = torch.where(ok, idx, torch.full_like(idx, P_max))  # invalid entries sort last
    idx, _ = torch.sort(idx, dim=-1)
    count = ok.sum(-1).to(torch.int32)
    index = torch.where(idx < P_max, idx, torch.zeros_like(idx)).to(torch.int32)
    return PageSelection(index.contiguous(), count, trusted=True)


def decode_reference(q: torch.Tensor, cache: PagedKVCache, seqs=None, pages: Optional[PageSelection] = None,
                     scale: Optional[float] = None, dtype: torch.dtype = torch.float64):
    """Eager reference of :func:`sparseattn.sparse_decode`: ``(o [B, Hq, D], lse [B, Hq])`` in ``dtype``, from
    each sequence's keys gathered densely (``cache.gather_dense``) with the unselected pages masked out. An
    empty sequence or an empty selection gives o = 0 and lse = -inf."""
    B, Hq, D = q.shape
    seqs_list = seqs_tensor(seqs, B, "cpu", cache.max_seqs).tolist()
    outs, lses = [], []
    for b, s in enumerate(seqs_list):
        k, v = cache.gather_dense(s)  # [Hkv, L, D]
        Hkv, L = k.shape[0], k.shape[1]
        if L == 0:
            outs.append(torch.zeros(Hq, D, dtype=dtype, device=q.device))
            lses.append(torch.full((Hq,), -math.inf, dtype=dtype, device=q.device))
            continue
        mask = torch.ones(1, Hkv, 1, L, dtype=torch.bool, device=q.device)
        if pages is not None:
            page_of = torch.arange(L, device=q.device) // cache.page_size
            for h in range(Hkv):
                chosen = pages.index[b, h, : int(pages.count[b, h])].to(q.device).long()
                mask[0, h, 0] = torch.isin(page_of, chosen)
        o, lse = reference_attention(q[b][None, :, None], k[None], v[None], mask=mask, scale=scale, dtype=dtype,
                                     return_lse=True)
        outs.append(o[0, :, 0])
        lses.append(lse[0, :, 0])
    return torch.stack(outs), torch.stack(lses)


# ---------------------------------------------------------------------------------------------------------
# content routing (the spec of sparseattn.route): torch.sort instead of bisection, dense masks, one head at a time
# ---------------------------------------------------------------------------------------------------------
def _pooled_blocks(x: torch.Tensor, block: int):
    """Mean, min and max of every ``block`` rows of ``x [B, H, L, D]`` (the last block clipped), float32
    ``[B, H, n, D]``."""
    B, H, L, D = x.shape
    n = -(-L // block)
    pad = n * block - L
    xf = torch.nn.functional.pad(x.float(), (0, 0, 0, pad)).view(B, H, n, block, D)
    valid = (torch.arange(n * block, device=x.device) < L).view(1, 1, n, block, 1)
    rows = valid.sum(3).float()  # [1, 1, n, 1]
    mean = (xf * valid).sum(3) / rows
    lo = torch.where(valid, xf, torch.full_like(xf, float("inf"))).amin(3)
    hi = torch.where(valid, xf, torch.full_like(xf, float("-inf"))).amax(3)
    return mean, lo, hi


def _shared_heads(spec) -> torch.Tensor:
    """``[LH, n_shared]``: the query heads whose scores each layout head takes the max of."""
    return torch.arange(spec.LH * spec.n_shared).view(spec.LH, spec.n_shared)


def _pooled_score(qp: torch.Tensor, kmean, kmin, kmax, pool: str) -> torch.Tensor:
    """Scores of pooled queries ``[..., r, D]`` against key blocks ``[..., c, D]`` -> ``[..., r, c]``."""
    if pool == "bound":
        return qp.clamp(min=0) @ kmax.transpose(-1, -2) + qp.clamp(max=0) @ kmin.transpose(-1, -2)
    return qp @ kmean.transpose(-1, -2)


def _forced_blocks(spec, j: torch.Tensor, i: torch.Tensor) -> torch.Tensor:
    """Key blocks ``j`` that query block ``i`` always keeps (broadcasting): the first ``sinks``, and for every
    query row the ``local`` key blocks ending at the row's own block."""
    q_first = i * spec.block_q + spec.q_offset
    q_last = torch.clamp((i + 1) * spec.block_q, max=spec.Lq) - 1 + spec.q_offset
    jf = torch.clamp(q_first // spec.block_k, max=spec.nk - 1)
    jd = torch.clamp(q_last // spec.block_k, max=spec.nk - 1)
    if spec.local == 0:
        return (j < spec.sinks) | torch.zeros_like(j + i, dtype=torch.bool)
    return (j < spec.sinks) | ((j >= jf - spec.local + 1) & (j <= jd))


def route_scores_reference(q: torch.Tensor, k: torch.Tensor, block_q: int = 128, block_k: int = 128,
                           causal: bool = True, share: str = "kv_head", pool: str = "mean",
                           scale: Optional[float] = None) -> torch.Tensor:
    """Eager reference of :func:`sparseattn.routing.block_scores`: float32 ``[B, H, nq, nk]``."""
    from ._checks import check_route
    spec = check_route(q, k, block_q, block_k, 0, None, causal, 0, 0, share, pool, "block", None, None, scale)
    return _route_scores(q, k, spec)


def _route_scores(q, k, spec) -> torch.Tensor:
    qp, _, _ = _pooled_blocks(q, spec.block_q)  # [B, Hq, nq, D]
    kmean, kmin, kmax = _pooled_blocks(k, spec.block_k)  # [B, Hkv, nk, D]
    heads = _shared_heads(spec)  # [LH, G]
    kv_of = heads // spec.group
    per_head = _pooled_score(qp[:, heads.flatten()], kmean[:, kv_of.flatten()], kmin[:, kv_of.flatten()],
                             kmax[:, kv_of.flatten()], spec.pool)  # [B, LH * G, nq, nk]
    s = per_head.view(spec.B, spec.LH, spec.n_shared, spec.nq, spec.nk).amax(2) * spec.scale
    if spec.causal:
        i = torch.arange(spec.nq, device=q.device)
        q_last = torch.clamp((i + 1) * spec.block_q, max=spec.Lq) - 1 + spec.q_offset
        visible = torch.arange(spec.nk, device=q.device)[None, :] * spec.block_k <= q_last[:, None]  # [nq, nk]
        s = s.masked_fill(~visible, float("-inf"))
    return s


def _take_top(score: torch.Tensor, pool: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """Bool mask of the ``n`` best members of ``pool`` along the last dim (ties: lower index first)."""
    ranked = torch.where(pool, score, torch.full_like(score, float("-inf")))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices  # stable: lower index first
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(score.shape[-1], device=score.device).expand_as(order))
    return pool & (rank < n[..., None])


def _mass_limit(s, visible, forced, cand, threshold: float) -> torch.Tensor:
    """How many of the best candidates the threshold rule keeps: candidates in score order (ties: lower
    index), each kept while the softmax mass of the pooled scores already kept (forced included) is below
    ``threshold``."""
    p = torch.softmax(s.masked_fill(~visible, float("-inf")), dim=-1)
    p = torch.where(visible, p, torch.zeros_like(p))
    forced_mass = (p * forced).sum(-1, keepdim=True)
    ranked = torch.where(cand, s, torch.full_like(s, float("-inf")))
    order = torch.sort(ranked, dim=-1, descending=True, stable=True).indices
    p_sorted = torch.gather(torch.where(cand, p, torch.zeros_like(p)), -1, order)
    before = torch.cumsum(p_sorted, -1) - p_sorted  # mass of the candidates ahead of each one
    is_cand = torch.gather(cand, -1, order)
    return (is_cand & (forced_mass + before < threshold)).sum(-1)


def route_reference(q: torch.Tensor, k: torch.Tensor, block_q: int = 128, block_k: int = 128,
                    topk: Optional[int] = None, threshold: Optional[float] = None, causal: bool = True,
                    local: int = 1, sinks: int = 1, share: str = "kv_head", pool: str = "mean",
                    semantics: str = "block", capacity: Optional[int] = None, member_topk: Optional[int] = None,
                    scale: Optional[float] = None):
    """Eager reference of :func:`sparseattn.route`: the same layout (same lists, widths and member bits),
    computed with ``torch.sort`` on the dense block scores and validated."""
    from . import patterns as P
    from ._checks import check_route
    from .layout import BlockLayout
    spec = check_route(q, k, block_q, block_k, topk, threshold, causal, local, sinks, share, pool, semantics,
                       capacity, member_topk, scale)
    kv_count, kv_index, full_count, full_index = select_blocks_reference(_route_scores(q, k, spec), spec)
    row_slot = None
    if semantics == "member":
        row_slot = _member_reference(q, k, spec, kv_count, kv_index)
        mask_mod = P.causal() if causal else P.full()
    else:
        mask_mod = P.causal() if causal else None
    return BlockLayout(kv_count, kv_index, full_count, full_index, q_len=spec.Lq, kv_len=spec.Lk, block_q=block_q,
                       block_k=block_k, mask_mod=mask_mod, row_slot=row_slot)


def select_blocks_reference(s: torch.Tensor, spec):
    """The selection rule on given block scores ``s [B, LH, nq, nk]`` (-inf: not visible) and a checked
    :class:`~sparseattn._checks.RouteSpec`: row lists ``(kv_count, kv_index, full_count, full_index)``. Shared by
    :func:`route_reference` and the GPU test that compares the top-k kernel on the same scores."""
    from . import _tiles as T
    dev = s.device
    j = torch.arange(spec.nk, device=dev)[None, :]  # [1, nk]
    visible = s > float("-inf")
    forced = visible & _forced_blocks(spec, j, torch.arange(spec.nq, device=dev)[:, None])
    cand = visible & ~forced
    n = torch.minimum(torch.clamp(spec.capacity - forced.sum(-1), min=0), cand.sum(-1))
    n = torch.clamp(n, max=spec.topk)
    if spec.threshold is not None:
        n = torch.minimum(n, _mass_limit(s, visible, forced, cand, spec.threshold))
    take = forced | _take_top(s, cand, n)  # [B, LH, nq, nk]
    i = torch.arange(spec.nq, device=dev)[:, None]
    if spec.semantics == "member":
        partial, full = take, torch.zeros_like(take)
    else:
        full = take
        if spec.causal:  # the block's last key (clipped) is not after the query block's first position
            full = take & (torch.clamp((j + 1) * spec.block_k, max=spec.Lk) - 1 <= i * spec.block_q + spec.q_offset)
        partial = take & ~full
    kv_count, kv_index = T.rows_to_lists(partial, spec.width)
    full_count, full_index = T.rows_to_lists(full, spec.full_width)
    return kv_count, kv_index, full_count, full_index


def _member_reference(q, k, spec, kv_count, kv_index) -> torch.Tensor:
    """Row x slot bits uint8 ``[B, LH, Lq, W]``: each query row keeps its block's forced slots and its own
    ``member_topk`` best other slots (per-row scores against pooled keys; ties: lower slot)."""
    dev = q.device
    kmean, kmin, kmax = _pooled_blocks(k, spec.block_k)
    heads = _shared_heads(spec)
    kv_of = heads // spec.group
    r = torch.arange(spec.Lq, device=dev)
    qi = r // spec.block_q  # [Lq]
    idx = kv_index.long()[:, :, qi]  # [B, LH, Lq, W]: each row's block selection
    listed = torch.arange(spec.width, device=dev) < kv_count[:, :, qi, None]
    score = torch.full(idx.shape, float("-inf"), device=dev)
    for g in range(spec.n_shared):
        hq, hkv = heads[:, g], kv_of[:, g]  # [LH]
        qr = q[:, hq].float()  # [B, LH, Lq, D]

        def gather(t):
            return torch.gather(t[:, hkv], 2, idx.flatten(2)[..., None].expand(-1, -1, -1, spec.D)).view(
                *idx.shape, spec.D)  # [B, LH, Lq, W, D]
        if spec.pool == "bound":
            sg = (qr.clamp(min=0)[..., None, :] * gather(kmax)).sum(-1) + \
                (qr.clamp(max=0)[..., None, :] * gather(kmin)).sum(-1)
        else:
            sg = (qr[..., None, :] * gather(kmean)).sum(-1)
        score = torch.maximum(score, sg)
    usable = listed
    if spec.causal:
        usable = usable & (idx * spec.block_k <= (r + spec.q_offset)[None, None, :, None])
    forced = listed & _forced_blocks(spec, idx, qi[None, None, :, None])
    cand = usable & ~forced
    n = torch.clamp(cand.sum(-1), max=spec.member_topk)
    return (forced | _take_top(score, cand, n)).to(torch.uint8)


def selection_recall_reference(q: torch.Tensor, k: torch.Tensor, layout, causal: bool = True,
                               scale: Optional[float] = None) -> torch.Tensor:
    """Eager reference of :func:`sparseattn.selection_recall` on every row: float64 ``[B, Hq, Lq]``, the full
    attention's probabilities (dense, ``causal`` or not) summed over ``layout.to_dense()``."""
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, k)
    scale = 1.0 / math.sqrt(D) if scale is None else scale
    s = (q.double() @ _expand_heads(k.double(), Hq).transpose(-1, -2)) * scale
    if causal:
        q_abs = torch.arange(Lq, device=q.device) + max(Lk - Lq, 0)
        s = s.masked_fill(torch.arange(Lk, device=q.device)[None, :] > q_abs[:, None], float("-inf"))
    p = torch.softmax(s, dim=-1)
    mask = layout.to_dense()
    return (p * _expand_heads(mask, Hq) if mask.shape[1] != 1 else p * mask).sum(-1)
