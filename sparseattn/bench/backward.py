"""Suite ``backward``: the deterministic and the atomic backward against FlexAttention (same block mask)
and SDPA's cuDNN and FA2 (dense and causal), with bitwise repeatability over repeated runs and, for the
sinks pattern, the backward without column splitting; the patterns with no hand-written predicate
(``MASKC_PATTERNS``) also with per-tile bits (``sparseattn-bits``) against the compiled mask_mod. Issue 13's
``documents64`` and ``window333`` (``TABLE_PATTERNS``) are measured when ``--patterns`` names them (not by
default: two more patterns at both lengths would not fit the suite's 10 minutes).
``--sweep`` runs only the config sweep (:func:`sweep`): each pass's launch configs timed separately on issue 13's
patterns at the largest N, the best combination per (dtype, head dim) written as tuned defaults."""
from __future__ import annotations

import itertools
import math
import statistics
import time
from dataclasses import replace
from typing import Dict, List, Tuple

import torch

from ..ops import BwdConfig, mask_path_name, sparse_attention
from ..ops import _launch as L
from ..ops.backward import bwd_config
from . import _common as C
from .cases import MASKC_PATTERNS, dense_pattern_of, prefill_layout
from .prefill import bits_ab, setup
from .record import Impl, Pass, Record

NAME = "backward"
DEFAULT_N = "8192,32768"
CONFIG_KIND = "bwd"
COLUMNS = ["pattern", "N", "det_bwd_ms", "atomic_bwd_ms", "nosplit_bwd_ms", "flex_bwd_ms", "flex/det", "cudnn_bwd_ms",
           "det_repeatable", "atomic_repeatable", "err_vs_flex", "bits_bwd_ms", "bits/det"]
SWEEP_PATTERNS = ("causal", "window1024", "sinks64+window1024", "documents64", "window333")
SWEEP_COLUMNS = ["pattern", "D", "best_dkdv", "dkdv_ms", "best_dq", "dq_ms", "default_ms", "best_ms", "flex_ms",
                 "flex/best"]

#: ``chunk`` of the no-split variant: one dK/dV program per key tile however long its column.
NO_CHUNK = 1 << 30


def nosplit_config(q: torch.Tensor, layout) -> BwdConfig:
    """The tuned default with column splitting off (everything else as the default call runs it; the record
    of 2026-11-29 used fixed 2-stage tiles here instead, so its split/no-split pair also differed in stages)."""
    return replace(bwd_config(q, layout), chunk=NO_CHUNK)


