"""Backward pass of block-sparse prefill attention: the dK/dV work plan (column chunks), Δ, and the keyword
launches of the dK/dV and dQ kernels (the dQ pass, when ``BwdConfig.dq_split`` asks, runs the task list of
:func:`sparseattn.balance.plan` and sums split rows' partials in a fixed order)."""
from __future__ import annotations

import functools
import math
from typing import NamedTuple, Optional

import torch

from .. import _runtime, balance
from .._checks import LOG2E
from ..layout import BlockLayout
from . import _launch as L
from .config import BwdConfig, layout_default, smaller_tiles


class ColumnWork(NamedTuple):
    """The dK/dV launch plan: one work item per (key sub-tile, chunk of its column)."""
    work: torch.Tensor  # int32 [items, 3]: key sub-tile, chunk index, workspace slot (-1: write directly)
    n_ws: int  # workspace slots (items of split columns)
    reduce: torch.Tensor  # int32 [split sub-tiles, 3]: sub-tile, first workspace slot, chunks (consecutive slots)
    chunk: int  # listed query tiles per chunk


def column_work(layout: BlockLayout, block_n: int, chunk: Optional[int] = None, programs: int = 1) -> ColumnWork:
    """The dK/dV work plan, cached per layout. A column is cut into chunks of at most ``chunk`` listed query
    tiles so that a column every row visits (a sink) does not become the tail of the launch (``None``: twice
    the mean column length, at least 8 -- and, when the launch has fewer columns than the GPU has SMs, at
    most half of one SM's fair share of the listed tiles, ``programs`` = batch x KV heads copies of every
    item: at one head a causal column of 128 tiles would otherwise run alone for as long as the rest of the
    pass; with a column per SM or more, cutting only adds the reduce launch -- H200, window 1024 at N = 2k,
    16 heads: 0.149 ms cut against 0.142 whole, causal 0.179 against 0.173). Items are
    ordered longest first. Items of split columns get a workspace slot; their partial dK/dV are summed in a
    fixed order afterwards (deterministic).

    A dynamic layout gets :func:`dynamic_column_work` instead, rebuilt at every call (``chunk`` is ignored)."""
    if layout.dynamic:
        return dynamic_column_work(layout, block_n)

    def build() -> ColumnWork:
        dev = layout.device
        t = layout.transposed_lists()
        totals = (t.q_count + t.full_q_count).amax(dim=(0, 1)).long()  # [nk]: the longest over the layout's B, H
        size = chunk
        if size is None:
            nonempty = totals[totals > 0]
            mean = float(nonempty.float().mean()) if nonempty.numel() else 1.0
            size = max(8, int(2 * mean + 0.999))
            sms = L.num_sms(dev)
            if math.ceil(layout.kv_len / block_n) * programs < sms:  # the launch cannot fill the GPU
                share = float(totals.sum()) * (layout.block_k // block_n) * programs / sms
                size = max(8, min(size, math.ceil(share / 2)))
        sub = layout.block_k // block_n
        n_sub = math.ceil(layout.kv_len / block_n)
        per_col = torch.clamp((totals + size - 1) // size, min=1)  # chunks per layout column
        per_sub = per_col.repeat_interleave(sub)[:n_sub]  # [n_sub]
        item_sub = torch.repeat_interleave(torch.arange(n_sub, device=dev), per_sub)
        starts = torch.cumsum(per_sub, 0) - per_sub
        item_c = torch.arange(item_sub.numel(), device=dev) - starts[item_sub]
        split = per_sub[item_sub] > 1
        ws_slot = torch.where(split, torch.cumsum(split.long(), 0) - 1, torch.full_like(item_sub, -1))
        work_len = torch.clamp(totals.repeat_interleave(sub)[:n_sub][item_sub] - item_c * size, min=0, max=size)
        order = torch.argsort(work_len, descending=True, stable=True)
        work = torch.stack([item_sub, item_c, ws_slot], 1)[order].to(torch.int32).contiguous()
        n_ws = int(split.sum())
        # reduction plan: each split sub-tile, its first workspace slot (its slots are consecutive), its chunks
        split_subs = torch.nonzero(per_sub > 1).flatten()
        reduce = torch.stack([split_subs, ws_slot[starts[split_subs]], per_sub[split_subs]], 1)
        return ColumnWork(work, n_ws, reduce.to(torch.int32).contiguous(), size)
    return layout.plan(("column_work", block_n, chunk, programs), build)


#: how many key sub-tiles of a dynamic layout are split into chunks (the first ones); a shape-only count, so the
#: plan's size and its workspace are fixed for a captured graph
DYNAMIC_SPLIT_COLUMNS = 8


def dynamic_column_work(layout: BlockLayout, block_n: int) -> ColumnWork:
    """The dK/dV plan of a dynamic layout, from its shape alone (built once per shape, no device work per call;
    a captured graph replays it with new lists): the first :data:`DYNAMIC_SPLIT_COLUMNS` key sub-tiles are
    each cut into ``ceil(nq / chunk)`` chunks -- enough for a column every row lists -- with a workspace slot
    per chunk, summed in chunk order afterwards (chunks past a column's end add zeros); the others stay whole,
    in key order. ``chunk`` is twice the mean column length the row capacity allows, at least 8. The first
    columns are the ones to cut because they are a routed layout's longest: its sink blocks are the first
    key blocks and every row lists them, and under a causal mask column ``j`` is visible only to rows at or
    after it. Without the split, the sink column (every query tile of every query head of the GQA group) was
    one program and the tail of the whole pass. (The plan used to pick this call's longest columns on the
    device: an argsort and a dozen small launches, 0.2 ms of host time per backward call on the H200 box.)"""
    n_sub = math.ceil(layout.kv_len / block_n)
    size = max(8, 2 * math.ceil(layout.nq * (layout.width + layout.full_width) / layout.nk))
    per = math.ceil(layout.nq / size)  # chunks of a split column
    R = min(n_sub, DYNAMIC_SPLIT_COLUMNS) if per > 1 else 0

    def build() -> ColumnWork:
        dev = layout.device
        order = torch.arange(n_sub, device=dev)
        if R == 0:
            work = torch.stack([order, torch.zeros_like(order), torch.full_like(order, -1)], 1).to(torch.int32)
            return ColumnWork(work.contiguous(), 0, torch.zeros(0, 3, dtype=torch.int32, device=dev), layout.nq)
        long, short = order[:R], order[R:]
        slots = torch.arange(R * per, device=dev)
        split = torch.stack([long.repeat_interleave(per), slots % per, slots], 1)  # [R * per, 3]
        whole = torch.stack([short, torch.zeros_like(short), torch.full_like(short, -1)], 1)
        work = torch.cat([split, whole]).to(torch.int32).contiguous()
        reduce = torch.stack([long, torch.arange(R, device=dev) * per, torch.full_like(long, per)], 1)
        return ColumnWork(work, R * per, reduce.to(torch.int32).contiguous(), size)
    return L.shape_plan(("dynamic_column_work", n_sub, R, per, size, layout.device), build)


class DqSplit(NamedTuple):
    """The split dQ pass: the planner's tasks for ``dq_block_m`` rows and their float32 workspace."""
    plan: balance.Plan
    ws: torch.Tensor  # float32 [B * Hq, ws slots, dq_block_m, D]: unscaled partial dQ of split rows' chunks


def dq_split_launch(layout: BlockLayout, block_m: int, split, B: int, Hq: int, D: int, device) -> DqSplit:
    """The dQ task plan for ``B * Hq`` heads on this device's SMs (the forward's planner, at the dQ pass's
    query tile) and an uninitialised workspace of its shape-only capacity. No host sync."""
    plan = balance.plan(layout, block_m, split, B * Hq, L.num_sms(device), D)
    ws = torch.empty(B * Hq, max(plan.ws_capacity, 1), block_m, D, device=device, dtype=torch.float32)
    return DqSplit(plan, ws)


def bwd_config(q: torch.Tensor, layout: BlockLayout) -> BwdConfig:
    """The tuned default for this GPU family, dtype and head dim, clipped to the layout's tiles."""
    return layout_default("bwd", q.device, _runtime.is_interpreter(), q.dtype, q.shape[-1], layout.block_q,
                          layout.block_k)


def backward(do, q, k, v, o, lse, layout: BlockLayout, scale: float, deterministic: bool,
             config: Optional[BwdConfig] = None):
    """``(dq, dk, dv)``. Without ``config``, a GPU short of shared memory falls back to smaller tiles."""
    cfg = config or bwd_config(q, layout)
    fallbacks = () if config is not None else smaller_tiles("bwd", layout.block_q, layout.block_k)
    return L.with_smaller_tiles(
        lambda c: _backward_with(do, q, k, v, o, lse, layout, scale, deterministic, c), cfg, fallbacks)


def _backward_with(do, q, k, v, o, lse, layout: BlockLayout, scale: float, deterministic: bool, cfg: BwdConfig):
    from ..kernels import prefill_bwd
    q, k, v, do = (L.last_dim_contiguous(t) for t in (q, k, v, do))
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    dq = torch.empty_like(q) if deterministic else None
    # everything but the per-call tensors, built once per (layout, shapes, strides, config, scale): at
    # N <= 4k an eager call's time is mostly this host path (python -m sparseattn.bench host)
    key = ("bwd_args", cfg, deterministic, DISPATCH, L2_SHARE, DYNAMIC_ORDER, L.forced_kind(), q.dtype, q.shape,
           k.shape, q.stride(), k.stride(), v.stride(), do.stride(), o.stride(), dk.stride(), dv.stride(),
           None if dq is None else dq.stride(), scale)
    build = lambda: _static_kwargs(q, k, v, do, o, dk, dv, dq, layout, scale, deterministic, cfg)  # noqa: E731
    st, per_call = (layout.plan(key, build), {}) if not layout.dynamic else \
        L.dynamic_plan(layout, key, build, _dynamic_tables(layout, cfg, B, Hq, Hkv))
    plan = st["plan"]  # for a dynamic layout, only its shape-only sizes are read here
    delta = torch.empty(B, Hq, Lq, device=q.device, dtype=torch.float32)  # rowsum(dO * O)
    L.launch(prefill_bwd.delta_kernel, st["delta_grid"], static=st["delta"], **per_call.get("delta", {}), O=o,
             DO=do, DELTA=delta, num_stages=1)
    if plan.n_ws:
        ws_k = torch.empty(B * Hkv, plan.n_ws, cfg.block_n, D, device=q.device, dtype=torch.float32)
        ws_v = torch.empty_like(ws_k)
    else:  # no column is split: the kernel never touches a workspace (two allocations fewer per call)
        ws_k = ws_v = _no_workspace(q.device)
    dq_acc = None if deterministic else torch.zeros(B, Hq, Lq, D, device=q.device, dtype=torch.float32)
    tensors = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta)
    tma = L.call_tma(st, q, k, v, do)
    split = None if not deterministic or cfg.dq_split is None else dq_split_launch(
        layout, cfg.dq_block_m, cfg.dq_split, B, Hq, D, q.device)
    if one_launch(cfg, deterministic):  # the dQ programs in the dK/dV pass's grid
        L.launch(prefill_bwd.bwd_kernel, st["fused_grid"], static=st["fused"], **per_call.get("fused", {}),
                 DK=dk, DV=dv, DQ=dq, WS_K=ws_k, WS_V=ws_v, **tensors,
                 **_descriptors(q, k, v, do, cfg.block_m, cfg.block_n, tma),
                 **_descriptors(q, k, v, do, cfg.dq_block_m, cfg.dq_block_n, tma, prefix="dq_desc_"),
                 num_stages=max(cfg.num_stages, cfg.dq_stages))
    else:
        # the atomic path's accumulator: a tensor descriptor when dQ is added by the copy engine (ATOMIC_DQ_TMA)
        acc = L.tensor_descriptors(D, dq=(dq_acc, cfg.block_m))["desc_dq"] \
            if dq_acc is not None and tma and ATOMIC_DQ_TMA and _bulk_reduce_runs() and L.tma_ok(dq_acc) else dq_acc
        L.launch(prefill_bwd.dkdv_kernel, st["dkdv_grid"], static=st["dkdv"], **per_call.get("dkdv", {}), DK=dk,
                 DV=dv, DQ_ACC=acc, WS_K=ws_k, WS_V=ws_v, **tensors,
                 **_descriptors(q, k, v, do, cfg.block_m, cfg.block_n, tma), num_stages=cfg.num_stages)
    if plan.reduce.shape[0]:  # fixed-order sum of the chunks of split columns (no host sync)
        L.launch(prefill_bwd.column_reduce_kernel, st["reduce_grid"], static=st["reduce"],
                 **per_call.get("reduce", {}), WS_K=ws_k, WS_V=ws_v, DK=dk, DV=dv, num_stages=1)
    if not deterministic:
        return (dq_acc * scale).to(q.dtype), dk, dv
    if one_launch(cfg, deterministic):
        return dq, dk, dv
    tasks = dict(TASKS=None, N_TASKS=None, WS_DQ=None, ws_cap=0) if split is None else dict(
        TASKS=split.plan.tasks, N_TASKS=split.plan.n_tasks, WS_DQ=split.ws, ws_cap=split.ws.shape[1])
    grid0 = math.ceil(Lq / cfg.dq_block_m) if split is None else split.plan.capacity
    L.launch(prefill_bwd.dq_kernel, (grid0, B * Hq), static=st["dq"], **per_call.get("dq", {}), **tasks, DQ=dq,
             **tensors, **_descriptors(q, k, v, do, cfg.dq_block_m, cfg.dq_block_n, tma), num_stages=cfg.dq_stages)
    if split is not None and split.plan.ws_capacity:  # no split row possible: every task wrote dQ itself
        block_d = min(D, 64)
        L.launch(prefill_bwd.dq_reduce_kernel, (split.plan.merge_capacity, B * Hq, D // block_d),
                 WS_DQ=split.ws, MERGE=split.plan.merge, N_MERGE=split.plan.n_merge, DQ=dq,
                 **L.strides("dq", dq, "m"), Hq=Hq, Lq=Lq, ws_cap=split.ws.shape[1], scale=scale,
                 HEAD_DIM=D, BLOCK_M=cfg.dq_block_m, BLOCK_D=block_d, num_warps=4, num_stages=1)
    return dq, dk, dv


#: The one-launch backward's dispatch order (:func:`dispatch_order`; same bits in every order): ``"cost"``
#: every program of every head sorted by its estimated cost, most expensive first (equal costs head by head);
#: ``"lead"`` the split-column chunks of every head first, item by item across the heads, then head by head;
#: ``"head"`` head by head (a 2-D grid, no order table); ``"group"`` (opt-in, for A/Bs far past the L2) "cost"
#: within groups of consecutive heads whose inputs fit :data:`L2_SHARE` of the L2 together, one group after
#: the other (measured worse than head by head at N = 2k, 1.14x Flex: the last group's longest programs start
#: last; at N = 16k, ``checks/bwd-dispatch-far-h200.json``, groups of half the L2 over "lead": two documents
#: 0.995, four 1.000, causal 0.996, window 2048 1.003, sinks + window 1.025, random tiles at 50% 1.021: no
#: gain); ``"auto"`` (default) "cost" when every head's Q, K, V
#: and dO fit in :data:`L2_SHARE` of the L2 cache together, or just past it (:data:`COST_ORDER_MAX_L2`) when a
#: static layout's programs are long and uneven (:func:`uneven_programs`), else "lead" when the dK/dV plan
#: splits columns, else "head". Measured on the H200 (checks/bwd-dispatch-cost-h200.json: CUDA graphs, H=16,
#: D=128, the median of three interleaved rounds; ours / FlexAttention, head | lead | cost): window 2048 at
#: N = 2k 1.04 | 1.04 | 0.85, 4k 1.01 | 1.02 | 0.99, 8k 1.01 | 1.02 | 1.03; causal 2k 1.03 | 1.04 | 0.85, 32k
#: 1.01 | 1.04 | 1.12; sinks 64 + window 1024 at 4k 1.02 | 0.83 | 0.83; eight documents at 4k 1.03 | 1.04 |
#: 1.11; window 1024 at 32k 1.01 | 1.03 | 1.04. Sorting across heads interleaves every head's programs, so a
#: head's tiles leave L2 between their readers once the heads' inputs exceed it; a 1-D grid through the table
#: also costs ~1.5% against the 2-D grid on long launches (a dependent load before each program's work).
DISPATCH = "auto"

#: Past the L2, "auto" still sorts a static layout's programs by cost while every head's inputs take at most
#: this many times the L2 and the programs are long and uneven (:func:`uneven_programs`). From the H200 A/Bs
#: (CUDA graphs, 16 heads, D = 128, medians of three rotated rounds; cost / lead, and the programs' coefficient
#: of variation and mean in :func:`program_costs` units): just past the L2 (N = 4k, 1.28x it;
#: ``checks/bwd-dispatch-l2-h200.json``, ``bwd-dispatch-cost-h200.json``) the cost order won on window 2048
#: (0.970; cv 0.48, mean 18), causal (0.969; 0.61, 23) and two documents (0.971; 0.57, 12.5), tied sinks +
#: window (0.995; 0.40) and window 1024 (1.005; 0.36), lost on random tiles at 20-50% (1.005-1.033; 0.31-0.36;
#: ``checks/bwd-dispatch-held-out-h200.json``) and on four and eight documents (1.024, 1.058; means 7 and 4).
#: At 1.92x the L2 (N = 6k) it lost on every layout measured, uneven or not: causal 1.019, two documents
#: 1.054, sinks + window 1.013, window 2048 1.003; further out more (two documents at 8k 1.084, causal at 32k
#: 1.083). The bound and the two thresholds below sit between those rows; every row's better order (or a tie
#: within 0.5%) is the one this rule picks. Chosen on all of them: no row is held out. (The rule before it, a
#: longest program of at least 0.2 of one SM's share, picked the cost order on random tiles at 4k and on
#: causal, two documents and sinks + window at 6k, where the held-out A/B measured it 0.4-8.8% slower than
#: "lead".)
COST_ORDER_MAX_L2 = 1.5
#: :func:`uneven_programs`: the least coefficient of variation (standard deviation / mean) of the programs'
#: estimated costs, and the least mean cost (short programs lose more to the interleaved heads' L2 misses than
#: the order saves)
COST_ORDER_MIN_CV = 0.45
COST_ORDER_MIN_MEAN = 10.0

#: The one-launch backward's order for a dynamic layout (:func:`sparseattn.routing.route`'s), whose lists change
#: at every call: ``"lead"`` (default; shape-only, built once per shape: split chunks first, then head by head)
#: or ``"cost"`` (every program sorted by this call's estimated cost, computed on the device at every call: a
#: dozen small launches and an argsort, no host sync, so a captured graph replays it with new lists). A
#: list-schedule simulation of a routed layout at N = 4k (16 heads, 132 SMs, this module's cost units) gave
#: "lead" a 9-22% longer launch than the cost order from top 2 to 16 of 32 key blocks; the device disagreed
#: (``checks/routed-bwd-host-h200.json``, 2026-12-02 10:33 UTC, N = 4k, from a CUDA graph, lead | cost): top
#: 2 0.221 | 0.310 ms, top 10 0.400 | 0.444, top 16 0.467 | 0.503 (the per-call ordering's launches cost
#: more than the order saves), and eager the host time per call doubled (482-502 | 1 109-1 406 us). Kept
#: for A/Bs; "lead" stays the default.
DYNAMIC_ORDER = "lead"

#: "auto" sorts by cost when the inputs of every head take at most this share of the L2 cache (H200, 50 MiB:
#: 16 heads of D = 128 up to N = 3k; the first A/B, checks/bwd-dispatch-cost-1-h200.json, measured the cost
#: order 7% ahead of head by head on window 2048 at N = 3k, 48 MiB of inputs)
L2_SHARE = 1.0

#: :func:`program_costs`' units: one query x key tile pair of the dQ pass costs 1; the same pair in the dK/dV
#: pass costs this much (four tile matmuls against three, and a slower rate: the H200 pass sweep,
#: checks/backward-pass-sweep-2-h200.json, timed the two passes of the tuned config at 1.57-1.81x on five
#: patterns); every program costs :data:`PROGRAM_COST` more for its prologue and epilogue (a guess of the
#: order of one tile, not a fit).
DKDV_TILE_COST = 1.7
PROGRAM_COST = 1.0


def program_costs(layout: BlockLayout, plan: ColumnWork, cfg: BwdConfig, B: int, Hq: int, Hkv: int,
                  lh_div: int) -> torch.Tensor:
    """float32 ``[B * Hkv, per_head]``: the estimated cost of each program of the one-launch backward's 2-D grid
    (``per_head`` = the dK/dV work items, then the dQ rows of the KV head's GQA group): listed tile pairs a
    program walks, weighted by :data:`DKDV_TILE_COST` for dK/dV items, plus :data:`PROGRAM_COST`. Per layout
    head, from the layout's lists and the transposed ones. A dynamic layout's lists change at every call: its
    costs are computed at every call, and only under :data:`DYNAMIC_ORDER` ``"cost"`` (else
    :func:`dispatch_order` orders it by shape)."""
    dev = layout.device
    group = Hq // Hkv
    hq = torch.arange(Hkv, device=dev)[:, None] * group + torch.arange(group, device=dev)  # [Hkv, group]
    lh = (hq // lh_div) % layout.H
    lb = torch.arange(B, device=dev) % layout.B
    t = layout.transposed_lists()
    col = (t.q_count + t.full_q_count)[lb][:, lh]  # [B, Hkv, group, nk] listed query tiles per key tile
    work = plan.work.long()
    sub = layout.block_k // cfg.block_n  # kernel key sub-tiles per layout key tile
    in_chunk = (col[..., work[:, 0] // sub] - work[:, 1] * plan.chunk).clamp(0, plan.chunk)  # [B, Hkv, g, items]
    dkdv = DKDV_TILE_COST * in_chunk.sum(2).float() / sub  # [B, Hkv, items]
    row = (layout.kv_count + layout.full_count)[lb][:, lh]  # [B, Hkv, group, nq] listed key tiles per query tile
    n_dq_m = math.ceil(layout.q_len / cfg.dq_block_m)
    qi = torch.arange(n_dq_m, device=dev) * cfg.dq_block_m // layout.block_q
    dq = row[..., qi].float() * (cfg.dq_block_m / layout.block_q)  # [B, Hkv, group, n_dq_m]
    return torch.cat([dkdv, dq.flatten(2)], 2).flatten(0, 1) + PROGRAM_COST


def dispatch_order(layout: BlockLayout, plan: ColumnWork, cfg: BwdConfig, B: int, Hq: int, Hkv: int,
                   lh_div: int, input_bytes: int) -> Optional[torch.Tensor]:
    """The one-launch backward's ``ORDER`` table (int32, program ``p`` of the 1-D grid runs ``bh * per_head +
    pid`` of the 2-D one), or None for head by head (:data:`DISPATCH`). Built once per layout plan, on the
    device. ``input_bytes``: every head's Q, K, V and dO together ("auto" sorts by cost when they fit L2, and
    up to :data:`COST_ORDER_MAX_L2` times it when :func:`uneven_programs` says so).

    Why an order: one program per work item, one 8-warp program per SM, and the GPU starts programs in grid
    order as SMs free up. Head by head, the last head's longest programs (a causal mask's last dQ rows, a
    sink column's chunks) start last and run alone at the end; at N = 2k-4k (8-30 programs per SM) that tail
    is a large share of the launch. Sorting programs by cost, most expensive first, is the classic
    longest-processing-time list schedule. A dynamic layout's costs are unknown when its plan is built; it
    gets the "lead" order, or under :data:`DYNAMIC_ORDER` ``"cost"`` a placeholder that every call replaces
    with its own order by cost, computed on the device."""
    n_items = plan.work.shape[0]
    per_head = n_items + (Hq // Hkv) * math.ceil(layout.q_len / cfg.dq_block_m)
    n_bh = B * Hkv
    if DISPATCH not in ("auto", "cost", "lead", "head", "group"):
        raise ValueError(f"ops.backward.DISPATCH must be 'auto', 'cost', 'lead', 'head' or 'group', got "
                         f"{DISPATCH!r}")
    if DYNAMIC_ORDER not in ("lead", "cost"):
        raise ValueError(f"ops.backward.DYNAMIC_ORDER must be 'lead' or 'cost', got {DYNAMIC_ORDER!r}")
    if layout.dynamic and _dynamic_by_cost():
        # a table of the right size; every call passes its own (:func:`_dynamic_tables`)
        return torch.arange(n_bh * per_head, device=layout.device, dtype=torch.int32)
    how = DISPATCH
    cost = None
    if how == "auto":
        l2 = L.l2_bytes(layout.device)
        how = "cost" if input_bytes <= L2_SHARE * l2 else "lead" if plan.n_ws else "head"
        if how != "cost" and not layout.dynamic and input_bytes <= COST_ORDER_MAX_L2 * l2:
            cost = program_costs(layout, plan, cfg, B, Hq, Hkv, lh_div).flatten()  # just past the L2: by cost
            if uneven_programs(cost):  # when the programs are long and uneven
                how = "cost"
    if how in ("cost", "group") and layout.dynamic:
        how = "lead"
    if how == "head":
        return None
    code = torch.arange(n_bh * per_head, device=layout.device)  # bh * per_head + pid: head by head
    if how == "lead":
        pid, bh = code % per_head, code // per_head
        n_lead = min(plan.n_ws, n_items)
        rank = torch.where(pid < n_lead, pid * n_bh + bh, code + n_lead * n_bh)
        return code[torch.argsort(rank)].to(torch.int32)
    if cost is None:
        cost = program_costs(layout, plan, cfg, B, Hq, Hkv, lh_div).flatten()
    by_cost = _by_cost(cost)
    if how == "group":  # heads whose inputs fit L2_SHARE of the L2 together, by cost within, group by group
        per_group = max(1, int(L2_SHARE * L.l2_bytes(layout.device) * n_bh // max(input_bytes, 1)))
        group = (by_cost // per_head) // per_group
        by_cost = by_cost[torch.argsort(group, stable=True)]
    return by_cost.to(torch.int32)


def _by_cost(cost: torch.Tensor) -> torch.Tensor:
    """Program ids (flat) most expensive first, equal costs in grid order: the longest-processing-time order."""
    return torch.argsort(cost.flatten(), descending=True, stable=True)


def _dynamic_by_cost() -> bool:
    """Whether a dynamic layout's one-launch backward takes each call's order by cost (:data:`DYNAMIC_ORDER`
    ``"cost"`` under a :data:`DISPATCH` that sorts by cost)."""
    return DYNAMIC_ORDER == "cost" and DISPATCH in ("auto", "cost")


def uneven_programs(cost: torch.Tensor) -> bool:
    """Whether programs of estimated ``cost`` (any shape) are long and uneven enough for the cost order to win
    just past the L2 (:data:`COST_ORDER_MIN_CV`, :data:`COST_ORDER_MIN_MEAN`). One host read of two numbers,
    once per launch plan."""
    mean, std = (float(x) for x in torch.stack([cost.mean(), cost.std(correction=0)]).tolist())
    return mean >= COST_ORDER_MIN_MEAN and std >= COST_ORDER_MIN_CV * mean


#: The atomic path's dQ accumulation when the pass loads through tensor descriptors: True, each tile's float32
#: dQ goes to the accumulator as one bulk reduce-add by the copy engine (a descriptor of the accumulator,
#: ``cp.reduce.async.bulk.tensor``, as FlashAttention-3 does); False, ``BM x D`` element atomics from the
#: program's threads. Compiled for sm90: the bulk variant spills 408 bytes a thread against 776 (64 x 128
#: tiles, 8 warps, 3 stages). Measured on the H200 (``book/data/bench/checks/atomic-dq-tma-h200.json``, CUDA
#: graphs, H=16, D=128, N=32k): 1-6% faster on all five patterns (causal 33.74 vs 34.18 ms, window 333 1.61 vs
#: 1.72), still 0.79-1.05x FlexAttention and slower than the deterministic backward on every one.
ATOMIC_DQ_TMA = True


def _bulk_reduce_runs() -> bool:
    """Whether a descriptor's ``atomic_add`` runs here: on a GPU (compiled), and in an interpreter that
    implements it (Triton 3.6's does not; the element atomics run there instead)."""
    if not _runtime.is_interpreter():
        return True
    from triton.runtime.interpreter import InterpreterBuilder
    return hasattr(InterpreterBuilder, "create_descriptor_reduce")


def one_launch(cfg: BwdConfig, deterministic: bool) -> bool:
    """Whether the deterministic backward runs its dK/dV and dQ programs in one launch (``bwd_kernel``): asked
    for (``overlap``), one program per dQ row (no ``dq_split``) and one warp count for both passes (each
    kind of program keeps its own loop pipeline depth)."""
    return deterministic and cfg.overlap and cfg.dq_split is None and cfg.dq_warps == cfg.num_warps


@functools.lru_cache(maxsize=None)
def _no_workspace(device: torch.device) -> torch.Tensor:
    return torch.empty(1, device=device, dtype=torch.float32)


def _dynamic_tables(layout: BlockLayout, cfg: BwdConfig, B: int, Hq: int, Hkv: int) -> dict:
    """The backward launch arguments a dynamic layout supplies per call (:func:`~._launch.dynamic_plan`): its
    tables, its transposed lists, the dK/dV work plan of this call's lists and, under
    :data:`DYNAMIC_ORDER` ``"cost"``, the one-launch pass's order by this call's costs (each computed only
    when the plan asks for it)."""
    t = layout.transposed_lists()
    work = dynamic_column_work(layout, cfg.block_n)
    tables = {**L.layout_tables(layout), "Q_COUNT": lambda: t.q_count, "Q_INDEX": lambda: t.q_index,
              "Q_SLOT": lambda: t.q_slot, "FULL_Q_COUNT": lambda: t.full_q_count,
              "FULL_Q_INDEX": lambda: t.full_q_index, "WORK": lambda: work.work, "REDUCE": lambda: work.reduce}
    if _dynamic_by_cost():
        lh_div = L.head_kwargs(layout, Hq, Hkv)["lh_div"]
        tables["ORDER"] = lambda: _by_cost(program_costs(layout, work, cfg, B, Hq, Hkv, lh_div)).to(torch.int32)
    return tables


def _descriptors(q, k, v, do, block_m: int, block_n: int, tma: bool, prefix: str = "desc_") -> dict:
    """One pass's tensor descriptors (``<prefix>q``, ...): Q and dO in ``block_m`` rows, K and V in ``block_n``
    rows (the pass's kernel tiles), or all None (the kernels' pointer path)."""
    if not tma:
        return {prefix + n: None for n in ("q", "k", "v", "do")}
    descs = L.tensor_descriptors(q.shape[-1], q=(q, block_m), k=(k, block_n), v=(v, block_n), do=(do, block_m))
    return {prefix + name[len("desc_"):]: d for name, d in descs.items()}


def _static_kwargs(q, k, v, do, o, dk, dv, dq, layout: BlockLayout, scale: float, deterministic: bool,
                   cfg: BwdConfig) -> dict:
    """The backward kernels' arguments that do not change between calls on the same layout, shapes, strides,
    config and scale, their grids, the dK/dV work plan, and whether the passes may load through tensor
    descriptors (``BwdConfig.tma``: None on a GPU of compute capability 9 or more, True also in the
    interpreter; each call still checks its tensors' alignment)."""
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    heads = L.head_kwargs(layout, Hq, Hkv)
    t = layout.transposed_lists()
    plan = column_work(layout, cfg.block_n, cfg.chunk, B * Hkv)
    common = dict(**L.strides("q", q, "m"), **L.strides("k", k, "n"), **L.strides("v", v, "n"),
                  **L.strides("do", do, "m"), **L.mask_kwargs(layout, B), Hq=Hq, group=heads["group"],
                  LB=layout.B, LH=layout.H, lh_div=heads["lh_div"], n_qtiles=layout.nq, W=layout.width,
                  Lq=Lq, Lk=Lk, q_offset=layout.q_offset, scale=scale, scale_log2=scale * LOG2E,
                  HEAD_DIM=D, BLOCK_Q=layout.block_q, BLOCK_K=layout.block_k)
    # the atomic path's float32 dQ accumulator is a contiguous [B, Hq, Lq, D] (no accumulator: strides 0)
    acc = (0, 0, 0) if deterministic else (Hq * Lq * D, Lq * D, D)
    dkdv = L.Static(**L.strides("dk", dk, "n"), **L.strides("dv", dv, "n"),
                    **{f"stride_dq{n}": acc[i] for i, n in enumerate("bhm")},
                    Q_COUNT=t.q_count, Q_INDEX=t.q_index, Q_SLOT=t.q_slot, FULL_Q_COUNT=t.full_q_count,
                    FULL_Q_INDEX=t.full_q_index, WORK=plan.work, Hkv=Hkv, n_ktiles=layout.nk,
                    WT=t.q_index.shape[-1], FWT=t.full_q_index.shape[-1], chunk=plan.chunk, n_ws=max(plan.n_ws, 1),
                    **common, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps)
    block_d = min(D, 64)
    reduce = L.Static(**L.strides("dk", dk, "n"), **L.strides("dv", dv, "n"), REDUCE=plan.reduce,
                      ws_cap=max(plan.n_ws, 1), Hkv=Hkv, Lk=Lk, HEAD_DIM=D, BLOCK_N=cfg.block_n, BLOCK_D=block_d,
                      num_warps=4)
    dq_kw = None if dq is None else L.Static(
        **L.strides("dq", dq, "m"), KV_COUNT=layout.kv_count, KV_INDEX=layout.kv_index,
        FULL_COUNT=layout.full_count, FULL_INDEX=layout.full_index, FW=layout.full_width, **common,
        BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, num_warps=cfg.dq_warps)
    fused, fused_grid = None, None
    if dq is not None and one_launch(cfg, deterministic):
        n_dq_m = math.ceil(Lq / cfg.dq_block_m)
        n_items = plan.work.shape[0]
        inputs = B * (2 * Hq * Lq + 2 * Hkv * Lk) * D * q.element_size()  # Q and dO, K and V
        order = dispatch_order(layout, plan, cfg, B, Hq, Hkv, heads["lh_div"], inputs)
        fused = L.Static({**dq_kw, **dkdv, **L.strides("dq", dq, "m"), "DQ_BLOCK_M": cfg.dq_block_m,
                          "DQ_BLOCK_N": cfg.dq_block_n, "n_items": n_items, "n_dq_m": n_dq_m, "ORDER": order,
                          "DKDV_STAGES": cfg.num_stages, "DQ_STAGES": cfg.dq_stages})
        per_head = n_items + heads["group"] * n_dq_m
        fused_grid = (per_head, B * Hkv) if order is None else (order.numel(),)
    delta_m = 64
    tma = L.plan_tma(cfg.tma, q.device, False, q, k, v, do)  # the interpreter keeps pointers unless asked
    return dict(plan=plan, tma=tma, small=L.too_small_for_tma("bwd", cfg.tma, layout, q), dkdv=dkdv,
                dkdv_grid=(plan.work.shape[0], B * Hkv), dq=dq_kw, fused=fused, fused_grid=fused_grid,
                reduce=reduce, reduce_grid=(plan.reduce.shape[0], B * Hkv, D // block_d),
                delta=L.Static(**{f"stride_o{n}": o.stride(i) for i, n in enumerate("bhm")},
                               **{f"stride_do{n}": do.stride(i) for i, n in enumerate("bhm")},
                               Hq=Hq, Lq=Lq, HEAD_DIM=D, BLOCK_M=delta_m, num_warps=4),
                delta_grid=(math.ceil(Lq / delta_m), B * Hq))
