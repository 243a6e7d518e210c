"""Suite ``crossover``: where a sparse pattern starts to beat an optimized dense kernel, measured beside the
cost model's prediction.

Families (the layouts of :func:`sparseattn.roofline.crossover.family_layout`, 128 x 128 tiles, bf16, B=1,
``--heads`` heads of ``--head-dim``):

* along the length (``--n``, default N = 1k, 1.5k, 2k, 3k, 4k, 6k, 8k, 16k): ``window`` (a 2048-token
  sliding window: at N <= 2048 it is the causal mask, then its density falls as 1/N) and ``sinks_window``
  (64 sinks + a 1024-token window), both against causal cuDNN;
* along the kept fraction at several lengths (``--keep-n``; forward 2k, 4k, 8k, 16k, backward 4k, 16k):
  ``block_random`` (whole tiles kept at random plus the diagonal; against dense cuDNN) and ``documents``
  (16, 8, 4, 2 or 1 equal documents, causal inside each; against causal cuDNN);
* ``routing`` (when :func:`sparseattn.routing.route` exists): layouts routed on the device from the
  inputs, top-k key tiles per query tile, with the routing time recorded beside the attention;
* decode (``--part decode``): the kept fraction of pages at B=4, L=64k and B=16, L=16k (32 query / 8 KV
  heads, D=128, page size 16): our decode in a CUDA graph against cuDNN dense decode on contiguous K/V, and
  the selected step (select + decode, one graph).

Every prefill row of ours, FlexAttention (compiled on the same block mask) and cuDNN carries two times: the
eager call (``ms``, Triton's ``do_bench``) and the same call replayed from one CUDA graph (``device_ms``: the
kernels without host work), each beside the packaged H200 model's prediction made before the measurement
(``predicted_ms``, ``device_predicted_ms``; :func:`sparseattn.roofline.cost`). The eager prediction takes the
host time of one call of the op measured at the start of the part (:func:`probe_host`, on a layout the sweep
does not measure; ``meta.parts.<part>.host_ms``): on the lent H200 machines the host's speed moves between
runs and within one, and below 8k it sets the eager time. The model was fitted on other layouts and shapes
(the calibration rule of :mod:`sparseattn.roofline.calibrate`), so every point here is an out-of-sample
prediction. The naive masked-dense attention is timed for the
length families where its scores fit (``--naive-max-bytes``), as chapter 1 shows it.

One run must fit in a 10-minute GPU slot: ``--part fwd,decode`` and ``--part bwd`` are separate runs,
``--merge FILE`` keeps the other parts' rows of an earlier file of the same device, and ``--budget-s``
bounds the run (decode, which compiles nothing, runs first). FlexAttention compiles once per length and
pattern (``dynamic=False``; counted with a counting ``torch.compile`` backend: a new length or a new
constant in a mask_mod recompiles, a kept fraction of block-random tiles or a document count at the same
length does not), so the grid needs 24 forward and 20 backward compiles. Each prefill part therefore first
measures ours, cuDNN and naive on every point, then FlexAttention point by point (families in turn, each
from the ends of its grid inwards) while the time left covers another compile; a point it could not reach
is recorded with ``ms: null`` and the reason. Measured in that order, the eager times of one point lie
minutes apart, and where the host sets them (short lengths, low kept fractions) the host's drift within a run
decides who wins; so each part ends by timing every point up to :data:`RETIME_MAX_N` again, ours, Flex and
cuDNN in turn, :data:`RETIME_ROUNDS` rounds (who goes first rotates): a retimed row's ``ms`` is the median of
its rounds (``eager_rounds``), its first timing stays as ``ms_first``. The JSON is rewritten after every
point (a crash keeps the finished rows). The table printed last is the interpolated crossover per family
and pass (and length, for the kept-fraction families): measured for ours and for FlexAttention, eager and
on the device, and predicted for ours.
"""
from __future__ import annotations

import functools
import math
import statistics
import time
from typing import Callable, Dict, List, Optional

import torch

from .. import _fast_launch
from ..ops import sparse_attention, sparse_decode
from ..roofline import cost
from ..roofline.cases import decode_setup
from ..roofline.counts import Shape
from ..roofline.host import CURRENT_PATH, RECORDED_PATH
from ..roofline.crossover import (KEEP_GRID, N_GRID, bracket, crossing, envelope_layout, envelope_of, family_layout,
                                  family_pattern)
from ..routing import select_pages
from . import _common as C
from ._common import RESERVE_S, Budget  # noqa: F401 - the run's time budget (one home, shared with versus)
from .record import BenchFile, Impl, Pass, Record, check_merge_source, load_path

NAME = "crossover"
DEFAULT_N = ",".join(str(n) for n in N_GRID)
CONFIG_KIND = None  # no config sweep
PARTS = ("fwd", "bwd", "decode")
COLUMNS = ["family", "pass", "N", "variable", "ours", "flex", "ours_device", "flex_device", "ours_predicted", "points",
           "pred/meas"]

#: families measured along the length, with their pattern parameters
LENGTH_FAMILIES: Dict[str, dict] = {"window": {"window": 2048}, "sinks_window": {"sinks": 64, "window": 1024}}
#: families measured along the kept fraction, with their grids (documents: 16, 8, 4, 2, 1 documents)
KEEP_FAMILIES: Dict[str, tuple] = {"block_random": (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0),
                                   "documents": (1 / 16, 1 / 8, 1 / 4, 1 / 2, 1.0)}
