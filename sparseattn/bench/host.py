"""Suite ``host``: where the time of one eager call goes at short sequences.

At N <= 4k a sparse kernel runs for tens of microseconds, so a call can cost more on the host (argument
checks, config lookup, building kernel arguments, Triton's launcher, small torch ops) than on the device.
For each (pattern, N, pass) and each implementation (ours, FlexAttention compiled on the same block mask,
cuDNN on the pattern's causal envelope) this suite records:

* ``ms`` — back-to-back eager calls timed by CUDA events, as every other suite times them (a call whose host
  work outlasts its kernels is timed at its host rate);
* ``device_ms`` — the same call replayed from one CUDA graph: the device time alone, no host work;
* ``host_us`` — host wall time per call: ``n`` calls issued without a synchronisation, divided by ``n``
  (the launch queue never fills at these sizes, so this is the host's cost of one call);
* ``launches`` — CUDA kernels per call (``torch.profiler``), and ``host_syncs`` — whether the call
  synchronises with the host (``torch.cuda.set_sync_debug_mode("error")``; catches torch's syncs, such
  as ``.item()`` and ``nonzero``, not a driver call made by Triton).

For our op it also records ``host_us_triton_binding``: the same host measurement with the cached launch path
off (:mod:`sparseattn._fast_launch`), so every launch goes through Triton's own argument binding; and
``host_us_no_kept_hits``: with the cache on but the launch plans' kept hits off, so every launch computes
its cache key; and ``host_us_tensor_pointers``: with hits handing Triton's launcher tensors rather than their
device addresses (the launcher then asks the driver about every pointer argument). The four paths are
measured interleaved, three rounds, medians (:func:`host_paths`).
At one length it also records a ``cProfile`` of ``n`` calls: the functions with the most own
time, in microseconds per call (``profile`` in the row), so the host path can be cut where it is spent.
"""
from __future__ import annotations

import contextlib
import cProfile
import pstats
import statistics
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Sequence

import torch

from .. import _fast_launch
from ..ops import sparse_attention
from . import _common as C
from .cases import dense_pattern_of, prefill_layout
from .record import Impl, Pass, Record

NAME = "host"
DEFAULT_N = "1024,2048,4096"
CONFIG_KIND = None
PATTERNS = ["window1024", "sinks64+window1024", "causal", "random10%+diag"]
PROFILE_N = 2048  # the length whose host path is profiled function by function
HOST_CALLS = 200  # calls per host-time measurement
PROFILE_TOP = 15
COLUMNS = ["pattern", "N", "pass", "ours_ms", "ours_dev_ms", "ours_host_us", "tensor_ptr_host_us", "keyed_host_us",
           "bound_host_us", "ours_launches", "flex_ms", "flex_host_us", "cudnn_ms", "cudnn_host_us", "flex/ours"]


def host_us(fn: Callable, device, calls: Optional[int] = None) -> float:
    """Host microseconds per call of ``fn``: ``calls`` (default :data:`HOST_CALLS`) calls issued back to
    back, no synchronisation between them, the device drained before the clock starts."""
    calls = calls or HOST_CALLS
    fn()
    C.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    C.synchronize(device)
    return (t1 - t0) / calls * 1e6


def rotated_rounds(measure: Callable[[str], float], names: Sequence[str], rounds: int) -> Dict[str, List[float]]:
    """``measure(name)`` for every name, ``rounds`` times, after one warm-up round that is not kept (plans,
    kept hits, compiled code); round ``r`` starts at the ``r``-th name, so a drift of the host's speed during
    the run favours no variant (the check scripts' A/Bs)."""
    names = list(names)
    for name in names:
        measure(name)
    got: Dict[str, List[float]] = {name: [] for name in names}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            got[name].append(measure(name))
    return got


@contextlib.contextmanager
def launches_stubbed():
    """Within the block every launch of the ops (``ops._launch.launch``) does nothing: what is left of a call
    is its Python."""
    from ..ops import _launch as L
    saved = L.launch
    L.launch = lambda *a, **kw: None
    try:
        yield
    finally:
        L.launch = saved


