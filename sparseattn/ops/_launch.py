"""What the prefill ops share between argument checks and a kernel launch: the layout checks, the mask
arguments every prefill kernel takes, cached launch plans, the TMA test and the shared-memory fallbacks.
No ``@triton.jit`` code here."""
from __future__ import annotations

import math
from typing import Optional

import torch

from .. import _runtime
from ..layout import BlockLayout
from ..predicates import Predicate, kernel_predicate


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


def check_kernel_tiles(name: str, layout: BlockLayout, **tiles) -> None:
    """A config's kernel tiles (``block_m=...``: query rows, divide ``block_q``; ``block_n=...``: keys, divide
    ``block_k``) must be powers of two >= 16 that divide the layout's tiles: a kernel tile that straddles two
    layout tiles would read the wrong tile's list and mask (silently wrong gradients, not an error)."""
    for field, value in tiles.items():
        limit = layout.block_q if field.endswith("_m") else layout.block_k
        if not isinstance(value, int) or isinstance(value, bool) or value < 16 or value & (value - 1) \
                or limit % value:
            raise ValueError(f"{name}: kernel tiles must be powers of two >= 16 that divide the layout's "
                             f"{layout.block_q}x{layout.block_k} tiles, got {field}={value!r}")


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


#: How many SMs the split planning assumes off the GPU (the interpreter has none). Tests raise it to reach
#: launch shapes a real GPU produces, e.g. more decode splits per row than one merge step holds.
CPU_SM_COUNT = 4


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


# ---- mask path: in-register predicate or per-tile bits ------------------------------------------------------
def mask_path(layout: BlockLayout):
    """``(predicate, bits)``: exactly one is used by the kernels for partial tiles (cached on the layout). A
    dynamic layout's path is fixed by construction (its predicate, else its own tile_bits): nothing is read
    from its contents, which may change."""
    def build():
        pred = None if layout.tile_bits is not None and layout.mask_mod is None else kernel_predicate(layout.mask_mod)
        bits = None
        if pred is None and layout.dynamic:
            bits = layout.tile_bits
        elif pred is None and bool((layout.kv_count > 0).any()):
            bits = layout.partial_tile_bits()
        return pred, bits
    return layout.plan("mask_path", build)


def mask_path_name(layout: BlockLayout) -> str:
    """``"predicate: ..."`` or ``"bits"``: how the kernels mask this layout's partial tiles."""
    pred, bits = mask_path(layout)
    if pred is not None:
        return "predicate: " + pred.describe()
    return "bits" if bits is not None else "none (no partial tiles)"


def _doc_table(pred: Optional[Predicate], layout: BlockLayout, B: int) -> Optional[torch.Tensor]:
    if pred is None or pred.doc_ids is None:
        return None

    def build():
        # the kernels compare int32 ids: replace every id by its rank among the distinct ids (equal ids stay
        # equal, different ones stay different), so ids beyond int32 cannot collide in their low 32 bits
        _, ranks = torch.unique(pred.doc_ids.to(layout.device), return_inverse=True)
        ids = ranks.to(torch.int32).view(pred.doc_ids.shape)
        need = max(layout.q_offset + layout.q_len, layout.kv_len)
        if ids.shape[-1] < need:
            raise ValueError(f"doc_ids covers {ids.shape[-1]} positions but attention needs {need}")
        # padded with -1 to whole tiles, so kernels read the ids of a tile's padding rows without a mask
        whole = max(layout.q_offset + layout.nq * layout.block_q, layout.nk * layout.block_k)
        return torch.nn.functional.pad(ids, (0, max(0, whole - ids.shape[-1])), value=-1).contiguous()
    ids = layout.plan("doc_ids", build)
    if ids.dim() == 2 and ids.shape[0] != B:
        raise ValueError(f"doc_ids has batch {ids.shape[0]} but q has batch {B}")
    return ids


def mask_kwargs(layout: BlockLayout, B: int) -> dict:
    """The keyword arguments every prefill kernel takes to mask partial tiles: ``BITS`` (None on the
    predicate path), ``DOC`` (None without documents), the predicate's band/sink scalars and ``ROW_SLOT`` (the
    member bits of a routed layout, else None). The kernels' ``@triton.heuristics`` derive their flags from
    these (``BITS is not None``, ``sink_n > 0``, ...)."""
    pred, bits = mask_path(layout)
    doc = _doc_table(pred, layout, B)
    band = pred.band if pred is not None else (0, -1)
    sink_n = pred.sink_n if pred is not None and pred.has_sinks else 0
    sink_lo, sink_hi = pred.sink_band if sink_n else (0, -1)
    return dict(BITS=bits, DOC=doc, stride_doc_b=doc.stride(0) if doc is not None and doc.dim() == 2 else 0,
                band_lo=band[0], band_hi=band[1], sink_n=sink_n, sink_lo=sink_lo, sink_hi=sink_hi,
                ROW_SLOT=layout.row_slot)


def head_kwargs(layout: BlockLayout, Hq: int, Hkv: int) -> dict:
    """How a query head finds its KV head (``group``) and its layout head (``lh_div``); layout dims."""
    group = Hq // Hkv
    return dict(group=group, lh_div=1 if layout.H == Hq else group, LB=layout.B, LH=layout.H)


def row_order(layout: BlockLayout, block_m: int) -> torch.Tensor:
    """Kernel query sub-tiles sorted by their row's tile count, longest first (cached per layout; rebuilt on
    the device at every call for a dynamic layout, whose counts may change: a few launches, no host sync)."""
    def build():
        work = (layout.kv_count + layout.full_count).sum(dim=(0, 1))  # [nq]
        sub = layout.block_q // block_m
        n_m = math.ceil(layout.q_len / block_m)
        per_m = work.repeat_interleave(sub)[:n_m]
        return torch.argsort(per_m, descending=True, stable=True).to(torch.int32)
    if layout.dynamic:
        return build()
    return layout.plan(("row_order", block_m), build)


# ---- launching -----------------------------------------------------------------------------------------------
def tma_ok(*tensors) -> bool:
    """Tensor descriptors need 16-byte aligned bases and strides (and a unit last stride)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def with_smaller_tiles(run, cfg, fallbacks):
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


def launch(kernel, grid, *, num_stages: int, **kwargs):
    """``kernel[grid](**kwargs)``; if the tile config needs more shared memory than the GPU has (the bit-mask
    path adds a buffer), retry with fewer pipeline stages."""
    import triton
    while True:
        try:
            return kernel[grid](num_stages=num_stages, **kwargs)
        except triton.runtime.errors.OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1


def strides(prefix: str, t: Optional[torch.Tensor], row: str) -> dict:
    """Keyword strides of a ``[B, H, L, D]`` tensor as the kernels name them: ``stride_<prefix>b``,
    ``stride_<prefix>h`` and ``stride_<prefix><row>`` (0 for an absent tensor)."""
    return {f"stride_{prefix}{name}": (t.stride(i) if t is not None else 0) for i, name in enumerate(("b", "h", row))}
