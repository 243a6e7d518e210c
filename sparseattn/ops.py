"""Public ops: argument checks, allocation, kernel launch and autograd. No ``@triton.jit`` code here."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from . import _runtime
from .layout import BlockLayout
from .predicates import Predicate, kernel_predicate
from .reference import check_qkv

__all__ = ["sparse_attention", "sparse_decode", "DecodeConfig", "SUPPORTED_HEAD_DIMS", "SUPPORTED_DTYPES"]

SUPPORTED_HEAD_DIMS = (16, 32, 64, 128)
SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class FwdConfig:
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: Optional[bool] = None  # None: use tensor descriptors (TMA) where the GPU and the strides allow
    warp_specialize: bool = False  # Triton's automatic producer/consumer warp specialisation of the tile loops


def _tma_ok(*tensors) -> bool:
    """Tensor descriptors need 16-byte aligned bases and strides (and a unit last stride)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def _use_tma(cfg: FwdConfig, q, k, v, interpreter: bool) -> bool:
    if cfg.tma is False:
        return False
    capable = interpreter or torch.cuda.get_device_capability(q.device)[0] >= 9
    return capable and _tma_ok(q, k, v)


def _fwd_config(D: int, dtype: torch.dtype, layout: BlockLayout, interpreter: bool) -> FwdConfig:
    """Kernel tiles: they must divide the layout's tiles. Chosen by head dim and dtype (tuned on the H200:
    see the ``prefill`` benchmark suite's config sweep)."""
    if interpreter:  # the interpreter's cost is per tile iteration, not per cell: use the largest tiles
        return FwdConfig(min(layout.block_q, 128), min(layout.block_k, 128), 4, 1)
    if dtype == torch.float32:
        bm, bn, warps, stages = 64, 32, 4, 2
    elif D <= 64:
        bm, bn, warps, stages = 128, 64, 4, 3
    else:
        bm, bn, warps, stages = 128, 128, 8, 3
    return FwdConfig(min(bm, layout.block_q), min(bn, layout.block_k), warps, stages)


def _cache(layout: BlockLayout) -> dict:
    return layout.__dict__.setdefault("_kernel_cache", {})


def _row_order(layout: BlockLayout, block_m: int) -> torch.Tensor:
    """Kernel query sub-tiles sorted by their row's tile count, longest first (computed once per layout)."""
    key = ("row_order", block_m)
    cache = _cache(layout)
    if key not in cache:
        work = (layout.kv_count + layout.full_count).sum(dim=(0, 1))  # [nq]
        sub = layout.block_q // block_m
        n_m = math.ceil(layout.q_len / block_m)
        per_m = work.repeat_interleave(sub)[:n_m]
        cache[key] = torch.argsort(per_m, descending=True, stable=True).to(torch.int32)
    return cache[key]


def _mask_path(layout: BlockLayout):
    """``(predicate, bits)``: exactly one is used by the kernel for partial tiles."""
    cache = _cache(layout)
    if "mask_path" not in cache:
        pred = None if layout.tile_bits is not None and layout.mask_mod is None else kernel_predicate(layout.mask_mod)
        bits = None
        if pred is None and bool((layout.kv_count > 0).any()):
            bits = layout.partial_tile_bits()
        cache["mask_path"] = (pred, bits)
    return cache["mask_path"]


def mask_path_name(layout: BlockLayout) -> str:
    """``"predicate: ..."`` or ``"bits"``: how the kernels mask this layout's partial tiles."""
    pred, bits = _mask_path(layout)
    if pred is not None:
        return "predicate: " + pred.describe()
    return "bits" if bits is not None else "none (no partial tiles)"


def _doc_table(pred: Predicate, layout: BlockLayout, B: int) -> Optional[torch.Tensor]:
    if pred is None or pred.doc_ids is None:
        return None
    cache = _cache(layout)
    if "doc" not in cache:
        ids = pred.doc_ids.to(device=layout.device, dtype=torch.int32)
        need = max(layout.q_offset + layout.q_len, layout.kv_len)
        if ids.shape[-1] < need:
            raise ValueError(f"doc_ids covers {ids.shape[-1]} positions but attention needs {need}")
        cache["doc"] = ids.contiguous()
    ids = cache["doc"]
    if ids.dim() == 2 and ids.shape[0] != B:
        raise ValueError(f"doc_ids has batch {ids.shape[0]} but q has batch {B}")
    return ids