def kernel_launches(fn: Callable, device, calls: int = 5) -> Optional[float]:
    """Device kernels per call of ``fn`` (``torch.profiler``); None off CUDA."""
    if torch.device(device).type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile
    fn()
    C.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        C.synchronize(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not e.name.startswith(("Memcpy", "Memset"))]
    return len(kernels) / calls


def host_syncs(fn: Callable, device) -> str:
    """``"none"`` if ``fn`` runs under ``set_sync_debug_mode("error")``, else the first line of the error
    (which names the synchronising op); ``"not checked"`` off CUDA."""
    if torch.device(device).type != "cuda":
        return "not checked"
    fn()
    torch.cuda.synchronize()
    old = torch.cuda.get_sync_debug_mode()
    torch.cuda.set_sync_debug_mode("error")
    try:
        fn()
        return "none"
    except RuntimeError as e:
        return str(e).splitlines()[0][:200]
    finally:
        torch.cuda.set_sync_debug_mode(old)


def host_profile(fn: Callable, device, calls: Optional[int] = None, top: int = PROFILE_TOP) -> List[dict]:
    """The ``top`` functions by own time over ``calls`` calls of ``fn``: ``{"function", "own_us",
    "cum_us", "calls"}`` per call of ``fn`` (``function`` is ``file:line(name)`` with the path shortened to
    the package)."""
    calls = calls or HOST_CALLS
    fn()
    C.synchronize(device)
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(calls):
        fn()
    prof.disable()
    C.synchronize(device)
    stats = pstats.Stats(prof).stats  # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    rows = []
    for (path, line, name), (_, nc, tt, ct, _) in stats.items():
        short = path.split("site-packages/", 1)[-1]
        if "/sparseattn/" in short:
            short = "sparseattn/" + short.split("/sparseattn/", 1)[1]
        rows.append({"function": f"{short}:{line}({name})", "own_us": tt / calls * 1e6, "cum_us": ct / calls * 1e6,
                     "calls": nc / calls})
    rows.sort(key=lambda r: -r["own_us"])
    return rows[:top]


class Span(NamedTuple):
    """One traced event: its name and its start and end in microseconds on the profiler's clock."""
    name: str
    start: float
    end: float


def rep_timeline(kernels: Sequence[Span], flushes: Sequence[Span], calls: Sequence[Span],
                 launches: Sequence[Span]) -> List[dict]:
    """Per timed repetition of a ``do_bench``-style loop (an L2 flush on the device, then the call), where its
    time went. ``kernels``: the device kernels of the calls; ``flushes``: the flush kernels, one per
    repetition; ``calls``: each call's host range; ``launches``: host launch API calls. Per repetition:
    ``lead_us`` (the device idle from the flush's end to the call's first kernel: the host was still
    preparing it), ``gaps_us`` (idle between the call's kernels), ``busy_us`` (its kernels' durations),
    ``total_us`` (flush end to last kernel end: what ``do_bench``'s events time), ``kernels``,
    ``host_first_us`` (the call's start to its first launch on the host) and ``host_span_us`` (its first
    launch to its last). A repetition whose kernels cannot be told apart (no kernel after its flush) is left
    out."""
    flushes = sorted(flushes, key=lambda s: s.start)
    kernels = sorted(kernels, key=lambda s: s.start)
    out = []
    for i, f in enumerate(flushes):
        stop = flushes[i + 1].start if i + 1 < len(flushes) else float("inf")
        mine = [k for k in kernels if f.end <= k.start < stop]
        if not mine:
            continue
        busy = sum(k.end - k.start for k in mine)
        span = max(k.end for k in mine) - mine[0].start
        row = {"lead_us": mine[0].start - f.end, "gaps_us": span - busy, "busy_us": busy,
               "total_us": max(k.end for k in mine) - f.end, "kernels": len(mine)}
        if i < len(calls):
            c = calls[i]
            own = sorted((a for a in launches if c.start <= a.start <= c.end), key=lambda s: s.start)
            if own:
                row["host_first_us"] = own[0].start - c.start
                row["host_span_us"] = own[-1].start - own[0].start
        out.append(row)
    return out


