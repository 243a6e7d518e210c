"""Load balance: the forward's task planner (long rows split into chunks) and the load-balance report.

One program per query tile walks that tile's whole row, so with skewed rows (documents of very different
lengths, a sink column every row visits, routing rows that select many blocks) the launch ends with a few
long programs while most SMs idle: the *tail*. Splitting a row into chunks of at most ``chunk`` listed tiles
gives more, shorter *tasks*; each task writes a partial ``(o, lse)`` and a merge combines the partials of a
row in a fixed order (the law of :func:`sparseattn.merge_states`). Rows no longer than the chunk
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

:class:`GraphBuckets` serves sequences of many lengths with a few CUDA graphs: one fixed-capacity layout
(contents replaced each step, shape fixed) and one captured step per *bucket* length; a layout is padded into
the smallest bucket that holds it (:meth:`~sparseattn.BlockLayout.copy_into`) and that bucket's graph is
replayed. :meth:`GraphBuckets.waste` says what the padding and the fixed capacity cost (tokens, table slots
and tasks allotted against those used).
"""
from __future__ import annotations

import heapq
import json
import math
from dataclasses import asdict, dataclass
from typing import Callable, Dict, NamedTuple, Optional, Sequence, Union

import numpy as np
import torch

from . import _runtime
from .layout import BlockLayout

__all__ = ["Plan", "plan", "capacity", "auto_chunk", "makespan", "BalanceReport", "report", "program_tiles",
           "GraphBuckets", "BucketWaste", "pow2_edges", "MIN_CHUNK", "FILL_WAVES", "TAIL_PARTS", "TAIL_PARTS_LPT", "WS_BUDGET_BYTES", "H200_SMS"]

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


# ---- CUDA-graph buckets ------------------------------------------------------------------------------------
def pow2_edges(max_len: int, min_len: int = 1024, block: int = 128) -> list:
    """Bucket lengths for :class:`GraphBuckets`: the powers of two from ``min_len`` (raised to ``block``) up to
    the first one that holds ``max_len``. Consecutive buckets differ by 2x, so a length pads by less than half
    its bucket (tokens wasted < 50%, about 25% on average for lengths spread evenly in log scale)."""
    for name, v in (("max_len", max_len), ("min_len", min_len), ("block", block)):
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")
    if block & (block - 1):
        raise ValueError(f"block must be a power of two (the layout's tile), got {block}")
    e = 1 << (max(min_len, block) - 1).bit_length()
    edges = [e]
    while edges[-1] < max_len:
        edges.append(edges[-1] * 2)
    return edges


@dataclass(frozen=True)
class BucketWaste:
    """What serving a layout of ``length`` tokens from the bucket of ``bucket`` tokens costs, per unit allotted
    against used: ``tokens`` (the bucket's length against the sequence's), ``rows`` (query tiles of the table,
    per layout head), ``slots`` (list entries of the table: ``rows x (width + full_width)`` over the buckets'
    B x H, against the tiles listed there) and, when a plan was asked for, ``tasks`` (the plan's shape-only
    capacity per head against its live tasks). ``*_waste`` = 1 - used / allotted."""
    length: int
    bucket: int
    tokens_waste: float
    rows_used: int
    rows_allotted: int
    rows_waste: float
    slots_used: int
    slots_allotted: int
    slots_waste: float
    tasks_used: Optional[int] = None
    tasks_allotted: Optional[int] = None
    tasks_waste: Optional[float] = None

    def to_json(self) -> dict:
        return asdict(self)


def _waste(used: int, allotted: int) -> float:
    return 0.0 if allotted == 0 else 1.0 - used / allotted


