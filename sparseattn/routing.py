"""Dynamic selection on the device.

``route`` is content routing for prefill and training: every query block picks the key blocks it attends
from pooled scores, and the result is a :class:`~sparseattn.layout.BlockLayout` built on the device with no
host synchronisation and fixed widths, so routing and attention can be captured in one CUDA graph. Three
launches, and a fourth when the backward first needs it (:mod:`sparseattn.kernels.route`,
:mod:`sparseattn.kernels.transpose`):

1. pool: the mean of every query block and every key block (and, for ``pool="bound"``, the element-wise
   min and max of every key block), reading Q and K once, whole blocks a load;
2. scores: pooled Q against pooled K, small GEMMs over a grid of query-block groups, key-column ranges and
   parts of the shared heads, the max over the query heads that share a selection (``share``), -inf for
   blocks a query block cannot see;
3. select: forced blocks (``sinks`` first blocks; for every query row, the ``local`` blocks ending at its
   own) plus the top-k of
   the rest (and/or the fewest whose softmax mass reaches ``threshold``); ties go to the lower block index;
   written ascending, split into tiles that cross the diagonal (partial, masked by ``causal``) and full tiles;
4. transpose: the column lists the backward pass walks (one fused launch), built by the layout on first use,
   so a forward-only step (inference, a forward captured alone) never launches it.

With ``RouteKernels.fused_select`` (:data:`FUSED`) steps 2 and 3 are one launch: each select program scores
its query blocks against every key block itself, so no score matrix goes through memory (up to
:data:`FUSED_MAX_NK` key blocks; past that, the two launches).

On the GPU every launch after the first of its kind skips Triton's argument binding
(:mod:`sparseattn._fast_launch`): routing runs every step, so its host time is paid every step.
:class:`RouteKernels` names these launch choices; :data:`FIRST` keeps the first version's for A/B timing.

``semantics="member"`` adds a fifth launch: each query row keeps the forced blocks and its own
``member_topk`` best of the block's other choices (scored per row against the pooled keys), as one byte per
(row, slot) that the kernels AND into the mask. The query block still loads every chosen tile; the rows
differ in what they use. :func:`sparseattn.reference.route_reference` is the eager specification.

``select_pages`` is Quest-style page selection for decoding: for every page the cache keeps the element-wise
min and max of its keys, so for a query q

    q . k  <=  sum_d max(q_d * min_d, q_d * max_d)     for every key k of the page,

an upper bound on the page's best score that costs ``2 D`` multiply-adds per page instead of ``page_size D``.
Pages are ranked by that bound (the max over the query heads of a GQA group, so the group shares one
selection), the forced first/last pages are added, and the top ``topk`` are returned ascending. Everything
stays on the device with fixed shapes, so a decode step with selection can be captured in a CUDA graph.
"""
from __future__ import annotations

import contextlib
from typing import NamedTuple, Optional

import torch

from . import patterns as P
from ._checks import RouteSpec, check_device, check_int, check_route, check_scale, seqs_tensor
from ._tiles import launch_kernel
from .layout import BlockLayout
from .paged import PagedKVCache, PageSelection, check_select_args

_TOPK_BLOCK = 8192  # pages of one row kept in registers by the top-k kernel

__all__ = ["page_bounds", "select_pages", "route", "select_blocks", "Selection", "block_scores", "selection_recall",
           "SelectionRecall", "RouteKernels", "FIRST", "CURRENT", "FUSED", "FUSED_MAX_NK", "route_kernels",
           "scores_grid", "fused_fits"]


