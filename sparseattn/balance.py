"""Load balance: the forward's task planner (long rows split into chunks) and the load-balance report.

One program per query tile walks that tile's whole row, so with skewed rows (documents of very different
lengths, a sink column every row visits, routing rows that select many blocks) the launch ends with a few
long programs while most SMs idle: the *tail*. Splitting a row into chunks of at most ``chunk`` listed tiles
gives more, shorter *tasks*; each task writes a partial ``(o, lse)`` and a merge combines the partials of a
row in a fixed order (the law of :func:`sparseattn.reference.merge_states`). Rows no longer than the chunk
stay one task and write O directly.

:func:`plan` builds the task list **on the device without a host sync**: its capacity (tasks, workspace
slots, merge entries) comes from shapes only, the live counts are device tensors and the empty slots at the
end are skipped by the kernels, so one CUDA graph serves every layout of the same shapes.

The chunk size (``split="auto"``) follows FlashInfer's prefill scheduler (``PrefillBinarySearchKVChunkSize``
in ``include/flashinfer/attention/scheduler.cuh``): it binary-searches the smallest KV chunk whose task count
times the KV heads still fits ``max_grid_size`` (a few programs per SM), and splits only if that chunk is
shorter than the longest row. FlashInfer does this on the host from CPU copies of the lengths. Here the
same search runs on the device over the powers of two (the task count only falls as the chunk grows, so the
first candidate that fits is the binary search's answer), and a second rule bounds the tail; the chunk is
the smaller of the two:

* *fill*: the smallest chunk ``c`` with ``B*Hq * tasks(c) <= FILL_WAVES * SMs`` (the whole row when even
  whole rows exceed that) -- FlashInfer's rule: split while the grid would leave SMs idle;
* *tail*: the largest power of two ``c <= B*Hq * tiles per head / (parts * SMs)``: no task
  longer than ``1/parts`` of an SM's balanced share. Dealing tasks to the SM that frees first ends at most
  one task after the balanced time (Graham's list-scheduling bound). When one layout head serves every
  head (``B = H = 1``) the launch is longest first for each of them, the programs that finish last are
  short, and only a row longer than a whole share can set the time (``parts = TAIL_PARTS_LPT = 1``); when
  the heads' rows differ, one launch order cannot be longest first for all, and the bound is what is left
  (``parts = TAIL_PARTS = 8``);
* never below ``MIN_CHUNK`` tiles (a task pays a Q load, a partial write and a merge read: about one tile
  step at D = 128), and never so small that the split rows' tasks overflow the workspace: at most
  ``WS_BUDGET_BYTES`` of float32 partial states (a shape-only capacity; the chunk is raised until they fit).

A launch of many waves whose rows are all well under an SM's share keeps its whole rows (no split, no merge).

:func:`report` is the load-balance lab: the per-program work (tiles) of the plain grid and of the split plan
in dispatch order, their makespans over the SMs (:func:`makespan`), the balanced ideal and the tail share.
"""
from __future__ import annotations

import heapq
import json
import math
from dataclasses import asdict, dataclass
from typing import NamedTuple, Optional, Union

import numpy as np
import torch

from .layout import BlockLayout

__all__ = ["Plan", "plan", "capacity", "auto_chunk", "makespan", "BalanceReport", "report", "program_tiles",
           "MIN_CHUNK", "FILL_WAVES", "TAIL_PARTS", "TAIL_PARTS_LPT", "WS_BUDGET_BYTES", "H200_SMS"]

MIN_CHUNK = 8  #: shortest split chunk (listed tiles) the auto rule picks
FILL_WAVES = 2  #: the fill rule's target: tasks x heads <= FILL_WAVES x SMs (FlashInfer: blocks per SM x SMs)
TAIL_PARTS = 8  #: the tail rule when the layout's heads differ: no task over 1/TAIL_PARTS of an SM's share
TAIL_PARTS_LPT = 1  #: ... when one layout head serves all: the launch is longest first for every head
WS_BUDGET_BYTES = 512 * 2**20  #: the auto plan's float32 workspace, at most (unless the fill rule needs more)
H200_SMS = 132  #: the report's default SM count
_SIM_LIMIT = 2_000_000  # programs; above this the makespan uses its two-sided bound (mean and longest)


