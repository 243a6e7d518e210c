"""Content routing on the device: pooled blocks, block scores, a top-k per query block, and per-row member bits.

``pool_kernel``: the mean of each block's rows and, for keys with ``pool="bound"``, their element-wise min and
max (Quest's bound); one launch for Q and K. Reads each of Q and K once, everything after works on ``D``
numbers per block. Pooling is a pure read, so what matters is how many bytes each SM keeps in flight and
whether every SM has work to the end. The launch choices (``sparseattn.routing.RouteKernels``): a program
(or, persistent, a task) takes ``BLOCKS`` consecutive blocks, ``SUB`` rows a load (``SUB = BLOCK``: one
``[BLOCK, D]`` load); ``ROW_ACC`` adds the loads element-wise into a ``[SUB, D]`` accumulator and reduces
once at the end, so no reduction (with its barrier) sits between two loads; ``JOINT`` loads chunk ``r0``
of all ``BLOCKS`` blocks as one ``[BLOCKS, SUB, D]`` tensor; ``PERSISTENT``: a grid of a few programs per
SM, each walking tasks ``p, p + P, ...`` in a loop software-pipelined ``STAGES`` deep (``tl.range``);
``USE_TMA``: rows through tensor descriptors (the copy engine). Grid otherwise: (groups of ``BLOCKS``
blocks, batch * head of Q, then of K).

``block_scores_kernel``: grid (``BLOCK_R`` query blocks, key-column ranges x parts of the shared heads,
batch * layout head): pooled Q against pooled K by ``tl.dot`` (fp32, ieee), the max over the query heads
of the program's part, the softmax scale, -inf for blocks the query block cannot see (causal, or past the
keys). A chunk of key blocks that starts after every row's last position is only -inf (``SKIP_HIDDEN``: no
GEMM). Parts write separate planes; the select kernel takes their max (exact in any order).

``select_kernel``: one program per (``ROWS`` query blocks, batch * layout head). The forced blocks (the first
``sinks``, the ``local`` blocks ending at the diagonal) are kept; of the other visible blocks it keeps the top
``k`` by score, ``k = min(topk, capacity - forced, visible)`` and, with a threshold, no more than the
smallest number whose softmax mass (with the forced blocks') reaches it. The k-th score is found by
bisection on the float's bits (as ``select_pages`` does); blocks above it are kept, ties at it go to the lower
block index. The chosen blocks are written ascending by a running prefix sum, split into partial tiles (they
cross the causal diagonal) and full tiles; no sort, no host sync, fixed widths; with ``ZERO_PAD`` the unused
slots get 0 from the same program (no zero-filled buffers launched before it).

``fused_select_kernel``: ``block_scores_kernel`` and ``select_kernel`` in one launch (one program per
``ROWS`` = 16 query blocks on the GPU, the smallest dot M): the program scores its query blocks against every
key block over every shared head with the scores kernel's own tile code (``_score_tile``), then selects with
the select kernel's own body (``_select_rows``), so the lists are the same bit for bit and no score matrix is
written or read. It needs a ``[16, BLOCK_NK]`` row block of scores in registers, so ``sparseattn.routing``
uses it only up to ``FUSED_MAX_NK`` key blocks.

``member_kernel``: one program per (``BLOCK_M`` query rows, batch * layout head). Each row scores its query
block's selected blocks against their pooled keys (the max over the shared heads), keeps the forced ones and
its own ``member_topk`` best of the rest (ties: lower block), and writes one byte per (row, slot).
"""
import triton
import triton.language as tl

from ._common import LOG2E


@triton.jit
def _pool_add(b_sum, b_min, b_max, b_x, ok, AXIS: tl.constexpr, BOUND: tl.constexpr, ROW_ACC: tl.constexpr):
    """One loaded chunk ``b_x`` (fp32; ``ok``: its real rows, broadcastable to it) into the accumulators:
    element-wise (``ROW_ACC``) or reduced over the chunk's rows (axis ``AXIS``) first."""
    if ROW_ACC:
        b_sum += b_x
        if BOUND:
            b_min = tl.minimum(b_min, tl.where(ok, b_x, float("inf")))
            b_max = tl.maximum(b_max, tl.where(ok, b_x, float("-inf")))
    else:
        b_sum += tl.sum(b_x, AXIS)
        if BOUND:
            b_min = tl.minimum(b_min, tl.min(tl.where(ok, b_x, float("inf")), AXIS))
            b_max = tl.maximum(b_max, tl.max(tl.where(ok, b_x, float("-inf")), AXIS))
    return b_sum, b_min, b_max


@triton.jit
def _pool_load(X_HEAD, desc, b, h, row0, L, stride_l, SUB: tl.constexpr, HEAD_DIM: tl.constexpr,
               USE_TMA: tl.constexpr):
    """Rows ``row0 .. row0 + SUB - 1`` of one head as fp32 ``[SUB, D]`` (rows past ``L`` read as 0) and the
    ``[SUB, 1]`` mask of the real ones."""
    offs = row0 + tl.arange(0, SUB)  # [SUB]
    ok = (offs < L)[:, None]
    if USE_TMA:  # the copy engine addresses the [SUB, D] box and zero-fills rows past L
        b_x = desc.load([b, h, row0, 0]).reshape(SUB, HEAD_DIM)
    else:
        b_x = tl.load(X_HEAD + offs[:, None].to(tl.int64) * stride_l + tl.arange(0, HEAD_DIM)[None, :], mask=ok,
                      other=0.0)
    return b_x.to(tl.float32), ok