#: lengths of the kept-fraction families, per pass
KEEP_N = {"fwd": (2048, 4096, 8192, 16384), "bwd": (4096, 16384)}
#: top-k key tiles per query tile of the routing family, as fractions of the tiles of a row
ROUTING_KEEPS = (0.05, 0.1, 0.2, 0.3, 0.5)
#: decode: (batch, tokens per sequence); heads, head dim, page size; kept fractions of the pages
DECODE_SHAPES = ((4, 65536), (16, 16384))
DECODE_HQ, DECODE_HKV, DECODE_D, PAGE_SIZE = 32, 8, 128, 16
DECODE_KEEPS = KEEP_GRID
#: the example steps profiled in the decode part (chapter 9 shows where their time goes)
PROFILE = dict(N=16384, batch=8, seq_len=32768)
#: the layout and length on which each prefill part first measures the host time of one eager call of every
#: op (``meta.parts.<part>.host_ms``; the part's rows are priced with it): a pattern the sweep never measures
HOST_PROBE = ("window1024", 2048)
#: calls per host-time measurement of the probe (:func:`sparseattn.bench.host.host_us`)
HOST_PROBE_CALLS = 200
#: the host path a part ran, by whether the cached launch was on (:mod:`sparseattn.roofline.host`)
HOST_PATHS = {True: CURRENT_PATH, False: RECORDED_PATH}
#: the interleaved re-timing at the end of a prefill part (:func:`retime`): points up to this length, rounds,
#: Triton ``do_bench`` windows of each timing (ms), and the seconds one timing is budgeted at
RETIME_MAX_N = 8192
RETIME_ROUNDS = 3
RETIME_WARMUP_MS, RETIME_REP_MS = 25, 100
RETIME_CALL_S = 0.25
#: first guesses of one FlexAttention compile + timing (s), replaced by the slowest seen in the run
FLEX_GUESS_S = {"fwd": 30.0, "bwd": 60.0}
DTYPE, DTYPE_NAME = torch.bfloat16, "bf16"
DECODE_PASSES = {Pass.DECODE_GRAPH, Pass.DECODE_DENSE, Pass.SELECT_DECODE_GRAPH}


# ---------------------------------------------------------------------------------------------------------
# bookkeeping
# ---------------------------------------------------------------------------------------------------------
def part_of(r: Record) -> str:
    """The part of the suite a row belongs to (its ``part`` field)."""
    return r.get("part", "decode" if r.pass_ in DECODE_PASSES else r.pass_)


#: the order parts run in: decode first (no compiles, a few seconds), so a forward or backward part whose
#: FlexAttention compiles spend the budget cannot crowd it out
RUN_ORDER = ("decode", "fwd", "bwd")


def parts_of(spec: str) -> List[str]:
    """The parts ``--part`` names (``"all"``: every part), in :data:`RUN_ORDER`."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if parts == ["all"]:
        parts = list(PARTS)
    bad = [p for p in parts if p not in PARTS]
    if bad or not parts:
        raise ValueError(f"--part must be 'all' or a comma-separated subset of {PARTS}, got {spec!r}")
    return [p for p in RUN_ORDER if p in parts]


def merged_rows(path: Optional[str], parts: List[str], device: str) -> tuple:
    """``(records, meta)`` of an earlier crossover file: its rows of the parts not being measured now, and the
    meta they bring (``parts``: when each was measured; ``profiles``, recorded with the decode part)."""
    if not path:
        return [], {"parts": {}}
    old = check_merge_source(load_path(path), NAME, device, path)
    keep = [r for r in old.records if part_of(r) not in parts]
    meta = {"parts": {p: m for p, m in old.meta.get("parts", {}).items() if p not in parts}}
    if "decode" not in parts and "profiles" in old.meta:
        meta["profiles"] = old.meta["profiles"]
    return keep, meta


def _base(N: int, args) -> dict:
    return {"N": N, "B": 1, "H": args.heads, "D": args.head_dim, "dtype": DTYPE_NAME}


def _pred(c) -> dict:
    return {"predicted_ms": c.predicted_ms, "predicted_bound": c.bound}


def _prefill_pred(layout, run: "_Run", pass_: str, impl: str = "sparseattn") -> dict:
    """The model's predictions for a prefill row, made before it is measured: the eager call as ``do_bench``
    times it, with the host time this part measured for the op (``predicted_ms``, beside ``ms``), and its
    CUDA-graph replay
    (``device_predicted_ms``, beside ``device_ms``)."""
    host = run.meta["parts"].get(pass_, {}).get("host_ms", {}).get(f"{impl}/{pass_}")
    return {**_pred(cost(layout, run.shape, pass_, impl=impl, host_ms=host, l2_flush=True)),
            "device_predicted_ms": cost(layout, run.shape, pass_, impl=impl, graph=True).predicted_ms}


def probe_host(run: "_Run", pass_: str) -> Dict[str, float]:
    """Milliseconds of host work per eager call of each op (``"sparseattn/fwd"``, ...) in this process, on
    :data:`HOST_PROBE` (not a sweep layout): the host side of the model's eager prices for this part. The
    host's speed differs between runs of the same code (our forward: 0.107 ms in ``host-h200.json``, about
    0.06 ms in a loop of the next day's crossover run), so it is measured, like a ceiling, where it is used."""
    from .cases import prefill_layout
    from .host import host_us
    pattern, N = HOST_PROBE
    lay = prefill_layout(pattern, N, block=128, device=run.dev)
    q, k, v, do = run.qkv(N, pass_ == "bwd")
    makes = {"sparseattn": lambda a, b, c: sparse_attention(a, b, c, lay),
             "cudnn": lambda a, b, c: C.sdpa_fn(a, b, c, "cudnn", True)()}
    if not run.args.no_flex:
        bm, flex = lay.to_flex(), C.compiled_flex()
        makes["flex"] = lambda a, b, c: flex(a, b, c, block_mask=bm)
    out = {}
    for impl, make in makes.items():
        fwd, bwd = C.fwd_bwd(make, q, k, v, do)
        try:
            out[f"{impl}/{pass_}"] = host_us(fwd if pass_ == "fwd" else bwd, run.dev, HOST_PROBE_CALLS) * 1e-3
        except Exception as e:  # a backend that refuses the shape: that op keeps the recorded host time
            C.note(f"host probe {impl} {pass_}: {type(e).__name__}: {str(e)[:160]}")
    return out


