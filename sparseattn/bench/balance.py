"""Suite ``balance``: the forward on skewed layouts, plain grid vs split rows (``FwdConfig.split``: "auto" and
fixed chunks) vs FlexAttention on the same block mask and cuDNN on the causal envelope, each beside its
*ideal* balanced time and the roofline's prediction.

Cases (the load-balance issue's): documents with log-normal lengths packed into one sequence (64k and 128k
tokens), causal and (64 sinks or a 1024 window), a synthetic routed layout with heavy-tailed per-row counts
(a different selection per head), and causal at B=1 (16 heads at 64k; one head at 16k, a grid that does
not fill the GPU). B=1, bf16, D=128, 128 x 128 tiles.

``ideal_ms``: the per-tile time measured on a layout of long equal rows at the same length (32 full tiles
per row: every program busy to the end, no tail; with more heads than the case where its own would not give
every SM four programs, :func:`calibration_heads`) times the case's listed tiles. ``predicted_ms``: the
roofline's prediction of the same call (:func:`sparseattn.roofline.cost`; the split rows with the split
plan's tasks, workspace traffic and merge). Each of our rows also carries
:func:`sparseattn.balance.report` (per-program tiles, makespan over the SMs, tail share) and, for the split
rows, the chunk the planner chose and the tasks it made. Each case also runs the persistent variant of the
"auto" split (``FwdConfig.persistent``: a fixed grid of about two programs per SM looping over the same
tasks), recorded as a split row with ``"persistent": true`` (the other split rows say ``false``) and ``pull``
(programs pulling items from a counter, ``ops.split.PERSISTENT_PULL``, or dealt them in advance; files before
it: dealt). The routed case is also captured in a CUDA graph
on a dynamic layout of fixed capacity (``fwd (CUDA graph)``): replay time, the planner run under
``torch.cuda.set_sync_debug_mode("error")`` (no host sync), capacity vs tasks used. The same split forward also
runs from CUDA-graph buckets (:class:`sparseattn.balance.GraphBuckets`, case ``"routed buckets"``): routed
layouts of three lengths, each padded into the smallest of the power-of-two buckets N/4, N/2, N that holds it,
replay time per bucket beside the eager call and a graph at the exact length, and the capacity's waste.
"""
from __future__ import annotations

import math
from typing import Callable

import torch

from .. import _runtime
from .. import balance as BAL
from .. import patterns as P
from ..layout import BlockLayout
from ..ops import FwdConfig, sparse_attention
from ..ops._launch import num_sms
from ..ops.config import layout_default
from . import _common as C
from .record import Impl, Pass, Record

#: characters of an exception's message a failed row keeps (after its type name)
ERROR_CHARS = 200
NAME = "balance"
DEFAULT_N = "65536"  # the documents case also runs at twice this (128k); --n sets the base length
CONFIG_KIND = None
BLOCK = 128
EQUAL_ROW_TILES = 32  # tiles per row of the ideal's calibration layout
EQUAL_ROW_WAVES = 4  # the calibration runs at least this many programs per SM (calibration_heads)
SPLITS = ("auto", 16, 64)  # the split variants timed on every case
COLUMNS = ["case", "N", "H", "plain_ms", "split_ms", "persist_ms", "chunk", "best_split", "flex_ms", "cudnn_ms",
           "ideal_ms", "pred_ms", "plain/ideal", "split/ideal", "persist/ideal", "flex/split", "tail_plain",
           "tail_split"]

#: case name -> (query heads, length multiplier of --n)
CASES = {"documents lognormal": (16, 1), "documents lognormal 2N": (16, 2), "causal&(sinks64|window1024)": (16, 1),
         "routed skewed (synthetic)": (16, 1), "causal": (16, 1), "causal H=1 N/4": (1, 0.25)}


def doc_lengths(N: int, seed: int = 0, median: int = 2048, sigma: float = 1.2) -> torch.Tensor:
    """Document lengths drawn log-normal (``median``, log-space ``sigma``) until they fill ``N`` tokens; the
    last one is cut to fit."""
    g = torch.Generator().manual_seed(seed)
    out, total = [], 0
    while total < N:
        n = max(1, int(math.exp(math.log(median) + sigma * float(torch.randn(1, generator=g)))))
        n = min(n, N - total)
        out.append(n)
        total += n
    return torch.tensor(out)