@triton.jit
def _pool_rows(X, desc, OUT_MEAN, OUT_MIN, OUT_MAX, blk, bh, L, n_blocks, stride_b, stride_h, stride_l, H,
               BLOCK: tl.constexpr, SUB: tl.constexpr, HEAD_DIM: tl.constexpr, BOUND: tl.constexpr,
               ROW_ACC: tl.constexpr, USE_TMA: tl.constexpr, TASK: tl.constexpr):
    """Pool block ``blk`` of (batch, head) ``bh``: ``SUB`` rows a load, its mean (and min/max) stored at row
    ``bh * n_blocks + blk`` of the outputs. ``TASK`` (the body of a persistent loop): nothing is stored for
    ``blk >= n_blocks`` (masked stores, no branch), and the chunk loop is unrolled, so that the task loop
    around it is the innermost loop, the one Triton's pipeliner deepens; otherwise the caller has branched
    around such blocks. With ``USE_TMA`` the rows come through the tensor descriptor ``desc``."""
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    if ROW_ACC:
        # element-wise [SUB, D] accumulators, reduced once after the loop: no reduction (and no barrier)
        # between the loads, so a program's loads do not wait on each other's sums
        b_sum = tl.zeros([SUB, HEAD_DIM], tl.float32)
        b_min = tl.full([SUB, HEAD_DIM], float("inf"), tl.float32)
        b_max = tl.full([SUB, HEAD_DIM], float("-inf"), tl.float32)
    else:  # the first version: reduce every [SUB, D] load to [D] before the next
        b_sum = tl.zeros([HEAD_DIM], tl.float32)
        b_min = tl.full([HEAD_DIM], float("inf"), tl.float32)
        b_max = tl.full([HEAD_DIM], float("-inf"), tl.float32)
    if TASK:
        for r0 in tl.static_range(0, BLOCK, SUB):
            b_x, ok = _pool_load(base, desc, b, h, blk * BLOCK + r0, L, stride_l, SUB, HEAD_DIM, USE_TMA)
            b_sum, b_min, b_max = _pool_add(b_sum, b_min, b_max, b_x, ok, 0, BOUND, ROW_ACC)
    else:
        for r0 in range(0, BLOCK, SUB):
            b_x, ok = _pool_load(base, desc, b, h, blk * BLOCK + r0, L, stride_l, SUB, HEAD_DIM, USE_TMA)
            b_sum, b_min, b_max = _pool_add(b_sum, b_min, b_max, b_x, ok, 0, BOUND, ROW_ACC)
    if ROW_ACC:
        b_sum = tl.sum(b_sum, 0)  # [D]
        if BOUND:
            b_min = tl.min(b_min, 0)
            b_max = tl.max(b_max, 0)
    n = tl.minimum(L - blk * BLOCK, BLOCK)  # rows of the block inside the sequence (the last one is clipped)
    out = (bh.to(tl.int64) * n_blocks + blk) * HEAD_DIM + offs_d
    if TASK:
        n = tl.maximum(n, 1)  # a block past the end stores nothing: no division by a non-positive count
        real = offs_d < tl.where(blk < n_blocks, HEAD_DIM, 0)  # [D]: all true, or all false past the last block
        tl.store(OUT_MEAN + out, b_sum / n.to(tl.float32), mask=real)
        if BOUND:
            tl.store(OUT_MIN + out, b_min, mask=real)
            tl.store(OUT_MAX + out, b_max, mask=real)
    else:
        tl.store(OUT_MEAN + out, b_sum / n.to(tl.float32))
        if BOUND:
            tl.store(OUT_MIN + out, b_min)
            tl.store(OUT_MAX + out, b_max)


@triton.jit
def _pool_joint(X, OUT_MEAN, OUT_MIN, OUT_MAX, blk0, bh, L, n_blocks, stride_b, stride_h, stride_l, H,
                BLOCK: tl.constexpr, SUB: tl.constexpr, BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
                BOUND: tl.constexpr, ROW_ACC: tl.constexpr, TASK: tl.constexpr):
    """Pool blocks ``blk0 .. blk0 + BLOCKS - 1`` of (batch, head) ``bh`` together: each load is one
    ``[BLOCKS, SUB, D]`` tensor (chunk ``r0`` of every block at once), so all of a program's bytes are
    requested before any reduction, and each reduction covers all its blocks (axis 1). Blocks past
    ``n_blocks`` are masked off (loads and stores); ``TASK`` unrolls the chunk loop (see ``_pool_rows``)."""
    b = bh // H
    h = bh % H
    offs_d = tl.arange(0, HEAD_DIM)
    offs_b = blk0 + tl.arange(0, BLOCKS)  # [NB]
    base = X + b.to(tl.int64) * stride_b + h.to(tl.int64) * stride_h
    if ROW_ACC:
        b_sum = tl.zeros([BLOCKS, SUB, HEAD_DIM], tl.float32)
        b_min = tl.full([BLOCKS, SUB, HEAD_DIM], float("inf"), tl.float32)
        b_max = tl.full([BLOCKS, SUB, HEAD_DIM], float("-inf"), tl.float32)
    else:
        b_sum = tl.zeros([BLOCKS, HEAD_DIM], tl.float32)
        b_min = tl.full([BLOCKS, HEAD_DIM], float("inf"), tl.float32)
        b_max = tl.full([BLOCKS, HEAD_DIM], float("-inf"), tl.float32)
    if TASK:
        for r0 in tl.static_range(0, BLOCK, SUB):
            b_x, ok = _joint_load(base, offs_b, r0, L, n_blocks, stride_l, BLOCK, SUB, HEAD_DIM)
            b_sum, b_min, b_max = _pool_add(b_sum, b_min, b_max, b_x, ok, 1, BOUND, ROW_ACC)
    else:
        for r0 in range(0, BLOCK, SUB):
            b_x, ok = _joint_load(base, offs_b, r0, L, n_blocks, stride_l, BLOCK, SUB, HEAD_DIM)
            b_sum, b_min, b_max = _pool_add(b_sum, b_min, b_max, b_x, ok, 1, BOUND, ROW_ACC)
    if ROW_ACC:
        b_sum = tl.sum(b_sum, 1)  # [NB, D]
        if BOUND:
            b_min = tl.min(b_min, 1)
            b_max = tl.max(b_max, 1)
    n = tl.minimum(L - offs_b * BLOCK, BLOCK)  # [NB] rows of each block inside the sequence
    n = tl.where(offs_b < n_blocks, n, 1)  # blocks past the end: no store, no division by a non-positive count
    out = (bh.to(tl.int64) * n_blocks + offs_b)[:, None] * HEAD_DIM + offs_d[None, :]  # [NB, D]
    real = (offs_b < n_blocks)[:, None]
    tl.store(OUT_MEAN + out, b_sum / n.to(tl.float32)[:, None], mask=real)
    if BOUND:
        tl.store(OUT_MIN + out, b_min, mask=real)
        tl.store(OUT_MAX + out, b_max, mask=real)


