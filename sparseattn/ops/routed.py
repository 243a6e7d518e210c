"""``routed_attention``: content routing and block-sparse attention as one differentiable op.

The selection is a hard top-k: it gets no gradient. The layout the forward routed is the one the backward
walks (``sparse_attention``'s autograd keeps it), so the router runs once per forward + backward; a backward
that routed again, on inputs that changed in between (dropout, a perturbed recomputation, lower precision),
would differentiate a function the forward never computed.
"""
from __future__ import annotations

from typing import Optional

import torch

from .. import routing
from ..layout import BlockLayout
from .attention import sparse_attention
from .config import BwdConfig, FwdConfig


def routed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int = 128, block_k: int = 128,
                     topk: Optional[int] = None, threshold: Optional[float] = None, causal: bool = True,
                     local: int = 1, sinks: int = 1, share: str = "kv_head", pool: str = "mean",
                     semantics: str = "block", capacity: Optional[int] = None, member_topk: Optional[int] = None,
                     scale: Optional[float] = None, *, layout: Optional[BlockLayout] = None,
                     return_layout: bool = False, return_lse: bool = False, deterministic: bool = True,
                     config: Optional[FwdConfig] = None, bwd_config: Optional[BwdConfig] = None):
    """Route (:func:`sparseattn.route`, on detached q and k) and attend (:func:`sparseattn.sparse_attention`)
    in one step; differentiable in q, k, v through the attention only.

    ``layout``: a selection routed earlier (another layer's, or a previous step's) to reuse instead of
    routing: the routing arguments are then ignored. Returns ``o``, then the LSE with ``return_lse``, then
    the layout used with ``return_layout`` (pass it to the next layer to share one selection across layers).
    Everything stays on the device with fixed shapes, so the whole step can be captured in one CUDA graph."""
    if layout is None:
        with torch.no_grad():
            layout = routing.route(q.detach(), k.detach(), block_q, block_k, topk=topk, threshold=threshold,
                                   causal=causal, local=local, sinks=sinks, share=share, pool=pool,
                                   semantics=semantics, capacity=capacity, member_topk=member_topk, scale=scale)
    elif not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout or None, got {type(layout).__name__}")
    out = sparse_attention(q, k, v, layout, scale=scale, return_lse=return_lse, deterministic=deterministic,
                           config=config, bwd_config=bwd_config)
    out = out if isinstance(out, tuple) else (out,)
    if return_layout:
        out = out + (layout,)
    return out if len(out) > 1 else out[0]