def run(args) -> tuple:
    """Measure every (N, pattern); return (records, table rows, table columns)."""
    if args.sweep:
        return sweep(args)
    B, H, D, dtype, Ns, patterns = setup(args)
    dev = args.device
    records, table = [], []
    with C.progress(len(Ns) * len(patterns), NAME) as bar:
        for N in Ns:
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
            do = torch.randn(B, H, N, D, device=dev, dtype=dtype)
            base = dict(N=N, B=B, H=H, D=D, dtype="bf16")
            dense_bwd = {}
            bar.set_postfix_str(f"dense baselines N={N}")
            for impl in (Impl.CUDNN, Impl.FA2):
                for causal in (False, True):
                    pat = "causal" if causal else "dense"
                    try:
                        fwd = C.sdpa_fn(q, k, v, impl, causal)
                        ms_b = C.time_gpu(C.grad_fn(fwd, (q, k, v), do))
                        ms_fb = C.time_gpu(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
                    except RuntimeError as e:
                        C.note(f"{impl} causal={causal}: {e}")
                        continue
                    dense_bwd[(impl, pat)] = ms_b
                    records.append(Record({**base, "pattern": pat}, impl, Pass.BWD, ms_b))
                    records.append(Record({**base, "pattern": pat}, impl, Pass.FWD_BWD, ms_fb))
            for pattern in patterns:
                bar.set_postfix_str(f"{pattern} N={N}")
                _pattern(args, q, k, v, do, base, pattern, N, Ns, dense_bwd, records, table)
                bar.update()
            C.empty_cache()
    return records, table, COLUMNS


def _pattern(args, q, k, v, do, base, pattern, N, Ns, dense_bwd, records, table) -> None:
    H, D = q.shape[1], q.shape[3]
    layout = prefill_layout(pattern, N, device=args.device)
    st = layout.stats()
    flops = C.tile_flops(layout, H, D) * 2.5  # backward: 5 tile matmuls of the forward's 2
    case = {**base, "pattern": pattern, "block": 128, "tiles": st["listed_tiles"],
            "logical_density": st["logical_density"], "max_col_tiles": st["max_col_tiles"]}
    row = {"pattern": pattern, "N": N}
    grads = {}
    variants = [(Impl.OURS, dict(deterministic=True)), (Impl.OURS_ATOMIC, dict(deterministic=False))]
    if pattern.startswith("sinks"):
        variants.append((Impl.OURS_NOSPLIT, dict(deterministic=True, bwd_config=nosplit_config(q, layout))))
    for impl, kw in variants:
        fwd = lambda kw=kw: sparse_attention(q, k, v, layout, **kw)  # noqa: E731
        ms_b = C.time_gpu(C.grad_fn(fwd, (q, k, v), do))
        ms_fb = C.time_gpu(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
        g = torch.autograd.grad(fwd(), (q, k, v), do)
        grads[impl] = g
        extra = {}
        if impl != Impl.OURS_NOSPLIT:
            reps = [torch.autograd.grad(fwd(), (q, k, v), do) for _ in range(4)]
            spread = max(float((r[0].float() - g[0].float()).abs().max()) for r in reps)
            extra = {"bitwise_repeatable": all(all(torch.equal(a, b) for a, b in zip(r, g)) for r in reps),
                     "dq_run_to_run_max_abs": spread}
        if impl == Impl.OURS:
            extra["mask_path"] = mask_path_name(layout)
        records.append(Record(case, impl, Pass.BWD, ms_b, {"tile_tflops": flops / ms_b / 1e9, **extra}))
        records.append(Record(case, impl, Pass.FWD_BWD, ms_fb))
        key = {Impl.OURS: "det", Impl.OURS_ATOMIC: "atomic", Impl.OURS_NOSPLIT: "nosplit"}[impl]
        row[f"{key}_bwd_ms"] = round(ms_b, 3)
        if extra:
            row[f"{key}_repeatable"] = extra["bitwise_repeatable"]
    if pattern in MASKC_PATTERNS:  # the same backward with per-tile bits (the forward kept is ours, compiled)
        ms_bits, err = bits_ab(C.grad_fn(lambda: sparse_attention(q, k, v, layout), (q, k, v), do),
                               grads[Impl.OURS])
        records.append(Record(case, Impl.OURS_BITS, Pass.BWD, ms_bits, {
            "tile_tflops": flops / ms_bits / 1e9, "mask_path": "bits", "max_abs_vs_ours": err}))
        row.update({"bits_bwd_ms": round(ms_bits, 3), "bits/det": round(ms_bits / row["det_bwd_ms"], 2)})
    if not args.no_flex:
        flex = C.flex_fn(q, k, v, layout.to_flex())
        ms_b = C.time_gpu(C.grad_fn(flex, (q, k, v), do))
        ms_fb = C.time_gpu(lambda: torch.autograd.grad(flex(), (q, k, v), do))
        gf = torch.autograd.grad(flex(), (q, k, v), do)
        err = max(C.rel_err(a, b) for a, b in zip(grads[Impl.OURS], gf))
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms_b, {"rel_err_ours_vs_flex": err}))
        records.append(Record(case, Impl.FLEX, Pass.FWD_BWD, ms_fb))
        row.update({"flex_bwd_ms": round(ms_b, 3), "flex/det": round(ms_b / row["det_bwd_ms"], 2),
                    "err_vs_flex": f"{err:.1e}"})
    same = dense_bwd.get((Impl.CUDNN, dense_pattern_of(pattern)))
    if same:
        row["cudnn_bwd_ms"] = round(same, 3)
    table.append(row)


def sweep_rows(records: List[Record]) -> List[Record]:
    """The whole-backward rows of the config sweep (each with its ``config``): the default and the best
    combination of the per-pass sweeps, per case; the tuned default is chosen among them."""
    return [r for r in records if r.is_sweep and r.pass_ == Pass.BWD]


# ---------------------------------------------------------------------------------------------------------
# the per-pass config sweep
# ---------------------------------------------------------------------------------------------------------
#: (head count, head dim) of the sweep's shapes: issue 13's D = 128 rows, then D = 64 with 32 heads if time is left
SWEEP_SHAPES = ((16, 128), (32, 64))
#: share of ``--budget-s`` the D = 128 shape may use before D = 64 starts (one shape: all of it)
SHAPE_SHARE = (0.65, 1.0)


def shape_shares(n: int) -> tuple:
    """The cumulative budget share of each of ``n`` sweep shapes: :data:`SHAPE_SHARE` for two, all for one,
    equal parts otherwise."""
    if n == len(SHAPE_SHARE):
        return SHAPE_SHARE
    return tuple((i + 1) / n for i in range(n))