@triton.jit
def _joint_load(X_HEAD, offs_b, r0, L, n_blocks, stride_l, BLOCK: tl.constexpr, SUB: tl.constexpr,
                HEAD_DIM: tl.constexpr):
    """Chunk ``r0`` (``SUB`` rows) of each block ``offs_b [NB]`` of one head: fp32 ``[NB, SUB, D]`` (rows past
    ``L`` and blocks past ``n_blocks`` read as 0) and the ``[NB, SUB, 1]`` mask of the real rows."""
    offs = offs_b[:, None] * BLOCK + r0 + tl.arange(0, SUB)[None, :]  # [NB, SUB] rows
    ok = ((offs < L) & (offs_b < n_blocks)[:, None])[:, :, None]  # [NB, SUB, 1]
    ptrs = X_HEAD + offs[:, :, None].to(tl.int64) * stride_l + tl.arange(0, HEAD_DIM)[None, None, :]
    return tl.load(ptrs, mask=ok, other=0.0).to(tl.float32), ok


@triton.jit
def _pool_task(X, desc, OUT_MEAN, OUT_MIN, OUT_MAX, blk0, bh, L, n_blocks, stride_b, stride_h, stride_l, H,
               BLOCK: tl.constexpr, SUB: tl.constexpr, BLOCKS: tl.constexpr, HEAD_DIM: tl.constexpr,
               BOUND: tl.constexpr, ROW_ACC: tl.constexpr, JOINT: tl.constexpr, USE_TMA: tl.constexpr,
               GUARD: tl.constexpr):
    """Blocks ``blk0 ..`` (``BLOCKS`` of them) of one (batch, head): jointly, or one after the other (with
    ``GUARD``, a block past ``n_blocks`` is skipped by a branch, as the first grid did; without it the
    stores are masked, so that a persistent loop's body has no branch)."""
    if JOINT:
        _pool_joint(X, OUT_MEAN, OUT_MIN, OUT_MAX, blk0, bh, L, n_blocks, stride_b, stride_h, stride_l, H,
                    BLOCK, SUB, BLOCKS, HEAD_DIM, BOUND, ROW_ACC, not GUARD)
    else:
        for t in tl.static_range(BLOCKS):  # independent loads in flight
            if GUARD:
                if blk0 + t < n_blocks:
                    _pool_rows(X, desc, OUT_MEAN, OUT_MIN, OUT_MAX, blk0 + t, bh, L, n_blocks, stride_b, stride_h,
                               stride_l, H, BLOCK, SUB, HEAD_DIM, BOUND, ROW_ACC, USE_TMA, False)
            else:
                _pool_rows(X, desc, OUT_MEAN, OUT_MIN, OUT_MAX, blk0 + t, bh, L, n_blocks, stride_b, stride_h,
                           stride_l, H, BLOCK, SUB, HEAD_DIM, BOUND, ROW_ACC, USE_TMA, True)