def _pow2_at_least(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def page_bounds(q: torch.Tensor, cache: PagedKVCache, seqs=None) -> torch.Tensor:
    """Upper bound of ``scale``-free ``q . k`` per (row, KV head, logical page): float32 ``[B, Hkv, P_max]``,
    the max over the query heads of each GQA group; pages past a sequence's end get ``-inf``. One Triton
    launch that reads the per-page key bounds through the page table (:func:`sparseattn.reference.page_bounds_reference` is the
    eager spec)."""
    B = check_select_args(q, cache, 1, 0, 0)
    check_device(q, what="q (and the cache)")
    return _page_bounds(q, cache, seqs_tensor(seqs, B, q.device, cache.max_seqs))


def _page_bounds(q: torch.Tensor, cache: PagedKVCache, seqs_t: torch.Tensor) -> torch.Tensor:
    """:func:`page_bounds` on checked arguments (``select_pages`` has checked them already)."""
    B, Hq, D = q.shape
    Hkv, P_max = cache.num_kv_heads, cache.max_pages_per_seq
    from .kernels import select
    group = Hq // Hkv
    bound = torch.empty(B, Hkv, P_max, device=q.device, dtype=torch.float32)
    q = q if q.stride(-1) == 1 else q.contiguous()
    block_p = 64
    select.page_bound_kernel[(-(-P_max // block_p), B, Hkv)](
        Q=q, K_MIN=cache.k_min, K_MAX=cache.k_max, PAGE_TABLE=cache.page_table, SEQ_LENS=cache.seq_lens,
        SEQS=seqs_t, BOUND=bound, stride_qb=q.stride(0), stride_qh=q.stride(1), stride_mp=cache.k_min.stride(0),
        stride_mh=cache.k_min.stride(1), stride_pt=cache.page_table.stride(0), Hkv=Hkv, group=group, P_max=P_max,
        HEAD_DIM=D, PAGE_SIZE=cache.page_size, BLOCK_G=max(16, _pow2_at_least(group)), BLOCK_P=block_p,
        num_warps=4)
    return bound


def select_pages(q: torch.Tensor, cache: PagedKVCache, topk: int, seqs=None, always_first: int = 1,
                 always_last: int = 1) -> PageSelection:
    """The ``topk`` pages of highest bound per (row, KV head), always including the first ``always_first``
    and last ``always_last`` pages of each sequence (they count towards ``topk``; with ``topk`` below their
    number the lowest-numbered forced pages are kept), clamped to the sequence's page count; ties go to the
    lower page. Capacity (the selection's P) is ``min(topk, max_pages_per_seq)``, fixed by shapes. Two
    Triton launches, no host synchronisation (:func:`sparseattn.reference.select_pages_reference` is the eager spec)."""
    B = check_select_args(q, cache, topk, always_first, always_last)
    check_device(q, what="q (and the cache)")
    seqs_t = seqs_tensor(seqs, B, q.device, cache.max_seqs)
    capacity = min(topk, cache.max_pages_per_seq)
    bound = _page_bounds(q, cache, seqs_t)  # [B, Hkv, P_max]
    from .kernels import select
    Hkv, P_max = cache.num_kv_heads, cache.max_pages_per_seq
    index = torch.zeros(B, Hkv, capacity, device=q.device, dtype=torch.int32)
    count = torch.empty(B, Hkv, device=q.device, dtype=torch.int32)
    block_p = min(_TOPK_BLOCK, max(16, _pow2_at_least(P_max)))
    select.topk_pages_kernel[(B, Hkv)](
        BOUND=bound, SEQ_LENS=cache.seq_lens, SEQS=seqs_t, INDEX=index, COUNT=count, Hkv=Hkv, P_max=P_max,
        capacity=capacity, always_first=always_first, always_last=always_last, PAGE_SIZE=cache.page_size,
        BLOCK_P=block_p, num_warps=8 if block_p >= 4096 else 4)
    return PageSelection(index, count, trusted=True)


# ---------------------------------------------------------------------------------------------------------
# content routing for prefill and training
# ---------------------------------------------------------------------------------------------------------
class RouteKernels(NamedTuple):
    """How :func:`route` launches its kernels (never what they compute: every choice gives the same
    selection, up to the rounding order of the pooled sums). :data:`CURRENT` is what ``route`` uses;
    :data:`FIRST` is the first version's launches, kept so that one benchmark run can time both in the same
    process (:func:`route_kernels`); :data:`FUSED` is CURRENT with scores and select in one launch."""
    pool_sub: Optional[int]  # rows a pool load reads ([SUB, D]); None: the whole block in one load
    pool_blocks: int  # consecutive blocks a pool program reads (independent loads in flight)
    pool_row_acc: bool  # accumulate [SUB, D] element-wise and reduce once (else reduce every load)
    pool_warps: int
    scores_split: bool  # scores: key-column ranges and parts of the shared heads on the grid, hidden chunks skipped
    select_zero_pad: bool  # the select kernel zeroes the lists' padding (else two zero-filled buffers)
    fast_launch: bool  # on the GPU, launches skip Triton's argument binding after the first (sparseattn._fast_launch)
    index_checked: bool  # the index does not re-check route's own lists (BlockLayout._dynamic)
    # scores and select in one launch (kernels.route.fused_select_kernel: no score matrix in memory) where the
    # key blocks fit one program's registers (nk <= FUSED_MAX_NK); else the two launches
    fused_select: bool = False
    # pool: the pool_blocks blocks of a program (or task) as one [blocks, SUB, D] load and one reduction
    # (pool_blocks a power of two); else one block after the other
    pool_joint: bool = False
    # pool: a persistent grid of this many programs per SM, each walking tasks of pool_blocks blocks in a
    # loop; 0: one program per pool_blocks blocks and head (the grid of the first versions)
    pool_persistent: int = 0
    # pool, persistent: software-pipelining depth of the task loop (tl.range num_stages; 1: none); Triton 3.6
    # pipelines the descriptor loads of pool_tma, not pointer loads that feed no dot (compiled for sm90)
    pool_stages: int = 1
    # pool: rows through tensor descriptors (TMA) where the GPU has them (sm90+; the interpreter) and the
    # tensors allow (16-byte aligned, unit last stride), else plain loads; not with pool_joint
    pool_tma: bool = False
    # pool, persistent, one whole block a task, plain loads: the next task's rows requested before this
    # task's reduction (a register double buffer: two blocks in flight per program)
    pool_prefetch: bool = False


#: the first version: one 128-row block a program in four dependent [32, D] loads (4 warps), a scores program
#: per 16 query blocks looping over every key block and shared head, zero-filled list buffers
FIRST = RouteKernels(pool_sub=32, pool_blocks=1, pool_row_acc=False, pool_warps=4, scores_split=False,
                     select_zero_pad=False, fast_launch=False, index_checked=False)
#: what ``route`` launches (see the bench's A/B rows in ``routing-<gpu>.json`` for the measured choice; the
#: pool's 4 warps: its recorded pool_choices, H200 2026-12-01, 0.088 ms vs 0.102 ms at 8 warps)
CURRENT = RouteKernels(pool_sub=None, pool_blocks=2, pool_row_acc=False, pool_warps=4, scores_split=True,
                       select_zero_pad=True, fast_launch=True, index_checked=True)
#: CURRENT with the scores computed inside the select kernel (one launch fewer, no score matrix); not the
#: default until the GPU has timed it against CURRENT (the bench's ``ms_fused_kernels``)
FUSED = CURRENT._replace(fused_select=True)
#: the most key blocks the fused select takes (a program scores and ranks [16, 512] in registers; ptxas spills
#: a few hundred bytes there at D = 128); past it, FUSED launches the scores kernel and the select kernel
FUSED_MAX_NK = 512
_KERNELS = [CURRENT]  # the choice in force (a one-element list: route_kernels swaps it)
SCORES_MIN_PROGRAMS = 512  # about four programs per SM on a 132-SM GPU: split the scores grid up to this


@contextlib.contextmanager
def route_kernels(kernels: RouteKernels):
    """Within the block, :func:`route` and :func:`select_blocks` launch their kernels as ``kernels`` says (an
    A/B switch for benchmarks and tests: ``with route_kernels(FIRST): ...`` times the first version)."""
    if not isinstance(kernels, RouteKernels):
        raise TypeError(f"kernels must be a RouteKernels, got {type(kernels).__name__}")
    before = _KERNELS[0]
    _KERNELS[0] = kernels
    try:
        yield kernels
    finally:
        _KERNELS[0] = before


#: SMs the persistent pool grid assumes off the GPU (the interpreter has none): a few programs, so that each
#: walks several tasks and the task striding is exercised
POOL_CPU_SMS = 2


def _pool_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return POOL_CPU_SMS


def check_pool_kernels(kn: RouteKernels) -> None:
    """The pool fields of ``kn`` that only some values make sense for: ValueError naming the field."""
    if kn.pool_blocks < 1:
        raise ValueError(f"RouteKernels.pool_blocks must be >= 1, got {kn.pool_blocks}")
    if kn.pool_joint and kn.pool_blocks & (kn.pool_blocks - 1):
        raise ValueError(f"RouteKernels.pool_blocks must be a power of two with pool_joint (one [blocks, SUB, D] "
                         f"load), got {kn.pool_blocks}")
    if kn.pool_sub is not None and (kn.pool_sub < 1 or kn.pool_sub & (kn.pool_sub - 1)):
        raise ValueError(f"RouteKernels.pool_sub must be None or a power of two, got {kn.pool_sub}")
    if kn.pool_persistent < 0:
        raise ValueError(f"RouteKernels.pool_persistent must be >= 0 (0: no persistent grid), got {kn.pool_persistent}")
    if kn.pool_stages < 1:
        raise ValueError(f"RouteKernels.pool_stages must be >= 1, got {kn.pool_stages}")
    if kn.pool_tma and kn.pool_joint:
        raise ValueError("RouteKernels.pool_tma applies to one block a load: it cannot be combined with pool_joint")
    if kn.pool_prefetch and (not kn.pool_persistent or kn.pool_blocks != 1 or kn.pool_sub is not None
                             or kn.pool_joint or kn.pool_tma or kn.pool_row_acc):
        raise ValueError("RouteKernels.pool_prefetch needs pool_persistent > 0 and one whole block a task with plain "
                         "loads (pool_blocks=1, pool_sub=None, no pool_joint, pool_tma or pool_row_acc)")


def _pool_descriptors(q: torch.Tensor, k: torch.Tensor, sub: int, D: int, kn: RouteKernels):
    """``(desc_q, desc_k)``: tensor descriptors loading ``[sub, D]`` rows of one head, or ``(None, None)``
    (plain loads) unless ``kn.pool_tma`` and the GPU (sm90+; the interpreter) and the tensors allow them."""
    from . import _runtime
    from ._tiles import tma_ok
    if not kn.pool_tma or D & (D - 1) or D > 256 or sub > 256 or D * q.element_size() < 16:
        return None, None
    if not _runtime.is_interpreter() and (q.device.type != "cuda" or torch.cuda.get_device_capability(q.device)[0] < 9):
        return None, None
    if not tma_ok(q, k):
        return None, None
    from triton.tools.tensor_descriptor import TensorDescriptor
    block = [1, 1, sub, D]
    return (TensorDescriptor(q, list(q.shape), list(q.stride()), block),
            TensorDescriptor(k, list(k.shape), list(k.stride()), block))


def _pool(q: torch.Tensor, k: torch.Tensor, spec: RouteSpec, kernels: Optional[RouteKernels] = None):
    """Pooled blocks, float32: ``q_mean [B,Hq,nq,D]``, ``k_mean [B,Hkv,nk,D]`` and, for ``pool="bound"``,
    ``k_min``/``k_max`` (else None). One launch over Q and K together: programs ``0 .. B*Hq-1`` of grid
    axis 1 pool query blocks, the rest key blocks; each reads ``pool_blocks`` whole blocks. With
    ``pool_persistent`` the grid is that many programs per SM (at most one per task), each walking the
    tasks of Q and then of K."""
    from .kernels import route as K
    kn = _KERNELS[0] if kernels is None else kernels
    check_pool_kernels(kn)
    B, D = spec.B, spec.D
    f32 = dict(device=q.device, dtype=torch.float32)
    q_mean = torch.empty(B, spec.Hq, spec.nq, D, **f32)
    k_mean = torch.empty(B, spec.Hkv, spec.nk, D, **f32)
    k_min = k_max = None
    if spec.pool == "bound":
        k_min, k_max = torch.empty_like(k_mean), torch.empty_like(k_mean)
    smallest = min(spec.block_q, spec.block_k)
    sub = smallest if kn.pool_sub is None else min(kn.pool_sub, smallest)
    desc_q, desc_k = _pool_descriptors(q, k, sub, D, kn)
    if kn.pool_persistent:
        tasks = B * (spec.Hq * -(-spec.nq // kn.pool_blocks) + spec.Hkv * -(-spec.nk // kn.pool_blocks))
        grid = (max(1, min(tasks, _pool_sms(q.device) * kn.pool_persistent)),)
    else:
        grid = (-(-max(spec.nq, spec.nk) // kn.pool_blocks), B * (spec.Hq + spec.Hkv))
    extra = dict(num_stages=kn.pool_stages) if kn.pool_persistent else {}  # else Triton's default, as before
    launch_kernel(K.pool_kernel, grid, dict(
        Q=q, K=k, desc_q=desc_q, desc_k=desc_k, Q_MEAN=q_mean, K_MEAN=k_mean, K_MIN=k_min, K_MAX=k_max,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qm=q.stride(2),
        stride_kb=k.stride(0), stride_kh=k.stride(1), stride_kn=k.stride(2),
        Hq=spec.Hq, Hkv=spec.Hkv, Lq=spec.Lq, Lk=spec.Lk, nq=spec.nq, nk=spec.nk, BQ_PROGRAMS=B * spec.Hq,
        BK_PROGRAMS=B * spec.Hkv, HEAD_DIM=D, BLOCK_Q=spec.block_q, BLOCK_K=spec.block_k, SUB=sub,
        BLOCKS=kn.pool_blocks, ROW_ACC=kn.pool_row_acc, JOINT=kn.pool_joint, PERSISTENT=kn.pool_persistent > 0,
        STAGES=kn.pool_stages, PREFETCH=kn.pool_prefetch, num_warps=kn.pool_warps, **extra), kn.fast_launch)
    return q_mean, k_mean, k_min, k_max


def scores_grid(spec: RouteSpec, split: bool, block_r: int = 16, min_programs: int = SCORES_MIN_PROGRAMS):
    """``(block_c, cols_per_program, n_parts)`` of the scores launch. Unsplit (the first version): one
    program per ``block_r`` query blocks, looping over every key block and shared head. Split: one 64-block
    column range a program, and the shared heads divided into ``n_parts`` parts (doubled while the grid has
    fewer than ``min_programs`` programs), so that ``share="all"`` (16 heads on one selection) is not 16
    programs on a 132-SM GPU each running a chain of 64 small GEMMs."""
    block_c = 64
    if not split:
        return block_c, max(1, spec.nk), 1
    base = -(-spec.nq // block_r) * -(-spec.nk // block_c) * spec.B * spec.LH
    parts = 1
    while parts < spec.n_shared and base * parts < min_programs:
        parts *= 2
    parts = min(parts, spec.n_shared)
    return block_c, block_c, -(-spec.n_shared // -(-spec.n_shared // parts))  # no empty part


def _score_parts(pooled, spec: RouteSpec, kernels: Optional[RouteKernels] = None) -> torch.Tensor:
    """Block scores float32 ``[n_parts, B, LH, nq, nk]`` (scaled; -inf where a query block cannot see a key
    block): each part the max over its share of the heads on one selection; the selection is their max."""
    from .kernels import route as K
    kn = _KERNELS[0] if kernels is None else kernels
    q_mean, k_mean, k_min, k_max = pooled
    block_r = 16  # query blocks a program: the smallest tl.dot M
    block_c, cols, parts = scores_grid(spec, kn.scores_split, block_r)
    heads_per_part = -(-spec.n_shared // parts)
    s = torch.empty(parts, spec.B, spec.LH, spec.nq, spec.nk, device=q_mean.device, dtype=torch.float32)
    launch_kernel(K.block_scores_kernel, (-(-spec.nq // block_r), -(-spec.nk // cols) * parts, spec.B * spec.LH), dict(
        Q_MEAN=q_mean, K_MEAN=k_mean, K_MIN=k_min, K_MAX=k_max, S=s,
        Hq=spec.Hq, Hkv=spec.Hkv, group=spec.group, LH=spec.LH, n_shared=spec.n_shared, nq=spec.nq, nk=spec.nk,
        Lq=spec.Lq, Lk=spec.Lk, q_offset=spec.q_offset, scale=spec.scale, cols_per_program=cols,
        heads_per_part=heads_per_part, part_stride=s[0].numel(),
        HEAD_DIM=spec.D, BLOCK_Q=spec.block_q, BLOCK_K=spec.block_k, BLOCK_R=block_r, BLOCK_C=block_c,
        CAUSAL=spec.causal, SKIP_HIDDEN=kn.scores_split, num_warps=4), kn.fast_launch)
    return s


def _scores(pooled, spec: RouteSpec, kernels: Optional[RouteKernels] = None) -> torch.Tensor:
    """Block scores float32 ``[B, LH, nq, nk]`` (scaled; -inf where a query block cannot see a key block)."""
    s = _score_parts(pooled, spec, kernels)
    return s[0] if s.shape[0] == 1 else s.amax(0)


def _select_lists(spec: RouteSpec, block_nk: int, kn: RouteKernels, device):
    """The select launch's outputs ``(kv_count, kv_index, full_count, full_index)`` (int32, widths
    ``spec.width`` / ``spec.full_width``) and whether the kernel writes the lists' zero padding itself."""
    from ._tiles import INDEX_DTYPE
    B, LH, nq = spec.B, spec.LH, spec.nq
    i32 = dict(device=device, dtype=INDEX_DTYPE)
    kv_count, full_count = torch.empty(B, LH, nq, **i32), torch.empty(B, LH, nq, **i32)
    # padding is never read; zeros keep the tables printable and comparable: written by the kernel itself
    # (widths never exceed nk <= BLOCK_NK), or by two fills in the first version
    zero_pad = kn.select_zero_pad and max(spec.width, spec.full_width) <= block_nk
    alloc = torch.empty if zero_pad else torch.zeros
    kv_index = alloc(B, LH, nq, spec.width, **i32)
    full_index = alloc(B, LH, nq, spec.full_width, **i32)
    return (kv_count, kv_index, full_count, full_index), zero_pad


def _select_args(spec: RouteSpec, lists, block_nk: int, zero_pad: bool) -> dict:
    """The launch arguments both select kernels share: outputs, sizes, the selection rule."""
    kv_count, kv_index, full_count, full_index = lists
    return dict(KV_COUNT=kv_count, KV_INDEX=kv_index, FULL_COUNT=full_count, FULL_INDEX=full_index,
                nq=spec.nq, nk=spec.nk, Lq=spec.Lq, Lk=spec.Lk, q_offset=spec.q_offset, topk=spec.topk,
                capacity=spec.capacity, local=spec.local, sinks=spec.sinks, threshold=spec.threshold,
                W=spec.width, FW=spec.full_width, BLOCK_Q=spec.block_q, BLOCK_K=spec.block_k, BLOCK_NK=block_nk,
                CAUSAL=spec.causal, MEMBER=spec.semantics == "member", ZERO_PAD=zero_pad)


def _block_nk(spec: RouteSpec) -> int:
    return max(16, 1 << (spec.nk - 1).bit_length())


def _select(s: torch.Tensor, spec: RouteSpec, kernels: Optional[RouteKernels] = None):
    """The chosen blocks of every query block as lists ``(kv_count, kv_index, full_count, full_index)`` of
    widths ``spec.width`` / ``spec.full_width``, from scores ``[B, LH, nq, nk]`` or their head parts
    ``[n_parts, B, LH, nq, nk]`` (the max over the parts is taken on load). One launch."""
    from .kernels import BACKEND
    from .kernels import route as K
    kn = _KERNELS[0] if kernels is None else kernels
    if s.dim() == 4:
        s = s.unsqueeze(0)
    nq = spec.nq
    block_nk = _block_nk(spec)
    lists, zero_pad = _select_lists(spec, block_nk, kn, s.device)
    # a GPU program takes one query block (a row of scores in registers); the interpreter takes many, since
    # it pays per operation, not per element
    rows = 1 if BACKEND != "interpreter" else min(1 << (nq - 1).bit_length(), max(1, (1 << 14) // block_nk))
    launch_kernel(K.select_kernel, (-(-nq // rows), spec.B * spec.LH), dict(
        S=s, n_parts=s.shape[0], part_stride=s[0].numel(), ROWS=rows, **_select_args(spec, lists, block_nk, zero_pad),
        # the 33 bisection steps each reduce the row: one warp keeps those reductions in shuffles up to 256 blocks
        num_warps=1 if block_nk <= 256 else 2 if block_nk <= 1024 else 4 if block_nk <= 4096 else 8), kn.fast_launch)
    return lists


def fused_fits(spec: RouteSpec, kernels: Optional[RouteKernels] = None) -> bool:
    """Whether :func:`route` takes the fused scores + select launch for ``spec``: asked for
    (``fused_select``) and at most :data:`FUSED_MAX_NK` key blocks (a program holds ``[16, BLOCK_NK]`` scores,
    keys and bisection state in registers). Member semantics fit too: the member bits need the lists and the
    pooled keys, not the score matrix."""
    kn = _KERNELS[0] if kernels is None else kernels
    return kn.fused_select and _block_nk(spec) <= FUSED_MAX_NK


def _fused_select(pooled, spec: RouteSpec, kernels: Optional[RouteKernels] = None):
    """``_select(_score_parts(pooled, spec), spec)`` in one launch (``fused_select_kernel``): each program
    scores its query blocks against every key block over every shared head and selects from the scores in
    registers. The same lists, bit for bit: the scores come from the same ``_score_tile`` code (max over heads
    is exact in any grouping), the selection from the same ``_select_rows``."""
    from .kernels import BACKEND
    from .kernels import route as K
    kn = _KERNELS[0] if kernels is None else kernels
    q_mean, k_mean, k_min, k_max = pooled
    nq = spec.nq
    block_nk = _block_nk(spec)
    lists, zero_pad = _select_lists(spec, block_nk, kn, q_mean.device)
    # 16 query blocks a program: the smallest tl.dot M on the GPU; the interpreter takes more (it pays per
    # operation, not per element)
    rows = 16 if BACKEND != "interpreter" else max(16, min(1 << (nq - 1).bit_length(), (1 << 14) // block_nk))
    launch_kernel(K.fused_select_kernel, (-(-nq // rows), spec.B * spec.LH), dict(
        Q_MEAN=q_mean, K_MEAN=k_mean, K_MIN=k_min, K_MAX=k_max, Hq=spec.Hq, Hkv=spec.Hkv, group=spec.group,
        LH=spec.LH, n_shared=spec.n_shared, scale=spec.scale, HEAD_DIM=spec.D, ROWS=rows,
        **_select_args(spec, lists, block_nk, zero_pad),
        # [16, BLOCK_NK] rows of scores, key slices and bisection state: ptxas (sm_90, D=128) spills a few
        # dozen bytes with these warps up to 256 key blocks, a few hundred at 512; 4 warps at 256 spill 3 KB
        num_warps=2 if block_nk <= 64 else 4 if block_nk <= 128 else 8), kn.fast_launch)
    return lists


def _member_bits(q: torch.Tensor, pooled, kv_count, kv_index, spec: RouteSpec) -> torch.Tensor:
    """Row x slot bits uint8 ``[B, LH, Lq, W]`` of a member selection. One launch."""
    from .kernels import route as K
    _, k_mean, k_min, k_max = pooled
    row_slot = torch.empty(spec.B, spec.LH, spec.Lq, spec.width, device=q.device, dtype=torch.uint8)
    block_m = min(spec.block_q, 64)
    launch_kernel(K.member_kernel, (-(-spec.Lq // block_m), spec.B * spec.LH), dict(
        Q=q, K_MEAN=k_mean, K_MIN=k_min, K_MAX=k_max, KV_COUNT=kv_count, KV_INDEX=kv_index, ROW_SLOT=row_slot,
        stride_qb=q.stride(0), stride_qh=q.stride(1), stride_qm=q.stride(2),
        Hq=spec.Hq, Hkv=spec.Hkv, group=spec.group, LH=spec.LH, n_shared=spec.n_shared, nq=spec.nq,
        nk=spec.nk, Lq=spec.Lq, q_offset=spec.q_offset, local=spec.local, sinks=spec.sinks,
        member_topk=spec.member_topk, W=spec.width,
        HEAD_DIM=spec.D, BLOCK_Q=spec.block_q, BLOCK_K=spec.block_k, BLOCK_M=block_m,
        W_PAD=max(16, 1 << (spec.width - 1).bit_length()), CAUSAL=spec.causal, num_warps=4), _KERNELS[0].fast_launch)
    return row_slot


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def block_scores(q: torch.Tensor, k: torch.Tensor, block_q: int = 128, block_k: int = 128, causal: bool = True,
                 share: str = "kv_head", pool: str = "mean", scale: Optional[float] = None) -> torch.Tensor:
    """The pooled block scores ``route`` ranks: float32 ``[B, H, nq, nk]`` (H per ``share``), scaled by the
    softmax scale, -inf where a query block cannot see a key block. Two launches, no host sync
    (:func:`sparseattn.reference.route_scores_reference` is the eager spec)."""
    spec = check_route(q, k, block_q, block_k, 0, None, causal, 0, 0, share, pool, "block", None, None, scale)
    check_device(q, what="q (and k)")
    q, k = _contiguous_rows(q), _contiguous_rows(k)
    return _scores(_pool(q, k, spec), spec)


class Selection(NamedTuple):
    """What :func:`select_blocks` chose, before the layout is built: the row lists, the member bits and the
    layout's mask_mod and shape. :meth:`to_layout` builds the layout (its index, the transposed lists the
    backward walks, on first use)."""
    kv_count: torch.Tensor
    kv_index: torch.Tensor
    full_count: torch.Tensor
    full_index: torch.Tensor
    row_slot: Optional[torch.Tensor]
    mask_mod: object
    q_len: int
    kv_len: int
    block_q: int
    block_k: int

    def to_layout(self) -> BlockLayout:
        """The dynamic layout (no launch, no host sync; its transposed lists come with one launch when first
        needed). The lists are route's own (kinds, shapes, device and mask path right by construction), so
        with :data:`CURRENT` they are not re-checked (:meth:`BlockLayout._dynamic`)."""
        kn = _KERNELS[0]
        return BlockLayout._dynamic(self.kv_count, self.kv_index, self.full_count, self.full_index,
                                    q_len=self.q_len, kv_len=self.kv_len, block_q=self.block_q, block_k=self.block_k,
                                    mask_mod=self.mask_mod, row_slot=self.row_slot, checked=kn.index_checked,
                                    fast_launch=kn.fast_launch)


def select_blocks(q: torch.Tensor, k: torch.Tensor, block_q: int = 128, block_k: int = 128,
                  topk: Optional[int] = None, threshold: Optional[float] = None, causal: bool = True, local: int = 1,
                  sinks: int = 1, share: str = "kv_head", pool: str = "mean", semantics: str = "block",
                  capacity: Optional[int] = None, member_topk: Optional[int] = None,
                  scale: Optional[float] = None) -> Selection:
    """The selection step of :func:`route` alone (pool, scores, top-k, member bits: three or four launches;
    one fewer with :data:`FUSED`), without building the index; ``route(...)`` is
    ``select_blocks(...).to_layout()``."""
    spec = check_route(q, k, block_q, block_k, topk, threshold, causal, local, sinks, share, pool, semantics,
                       capacity, member_topk, scale)
    check_device(q, what="q (and k)")
    q, k = _contiguous_rows(q), _contiguous_rows(k)
    pooled = _pool(q, k, spec)
    if fused_fits(spec):
        kv_count, kv_index, full_count, full_index = _fused_select(pooled, spec)
    else:
        kv_count, kv_index, full_count, full_index = _select(_score_parts(pooled, spec), spec)
    row_slot = _member_bits(q, pooled, kv_count, kv_index, spec) if semantics == "member" else None
    if semantics == "member":
        mask_mod = P.causal() if causal else P.full()
    else:
        mask_mod = P.causal() if causal else None
    return Selection(kv_count, kv_index, full_count, full_index, row_slot, mask_mod, spec.Lq, spec.Lk, block_q,
                     block_k)


def route(q: torch.Tensor, k: torch.Tensor, block_q: int = 128, block_k: int = 128, topk: Optional[int] = None,
          threshold: Optional[float] = None, causal: bool = True, local: int = 1, sinks: int = 1,
          share: str = "kv_head", pool: str = "mean", semantics: str = "block", capacity: Optional[int] = None,
          member_topk: Optional[int] = None, scale: Optional[float] = None) -> BlockLayout:
    """Content routing: the key blocks every query block attends, chosen on the device from pooled scores.

    q ``[B, Hq, Lq, D]``, k ``[B, Hkv, Lk, D]`` (queries are the last ``Lq`` positions when ``Lq < Lk``). Query
    and key blocks are pooled (``pool="mean"``: the mean; ``"bound"``: the keys' element-wise min/max, scored
    by Quest's upper bound ``relu(q) . max + min(q, 0) . min``), scored by one GEMM (scaled by ``scale``,
    default ``1/sqrt(D)``), the max taken over the query heads that share a selection:

    * ``share="kv_head"``: one selection per KV head, shared by its GQA group (layout ``H = Hkv``);
      ``"all"``: one for every head (``H = 1``); ``"none"``: one per query head (``H = Hq``).

    Every query block keeps its forced blocks when it can see them — the first ``sinks`` key blocks and, for
    each of its rows, the ``local`` key blocks ending at the row's own block (so with ``local >= 1`` every row
    sees its own position) — then adds visible blocks by score
    while: fewer than ``topk`` were added, the row holds fewer than ``capacity`` tiles, and (with
    ``threshold``) the softmax mass over visible blocks of what is kept is below ``threshold``. Ties go to the
    lower block index. ``causal=True`` hides key blocks that start after a query block's last position and
    masks the diagonal tiles token by token.

    ``capacity`` (default ``min(nk, topk + local + sinks)`` for equal, aligned blocks; ``topk=None`` counts
    as ``nk``; see :func:`sparseattn._checks.check_route`) is the fixed width of the result, so shapes never
    depend on the data. ``semantics="block"``: every row of a query
    block attends every chosen tile (full tiles unmasked, the diagonal ones causally masked).
    ``"member"``: the chosen tiles are only what the query block loads; each query row keeps the forced blocks
    and its own ``member_topk`` best others, scored per row against the pooled keys (``layout.row_slot``).

    Returns a dynamic :class:`~sparseattn.layout.BlockLayout` (trusted: built without a validation pass or
    a host sync; its transposed lists are built on first use). The reported tiles are physical: a query block
    of ``block_q`` rows reads each chosen ``block_q x block_k`` tile once, whatever its rows use.
    """
    return select_blocks(q, k, block_q, block_k, topk=topk, threshold=threshold, causal=causal, local=local,
                         sinks=sinks, share=share, pool=pool, semantics=semantics, capacity=capacity,
                         member_topk=member_topk, scale=scale).to_layout()


class SelectionRecall(NamedTuple):
    """Per query row, the share of the full attention's softmax mass that a layout's allowed cells cover."""
    recall: torch.Tensor  # float32 [B, Hq, R]
    rows: torch.Tensor  # int64 [R]: the local query rows measured

    def mean(self) -> float:
        return float(self.recall.mean())


def _recall_rows(Lq: int, Lk: int, sample: Optional[int], device) -> torch.Tensor:
    if sample is None:
        sample = Lq if Lq * Lk <= (1 << 26) else 1024
    n = min(check_int("sample", sample), Lq)
    return torch.unique(torch.linspace(0, Lq - 1, n, device=device).round().long())


def selection_recall(q: torch.Tensor, k: torch.Tensor, layout: BlockLayout, causal: bool = True,
                     scale: Optional[float] = None, sample: Optional[int] = None,
                     rows: Optional[torch.Tensor] = None) -> SelectionRecall:
    """How much of full attention a selection keeps: for query rows, ``sum over allowed keys of p(key)`` where
    ``p`` is the softmax of the full (``causal``, else unmasked) attention row, in float32.

    Rows: ``rows`` if given, else ``sample`` rows spread evenly (default: every row when ``Lq x Lk <= 2**26``,
    else 1024), so large shapes cost ``rows x Lk`` per head, never ``Lq x Lk``. Heads map to the layout's as
    in attention (GQA). 1.0 means the selection loses nothing of the full row."""
    from ._checks import check_qkv
    B, Hq, Hkv, Lq, Lk, D = check_qkv(q, k, k)
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if (layout.q_len, layout.kv_len) != (Lq, Lk) or layout.B not in (1, B) or layout.H not in (1, Hkv, Hq):
        raise ValueError(f"layout (B={layout.B}, H={layout.H}, q_len={layout.q_len}, kv_len={layout.kv_len}) does "
                         f"not fit q {tuple(q.shape)} and k {tuple(k.shape)}")
    scale = check_scale(scale, D)
    rows = _recall_rows(Lq, Lk, sample, q.device) if rows is None else torch.as_tensor(rows, device=q.device).long()
    allowed = layout.dense_rows(rows)  # [LB, LH, R, Lk]
    q_abs = rows + max(Lk - Lq, 0)
    out = torch.empty(B, Hq, rows.numel(), device=q.device, dtype=torch.float32)
    for hq in range(Hq):  # one head at a time: memory B x R x Lk
        s = (q[:, hq, rows].float() @ k[:, hq // (Hq // Hkv)].float().transpose(-1, -2)) * scale  # [B, R, Lk]
        if causal:
            s = s.masked_fill(torch.arange(Lk, device=q.device)[None, :] > q_abs[:, None], float("-inf"))
        p = torch.softmax(s, dim=-1)
        lh = hq if layout.H == Hq else (hq // (Hq // Hkv) if layout.H == Hkv else 0)
        out[:, hq] = (p * allowed[:, lh]).sum(-1)
    return SelectionRecall(out, rows)