class GraphBuckets:
    """One captured CUDA graph per sequence-length bucket, for layouts that change at every step.

    A captured graph replays fixed grids on fixed buffers. :meth:`~sparseattn.BlockLayout.with_capacity` gives a table
    whose *contents* may change between replays (the kernels and :func:`plan` read only its live counts),
    but its *shape* (the sequence length, the widths) is frozen at capture. To serve every length up to the
    largest edge, this keeps one static layout, one set of static buffers and one captured ``step`` per edge
    in ``edges``, and serves a layout of ``L`` tokens from the **smallest edge >= L**:

    1. its lists are padded to that edge's table: query tiles past ``L`` list nothing (their outputs are
       zero, as for any empty row), rows keep their tiles, the widths are padded with unread slots; then
       copied in with :meth:`~sparseattn.BlockLayout.copy_into` (device copies, no host sync);
    2. the given inputs are copied into the first ``L`` positions of the bucket's buffers (sequence on
       dimension -2, as q/k/v ``[B, H, L, D]``) and the positions past ``L`` are zeroed;
    3. the bucket's graph is replayed (captured on its first use, after a warm-up call; on a CPU, or with
       ``capture=False``, ``step`` simply runs), and the buffers are returned cut to ``L`` positions.

    The padding is exact only when no tile straddles ``L``: a layout fits when ``q_len == kv_len == L`` and
    ``L`` is a multiple of both tile sizes (then the padded keys lie in tiles no row lists), its widths are
    at most the bucket's, and its partial tiles are masked by a mask_mod whose kernel predicate does not
    depend on the length (causal, bands, sinks: the same predicate as ``mask_mod`` here; a document mask
    holds a tensor of ids as long as the sequence, so it is refused) or it has no partial tiles
    (``mask_mod=None``: block masks of full tiles). Pad a sequence to a tile multiple before building its
    layout (e.g. with an extra document that attends only to itself).

    Args:
        edges: the bucket lengths, ascending, each a multiple of ``block_q`` and ``block_k``
            (:func:`pow2_edges` gives powers of two).
        step: ``step(layout, **buffers)``, the work to capture; it must read and write only the bucket's
            static layout and buffers (e.g. ``sparse_attention(q, k, v, layout, out=out)``) and make no host
            sync.
        buffers: ``buffers(length) -> dict[str, Tensor]``, a bucket's static tensors (inputs and outputs),
            each with the sequence on dimension -2.
        B: the layouts' batch dimension.
        H: the layouts' head dimension.
        block_q: the layouts' query tile (rows of a tile).
        block_k: the layouts' key tile (columns of a tile).
        width: each bucket's width of the partial-tile lists: an int, ``f(length) -> int``, or None for the
            bucket's number of key tiles (any row fits).
        full_width: the same for the full-tile lists.
        mask_mod: the mask_mod of the layouts' partial tiles (None: full tiles only).
        device: where the static tables live (default: CUDA when available).
        capture: capture CUDA graphs (default: when the device is CUDA).

    Raises ValueError naming the argument and the rule for bad arguments and for a layout that does not fit.
    """

    def __init__(self, edges: Sequence[int], step: Callable, buffers: Callable, *, B: int = 1, H: int = 1,
                 block_q: int = 128, block_k: int = 128, width=None, full_width=None, mask_mod=None, device=None,
                 capture: Optional[bool] = None):
        from ._checks import check_block, check_int
        from .predicates import kernel_predicate
        self.block_q, self.block_k = check_block("block_q", block_q), check_block("block_k", block_k)
        self.B, self.H = check_int("B", B), check_int("H", H)
        try:
            edges = [int(e) for e in edges]
        except TypeError:
            raise ValueError(f"edges must be a sequence of ints (bucket lengths), got {edges!r}") from None
        tile = max(self.block_q, self.block_k)
        if not edges or any(e < 1 or e % tile for e in edges) or any(a >= b for a, b in zip(edges, edges[1:])):
            raise ValueError(f"edges must be non-empty, strictly ascending and multiples of the tiles ({tile}), "
                             f"got {edges}")
        self.edges = tuple(edges)
        if not callable(step):
            raise TypeError(f"step must be callable as step(layout, **buffers), got {type(step).__name__}")
        if not callable(buffers):
            raise TypeError(f"buffers must be callable as buffers(length) -> dict, got {type(buffers).__name__}")
        for name, w in (("width", width), ("full_width", full_width)):
            if not (w is None or callable(w) or (isinstance(w, int) and not isinstance(w, bool) and w >= 1)):
                raise ValueError(f"{name} must be None, an int >= 1 or a function of the length, got {w!r}")
        if mask_mod is not None:
            pred = kernel_predicate(mask_mod)
            if pred is None or pred.doc_ids is not None:
                raise ValueError("mask_mod must have a kernel predicate that does not depend on the length "
                                 "(causal, bands, sinks) or be None; a document mask's ids have the sequence's "
                                 f"length; got {getattr(mask_mod, '__name__', mask_mod)!r}")
        self.step, self._make_buffers, self.mask_mod = step, buffers, mask_mod
        self._width, self._full_width = width, full_width
        from ._tiles import default_device
        self.device = default_device(device)
        self.capture = self.device.type == "cuda" if capture is None else bool(capture)
        if self.capture and self.device.type != "cuda":
            raise ValueError(f"capture=True needs a CUDA device, got {self.device}")
        self._static: Dict[int, BlockLayout] = {}
        self._buffers: Dict[int, dict] = {}
        self._graphs: dict = {}

    # ---- the buckets ----
    def bucket_for(self, length: int) -> int:
        """The smallest edge >= ``length``."""
        if isinstance(length, bool) or not isinstance(length, int) or length < 1:
            raise ValueError(f"length must be an int >= 1, got {length!r}")
        for e in self.edges:
            if e >= length:
                return e
        raise ValueError(f"length {length} exceeds the largest bucket ({self.edges[-1]}); add a larger edge")

    def _widths(self, edge: int):
        nk = math.ceil(edge / self.block_k)

        def get(w):
            w = nk if w is None else w(edge) if callable(w) else w
            if isinstance(w, bool) or not isinstance(w, int) or w < 1:
                raise ValueError(f"a width function must return an int >= 1, got {w!r} for length {edge}")
            return w
        return get(self._width), get(self._full_width)

    def static(self, edge: int) -> BlockLayout:
        """The bucket's fixed-capacity layout, whose lists each step overwrites (made on first use)."""
        if edge not in self.edges:
            raise ValueError(f"edge must be one of the buckets {self.edges}, got {edge!r}")
        if edge not in self._static:
            w, fw = self._widths(edge)
            self._static[edge] = BlockLayout.with_capacity(self.B, self.H, edge, edge, self.block_q, self.block_k,
                                                           width=w, full_width=fw, mask_mod=self.mask_mod,
                                                           device=self.device)
        return self._static[edge]

    def buffers(self, edge: int) -> dict:
        """The bucket's static buffers (made on first use), whole (``edge`` positions)."""
        if edge not in self._buffers:
            self.static(edge)  # checks the edge
            bufs = self._make_buffers(edge)
            if not isinstance(bufs, dict) or not all(isinstance(t, torch.Tensor) and t.dim() >= 2
                                                     and t.shape[-2] == edge for t in bufs.values()):
                raise ValueError(f"buffers({edge}) must return a dict of tensors with the sequence ({edge}) on "
                                 "dimension -2")
            self._buffers[edge] = bufs
        return self._buffers[edge]

    # ---- padding ----
    def pad(self, layout: BlockLayout) -> BlockLayout:
        """``layout``'s lists at the capacity of its bucket: a trusted dynamic layout of the bucket's length
        (device ops, no host sync), ready for ``copy_into``."""
        if not isinstance(layout, BlockLayout):
            raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
        L = layout.q_len
        if layout.kv_len != L:
            raise ValueError(f"layout must have q_len == kv_len to be bucketed by length, got {L} and "
                             f"{layout.kv_len}")
        if (layout.block_q, layout.block_k) != (self.block_q, self.block_k):
            raise ValueError(f"layout tiles ({layout.block_q}, {layout.block_k}) differ from the buckets' "
                             f"({self.block_q}, {self.block_k})")
        if layout.B not in (1, self.B) or layout.H not in (1, self.H):
            raise ValueError(f"layout (B={layout.B}, H={layout.H}) must equal the buckets' (B={self.B}, "
                             f"H={self.H}) or be 1 there (shared, then repeated)")
        if layout.tile_bits is not None or layout.row_slot is not None:
            raise ValueError("layout must mask its partial tiles with a mask_mod (tile_bits and member bits have "
                             "no padded form here)")
        if layout.q_offset != 0:
            raise ValueError(f"layout must have q_offset 0 (queries at the positions of the keys), got "
                             f"{layout.q_offset}")
        edge = self.bucket_for(L)
        if L != edge and (L % self.block_q or L % self.block_k):
            raise ValueError(f"layout length {L} must be a multiple of the tiles ({self.block_q}, "
                             f"{self.block_k}) to pad into the bucket of {edge}: a tile across the end would "
                             "read padded keys")
        static = self.static(edge)
        if layout.width > static.width or layout.full_width > static.full_width:
            raise ValueError(f"layout widths ({layout.width}, {layout.full_width}) exceed the bucket's capacity "
                             f"({static.width}, {static.full_width}); raise width/full_width")
        nq = layout.nq

        def grow(t, w):  # [LB, LH, nq(, w0)] -> [B, H, nq_edge(, w)], zeros past the layout's own
            out = torch.zeros(self.B, self.H, static.nq, *([w] if t.dim() == 4 else []), dtype=t.dtype,
                              device=self.device)
            if t.dim() == 4:
                out[:, :, :nq, : t.shape[-1]] = t
            else:
                out[:, :, :nq] = t
            return out
        src = layout.to(self.device)
        return BlockLayout.from_lists(grow(src.kv_count, 0), grow(src.kv_index, static.width),
                                      grow(src.full_count, 0), grow(src.full_index, static.full_width), q_len=edge,
                                      kv_len=edge, block_q=self.block_q, block_k=self.block_k,
                                      mask_mod=layout.mask_mod, trusted=True,
                                      transposed_width=static.transposed_lists().q_index.shape[-1])

    def load(self, layout: BlockLayout, **inputs) -> int:
        """Pad ``layout`` into its bucket's static layout and copy ``inputs`` (names of the bucket's buffers)
        into the buffers' first ``L`` positions, zeroing the rest; return the bucket's edge."""
        padded = self.pad(layout)
        edge = padded.q_len
        padded.copy_into(self.static(edge))
        bufs = self.buffers(edge)
        L = layout.q_len
        for name, t in inputs.items():
            if name not in bufs:
                raise ValueError(f"input {name!r} is not a buffer of the buckets ({sorted(bufs)})")
            buf = bufs[name]
            if not isinstance(t, torch.Tensor) or t.dim() != buf.dim() or t.shape[-2] != L or \
                    t.shape[:-2] != buf.shape[:-2] or t.shape[-1] != buf.shape[-1]:
                raise ValueError(f"input {name!r} must have the buffer's shape {tuple(buf.shape)} with {L} on "
                                 f"dimension -2, got {tuple(t.shape) if isinstance(t, torch.Tensor) else t!r}")
            buf[..., :L, :].copy_(t)
            buf[..., L:, :].zero_()
        return edge

    def replay(self, edge: int) -> None:
        """Run the bucket's step on its static layout and buffers: the captured graph (captured now if this is
        its first replay), or the step itself without capture."""
        layout, bufs = self.static(edge), self.buffers(edge)
        if not self.capture:
            self.step(layout, **bufs)
            return
        if edge not in self._graphs:
            self._graphs[edge] = _runtime.graph_step(lambda: self.step(layout, **bufs), warmup=1)
        self._graphs[edge].replay()

    def run(self, layout: BlockLayout, **inputs) -> dict:
        """:meth:`load`, :meth:`replay`; the bucket's buffers cut to the layout's ``L`` positions (views)."""
        edge = self.load(layout, **inputs)
        self.replay(edge)
        L = layout.q_len
        return {name: t[..., :L, :] for name, t in self.buffers(edge).items()}

    @property
    def captured(self) -> tuple:
        """The edges whose graph is captured."""
        return tuple(sorted(self._graphs))

    def waste(self, layout: BlockLayout, *, block_m: Optional[int] = None, split: Union[int, str, None] = None,
              heads: int = 1, sms: int = H200_SMS, head_dim: int = 128) -> BucketWaste:
        """What serving ``layout`` from its bucket costs (:class:`BucketWaste`); with ``block_m`` and ``split``
        also the split plan's tasks, planned on the padded table as the captured step plans them (``heads``
        = B x Hq programs per task). Reads counts back to the host: a report, not for the hot path."""
        padded = self.pad(layout)
        edge = padded.q_len
        used_rows = layout.nq
        listed = int(padded.kv_count.sum() + padded.full_count.sum())  # over the bucket's B x H
        slots = self.B * self.H * padded.nq * (padded.width + padded.full_width)
        tasks = {}
        if split is not None:
            if block_m is None:
                raise ValueError("block_m is needed with split (the plan's kernel query tile)")
            p = plan(padded, block_m, split, heads, sms, head_dim)
            n = int(p.n_tasks[0])
            tasks = dict(tasks_used=n, tasks_allotted=p.capacity, tasks_waste=_waste(n, p.capacity))
        return BucketWaste(length=layout.q_len, bucket=edge, tokens_waste=_waste(layout.q_len, edge),
                           rows_used=used_rows, rows_allotted=padded.nq, rows_waste=_waste(used_rows, padded.nq),
                           slots_used=listed, slots_allotted=slots, slots_waste=_waste(listed, slots), **tasks)
