"""Backward pass of block-sparse prefill attention: the dK/dV work plan (column chunks), Δ, and the keyword
launches of the dK/dV and dQ kernels (the dQ pass, when ``BwdConfig.dq_split`` asks, runs the task list of
:func:`sparseattn.balance.plan` and sums split rows' partials in a fixed order)."""
from __future__ import annotations

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
    split_subs: torch.Tensor  # key sub-tiles whose column was split
    slots: torch.Tensor  # [len(split_subs), max chunks]: their workspace slots, padded with n_ws (a zero slot)
    chunk: int  # listed query tiles per chunk
    split_rows: torch.Tensor  # key rows (< Lk) of the split sub-tiles, where their reduced dK/dV go
    split_pos: torch.Tensor  # each such row's position among the split sub-tiles' rows


def column_work(layout: BlockLayout, block_n: int, chunk: Optional[int] = None) -> ColumnWork:
    """The dK/dV work plan, cached per layout. A column is cut into chunks of at most ``chunk`` listed query
    tiles so that a column every row visits (a sink) does not become the tail of the launch (``None``: twice
    the mean column length, at least 8). Items are ordered longest first. Items of split columns get a
    workspace slot; their partial dK/dV are summed in a fixed order afterwards (deterministic).

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
        # reduction plan: for each split sub-tile, its workspace slots (padded with the zero slot n_ws)
        split_subs = torch.nonzero(per_sub > 1).flatten()
        cmax = int(per_sub.max()) if n_sub else 1
        slots = torch.full((split_subs.numel(), cmax), n_ws, dtype=torch.long, device=dev)
        if split_subs.numel():
            first = ws_slot[starts[split_subs]]  # slots of one sub-tile are consecutive
            ar = torch.arange(cmax, device=dev)
            valid = ar[None, :] < per_sub[split_subs][:, None]
            slots = torch.where(valid, first[:, None] + ar[None, :], slots)
        rows = (split_subs[:, None] * block_n + torch.arange(block_n, device=dev)[None, :]).flatten()
        split_pos = torch.nonzero(rows < layout.kv_len).flatten()
        return ColumnWork(work, n_ws, split_subs, slots, size, rows[split_pos], split_pos)
    return layout.plan(("column_work", block_n, chunk), build)


def dynamic_column_work(layout: BlockLayout, block_n: int) -> ColumnWork:
    """The dK/dV plan of a dynamic layout, built on the device without a host sync: one item per key sub-tile
    (no column splitting: how many chunks a column needs depends on its contents, which a captured graph
    cannot know), ordered by column length, longest first. The chunk is ``nq``, longer than any column."""
    dev = layout.device
    t = layout.transposed_lists()
    totals = (t.q_count + t.full_q_count).amax(dim=(0, 1))  # [nk]
    sub = layout.block_k // block_n
    n_sub = math.ceil(layout.kv_len / block_n)
    order = torch.argsort(totals.repeat_interleave(sub)[:n_sub], descending=True, stable=True)
    work = torch.stack([order, torch.zeros_like(order), torch.full_like(order, -1)], 1).to(torch.int32)
    none = torch.zeros(0, dtype=torch.long, device=dev)
    return ColumnWork(work.contiguous(), 0, none, torch.zeros(0, 1, dtype=torch.long, device=dev), layout.nq,
                      none, none)


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
    B, Hq, Lq, D = q.shape
    Hkv, Lk = k.shape[1], k.shape[2]
    q, k, v, do = (L.last_dim_contiguous(t) for t in (q, k, v, do))
    delta = (do.float() * o.float()).sum(-1).contiguous()  # [B, Hq, Lq]: rowsum(dO * O)
    masks = L.mask_kwargs(layout, B)
    heads = L.head_kwargs(layout, Hq, Hkv)
    t = layout.transposed_lists()
    plan = column_work(layout, cfg.block_n, cfg.chunk)
    dk = torch.empty_like(k)
    dv = torch.empty_like(v)
    ws_k = torch.empty(B * Hkv, max(plan.n_ws, 1), cfg.block_n, D, device=q.device, dtype=torch.float32)
    ws_v = torch.empty_like(ws_k)
    dq_acc = None if deterministic else torch.zeros(B, Hq, Lq, D, device=q.device, dtype=torch.float32)
    common = dict(Q=q, K=k, V=v, DO=do, LSE=lse, DELTA=delta, **L.strides("q", q, "m"), **L.strides("k", k, "n"),
                  **L.strides("v", v, "n"), **L.strides("do", do, "m"), **masks, Hq=Hq, group=heads["group"],
                  LB=layout.B, LH=layout.H, lh_div=heads["lh_div"], n_qtiles=layout.nq, W=layout.width,
                  Lq=Lq, Lk=Lk, q_offset=layout.q_offset, scale=scale, scale_log2=scale * LOG2E,
                  HEAD_DIM=D, BLOCK_Q=layout.block_q, BLOCK_K=layout.block_k)
    L.launch(prefill_bwd.dkdv_kernel, (plan.work.shape[0], B * Hkv),
             DK=dk, DV=dv, DQ_ACC=dq_acc, WS_K=ws_k, WS_V=ws_v, **L.strides("dk", dk, "n"),
             **L.strides("dv", dv, "n"), **L.strides("dq", dq_acc, "m"),
             Q_COUNT=t.q_count, Q_INDEX=t.q_index, Q_SLOT=t.q_slot, FULL_Q_COUNT=t.full_q_count,
             FULL_Q_INDEX=t.full_q_index, WORK=plan.work, Hkv=Hkv, n_ktiles=layout.nk, WT=t.q_index.shape[-1],
             FWT=t.full_q_index.shape[-1], chunk=plan.chunk, n_ws=max(plan.n_ws, 1), **common,
             BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    if plan.split_subs.numel():  # fixed-order sum of the chunks of split columns (no host sync)
        for ws, grad in ((ws_k, dk), (ws_v, dv)):
            padded = torch.cat([ws, ws.new_zeros(B * Hkv, 1, cfg.block_n, D)], 1)  # slot n_ws reads zeros
            summed = padded[:, plan.slots].sum(dim=2)  # [B*Hkv, n_split, BN, D], fixed order
            summed = summed.view(B, Hkv, -1, D)[:, :, plan.split_pos]
            grad[:, :, plan.split_rows] = summed.to(grad.dtype)
    if deterministic:
        dq = torch.empty_like(q)
        split = None if cfg.dq_split is None else dq_split_launch(layout, cfg.dq_block_m, cfg.dq_split, B, Hq, D,
                                                                   q.device)
        tasks = dict(TASKS=None, N_TASKS=None, WS_DQ=None, ws_cap=0) if split is None else dict(
            TASKS=split.plan.tasks, N_TASKS=split.plan.n_tasks, WS_DQ=split.ws, ws_cap=split.ws.shape[1])
        grid0 = math.ceil(Lq / cfg.dq_block_m) if split is None else split.plan.capacity
        L.launch(prefill_bwd.dq_kernel, (grid0, B * Hq), **tasks,
                 DQ=dq, **L.strides("dq", dq, "m"), KV_COUNT=layout.kv_count, KV_INDEX=layout.kv_index,
                 FULL_COUNT=layout.full_count, FULL_INDEX=layout.full_index, FW=layout.full_width, **common,
                 BLOCK_M=cfg.dq_block_m, BLOCK_N=cfg.dq_block_n, num_warps=cfg.num_warps,
                 num_stages=cfg.num_stages)
        if split is not None and split.plan.ws_capacity:  # no split row possible: every task wrote dQ itself
            block_d = min(D, 64)
            L.launch(prefill_bwd.dq_reduce_kernel, (split.plan.merge_capacity, B * Hq, D // block_d),
                     WS_DQ=split.ws, MERGE=split.plan.merge, N_MERGE=split.plan.n_merge, DQ=dq,
                     **L.strides("dq", dq, "m"), Hq=Hq, Lq=Lq, ws_cap=split.ws.shape[1], scale=scale,
                     HEAD_DIM=D, BLOCK_M=cfg.dq_block_m, BLOCK_D=block_d, num_warps=4, num_stages=1)
    else:
        dq = (dq_acc * scale).to(q.dtype)
    return dq, dk, dv