def routed_block_mask(N: int, H: int, seed: int = 0, alpha: float = 1.1, base: int = 4) -> torch.Tensor:
    """A synthetic routed selection ``[1, H, nq, nq]`` (causal): query tile i of head h keeps its diagonal
    tile and ``min(i + 1, base * Pareto(alpha))`` earlier tiles at random, a heavy-tailed count per row (most
    rows keep a few tiles, a few keep hundreds), different per head."""
    g = torch.Generator().manual_seed(seed)
    nq = math.ceil(N / BLOCK)
    blocks = torch.zeros(1, H, nq, nq, dtype=torch.bool)
    u = torch.rand(H, nq, generator=g)
    counts = torch.clamp((base * (1 - u) ** (-1 / alpha)).long(), max=nq)
    for h in range(H):
        for i in range(nq):
            keep = min(i + 1, int(counts[h, i]))
            blocks[0, h, i, torch.randperm(i + 1, generator=g)[:keep]] = True
            blocks[0, h, i, i] = True
    return blocks


def case_layout(name: str, N: int, H: int, device="cpu") -> BlockLayout:
    """The layout of case ``name`` at length ``N`` (``H``: heads of the routed case's per-head selection)."""
    if name.startswith("documents lognormal"):
        ids = torch.repeat_interleave(torch.arange(len(lens := doc_lengths(N))), lens).to(device)
        return BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(ids)), N, N, BLOCK, BLOCK,
                                         device=device)
    if name == "causal&(sinks64|window1024)":
        return BlockLayout.from_mask_mod(P.sinks_window(64, 1024), N, N, BLOCK, BLOCK, device=device)
    if name == "routed skewed (synthetic)":
        return BlockLayout.from_block_mask(routed_block_mask(N, H), N, N, BLOCK, BLOCK,
                                           mask_mod=P.causal()).to(device)
    if name.startswith("causal"):
        return BlockLayout.from_mask_mod(P.causal(), N, N, BLOCK, BLOCK, device=device)
    raise ValueError(f"unknown balance case {name!r}; choose from {sorted(CASES)}")


def equal_rows_layout(N: int, device="cpu", tiles: int = EQUAL_ROW_TILES) -> BlockLayout:
    """Every query tile lists ``tiles`` full key tiles (a band that wraps around): equal work per program."""
    nq = math.ceil(N / BLOCK)
    i = torch.arange(nq)[:, None]
    j = torch.arange(nq)[None, :]
    blocks = ((i - j) % nq < min(tiles, nq))[None, None]
    return BlockLayout.from_block_mask(blocks, N, N, BLOCK, BLOCK).to(device)


