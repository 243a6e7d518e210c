"""Suite ``routing``: content routing plus block-sparse attention, against the pipeline a FlexAttention user
would write, in the same run.

The step (bf16, B=1, 16 heads, D=128, 128-token blocks, top-16 + 1 local + 1 sink blocks per query block,
one selection per KV head): **route** (pooled scores and the top-k, :func:`sparseattn.routing.select_blocks`),
**index** (the dynamic layout and its transposed lists), **attention forward** (and forward + backward),
each timed alone, then the whole step eager and replayed from one CUDA graph (forward, and forward +
backward). The baseline: compiled pooling + scores + ``torch.topk``, then ``BlockMask.from_kv_blocks``, then
compiled ``flex_attention`` (and its backward), same inputs, same selection rule (the diagonal block partial
with a causal mask_mod, the other chosen blocks full).

Sweeps: N = 4k ... 128k at top-16 (how the overhead share of route + index moves with N, and dense causal
attention on cuDNN beside it: where selecting stops paying), and top-k at
N = 32k with the recall of each selection (:func:`sparseattn.selection_recall` on sampled rows). Reuse:
one selection per query head, per KV head (GQA group of 4) and for all heads (route time, recall), and the
recall of a stale selection routed on inputs that drifted (what reusing across layers or steps costs).

Inputs are synthetic and stated as such: keys and queries lie around 64 shared topic directions, one topic
per 128-token block, with unit noise, so attention concentrates on a few blocks (random Gaussian inputs would
make every selection look equally poor). Speed does not depend on them; recall does.
"""
from __future__ import annotations

import math
import statistics
from typing import Callable, Optional

import torch

from .. import patterns as P
from ..ops import routed_attention, sparse_attention
from ..routing import FIRST, FUSED, route, route_kernels, select_blocks, selection_recall
from . import _common as C
from .record import Impl, Pass, Record

NAME = "routing"
DEFAULT_N = "4096,8192,16384,32768,65536,131072"
CONFIG_KIND = None  # no config sweep
HQ, HKV, D, DTYPE, BLOCK = 16, 16, 128, torch.bfloat16, 128
TOPK, LOCAL, SINKS, SHARE = 16, 1, 1, "kv_head"
MAIN_N = 32768  # the shape: every term, both passes, graphs, the sync check
TOPKS = [4, 8, 16, 32, 64]
REUSE_HKV = 4  # GQA: 16 query heads on 4 KV heads for the head-sharing rows
DRIFTS = [0.1, 0.3, 0.5]  # stale selections: routed on inputs with this share of fresh noise mixed in
RECALL_ROWS = 512  # sampled query rows per recall
TOPICS, CONTRAST = 64, 5.5  # synthetic inputs: topic directions, logit gap of a matching key
COLUMNS = ["N", "topk", "route", "route_again", "route_first", "route_fused", "index", "index_first", "transpose",
           "fwd", "step", "step_graph", "overhead", "added", "flex_route", "flex_index", "flex_fwd", "flex_step",
           "flex_step_graph", "speedup", "eager_speedup", "train_graph", "flex_train", "train_speedup",
           "cudnn_causal", "recall"]