class _Run:
    """The state of one suite run: records (merged ones first), inputs per length, the output file."""

    def __init__(self, args, env: dict, merged: List[Record], merged_meta: dict):
        self.args, self.env, self.dev = args, env, args.device
        self.records: List[Record] = list(merged)
        self.meta = {**merged_meta, "families": {
            **{f: dict(p, variable="N") for f, p in LENGTH_FAMILIES.items()},
            **{f: {"variable": "keep", "grid": list(g)} for f, g in KEEP_FAMILIES.items()},
            "decode": {"variable": "keep", "grid": list(DECODE_KEEPS), "shapes": [list(s) for s in DECODE_SHAPES]}}}
        self.shape = Shape(B=1, Hq=args.heads, Hkv=args.heads, D=args.head_dim, dtype=DTYPE)
        self.inputs: Dict[tuple, tuple] = {}
        self.dense: Dict[tuple, float] = {}
        # the eager calls :func:`retime` times again: point -> {impl: (index in records, timed callable)}
        self.eager: Dict[tuple, Dict[str, tuple]] = {}
        self.dense_eager: Dict[tuple, tuple] = {}  # (pass, N, envelope) -> (index, callable) of the cuDNN row
        self.retime_reserve = 0.0  # seconds the Flex compiles leave to the re-timing
        self.flex_seen: Dict[str, List[float]] = {"fwd": [], "bwd": []}  # first-call seconds observed
        self.flex_compiled: set = set()  # (pass, family, N): a kept fraction or document count reuses it
        self.budget = Budget(args.budget_s)

    def flex_estimate(self, pass_: str, key: tuple = ()) -> float:
        """Seconds one more FlexAttention point may take: a timing when ``key`` (pass, family, N) compiled
        already, else the slowest of the last three first calls of this pass (each a compile) plus the timing,
        or a first guess before any."""
        if key in self.flex_compiled:
            return 3.0
        seen = self.flex_seen[pass_][-3:]  # the first compile of a process also warms Inductor up
        return 1.2 * max(seen) + 2.0 if seen else FLEX_GUESS_S[pass_]

    def add(self, r: Record, timed: Optional[Callable] = None, point: Optional[tuple] = None) -> None:
        """Keep a row; with ``timed`` (its eager call) and ``point`` (pass, family, grid value, N), the row is
        one of the point's re-timed ones."""
        self.records.append(r)
        if timed is not None and point is not None and r.ms is not None:
            self.eager.setdefault(point, {})[r.impl] = (len(self.records) - 1, timed)

    def with_dense(self, point: tuple, env: str) -> None:
        """Re-time the cuDNN row of ``point``'s length and envelope with it."""
        pass_, N = point[0], point[-1]
        if (pass_, N, env) in self.dense_eager:
            self.eager.setdefault(point, {})[Impl.CUDNN] = self.dense_eager[(pass_, N, env)]

    def save(self) -> None:
        C.write_json(NAME, self.records, self.args.out, self.env, meta=self.meta)

    def qkv(self, N: int, grad: bool):
        key = (N, grad)
        if key not in self.inputs:
            g = torch.Generator(device=self.dev).manual_seed(N)
            B, H, D = 1, self.args.heads, self.args.head_dim
            t = [torch.randn(B, H, N, D, device=self.dev, dtype=DTYPE, generator=g) for _ in range(4)]
            q, k, v = (x.requires_grad_(grad) for x in t[:3])
            self.inputs[key] = (q, k, v, t[3])
        return self.inputs[key]


# ---------------------------------------------------------------------------------------------------------
# the points of a prefill part
# ---------------------------------------------------------------------------------------------------------
def points(pass_: str, args) -> List[dict]:
    """Every prefill point of a pass: ``{"family", "x", "N", "params"}`` (``x``: the grid value)."""
    families = args.families.split(",") if args.families else None
    out = []
    Ns = [int(x) for x in args.n.split(",")] if args.n else list(N_GRID)
    for fam, params in LENGTH_FAMILIES.items():
        if families is None or fam in families:
            out += [{"family": fam, "x": N, "N": N, "params": params} for N in Ns]
    keep_n = [int(x) for x in args.keep_n.split(",")] if args.keep_n else list(KEEP_N[pass_])
    for fam, grid in KEEP_FAMILIES.items():
        if families is None or fam in families:
            out += [{"family": fam, "x": x, "N": N, "params": {}} for N in keep_n for x in grid]
    return out


def _layout_of(pt: dict):
    """CPU layout, envelope, kept fraction and the recorded case fields of a point."""
    lay, env, kept = family_layout(pt["family"], pt["x"], N=pt["N"], **pt["params"])
    st = lay.stats()
    case = {"family": pt["family"], "pattern": family_pattern(pt["family"], pt["x"], **pt["params"]),
            **pt["params"], "envelope": env, "kept": kept, "block": 128, "tiles": st["listed_tiles"],
            "full_tiles": st["full_tiles"], "partial_tiles": st["partial_tiles"],
            "logical_density": st["logical_density"], "tile_amplification": st["tile_amplification"]}
    if pt["family"] in KEEP_FAMILIES:
        case["keep"] = pt["x"]
    return lay, env, case


def _timed(run: _Run, pass_: str, fn, q, k, v, do) -> tuple:
    """``(median ms, the timed callable)`` of the forward, or of the backward alone (gradients from one kept
    forward; the callable keeps it for :func:`retime`)."""
    timed = fn if pass_ == "fwd" else C.grad_fn(fn, (q, k, v), do)
    return C.time_gpu(timed), timed


def _device_ms(run: _Run, pass_: str, make: Callable, N: int) -> Optional[float]:
    """The point's call replayed from one CUDA graph (``make(q, k, v)``; the backward from one kept forward):
    its device time without host work -- what the model's kernel and per-call terms price, whatever the
    host's speed that day. None off CUDA or when the capture fails (noted)."""
    if torch.device(run.dev).type != "cuda":
        return None
    q, k, v, do = run.qkv(N, pass_ == "bwd")
    return C.pass_graph_ms(make, q, k, v, do, pass_)


