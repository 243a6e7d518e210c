"""Forward pass of block-sparse prefill attention: config, allocation and the keyword launch (plain grid, or
split tasks and their merge when the config asks, on the split or the persistent grid: :mod:`.split`)."""
from __future__ import annotations

from typing import Optional

import torch

from .. import _runtime
from .._checks import LOG2E
from ..layout import BlockLayout
from . import _launch as L
from . import split as S
from .config import FwdConfig, layout_default, smaller_tiles


def fwd_config(q: torch.Tensor, layout: BlockLayout) -> FwdConfig:
    """The tuned default for this GPU family, dtype and head dim, clipped to the layout's tiles."""
    return layout_default("fwd", q.device, _runtime.is_interpreter(), q.dtype, q.shape[-1], layout.block_q,
                          layout.block_k)


def forward(q, k, v, layout: BlockLayout, scale: float, out: Optional[torch.Tensor], config: Optional[FwdConfig]):
    """``(o, lse)`` on checked arguments. Without ``config``, a GPU short of shared memory for the default
    tiles falls back to smaller ones."""
    cfg = config or fwd_config(q, layout)
    fallbacks = () if config is not None else smaller_tiles("fwd", layout.block_q, layout.block_k)
    return L.with_smaller_tiles(lambda c: _forward_with(q, k, v, layout, scale, out, c), cfg, fallbacks)


def _forward_with(q, k, v, layout: BlockLayout, scale: float, out: Optional[torch.Tensor], cfg: FwdConfig):
    from ..kernels import prefill_fwd
    q, k, v = (L.last_dim_contiguous(t) for t in (q, k, v))
    if layout.block_q % cfg.block_m or layout.block_k % cfg.block_n:
        raise ValueError(f"config: kernel tiles {cfg.block_m}x{cfg.block_n} must divide the layout's "
                         f"{layout.block_q}x{layout.block_k}")
    B, Hq, Lq, D = q.shape
    o = out if out is not None else torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, device=q.device, dtype=torch.float32)
    # everything but the per-call tensors, built once per (layout, shapes, strides, config, scale): at
    # N <= 4k an eager call's time is mostly this host path (python -m sparseattn.bench host)
    key = ("fwd_args", cfg, L.forced_kind(), q.dtype, q.shape, k.shape, q.stride(), k.stride(), v.stride(),
           o.stride(), scale)
    build = lambda: _static_kwargs(q, k, v, o, layout, scale, cfg)  # noqa: E731
    static, per_call = L.dynamic_plan(layout, key, build, L.layout_tables(layout)) if layout.dynamic else \
        (layout.plan(key, build), {})
    split = S.prepare(layout, cfg.block_m, cfg.split, B, Hq, D, q.device) if cfg.split is not None else None
    tma = L.call_tma(static, q, k, v)
    descs = L.tensor_descriptors(D, q=(q, cfg.block_m), k=(k, cfg.block_n), v=(v, cfg.block_n)) if tma else \
        dict(desc_q=None, desc_k=None, desc_v=None)
    persistent = split is not None and cfg.persistent
    L.launch(
        prefill_fwd.sparse_fwd_kernel,
        S.grid(split, persistent, L.num_sms(q.device)) if split is not None else static["grid"],
        static=static["kwargs"], **per_call.get("kwargs", {}),
        Q=q, K=k, V=v, O=o, LSE=lse, **descs,
        **(S.kernel_kwargs(split, persistent) if split is not None else {}), num_stages=cfg.num_stages,
    )
    if split is not None:
        S.merge(split, o, lse, cfg.block_m)
    return o, lse


def _static_kwargs(q, k, v, o, layout: BlockLayout, scale: float, cfg: FwdConfig) -> dict:
    """The forward kernel's arguments that do not change between calls on the same layout, shapes, strides,
    config and scale (strides, tables, mask and head arguments, sizes, flags, ``num_warps``; the plain grid's
    split arguments), the plain grid, and whether this GPU can take tensor descriptors (each call still
    checks its tensors' alignment)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    order = L.row_order(layout, cfg.block_m)
    persistent = cfg.split is not None and cfg.persistent
    kwargs = L.Static(
        **L.strides("q", q, "m"), **L.strides("k", k, "n"), **L.strides("v", v, "n"), **L.strides("o", o, "m"),
        KV_COUNT=layout.kv_count, KV_INDEX=layout.kv_index, FULL_COUNT=layout.full_count,
        FULL_INDEX=layout.full_index, ROW_ORDER=order, **L.mask_kwargs(layout, B),
        Hq=Hq, **L.head_kwargs(layout, Hq, Hkv), n_qtiles=layout.nq, W=layout.width, FW=layout.full_width,
        Lq=Lq, Lk=Lk, q_offset=layout.q_offset, scale_log2=scale * LOG2E,
        HEAD_DIM=D, BLOCK_Q=layout.block_q, BLOCK_K=layout.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **(S.PLAIN if cfg.split is None else {}),
        WARP_SPEC=cfg.warp_specialize and not persistent and not _runtime.is_interpreter(),
        num_warps=cfg.num_warps)
    return dict(kwargs=kwargs, grid=(order.numel(), B * Hq),
                tma=L.plan_tma(cfg.tma, q.device, True, q, k, v),
                small=L.too_small_for_tma("fwd", cfg.tma, layout, q))