def parse_sweep_shapes(spec) -> tuple:
    """``--sweep-shapes`` ("16x128,32x64": heads x head dim) as ``((16, 128), (32, 64))``; None: the default
    :data:`SWEEP_SHAPES`."""
    if spec is None:
        return SWEEP_SHAPES
    out = []
    for part in str(spec).split(","):
        try:
            h, d = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--sweep-shapes must be comma-separated HxD pairs (e.g. 16x128,32x64), "
                             f"got {spec!r}") from None
        if h < 1 or d < 1:
            raise ValueError(f"--sweep-shapes: heads and head dim must be >= 1, got {part!r}")
        out.append((h, d))
    if not out:
        raise ValueError(f"--sweep-shapes names no shape: {spec!r}")
    return tuple(out)


SMEM_BYTES = 227 * 1024  # an H200 SM's shared memory for one program
#: FlexAttention's sm90 D = 128 backward (BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, 8 warps, 3 stages): the
#: sweep starts from the configs nearest to it
FLEX_DKDV = dict(block_m=64, block_n=128, num_warps=8, num_stages=3)
FLEX_DQ = dict(dq_block_m=128, dq_block_n=64, dq_num_warps=8, dq_num_stages=3)


def _fits(resident_rows: int, streamed_rows: int, stages: int, warps: int, acc_rows: int, D: int) -> bool:
    """A pass config worth timing: two resident ``[rows, D]`` bf16 tiles plus ``stages`` copies of the two
    streamed ones within an SM's shared memory, and the float32 accumulators (``acc_rows x D``) at most 128
    registers a thread (more spills)."""
    smem = 2 * resident_rows * D * 2 + stages * 2 * streamed_rows * D * 2
    return smem <= SMEM_BYTES and acc_rows * D / (32 * warps) <= 128


def pass_grid(D: int) -> Dict[bool, Tuple[List[dict], List[dict]]]:
    """``{tma: (dK/dV configs, dQ configs)}``: block_m 32/64 x block_n 64/128 (dQ: 64/128 x 32/64), 4/8 warps,
    2/3/4 stages, TMA on/off, pruned by :func:`_fits`, each list ordered nearest to FlexAttention's config
    first (so a sweep cut short by its time budget has measured the likeliest winners)."""
    out = {}
    for tma in (True, False):
        dkdv = [dict(block_m=m, block_n=n, num_warps=w, num_stages=st)
                for m, n, w, st in itertools.product((32, 64), (64, 128), (4, 8), (2, 3, 4))
                if _fits(n, m, st, w, 2 * n, D)]
        dq = [dict(dq_block_m=m, dq_block_n=n, dq_num_warps=w, dq_num_stages=st)
              for m, n, w, st in itertools.product((64, 128), (32, 64), (4, 8), (2, 3, 4))
              if _fits(m, n, st, w, m, D)]
        dkdv.sort(key=lambda c: sum(c[k] != v for k, v in FLEX_DKDV.items()))
        dq.sort(key=lambda c: sum(c[k] != v for k, v in FLEX_DQ.items()))
        out[tma] = (dkdv, dq)
    return out


def sweep_pairs(D: int, default: BwdConfig) -> List[BwdConfig]:
    """The configs the sweep runs: the i-th dK/dV config with the i-th dQ config of the same TMA choice (the
    passes are separate kernels timed separately, so one run measures one config of each; the shorter list
    is padded with the default's pass), TMA on first, alternating on/off."""
    grid = pass_grid(D)
    dk_default = dict(block_m=default.block_m, block_n=default.block_n, num_warps=default.num_warps,
                      num_stages=default.num_stages)
    dq_default = dict(dq_block_m=default.dq_block_m, dq_block_n=default.dq_block_n,
                      dq_num_warps=default.dq_warps, dq_num_stages=default.dq_stages)
    per_tma = []
    for tma in (True, False):
        dkdv, dq = grid[tma]
        # two launches (overlap=False): each pass is its own kernel, timed by its own events
        per_tma.append([BwdConfig(**(a or dk_default), **(b or dq_default), tma=tma, overlap=False)
                        for a, b in itertools.zip_longest(dkdv, dq)])
    return [c for pair in itertools.zip_longest(*per_tma) for c in pair if c is not None]


def dkdv_part(cfg: BwdConfig) -> tuple:
    return (cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages, cfg.tma)


def dq_part(cfg: BwdConfig) -> tuple:
    return (cfg.dq_block_m, cfg.dq_block_n, cfg.dq_warps, cfg.dq_stages, cfg.tma)