def _dense_row(run: _Run, pass_: str, N: int, env: str) -> None:
    """cuDNN on the envelope at length N, once per (pass, N, envelope)."""
    if (pass_, N, env) in run.dense:
        return
    q, k, v, do = run.qkv(N, pass_ == "bwd")
    case = {**_base(N, run.args), "pattern": env, "envelope": env}
    pred = _prefill_pred(envelope_layout(env, N, N), run, pass_, "cudnn")
    try:
        ms, timed = _timed(run, pass_, C.sdpa_fn(q, k, v, "cudnn", env == "causal"), q, k, v, do)
        dev_ms = _device_ms(run, pass_, lambda a, b, c: C.sdpa_fn(a, b, c, "cudnn", env == "causal")(), N)
    except RuntimeError as e:  # the backend refused the shape
        C.note(f"cudnn {env} N={N} {pass_}: {e}")
        run.add(Record(case, Impl.CUDNN, pass_, None, {**pred, "part": pass_, "error": str(e)[:200]}))
        run.dense[(pass_, N, env)] = None
        return
    run.dense[(pass_, N, env)] = ms
    run.add(Record(case, Impl.CUDNN, pass_, ms, {**pred, "part": pass_, "device_ms": dev_ms}))
    if N <= RETIME_MAX_N:
        run.dense_eager[(pass_, N, env)] = (len(run.records) - 1, timed)


def _ours_rows(run: _Run, pass_: str, pt: dict) -> None:
    """Ours (and, forward on the length families, naive masked dense) at one point."""
    args = run.args
    N = pt["N"]
    lay, env, case = _layout_of(pt)
    case = {**_base(N, args), **case}
    pt.update(case=case, layout=lay, envelope=env)
    _dense_row(run, pass_, N, env)
    q, k, v, do = run.qkv(N, pass_ == "bwd")
    # the kernels get the layout built on their device (a document mask then holds its ids there, for our
    # kernel and for FlexAttention's compiled mask_mod alike); the model prices the CPU copy
    dev_lay = pt["device_layout"] = lay if torch.device(run.dev).type == "cpu" else \
        family_layout(pt["family"], pt["x"], N=N, device=run.dev, **pt["params"])[0]
    tiles = int(dev_lay.kv_count.sum() + dev_lay.full_count.sum())
    if tiles != case["tiles"]:
        raise AssertionError(f"{case['pattern']} N={N}: {tiles} tiles on {run.dev}, {case['tiles']} on the CPU")
    call = lambda: sparse_attention(q, k, v, dev_lay)  # noqa: E731
    ms, timed = _timed(run, pass_, call, q, k, v, do)
    # the same call back to back without do_bench's L2 flush: where the host is the slower side, the event
    # times of the recorded sweep split into two groups ~2x apart; this is the per-call wall time of a loop
    loop_ms = C.time_loop(call if pass_ == "fwd" else C.grad_fn(call, (q, k, v), do), device=run.dev)
    dev_ms = _device_ms(run, pass_, lambda a, b, c: sparse_attention(a, b, c, dev_lay), N)
    flops = C.tile_flops(lay, args.heads, args.head_dim) * (1.0 if pass_ == "fwd" else 3.5)
    point = pt["point"] = _point(pass_, pt["family"], pt["x"], N)
    run.add(Record(case, Impl.OURS, pass_, ms, {**_prefill_pred(lay, run, pass_), "part": pass_,
                                                "tile_tflops": flops / ms / 1e9, "loop_ms": loop_ms,
                                                "device_ms": dev_ms}), timed if point else None, point)
    if point:
        run.with_dense(point, env)
    if pass_ == "fwd" and pt["family"] in LENGTH_FAMILIES and 1 * args.heads * N * N * 2 * 3 <= args.naive_max_bytes:
        mask = dev_lay.to_dense()
        run.add(Record(case, Impl.NAIVE, pass_, C.time_gpu(C.naive_fn(q, k, v, mask)), {"part": pass_}))
        del mask


def _flex_row(run: _Run, pass_: str, pt: dict) -> None:
    """FlexAttention at one point (compiled on the point's block mask), if the budget covers a compile."""
    case, lay = pt["case"], pt["layout"]
    extra = {**_prefill_pred(lay, run, pass_, "flex"), "part": pass_}
    # a kept fraction or a document count at a compiled length does not recompile; a window's length does
    key = (pass_, pt["family"], pt["N"]) if pt["family"] in KEEP_FAMILIES else (pass_, case["pattern"], pt["N"])
    estimate = run.flex_estimate(pass_, key)
    if not run.budget.allows(estimate + run.retime_reserve):
        run.add(Record(case, Impl.FLEX, pass_, None, {**extra, "error": f"skipped: {run.budget.left():.0f} s left of "
                                                      f"the time budget, a compile takes up to {estimate:.0f} s"}))
        return
    run.add(*_flex_time(run, pass_, pt["N"], pt["device_layout"], key, case, extra), pt.get("point"))


def _flex_time(run: _Run, pass_: str, N: int, device_layout, key: tuple, case: dict, extra: dict) -> tuple:
    """FlexAttention compiled on ``device_layout``'s block mask: ``(row, timed callable)`` -- the row with
    the eager and device times and the first call's seconds (counted as a compile of ``key`` when it was one),
    or a row with the error and no callable when the compile or a launch fails (recorded, not fatal)."""
    q, k, v, do = run.qkv(N, pass_ == "bwd")
    t0 = time.perf_counter()
    try:
        bm = device_layout.to_flex()
        fn = C.flex_fn(q, k, v, bm)
        out = fn()  # compiles
        if pass_ == "bwd":
            # compiles the backward; retain_graph as the timed calls have it: a backward first compiled
            # without it donates buffers and then refuses every retained call (the 2026-12-01 run lost every
            # FlexAttention backward point to that)
            torch.autograd.grad(out, (q, k, v), do, retain_graph=True)
        C.synchronize(run.dev)
        first = time.perf_counter() - t0
        ms, timed = _timed(run, pass_, fn, q, k, v, do)
        flex = C.compiled_flex()
        dev_ms = _device_ms(run, pass_, lambda a, b, c: flex(a, b, c, block_mask=bm), N)
    except Exception as e:  # a compile or launch failure
        err = f"{type(e).__name__}: {str(e)[:200]}"
        C.note(f"flex {case['pattern']} N={N} {pass_}: {err}")
        return Record(case, Impl.FLEX, pass_, None, {**extra, "error": err}), None
    if key not in run.flex_compiled:
        run.flex_seen[pass_].append(first)
        run.flex_compiled.add(key)
    return Record(case, Impl.FLEX, pass_, ms, {**extra, "first_call_s": first, "device_ms": dev_ms}), timed