def eager_timeline(fn: Callable, reps: int = 30, flush_bytes: Optional[int] = None) -> dict:
    """Where an eager call's time goes as ``do_bench`` times it (CUDA only): ``reps`` repetitions of
    (zero a ``flush_bytes`` buffer, call ``fn``) under ``torch.profiler``, split by :func:`rep_timeline`;
    returns the median of each of its fields over the repetitions, and each kernel's median duration
    (``kernel_us``, by name). The profiler adds a few microseconds of host time per launch."""
    from torch.profiler import ProfilerActivity, profile, record_function

    from ..roofline.host import DO_BENCH_FLUSH_BYTES
    cache = torch.empty((flush_bytes or DO_BENCH_FLUSH_BYTES) // 4, dtype=torch.int32, device="cuda")
    for _ in range(3):
        cache.zero_()
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            cache.zero_()
            with record_function("sparseattn.call"):
                fn()
        torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as alone:  # the flush's own kernel names
        cache.zero_()
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    # a call's own small fills may share the flush kernel's name: a flush is also as long as the lone one
    lone = [e for e in alone.events() if e.device_type == cuda]
    flush_names = {e.name for e in lone}
    shortest = 0.5 * min(e.time_range.end - e.time_range.start for e in lone)
    events = list(prof.events())
    span = lambda e: Span(e.name, e.time_range.start, e.time_range.end)  # noqa: E731
    calls = sorted((span(e) for e in events if e.name == "sparseattn.call" and e.device_type != cuda),
                   key=lambda s: s.start)
    device = sorted((span(e) for e in events if e.device_type == cuda and not e.name.startswith("Memcpy")
                     and e.name != "sparseattn.call"),  # (the range's own device-side annotation)
                    key=lambda s: s.start)
    is_flush = lambda d: d.name in flush_names and d.end - d.start >= shortest  # noqa: E731
    flushes = [d for d in device if is_flush(d)]
    kernels = [d for d in device if not is_flush(d)]
    launches = [span(e) for e in events if e.device_type != cuda and ("LaunchKernel" in e.name or
                                                                      "GraphLaunch" in e.name)]
    reps_ = rep_timeline(kernels, flushes, calls, launches)
    fields = sorted({k for r in reps_ for k in r})
    out = {k: float(statistics.median(r[k] for r in reps_ if k in r)) for k in fields}
    by_name: Dict[str, List[float]] = {}
    for d in kernels:
        by_name.setdefault(d.name, []).append(d.end - d.start)
    out["kernel_us"] = {n[:80]: float(statistics.median(v)) for n, v in by_name.items()}
    out["reps"] = len(reps_)
    return out


def _measure(fn: Callable, device, stream=None) -> dict:
    """Every number of one (implementation, case): ms, device_ms, host_us, launches, host_syncs. ``stream``:
    the side stream a backward's kept forward ran on (its capture must run there too)."""
    ms = C.time_gpu(fn)
    out = {"ms": ms, "device_ms": C.graph_ms(fn, stream), "host_us": host_us(fn, device),
           "launches": kernel_launches(fn, device), "host_syncs": host_syncs(fn, device)}
    return out


#: The host paths of our op the suite compares, each entered by a context (the default path first).
PATHS = {"host_us": contextlib.nullcontext, "host_us_no_kept_hits": lambda: _fast_launch.kept_hits(False),
         "host_us_triton_binding": lambda: _fast_launch.enabled(False),
         "host_us_tensor_pointers": lambda: _fast_launch.pointer_ints(False)}
AB_ROUNDS = 3


def host_paths(fn: Callable, device) -> dict:
    """Host microseconds per call of ``fn`` on each path of :data:`PATHS`: the median of :data:`AB_ROUNDS`
    rounds, the paths interleaved in each (the host's speed drifts between measurements taken minutes apart,
    by a third on the H200 box)."""
    got = {name: [] for name in PATHS}
    for _ in range(AB_ROUNDS):
        for name, path in PATHS.items():
            with path():
                got[name].append(host_us(fn, device))
    return {name: float(statistics.median(v)) for name, v in got.items()}


def run(args) -> tuple:
    """Measure every (N, pattern, pass); return (records, table rows, table columns)."""
    dev = args.device
    H, D, dtype = args.heads, args.head_dim, torch.bfloat16
    Ns = [int(x) for x in args.n.split(",")]
    patterns = args.patterns.split(",") if args.patterns else PATTERNS
    records, table = [], []
    with C.progress(len(Ns) * len(patterns), NAME) as bar:
        for N in Ns:
            torch.manual_seed(0)
            q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=dtype) for _ in range(4))
            base = dict(N=N, B=1, H=H, D=D, dtype="bf16")
            for pattern in patterns:
                bar.set_postfix_str(f"{pattern} N={N}")
                layout = prefill_layout(pattern, N, device=dev)
                st = layout.stats()
                case = {**base, "pattern": pattern, "block": 128, "tiles": st["listed_tiles"]}
                impls = {Impl.OURS: lambda a, b, c, lay=layout: sparse_attention(a, b, c, lay)}
                if not args.no_flex:
                    block_mask = layout.to_flex()
                    flex = C.compiled_flex()
                    impls[Impl.FLEX] = lambda a, b, c, bm=block_mask: flex(a, b, c, block_mask=bm)
                envelope = dense_pattern_of(pattern)
                impls[Impl.CUDNN] = lambda a, b, c, causal=(envelope == "causal"): C.sdpa_fn(a, b, c, Impl.CUDNN,
                                                                                              causal)()
                for pass_ in (Pass.FWD, Pass.BWD):
                    row = {"pattern": pattern, "N": N, "pass": pass_}
                    got = {}
                    for impl, make in impls.items():
                        side = torch.cuda.Stream() if pass_ == Pass.BWD and torch.device(dev).type == "cuda" \
                            else None
                        fwd, bwd = C.fwd_bwd(make, q, k, v, do, side)
                        fn = fwd if pass_ == Pass.FWD else bwd
                        try:
                            m = _measure(fn, dev, side)
                        except RuntimeError as e:  # a backend that refuses the shape
                            C.note(f"{impl} {pass_} {pattern} N={N}: {type(e).__name__}: {str(e)[:160]}")
                            continue
                        extra = {k_: v_ for k_, v_ in m.items() if k_ != "ms"}
                        if impl == Impl.CUDNN:
                            extra["envelope"] = envelope
                        if impl == Impl.OURS:  # the host paths interleaved (host_us replaced by its median)
                            extra.update(host_paths(fn, dev))
                            m["host_us"] = extra["host_us"]
                        if impl == Impl.OURS and N == PROFILE_N:
                            extra["profile"] = host_profile(fn, dev)
                        records.append(Record(case, impl, pass_, m["ms"], extra))
                        got[impl] = {**m, **extra}
                    _table_row(row, got)
                    table.append(row)
                bar.update()
            C.empty_cache()
    return records, table, COLUMNS


def _table_row(row: dict, got: dict) -> None:
    names = {Impl.OURS: "ours", Impl.FLEX: "flex", Impl.CUDNN: "cudnn"}
    for impl, m in got.items():
        row[f"{names[impl]}_ms"] = round(m["ms"], 4)
        row[f"{names[impl]}_host_us"] = round(m["host_us"], 1)
    if Impl.OURS in got:
        dev_ms = got[Impl.OURS]["device_ms"]
        row["ours_dev_ms"] = None if dev_ms is None else round(dev_ms, 4)
        row["ours_launches"] = got[Impl.OURS]["launches"]
        row["bound_host_us"] = round(got[Impl.OURS]["host_us_triton_binding"], 1)
        row["keyed_host_us"] = round(got[Impl.OURS]["host_us_no_kept_hits"], 1)
        row["tensor_ptr_host_us"] = round(got[Impl.OURS]["host_us_tensor_pointers"], 1)
    if Impl.OURS in got and Impl.FLEX in got:
        row["flex/ours"] = round(got[Impl.FLEX]["ms"] / got[Impl.OURS]["ms"], 2)