def _listed(layout: BlockLayout, H: int) -> int:
    """Listed tiles over all heads (a layout shared by the heads counts once per head)."""
    return int(layout.kv_count.sum() + layout.full_count.sum()) * (H // layout.H)


def _predicted(layout, H, D, impl="sparseattn", config=None) -> float:
    try:
        from .. import roofline
        # priced as the suite times the call (do_bench: an L2 flush before it)
        return roofline.cost(layout, dict(B=1, Hq=H, Hkv=H, D=D, dtype=torch.bfloat16), "fwd", config=config,
                             impl=impl, l2_flush=True).predicted_ms
    except Exception as e:  # noqa: BLE001 - a missing calibration must not stop the suite
        C.note(f"roofline prediction ({impl}) failed: {type(e).__name__}: {str(e)[:160]}")
        return None


def selected_cases(args) -> list:
    """The case names this run measures: ``--cases`` (0-based numbers in :data:`CASES` order or names,
    comma-separated), all cases without it. ValueError names an unknown one."""
    spec = getattr(args, "cases", None)
    names = list(CASES)
    if not spec:
        return names
    out = []
    for item in str(spec).split(","):
        item = item.strip()
        if item.isdigit() and int(item) < len(names):
            out.append(names[int(item)])
        elif item in CASES:
            out.append(item)
        else:
            raise ValueError(f"--cases: {item!r} is neither a case number 0..{len(names) - 1} nor a case name "
                             f"({names})")
    return [n for n in names if n in out]


def merged_records(args, suite: str, measured: list) -> list:
    """With ``--merge FILE`` (an earlier ``suite`` file of the same GPU): its records of the cases not measured
    now (with their bucket rows and the equal-rows calibrations of their shapes), to write before this run's."""
    path = getattr(args, "merge", None)
    if not path:
        return []
    from .record import check_merge_source, load_path
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else None
    old = check_merge_source(load_path(path), suite, device, path)
    base_n = int(str(args.n).split(",")[0])
    now = {(max(BLOCK, int(base_n * CASES[n][1])), CASES[n][0]) for n in measured}  # (N, H) calibrated now
    keep = []
    for r in old.records:
        name = r.case.get("case")
        if name == "equal rows":
            if (r.case["N"], r.case.get("for_heads", r.case["H"])) not in now:  # the case's heads (not the run's)
                keep.append(r)
        elif name == BUCKETS_CASE:
            if "routed skewed (synthetic)" not in measured:
                keep.append(r)
        elif name not in measured:
            keep.append(r)
    return keep


def case_shapes(args, suite: str):
    """``(name, H, N)`` of every case (of ``--cases``) at this run's base length (``--n``), in order, under the
    suite's progress bar; the seed is reset before each case and the allocator's cache emptied after it (the
    caller drops its tensors first)."""
    base_n = int(str(args.n).split(",")[0])
    chosen = selected_cases(args)
    with C.progress(len(chosen), suite) as bar:
        for name, (H, mult) in CASES.items():
            if name not in chosen:
                continue
            N = max(BLOCK, int(base_n * mult))
            bar.set_postfix_str(f"{name} N={N}")
            torch.manual_seed(0)
            yield name, H, N
            bar.update()
            C.empty_cache()


def calibration_heads(N: int, H: int, sms: int) -> int:
    """Heads of the equal-rows calibration at length ``N``: ``H``, or more where ``H`` heads of equal rows give
    fewer than :data:`EQUAL_ROW_WAVES` programs per SM (one head at 16k is 128 programs on 132 SMs: each walks
    its 32 tiles alone, a latency-bound rate above what a full GPU reaches, so the "ideal" would sit above the
    measured times)."""
    rows = math.ceil(N / BLOCK)
    return max(H, math.ceil(EQUAL_ROW_WAVES * sms / rows))


def tile_ms_on_equal_rows(timed: Callable, N: int, H: int, D: int, dev, pass_: str, cache: dict,
                          records: list) -> float:
    """The ideal's unit: measured ms per listed tile of ``timed(layout, heads)`` (a call to time, on inputs of
    ``heads`` heads) on the layout of long equal rows at length ``N`` and :func:`calibration_heads` heads,
    measured once per shape (``cache``) and recorded as an "equal rows" row."""
    if (N, H) not in cache:
        eq = equal_rows_layout(N, dev)
        heads = calibration_heads(N, H, num_sms(torch.device(dev)))
        ms_eq = C.time_gpu(timed(eq, heads))
        cache[(N, H)] = ms_eq / _listed(eq, heads)
        records.append(Record({"case": "equal rows", "N": N, "H": heads, "B": 1, "D": D, "dtype": "bf16",
                               "tiles_per_row": EQUAL_ROW_TILES, "for_heads": H}, Impl.OURS, pass_, ms_eq,
                              {"tile_us": cache[(N, H)] * 1e3, "listed_tiles": _listed(eq, heads)}))
    return cache[(N, H)]


def run(args) -> tuple:
    """Measure every case; return (records, table rows, table columns)."""
    D = args.head_dim
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    records, table = merged_records(args, NAME, selected_cases(args)), []
    tile_ms = {}  # (N, H) -> measured ms per listed tile on equal rows
    sms = num_sms(torch.device(dev))  # what the ops plan with
    for name, H, N in case_shapes(args, NAME):
        q, k, v = (torch.randn(1, H, N, D, device=dev, dtype=dtype) for _ in range(3))
        def timed(eq, heads, q=q, k=k, v=v):
            if heads != H:  # the calibration's own inputs (more heads than the case, see calibration_heads)
                q, k, v = (torch.randn(1, heads, N, D, device=dev, dtype=dtype) for _ in range(3))
            return lambda: sparse_attention(q, k, v, eq)
        unit = tile_ms_on_equal_rows(timed, N, H, D, dev, Pass.FWD, tile_ms, records)
        _case(args, name, N, H, D, q, k, v, case_layout(name, N, H, dev), unit, sms, records, table)
        del q, k, v
    return records, table, COLUMNS


def _time(fn: Callable):
    try:
        return C.time_gpu(fn), None
    except Exception as e:  # noqa: BLE001 - out of memory or a refused shape: recorded, the suite goes on
        return None, f"{type(e).__name__}: {str(e)[:ERROR_CHARS]}"


def _case(args, name, N, H, D, q, k, v, layout, tile_ms, sms, records, table) -> None:
    st = layout.stats()
    listed = _listed(layout, H)
    ideal = tile_ms * listed
    case = {"case": name, "N": N, "H": H, "B": 1, "D": D, "dtype": "bf16", "block": BLOCK,
            "listed_tiles": listed, "logical_density": st["logical_density"]}
    pred = _predicted(layout, H, D)
    o_plain = sparse_attention(q, k, v, layout)
    ms_plain, err = _time(lambda: sparse_attention(q, k, v, layout))
    rep_auto = BAL.report(layout.to("cpu"), 1, H, block_m=BLOCK, split="auto", sms=sms, head_dim=D)
    records.append(Record(case, Impl.OURS, Pass.FWD, ms_plain,
                          {"ideal_ms": ideal, "predicted_ms": pred, "balance": rep_auto.to_json(),
                           **({"error": err} if err else {})}))
    row = {"case": name, "N": N, "H": H, "plain_ms": _r(ms_plain), "ideal_ms": _r(ideal), "pred_ms": _r(pred),
           "plain/ideal": _ratio(ms_plain, ideal), "tail_plain": round(rep_auto.tail_plain, 3),
           "tail_split": round(rep_auto.tail_split, 3)}
    base_cfg = layout_default("fwd", q.device, _runtime.is_interpreter(), q.dtype, D, BLOCK, BLOCK)
    best = None
    for split in SPLITS:
        cfg = FwdConfig(**{**C.config_dict(base_cfg), "split": split})
        o = sparse_attention(q, k, v, layout, config=cfg)
        diff = float((o.float() - o_plain.float()).abs().max())
        ms, err = _time(lambda: sparse_attention(q, k, v, layout, config=cfg))
        plan = BAL.plan(layout, cfg.block_m, split, H, sms, D)
        rep = rep_auto if split == "auto" else BAL.report(layout.to("cpu"), 1, H, block_m=BLOCK, split=split,
                                                            sms=sms, head_dim=D)
        records.append(Record({**case, "split": split, "persistent": False}, Impl.OURS_SPLIT, Pass.FWD, ms,
                              {"ideal_ms": ideal, "predicted_ms": _predicted(layout, H, D, config=cfg),
                               "chunk": int(plan.chunk), "tasks": int(plan.n_tasks[0]),
                               "capacity": plan.capacity, "merged_rows": int(plan.n_merge[0]),
                               "max_abs_diff_vs_plain": diff, "makespan_tiles": rep.makespan_split,
                               "tail": rep.tail_split, "config": C.config_dict(cfg),
                               **({"error": err} if err else {})}))
        if split == "auto":
            row.update({"split_ms": _r(ms), "chunk": int(plan.chunk), "split/ideal": _ratio(ms, ideal)})
        if ms is not None and (best is None or ms < best[0]):
            best = (ms, split)
    if best:
        row["best_split"] = f"{best[1]}:{best[0]:.3f}"
    _persistent(q, k, v, layout, base_cfg, case, ideal, o_plain, H, D, sms, records, row)
    if not args.no_flex:
        ms_flex, err = _time(C.flex_fn(q, k, v, layout.to_flex()))
        records.append(Record(case, Impl.FLEX, Pass.FWD, ms_flex,
                              {"ideal_ms": ideal, "predicted_ms": _predicted(layout, H, D, "flex"),
                               **({"error": err} if err else {})}))
        row["flex_ms"] = _r(ms_flex)
        row["flex/split"] = _ratio(ms_flex, best[0] if best else None)
    ms_cudnn, err = _time(C.sdpa_fn(q, k, v, Impl.CUDNN, causal=True))  # every case lies inside causal
    records.append(Record({**case, "envelope": "causal"}, Impl.CUDNN, Pass.FWD, ms_cudnn,
                          {"error": err} if err else {}))
    row["cudnn_ms"] = _r(ms_cudnn)
    if name == "routed skewed (synthetic)":
        _graph(q, k, v, layout, base_cfg, case, ideal, records)
        _buckets(N, H, D, q.dtype, q.device, base_cfg, records)
    table.append(row)


def _persistent(q, k, v, layout, base_cfg, case, ideal, o_plain, H, D, sms, records, row) -> None:
    """The "auto" split on the persistent grid: the same plan and workspace, a fixed grid of
    ``PERSISTENT_PROGRAMS_PER_SM x SMs`` programs (warp specialisation off on this path)."""
    from ..ops import split as S
    cfg = FwdConfig(**{**C.config_dict(base_cfg), "split": "auto", "persistent": True})
    # pull: whether the programs took their items from a counter (split.PERSISTENT_PULL) or had them dealt
    extra = {"ideal_ms": ideal, "config": C.config_dict(cfg), "pull": S.PERSISTENT_PULL}
    try:
        o = sparse_attention(q, k, v, layout, config=cfg)
        plan = BAL.plan(layout, cfg.block_m, "auto", H, sms, D)
        extra.update(max_abs_diff_vs_plain=float((o.float() - o_plain.float()).abs().max()),
                     chunk=int(plan.chunk), tasks=int(plan.n_tasks[0]), capacity=plan.capacity,
                     programs=S.persistent_programs(plan.capacity, H, sms))
        ms, err = _time(lambda: sparse_attention(q, k, v, layout, config=cfg))
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
        ms, err = None, f"{type(e).__name__}: {str(e)[:ERROR_CHARS]}"
    records.append(Record({**case, "split": "auto", "persistent": True}, Impl.OURS_SPLIT, Pass.FWD, ms,
                          {**extra, **({"error": err} if err else {})}))
    row.update({"persist_ms": _r(ms), "persist/ideal": _ratio(ms, ideal)})


def _graph(q, k, v, layout, base_cfg, case, ideal, records) -> None:
    """The split forward on a dynamic layout of this one's capacity, in one CUDA graph: replay time, its output
    against the eager call, the planner under sync-debug "error" (any host sync raises)."""
    cfg = FwdConfig(**{**C.config_dict(base_cfg), "split": "auto"})
    static = BlockLayout.with_capacity(layout.B, layout.H, layout.q_len, layout.kv_len, BLOCK, BLOCK,
                                       width=layout.width, full_width=layout.full_width, mask_mod=layout.mask_mod,
                                       device=q.device)
    layout.copy_into(static)
    extra = {"ideal_ms": ideal}
    try:
        eager = sparse_attention(q, k, v, static, config=cfg)
        cuda = q.device.type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            sparse_attention(q, k, v, static, config=cfg)
            extra["host_sync_free"] = True
        except RuntimeError as e:
            extra["host_sync_free"] = False
            extra["sync_error"] = str(e)[:300]
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode("default")
        out = torch.empty_like(q)
        graph = C.graph_step(lambda: sparse_attention(q, k, v, static, config=cfg, out=out))
        graph.replay()
        C.synchronize(q.device)
        extra["graph_equals_eager"] = bool(torch.equal(out, eager))
        plan = BAL.plan(static, cfg.block_m, "auto", q.shape[1], num_sms(q.device), q.shape[-1])
        extra.update(capacity=plan.capacity, tasks=int(plan.n_tasks[0]), ws_capacity=plan.ws_capacity)
        ms, err = _time(graph.replay)
    except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
        ms, err = None, f"{type(e).__name__}: {str(e)[:ERROR_CHARS]}"
    records.append(Record({**case, "split": "auto"}, Impl.OURS_SPLIT, Pass.FWD_GRAPH, ms,
                          {**extra, **({"error": err} if err else {})}))


BUCKETS_CASE = "routed buckets"  #: the case name of the bucket rows (a routed layout per bucket)


def bucket_lengths(N: int) -> list:
    """``[(edge, length)]`` of the bucket rows at base length ``N``: power-of-two edges N/4, N/2, N (tile
    multiples, at least one tile), each served a layout whose length lies halfway between the edge below and
    its own (rounded up to a tile; a quarter of the top bucket's tokens padded), so every bucket pads."""
    edges = balance_edges(N)
    out, prev = [], edges[0] // 2
    for e in edges:
        L = min(e, max(prev + BLOCK, math.ceil((prev + e) / 2 / BLOCK) * BLOCK))
        out.append((e, L))
        prev = e
    return out


def balance_edges(N: int) -> list:
    """The bucket edges of the suite at base length ``N``."""
    return sorted({max(BLOCK, N // f // BLOCK * BLOCK) for f in (4, 2, 1)})


def _buckets(N, H, D, dtype, dev, base_cfg, records) -> None:
    """CUDA-graph buckets (:class:`sparseattn.balance.GraphBuckets`) for routed layouts of several lengths: per
    bucket, a routed layout shorter than the bucket padded into it and the split forward replayed from the
    bucket's graph (``ms``), beside the same layout's eager split call and a graph captured at its exact length
    (``exact_graph_ms``: what the padding costs in time), the copy into the bucket (``load_ms``) and the
    capacity's waste (tokens, table slots, plan tasks; :class:`sparseattn.balance.BucketWaste`)."""
    cfg = FwdConfig(**{**C.config_dict(base_cfg), "split": "auto"})
    sms = num_sms(torch.device(dev))
    cuda = torch.device(dev).type == "cuda"

    def step(layout, q, k, v, out):
        sparse_attention(q, k, v, layout, config=cfg, out=out)

    def buffers(E):
        return {n: torch.zeros(1, H, E, D, device=dev, dtype=dtype) for n in ("q", "k", "v", "out")}
    plan = bucket_lengths(N)
    buckets = BAL.GraphBuckets([e for e, _ in plan], step, buffers, H=H, block_q=BLOCK, block_k=BLOCK,
                               mask_mod=P.causal(), device=dev)
    for edge, L in plan:
        case = {"case": BUCKETS_CASE, "N": L, "bucket": edge, "H": H, "B": 1, "D": D, "dtype": "bf16",
                "block": BLOCK}
        extra = {}
        try:
            layout = case_layout("routed skewed (synthetic)", L, H, dev)
            q, k, v = (torch.randn(1, H, L, D, device=dev, dtype=dtype) for _ in range(3))
            got = buckets.run(layout, q=q, k=k, v=v)["out"].clone()  # captures the bucket's graph
            eager = sparse_attention(q, k, v, layout, config=cfg)
            bufs = buckets.buffers(edge)
            on_static = sparse_attention(bufs["q"], bufs["k"], bufs["v"], buckets.static(edge), config=cfg)
            extra.update(graph_equals_eager=bool(torch.equal(got, on_static[..., :L, :])),
                         max_abs_vs_unpadded=float((got.float() - eager.float()).abs().max()),
                         waste=buckets.waste(layout, block_m=cfg.block_m, split="auto", heads=H, sms=sms,
                                             head_dim=D).to_json(),
                         listed_tiles=_listed(layout, H))
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.set_sync_debug_mode("error")
            try:
                buckets.run(layout, q=q, k=k, v=v)  # pad, copy_into, replay
                extra["host_sync_free"] = True
            except RuntimeError as e:
                extra.update(host_sync_free=False, sync_error=str(e)[:300])
            finally:
                if cuda:
                    torch.cuda.set_sync_debug_mode("default")
            extra["load_ms"], _ = _time(lambda: buckets.load(layout, q=q, k=k, v=v))
            extra["eager_ms"], _ = _time(lambda: sparse_attention(q, k, v, layout, config=cfg))
            exact = BAL.GraphBuckets([L], step, buffers, H=H, block_q=BLOCK, block_k=BLOCK, mask_mod=P.causal(),
                                     device=dev)
            exact.run(layout, q=q, k=k, v=v)
            extra["exact_graph_ms"], _ = _time(lambda: exact.replay(L))
            buckets.load(layout, q=q, k=k, v=v)
            ms, err = _time(lambda: buckets.replay(edge))
            del exact, q, k, v, got, eager, on_static
        except Exception as e:  # noqa: BLE001 - recorded, the suite goes on
            ms, err = None, f"{type(e).__name__}: {str(e)[:ERROR_CHARS]}"
        records.append(Record(case, Impl.OURS_SPLIT, Pass.FWD_GRAPH, ms, {**extra, **({"error": err} if err else {})}))


def _r(x, nd=3):
    return None if x is None else round(x, nd)


def _ratio(a, b):
    return None if a is None or b is None or b == 0 else round(a / b, 2)