def _routing_rows(run: _Run, pass_: str) -> None:
    """The routing family, when :func:`sparseattn.routing.route` exists: top-k key tiles per query tile chosen
    on the device from the inputs (causal), timed apart from the attention on the layout it returns (a
    ``route`` row beside each attention row; the attention's prediction leaves routing out, as its time
    does). A failure anywhere in the family is noted and ends the family, not the run."""
    from .. import routing
    route = getattr(routing, "route", None)
    if route is None:
        C.note("routing family skipped: sparseattn.routing has no route() yet")
        return
    args = run.args
    for N in _keep_lengths(pass_, args):
        q, k, v, do = run.qkv(N, pass_ == "bwd")
        nk = math.ceil(N / 128)
        for x in ROUTING_KEEPS:
            if not run.budget.allows(0.0):
                C.note(f"time budget spent: routing N={N} not measured")
                return
            topk = max(1, round(x * nk))
            step = lambda: route(q.detach(), k.detach(), 128, 128, topk=topk, causal=True)  # noqa: E731
            try:
                lay = step()
                ms_route = C.time_gpu(step)
                cpu = lay.to("cpu")
                env = envelope_of(cpu)
                st = cpu.stats()
                env_cells = N * (N + 1) / 2 if env == "causal" else float(N * N)
                case = {**_base(N, args), "family": "routing", "pattern": f"route_top{topk}", "keep": x,
                        "topk": topk, "envelope": env, "kept": st["logical_edges"] / (cpu.B * cpu.H * env_cells),
                        "block": 128, "tiles": st["listed_tiles"], "logical_density": st["logical_density"]}
                pred = _prefill_pred(cpu, run, pass_)
                # the call is kept for the re-timing at the end of the part, after this loop has moved on:
                # its layout and inputs are bound now (a closure over the loop's names timed the last point)
                call = functools.partial(sparse_attention, q, k, v, lay)
                ms, timed = _timed(run, pass_, call, q, k, v, do)
                dev_ms = _device_ms(run, pass_, lambda a, b, c, lay=lay: sparse_attention(a, b, c, lay), N)
            except Exception as e:  # an interface this hook does not know yet: say so, measure the rest
                C.note(f"routing family stopped: {type(e).__name__}: {str(e)[:160]}")
                return
            run.add(Record(case, Impl.OURS, Pass.ROUTE, ms_route, {"part": pass_}))
            _dense_row(run, pass_, N, env)
            point = _point(pass_, "routing", x, N)
            run.add(Record(case, Impl.OURS, pass_, ms, {**pred, "part": pass_, "route_ms": ms_route,
                                                        "device_ms": dev_ms}), timed, point)
            if point:
                run.with_dense(point, env)
            # FlexAttention on the same routed blocks (its own routing pipeline is the routing suite's): the
            # shapes of a length's block mask do not change with top-k, so one compile per length and pass
            key = (pass_, "routing", N)
            if not run.args.no_flex and run.budget.allows(run.flex_estimate(pass_, key) + run.retime_reserve):
                run.add(*_flex_time(run, pass_, N, lay, key, case,
                                    {**_prefill_pred(cpu, run, pass_, "flex"), "part": pass_}), point)
            run.save()


def prefill_part(run: _Run, pass_: str, bar) -> None:
    """Ours, naive and cuDNN on every point first (no compiles), then FlexAttention while the budget lasts
    (leaving :func:`retime` its share), then the eager calls of every point again, interleaved."""
    pts = points(pass_, run.args)
    routing = not run.args.families or "routing" in run.args.families.split(",")
    run.meta["parts"][pass_]["host_ms"] = probe_host(run, pass_)
    run.meta["parts"][pass_]["host_probe"] = {"pattern": HOST_PROBE[0], "N": HOST_PROBE[1]}
    run.meta["parts"][pass_]["host_path"] = HOST_PATHS[_fast_launch.is_enabled()]
    n_retimed = sum(pt["N"] <= RETIME_MAX_N for pt in pts)
    if routing:
        n_retimed += len(ROUTING_KEEPS) * sum(N <= RETIME_MAX_N for N in _keep_lengths(pass_, run.args))
    run.retime_reserve = RETIME_ROUNDS * n_retimed * 3 * RETIME_CALL_S  # ours, Flex, cuDNN per point
    for pt in pts:
        if not run.budget.allows(0.0):
            C.note(f"time budget spent: {pass_} point {pt['family']} x={pt['x']} N={pt['N']} not measured")
            continue
        bar.set_postfix_str(f"{pass_} {pt['family']} x={pt['x']:g} N={pt['N']}")
        _ours_rows(run, pass_, pt)
        run.save()
        bar.update()
    if routing:
        _routing_rows(run, pass_)
    if not run.args.no_flex:
        _flex_points(run, pass_, pts, bar)
    retime(run, pass_)
    run.save()


def _flex_points(run: _Run, pass_: str, pts: List[dict], bar) -> None:
    """FlexAttention: one point of each family in turn, each family's points from the ends of its grid
    inwards, so a budget cut leaves every family points across its whole range."""
    by_family: Dict[str, list] = {}
    for pt in pts:
        if "case" in pt:
            by_family.setdefault(pt["family"], []).append(pt)
    spread = [[pts_[i] for i in spread_order(len(pts_))] for pts_ in by_family.values()]
    order = [pt for group in zip_longest_lists(spread) for pt in group]
    for pt in order:
        bar.set_postfix_str(f"{pass_} flex {pt['family']} x={pt['x']:g} N={pt['N']}")
        _flex_row(run, pass_, pt)
        run.save()
        bar.update()


def _keep_lengths(pass_: str, args) -> List[int]:
    """The lengths of the kept-fraction and routing families (``--keep-n``, else :data:`KEEP_N`)."""
    return [int(x) for x in args.keep_n.split(",")] if args.keep_n else list(KEEP_N[pass_])


def _point(pass_: str, family: str, x, N: int) -> Optional[tuple]:
    """The key of a prefill point :func:`retime` times again, or None above :data:`RETIME_MAX_N`."""
    return (pass_, family, x, N) if N <= RETIME_MAX_N else None