def part_label(part: tuple) -> str:
    m, n, w, st, tma = part
    return f"{m}x{n} w{w} s{st}{' tma' if tma else ''}"


DKDV_KERNELS = ("dkdv_kernel", "column_reduce_kernel")
DQ_KERNELS = ("dq_kernel", "dq_reduce_kernel")


REPS = 5  #: calls per (config, pattern) whose median pass times are recorded


def pass_times(fn, reps: int = REPS) -> Tuple[float, float, float]:
    """Median device ms of the dK/dV pass, the dQ pass and every launch of the backward ``fn`` over ``reps``
    calls, from CUDA events around each launch (:func:`sparseattn.ops._launch.timed_launches`). Each call
    starts behind a short GPU sleep so the host has queued its launches before the device reaches them."""
    cuda = torch.cuda.is_available()
    dk, dq, total = [], [], []
    for _ in range(reps):
        if cuda:
            torch.cuda._sleep(2_000_000)  # ~1 ms: the launches queue up behind it
        with L.timed_launches() as entries:
            fn()
        C.synchronize("cuda" if cuda else "cpu")
        ms = [(e[0], L.elapsed_ms(e)) for e in entries]
        dk.append(sum(t for name, t in ms if name in DKDV_KERNELS))
        dq.append(sum(t for name, t in ms if name in DQ_KERNELS))
        total.append(sum(t for _, t in ms))
    return statistics.median(dk), statistics.median(dq), statistics.median(total)


def _best(times: Dict[str, Dict[tuple, float]]) -> Dict[tuple, float]:
    """Geometric mean over patterns of ``ms / best ms of the pattern`` per config part measured on every
    pattern."""
    parts = set.intersection(*(set(t) for t in times.values()))
    return {p: math.exp(statistics.fmean(math.log(t[p] / min(t.values())) for t in times.values()))
            for p in parts}


