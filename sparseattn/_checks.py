"""Argument checks and constants shared by every module (one copy each).

Each check raises ``TypeError`` (wrong kind of value) or ``ValueError`` (right kind, broken rule) with a
message that names the argument and the rule. Nothing here imports Triton or touches a GPU.
"""
from __future__ import annotations

import functools
import math

import torch

from . import _runtime

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634  # log2(e): kernels run softmax in base 2 (exp2 is one instruction)
LN2 = 0.6931471805599453  # ln(2): back from base 2 to the natural-log LSE every op returns


def check_int(name: str, value, minimum: int = 1) -> int:
    """``value`` is a Python int (not a bool) and at least ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_block(name: str, value) -> int:
    """A tile size: a power of two >= 16 (what ``tl.dot`` and the bit tables need)."""
    check_int(name, value)
    if value < 16 or value & (value - 1):
        raise ValueError(f"{name} must be a power of two >= 16, got {value}")
    return value


def check_tensor(name: str, t, dims: int) -> None:
    """``t`` is a floating-point tensor with ``dims`` dimensions."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if not t.dtype.is_floating_point:
        raise TypeError(f"{name} must be a floating-point tensor, got {t.dtype}")
    if t.dim() != dims:
        raise ValueError(f"{name} must have {dims} dimensions, got shape {tuple(t.shape)}")