def retime(run: _Run, pass_: str) -> None:
    """Time the eager calls of every point of ``pass_`` again, ours, FlexAttention and cuDNN in turn,
    :data:`RETIME_ROUNDS` rounds, the first impl rotating; a round starts only if the budget covers it. Each
    re-timed row gets ``ms`` = the median of its rounds (a cuDNN row shared by several points: of all of
    them), ``eager_rounds`` and ``ms_first`` (its first timing, minutes from the others'). Points with one
    impl measured are left as they are."""
    groups = [g for key, g in run.eager.items() if key[0] == pass_ and len(g) > 1]
    if not groups:
        return
    times: Dict[int, List[float]] = {}
    round_s = RETIME_CALL_S * sum(len(g) for g in groups)
    for rnd in range(RETIME_ROUNDS):
        if not run.budget.allows(round_s):
            C.note(f"time budget spent: {pass_} eager re-timing stopped after {rnd} of {RETIME_ROUNDS} rounds")
            break
        for g in groups:
            members = sorted(g.values())
            members = members[rnd % len(members):] + members[:rnd % len(members)]
            for idx, timed in members:
                times.setdefault(idx, []).append(C.time_gpu(timed, warmup_ms=RETIME_WARMUP_MS,
                                                            rep_ms=RETIME_REP_MS))
    for idx, ts in times.items():
        r = run.records[idx]
        run.records[idx] = Record(r.case, r.impl, r.pass_, statistics.median(ts),
                                  {**r.extra, "ms_first": r.ms, "eager_rounds": [round(t, 5) for t in ts]})


def spread_order(n: int) -> List[int]:
    """``0 .. n-1`` ordered so that every prefix covers the range evenly: both ends, then the middle, then
    the middles of the halves, ... (``spread_order(5) == [0, 4, 2, 1, 3]``)."""
    if n <= 0:
        return []
    order, seen, spans = [0], {0}, [(0, n - 1)]
    if n > 1:
        order.append(n - 1)
        seen.add(n - 1)
    while spans:
        nxt = []
        for a, b in spans:
            m = (a + b) // 2
            if m not in seen:
                seen.add(m)
                order.append(m)
            if m - a > 1:
                nxt.append((a, m))
            if b - m > 1:
                nxt.append((m, b))
        spans = nxt
    return order + [i for i in range(n) if i not in seen]


def zip_longest_lists(lists: List[list]) -> List[list]:
    """``[[a0, b0, ...], [a1, b1, ...], ...]``: the i-th element of every list that has one."""
    n = max((len(x) for x in lists), default=0)
    return [[x[i] for x in lists if i < len(x)] for i in range(n)]


# ---------------------------------------------------------------------------------------------------------
# decode
# ---------------------------------------------------------------------------------------------------------
def decode_part(run: _Run, bar) -> None:
    """Our decode (CUDA graph) per kept fraction against cuDNN dense decode, per shape; then the profiles of
    the book's two example steps (stored under ``profiles`` in the file's meta)."""
    from ..roofline.profile import example_steps, profile_step
    for B, L in DECODE_SHAPES:
        if not run.budget.allows(0.0):
            C.note(f"time budget spent: decode B={B} L={L} not measured")
            continue
        _decode_shape(run, B, L, bar)
        C.empty_cache()
    profiles = {}
    for name, (fn, what) in example_steps(run.dev, **PROFILE).items():
        if not run.budget.allows(5.0):
            break
        try:
            profiles[name] = {"what": what, **profile_step(fn).as_dict()}
        except Exception as e:  # the profiler is a diagnostic: a failure is noted, not fatal
            C.note(f"profile {name}: {type(e).__name__}: {str(e)[:160]}")
    run.meta["profiles"] = profiles
    run.save()


def _decode_shape(run: _Run, B: int, L: int, bar) -> None:
    kd, vd, cache, q = decode_setup(B, L, PAGE_SIZE, DECODE_HQ, DECODE_HKV, DECODE_D, DTYPE, device=run.dev)
    s = Shape(B=B, Hq=DECODE_HQ, Hkv=DECODE_HKV, D=DECODE_D, dtype=DTYPE, seq_len=L, page_size=PAGE_SIZE)
    base = {"family": "decode", "N": L, "B": B, "Hq": DECODE_HQ, "Hkv": DECODE_HKV, "D": DECODE_D,
            "dtype": DTYPE_NAME, "page_size": PAGE_SIZE}
    full_bytes = 2 * B * DECODE_HKV * L * DECODE_D * 2
    q4 = q.view(B, DECODE_HQ, 1, DECODE_D)
    pred = _pred(cost(None, s, "decode", impl="cudnn"))
    try:
        ms = C.time_gpu(C.sdpa_fn(q4, kd, vd, "cudnn", enable_gqa=True))
        run.add(Record({**base, "pattern": "dense"}, Impl.CUDNN, Pass.DECODE_DENSE, ms,
                       {**pred, "part": "decode", "bytes": full_bytes, "tbps": full_bytes / ms / 1e9}))
    except RuntimeError as e:  # the backend refused the shape
        run.add(Record({**base, "pattern": "dense"}, Impl.CUDNN, Pass.DECODE_DENSE, None,
                       {**pred, "part": "decode", "error": str(e)[:200]}))
    n_pages = math.ceil(L / PAGE_SIZE)
    for keep in DECODE_KEEPS:
        bar.set_postfix_str(f"decode B={B} L={L} keep={keep}")
        topk = max(1, round(keep * n_pages))
        sel = select_pages(q, cache, topk)
        sel_bytes = int(sel.count.sum()) * PAGE_SIZE * DECODE_D * 2 * 2
        case = {**base, "pattern": family_pattern("decode", keep), "keep": keep, "kept": sel_bytes / full_bytes}
        ms = C.time_gpu(C.graph_step(lambda: sparse_decode(q, cache, pages=sel)).replay)
        run.add(Record(case, Impl.OURS, Pass.DECODE_GRAPH, ms,
                       {**_pred(cost(cache, s, "decode", pages=sel, graph=True)), "part": "decode",
                        "bytes": sel_bytes, "tbps": sel_bytes / ms / 1e9}))
        step = C.graph_step(lambda: sparse_decode(q, cache, pages=select_pages(q, cache, topk)))
        run.add(Record(case, Impl.OURS, Pass.SELECT_DECODE_GRAPH, C.time_gpu(step.replay), {"part": "decode"}))
        run.save()
        bar.update()