def sweep(args) -> tuple:
    """The per-pass sweep (``--sweep``): for each shape of :data:`SWEEP_SHAPES` (bf16, B = 1, N = the largest
    ``--n``) and each pattern (``--patterns``, default :data:`SWEEP_PATTERNS`): the default config's whole
    backward and FlexAttention's; then the configs of :func:`sweep_pairs`, each pass timed by itself
    (:func:`pass_times`), until the shape's share of ``--budget-s`` is spent; then the best dK/dV part and
    the best dQ part (geometric mean over the patterns, per TMA choice) combined and timed whole. Returns
    the records, a table per (pattern, D) and its columns."""
    Ns = [int(x) for x in args.n.split(",")]
    N = max(Ns)
    patterns = args.patterns.split(",") if args.patterns else list(SWEEP_PATTERNS)
    budget = getattr(args, "budget_s", 500.0)
    shapes = getattr(args, "sweep_shapes", None) or SWEEP_SHAPES  # parsed by the CLI (parse_sweep_shapes)
    dev, dtype = args.device, torch.bfloat16
    t0 = time.perf_counter()
    records, table = [], []
    for (H, D), share in zip(shapes, shape_shares(len(shapes))):
        if time.perf_counter() - t0 > budget * (share - 0.25):
            C.note(f"bwd sweep: no time left for H={H} D={D}")
            break
        torch.manual_seed(0)
        q, k, v = (torch.randn(1, H, N, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn(1, H, N, D, device=dev, dtype=dtype)
        layouts = {p: prefill_layout(p, N, device=dev) for p in patterns}
        cases = {p: dict(N=N, B=1, H=H, D=D, dtype="bf16", pattern=p, block=128,
                         tiles=layouts[p].stats()["listed_tiles"]) for p in patterns}
        default = bwd_config(q, layouts[patterns[0]])

        def grad(p, cfg):
            return C.grad_fn(lambda: sparse_attention(q, k, v, layouts[p], bwd_config=cfg), (q, k, v), do)
        rows = {p: {"pattern": p, "D": D} for p in patterns}
        for p in patterns:  # the references first: they are in the table whatever the budget allows
            ms = C.time_gpu(grad(p, default))
            records.append(Record(cases[p], Impl.OURS, Pass.BWD, ms, {"sweep": True, "default": True,
                                                                       "config": C.config_dict(default)}))
            rows[p]["default_ms"] = round(ms, 3)
            if not args.no_flex:
                ms_f = C.time_gpu(C.grad_fn(C.flex_fn(q, k, v, layouts[p].to_flex()), (q, k, v), do))
                records.append(Record(cases[p], Impl.FLEX, Pass.BWD, ms_f))
                rows[p]["flex_ms"] = round(ms_f, 3)
        dk_times: Dict[str, Dict[tuple, float]] = {p: {} for p in patterns}
        dq_times: Dict[str, Dict[tuple, float]] = {p: {} for p in patterns}
        configs = sweep_pairs(D, default)
        with C.progress(len(configs), f"{NAME} sweep D={D}") as bar:
            for cfg in configs:
                if time.perf_counter() - t0 > budget * share - 30:
                    C.note(f"bwd sweep D={D}: budget spent after {bar.n} of {len(configs)} configs")
                    break
                bar.set_postfix_str(f"{part_label(dkdv_part(cfg))} | {part_label(dq_part(cfg))}")
                for p in patterns:
                    _time_pair(cfg, p, grad(p, cfg), cases[p], records, dk_times[p], dq_times[p])
                bar.update()
        best = _combine(dk_times, dq_times)
        for p in patterns:
            row = rows[p]
            for key, times in (("dkdv", dk_times[p]), ("dq", dq_times[p])):
                if times:
                    part = min(times, key=times.get)
                    row[f"best_{key}"], row[f"{key}_ms"] = part_label(part), round(times[part], 3)
            if best is not None:
                ms = C.time_gpu(grad(p, best))
                records.append(Record(cases[p], Impl.OURS, Pass.BWD, ms, {"sweep": True, "combined": True,
                                                                           "config": C.config_dict(best)}))
                row["best_ms"] = round(ms, 3)
                if "flex_ms" in row:
                    row["flex/best"] = round(row["flex_ms"] / ms, 2)
            table.append(row)
        if best is not None:
            C.note(f"bwd sweep D={D}: best combination {best}")
        del q, k, v, do, layouts
        C.empty_cache()
    return records, table, SWEEP_COLUMNS


def _time_pair(cfg: BwdConfig, pattern: str, fn, case: dict, records: list, dk_times: dict, dq_times: dict):
    """One config on one pattern: compile and check it ran the stages it names, then each pass's device time."""
    extra = {"sweep": True, "config": C.config_dict(cfg)}
    before = len(L.STAGE_FALLBACKS)
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a config that does not compile is a result, not a crash
        records.append(Record(case, Impl.OURS, Pass.BWD_DKDV, None, {**extra, "error": f"{type(e).__name__}: "
                                                                                          f"{str(e)[:200]}"}))
        return
    fell_back = L.STAGE_FALLBACKS[before:]
    dk, dq, total = pass_times(fn, REPS)
    back = {name for name, _ in fell_back}
    extra["stage_fallbacks"] = [list(f) for f in fell_back]
    extra["all_launches_ms"] = total
    records.append(Record(case, Impl.OURS, Pass.BWD_DKDV, dk, {**extra, "part": part_label(dkdv_part(cfg))}))
    records.append(Record(case, Impl.OURS, Pass.BWD_DQ, dq, {**extra, "part": part_label(dq_part(cfg))}))
    if not back & set(DKDV_KERNELS):  # a pass that fell back to fewer stages did not run the config it names
        dk_times[dkdv_part(cfg)] = min(dk, dk_times.get(dkdv_part(cfg), math.inf))
    if not back & set(DQ_KERNELS):
        dq_times[dq_part(cfg)] = min(dq, dq_times.get(dq_part(cfg), math.inf))


def _combine(dk_times: Dict[str, Dict[tuple, float]], dq_times: Dict[str, Dict[tuple, float]]):
    """The best dK/dV part and the best dQ part with the same TMA choice, by the geometric mean over the
    patterns of each part's ms / the pattern's best; the TMA choice whose two parts sum to the least over the
    patterns wins. None when nothing was measured."""
    if not all(dk_times.values()) or not all(dq_times.values()):
        return None
    dk_score, dq_score = _best(dk_times), _best(dq_times)
    candidates = []
    for tma in (True, False):
        dks = [p for p in dk_score if p[-1] == tma]
        dqs = [p for p in dq_score if p[-1] == tma]
        if not dks or not dqs:
            continue
        a, b = min(dks, key=dk_score.get), min(dqs, key=dq_score.get)
        total = sum(dk_times[p][a] + dq_times[p][b] for p in dk_times)
        candidates.append((total, a, b))
    if not candidates:
        return None
    _, (m, n, w, st, tma), (dm, dn, dw, dst, _) = min(candidates)
    return BwdConfig(block_m=m, block_n=n, dq_block_m=dm, dq_block_n=dn, num_warps=w, num_stages=st,
                     dq_num_warps=dw, dq_num_stages=dst, tma=tma)
