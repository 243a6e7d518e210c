"""Exact work of one call of an op: per kernel launch, per program in dispatch order.

What each count means (the tests check every one against a loop over the dense mask):

* **steps** — iterations of a kernel's inner loop. The forward visits each listed layout tile of its row in
  ``block_k / block_n`` steps of ``block_m x block_n``; partial (masked) and full steps are kept apart because
  partial ones also build a token mask. One program per (query sub-tile, batch x query head), dispatched
  longest row first (the forward's ``ROW_ORDER``).
* **flops** — physical: every step multiplies whole tiles (rows past ``Lq``, keys past ``Lk`` and masked
  cells included), ``2 m n k`` per matmul. Forward: 2 matmuls a step, so ``4 Bq Bk D`` per listed tile per
  query head. Backward: the dK/dV kernel does 4 per step (S^T, dV, dP^T, dK) and 5 with atomic dQ
  (+ dQ); the dQ kernel 3 (S, dP, dQ): deterministic 7, atomic 5. Decode: 2 per step on a group tile padded
  to ``BLOCK_G >= 16`` rows.
* **requested bytes** — what the kernels' loads and stores ask of the memory system, program by program:
  Q once per program, K/V once per visited tile per program (the only reuse the kernel has is across the
  ``block_m`` rows of its own tile, and across the query heads of a GQA group in decode), O, LSE, dO, delta,
  index entries (4 bytes each time a loop iteration reads one), bit-table bytes (``block_m x block_n / 8``
  per partial step) and document ids. Masked rows past ``Lq``/``Lk`` move no bytes and are not counted.
* **HBM bytes** (``D_HBM``) — compulsory traffic: each distinct byte a launch reads or writes, once (K/V
  rows once per batch x KV head for the key tiles some program visits, Q/O/LSE once, the tables once).
  Repeated reads of a K/V tile by the programs of one head are served by the L2 cache (50 MB on an H200),
  so ``requested / hbm`` is the reuse the L2 must supply.
* **helper ops** — the small launches around the main kernels (the backward's ``delta_kernel``,
  Δ = rowsum(dO * O); ``column_reduce_kernel``, the fixed-order sum of split columns; atomic dQ's eager
  zero-fill and cast), counted as the bytes they move.

Nothing here launches a kernel: everything is computed from the layout's tables with torch on the layout's
device (CPU is fine).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import torch

from .._checks import check_int
from ..layout import BlockLayout
from ..ops import BwdConfig, DecodeConfig, FwdConfig, column_work, decode_programs_per_sm, decode_splits
from ..ops import mask_path_name
from ..ops.backward import one_launch

__all__ = ["Shape", "KernelWork", "TorchOpWork", "Work", "as_shape", "element_size", "fwd_work", "bwd_work",
           "decode_work", "DecodeInput", "decode_input"]

_ELT = {torch.float16: 2, torch.bfloat16: 2, torch.float32: 4}
_DTYPE_ALIASES = {"bf16": torch.bfloat16, "bfloat16": torch.bfloat16, "fp16": torch.float16,
                  "float16": torch.float16, "half": torch.float16, "fp32": torch.float32,
                  "float32": torch.float32, "float": torch.float32}


def element_size(dtype: torch.dtype) -> int:
    if dtype not in _ELT:
        raise TypeError(f"dtype must be float16, bfloat16 or float32, got {dtype}")
    return _ELT[dtype]


@dataclass(frozen=True)
class Shape:
    """Problem shape for the cost model. ``Hkv`` defaults to ``Hq``. Decode without a cache also needs
    ``seq_len`` (tokens per sequence) and ``page_size``."""

    B: int = 1
    Hq: int = 1
    Hkv: Optional[int] = None
    D: int = 128
    dtype: torch.dtype = torch.bfloat16
    seq_len: Optional[int] = None
    page_size: int = 16

    def __post_init__(self):
        check_int("B", self.B)
        check_int("Hq", self.Hq)
        if self.Hkv is None:
            object.__setattr__(self, "Hkv", self.Hq)
        check_int("Hkv", self.Hkv)
        if self.Hq % self.Hkv:
            raise ValueError(f"Hq ({self.Hq}) must be a multiple of Hkv ({self.Hkv})")
        check_int("D", self.D)
        dtype = self.dtype
        if isinstance(dtype, str):
            if dtype.lower() not in _DTYPE_ALIASES:
                raise TypeError(f"dtype must be one of {sorted(_DTYPE_ALIASES)} or a torch dtype, got {dtype!r}")
            object.__setattr__(self, "dtype", _DTYPE_ALIASES[dtype.lower()])
        element_size(self.dtype)
        if self.seq_len is not None:
            check_int("seq_len", self.seq_len)
        check_int("page_size", self.page_size)

    @property
    def group(self) -> int:
        return self.Hq // self.Hkv

    @property
    def elt(self) -> int:
        return _ELT[self.dtype]


def as_shape(shape) -> Shape:
    """A :class:`Shape` from a Shape or a dict (keys ``B, Hq`` (or ``H``), ``Hkv, D, dtype, seq_len`` (or
    ``N``), ``page_size``)."""
    if isinstance(shape, Shape):
        return shape
    if not isinstance(shape, dict):
        raise TypeError(f"shape must be a Shape or a dict, got {type(shape).__name__}")
    d = dict(shape)
    if "H" in d:
        d.setdefault("Hq", d.pop("H"))
    if "N" in d:
        d.setdefault("seq_len", d.pop("N"))
    known = {"B", "Hq", "Hkv", "D", "dtype", "seq_len", "page_size"}
    unknown = set(d) - known
    if unknown:
        raise ValueError(f"shape has unknown keys {sorted(unknown)}; known: {sorted(known)}")
    return Shape(**d)


@dataclass
class KernelWork:
    """One kernel launch. ``steps_full``/``steps_partial`` are int64 ``[programs]`` in dispatch order."""

    name: str
    grid: tuple
    steps_full: torch.Tensor
    steps_partial: torch.Tensor
    flops_per_step: float
    matmuls: int
    requested: Dict[str, float]
    hbm: Dict[str, float]

    @property
    def programs(self) -> int:
        return int(self.steps_full.numel())

    @property
    def steps(self) -> int:
        return int(self.steps_full.sum() + self.steps_partial.sum())

    @property
    def flops(self) -> float:
        return self.steps * self.flops_per_step

    @property
    def requested_bytes(self) -> float:
        return float(sum(self.requested.values()))

    @property
    def hbm_bytes(self) -> float:
        return float(sum(self.hbm.values()))


@dataclass
class TorchOpWork:
    """Eager torch ops around the kernels: how many kernels they launch and the bytes they move."""

    name: str
    launches: int
    hbm: Dict[str, float]

    @property
    def hbm_bytes(self) -> float:
        return float(sum(self.hbm.values()))


@dataclass
class Work:
    pass_: str
    kernels: List[KernelWork]
    torch_ops: List[TorchOpWork] = field(default_factory=list)
    config: object = None
    #: kernels that run inside another's launch (the backward's dQ programs in ``bwd_kernel``): priced as
    #: their own work, back to back, but with no launch of their own
    shared_launches: int = 0

    @property
    def flops(self) -> float:
        return float(sum(k.flops for k in self.kernels))

    @property
    def matmuls(self) -> int:
        """Tile matmuls per (query tile, key tile) pair over the whole pass (7 / 5 backward, 2 forward)."""
        return sum(k.matmuls for k in self.kernels)

    def _sum(self, attr: str, ops: bool) -> Dict[str, float]:
        out: Dict[str, float] = {}
        for k in self.kernels:
            for term, b in getattr(k, attr).items():
                out[term] = out.get(term, 0.0) + float(b)
        if ops:
            for op in self.torch_ops:
                for term, b in op.hbm.items():
                    out[term] = out.get(term, 0.0) + float(b)
        return out

    @property
    def requested(self) -> Dict[str, float]:
        """Requested bytes by term (kernels' loads/stores plus the torch ops' traffic)."""
        return self._sum("requested", True)

    @property
    def hbm(self) -> Dict[str, float]:
        return self._sum("hbm", True)

    @property
    def launches(self) -> int:
        return len(self.kernels) - self.shared_launches + sum(op.launches for op in self.torch_ops)


# ---- shared pieces -------------------------------------------------------------------------------------------
def _check_layout_for(layout: BlockLayout, s: Shape) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if layout.B not in (1, s.B):
        raise ValueError(f"layout has B={layout.B}; it must be 1 or the batch size {s.B}")
    if layout.H not in (1, s.Hkv, s.Hq):
        raise ValueError(f"layout has H={layout.H}; it must be 1, the KV heads ({s.Hkv}) or the query heads ({s.Hq})")


def _head_maps(layout: BlockLayout, s: Shape):
    """Layout batch index of each batch row and layout head of each query head (as the kernels map them)."""
    lh_div = 1 if layout.H == s.Hq else s.group
    lb = torch.arange(s.B) % layout.B
    lh = (torch.arange(s.Hq) // lh_div) % layout.H
    return lb, lh


def _mask_flags(layout: BlockLayout):
    """``(uses_bits, has_doc)``: how the kernels mask this layout's partial tiles. A compiled mask_mod
    (``"compiled: ..."``) reads neither; the tables it may capture are not counted (small and cached)."""
    name = mask_path_name(layout)
    return name.startswith("bits"), "same document" in name


def _clipped(length: int, n: int, block: int) -> torch.Tensor:
    """In-range size of each of ``n`` blocks of ``block`` over ``length``: int64 ``[n]``."""
    return torch.clamp(length - torch.arange(n, dtype=torch.int64) * block, min=0, max=block)


def _row_sums(count: torch.Tensor, index: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """``sum(values[index[..., :count]])`` per row: ``[..., rows]``. Padding past ``count`` is never read as an
    index: a layout leaves it unwritten (the fused transpose allocates with ``torch.empty``)."""
    valid = torch.arange(index.shape[-1]) < count[..., None]
    return (values[index.long().where(valid, 0)] * valid).sum(-1)


def _used_columns(layout: BlockLayout) -> torch.Tensor:
    """bool ``[LB, LH, nk]``: key tiles listed in some row of each layout (b, h)."""
    out = torch.zeros(layout.B, layout.H, layout.nk + 1, dtype=torch.bool)
    for count, index in ((layout.kv_count, layout.kv_index), (layout.full_count, layout.full_index)):
        count, index = count.cpu(), index.cpu().long()
        valid = torch.arange(index.shape[-1]) < count[..., None]
        dest = torch.where(valid, index, torch.full_like(index, layout.nk))  # [LB, LH, nq, W]
        out.scatter_(-1, dest.flatten(2), True)
    return out[..., :layout.nk]


def _unique_kv_rows(layout: BlockLayout, s: Shape) -> int:
    """Key rows some program of each (batch, KV head) visits, summed over batch x KV heads."""
    lb, lh = _head_maps(layout, s)
    used = _used_columns(layout)[:, lh]  # [LB, Hq, nk]
    per_kv = used.view(layout.B, s.Hkv, s.group, layout.nk).any(2)  # [LB, Hkv, nk]
    keys = (per_kv.long() * _clipped(layout.kv_len, layout.nk, layout.block_k)).sum(-1)  # [LB, Hkv]
    return int(keys[lb].sum())


def _table_bytes(layout: BlockLayout) -> float:
    """The forward tables' entries that are read: listed entries and counts (4 bytes each)."""
    listed = int(layout.kv_count.sum() + layout.full_count.sum())
    return 4.0 * (listed + 2 * layout.B * layout.H * layout.nq)