@dataclass
class _MaskArgs:
    """What every prefill kernel needs to mask partial tiles and map heads to the layout (see predicates)."""
    bits: Optional[torch.Tensor]
    doc: Optional[torch.Tensor]
    scalars: tuple  # band_lo, band_hi, sink_n, sink_lo, sink_hi
    group: int  # query heads per KV head
    lh_div: int  # query head -> layout head divisor
    flags: dict  # USE_BITS, HAS_SINKS, HAS_DOC, DOC_BATCHED

    def pointers(self, dummy: torch.Tensor):
        doc_stride = self.doc.stride(0) if self.doc is not None and self.doc.dim() == 2 else 0
        return (self.bits if self.bits is not None else dummy, self.doc if self.doc is not None else dummy,
                doc_stride)


def _mask_args(layout: BlockLayout, B: int, Hq: int, Hkv: int) -> _MaskArgs:
    pred, bits = _mask_path(layout)
    doc = _doc_table(pred, layout, B)
    band = pred.band if pred is not None else (0, -1)
    sink_n = pred.sink_n if pred is not None and pred.has_sinks else 0
    sink_band = pred.sink_band if sink_n else (0, -1)
    group = Hq // Hkv
    flags = dict(USE_BITS=bits is not None, HAS_SINKS=sink_n > 0, HAS_DOC=doc is not None,
                 DOC_BATCHED=doc is not None and doc.dim() == 2)
    return _MaskArgs(bits, doc, (band[0], band[1], sink_n, sink_band[0], sink_band[1]), group,
                     1 if layout.H == Hq else group, flags)


def check_layout_for(layout: BlockLayout, B: int, Hq: int, Hkv: int, Lq: int, Lk: int, device) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if (layout.q_len, layout.kv_len) != (Lq, Lk):
        raise ValueError(f"layout is for q_len={layout.q_len}, kv_len={layout.kv_len} but q/k have Lq={Lq}, Lk={Lk}")
    if layout.B not in (1, B):
        raise ValueError(f"layout has B={layout.B}; it must be 1 or the batch size {B}")
    if layout.H not in (1, Hkv, Hq):
        raise ValueError(f"layout has H={layout.H}; it must be 1, the KV heads ({Hkv}) or the query heads ({Hq})")
    if layout.device != device:
        raise ValueError(f"layout is on {layout.device} but q is on {device}; use layout.to(q.device)")