def makespan(units: np.ndarray, slots: int) -> float:
    """Finish time of the last program when programs (``units``, in dispatch order) are dealt to ``slots``
    identical SMs, each to the SM that frees first."""
    units = np.asarray(units)
    n = len(units)
    if n == 0:
        return 0.0
    if n <= slots:
        return float(units.max())
    if float(units.min()) == float(units.max()):
        return math.ceil(n / slots) * float(units[0])
    if n > _SIM_LIMIT:
        return float(units.sum() / slots + units.max() * (1 - 1 / slots))
    heap = units[:slots].astype(float).tolist()
    heapq.heapify(heap)
    replace = heapq.heapreplace
    for w in units[slots:].tolist():
        replace(heap, heap[0] + w)
    return float(max(heap))


# ---- the planner -------------------------------------------------------------------------------------------
class Plan(NamedTuple):
    """A forward task list of fixed capacity (device tensors; the ints are shape-only).

    ``tasks`` int32 ``[capacity, 4]``: (kernel query sub-tile, first slot, end slot, workspace slot), longest
    first; slots count the row's partial tiles then its full tiles (slot ``s >= kv_count`` is full tile
    ``s - kv_count``), so which list a slot reads is decided per head in the kernel. Workspace slot -1: the
    row is one task and writes O directly. Rows ``>= n_tasks[0]`` are empty slots the kernel skips.
    ``merge`` int32 ``[merge_capacity, 3]``: (sub-tile, first workspace slot, chunks) of each split sub-tile,
    in sub-tile order; rows ``>= n_merge[0]`` are skipped. ``chunk``: the chunk size used (0-d device int64).
    """
    tasks: torch.Tensor
    n_tasks: torch.Tensor
    merge: torch.Tensor
    n_merge: torch.Tensor
    chunk: torch.Tensor
    capacity: int
    ws_capacity: int
    merge_capacity: int


def _check_split(split) -> None:
    if split == "auto":
        return
    if isinstance(split, bool) or not isinstance(split, int) or split < 1:
        raise ValueError(f"split must be None, 'auto' or an int >= 1 (listed tiles per task), got {split!r}")


def _row_tiles(layout: BlockLayout, block_m: int) -> torch.Tensor:
    """Listed tiles of each kernel query sub-tile's row, the longest over the layout's B and H ([n_m], int64)."""
    return _head_row_tiles(layout, block_m).amax(dim=0)