def _doc_table_bytes(layout: BlockLayout, has_doc: bool) -> float:
    return 4.0 * (layout.q_offset + layout.q_len) if has_doc else 0.0


def _partial_tiles(layout: BlockLayout) -> int:
    return int(layout.kv_count.sum())


# ---- forward -------------------------------------------------------------------------------------------------
def fwd_work(layout: BlockLayout, shape, config: FwdConfig, order: str = "longest", sms: int = 132) -> Work:
    """Work of the forward kernel (``sparse_fwd_kernel``). ``order="longest"`` dispatches query sub-tiles
    longest row first as the kernel does; ``"natural"`` in index order (how FlexAttention launches). A config
    with ``split`` set gives the split forward's work on ``sms`` SMs instead (:func:`_split_fwd_work`)."""
    if getattr(config, "split", None) is not None:
        return _split_fwd_work(layout, shape, config, sms)
    s = as_shape(shape)
    _check_layout_for(layout, s)
    BM, BN = config.block_m, config.block_n
    Bq, Bk = layout.block_q, layout.block_k
    if Bq % BM or Bk % BN:
        raise ValueError(f"kernel tiles {BM}x{BN} must divide the layout's {Bq}x{Bk}")
    Lq, Lk, D, elt = layout.q_len, layout.kv_len, s.D, s.elt
    sub = Bk // BN
    n_m = math.ceil(Lq / BM)
    m = torch.arange(n_m)
    qi = (m * BM) // Bq
    kcols = _clipped(Lk, layout.nk, Bk)
    cnt_p, cnt_f = layout.kv_count.cpu().long(), layout.full_count.cpu().long()
    keys = (_row_sums(cnt_p, layout.kv_index.cpu(), kcols) + _row_sums(cnt_f, layout.full_index.cpu(), kcols))
    lb, lh = _head_maps(layout, s)

    def per_program(t):  # layout row value -> [B, Hq, n_m]
        return t[lb][:, lh][:, :, qi]

    if order == "longest":
        work = (cnt_p + cnt_f).sum(dim=(0, 1))  # [nq], as the kernel's ROW_ORDER
        perm = torch.argsort(work.repeat_interleave(Bq // BM)[:n_m], descending=True, stable=True)
    elif order == "natural":
        perm = torch.arange(n_m)
    else:
        raise ValueError(f"order must be 'longest' or 'natural', got {order!r}")
    steps_p = (per_program(cnt_p) * sub)[..., perm].flatten()  # dispatch order: batch x head outer
    steps_f = (per_program(cnt_f) * sub)[..., perm].flatten()
    bits, doc = _mask_flags(layout)
    programs = s.B * s.Hq * n_m
    q_rows = s.B * s.Hq * Lq
    requested = {
        "q": q_rows * D * elt,
        "kv": 2.0 * D * elt * float(per_program(keys).sum()),
        "o": q_rows * D * elt,
        "lse": q_rows * 4.0,
        "index": 4.0 * float(steps_p.sum() + steps_f.sum()) + 12.0 * programs,
        "bits": float(steps_p.sum()) * BM * BN / 8 if bits else 0.0,
        "doc": 4.0 * (programs * BM + float(steps_p.sum()) * BN) if doc else 0.0,
    }
    hbm = {
        "q": q_rows * D * elt,
        "kv": 2.0 * D * elt * _unique_kv_rows(layout, s),
        "o": q_rows * D * elt,
        "lse": q_rows * 4.0,
        "index": _table_bytes(layout) + 4.0 * n_m,
        "bits": _partial_tiles(layout) * Bq * Bk / 8.0 if bits else 0.0,
        "doc": _doc_table_bytes(layout, doc),
    }
    k = KernelWork("sparse_fwd_kernel", (n_m, s.B * s.Hq), steps_f, steps_p, 4.0 * BM * BN * D, 2,
                   requested, hbm)
    return Work("fwd", [k], [], config)


def _split_fwd_work(layout: BlockLayout, shape, config: FwdConfig, sms: int) -> Work:
    """The split forward: the plan's tasks (:func:`sparseattn.balance.plan`) in dispatch order, heads outer, each
    walking its slot range of its head's row (partial slots first), then the merge of the split rows. A task
    loads its query tile again and a chunk of a split row writes its float32 state, which the merge reads back;
    the empty slots of the fixed-capacity list exit at once and are not priced."""
    from .. import balance
    s = as_shape(shape)
    _check_layout_for(layout, s)
    BM, BN, D, elt = config.block_m, config.block_n, s.D, s.elt
    sub = layout.block_k // BN
    n_m = math.ceil(layout.q_len / BM)
    qi = (torch.arange(n_m) * BM) // layout.block_q
    lb, lh = _head_maps(layout, s)
    cpu = layout.to("cpu")
    plan = balance.plan(cpu, BM, config.split, s.B * s.Hq, sms, D)
    n = int(plan.n_tasks[0])
    m, lo, hi, ws = (plan.tasks[:n, i].long() for i in range(4))
    cnt_p = cpu.kv_count.long()[lb][:, lh][:, :, qi][..., m]  # [B, Hq, tasks]: this head's partial tiles
    cnt_f = cpu.full_count.long()[lb][:, lh][:, :, qi][..., m]
    part = torch.clamp(torch.minimum(hi, cnt_p) - lo, min=0)
    full = torch.clamp(torch.minimum(hi - cnt_p, cnt_f) - torch.clamp(lo - cnt_p, min=0), min=0)
    heads = s.B * s.Hq
    n_ws = int((ws >= 0).sum())
    ws_bytes = float(heads * n_ws * BM * (D + 1) * 4)
    direct_rows = float(heads * min(layout.q_len, (n - n_ws) * BM))  # whole rows write O themselves
    bits, doc = _mask_flags(layout)
    steps_p, steps_f = (part * sub).flatten(), (full * sub).flatten()
    requested = {"q": heads * n * BM * D * elt, "kv": 2.0 * D * elt * BN * float(steps_p.sum() + steps_f.sum()),
                 "o": direct_rows * D * elt, "lse": direct_rows * 4.0, "workspace": ws_bytes,
                 "index": 4.0 * float(steps_p.sum() + steps_f.sum()) + 16.0 * heads * n,
                 "bits": float(steps_p.sum()) * BM * BN / 8 if bits else 0.0,
                 "doc": 4.0 * (heads * n * BM + float(steps_p.sum()) * BN) if doc else 0.0}
    hbm = {"q": heads * n * BM * D * elt, "kv": 2.0 * D * elt * _unique_kv_rows(layout, s),
           "o": direct_rows * D * elt, "lse": direct_rows * 4.0, "workspace": ws_bytes,
           "index": _table_bytes(layout) + 16.0 * n,
           "bits": _partial_tiles(layout) * layout.block_q * layout.block_k / 8.0 if bits else 0.0,
           "doc": _doc_table_bytes(layout, doc)}
    kernels = [KernelWork("sparse_fwd_kernel (split)", (plan.capacity, heads), steps_f, steps_p,
                          4.0 * BM * BN * D, 2, requested, hbm)]
    n_merge = int(plan.n_merge[0])
    if n_merge:
        rows = float(heads * n_merge * BM)
        mb = {"workspace": ws_bytes, "o": rows * D * elt, "lse": rows * 4.0}
        block_d = min(D, 64)
        zeros = torch.zeros(heads * n_merge * (D // block_d), dtype=torch.long)
        kernels.append(KernelWork("merge_rows_kernel", (plan.merge_capacity, heads, D // block_d), zeros, zeros,
                                  0.0, 0, dict(mb), dict(mb)))
    return Work("fwd", kernels, [], config)


# ---- backward ------------------------------------------------------------------------------------------------
def _delta_op(s: Shape, Lq: int) -> TorchOpWork:
    """``delta_kernel``: Δ = rowsum(dO * O) in one launch (reads O and dO, writes a float32 per row)."""
    n = s.B * s.Hq * Lq * s.D
    return TorchOpWork("delta", 1, {"delta": 2 * n * s.elt + s.B * s.Hq * Lq * 4.0})


def _prefix_rows(count, index, rows_of_tile):
    """Prefix sums of clipped query rows along each column list: ``[..., W + 1]`` (padding never read, as in
    :func:`_row_sums`)."""
    valid = torch.arange(index.shape[-1]) < count[..., None]
    vals = rows_of_tile[index.long().where(valid, 0)] * valid
    return torch.cat([torch.zeros(*vals.shape[:-1], 1, dtype=vals.dtype), vals.cumsum(-1)], -1)


def bwd_work(layout: BlockLayout, shape, config: BwdConfig, deterministic: bool = True) -> Work:
    """Work of the backward: delta (torch ops), ``dkdv_kernel`` over the column work items, the fixed-order
    sum of split columns (torch ops), then ``dq_kernel`` (deterministic) or the atomic dQ's cast."""
    s = as_shape(shape)
    _check_layout_for(layout, s)
    BM, BN, dBM, dBN = config.block_m, config.block_n, config.dq_block_m, config.dq_block_n
    Bq, Bk = layout.block_q, layout.block_k
    for a, b, what in ((Bq, BM, "block_m"), (Bk, BN, "block_n"), (Bq, dBM, "dq_block_m"), (Bk, dBN, "dq_block_n")):
        if a % b:
            raise ValueError(f"{what}={b} must divide the layout's tile ({a})")
    Lq, Lk, D, elt = layout.q_len, layout.kv_len, s.D, s.elt
    bits, doc = _mask_flags(layout)
    lb, lh = _head_maps(layout, s)
    ops = [_delta_op(s, Lq)]

    # dK/dV: one program per (work item, batch x KV head); the item walks a chunk of its column per head
    plan = column_work(layout, BN, config.chunk, s.B * s.Hkv)
    t = layout.transposed_lists()
    work = plan.work.cpu().long()  # [I, 3]: key sub-tile, chunk, workspace slot
    I = work.shape[0]
    sub_m = Bq // BM
    kj = (work[:, 0] * BN) // Bk  # [I]
    lo = work[:, 1] * plan.chunk
    qc, fqc = t.q_count.cpu().long(), t.full_q_count.cpu().long()  # [LB, LH, nk]
    rows_tile = _clipped(Lq, layout.nq, Bq)
    pre_p = _prefix_rows(qc, t.q_index.cpu(), rows_tile)  # [LB, LH, nk, W'+1]
    pre_f = _prefix_rows(fqc, t.full_q_index.cpu(), rows_tile)
    # positions of each item's chunk in the partial and the full list, per layout (b, h): [LB, LH, I]
    np_, nf_ = qc[:, :, kj], fqc[:, :, kj]
    lo_ = lo.view(1, 1, I).expand_as(np_)
    hi_ = torch.minimum(lo_ + plan.chunk, np_ + nf_)
    p_lo, p_hi = torch.minimum(lo_, np_), torch.minimum(hi_, np_)
    f_lo, f_hi = torch.maximum(lo_, np_) - np_, torch.maximum(hi_, np_) - np_
    pos_p = torch.clamp(p_hi - p_lo, min=0)
    pos_f = torch.clamp(f_hi - f_lo, min=0)

    def rows_between(pre, a, b_):  # clipped query rows at list positions [a, b) of each item's column
        P = pre[:, :, kj]  # [LB, LH, I, W'+1]
        a, b_ = torch.clamp(a, min=0), torch.maximum(torch.clamp(b_, min=0), torch.clamp(a, min=0))
        return (P.gather(-1, b_[..., None]) - P.gather(-1, a[..., None]))[..., 0]

    rows_p, rows_f = rows_between(pre_p, p_lo, p_hi), rows_between(pre_f, f_lo, f_hi)

    def by_kv(x):  # layout-level [LB, LH, I] -> programs [B * Hkv * I], summed over the group, item fastest
        x = x[lb][:, lh]  # [B, Hq, I]
        return x.reshape(s.B, s.Hkv, s.group, I).sum(2).flatten()

    steps_p, steps_f = by_kv(pos_p * sub_m), by_kv(pos_f * sub_m)
    q_rows_visited = float(by_kv(rows_p + rows_f).sum())
    n_prog = s.B * s.Hkv * I
    keys_sub = _clipped(Lk, math.ceil(Lk / BN), BN)[work[:, 0]]  # [I]
    direct = work[:, 2] < 0
    stores = float((keys_sub * direct).sum()) * 2 * D * elt + float((~direct).sum()) * 2 * BN * D * 4.0
    atomic = not deterministic
    all_steps = float(steps_p.sum() + steps_f.sum())
    requested = {
        "kv": float(keys_sub.sum()) * s.B * s.Hkv * 2 * D * elt,
        "q": q_rows_visited * D * elt,
        "do": q_rows_visited * D * elt,
        "lse": q_rows_visited * 4.0,
        "delta": q_rows_visited * 4.0,
        "dkdv": stores * s.B * s.Hkv,
        "dq": q_rows_visited * D * 4.0 if atomic else 0.0,
        "index": 12.0 * n_prog + 8.0 * n_prog * s.group + 4.0 * all_steps + 4.0 * float(steps_p.sum()),
        "bits": float(steps_p.sum()) * BM * BN / 8 if bits else 0.0,
        "doc": 4.0 * (n_prog * BN + float(steps_p.sum()) * BM) if doc else 0.0,
    }
    # compulsory: each key row once (every item loads its sub-tile), each visited query row once per head
    visited_q = _visited_query_rows(layout, s)
    hbm = {
        "kv": s.B * s.Hkv * Lk * 2.0 * D * elt,
        "q": visited_q * D * elt,
        "do": visited_q * D * elt,
        "lse": visited_q * 4.0,
        "delta": visited_q * 4.0,
        "dkdv": (float((keys_sub * direct).sum()) * 2 * D * elt + float((~direct).sum()) * 2 * BN * D * 4.0)
        * s.B * s.Hkv,
        "dq": visited_q * D * 4.0 if atomic else 0.0,
        "index": _transposed_table_bytes(layout) + 12.0 * I,
        "bits": _partial_tiles(layout) * Bq * Bk / 8.0 if bits else 0.0,
        "doc": _doc_table_bytes(layout, doc),
    }
    mm = 5 if atomic else 4
    kernels = [KernelWork("dkdv_kernel", (I, s.B * s.Hkv), steps_f, steps_p, mm * 2.0 * BM * BN * D, mm,
                          requested, hbm)]
    if plan.n_ws:
        ops.append(_split_sum_op(s, plan, BN, Lk))
    if deterministic:
        fw = fwd_work(layout, s, FwdConfig(block_m=dBM, block_n=dBN, num_warps=config.num_warps,
                                           num_stages=config.num_stages), order="natural")
        f = fw.kernels[0]
        q_rows = s.B * s.Hq * Lq
        req = {"q": q_rows * D * elt, "do": q_rows * D * elt, "lse": q_rows * 4.0, "delta": q_rows * 4.0,
               "kv": f.requested["kv"], "dq": q_rows * D * elt,
               "index": f.requested["index"] - 4.0 * f.programs,  # no ROW_ORDER
               "bits": f.requested["bits"], "doc": f.requested["doc"]}
        hb = {"q": q_rows * D * elt, "do": q_rows * D * elt, "lse": q_rows * 4.0, "delta": q_rows * 4.0,
              "kv": f.hbm["kv"], "dq": q_rows * D * elt, "index": _table_bytes(layout),
              "bits": f.hbm["bits"], "doc": f.hbm["doc"]}
        kernels.append(KernelWork("dq_kernel", f.grid, f.steps_full, f.steps_partial, 3 * 2.0 * dBM * dBN * D, 3,
                                  req, hb))
        if one_launch(config, deterministic):  # the dQ programs run in the dK/dV launch (bwd_kernel)
            return Work("bwd", kernels, ops, config, shared_launches=1)
    else:
        n = s.B * s.Hq * Lq * D
        ops.insert(0, TorchOpWork("dq_zero", 1, {"dq": n * 4.0}))
        ops.append(TorchOpWork("dq_cast", 2, {"dq": n * (4.0 + 4.0 + 4.0 + elt)}))
    return Work("bwd", kernels, ops, config)


def _visited_query_rows(layout: BlockLayout, s: Shape) -> float:
    """Query rows (over batch x query heads) whose layout row lists at least one tile."""
    lb, lh = _head_maps(layout, s)
    nonempty = ((layout.kv_count + layout.full_count).cpu() > 0).long()  # [LB, LH, nq]
    rows = (nonempty * _clipped(layout.q_len, layout.nq, layout.block_q)).sum(-1)  # [LB, LH]
    return float(rows[lb][:, lh].sum())


def _transposed_table_bytes(layout: BlockLayout) -> float:
    listed = int(layout.kv_count.sum() + layout.full_count.sum())
    return 4.0 * (listed + int(layout.kv_count.sum()) + 2 * layout.B * layout.H * layout.nk)


def _split_sum_op(s: Shape, plan, BN: int, Lk: int) -> TorchOpWork:
    """``column_reduce_kernel``: the fixed-order sum of the chunks of split columns, one launch for dK and dV
    (reads every chunk's float32 partials, writes the split sub-tiles' rows)."""
    bh = s.B * s.Hkv
    chunks = float(plan.reduce[:, 2].sum()) if plan.reduce.numel() else 0.0
    read = bh * chunks * BN * s.D * 4.0
    written = bh * plan.reduce.shape[0] * BN * s.D * s.elt
    return TorchOpWork("split_sum", 1, {"split_sum": 2 * (read + written)})


# ---- decode --------------------------------------------------------------------------------------------------
@dataclass
class DecodeInput:
    """What decode reads, per batch row: sequence lengths ``[B]`` and, with a selection, its page counts and
    the valid tokens of its pages ``[B, Hkv]``; ``capacity`` pages per row bounds the split plan."""

    seq_lens: torch.Tensor
    page_size: int
    capacity: int
    sel_count: Optional[torch.Tensor] = None  # [B, Hkv] pages selected
    sel_tokens: Optional[torch.Tensor] = None  # [B, Hkv] valid tokens in the selected pages


def decode_input(s: Shape, cache=None, pages=None, keep: Optional[float] = None, seqs=None) -> DecodeInput:
    """Decode input from a cache (and a PageSelection or a kept fraction), or from the shape alone
    (``seq_len`` tokens per row; a kept fraction selects ``max(1, round(keep * pages))`` pages, the last
    always among them, as :func:`sparseattn.select_pages` does)."""
    if pages is not None and keep is not None:
        raise ValueError("pass either pages (a PageSelection) or keep (a fraction), not both")
    if keep is not None:
        if isinstance(keep, bool) or not isinstance(keep, (int, float)) or not 0 < float(keep) <= 1:
            raise ValueError(f"keep must be a fraction in (0, 1], got {keep!r}")
    if cache is not None:
        ps = cache.page_size
        if seqs is None:
            seq_rows = torch.arange(s.B)
        else:
            seq_rows = torch.as_tensor(seqs).cpu().long()
        lens = cache.seq_lens.cpu().long()[seq_rows]
        if pages is not None:
            count = pages.count.cpu().long()
            idx = pages.index.cpu().long()
            valid = torch.arange(pages.capacity) < count[..., None]
            tok = torch.clamp(lens.view(-1, 1, 1) - idx * ps, min=0, max=ps) * valid
            return DecodeInput(lens, ps, pages.capacity, count, tok.sum(-1))
        if keep is None:
            return DecodeInput(lens, ps, cache.max_pages_per_seq)
        n_pages = -(-lens // ps)
        return _kept(lens, ps, keep, s.Hkv, cap_limit=cache.max_pages_per_seq, n_pages=n_pages)
    if s.seq_len is None:
        raise ValueError("decode without a cache needs shape.seq_len (tokens per sequence)")
    lens = torch.full((s.B,), s.seq_len, dtype=torch.int64)
    ps = s.page_size
    n_pages = -(-lens // ps)
    if keep is None:
        return DecodeInput(lens, ps, int(n_pages.max()))
    return _kept(lens, ps, keep, s.Hkv, cap_limit=int(n_pages.max()), n_pages=n_pages)


def _kept(lens, ps, keep, Hkv, cap_limit, n_pages) -> DecodeInput:
    topk = max(1, round(float(keep) * int(n_pages.max())))
    capacity = min(topk, cap_limit)
    count = torch.minimum(torch.full_like(n_pages, capacity), n_pages)  # [B]
    last_tokens = lens - (n_pages - 1) * ps  # the last page is always kept
    tokens = torch.where(count > 0, (count - 1) * ps + last_tokens, torch.zeros_like(count))
    return DecodeInput(lens, ps, capacity, count.view(-1, 1).expand(-1, Hkv).clone(),
                       tokens.view(-1, 1).expand(-1, Hkv).clone())


def decode_work(shape, inp: DecodeInput, config: DecodeConfig, num_sms: int) -> Work:
    """Work of ``decode_split_kernel`` (one program per split x KV head x row) and ``merge_splits_kernel``."""
    s = as_shape(shape)
    BN, ps, D, elt = config.block_n, inp.page_size, s.D, s.elt
    B, Hkv, G = s.B, s.Hkv, s.group
    n_splits, per_split = decode_splits(B, Hkv, inp.capacity * ps, BN, num_sms,
                                        decode_programs_per_sm(config, B, Hkv, num_sms))
    if inp.sel_count is not None:
        n_virtual = inp.sel_count * ps  # [B, Hkv]
        tokens = inp.sel_tokens
    else:
        n_virtual = inp.seq_lens.view(-1, 1).expand(B, Hkv)
        tokens = n_virtual
    n_blocks = -(-n_virtual // BN)  # [B, Hkv]
    first = torch.arange(n_splits) * per_split  # [S]
    steps = torch.clamp(torch.minimum(first + per_split, n_blocks[..., None]) - first, min=0)  # [B, Hkv, S]
    if config.head_fastest:  # grid (Hkv, n_splits, B): head fastest
        order = steps.permute(0, 2, 1)  # [B, S, Hkv]
    else:
        order = steps  # grid (n_splits, Hkv, B): split fastest
    steps_f = order.flatten()
    block_g = max(16, 1 << (G - 1).bit_length())
    programs = B * Hkv * n_splits
    total_steps = float(steps.sum())
    kv_bytes = float(tokens.sum()) * 2 * D * elt
    pages_per_step = -(-BN // ps)
    index = total_steps * pages_per_step * 4.0 * (2 if inp.sel_count is not None else 1) + programs * 8.0
    part = B * s.Hq * n_splits * (D + 1) * 4.0
    requested = {"q": programs * G * D * elt, "kv": kv_bytes, "index": index, "o_part": part}
    hbm = {"q": B * s.Hq * D * elt, "kv": kv_bytes,
           "index": float((-(-tokens // ps)).sum()) * 4.0 * (2 if inp.sel_count is not None else 1) + B * 8.0,
           "o_part": part}
    split = KernelWork("decode_split_kernel", (Hkv, n_splits, B) if config.head_fastest else (n_splits, Hkv, B),
                       steps_f, torch.zeros_like(steps_f), 2 * 2.0 * block_g * BN * D, 2, requested, hbm)
    block_d = min(D, 32)
    merge_bytes = {"o_part": part, "o": B * s.Hq * D * elt, "lse": B * s.Hq * 4.0}
    merge = KernelWork("merge_splits_kernel", (B * s.Hq, D // block_d), torch.zeros(B * s.Hq * (D // block_d),
                       dtype=torch.int64), torch.zeros(B * s.Hq * (D // block_d), dtype=torch.int64), 0.0, 0,
                       dict(merge_bytes), dict(merge_bytes))
    return Work("decode", [split, merge], [], config)