@triton.jit
def _prefetch_load(X, t, t_end, L, n_blocks, stride_b, stride_h, stride_l, H, BLOCK: tl.constexpr,
                   HEAD_DIM: tl.constexpr):
    """The rows of task ``t`` (one whole block: ``t = bh * n_blocks + blk``) as ``[BLOCK, D]`` in the tensor's
    dtype (nothing read for ``t >= t_end``: the prefetch past a program's last task) and its row mask."""
    bh = t // n_blocks
    offs = (t % n_blocks) * BLOCK + tl.arange(0, BLOCK)  # [BLOCK]
    ok = (offs < L) & (t < t_end)
    base = X + (bh // H).to(tl.int64) * stride_b + (bh % H).to(tl.int64) * stride_h
    ptrs = base + offs[:, None].to(tl.int64) * stride_l + tl.arange(0, HEAD_DIM)[None, :]
    return tl.load(ptrs, mask=ok[:, None], other=0.0), ok


@triton.jit
def _pool_prefetched(X, OUT_MEAN, OUT_MIN, OUT_MAX, t_first, t_end, P, L, n_blocks, stride_b, stride_h, stride_l,
                     H, BLOCK: tl.constexpr, HEAD_DIM: tl.constexpr, BOUND: tl.constexpr):
    """Tasks ``t_first, t_first + P, ... < t_end`` (one whole block each) with a register double buffer:
    the next task's rows are requested before this task's reduction, so two blocks' bytes are in flight per
    program (by hand what a software pipeliner would do; Triton 3.6 does not pipeline loads that feed no dot)."""
    offs_d = tl.arange(0, HEAD_DIM)
    b_next, ok_next = _prefetch_load(X, t_first, t_end, L, n_blocks, stride_b, stride_h, stride_l, H, BLOCK,
                                     HEAD_DIM)  # [BLOCK, D]
    for t in range(t_first, t_end, P):
        b_x = b_next.to(tl.float32)  # [BLOCK, D]
        ok = ok_next
        b_next, ok_next = _prefetch_load(X, t + P, t_end, L, n_blocks, stride_b, stride_h, stride_l, H, BLOCK,
                                         HEAD_DIM)
        blk = t % n_blocks
        n = tl.minimum(L - blk * BLOCK, BLOCK)  # rows of the block inside the sequence (the last one is clipped)
        out = tl.cast(t, tl.int64) * HEAD_DIM + offs_d  # row t = bh * n_blocks + blk of the outputs
        tl.store(OUT_MEAN + out, tl.sum(b_x, 0) / n.to(tl.float32))
        if BOUND:
            tl.store(OUT_MIN + out, tl.min(tl.where(ok[:, None], b_x, float("inf")), 0))
            tl.store(OUT_MAX + out, tl.max(tl.where(ok[:, None], b_x, float("-inf")), 0))


@triton.heuristics({"BOUND": lambda a: a["K_MIN"] is not None, "USE_TMA": lambda a: a["desc_q"] is not None})
@triton.jit
def pool_kernel(
    Q, K, desc_q, desc_k, Q_MEAN, K_MEAN, K_MIN, K_MAX,
    stride_qb, stride_qh, stride_qm, stride_kb, stride_kh, stride_kn,
    Hq, Hkv, Lq, Lk, nq, nk, BQ_PROGRAMS, BK_PROGRAMS,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, SUB: tl.constexpr,
    BLOCKS: tl.constexpr, ROW_ACC: tl.constexpr, JOINT: tl.constexpr, PERSISTENT: tl.constexpr,
    STAGES: tl.constexpr, PREFETCH: tl.constexpr, BOUND: tl.constexpr, USE_TMA: tl.constexpr,
):
    if PERSISTENT and PREFETCH:  # one whole block a task, the next one loaded before this one is reduced
        P = tl.num_programs(0)
        pid = tl.program_id(0)
        n_q = BQ_PROGRAMS * nq
        n_k = BK_PROGRAMS * nk
        _pool_prefetched(Q, Q_MEAN, Q_MEAN, Q_MEAN, pid, n_q, P, Lq, nq, stride_qb, stride_qh, stride_qm, Hq,
                         BLOCK_Q, HEAD_DIM, False)
        # K's tasks continue the same striding: task n_q + u is program (n_q + u) mod P's
        _pool_prefetched(K, K_MEAN, K_MIN, K_MAX, (pid + P - n_q % P) % P, n_k, P, Lk, nk, stride_kb, stride_kh,
                         stride_kn, Hkv, BLOCK_K, HEAD_DIM, BOUND)
    elif PERSISTENT:
        # a task is BLOCKS consecutive blocks of one (batch, head): Q's tasks first, then K's; program p of P
        # takes tasks p, p + P, ... in two loops (one per tensor: no branch in a loop body, so the software
        # pipeliner can keep STAGES tasks' loads in flight)
        P = tl.num_programs(0)
        pid = tl.program_id(0)
        q_tasks = tl.cdiv(nq, BLOCKS)  # tasks per (batch, head)
        k_tasks = tl.cdiv(nk, BLOCKS)
        n_q = BQ_PROGRAMS * q_tasks
        n_all = n_q + BK_PROGRAMS * k_tasks
        for t in tl.range(pid, n_q, P, num_stages=STAGES):
            _pool_task(Q, desc_q, Q_MEAN, Q_MEAN, Q_MEAN, (t % q_tasks) * BLOCKS, t // q_tasks, Lq, nq,
                       stride_qb, stride_qh, stride_qm, Hq, BLOCK_Q, SUB, BLOCKS, HEAD_DIM, False, ROW_ACC, JOINT,
                       USE_TMA, False)
        k_first = n_q + (pid + P - n_q % P) % P  # the first task index >= n_q that is pid modulo P
        for t in tl.range(k_first, n_all, P, num_stages=STAGES):
            tk = t - n_q
            _pool_task(K, desc_k, K_MEAN, K_MIN, K_MAX, (tk % k_tasks) * BLOCKS, tk // k_tasks, Lk, nk,
                       stride_kb, stride_kh, stride_kn, Hkv, BLOCK_K, SUB, BLOCKS, HEAD_DIM, BOUND, ROW_ACC, JOINT,
                       USE_TMA, False)
    else:
        bh = tl.program_id(1)
        blk0 = tl.program_id(0) * BLOCKS
        if bh < BQ_PROGRAMS:  # the first B * Hq programs pool query blocks, the rest key blocks
            _pool_task(Q, desc_q, Q_MEAN, Q_MEAN, Q_MEAN, blk0, bh, Lq, nq, stride_qb, stride_qh, stride_qm, Hq,
                       BLOCK_Q, SUB, BLOCKS, HEAD_DIM, False, ROW_ACC, JOINT, USE_TMA, True)
        else:
            _pool_task(K, desc_k, K_MEAN, K_MIN, K_MAX, blk0, bh - BQ_PROGRAMS, Lk, nk, stride_kb, stride_kh,
                       stride_kn, Hkv, BLOCK_K, SUB, BLOCKS, HEAD_DIM, BOUND, ROW_ACC, JOINT, USE_TMA, True)


@triton.jit
def _pooled_scores(Q_PTR, q_offs, q_ok, K_MEAN, K_MIN, K_MAX, k_rows, k_ok, HEAD_DIM: tl.constexpr,
                   D_CHUNK: tl.constexpr, BOUND: tl.constexpr):
    """Scores ``[R, C]`` of the query rows at ``Q_PTR + q_offs`` (``[R]`` element offsets, ``D`` contiguous
    values each, converted to fp32) against the pooled key blocks at ``k_rows`` ([C] row offsets into the
    pooled-key tables): the mean's dot product, or Quest's upper bound ``relu(q) . max + min(q, 0) . min``.
    The dot runs over ``D`` in ``D_CHUNK`` slices accumulated in order, in a loop that is not unrolled: one
    ``[C, D_CHUNK]`` key slice sits in registers at a time, so a program can score every key block of a row
    at once (the fused select; unrolled, or unsliced, ptxas spills kilobytes there at 256 key blocks). The
    slicing may change the rounding (the interpreter adds each slice's product separately), so every caller
    that must agree bitwise (the scores kernel and the fused select) uses the same ``D_CHUNK``."""
    R: tl.constexpr = q_offs.shape[0]
    C: tl.constexpr = k_rows.shape[0]
    b_s = tl.zeros([R, C], tl.float32)
    for d0 in range(0, HEAD_DIM, D_CHUNK):
        offs_d = d0 + tl.arange(0, D_CHUNK)
        b_q = tl.load(Q_PTR + q_offs[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
        ptr = k_rows[:, None] * HEAD_DIM + offs_d[None, :]  # [C, DC]
        if BOUND:  # the relu(q) . max half first, over every slice: the FMA order of one whole-D dot
            b_k = tl.load(K_MAX + ptr, mask=k_ok[:, None], other=0.0)
            b_s = tl.dot(tl.maximum(b_q, 0.0), tl.trans(b_k), b_s, input_precision="ieee")
        else:
            b_k = tl.load(K_MEAN + ptr, mask=k_ok[:, None], other=0.0)
            b_s = tl.dot(b_q, tl.trans(b_k), b_s, input_precision="ieee")
    if BOUND:
        for d0 in range(0, HEAD_DIM, D_CHUNK):
            offs_d = d0 + tl.arange(0, D_CHUNK)
            b_q = tl.load(Q_PTR + q_offs[:, None] + offs_d[None, :], mask=q_ok[:, None], other=0.0).to(tl.float32)
            b_k = tl.load(K_MIN + k_rows[:, None] * HEAD_DIM + offs_d[None, :], mask=k_ok[:, None], other=0.0)
            b_s = tl.dot(tl.minimum(b_q, 0.0), tl.trans(b_k), b_s, input_precision="ieee")
    return b_s


@triton.jit
def _score_tile(Q_MEAN, K_MEAN, K_MIN, K_MAX, b, lh, offs_r, r_ok, offs_c, c_ok, g_begin, g_end,
                Hq, Hkv, group, n_shared, nq, nk, Lq, q_offset, scale,
                HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr,
                BOUND: tl.constexpr):
    """Block scores ``[R, C]`` of query blocks ``offs_r`` against key blocks ``offs_c`` for one selection
    (batch ``b``, layout head ``lh``): the max of the pooled scores over its shared query heads
    ``g_begin .. g_end - 1``, times the softmax scale; -inf where the key block is out of range (``c_ok``) or,
    with ``CAUSAL``, starts after the query block's last position. The one scoring code of both the scores
    kernel (one column chunk, one part of the heads) and the fused select (every key block, every head)."""
    R: tl.constexpr = offs_r.shape[0]
    C: tl.constexpr = offs_c.shape[0]
    # the dot's slice of D: a [C, 32] fp32 key slice in registers (see _pooled_scores)
    D_CHUNK: tl.constexpr = 32 if HEAD_DIM > 32 else HEAD_DIM
    b_s = tl.full([R, C], float("-inf"), tl.float32)
    for g in range(g_begin, g_end):  # the query heads that share this selection: their max
        hq = lh * n_shared + g
        hkv = hq // group
        q_rows = (b * Hq + hq).to(tl.int64) * nq + offs_r  # [R]
        k_rows = (b * Hkv + hkv).to(tl.int64) * nk + offs_c  # [C]
        b_s = tl.maximum(b_s, _pooled_scores(Q_MEAN, q_rows * HEAD_DIM, r_ok, K_MEAN, K_MIN, K_MAX, k_rows, c_ok,
                                             HEAD_DIM, D_CHUNK, BOUND))
    visible = c_ok[None, :]
    if CAUSAL:  # a key block is visible if its first key is not after the query block's last position
        q_last = tl.minimum((offs_r + 1) * BLOCK_Q, Lq) - 1 + q_offset  # [R]
        visible = visible & (offs_c[None, :] * BLOCK_K <= q_last[:, None])
    return tl.where(visible, b_s * scale, float("-inf"))  # [R, C]


@triton.jit
def forced_blocks(j, i, Lq, q_offset, nk, local, sinks, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr):
    """Key blocks ``j`` that query block ``i`` always keeps (when it can see them): the first ``sinks``, and
    for every query row the ``local`` key blocks ending at the row's own block, i.e. blocks
    ``jf - local + 1 .. jd`` with ``jf``/``jd`` the blocks of the query block's first/last position."""
    q_first = i * BLOCK_Q + q_offset
    q_last = tl.minimum((i + 1) * BLOCK_Q, Lq) - 1 + q_offset
    jf = tl.minimum(q_first // BLOCK_K, nk - 1)
    jd = tl.minimum(q_last // BLOCK_K, nk - 1)
    lo = tl.where(local > 0, jf - local + 1, jd + 1)  # local = 0: no local blocks
    return (j < sinks) | ((j >= lo) & (j <= jd))


@triton.heuristics({"BOUND": lambda a: a["K_MIN"] is not None})
@triton.jit
def block_scores_kernel(
    Q_MEAN, K_MEAN, K_MIN, K_MAX, S,
    Hq, Hkv, group, LH, n_shared, nq, nk, Lq, Lk, q_offset, scale, cols_per_program, heads_per_part, part_stride,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr, CAUSAL: tl.constexpr, SKIP_HIDDEN: tl.constexpr, BOUND: tl.constexpr,
):
    """Grid ``(query-block groups, column ranges x head parts, B * LH)``: a program scores ``BLOCK_R`` query
    blocks against the key blocks ``[c_begin, c_begin + cols_per_program)``, taking the max over the
    ``heads_per_part`` shared heads of its part; part ``p`` writes its maxima at ``S + p * part_stride`` (the
    select kernel takes the max over the parts; max is exact in any order, so the parts change no result).
    One column range and one part is the first version's grid (a program loops over every key block and
    every shared head)."""
    rb = tl.program_id(0)
    n_col_ranges = tl.cdiv(nk, cols_per_program)
    col_range = tl.program_id(1) % n_col_ranges
    part = tl.program_id(1) // n_col_ranges
    blh = tl.program_id(2)
    b = blh // LH
    lh = blh % LH
    offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)  # [R] query blocks
    r_ok = offs_r < nq
    q_last = tl.minimum((offs_r + 1) * BLOCK_Q, Lq) - 1 + q_offset  # [R] last position of each query block
    # the last key position any of these query blocks can see: key chunks starting after it are all -inf
    last_seen = tl.max(tl.where(r_ok, q_last, 0))
    c_begin = col_range * cols_per_program
    c_end = tl.minimum(c_begin + cols_per_program, nk)
    S_PART = S + part.to(tl.int64) * part_stride
    for c0 in range(c_begin, c_end, BLOCK_C):
        offs_c = c0 + tl.arange(0, BLOCK_C)  # [C] key blocks
        c_ok = offs_c < c_end
        g_begin = part * heads_per_part
        g_end = tl.minimum(g_begin + heads_per_part, n_shared)
        if SKIP_HIDDEN and CAUSAL:  # a chunk that starts after every row's last position: no GEMM, only -inf
            g_end = tl.where(c0 * BLOCK_K > last_seen, g_begin, g_end)
        b_s = _score_tile(Q_MEAN, K_MEAN, K_MIN, K_MAX, b, lh, offs_r, r_ok, offs_c, c_ok, g_begin, g_end,
                          Hq, Hkv, group, n_shared, nq, nk, Lq, q_offset, scale,
                          HEAD_DIM, BLOCK_Q, BLOCK_K, CAUSAL, BOUND)  # [R, C]
        out = (blh.to(tl.int64) * nq + offs_r[:, None]) * nk + offs_c[None, :]
        tl.store(S_PART + out, b_s, mask=r_ok[:, None] & c_ok[None, :])


@triton.jit
def _sort_key(x):
    # float32 -> int32 with the same order: flip the magnitude bits of negative floats
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)


@triton.jit
def _kth_key(b_key, pool, k):
    """Per row of ``b_key [R, N]``: the largest sort key ``t`` with at least ``k [R]`` members of ``pool`` at
    or above it (33 halvings of the int32 key range; ``k = 0`` gives the key of +inf, so nothing lies above
    it). Returns ``[R, 1]``."""
    R: tl.constexpr = b_key.shape[0]
    b_pool = tl.where(pool, b_key, -2139095041).to(tl.int64)  # outside the pool: the key of -inf, never counted
    lo = tl.full([R, 1], -2139095041 + 1, tl.int64)  # _sort_key(-inf) + 1: the smallest finite score's key
    hi = tl.full([R, 1], 2139095040, tl.int64)  # _sort_key(+inf)
    for _step in range(33):
        mid = (lo + hi + 1) >> 1
        ok = tl.sum((b_pool >= mid).to(tl.int32), 1, keep_dims=True) >= k[:, None]
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    return lo.to(tl.int32)


@triton.jit
def _top_k(b_key, pool, k):
    """Bool ``[R, N]``: the ``k [R]`` best members of ``pool`` per row; ties at the k-th key go to the lower
    column."""
    t = _kth_key(b_key, pool, k)
    above = pool & (b_key > t)
    ties = pool & (b_key == t)
    tie_rank = tl.cumsum(ties.to(tl.int32), 1) - 1
    return above | (ties & (tie_rank < (k - tl.sum(above.to(tl.int32), 1))[:, None]))


@triton.jit
def _mass_count(b_s, b_key, visible, forced, cand, n_cand, threshold):
    """Per row: how many of the best candidates the threshold rule keeps. Walking them by score (ties: lower
    block), a candidate is kept while the softmax mass of the pooled scores kept before it (forced blocks
    included) is below ``threshold``."""
    R: tl.constexpr = b_s.shape[0]
    m = tl.max(tl.where(visible, b_s, float("-inf")), 1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a row that sees nothing (padding rows): no inf - inf
    b_p = tl.where(visible, tl.math.exp2((b_s - m[:, None]) * LOG2E), 0.0)
    total = tl.sum(b_p, 1)
    b_p = b_p / tl.where(total > 0.0, total, 1.0)[:, None]
    forced_mass = tl.sum(tl.where(forced, b_p, 0.0), 1)  # [R]
    need = threshold - forced_mass
    # the largest key t whose candidates at or above it carry at least `need`
    lo = tl.full([R], -2139095041 + 1, tl.int64)
    hi = tl.full([R], 2139095040, tl.int64)
    for _step in range(33):
        mid = lo + (hi - lo + 1) // 2
        mass = tl.sum(tl.where(cand & (b_key >= mid.to(tl.int32)[:, None]), b_p, 0.0), 1)
        ok = mass >= need
        lo = tl.where(ok, mid, lo)
        hi = tl.where(ok, hi, mid - 1)
    t = lo.to(tl.int32)[:, None]
    above = cand & (b_key > t)
    mass_above = tl.sum(tl.where(above, b_p, 0.0), 1)
    ties = cand & (b_key == t)
    p_tie = tl.max(tl.where(ties, b_p, 0.0), 1)  # equal scores have equal mass
    tie_rank = tl.cumsum(ties.to(tl.int32), 1) - 1
    before = (forced_mass + mass_above)[:, None] + tie_rank.to(tl.float32) * p_tie[:, None]
    n = tl.sum(above.to(tl.int32), 1) + tl.sum((ties & (before < threshold)).to(tl.int32), 1)
    reachable = forced_mass + tl.sum(tl.where(cand, b_p, 0.0), 1) >= threshold
    n = tl.where(reachable, n, n_cand)  # rounding left the threshold out of reach: every candidate
    return tl.where(need <= 0.0, 0, n)


@triton.jit
def _write_ascending(take, offs, OUT_INDEX, rows, width, r_ok, ZERO_PAD: tl.constexpr):
    """Store, per row, the column indices where ``take [R, N]`` holds at slots 0, 1, ... (ascending) of
    ``OUT_INDEX[rows]``; return the counts ``[R]``. ``ZERO_PAD``: also write 0 into the row's unused slots
    (``count .. width - 1``; ``width <= N``), so the caller needs no zero-filled buffer (one launch less)."""
    pos = tl.cumsum(take.to(tl.int32), 1) - 1
    tl.store(OUT_INDEX + rows[:, None] * width + pos, tl.broadcast_to(offs[None, :], pos.shape),
             mask=take & r_ok[:, None])
    n = tl.sum(take.to(tl.int32), 1)
    if ZERO_PAD:
        pad = (offs[None, :] >= n[:, None]) & (offs[None, :] < width) & r_ok[:, None]  # [R, N] slots
        tl.store(OUT_INDEX + rows[:, None] * width + offs[None, :], tl.zeros(pad.shape, tl.int32), mask=pad)
    return n


@triton.jit
def _select_rows(b_s, i, r_ok, rows, offs, KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX,
                 nk, Lq, Lk, q_offset, topk, capacity, local, sinks, threshold, W, FW,
                 BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, CAUSAL: tl.constexpr, MEMBER: tl.constexpr,
                 HAS_THRESHOLD: tl.constexpr, ZERO_PAD: tl.constexpr):
    """The selection of query blocks ``i [R]`` from their scores ``b_s [R, NK]`` (-inf: not visible; key
    blocks ``offs [NK]``): forced blocks, the top-k / threshold rule, the lists written ascending (partial and
    full tiles, or every tile partial for ``MEMBER``) at list rows ``rows [R]`` and their counts."""
    R: tl.constexpr = b_s.shape[0]
    visible = b_s > float("-inf")  # the scores wrote -inf where the block cannot be seen
    j = offs[None, :]
    forced = visible & forced_blocks(j, i[:, None], Lq, q_offset, nk, local, sinks, BLOCK_Q, BLOCK_K)
    cand = visible & (forced == 0)
    n_cand = tl.sum(cand.to(tl.int32), 1)
    k = tl.minimum(tl.minimum(topk, capacity - tl.sum(forced.to(tl.int32), 1)), n_cand)  # [R]
    b_key = _sort_key(b_s)
    if HAS_THRESHOLD:
        k = tl.minimum(k, _mass_count(b_s, b_key, visible, forced, cand, n_cand, threshold))
    take = forced | _top_k(b_key, cand, k)  # every candidate above the k-th score; ties in block order
    if MEMBER:  # every tile is masked: the member bits decide per row
        n_partial = _write_ascending(take, offs, KV_INDEX, rows, W, r_ok, ZERO_PAD)
        n_full = tl.zeros([R], tl.int32)
        if ZERO_PAD:  # the (unused) full list of a member selection: zeros
            _write_ascending(take & (j < 0), offs, FULL_INDEX, rows, FW, r_ok, ZERO_PAD)
    else:
        full = take
        if CAUSAL:  # full: the block's last key (clipped) is not after the query block's first position
            full = take & (tl.minimum((j + 1) * BLOCK_K, Lk) - 1 <= (i * BLOCK_Q + q_offset)[:, None])
        n_partial = _write_ascending(take & (full == 0), offs, KV_INDEX, rows, W, r_ok, ZERO_PAD)
        n_full = _write_ascending(full, offs, FULL_INDEX, rows, FW, r_ok, ZERO_PAD)
    tl.store(KV_COUNT + rows, n_partial, mask=r_ok)
    tl.store(FULL_COUNT + rows, n_full, mask=r_ok)


@triton.heuristics({"HAS_THRESHOLD": lambda a: a["threshold"] is not None})
@triton.jit
def select_kernel(
    S, KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX,
    nq, nk, Lq, Lk, q_offset, topk, capacity, local, sinks, threshold, W, FW, n_parts, part_stride,
    BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_NK: tl.constexpr, ROWS: tl.constexpr,
    CAUSAL: tl.constexpr, MEMBER: tl.constexpr, HAS_THRESHOLD: tl.constexpr, ZERO_PAD: tl.constexpr,
):
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R] query blocks
    r_ok = i < nq
    blh = tl.program_id(1)
    rows = blh.to(tl.int64) * nq + i  # [R]
    offs = tl.arange(0, BLOCK_NK)  # [NK] key blocks
    s_ptr = S + rows[:, None] * nk + offs[None, :]
    s_ok = r_ok[:, None] & (offs < nk)[None, :]
    b_s = tl.load(s_ptr, mask=s_ok, other=float("-inf"))  # [R, NK]
    for p in range(1, n_parts):  # the scores kernel split the shared heads into parts: their max
        b_s = tl.maximum(b_s, tl.load(s_ptr + p * part_stride, mask=s_ok, other=float("-inf")))
    _select_rows(b_s, i, r_ok, rows, offs, KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX,
                 nk, Lq, Lk, q_offset, topk, capacity, local, sinks, threshold, W, FW,
                 BLOCK_Q, BLOCK_K, CAUSAL, MEMBER, HAS_THRESHOLD, ZERO_PAD)


@triton.heuristics({"BOUND": lambda a: a["K_MIN"] is not None,
                    "HAS_THRESHOLD": lambda a: a["threshold"] is not None})
@triton.jit
def fused_select_kernel(
    Q_MEAN, K_MEAN, K_MIN, K_MAX, KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX,
    Hq, Hkv, group, LH, n_shared, nq, nk, Lq, Lk, q_offset, scale, topk, capacity, local, sinks, threshold, W, FW,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_NK: tl.constexpr,
    ROWS: tl.constexpr, CAUSAL: tl.constexpr, MEMBER: tl.constexpr, HAS_THRESHOLD: tl.constexpr,
    ZERO_PAD: tl.constexpr, BOUND: tl.constexpr,
):
    """``block_scores_kernel`` and ``select_kernel`` in one launch: a program scores its ``ROWS`` query blocks
    against all ``nk`` key blocks itself (the same ``_score_tile``, over every shared head) and selects from
    the scores in registers, so no score matrix goes through memory. Grid ``(cdiv(nq, ROWS), B * LH)``."""
    i = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # [R] query blocks
    r_ok = i < nq
    blh = tl.program_id(1)
    b = blh // LH
    lh = blh % LH
    rows = blh.to(tl.int64) * nq + i  # [R]
    offs = tl.arange(0, BLOCK_NK)  # [NK] key blocks
    b_s = _score_tile(Q_MEAN, K_MEAN, K_MIN, K_MAX, b, lh, i, r_ok, offs, offs < nk, 0, n_shared,
                      Hq, Hkv, group, n_shared, nq, nk, Lq, q_offset, scale,
                      HEAD_DIM, BLOCK_Q, BLOCK_K, CAUSAL, BOUND)  # [R, NK]
    b_s = tl.where(r_ok[:, None], b_s, float("-inf"))  # rows past nq: nothing visible, as select_kernel loads them
    _select_rows(b_s, i, r_ok, rows, offs, KV_COUNT, KV_INDEX, FULL_COUNT, FULL_INDEX,
                 nk, Lq, Lk, q_offset, topk, capacity, local, sinks, threshold, W, FW,
                 BLOCK_Q, BLOCK_K, CAUSAL, MEMBER, HAS_THRESHOLD, ZERO_PAD)


@triton.heuristics({"BOUND": lambda a: a["K_MIN"] is not None})
@triton.jit
def member_kernel(
    Q, K_MEAN, K_MIN, K_MAX, KV_COUNT, KV_INDEX, ROW_SLOT,
    stride_qb, stride_qh, stride_qm,
    Hq, Hkv, group, LH, n_shared, nq, nk, Lq, q_offset, local, sinks, member_topk, W,
    HEAD_DIM: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_M: tl.constexpr,
    W_PAD: tl.constexpr, CAUSAL: tl.constexpr, BOUND: tl.constexpr,
):
    pid = tl.program_id(0)
    blh = tl.program_id(1)
    b = blh // LH
    lh = blh % LH
    m_start = pid * BLOCK_M  # BLOCK_M divides BLOCK_Q: the rows share one query block
    i = m_start // BLOCK_Q
    row = blh.to(tl.int64) * nq + i
    offs_m = m_start + tl.arange(0, BLOCK_M)  # [BM] local query rows
    m_ok = offs_m < Lq
    offs_w = tl.arange(0, W_PAD)  # [WP] slots of the query block's selection
    n_sel = tl.load(KV_COUNT + row)
    listed = offs_w < n_sel
    b_blk = tl.load(KV_INDEX + row * W + offs_w, mask=listed, other=0)  # [WP] selected key blocks
    # per-row scores against the selected blocks' pooled keys, max over the heads sharing the selection
    b_s = tl.full([BLOCK_M, W_PAD], float("-inf"), tl.float32)
    for g in range(0, n_shared):
        hq = lh * n_shared + g
        hkv = hq // group
        q_base = Q + b.to(tl.int64) * stride_qb + hq.to(tl.int64) * stride_qh
        k_rows = (b * Hkv + hkv).to(tl.int64) * nk + b_blk  # [WP]
        # the rows' own queries [BM, D] (one whole-D dot: W_PAD key blocks are few)
        b_s = tl.maximum(b_s, _pooled_scores(q_base, offs_m.to(tl.int64) * stride_qm, m_ok, K_MEAN, K_MIN, K_MAX,
                                             k_rows, listed, HEAD_DIM, HEAD_DIM, BOUND))
    usable = listed[None, :] & m_ok[:, None]  # [BM, WP]
    if CAUSAL:  # a row cannot use a block that starts after it
        usable = usable & (b_blk[None, :] * BLOCK_K <= offs_m[:, None] + q_offset)
    forced = listed & forced_blocks(b_blk, i, Lq, q_offset, nk, local, sinks, BLOCK_Q, BLOCK_K)  # [WP]
    cand = usable & (forced[None, :] == 0)  # [BM, WP]
    k = tl.minimum(tl.sum(cand.to(tl.int32), 1), member_topk)  # [BM]
    chosen = _top_k(_sort_key(b_s), cand, k)  # this row's best, ties to the lower slot (= lower block)
    bits = (chosen | (forced[None, :] & m_ok[:, None])).to(tl.uint8)  # [BM, WP]
    out = ((blh.to(tl.int64) * Lq + offs_m[:, None]) * W + offs_w[None, :])
    tl.store(ROW_SLOT + out, bits, mask=m_ok[:, None] & (offs_w[None, :] < W))