def _head_row_tiles(layout: BlockLayout, block_m: int) -> torch.Tensor:
    """Listed tiles of each kernel query sub-tile's row per layout head ([LB * LH, n_m], int64)."""
    work = (layout.kv_count.long() + layout.full_count.long()).flatten(0, 1)  # [LB * LH, nq]
    n_m = math.ceil(layout.q_len / block_m)
    return work.repeat_interleave(layout.block_q // block_m, dim=1)[:, :n_m]


def _candidates(layout: BlockLayout) -> torch.Tensor:
    """Chunk candidates (int64, ascending, on the layout's device): powers of two from MIN_CHUNK up to the
    first one that holds any row whole. Made by a device op, not copied from the host (a CUDA graph may be
    capturing)."""
    longest = max(1, min(layout.width + layout.full_width, layout.nk))
    top = max(MIN_CHUNK, 1 << (longest - 1).bit_length())
    exps = torch.arange(MIN_CHUNK.bit_length() - 1, top.bit_length(), device=layout.device, dtype=torch.int64)
    return torch.bitwise_left_shift(torch.ones_like(exps), exps)


def capacity(layout: BlockLayout, block_m: int, split: Union[int, str], heads: int, sms: int,
             head_dim: int = 128):
    """``(tasks, workspace slots, merge entries)`` of the plan, from shapes only. ``heads``: the programs of one
    task (``B * Hq``). Workspace slots: the tasks of split rows (each writes a partial state per head). A fixed
    chunk may need every row split at it; ``"auto"`` gets at most ``WS_BUDGET_BYTES`` of workspace (but
    never fewer slots than the fill rule's tasks) and picks no chunk whose split tasks would not fit. Tasks:
    one per unsplit row plus the split rows' tasks."""
    _check_split(split)
    n_m = math.ceil(layout.q_len / block_m)
    longest = max(1, min(layout.width + layout.full_width, layout.nk))
    per_row = math.ceil(longest / (MIN_CHUNK if split == "auto" else split))
    most = n_m * per_row if per_row > 1 else 0  # every row split at the smallest chunk
    ws = most
    if split == "auto":
        budget = WS_BUDGET_BYTES // (heads * block_m * (head_dim + 1) * 4)
        ws = min(most, max(budget, math.ceil(FILL_WAVES * sms / heads)))
    return n_m + ws, ws, max(1, min(n_m, ws // 2))


def auto_chunk(layout: BlockLayout, block_m: int, heads: int, sms: int, ws_slots: int) -> torch.Tensor:
    """The ``"auto"`` chunk (0-d int64 on the layout's device), computed on the device: the smaller of the fill
    and tail rules' chunks (module docstring), raised to the smallest chunk whose split tasks fit
    ``ws_slots`` workspace slots."""
    lens = _row_tiles(layout, block_m)  # [n_m], the longest over the layout's heads: what a task covers
    cand = _candidates(layout)  # [C] ascending
    n_chunks = torch.clamp((lens[None, :] + cand[:, None] - 1) // cand[:, None], min=1)  # [C, n_m]
    tasks = n_chunks.sum(1)  # [C]
    split_tasks = torch.where(n_chunks > 1, n_chunks, 0).sum(1)  # [C]
    top = cand[-1]  # holds every row whole

    def first(ok):  # the smallest candidate that satisfies ok (the top one when none does); no indexing by a
        return torch.where(ok, cand, top).amin()  # device scalar, which would read it back to the host
    c_fill = first(heads * tasks <= FILL_WAVES * sms)
    # an SM's balanced share, from each layout head's own total (heads may differ; the task list follows
    # the longest, but the time follows the sum)
    total = _head_row_tiles(layout, block_m).sum(1).double().mean()
    parts = TAIL_PARTS if layout.B * layout.H > 1 else TAIL_PARTS_LPT
    share = heads * total / (parts * sms)
    c_tail = torch.where(cand <= torch.clamp(share, min=MIN_CHUNK), cand, cand[0]).amax()
    c_mem = first(split_tasks <= ws_slots)
    return torch.maximum(torch.minimum(c_fill, c_tail), c_mem)


def plan(layout: BlockLayout, block_m: int, split: Union[int, str], heads: int, sms: int,
         head_dim: int = 128) -> Plan:
    """The forward's task list for kernel query tiles of ``block_m`` rows (``heads`` = B * Hq programs per
    task, ``sms`` SMs). ``split``: listed tiles per task, or ``"auto"`` (module docstring). Built with device
    ops only (no host sync); cached per layout, rebuilt at every call for a dynamic layout."""
    _check_split(split)
    if not isinstance(block_m, int) or block_m < 1 or layout.block_q % block_m:
        raise ValueError(f"block_m must be a positive int dividing block_q={layout.block_q}, got {block_m!r}")

    def build() -> Plan:
        dev = layout.device
        cap, ws_cap, merge_cap = capacity(layout, block_m, split, heads, sms, head_dim)
        lens = _row_tiles(layout, block_m)  # [n_m]
        n_m = lens.numel()
        chunk = auto_chunk(layout, block_m, heads, sms, ws_cap) if split == "auto" else \
            torch.full((), split, device=dev, dtype=torch.int64)
        n_chunks = torch.clamp((lens + chunk - 1) // chunk, min=1)  # [n_m]: an empty row is one (empty) task
        ends = torch.cumsum(n_chunks, 0)
        t = torch.arange(cap, device=dev)
        m = torch.clamp(torch.searchsorted(ends, t, right=True), max=n_m - 1)  # each task's sub-tile
        c = t - (ends - n_chunks)[m]  # its chunk index
        valid = t < ends[-1]
        lo = c * chunk
        hi = torch.minimum(lo + chunk, lens[m])
        split_row = n_chunks > 1
        ws_first = torch.cumsum(torch.where(split_row, n_chunks, 0), 0) - torch.where(split_row, n_chunks, 0)
        ws = torch.where(split_row[m], ws_first[m] + c, -1)
        length = torch.where(valid, hi - lo, -1)  # empty slots last
        order = torch.argsort(length, descending=True, stable=True)
        keep = valid.long()  # empty slots: sub-tile 0, no slots, no workspace
        tasks = torch.stack([m * keep, lo * keep, torch.maximum(hi, lo) * keep, torch.where(valid, ws, -1)], 1)[order]
        n_tasks = torch.clamp(ends[-1:], max=cap)
        # merge entries: the split sub-tiles, compacted into a fixed buffer (one dump row for the others)
        pos = torch.where(split_row, torch.cumsum(split_row.long(), 0) - 1, merge_cap)
        entry = torch.stack([torch.arange(n_m, device=dev), ws_first, n_chunks], 1)
        merge = torch.zeros(merge_cap + 1, 3, dtype=torch.int64, device=dev)
        merge[torch.clamp(pos, max=merge_cap)] = entry
        n_merge = torch.clamp(split_row.long().sum().reshape(1), max=merge_cap)
        return Plan(tasks.to(torch.int32).contiguous(), n_tasks.to(torch.int32), merge[:merge_cap].to(torch.int32)
                    .contiguous(), n_merge.to(torch.int32), chunk, cap, ws_cap, merge_cap)
    if layout.dynamic:
        return build()
    return layout.plan(("balance_plan", block_m, split, heads, sms, head_dim), build)


# ---- the report --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class BalanceReport:
    """Per-program work (listed tiles, in dispatch order) of the plain grid and of the split plan, and what
    dealing them to ``sms`` SMs gives. Times are in tiles (one tile step of ``block_q x block_k``) plus
    ``program_overhead`` tiles per program; multiply by a per-tile time for milliseconds.

    ``ideal`` = total tiles / SMs (every SM busy to the end, no overhead); ``makespan_*`` the finish time of
    the last program (:func:`makespan`); ``tail_*`` = (makespan - ideal) / makespan, the share of the launch
    the average SM idles; ``hist_*``: tiles per program -> programs. ``capacity``/``ws_capacity``: the plan's
    shape-only task and workspace slots (per head); ``split_row_tasks``: the tasks that write a partial state
    to the workspace (per head), each read back once by the merge."""
    sms: int
    heads: int
    block_m: int
    split: Union[int, str]
    chunk: int
    total_tiles: int
    ideal: float
    programs_plain: int
    longest_plain: int
    makespan_plain: float
    tail_plain: float
    tasks_split: int
    merged_rows: int
    longest_split: int
    makespan_split: float
    tail_split: float
    capacity: int
    ws_capacity: int
    split_row_tasks: int
    hist_plain: dict
    hist_split: dict

    def to_json(self) -> dict:
        """A JSON-ready dict (histogram keys as strings)."""
        d = asdict(self)
        d["hist_plain"] = {str(k): v for k, v in self.hist_plain.items()}
        d["hist_split"] = {str(k): v for k, v in self.hist_split.items()}
        return json.loads(json.dumps(d))


def _per_head_tiles(layout: BlockLayout, block_m: int, B: int, Hq: int) -> np.ndarray:
    """Listed tiles of every (batch, query head, kernel sub-tile): ``[B * Hq, n_m]``."""
    cnt = (layout.kv_count.long() + layout.full_count.long()).cpu()  # [LB, LH, nq]
    n_m = math.ceil(layout.q_len / block_m)
    lb = torch.arange(B) % layout.B
    group = 1 if layout.H in (1, Hq) else Hq // layout.H
    lh = (torch.arange(Hq) // group) % layout.H
    per = cnt[lb][:, lh].repeat_interleave(layout.block_q // block_m, dim=2)[..., :n_m]  # [B, Hq, n_m]
    return per.reshape(B * Hq, n_m).numpy()


def program_tiles(layout: BlockLayout, B: int, Hq: int, block_m: int = 128, split: Union[int, str, None] = None,
                  sms: int = H200_SMS, head_dim: int = 128) -> np.ndarray:
    """Listed tiles of every program in dispatch order (heads outer, tasks inner, as the kernels launch):
    ``split=None`` the plain grid (one program per sub-tile, longest row first), else the plan's tasks (each
    task's slot range clipped to its head's row)."""
    per = _per_head_tiles(layout, block_m, B, Hq)  # [BH, n_m]
    if split is None:
        work = (layout.kv_count.long() + layout.full_count.long()).sum(dim=(0, 1)).cpu()
        order = torch.argsort(work.repeat_interleave(layout.block_q // block_m)[:per.shape[1]], descending=True,
                              stable=True).numpy()
        return per[:, order].reshape(-1)
    p = plan(layout.to("cpu"), block_m, split, B * Hq, sms, head_dim)
    n = int(p.n_tasks[0])
    t = p.tasks[:n].long().numpy()
    return np.clip(np.minimum(per[:, t[:, 0]], t[None, :, 2]) - t[None, :, 1], 0, None).reshape(-1)


def report(layout: BlockLayout, B: int = 1, Hq: Optional[int] = None, *, block_m: int = 128,
           split: Union[int, str] = "auto", sms: int = H200_SMS, program_overhead: float = 0.0,
           head_dim: int = 128) -> BalanceReport:
    """The load-balance lab for ``layout`` with ``B`` sequences of ``Hq`` query heads (default: the layout's
    H) on ``sms`` SMs, kernel query tiles of ``block_m`` rows: per-program work of the plain grid and of the
    ``split`` plan (``head_dim``: its workspace budget), makespans, the balanced ideal and the tail shares.
    Exact counts from the layout (runs on the CPU; no kernel is launched)."""
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    Hq = layout.H if Hq is None else Hq
    for name, v in (("B", B), ("Hq", Hq), ("sms", sms)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if layout.B not in (1, B) or layout.H not in (1, Hq) and Hq % layout.H:
        raise ValueError(f"layout (B={layout.B}, H={layout.H}) does not broadcast to B={B}, Hq={Hq}")
    if block_m < 16 or layout.block_q % block_m:
        raise ValueError(f"block_m must be >= 16 and divide block_q={layout.block_q}, got {block_m!r}")
    if not (isinstance(program_overhead, (int, float)) and program_overhead >= 0):
        raise ValueError(f"program_overhead must be a number >= 0 (tiles), got {program_overhead!r}")
    _check_split(split)
    plain = program_tiles(layout, B, Hq, block_m, None, sms)
    tasks = program_tiles(layout, B, Hq, block_m, split, sms, head_dim)
    p = plan(layout.to("cpu"), block_m, split, B * Hq, sms, head_dim)
    total = int(plain.sum())
    ideal = total / sms
    ms_plain = makespan(plain + program_overhead, sms)
    ms_split = makespan(tasks + program_overhead, sms)

    def hist(units):
        vals, counts = np.unique(units, return_counts=True)
        return {int(v): int(c) for v, c in zip(vals, counts)}

    def tail(ms):
        return 0.0 if ms == 0 else (ms - ideal) / ms
    return BalanceReport(sms=sms, heads=B * Hq, block_m=block_m, split=split, chunk=int(p.chunk),
                         total_tiles=total, ideal=ideal, programs_plain=len(plain),
                         longest_plain=int(plain.max()) if len(plain) else 0, makespan_plain=ms_plain,
                         tail_plain=tail(ms_plain), tasks_split=int(p.n_tasks[0]), merged_rows=int(p.n_merge[0]),
                         longest_split=int(tasks.max()) if len(tasks) else 0, makespan_split=ms_split,
                         tail_split=tail(ms_split), capacity=p.capacity, ws_capacity=p.ws_capacity,
                         split_row_tasks=int(p.merge[:int(p.n_merge[0]), 2].sum()), hist_plain=hist(plain),
                         hist_split=hist(tasks))