# ---------------------------------------------------------------------------------------------------------
# the run and its table
# ---------------------------------------------------------------------------------------------------------
def run(args) -> tuple:
    """Measure the parts ``args.part`` asks for; return (records, table rows, table columns)."""
    for name, default in (("part", "all"), ("families", None), ("keep_n", None), ("budget_s", 500.0),
                          ("merge", None)):  # options of this suite only (a caller may not set them)
        if getattr(args, name, None) is None:
            setattr(args, name, default)
    parts = parts_of(args.part)
    known = set(LENGTH_FAMILIES) | set(KEEP_FAMILIES) | {"routing"}
    if args.families and not set(args.families.split(",")) <= known:
        raise ValueError(f"--families must be a comma-separated subset of {sorted(known)}, got {args.families!r}")
    env = C.environment()
    merged, merged_meta = merged_rows(args.merge, parts, env["device"])
    r = _Run(args, env, merged, merged_meta)
    for p in parts:
        r.meta["parts"][p] = {**{k: env.get(k) for k in ("date", "torch", "triton", "device")},
                              "budget_s": args.budget_s}
    n_points = sum(len(points(p, args)) * (1 if args.no_flex else 2) for p in parts if p != "decode")
    n_points += len(DECODE_SHAPES) * len(DECODE_KEEPS) if "decode" in parts else 0
    with C.progress(n_points, NAME) as bar:
        for p in parts:
            if p == "decode":
                decode_part(r, bar)
            else:
                prefill_part(r, p, bar)
                r.inputs.clear()
                C.empty_cache()
    for p in parts:
        r.meta["parts"][p]["run_s"] = r.budget.clock() - r.budget.t0  # the whole run these parts were measured in
    r.save()
    if hasattr(args, "meta"):
        args.meta.update(r.meta)
    bf = BenchFile.from_json({"suite": NAME, **env, **r.meta, "results": [x.to_json() for x in r.records]})
    return r.records, crossover_table(bf), COLUMNS


def _fmt(value, state) -> str:
    if value is not None:
        return f"{value:.3g}" if value < 1 else f"{value:.0f}"
    return state


#: The bracket of a curve with no measured point (FlexAttention skipped by the time budget, or no Flex decode).
_NOT_MEASURED = {"state": "not measured", "lo": None, "hi": None, "n": 0, "wins": 0}


def _first_of_each(points: list) -> list:
    """Points sorted by their grid value, one per value (documents round to whole documents, so two kept
    fractions can give the same layout): the first measured one."""
    seen, out = set(), []
    for p in sorted(points, key=lambda p: p[0]):
        if p[0] not in seen:
            seen.add(p[0])
            out.append(p)
    return out


def _ratio(r: Optional[Record]) -> Optional[float]:
    p = r.get("predicted_ms") if r is not None else None
    return p / r.ms if p and r.ms else None