def _check_inputs(q, k, v, layout, scale, out):
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, v)
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k.dtype != q.dtype or v.dtype != q.dtype:
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if D not in SUPPORTED_HEAD_DIMS or v.shape[-1] != D:
        raise ValueError(f"head dim must be one of {SUPPORTED_HEAD_DIMS} (and equal for q, k, v), got q {D}, "
                         f"v {v.shape[-1]}")
    check_layout_for(layout, B, Hq, Hkv, Lq, Lk, q.device)
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    elif isinstance(scale, bool) or not isinstance(scale, (int, float)) or not math.isfinite(scale) or scale <= 0:
        raise ValueError(f"scale must be a positive finite float, got {scale!r}")
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be a torch.Tensor, got {type(out).__name__}")
        if tuple(out.shape) != (B, Hq, Lq, D) or out.dtype != q.dtype or out.device != q.device:
            raise ValueError(f"out must be a {q.dtype} tensor of shape {(B, Hq, Lq, D)} on {q.device}, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        if out.stride(-1) != 1:
            raise ValueError("out must have a contiguous last dimension")
    if q.device.type == "cpu" and _runtime.select_backend() == "cuda":
        raise ValueError("q is on the CPU but a GPU is present: move q, k, v and the layout to CUDA, or set "
                         "TRITON_INTERPRET=1 before importing sparseattn to run the kernels on the CPU")
    return B, Hq, Hkv, Lq, Lk, D, float(scale)


def _last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _with_smaller_tiles(run, cfg, fallbacks):
    """Run ``run(cfg)``; if the GPU lacks the shared memory for its tiles even at one pipeline stage (a T4 on
    Colab has 64 KiB), retry with the smaller tile configs of ``fallbacks``."""
    import triton
    attempts = [cfg, *fallbacks]
    for i, attempt in enumerate(attempts):
        try:
            return run(attempt)
        except triton.runtime.errors.OutOfResources:
            if i == len(attempts) - 1:
                raise


def _forward(q, k, v, layout: BlockLayout, scale: float, out: Optional[torch.Tensor], config: Optional[FwdConfig]):
    interpreter = _runtime.select_backend() == "interpreter"
    D = q.shape[-1]
    cfg = config or _fwd_config(D, q.dtype, layout, interpreter)
    fallbacks = [] if config is not None else [
        FwdConfig(min(bm, layout.block_q), min(bn, layout.block_k), 4, 2) for bm, bn in ((64, 64), (32, 32))]
    return _with_smaller_tiles(lambda c: _forward_with(q, k, v, layout, scale, out, c, interpreter), cfg, fallbacks)


def _forward_with(q, k, v, layout: BlockLayout, scale: float, out: Optional[torch.Tensor], cfg: FwdConfig,
                  interpreter: bool):
    kernels = _runtime.load_kernels("prefill_fwd")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
    if layout.block_q % cfg.block_m or layout.block_k % cfg.block_n:
        raise ValueError(f"kernel tiles {cfg.block_m}x{cfg.block_n} must divide the layout's "
                         f"{layout.block_q}x{layout.block_k}")
    o = out if out is not None else torch.empty_like(q)
    lse = torch.empty(B, Hq, Lq, device=q.device, dtype=torch.float32)
    ma = _mask_args(layout, B, Hq, Hkv)
    order = _row_order(layout, cfg.block_m)
    grid = (order.numel(), B * Hq)
    use_tma = _use_tma(cfg, q, k, v, interpreter)
    if use_tma:
        from triton.tools.tensor_descriptor import TensorDescriptor
        desc_q = TensorDescriptor(q, list(q.shape), list(q.stride()), [1, 1, cfg.block_m, D])
        desc_k = TensorDescriptor(k, list(k.shape), list(k.stride()), [1, 1, cfg.block_n, D])
        desc_v = TensorDescriptor(v, list(v.shape), list(v.stride()), [1, 1, cfg.block_n, D])
    else:
        desc_q = desc_k = desc_v = q
    _launch(kernels.sparse_fwd_kernel, grid,
        q, k, v, o, lse, desc_q, desc_k, desc_v,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        layout.kv_count, layout.kv_index, layout.full_count, layout.full_index, order,
        *ma.pointers(layout.kv_count),
        Hq, ma.group, layout.B, layout.H, ma.lh_div, layout.nq, layout.width, layout.full_width,
        Lq, Lk, layout.q_offset, scale * LOG2E, *ma.scalars,
        HEAD_DIM=D, BLOCK_Q=layout.block_q, BLOCK_K=layout.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        **ma.flags, EVEN_K=Lk % layout.block_k == 0, USE_TMA=use_tma,
        WARP_SPEC=cfg.warp_specialize and not interpreter,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages,
    )
    return o, lse


@dataclass(frozen=True)
class BwdConfig:
    block_m: int  # dK/dV pass: queries per step
    block_n: int  # dK/dV pass: keys per program
    dq_block_m: int  # dQ pass: queries per program
    dq_block_n: int  # dQ pass: keys per step
    num_warps: int
    num_stages: int
    chunk: Optional[int] = None  # max listed query tiles per dK/dV program; None: from the layout


def _bwd_config(D: int, dtype: torch.dtype, layout: BlockLayout, interpreter: bool) -> BwdConfig:
    """Like Triton's fused-attention tutorial: the dK/dV pass keeps a tall key tile resident and streams
    thin query tiles past it; the dQ pass does the opposite."""
    bq, bk = layout.block_q, layout.block_k
    if interpreter:
        return BwdConfig(min(bq, 64), min(bk, 64), min(bq, 64), min(bk, 64), 4, 1)
    if dtype == torch.float32:
        return BwdConfig(min(32, bq), min(32, bk), min(32, bq), min(32, bk), 4, 2)
    return BwdConfig(min(64, bq), min(128, bk), min(128, bq), min(64, bk), 8, 2)  # best of the H200 sweep


def _launch(kernel, grid, *args, num_stages: int, **kwargs):
    """Launch; if the tile config needs more shared memory than the GPU has (the bit-mask path adds a
    buffer), retry with fewer pipeline stages."""
    import triton
    while True:
        try:
            return kernel[grid](*args, num_stages=num_stages, **kwargs)
        except triton.runtime.errors.OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1


def _bwd_work(layout: BlockLayout, block_n: int, chunk: Optional[int]):
    """The dK/dV launch plan, cached per layout: one work item per (key sub-tile, chunk of its column).

    A column is cut into chunks of at most ``chunk`` listed query tiles so that a column every row visits
    (a sink) does not become the tail of the launch. Items are ordered longest first. Items of split columns
    get a workspace slot; their partial dK/dV are summed in a fixed order afterwards (deterministic)."""
    t = layout._t()
    totals = (t.q_count + t.full_q_count).amax(dim=(0, 1)).long()  # [nk]: the longest over the layout's B, H
    if chunk is None:
        nonempty = totals[totals > 0]
        mean = float(nonempty.float().mean()) if nonempty.numel() else 1.0
        chunk = max(8, int(2 * mean + 0.999))
    key = ("bwd_work", block_n, chunk)
    cache = _cache(layout)
    if key in cache:
        return cache[key]
    sub = layout.block_k // block_n
    n_sub = math.ceil(layout.kv_len / block_n)
    per_col = torch.clamp((totals + chunk - 1) // chunk, min=1)  # chunks per layout column
    per_sub = per_col.repeat_interleave(sub)[:n_sub]  # [n_sub]
    item_sub = torch.repeat_interleave(torch.arange(n_sub, device=layout.device), per_sub)
    starts = torch.cumsum(per_sub, 0) - per_sub
    item_c = torch.arange(item_sub.numel(), device=layout.device) - starts[item_sub]
    split = per_sub[item_sub] > 1
    ws_slot = torch.where(split, torch.cumsum(split.long(), 0) - 1, torch.full_like(item_sub, -1))
    work_len = torch.clamp(totals.repeat_interleave(sub)[:n_sub][item_sub] - item_c * chunk, min=0, max=chunk)
    order = torch.argsort(work_len, descending=True, stable=True)
    work = torch.stack([item_sub, item_c, ws_slot], 1)[order].to(torch.int32).contiguous()
    n_ws = int(split.sum())
    # reduction plan: for each split sub-tile, its workspace slots (padded with the zero slot n_ws)
    split_subs = torch.nonzero(per_sub > 1).flatten()
    cmax = int(per_sub.max()) if n_sub else 1
    slots = torch.full((split_subs.numel(), cmax), n_ws, dtype=torch.long, device=layout.device)
    if split_subs.numel():
        first = ws_slot[starts[split_subs]]  # slots of one sub-tile are consecutive
        ar = torch.arange(cmax, device=layout.device)
        valid = ar[None, :] < per_sub[split_subs][:, None]
        slots = torch.where(valid, first[:, None] + ar[None, :], slots)
    cache[key] = (work, n_ws, split_subs, slots, chunk)
    return cache[key]


def _backward(do, q, k, v, o, lse, layout: BlockLayout, scale: float, deterministic: bool,
              config: Optional[BwdConfig] = None):
    interpreter = _runtime.select_backend() == "interpreter"
    cfg = config or _bwd_config(q.shape[-1], q.dtype, layout, interpreter)
    bq, bk = layout.block_q, layout.block_k
    fallbacks = [] if config is not None else [
        BwdConfig(min(m, bq), min(n, bk), min(dm, bq), min(dn, bk), 4, 2)
        for m, n, dm, dn in ((32, 64, 64, 32), (16, 32, 32, 16))]
    return _with_smaller_tiles(
        lambda c: _backward_with(do, q, k, v, o, lse, layout, scale, deterministic, c, interpreter), cfg, fallbacks)


def _backward_with(do, q, k, v, o, lse, layout: BlockLayout, scale: float, deterministic: bool, cfg: BwdConfig,
                   interpreter: bool):
    kernels = _runtime.load_kernels("prefill_bwd")
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    q, k, v, do = (_last_dim_contiguous(t) for t in (q, k, v, do))
    delta = (do.float() * o.float()).sum(-1).contiguous()  # [B, Hq, Lq]: rowsum(dO * O)
    ma = _mask_args(layout, B, Hq, Hkv)
    group, lh_div, mask_args = ma.group, ma.lh_div, ma.scalars
    flags = dict(ma.flags, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32")
    bits_t, doc_t, doc_stride = ma.pointers(layout.kv_count)
    t = layout._t()
    work, n_ws, split_subs, slots, chunk = _bwd_work(layout, cfg.block_n, cfg.chunk)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ws_k = torch.empty(B * Hkv, max(n_ws, 1), cfg.block_n, D, device=q.device, dtype=torch.float32)
    ws_v = torch.empty_like(ws_k)
    dq_acc = torch.zeros(B, Hq, Lq, D, device=q.device, dtype=torch.float32) if not deterministic else q
    scale_log2 = scale * LOG2E
    _launch(kernels.dkdv_kernel, (work.shape[0], B * Hkv),
        q, k, v, do, lse, delta, dk, dv, dq_acc, ws_k, ws_v,
        q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
        dk.stride(0), dk.stride(1), dk.stride(2), dv.stride(0), dv.stride(1), dv.stride(2),
        dq_acc.stride(0), dq_acc.stride(1), dq_acc.stride(2),
        t.q_count, t.q_index, t.q_slot, t.full_q_count, t.full_q_index, work, bits_t, doc_t, doc_stride,
        Hq, Hkv, group, layout.B, layout.H, lh_div, layout.nk, t.q_index.shape[-1], t.full_q_index.shape[-1],
        layout.nq, layout.width, Lq, Lk, layout.q_offset, scale, scale_log2, chunk, max(n_ws, 1), *mask_args,
        HEAD_DIM=D, BLOCK_Q=layout.block_q, BLOCK_K=layout.block_k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n,
        ATOMIC_DQ=not deterministic, **flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if split_subs.numel():  # fixed-order sum of the chunks of split columns
        rows = (split_subs[:, None] * cfg.block_n + torch.arange(cfg.block_n, device=q.device)[None, :]).flatten()
        keep = rows < Lk
        for ws, out in ((ws_k, dk), (ws_v, dv)):
            padded = torch.cat([ws, ws.new_zeros(B * Hkv, 1, cfg.block_n, D)], 1)  # slot n_ws reads zeros
            summed = padded[:, slots].sum(dim=2)  # [B*Hkv, n_split, BN, D], fixed order
            summed = summed.view(B, Hkv, -1, D)[:, :, keep]
            out[:, :, rows[keep]] = summed.to(out.dtype)
    if deterministic:
        dq = torch.empty_like(q)
        _launch(kernels.dq_kernel, (math.ceil(Lq / cfg.dq_block_m), B * Hq),
            q, k, v, do, lse, delta, dq,
            q.stride(0), q.stride(1), q.stride(2), k.stride(0), k.stride(1), k.stride(2),
            v.stride(0), v.stride(1), v.stride(2), do.stride(0), do.stride(1), do.stride(2),
            dq.stride(0), dq.stride(1), dq.stride(2),
            layout.kv_count, layout.kv_index, layout.full_count, layout.full_index, bits_t, doc_t, doc_stride,
            Hq, group, layout.B, layout.H, lh_div, layout.nq, layout.width, layout.full_width,
            Lq, Lk, layout.q_offset, scale, scale_log2, *mask_args,
            HEAD_DIM=D, BLOCK_Q=layout.block_q, BLOCK_K=layout.block_k, BLOCK_M=cfg.dq_block_m,
            BLOCK_N=cfg.dq_block_n, **flags, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    else:
        dq = (dq_acc * scale).to(q.dtype)
    return dq, dk, dv


class _SparseAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, layout, scale, out, config, deterministic, bwd_config):
        o, lse = _forward(q, k, v, layout, scale, out, config)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.layout, ctx.scale, ctx.deterministic, ctx.bwd_config = layout, scale, deterministic, bwd_config
        ctx.mark_non_differentiable(lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        dq, dk, dv = _backward(do, q, k, v, o, lse, ctx.layout, ctx.scale, ctx.deterministic, ctx.bwd_config)
        return dq, dk, dv, None, None, None, None, None, None


def sparse_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: BlockLayout,
                     scale: Optional[float] = None, return_lse: bool = False, deterministic: bool = True,
                     out: Optional[torch.Tensor] = None, *, _config: Optional[FwdConfig] = None,
                     _bwd_config: Optional[BwdConfig] = None):
    """Block-sparse attention over the tiles ``layout`` lists.

    q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (``Hq % Hkv == 0``), fp16/bf16/fp32, D in
    ``SUPPORTED_HEAD_DIMS``. Returns ``o`` (q's dtype) and, with ``return_lse``, the natural-log LSE
    ``[B, Hq, Lq]`` float32. Rows with no allowed key give 0 and ``-inf``. ``out`` receives ``o`` when given.

    Differentiable in q, k, v. ``deterministic=True`` (default) computes dK/dV by walking the transposed
    table and dQ in a separate pass (7 tile matmuls, bitwise-reproducible); ``False`` adds dQ with atomics
    inside the dK/dV pass (5 tile matmuls, run-to-run rounding differences).
    """
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    *_, scale = _check_inputs(q, k, v, layout, scale, out)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        o, lse = _SparseAttention.apply(q, k, v, layout, scale, out, _config, deterministic, _bwd_config)
    else:
        o, lse = _forward(q, k, v, layout, scale, out, _config)
    return (o, lse) if return_lse else o


# ---------------------------------------------------------------------------------------------------------
# decode over a paged KV cache
# ---------------------------------------------------------------------------------------------------------
def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 4


@dataclass(frozen=True)
class DecodeConfig:
    # defaults: best over four target cases of the H200 sweep (``python -m sparseattn.bench decode --sweep``)
    block_n: int = 64  # tokens per step (a step may span several pages or part of one)
    num_warps: int = 4
    num_stages: int = 2
    # split-KV target, programs per SM over the whole launch. None: 16, or 8 when the (sequence, KV head) rows
    # alone cover every SM (then splits only trim the tail; fewer, longer programs spend less on prologues
    # and on the merge). H200 sweep: B=8 dense 0.98 ms at 16 vs 1.15 at 8; B=32 keep 16% 0.19 at 8 vs 0.20.
    programs_per_sm: Optional[int] = None
    head_fastest: bool = True  # launch order: the KV heads of one split next to each other (they share rows)


def _decode_config(interpreter: bool) -> DecodeConfig:
    if interpreter:
        return DecodeConfig(num_stages=1)
    return DecodeConfig()


def decode_programs_per_sm(cfg: DecodeConfig, B: int, Hkv: int, num_sms: int) -> int:
    """The config's split target, or the default rule (see :class:`DecodeConfig`)."""
    return cfg.programs_per_sm or (8 if B * Hkv >= num_sms else 16)


DECODE_MAX_SPLITS = 64  # per row, unless fewer would leave SMs idle: the merge then reads one chunk per row


def decode_splits(B: int, Hkv: int, capacity_tokens: int, block_n: int, num_sms: int, programs_per_sm: int):
    """``(n_splits, blocks_per_split)`` from shapes and capacity only (never from data), so one CUDA graph
    serves every step: about ``programs_per_sm`` programs per SM (many short programs also shrink the last,
    partly filled wave), at most ``DECODE_MAX_SPLITS`` per row while that still gives two programs per SM
    (at batch 1 the merge of hundreds of splits per row costs more than the tail it trims: see the decode
    entries of book/perf-notes.md), never more splits than key blocks."""
    rows = B * Hkv
    max_blocks = max(1, math.ceil(capacity_tokens / block_n))
    want = math.ceil(programs_per_sm * num_sms / rows)
    n_splits = min(max_blocks, max(1, min(want, DECODE_MAX_SPLITS), math.ceil(2 * num_sms / rows)))
    per_split = math.ceil(max_blocks / n_splits)
    return math.ceil(max_blocks / per_split), per_split


def sparse_decode(q: torch.Tensor, cache, pages=None, seqs=None, scale: Optional[float] = None,
                  return_lse: bool = False, *, _config: Optional[DecodeConfig] = None):
    """One new query per sequence against its paged KV cache.

    q ``[B, Hq, D]``; row b is sequence ``seqs[b]`` (default b). ``pages=None`` attends to every page;
    a :class:`PageSelection` restricts each (row, KV head) to its listed logical pages. Returns ``o [B, Hq, D]``
    (q's dtype) and, with ``return_lse``, the natural-log LSE ``[B, Hq]`` float32. Checks shapes and dtypes
    only: no host synchronisation, so it can run inside a CUDA graph."""
    from .paged import PagedKVCache, PageSelection
    from .routing import _seqs_tensor
    if not isinstance(cache, PagedKVCache):
        raise TypeError(f"cache must be a PagedKVCache, got {type(cache).__name__}")
    if not isinstance(q, torch.Tensor) or q.dim() != 3:
        raise ValueError(f"q must be a [B, Hq, D] tensor, got {getattr(q, 'shape', type(q).__name__)}")
    B, Hq, D = q.shape
    Hkv = cache.num_kv_heads
    if q.dtype not in SUPPORTED_DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if q.dtype != cache.dtype:
        raise TypeError(f"q is {q.dtype} but the cache holds {cache.dtype}")
    if D != cache.head_dim or D not in SUPPORTED_HEAD_DIMS:
        raise ValueError(f"head dim {D} must equal the cache's ({cache.head_dim}) and be one of {SUPPORTED_HEAD_DIMS}")
    if Hq % Hkv:
        raise ValueError(f"query heads ({Hq}) must be a multiple of the cache's KV heads ({Hkv})")
    if q.device != cache.device:
        raise ValueError(f"q is on {q.device} but the cache is on {cache.device}")
    if pages is not None:
        if not isinstance(pages, PageSelection):
            raise TypeError(f"pages must be a PageSelection or None, got {type(pages).__name__}")
        if tuple(pages.index.shape[:2]) != (B, Hkv) or pages.index.device != q.device:
            raise ValueError(f"pages must be [B={B}, Hkv={Hkv}, P] on {q.device}, got {tuple(pages.index.shape)} "
                             f"on {pages.index.device}")
    if scale is None:
        scale = 1.0 / math.sqrt(D)
    seqs_t = _seqs_tensor(seqs, B, q.device, cache.max_seqs)
    kernels = _runtime.load_kernels("decode")
    interpreter = _runtime.select_backend() == "interpreter"
    q = _last_dim_contiguous(q)
    group = Hq // Hkv
    block_g = max(16, 1 << (group - 1).bit_length())
    cfg = _config or _decode_config(interpreter)
    cap_pages = pages.capacity if pages is not None else cache.max_pages_per_seq
    sms = _num_sms(q.device)
    n_splits, per_split = decode_splits(B, Hkv, cap_pages * cache.page_size, cfg.block_n, sms,
                                        decode_programs_per_sm(cfg, B, Hkv, sms))
    o_part = torch.empty(B, Hq, n_splits, D, device=q.device, dtype=torch.float32)
    lse_part = torch.empty(B, Hq, n_splits, device=q.device, dtype=torch.float32)
    kp, vp = cache.k_pages, cache.v_pages
    sel_index = pages.index if pages is not None else cache.seq_lens
    sel_count = pages.count if pages is not None else cache.seq_lens
    grid = (Hkv, n_splits, B) if cfg.head_fastest else (n_splits, Hkv, B)
    kernels.decode_split_kernel[grid](
        q, kp, vp, cache.page_table, cache.seq_lens, seqs_t, sel_index, sel_count, o_part, lse_part,
        q.stride(0), q.stride(1), kp.stride(0), kp.stride(1), kp.stride(2), vp.stride(0), vp.stride(1), vp.stride(2),
        cache.page_table.stride(0), cache.max_pages_per_seq, Hq, Hkv, group, n_splits, per_split, cap_pages,
        scale * LOG2E,
        HEAD_DIM=D, PAGE_SIZE=cache.page_size, BLOCK_G=block_g, BLOCK_N=cfg.block_n, USE_SEL=pages is not None,
        HEAD_FASTEST=cfg.head_fastest, DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    o = torch.empty(B, Hq, D, device=q.device, dtype=q.dtype)
    lse = torch.empty(B, Hq, device=q.device, dtype=torch.float32)
    block_d = min(D, 32)
    kernels.merge_splits_kernel[(B * Hq, D // block_d)](
        o_part, lse_part, o, lse, o.stride(0), o.stride(1), Hq, n_splits, HEAD_DIM=D, BLOCK_D=block_d,
        BLOCK_S=min(64, max(2, 1 << (n_splits - 1).bit_length())))
    return (o, lse) if return_lse else o