def routing_inputs(B: int, Hq: int, Hkv: int, N: int, D: int, dtype, device, seed: int = 0,
                   block: Optional[int] = None):
    """Synthetic q, k, v ``[B, H, N, D]``: every ``block`` keys (queries) share one of ``TOPICS`` directions per
    KV head (a query head uses its KV head's directions), scaled so that a matching query-key pair scores
    ``CONTRAST`` above an unrelated one after the ``1/sqrt(D)`` scale, plus unit Gaussian noise."""
    block = BLOCK if block is None else block
    g = torch.Generator(device="cpu").manual_seed(seed)  # the small tables: topic directions and choices
    noise = torch.Generator(device=device).manual_seed(seed)  # the large ones, drawn where they live
    nb = math.ceil(N / block)
    topic = torch.randn(Hkv, TOPICS, D, generator=g)
    topic = topic / topic.norm(dim=-1, keepdim=True) * math.sqrt(CONTRAST * math.sqrt(D))
    k_topic = torch.randint(TOPICS, (B, Hkv, nb), generator=g)
    q_topic = torch.randint(TOPICS, (B, Hq, nb), generator=g)
    topic, k_topic, q_topic = topic.to(device), k_topic.to(device), q_topic.to(device)
    heads = torch.arange(Hkv, device=device).view(1, Hkv, 1)
    q_heads = (torch.arange(Hq, device=device) // (Hq // Hkv)).view(1, Hq, 1)
    k_dir = topic[heads, k_topic].repeat_interleave(block, 2)[:, :, :N]  # [B, Hkv, N, D]
    q_dir = topic[q_heads, q_topic].repeat_interleave(block, 2)[:, :, :N]
    k = (k_dir + torch.randn(B, Hkv, N, D, generator=noise, device=device)).to(dtype)
    q = (q_dir + torch.randn(B, Hq, N, D, generator=noise, device=device)).to(dtype)
    v = torch.randn(B, Hkv, N, D, generator=noise, device=device).to(dtype)
    return q, k, v


def _compile(fn: Callable) -> Callable:
    """``torch.compile`` of a baseline function (a test replaces it with the identity on the CPU)."""
    return torch.compile(fn, dynamic=False)


class FlexPipeline:
    """What a FlexAttention user writes for the same step: compiled pooling, block scores and ``torch.topk``
    (forced sink and local blocks by +inf), ``BlockMask.from_kv_blocks`` (the diagonal block partial with a
    causal mask_mod, the other chosen blocks full), compiled ``flex_attention``."""

    def __init__(self, q, k, v, topk: int, local: int, sinks: int, block: int):
        B, Hq, N, Dh = q.shape
        Hkv = k.shape[1]
        G, n = Hq // Hkv, N // block
        self.q, self.k, self.v, self.N, self.block, self.G = q, k, v, N, block, G
        width = min(n, topk + local + sinks - 1)  # full tiles: every chosen block but the diagonal
        scale = 1.0 / math.sqrt(Dh)

        def select(q, k):
            qp = q.view(B, Hkv, G, n, block, Dh).float().mean(4)  # [B, Hkv, G, n, D]
            kp = k.view(B, Hkv, n, block, Dh).float().mean(3)  # [B, Hkv, n, D]
            s = torch.einsum("bhgid,bhjd->bhgij", qp, kp).amax(2) * scale  # [B, Hkv, n, n]
            i = torch.arange(n, device=q.device)[:, None]
            j = torch.arange(n, device=q.device)[None, :]
            forced = (j < sinks) | ((j > i - local) & (j < i))
            s = torch.where(forced, torch.full_like(s, float("inf")), s).masked_fill(j >= i, float("-inf"))
            vals, idx = torch.topk(s, width, dim=-1)
            full_num = (vals > float("-inf")).sum(-1, dtype=torch.int32)
            full_idx = torch.nn.functional.pad(idx.to(torch.int32), (0, n - width))  # from_kv_blocks wants n
            kv_num = torch.ones(B, Hkv, n, dtype=torch.int32, device=q.device)
            kv_idx = torch.nn.functional.pad(i.expand(B, Hkv, n, 1).to(torch.int32), (0, n - 1))
            if G > 1:  # the block mask is per query head
                kv_num, kv_idx, full_num, full_idx = (t.repeat_interleave(G, 1) for t in
                                                      (kv_num, kv_idx, full_num, full_idx))
            return kv_num, kv_idx, full_num, full_idx
        self.select = _compile(select)
        self.flex = C.compiled_flex()
        self.causal = P.causal()

    def route(self):
        return self.select(self.q, self.k)

    def index(self, lists):
        from torch.nn.attention.flex_attention import BlockMask
        return BlockMask.from_kv_blocks(*lists, BLOCK_SIZE=self.block, mask_mod=self.causal,
                                        seq_lengths=(self.N, self.N))

    def attend(self, block_mask, q=None, k=None, v=None):
        kw = {"enable_gqa": True} if self.G > 1 else {}
        return self.flex(self.q if q is None else q, self.k if k is None else k, self.v if v is None else v,
                         block_mask=block_mask, **kw)

    def step(self, q=None, k=None, v=None):
        return self.attend(self.index(self.route()), q, k, v)


def _timed(fn: Callable, what: str, errors: dict) -> Optional[float]:
    """``C.time_gpu(fn)``, or None with the reason in ``errors[what]`` if it fails (one failed baseline must not
    end a 10-minute run)."""
    try:
        return C.time_gpu(fn)
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        errors[what] = f"{type(e).__name__}: {str(e)[:300]}"
        C.note(f"{what} failed: {errors[what]}")
        C.empty_cache()
        return None


def _graph(fn: Callable, what: str, errors: dict):
    """``(graph, output of the captured call)`` or ``(None, None)`` with the reason in ``errors``."""
    out = []
    try:
        graph = C.graph_step(lambda: out.append(fn()))
        return graph, out[-1]
    except Exception as e:  # noqa: BLE001
        errors[what] = f"{type(e).__name__}: {str(e)[:300]}"
        C.note(f"capturing {what} failed: {errors[what]}")
        return None, None


PAIRED_ROUNDS = 7  #: rounds of :func:`paired_added_ms`


def paired_added_ms(base: Callable, step: Callable, errors: dict, rounds: int = PAIRED_ROUNDS) -> Optional[dict]:
    """What ``step`` adds to ``base`` (two CUDA-graph replays: the routed step, and the attention forward alone
    on its layout): each round times one right after the other, and the median of the per-round differences
    is kept: two medians measured minutes apart can differ by a few percent (clocks, the run's other work),
    the size of what is measured here.
    ``{"base_ms", "step_ms", "added_ms", "share", "rounds", "spread"}`` (medians; ``share`` = added / step;
    ``spread``: the lowest and highest per-round difference), None with the reason in ``errors``."""
    try:
        pairs = [(C.time_gpu(base), C.time_gpu(step)) for _ in range(rounds)]
    except Exception as e:  # noqa: BLE001
        errors["paired"] = f"{type(e).__name__}: {str(e)[:300]}"
        return None
    added = [s - b for b, s in pairs]
    step_ms = statistics.median(s for _, s in pairs)
    return {"base_ms": statistics.median(b for b, _ in pairs), "step_ms": step_ms,
            "added_ms": statistics.median(added), "share": statistics.median(added) / step_ms,
            "rounds": rounds, "spread": [min(added), max(added)]}


def sync_free(fn: Callable) -> Optional[bool]:
    """Whether ``fn`` runs without a host synchronisation (``torch.cuda.set_sync_debug_mode("error")``), None
    off CUDA."""
    if not torch.cuda.is_available():
        return None
    fn()  # compile and allocate first: only the steady state counts
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return True
    except RuntimeError:
        return False
    finally:
        torch.cuda.set_sync_debug_mode(0)
        torch.cuda.synchronize()


def _record(records, case, impl, pass_, ms, errors, key, **extra):
    if ms is None:
        extra["error"] = errors.get(key, "not measured")
    records.append(Record(case, impl, pass_, ms, extra))


def _fmt(x, digits=3):
    return "" if x is None else round(x, digits)


def routed_index(sel):
    """The index term: the layout of a selection with the transposed lists the backward walks (a routed layout
    builds them on first use, so a forward-only step skips them; FlexAttention's ``BlockMask`` always builds
    its transposes)."""
    layout = sel.to_layout()
    layout.transposed_lists()
    return layout


def _case(args, N: int, topk: int, full: bool, records: list) -> dict:
    """One (N, topk): our terms and step, Flex's; with ``full`` (the main shape), both passes, the training
    graph, the sync check and the recall of drifted selections too."""
    dev = args.device
    q, k, v = routing_inputs(1, HQ, HKV, N, D, DTYPE, dev)
    case = {"pattern": "routed", "N": N, "B": 1, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bf16", "block": BLOCK,
            "topk": topk, "local": LOCAL, "sinks": SINKS, "share": SHARE, "semantics": "block"}
    kw = dict(block_q=BLOCK, block_k=BLOCK, topk=topk, local=LOCAL, sinks=SINKS, share=SHARE)
    errors, row = {}, {"N": N, "topk": topk}
    sel = select_blocks(q, k, **kw)
    layout = sel.to_layout()
    tiles = int(layout.kv_count.sum() + layout.full_count.sum())  # physical tiles per KV head set
    ms_route = _timed(lambda: select_blocks(q, k, **kw), "route", errors)
    ms_index = _timed(lambda: routed_index(sel), "index", errors)
    ms_fwd = _timed(lambda: sparse_attention(q, k, v, layout), "fwd", errors)
    ms_step = _timed(lambda: sparse_attention(q, k, v, route(q, k, **kw)), "step", errors)
    graph, o_graph = _graph(lambda: sparse_attention(q, k, v, route(q, k, **kw)), "step graph", errors)
    ms_graph = _timed(graph.replay, "step graph", errors) if graph is not None else None
    rec = selection_recall(q, k, layout, sample=RECALL_ROWS)
    route_extra = {"recall": rec.mean(), "tiles": tiles, "recall_rows": rec.rows.numel()}
    if full:  # what a stale selection costs: routed on drifted inputs, measured on the current ones
        drift = {}
        for d in DRIFTS:
            g = torch.Generator(device=dev).manual_seed(1)
            mix = [(math.sqrt(1 - d * d) * t.float() + d * torch.randn(t.shape, generator=g, device=dev)).to(DTYPE)
                   for t in (q, k)]
            drift[str(d)] = selection_recall(q, k, route(*mix, **kw), sample=RECALL_ROWS).mean()
        route_extra["recall_drifted"] = drift
    index_extra = {}
    if full:  # where route's time goes, and the first version's kernels timed in the same process
        _route_ab(q, k, kw, sel, route_extra, index_extra, errors)
        # the main case measured again, after everything above: the first measurement of a run may carry a
        # first-call effect (clocks, allocator, caches); "ms" stays the first, "ms_again" is this one
        route_extra["ms_again"] = _timed(lambda: select_blocks(q, k, **kw), "route again", errors)
        index_extra["ms_again"] = _timed(lambda: routed_index(sel), "index again", errors)
    _record(records, case, Impl.OURS, Pass.ROUTE, ms_route, errors, "route", **route_extra)
    _record(records, case, Impl.OURS, Pass.INDEX, ms_index, errors, "index", **index_extra)
    if full:
        row.update(route_again=_fmt(route_extra["ms_again"], 4), route_first=_fmt(route_extra["ms_first_kernels"], 4),
                   route_fused=_fmt(route_extra["ms_fused_kernels"], 4),
                   index_first=_fmt(index_extra["ms_first_kernels"], 4))
    if full:  # the fused transpose alone (the target: <= 0.2 ms at N = 32k)
        ms_t = _timed(lambda: layout.transpose_fixed(layout.nq), "transpose", errors)
        _record(records, case, Impl.OURS, Pass.TRANSPOSE, ms_t, errors, "transpose")
        row["transpose"] = _fmt(ms_t, 4)
    _record(records, case, Impl.OURS, Pass.FWD, ms_fwd, errors, "fwd",
            tflops=tiles * HQ // layout.H * 4.0 * BLOCK * BLOCK * D / ms_fwd / 1e9 if ms_fwd else None)
    step_extra = {}
    if full:
        step_extra["sync_free"] = sync_free(lambda: sparse_attention(q, k, v, route(q, k, **kw)))
    _record(records, case, Impl.OURS, Pass.STEP, ms_step, errors, "step", **step_extra)
    graph_extra = {}
    if o_graph is not None:
        graph.replay()
        graph_extra["graph_equals_eager"] = bool(torch.equal(o_graph, sparse_attention(q, k, v, route(q, k, **kw))))
        if full:  # what routing adds to the step, as a difference of two graphs timed back to back
            fwd_graph, _ = _graph(lambda: sparse_attention(q, k, v, layout), "fwd graph", errors)
            if fwd_graph is not None:
                graph_extra["paired"] = paired_added_ms(fwd_graph.replay, graph.replay, errors)
    _record(records, case, Impl.OURS, Pass.STEP_GRAPH, ms_graph, errors, "step graph", **graph_extra)
    row.update(route=_fmt(ms_route, 4), index=_fmt(ms_index, 4), fwd=_fmt(ms_fwd), step=_fmt(ms_step),
               step_graph=_fmt(ms_graph), recall=round(rec.mean(), 3))
    if ms_route and ms_index and ms_graph:
        row["overhead"] = f"{(ms_route + ms_index) / ms_graph:.0%}"
    if graph_extra.get("paired"):
        row["added"] = f"{graph_extra['paired']['share']:.1%}"  # the step's graph beyond the forward's graph

    if full:
        _train(q, k, v, kw, layout, case, records, errors, row)
    if not args.no_flex:
        _flex(q, k, v, topk, full, case, records, errors, row, o_graph)
        # where routing pays: dense causal attention on the same inputs (cuDNN), the cost without selecting
        ms_dense = _timed(C.sdpa_fn(q, k, v, Impl.CUDNN, causal=True), "cudnn causal", errors)
        _record(records, {**case, "pattern": "causal"}, Impl.CUDNN, Pass.FWD, ms_dense, errors, "cudnn causal")
        row["cudnn_causal"] = _fmt(ms_dense)
    if row.get("flex_step") and ms_graph:
        row["speedup"] = round(row["flex_step"] / ms_graph, 2)  # Flex eager against our step in one graph
    if row.get("flex_step") and ms_step:
        row["eager_speedup"] = round(row["flex_step"] / ms_step, 2)  # both eager
    if row.get("flex_train") and row.get("train_graph"):
        row["train_speedup"] = round(row["flex_train"] / row["train_graph"], 2)
    return row


# device kernels of a route (select_blocks) and of its index (routed_index), by name, for profile_step
ROUTE_KERNELS = (r"pool_kernel", r"block_scores_kernel", r"select_kernel", r"fused_select_kernel", r"member_kernel")
INDEX_KERNELS = (r"transpose_kernel",)
#: pooling launch choices timed alone at the main shape: (rows a load (None: the block), blocks a program,
#: element-wise accumulation, warps); the first is the first version's, the second the current default
POOL_CHOICES = [(32, 1, False, 4), (None, 2, False, 8), (None, 1, False, 8), (None, 4, False, 8), (64, 2, True, 8),
                (None, 2, False, 4)]

def _pool_variants() -> dict:
    """The pool kernel variants ``--pool-sweep`` times (name -> ``routing.RouteKernels``; only the pool fields
    differ from CURRENT). Aimed at the read ceiling of Q + K: more bytes requested before the first reduction
    (``joint``: all of a program's blocks as one load), an even persistent grid over every SM for Q and K
    blocks alike (``pers<programs per SM>``) with its task loop software-pipelined ``s`` stages deep, and
    rows through TMA (``tma``). Names: ``b`` blocks a program/task, ``sub`` rows a load (the block if
    absent), ``acc`` element-wise accumulation, ``w`` warps."""
    from ..routing import CURRENT as CUR, FIRST as FST
    v = {"current": CUR, "first": FST}
    for name, kw in (
            ("joint_b2_w4", dict(pool_joint=True)),
            ("joint_b2_w8", dict(pool_joint=True, pool_warps=8)),
            ("joint_b4_sub64_w8", dict(pool_joint=True, pool_blocks=4, pool_sub=64, pool_warps=8)),
            ("joint_b4_sub32_acc_w8", dict(pool_joint=True, pool_blocks=4, pool_sub=32, pool_row_acc=True,
                                           pool_warps=8)),
            ("joint_b2_sub64_acc_w4", dict(pool_joint=True, pool_sub=64, pool_row_acc=True)),
            ("tma_b2_w4", dict(pool_tma=True)),
            ("tma_b4_sub64_w4", dict(pool_tma=True, pool_blocks=4, pool_sub=64)),
            # pointer loads, persistent: Triton 3.6 does not software-pipeline loads that feed no dot (compiled
            # for sm90: no cp.async, no shared memory at any num_stages), so these keep pool_stages = 1 and put
            # bytes in flight by programs per SM and blocks a task instead
            ("pers2_b1_w4", dict(pool_persistent=2, pool_blocks=1)),
            ("pers4_b2_w4", dict(pool_persistent=4, pool_blocks=2)),
            ("pers4_b1_sub64_w4", dict(pool_persistent=4, pool_blocks=1, pool_sub=64)),
            ("pers8_b1_sub64_w4", dict(pool_persistent=8, pool_blocks=1, pool_sub=64)),
            ("pers4_b1_sub32_acc_w4", dict(pool_persistent=4, pool_blocks=1, pool_sub=32, pool_row_acc=True)),
            ("pers2_joint_b2_w8", dict(pool_persistent=2, pool_joint=True, pool_warps=8)),
            # by hand: the next block loaded before this one is reduced (two blocks in flight per program)
            ("pers2_prefetch_w4", dict(pool_persistent=2, pool_blocks=1, pool_prefetch=True)),
            ("pers2_prefetch_w8", dict(pool_persistent=2, pool_blocks=1, pool_prefetch=True, pool_warps=8)),
            ("pers4_prefetch_w8", dict(pool_persistent=4, pool_blocks=1, pool_prefetch=True, pool_warps=8)),
            # TMA, persistent: descriptor loads are pipelined (s - 1 boxes in flight per program, in shared memory)
            ("pers1_s4_tma_b1_w4", dict(pool_persistent=1, pool_blocks=1, pool_tma=True, pool_stages=4)),
            ("pers2_s3_tma_b1_w4", dict(pool_persistent=2, pool_blocks=1, pool_tma=True, pool_stages=3)),
            ("pers2_s2_tma_b1_w8", dict(pool_persistent=2, pool_blocks=1, pool_tma=True, pool_stages=2,
                                        pool_warps=8)),
            ("pers2_s4_tma_b1_sub64_w4", dict(pool_persistent=2, pool_blocks=1, pool_tma=True, pool_sub=64,
                                              pool_stages=4)),
            ("pers3_s2_tma_b1_w4", dict(pool_persistent=3, pool_blocks=1, pool_tma=True, pool_stages=2)),
    ):
        v[name] = CUR._replace(**kw)
    return v


#: what ``python -m sparseattn.bench routing --pool-sweep`` times (and the CPU tests check against the reference)
POOL_VARIANTS = _pool_variants()


def _route_profile(fn, errors: dict, what: str) -> Optional[dict]:
    """``roofline.profile_step`` of ``fn`` (a route, then its index) as JSON: device ms per kernel name, the
    route / index buckets, wall time; None with the reason in ``errors`` if the profiler fails."""
    from ..roofline import profile_step
    try:
        return profile_step(fn, warmup=3, route=ROUTE_KERNELS, index=INDEX_KERNELS).as_dict()
    except Exception as e:  # noqa: BLE001 - recorded, the run goes on
        errors[what] = f"{type(e).__name__}: {str(e)[:300]}"
        C.note(f"{what} failed: {errors[what]}")
        return None


def _route_ab(q, k, kw: dict, sel, route_extra: dict, index_extra: dict, errors: dict) -> None:
    """At the main shape: route and index with the first version's launches (``routing.FIRST``) beside the
    current ones, each term alone (pool, scores, select), pooling under several launch choices, and a
    ``torch.profiler`` split of both versions by kernel (device time per kernel, no host time). The fused
    scores + select (``routing.FUSED``): its route (``ms_fused_kernels``), its terms (pool, fused_select)
    and its profile, beside the same rows of CURRENT."""
    from .. import routing as R
    spec = R.check_route(q, k, kw["block_q"], kw["block_k"], kw["topk"], None, True, kw["local"], kw["sinks"],
                         kw["share"], "mean", "block", None, None, None)
    route_extra["kernels"] = R.CURRENT._asdict()
    for name, kn in (("current", R.CURRENT), ("first", R.FIRST), ("fused", R.FUSED)):
        with R.route_kernels(kn):
            if name != "current":
                route_extra[f"ms_{name}_kernels"] = _timed(lambda: select_blocks(q, k, **kw), f"route {name}", errors)
            if name == "first":
                index_extra["ms_first_kernels"] = _timed(lambda: routed_index(sel), "index first", errors)
            pooled = R._pool(q, k, spec)
            terms = {"pool": _timed(lambda: R._pool(q, k, spec), f"pool {name}", errors)}
            if name == "fused":
                # whether FUSED launched the fused kernel at this shape (else it took the two launches), and
                # whether its lists are CURRENT's bit for bit (the CPU tests' claim, checked at this size)
                route_extra["fused_fits"] = R.fused_fits(spec)
                route_extra["fused_equals_current"] = all(
                    bool(torch.equal(a, b)) for a, b in zip(select_blocks(q, k, **kw)[:4], sel[:4]))
                terms["fused_select"] = (_timed(lambda: R._fused_select(pooled, spec), "fused select", errors)
                                         if route_extra["fused_fits"] else None)
            else:
                parts = R._score_parts(pooled, spec)
                terms["scores"] = _timed(lambda: R._score_parts(pooled, spec), f"scores {name}", errors)
                terms["select"] = _timed(lambda: R._select(parts, spec), f"select {name}", errors)
            route_extra[f"terms_{name}"] = terms
            route_extra[f"profile_{name}"] = _route_profile(lambda: routed_index(select_blocks(q, k, **kw)), errors,
                                                           f"profile {name}")
    pool_rows = []
    for sub, blocks, row_acc, warps in POOL_CHOICES:
        kn = R.CURRENT._replace(pool_sub=sub, pool_blocks=blocks, pool_row_acc=row_acc, pool_warps=warps)
        ms = _timed(lambda: R._pool(q, k, spec, kn), f"pool {sub},{blocks},{row_acc},{warps}", errors)
        pool_rows.append({"sub": sub, "blocks": blocks, "row_acc": row_acc, "warps": warps, "ms": ms})
    read_bytes = (q.numel() + k.numel()) * q.element_size()
    for r in pool_rows:  # what each choice reads per second: Q and K once
        r["tbps"] = read_bytes / r["ms"] / 1e9 if r["ms"] else None
    route_extra["pool_choices"] = pool_rows


POOL_COLUMNS = ["variant", "persistent", "blocks", "sub", "joint", "row_acc", "warps", "stages", "tma", "prefetch",
                "ms", "tbps", "of_read", "same_selection", "max_diff_vs_ref"]


def pool_sweep(args) -> tuple:
    """``--pool-sweep``: every :data:`POOL_VARIANTS` pool launch timed alone at the issue's shape (Q and K of
    ``MAIN_N`` tokens, ``pool="mean"``), beside the fastest streaming read of the same bytes
    (``C.best_read``), as ms and TB/s. Each variant's pooled blocks are compared with the eager torch
    pooling (``reference._pooled_blocks``, fp32) and its selection with CURRENT's, bit for bit (a variant
    that changed the routed blocks would not be a launch choice). Writes ``routing-pool-<gpu>.json``."""
    from .. import routing as R
    from ..reference import _pooled_blocks
    dev = args.device
    q, k, _ = routing_inputs(1, HQ, HKV, MAIN_N, D, DTYPE, dev)
    kw = dict(block_q=BLOCK, block_k=BLOCK, topk=TOPK, local=LOCAL, sinks=SINKS, share=SHARE)
    spec = R.check_route(q, k, BLOCK, BLOCK, TOPK, None, True, LOCAL, SINKS, SHARE, "mean", "block", None, None,
                         None)
    case = {"pattern": "routed", "N": MAIN_N, "B": 1, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bf16",
            "block": BLOCK, "pool": "mean"}
    read_bytes = (q.numel() + k.numel()) * q.element_size()
    records, table, errors = [], [], {}
    q_ref, k_ref = _pooled_blocks(q, BLOCK)[0], _pooled_blocks(k, BLOCK)[0]
    want = select_blocks(q, k, **kw)  # CURRENT's lists
    with C.progress(len(POOL_VARIANTS) + 1, f"{NAME} pool sweep") as bar:
        bar.set_postfix_str("streaming read of Q + K")
        try:
            ms_read, how = C.best_read([q, k], C.time_gpu)
        except Exception as e:  # noqa: BLE001 - the variants are still worth measuring
            ms_read, how = None, None
            errors["read"] = f"{type(e).__name__}: {str(e)[:300]}"
        _record(records, case, Impl.READ_CEILING, Pass.READ, ms_read, errors, "read", bytes=read_bytes, method=how,
                tbps=read_bytes / ms_read / 1e9 if ms_read else None)
        bar.update()
        for name, kn in POOL_VARIANTS.items():
            bar.set_postfix_str(name)
            extra = {"variant": name, "kernels": kn._asdict(), "bytes": read_bytes}
            try:
                q_mean, k_mean, _, _ = R._pool(q, k, spec, kn)
                extra["max_diff_vs_ref"] = max(float((q_mean - q_ref).abs().max()), float((k_mean - k_ref).abs().max()))
                with R.route_kernels(kn):
                    got = select_blocks(q, k, **kw)
                extra["same_selection"] = all(bool(torch.equal(a, b)) for a, b in zip(got[:4], want[:4]))
            except Exception as e:  # noqa: BLE001 - a variant that fails (compile, resources) is recorded
                errors[name] = f"{type(e).__name__}: {str(e)[:300]}"
                C.note(f"pool variant {name} failed: {errors[name]}")
                ms = None
            else:
                ms = _timed(lambda: R._pool(q, k, spec, kn), name, errors)
            extra["tbps"] = read_bytes / ms / 1e9 if ms else None
            extra["of_read"] = ms_read / ms if ms and ms_read else None  # share of the read ceiling reached
            _record(records, {**case, "variant": name}, Impl.OURS, Pass.POOL, ms, errors, name, **extra)
            table.append({"variant": name, "persistent": kn.pool_persistent, "blocks": kn.pool_blocks,
                          "sub": kn.pool_sub or BLOCK, "joint": int(kn.pool_joint), "row_acc": int(kn.pool_row_acc),
                          "warps": kn.pool_warps, "stages": kn.pool_stages, "tma": int(kn.pool_tma),
                          "prefetch": int(kn.pool_prefetch),
                          "ms": _fmt(ms, 4), "tbps": _fmt(extra["tbps"], 2), "of_read": _fmt(extra["of_read"], 2),
                          "same_selection": extra.get("same_selection"),
                          "max_diff_vs_ref": None if "max_diff_vs_ref" not in extra
                          else f"{extra['max_diff_vs_ref']:.1e}"})
            bar.update()
            C.empty_cache()
    table.sort(key=lambda r: (r["ms"] == "", r["ms"] if r["ms"] != "" else 0))  # fastest first, failures last
    table.append({"variant": "read ceiling", "ms": _fmt(ms_read, 4),
                  "tbps": _fmt(read_bytes / ms_read / 1e9 if ms_read else None, 2), "of_read": 1.0 if ms_read else ""})
    args.variant = "pool"  # routing-pool-<gpu>.json: never overwrites the recorded suite
    args.meta = {**getattr(args, "meta", {}), "read_method": how, "read_bytes": read_bytes}
    return records, table, POOL_COLUMNS


def _train(q, k, v, kw, layout, case, records, errors, row) -> None:
    """Forward + backward: the attention alone on a fixed layout, the whole routed step eager and from one
    CUDA graph."""
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    do = torch.randn_like(q)
    ms_fb = _timed(lambda: torch.autograd.grad(sparse_attention(qg, kg, vg, layout), (qg, kg, vg), do), "fwd+bwd",
                   errors)

    def train_step():
        return torch.autograd.grad(routed_attention(qg, kg, vg, **kw), (qg, kg, vg), do)
    ms_train = _timed(train_step, "train step", errors)
    extra = {"sync_free": sync_free(train_step)}
    graph, grads = _graph(train_step, "train graph", errors)
    ms_train_graph = _timed(graph.replay, "train graph", errors) if graph is not None else None
    graph_extra = {}
    if grads is not None:
        graph.replay()
        graph_extra["graph_equals_eager"] = all(bool(torch.equal(a, b)) for a, b in zip(grads, train_step()))
    _record(records, case, Impl.OURS, Pass.FWD_BWD, ms_fb, errors, "fwd+bwd")
    _record(records, case, Impl.OURS, Pass.TRAIN_STEP, ms_train, errors, "train step", **extra)
    _record(records, case, Impl.OURS, Pass.TRAIN_STEP_GRAPH, ms_train_graph, errors, "train graph", **graph_extra)
    row["train_graph"] = _fmt(ms_train_graph)


def _flex(q, k, v, topk, full, case, records, errors, row, o_ours) -> None:
    """The FlexAttention pipeline on the same inputs: each term, the step eager and (if it captures) in a CUDA
    graph; with ``full`` its forward + backward too."""
    try:
        flex = FlexPipeline(q, k, v, topk, LOCAL, SINKS, BLOCK)
        lists = flex.route()
        bm = flex.index(lists)
        o_flex = flex.attend(bm)
    except Exception as e:  # noqa: BLE001 - a baseline that cannot run is recorded, not fatal
        errors["flex"] = f"{type(e).__name__}: {str(e)[:300]}"
        C.note(f"flex pipeline failed: {errors['flex']}")
        for pass_ in (Pass.ROUTE, Pass.INDEX, Pass.FWD, Pass.STEP):
            _record(records, case, Impl.FLEX, pass_, None, errors, "flex")
        return
    ms_route = _timed(flex.route, "flex route", errors)
    ms_index = _timed(lambda: flex.index(lists), "flex index", errors)
    ms_fwd = _timed(lambda: flex.attend(bm), "flex fwd", errors)
    ms_step = _timed(flex.step, "flex step", errors)
    extra = {}
    if o_ours is not None:
        extra["rel_err_vs_ours"] = C.rel_err(o_flex, o_ours)  # near 0 when both chose the same blocks
    _record(records, case, Impl.FLEX, Pass.ROUTE, ms_route, errors, "flex route")
    _record(records, case, Impl.FLEX, Pass.INDEX, ms_index, errors, "flex index")
    _record(records, case, Impl.FLEX, Pass.FWD, ms_fwd, errors, "flex fwd", **extra)
    _record(records, case, Impl.FLEX, Pass.STEP, ms_step, errors, "flex step")
    row.update(flex_route=_fmt(ms_route, 4), flex_index=_fmt(ms_index, 4), flex_fwd=_fmt(ms_fwd),
               flex_step=_fmt(ms_step))
    if full:
        qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
        do = torch.randn_like(q)
        ms_fb = _timed(lambda: torch.autograd.grad(flex.attend(bm, qg, kg, vg), (qg, kg, vg), do), "flex fwd+bwd",
                       errors)
        ms_train = _timed(lambda: torch.autograd.grad(flex.step(qg, kg, vg), (qg, kg, vg), do), "flex train step",
                          errors)
        _record(records, case, Impl.FLEX, Pass.FWD_BWD, ms_fb, errors, "flex fwd+bwd")
        _record(records, case, Impl.FLEX, Pass.TRAIN_STEP, ms_train, errors, "flex train step")
        row["flex_train"] = _fmt(ms_train)


def _flex_graph(args, N: int, records: list, table: list) -> None:
    """The Flex pipeline's step captured in one CUDA graph, if it captures: measured last, because a failed
    capture may leave the CUDA context unusable for what follows."""
    q, k, v = routing_inputs(1, HQ, HKV, N, D, DTYPE, args.device)
    case = {"pattern": "routed", "N": N, "B": 1, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bf16", "block": BLOCK,
            "topk": TOPK, "local": LOCAL, "sinks": SINKS, "share": SHARE, "semantics": "block"}
    errors = {}
    try:
        flex = FlexPipeline(q, k, v, TOPK, LOCAL, SINKS, BLOCK)
        flex.step()
    except Exception as e:  # noqa: BLE001
        errors["flex step graph"] = f"{type(e).__name__}: {str(e)[:300]}"
        ms = None
    else:
        graph, _ = _graph(flex.step, "flex step graph", errors)
        ms = _timed(graph.replay, "flex step graph", errors) if graph is not None else None
    _record(records, case, Impl.FLEX, Pass.STEP_GRAPH, ms, errors, "flex step graph")
    for row in table:
        if row["N"] == N and row["topk"] == TOPK:
            row["flex_step_graph"] = _fmt(ms)


def _reuse(args, records: list, table: list) -> None:
    """One selection per query head, per KV head, for all heads (GQA, 4 query heads per KV head): what routing
    costs and what the shared selection keeps of the full attention."""
    dev = args.device
    q, k, v = routing_inputs(1, HQ, REUSE_HKV, MAIN_N, D, DTYPE, dev, seed=2)
    for share in ("none", "kv_head", "all"):
        errors = {}
        kw = dict(block_q=BLOCK, block_k=BLOCK, topk=TOPK, local=LOCAL, sinks=SINKS, share=share)
        case = {"pattern": "routed", "N": MAIN_N, "B": 1, "Hq": HQ, "Hkv": REUSE_HKV, "D": D, "dtype": "bf16",
                "block": BLOCK, "topk": TOPK, "local": LOCAL, "sinks": SINKS, "share": share, "semantics": "block"}
        layout = route(q, k, **kw)
        ms_route = _timed(lambda: select_blocks(q, k, **kw), "route", errors)
        with route_kernels(FIRST):  # the first version's launches (share="all": 16 scores programs)
            ms_first = _timed(lambda: select_blocks(q, k, **kw), "route first", errors)
        with route_kernels(FUSED):  # scores inside the select program (share="all": a program loops 16 heads)
            ms_fused = _timed(lambda: select_blocks(q, k, **kw), "route fused", errors)
        ms_graph = None
        graph, _ = _graph(lambda: sparse_attention(q, k, v, route(q, k, **kw)), "step graph", errors)
        if graph is not None:
            ms_graph = _timed(graph.replay, "step graph", errors)
        recall = selection_recall(q, k, layout, sample=RECALL_ROWS).mean()
        _record(records, case, Impl.OURS, Pass.ROUTE, ms_route, errors, "route", recall=recall,
                layout_heads=layout.H, ms_first_kernels=ms_first, ms_fused_kernels=ms_fused)
        _record(records, case, Impl.OURS, Pass.STEP_GRAPH, ms_graph, errors, "step graph")
        table.append({"N": MAIN_N, "topk": f"{TOPK} share={share}", "route": _fmt(ms_route, 4),
                      "route_first": _fmt(ms_first, 4), "route_fused": _fmt(ms_fused, 4),
                      "step_graph": _fmt(ms_graph), "recall": round(recall, 3)})


def _checkpoint(args, records) -> None:
    """Write what is measured so far to ``routing-partial-<gpu>.json`` in ``--out``: if the run is stopped at
    its time limit, the main shape (measured first) is not lost."""
    out = getattr(args, "out", None)
    if out and records:
        C.write_json(NAME, records, out, C.environment(), variant="partial")


def run(args) -> tuple:
    """Measure the main shape first (every term, both passes, graphs, Flex), then the top-k sweep and the reuse
    rows at that N, then the other lengths; return (records, table rows, table columns). With
    ``args.pool_sweep``: only :func:`pool_sweep`."""
    if getattr(args, "pool_sweep", False):
        return pool_sweep(args)
    Ns = [int(x) for x in args.n.split(",")]
    main = MAIN_N if MAIN_N in Ns else Ns[len(Ns) // 2]
    records, table = [], []
    with C.progress(len(Ns) + len(TOPKS) - (TOPK in TOPKS) + 1 + (not args.no_flex), NAME) as bar:
        bar.set_postfix_str(f"N={main} topk={TOPK} (every term)")
        table.append(_case(args, main, TOPK, full=True, records=records))
        bar.update()
        _checkpoint(args, records)
        for topk in TOPKS:
            if topk == TOPK:
                continue
            bar.set_postfix_str(f"N={main} topk={topk}")
            table.append(_case(argparse_no_flex(args), main, topk, full=False, records=records))
            bar.update()
            C.empty_cache()
        bar.set_postfix_str("reuse across heads")
        _reuse(args, records, table)
        bar.update()
        _checkpoint(args, records)
        for N in Ns:
            if N == main:
                continue
            bar.set_postfix_str(f"N={N} topk={TOPK}")
            table.append(_case(args, N, TOPK, full=False, records=records))
            bar.update()
            _checkpoint(args, records)
            C.empty_cache()
        if not args.no_flex:
            bar.set_postfix_str(f"N={main}: the Flex step in a CUDA graph")
            _flex_graph(args, main, records, table)
            bar.update()
            _checkpoint(args, records)
    # the table, last on the console: the N sweep, then the top-k sweep, then the reuse rows
    def order(r):
        return (0, r["N"], 0) if r["topk"] == TOPK else (1, 0, r["topk"]) if isinstance(r["topk"], int) else (2, 0, 0)
    table.sort(key=order)
    return records, table, COLUMNS


def argparse_no_flex(args):
    """``args`` with the Flex baseline off (the top-k sweep measures ours and recall: a compiled Flex pipeline
    per top-k would not fit the run's ten minutes)."""
    import copy
    out = copy.copy(args)
    out.no_flex = True
    return out