def measured_crossovers(bf: BenchFile) -> List[dict]:
    """One entry per family and pass (and length, for the kept-fraction families; batch, for decode): the
    grid (lengths, or the kept fraction of the envelope's cells / of the cache's bytes), the measured times
    of ours, FlexAttention and cuDNN on the envelope with their predictions, and the interpolated
    crossovers ``(value, state)`` of :func:`~sparseattn.roofline.crossover.crossing`: ``ours`` and ``flex``
    measured, ``ours_predicted`` from the predictions; ``ours_bracket`` and ``flex_bracket``: the measured
    crossovers as the two grid points around them (:func:`~sparseattn.roofline.crossover.bracket`), what a
    single median per point supports. A point without a cuDNN time is left out; a point
    without a FlexAttention time is left out of Flex's crossover only."""
    out = []
    prefill = [r for r in bf.records if r.pass_ in (Pass.FWD, Pass.BWD) and "family" in r.case]
    dense = {(r.pass_, r.case["N"], r.case["pattern"]): r for r in bf.records
             if r.impl == Impl.CUDNN and r.pass_ in (Pass.FWD, Pass.BWD)}
    flex = {(r.pass_, r.case["pattern"], r.case["N"]): r for r in prefill if r.impl == Impl.FLEX}
    groups: Dict[tuple, list] = {}
    for r in prefill:
        if r.impl == Impl.OURS:
            length = r.case["family"] in LENGTH_FAMILIES
            key = (r.case["family"], r.pass_, None if length else r.case["N"], r.case["pattern"] if length else None)
            groups.setdefault(key, []).append(r)
    for (fam, pass_, N, pattern), rows in groups.items():
        variable = "N" if N is None else "keep"
        pts = []
        for r in rows:
            d = dense.get((pass_, r.case["N"], r.case["envelope"]))
            if r.ms is not None and d is not None and d.ms is not None:
                pts.append((r.case["N"] if variable == "N" else r.case["kept"], r, d,
                            flex.get((pass_, r.case["pattern"], r.case["N"]))))
        pts = _first_of_each(pts)
        if not pts:
            continue
        grid = [p[0] for p in pts]
        ours, cud = [p[1].ms for p in pts], [p[2].ms for p in pts]
        pred, cud_pred = [p[1].get("predicted_ms") for p in pts], [p[2].get("predicted_ms") for p in pts]
        fx = [p[3].ms if p[3] is not None else None for p in pts]
        fpts = [(g, f, c) for g, f, c in zip(grid, fx, cud) if f is not None]
        # the same crossings on the CUDA-graph replays: the kernels alone, whatever the host's speed that day
        dev = lambda r: r.time("device") if r is not None else None  # noqa: E731
        odev = [(g, dev(p[1]), dev(p[2])) for g, p in zip(grid, pts) if dev(p[1]) and dev(p[2])]
        fdev = [(g, dev(p[3]), dev(p[2])) for g, p in zip(grid, pts) if dev(p[3]) and dev(p[2])]
        have_pred = all(x is not None for x in pred + cud_pred)
        out.append({"family": fam, "pass": pass_, "N": N, "B": None, "pattern": pattern or rows[0].case["family"],
                    "variable": variable, "envelope": pts[0][1].case["envelope"], "grid": grid,
                    "patterns": [p[1].case["pattern"] for p in pts], "ours_ms": ours, "flex_ms": fx, "cudnn_ms": cud,
                    "ours_predicted_ms": pred, "cudnn_predicted_ms": cud_pred,
                    "flex_predicted_ms": [p[3].get("predicted_ms") if p[3] is not None else None for p in pts],
                    "ours": crossing(grid, ours, cud, variable),
                    "flex": crossing(*map(list, zip(*fpts)), variable) if fpts else (None, "not measured"),
                    "ours_device": crossing(*map(list, zip(*odev)), variable) if odev else (None, "not measured"),
                    "flex_device": crossing(*map(list, zip(*fdev)), variable) if fdev else (None, "not measured"),
                    "ours_bracket": bracket(grid, ours, cud, variable),
                    "flex_bracket": bracket(*map(list, zip(*fpts)), variable) if fpts else _NOT_MEASURED,
                    "ours_predicted": crossing(grid, pred, cud_pred, variable) if have_pred else (None, "no prediction"),
                    "ratios": [x for p in pts for x in (_ratio(p[1]), _ratio(p[3])) if x is not None]})
    for B in sorted({r.case["B"] for r in bf.records if r.pass_ == Pass.DECODE_GRAPH}):
        d = next((r for r in bf.records if r.pass_ == Pass.DECODE_DENSE and r.impl == Impl.CUDNN
                  and r.case["B"] == B), None)
        rows = [r for r in bf.records if r.pass_ == Pass.DECODE_GRAPH and r.case["B"] == B and r.ms is not None]
        if not rows or d is None or d.ms is None:
            continue
        steps = {r.case["keep"]: r.ms for r in bf.records if r.pass_ == Pass.SELECT_DECODE_GRAPH and r.case["B"] == B}
        pts = _first_of_each([(r.case["kept"], r) for r in rows])
        grid = [p[0] for p in pts]
        ours, pred = [p[1].ms for p in pts], [p[1].get("predicted_ms") for p in pts]
        step = [steps.get(p[1].case["keep"]) for p in pts]
        spts = [(g, x) for g, x in zip(grid, step) if x is not None]
        cud, cud_pred = [d.ms] * len(grid), [d.get("predicted_ms")] * len(grid)
        out.append({"family": "decode", "pass": "decode", "N": pts[0][1].case["N"], "B": B, "pattern": "decode",
                    "variable": "keep", "envelope": "dense", "grid": grid,
                    "patterns": [p[1].case["pattern"] for p in pts], "ours_ms": ours, "flex_ms": [None] * len(grid),
                    "cudnn_ms": cud, "ours_predicted_ms": pred, "cudnn_predicted_ms": cud_pred,
                    "flex_predicted_ms": [None] * len(grid), "step_ms": step,
                    "ours": crossing(grid, ours, cud, "keep"), "flex": (None, "not measured"),
                    "ours_device": (None, "not measured"), "flex_device": (None, "not measured"),
                    "ours_bracket": bracket(grid, ours, cud, "keep"), "flex_bracket": _NOT_MEASURED,
                    "step": crossing([g for g, _ in spts], [x for _, x in spts], cud[:len(spts)], "keep")
                    if spts else (None, "not measured"),
                    "ours_predicted": crossing(grid, pred, cud_pred, "keep") if all(x is not None for x in pred +
                                                                                   cud_pred) else
                    (None, "no prediction"),
                    "ratios": [x for x in (_ratio(p[1]) for p in pts) if x is not None] +
                    ([_ratio(d)] if _ratio(d) is not None else [])})
    return out


def prediction_ratios(bf: BenchFile, exclude=()) -> List[dict]:
    """Every measured row that carries a prediction, once: ``{"index", "impl", "pass", "family", "pattern",
    "N", "B", "measured_ms", "predicted_ms", "ratio"}`` with ratio = predicted / measured; ``exclude``: row
    indices to leave out (the calibration's repeats of fitted points)."""
    out = []
    skip = set(exclude)
    for i, r in enumerate(bf.records):
        ratio = _ratio(r)
        if ratio is not None and i not in skip:
            out.append({"index": i, "impl": r.impl, "pass": r.pass_, "family": r.case.get("family", "envelope"),
                        "pattern": r.case["pattern"], "N": r.case["N"], "B": r.case.get("B"), "measured_ms": r.ms,
                        "predicted_ms": r.get("predicted_ms"), "ratio": ratio})
    return out


def ratio_summary(ratios: List[float]) -> dict:
    """``n``, median, 10th and 90th percentiles and the fraction within +-25% of predicted / measured."""
    import numpy as np
    if not ratios:
        return {"n": 0}
    r = np.asarray(ratios, dtype=float)
    return {"n": int(r.size), "median": float(np.median(r)), "p10": float(np.quantile(r, 0.1)),
            "p90": float(np.quantile(r, 0.9)), "within_25pct": float(np.mean(np.abs(r - 1) <= 0.25))}


def crossover_table(bf: BenchFile) -> List[dict]:
    """The printed table: one line per family and pass (and length or batch), the crossovers measured (ours,
    Flex) and predicted (ours), and the median predicted/measured of the line's rows; a last line over every
    row with a prediction."""
    table = []
    for e in measured_crossovers(bf):
        rs = ratio_summary(e["ratios"])
        where = f"B={e['B']} L={e['N']}" if e["B"] else ("grid" if e["N"] is None else e["N"])
        table.append({"family": e["pattern"], "pass": e["pass"], "N": where, "variable": e["variable"],
                      "ours": _fmt(*e["ours"]), "flex": _fmt(*e["flex"]), "ours_device": _fmt(*e["ours_device"]),
                      "flex_device": _fmt(*e["flex_device"]), "ours_predicted": _fmt(*e["ours_predicted"]),
                      "points": len(e["grid"]), "pred/meas": f"{rs['median']:.2f}" if rs["n"] else ""})
    rs = ratio_summary([x["ratio"] for x in prediction_ratios(bf)])
    if rs["n"]:
        table.append({"family": "all rows", "points": rs["n"],
                      "pred/meas": f"median {rs['median']:.2f} (p10 {rs['p10']:.2f}, p90 {rs['p90']:.2f}), "
                                   f"{rs['within_25pct']:.0%} within 25%"})
    return table
