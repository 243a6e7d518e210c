"""``sparse_attention``: argument checks, dispatch to the forward kernel, and autograd."""
from __future__ import annotations

from typing import Optional

import torch

from .._checks import check_device, check_head_dim, check_kernel_dtype, check_qkv, check_scale
from ..layout import BlockLayout
from . import _launch as L
from .backward import backward
from .config import BwdConfig, FwdConfig
from .prefill import forward
from .split import check_split


def _check_inputs(q, k, v, layout, scale, out, config, bwd_config):
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v)
    check_kernel_dtype("q", q.dtype)
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    check_head_dim(D)
    if v.shape[-1] != D:
        raise ValueError(f"v's head dim ({v.shape[-1]}) must equal q's ({D})")
    L.check_layout_for(layout, B, Hq, Hkv, Lq, Lk, q.device)
    scale = check_scale(scale, D)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (B, Hq, Lq, D) or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be a {q.dtype} tensor of shape {(B, Hq, Lq, D)} on {q.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        if out.stride(-1) != 1:
            raise ValueError("out must have a contiguous last dimension")
    if config is not None:
        if not isinstance(config, FwdConfig):
            raise TypeError(f"config must be a FwdConfig or None, got {type(config).__name__}")
        L.check_kernel_tiles("config", layout, block_m=config.block_m, block_n=config.block_n)
        check_split("config", config.split, config.persistent)
        L.check_launch_options("config", config)
    if bwd_config is not None:
        if not isinstance(bwd_config, BwdConfig):
            raise TypeError(f"bwd_config must be a BwdConfig or None, got {type(bwd_config).__name__}")
        L.check_kernel_tiles("bwd_config", layout, block_m=bwd_config.block_m, block_n=bwd_config.block_n,
                             dq_block_m=bwd_config.dq_block_m, dq_block_n=bwd_config.dq_block_n)
        if bwd_config.chunk is not None and (isinstance(bwd_config.chunk, bool) or
                                             not isinstance(bwd_config.chunk, int) or bwd_config.chunk < 1):
            raise ValueError(f"bwd_config: chunk must be None or an int >= 1, got {bwd_config.chunk!r}")
        dq_split = bwd_config.dq_split
        if dq_split is not None and not (isinstance(dq_split, str) and dq_split == "auto") and (
                isinstance(dq_split, bool) or not isinstance(dq_split, int) or dq_split < 1):
            raise ValueError(f"bwd_config: dq_split must be None (one program per dQ row), 'auto' or an int >= 1 "
                             f"(listed tiles per task), got {dq_split!r}")
        if not isinstance(bwd_config.overlap, bool):
            raise ValueError(f"bwd_config: overlap must be True or False, got {bwd_config.overlap!r}")
        L.check_launch_options("bwd_config", bwd_config, dq_num_warps=bwd_config.dq_num_warps,
                               dq_num_stages=bwd_config.dq_num_stages)
    check_device(q)
    return scale


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale, out, config, deterministic, bwd_config):
        o, lse = forward(q, k, v, layout, scale, out, config)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.layout, ctx.scale, ctx.deterministic, ctx.bwd_config = layout, scale, deterministic, bwd_config
        ctx.mark_non_differentiable(lse)
        # the LSE has no gradient: without this, autograd fills a zero dLSE at every backward (one more kernel
        # launch and its host time in each call; on the H200 box a backward call was host-bound up to N = 4k)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):  # dlse is None (not materialised); do never is: o is the only differentiable output
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = backward(do, q, k, v, o, lse, ctx.layout, ctx.scale, ctx.deterministic, ctx.bwd_config)
        return dq, dk, dv, None, None, None, None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                     scale: Optional[float] = None, return_lse: bool = False, deterministic: bool = True,
                     out: Optional[torch.Tensor] = None, *, config: Optional[FwdConfig] = None,
                     bwd_config: Optional[BwdConfig] = None):
    """Block-sparse attention over the tiles ``layout`` lists.

    q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (``Hq % Hkv == 0``), fp16/bf16/fp32, D in
    ``SUPPORTED_HEAD_DIMS``. Returns ``o`` (q's dtype) and, with ``return_lse``, the natural-log LSE
    ``[B, Hq, Lq]`` float32. Rows with no allowed key give 0 and ``-inf``. ``out`` receives ``o`` when given.

    Differentiable in q, k, v. ``deterministic=True`` (default) computes dK/dV by walking the transposed
    table and dQ in a separate pass (7 tile matmuls, bitwise-reproducible); ``False`` adds dQ with atomics
    inside the dK/dV pass (5 tile matmuls, run-to-run rounding differences). ``config``/``bwd_config`` override
    the tuned tile configs (:class:`FwdConfig`, :class:`BwdConfig`).

    Input range: scores are computed in float32, so every raw dot product ``q . k`` and every scaled score
    must stay below ``2**127`` (about 1.7e38) in magnitude; within that range large scores are exact (the
    online softmax subtracts the running maximum), beyond it float32 overflows and the row becomes NaN where
    the fp64 reference would stay finite. NaN and inf inputs are the caller's: a NaN in K or V reaches the
    rows whose visited tiles hold it (a tile is multiplied whole, so it may reach every row of a query tile
    that visits that key tile) and never a row whose layout row does not list that tile; a NaN in q stays in
    its row.
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    scale = _check_inputs(q, k, v, layout, scale, out, config, bwd_config)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        o, lse = _SparseAttention.apply(q, k, v, layout, scale, out, config, deterministic, bwd_config)
    else:
        o, lse = forward(q, k, v, layout, scale, out, config)
    return (o, lse) if return_lse else o