def check_qkv(q, k, v):
    """Validate q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (Hq % Hkv == 0); return ``(B, Hq, Hkv, Lq, Lk, D)``."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, 4)
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
        raise ValueError(f"q's query heads ({Hq}) must be a multiple of k's and v's KV heads ({Hkv}) for GQA")
    return B, Hq, Hkv, Lq, Lk, D


def check_kernel_dtype(name: str, dtype: torch.dtype) -> None:
    if dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16 or float32, got {dtype}")


def check_head_dim(D: int, what: str = "q's head dim") -> None:
    if D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"{what} must be one of {SUPPORTED_HEAD_DIMS}, got {D}")


def check_scale(scale, D: int) -> float:
    """The softmax scale: ``None`` gives ``1/sqrt(D)``; otherwise a positive finite real number."""
    if scale is None:
        return 1.0 / math.sqrt(D)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a positive finite float or None, got {type(scale).__name__}")
    if not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    return float(scale)


def seqs_tensor(seqs, B: int, device, max_seqs: int) -> torch.Tensor:
    """Sequence of each query row as int32 on ``device``. Host values (lists, CPU tensors) are range-checked
    here; a tensor already on the GPU is trusted, since checking it would synchronise."""
    if seqs is None:
        if B > max_seqs:
            raise ValueError(f"q has {B} rows but the cache holds at most max_seqs={max_seqs} sequences")
        return torch.arange(B, device=device, dtype=torch.int32)
    if isinstance(seqs, torch.Tensor) and seqs.dtype.is_floating_point:
        raise TypeError(f"seqs must hold integers, got {seqs.dtype}")
    on_host = not (isinstance(seqs, torch.Tensor) and seqs.device.type != "cpu")
    seqs = torch.as_tensor(seqs)
    if seqs.shape != (B,):
        raise ValueError(f"seqs must have shape [{B}] (one sequence per query row), got {tuple(seqs.shape)}")
    if on_host and B and (int(seqs.min()) < 0 or int(seqs.max()) >= max_seqs):
        raise ValueError(f"seqs must be in [0, max_seqs={max_seqs}), got {seqs.tolist()}")
    return seqs.to(device=device, dtype=torch.int32)


def check_query_fits_cache(q, cache) -> None:
    """A decode query ``[B, Hq, D]`` that the paged ``cache`` can serve: device, dtype, head dim, GQA."""
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [B, Hq, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    B, Hq, D = q.shape
    check_kernel_dtype("q", q.dtype)
    if q.dtype != cache.dtype:
        raise TypeError(f"q is {q.dtype} but the cache holds {cache.dtype}")
    if D != cache.head_dim:
        raise ValueError(f"q's head dim ({D}) must equal the cache's ({cache.head_dim})")
    check_head_dim(D)
    if Hq % cache.num_kv_heads:
        raise ValueError(f"q's query heads ({Hq}) must be a multiple of the cache's KV heads ({cache.num_kv_heads})")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {cache.device}")


def check_device(t: torch.Tensor, what: str = "q") -> None:
    """Every op runs where its inputs are. A CPU tensor while a GPU is present would be handed to a CUDA
    launch: refuse it, naming the rule (the interpreter runs CPU tensors only when chosen before import)."""
    if t.device.type == "cpu" and _runtime.select_backend() == "cuda":
        raise ValueError(f"{what} is on the CPU but a GPU is present and the kernels run on it: move the inputs "
                         "to CUDA, or set TRITON_INTERPRET=1 before importing sparseattn to run the kernels on "
                         "the CPU")


# ---- content routing (shared by sparseattn.routing.route and its eager reference) -----------------------------
ROUTE_SHARES = ("kv_head", "all", "none")
ROUTE_POOLS = ("mean", "bound")
ROUTE_SEMANTICS = ("block", "member")
ROUTE_MAX_KEY_BLOCKS = 8192  # the top-k kernel keeps one query block's scores in registers


class RouteSpec:
    """The checked arguments of a routing call and what follows from the shapes alone (so the selection's
    capacity, and every launch, is fixed before any data is read)."""

    __slots__ = ("B", "Hq", "Hkv", "Lq", "Lk", "D", "block_q", "block_k", "nq", "nk", "q_offset", "topk",
                 "threshold", "causal", "local", "sinks", "share", "pool", "semantics", "member_topk", "scale",
                 "capacity", "LH", "n_shared", "group", "width", "full_width")

    def __init__(self, **kw):
        for k, v in kw.items():
            setattr(self, k, v)


@functools.lru_cache(maxsize=256)
def _query_span(Lq: int, Lk: int, block_q: int, block_k: int) -> int:
    """The most key blocks that one query block's own positions fall in (1 when the blocks are equal and the
    queries start on a block boundary)."""
    nq, nk, off = -(-Lq // block_q), -(-Lk // block_k), max(Lk - Lq, 0)
    return max(min((min((i + 1) * block_q, Lq) - 1 + off) // block_k, nk - 1)
               - min((i * block_q + off) // block_k, nk - 1) + 1 for i in range(nq))


def check_route(q, k, block_q, block_k, topk, threshold, causal, local, sinks, share, pool, semantics, capacity,
                member_topk, scale) -> RouteSpec:
    """Check the arguments of ``route`` (and ``route_reference``); derive the layout's dims and widths.

    Widths: ``capacity`` (default ``min(nk, topk + forced)``, ``topk=None`` counting as ``nk``; ``forced =
    sinks + local`` when query and key blocks are equal and aligned, plus the extra key blocks a query block's
    own positions fall in otherwise) bounds the tiles a query block keeps. With ``semantics="block"`` the full tiles go to a list of that width and the
    tiles that cross the causal diagonal to a partial list of width ``min(nk, (block_q - 1) // block_k + 2)``
    (the most key blocks a query block's span can cross); with ``"member"`` every tile is partial."""
    for name, t in (("q", q), ("k", k)):
        check_tensor(name, t, 4)
        check_kernel_dtype(name, t.dtype)
    if q.device != k.device:
        raise ValueError(f"q and k must be on one device, got {q.device} and {k.device}")
    B, Hq, Lq, D = q.shape
    Bk, Hkv, Lk, Dk = k.shape
    if Bk != B or Dk != D:
        raise ValueError(f"q [B, Hq, Lq, D] and k [B, Hkv, Lk, D] must share B and D, got {tuple(q.shape)} and "
                         f"{tuple(k.shape)}")
    if min(B, Hq, Lq, Hkv, Lk) < 1:
        raise ValueError(f"every dimension must be >= 1, got q {tuple(q.shape)}, k {tuple(k.shape)}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of KV heads ({Hkv}) for GQA")
    check_head_dim(D)
    check_block("block_q", block_q)
    check_block("block_k", block_k)
    nq, nk = -(-Lq // block_q), -(-Lk // block_k)
    if nk > ROUTE_MAX_KEY_BLOCKS:
        raise ValueError(f"routing supports at most {ROUTE_MAX_KEY_BLOCKS} key blocks, got nk = {nk} "
                         f"(Lk={Lk}, block_k={block_k}); use larger key blocks")
    if topk is None and threshold is None:
        raise ValueError("give topk (blocks kept per query block beyond the forced ones), threshold (softmax "
                         "mass to reach), or both")
    if topk is not None:
        check_int("topk", topk, 0)
    if threshold is not None:
        if isinstance(threshold, bool) or not isinstance(threshold, (int, float)):
            raise TypeError(f"threshold must be a float in (0, 1] or None, got {type(threshold).__name__}")
        if not 0.0 < threshold <= 1.0:
            raise ValueError(f"threshold must be in (0, 1] (a share of the softmax mass), got {threshold}")
        threshold = float(threshold)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_int("local", local, 0)
    check_int("sinks", sinks, 0)
    for name, value, allowed in (("share", share, ROUTE_SHARES), ("pool", pool, ROUTE_POOLS),
                                 ("semantics", semantics, ROUTE_SEMANTICS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    if semantics == "member":
        if member_topk is None:
            raise ValueError("semantics='member' needs member_topk: how many of its query block's non-forced "
                             "blocks each query row keeps")
        check_int("member_topk", member_topk, 0)
    elif member_topk is not None:
        raise ValueError("member_topk applies only to semantics='member'")
    scale = check_scale(scale, D)
    q_offset = max(Lk - Lq, 0)
    forced = min(nk, sinks + (local + _query_span(Lq, Lk, block_q, block_k) - 1 if local else 0))
    default = min(nk, (nk if topk is None else topk) + forced)
    if capacity is None:
        capacity = max(default, 1)
    else:
        check_int("capacity", capacity)
        if capacity < forced:
            raise ValueError(f"capacity ({capacity}) must hold the forced blocks: up to {forced} (sinks + local, and "
                             f"every key block a query block's own positions fall in)")
        capacity = min(capacity, nk)
    group = Hq // Hkv
    LH, n_shared = {"none": (Hq, 1), "kv_head": (Hkv, group), "all": (1, Hq)}[share]
    if semantics == "member":
        width, full_width = capacity, 1
    elif causal:
        width, full_width = min(nk, (block_q - 1) // block_k + 2), capacity
    else:
        width, full_width = 1, capacity
    return RouteSpec(B=B, Hq=Hq, Hkv=Hkv, Lq=Lq, Lk=Lk, D=D, block_q=block_q, block_k=block_k, nq=nq, nk=nk,
                     q_offset=q_offset, topk=nk if topk is None else topk, threshold=threshold,
                     causal=causal, local=local, sinks=sinks, share=share, pool=pool, semantics=semantics,
                     member_topk=member_topk, scale=scale, capacity=capacity, LH=LH, n_shared=n_shared,
                     group=group, width=width, full_width=full_width)
