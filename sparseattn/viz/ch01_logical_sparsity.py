"""Chapter 1, logical sparsity is not speed: one pattern run four ways (dense logits with a -inf mask, as
FlexAttention, as our block-sparse kernel, and cuDNN on the pattern's envelope) from the recorded ``prefill``
and ``crossover`` suites; the work a pattern removes, keeps and adds, counted exactly for one shape and
priced by the cost model; the live version of the measurement."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Tuple

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..bench.cases import dense_pattern_of
from ..bench.record import BenchFile, Impl, Pass, check_timing
from ..layout import BlockLayout
from ..roofline import cost
from ..roofline.counts import as_shape
from ..roofline.crossover import PREFILL_SHAPE, bracket, envelope_of
from ..roofline.model import model_params, work_of
from . import COLORS
from ._axes import tidy_log

__all__ = ["FOUR_WAYS", "four_ways_series", "recorded_patterns", "four_ways_figure", "four_ways_bars",
           "measured_crossover", "runs_of", "one_run", "work_ledger", "work_figure", "measure_four_ways", "four_ways_small", "pattern_layout"]

#: The four ways of running a pattern, in the order the figures draw them: (impl, legend).
FOUR_WAYS = [(Impl.NAIVE, "dense logits + -inf mask (eager PyTorch)"), (Impl.FLEX, "FlexAttention, same block mask"),
             (Impl.OURS, "sparseattn, block-sparse kernel"), (Impl.CUDNN, "cuDNN on the envelope (dense or causal)")]


# ---------------------------------------------------------------------------------------------------------
# recorded: the four ways against N
# ---------------------------------------------------------------------------------------------------------
def _envelope_name(rows: list, pattern: str) -> str:
    for r in rows:
        if "envelope" in r.case:
            return r.case["envelope"]
    return dense_pattern_of(pattern)


def four_ways_series(prefill: BenchFile, crossover: Optional[BenchFile], pattern: str,
                     pass_: str = Pass.FWD, timing: str = "eager") -> Dict[str, List[Tuple[int, float, str]]]:
    """impl -> ascending ``[(N, ms, source suite)]`` of one pattern: naive, FlexAttention and ours on the pattern,
    cuDNN on its envelope. Lengths the ``crossover`` file measured come from it (one run for the short
    lengths and the crossover), the others from ``prefill``. Rows whose measurement failed are left out.
    ``timing``: ``"eager"`` (the event-timed call, ``ms``) or ``"device"`` (the same call replayed from a
    CUDA graph, ``device_ms``: no host work; rows without it, the naive one's and older runs', are left out)."""
    check_timing(timing)

    def ms_of(r):
        return r.time(timing)

    files = [f for f in (crossover, prefill) if f is not None]
    env = None
    out: Dict[str, Dict[int, Tuple[float, str]]] = {impl: {} for impl, _ in FOUR_WAYS}
    for f in files:
        have = {r.case["pattern"] for r in f.records}
        if pattern not in have:
            continue
        rows = [r for r in f.records if r.case["pattern"] == pattern and r.pass_ == pass_ and not r.is_sweep]
        env = env or _envelope_name(rows, pattern)
        for r in rows:
            if r.impl in out and r.impl != Impl.CUDNN and ms_of(r) is not None:
                out[r.impl].setdefault(r.case["N"], (ms_of(r), f.suite))
        for r in f.records:
            if r.impl == Impl.CUDNN and r.pass_ == pass_ and r.case["pattern"] == env and ms_of(r) is not None \
                    and r.case.get("B", 1) == 1:
                if any(x.case["N"] == r.case["N"] for x in rows):  # the lengths this file measured the pattern at
                    out[Impl.CUDNN].setdefault(r.case["N"], (ms_of(r), f.suite))
    if env is None:
        raise LookupError(f"no recorded {pass_} rows of pattern {pattern!r}; patterns: "
                          f"{recorded_patterns(prefill, crossover)}")
    return {impl: sorted((n, ms, src) for n, (ms, src) in pts.items()) for impl, pts in out.items()}


def recorded_patterns(prefill: BenchFile, crossover: Optional[BenchFile]) -> List[str]:
    """The patterns measured against the length: the prefill suite's (but causal, which is its own envelope)
    and the crossover suite's length families."""
    pats = [p for p in prefill.distinct("pattern", impl=Impl.OURS, pass_=Pass.FWD) if p != "causal"]
    if crossover is not None:
        pats += [p for p in crossover.distinct("pattern", impl=Impl.OURS, pass_=Pass.FWD)
                 if any(r.case.get("family") in ("window", "sinks_window") for r in
                        crossover.select(Impl.OURS, Pass.FWD, pattern=p))]
    return sorted(set(pats))


def _sources(runs: List[BenchFile]) -> str:
    """Device and date of each run a figure draws (and only those)."""
    parts = [f"{f.suite}: {f.meta['device']}, {f.meta['date'][:10]}" for f in runs]
    return "; ".join(parts) + f"; torch {runs[0].meta['torch']}"


def measured_crossover(series: Dict[str, list], impl: str = Impl.OURS) -> dict:
    """Where ``impl`` drops below cuDNN on the envelope for good along N, as the two measured lengths that
    bracket it (:func:`~sparseattn.roofline.crossover.bracket`: no interpolation between single medians), on
    the lengths both were measured at. Give it the series of one run (:func:`one_run`): mixing runs mixes
    their host conditions."""
    cud = {n: ms for n, ms, _ in series[Impl.CUDNN]}
    pts = [(n, ms, cud[n]) for n, ms, _ in series[impl] if n in cud]
    if not pts:
        return {"state": "not measured", "lo": None, "hi": None, "n": 0, "wins": 0}
    return bracket([p[0] for p in pts], [p[1] for p in pts], [p[2] for p in pts], "N")


def runs_of(prefill: BenchFile, crossover: Optional[BenchFile], pattern: str) -> List[BenchFile]:
    """The recorded runs (files) that measured ``pattern`` forward, the crossover run first."""
    return [f for f in (crossover, prefill) if f is not None
            and any(r.case["pattern"] == pattern and r.pass_ == Pass.FWD and r.impl == Impl.OURS for r in f.records)]


def one_run(f: BenchFile, pattern: str, pass_: str = Pass.FWD,
            timing: str = "eager") -> Dict[str, List[Tuple[int, float, str]]]:
    """:func:`four_ways_series` of one run only: every curve and every comparison from the same process."""
    return four_ways_series(f, None, pattern, pass_, timing)


def four_ways_figure(prefill: BenchFile, crossover: Optional[BenchFile], pattern: str) -> go.Figure:
    """Forward time against N of the four ways for one pattern (bf16, B=1, 16 heads, D=128), log-log. Each run
    draws its own curves (solid: the crossover run, dotted: the prefill run), so no curve joins points of two
    runs; the shaded band is where ours overtakes cuDNN in a run, between two measured lengths."""
    runs = runs_of(prefill, crossover, pattern)
    env = _envelope_name([r for f in runs for r in f.records if r.case["pattern"] == pattern], pattern)
    fig = go.Figure()
    xs, ys = [], []
    for f in runs:
        series = one_run(f, pattern)
        run = f"{f.suite} run {f.meta['date'][5:10]}"
        solid = f.suite != prefill.suite  # the style names the run, also where a pattern has only one
        for impl, name in FOUR_WAYS:
            pts = series[impl]
            if not pts:
                continue
            label = name.replace("the envelope (dense or causal)", f"the envelope: {env}").split(",")[0]
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                     name=f"{label} ({run})", legendgroup=impl,
                                     marker=dict(symbol="circle" if solid else "square", size=7),
                                     line=dict(color=COLORS[impl], dash="solid" if solid else "dot"),
                                     hovertemplate=f"N=%{{x}}: %{{y:.3f}} ms ({run})<extra></extra>"))
            xs += [p[0] for p in pts]
            ys += [p[1] for p in pts]
        b = measured_crossover(series)
        if b["state"] == "crosses":
            fig.add_vrect(x0=b["lo"], x1=b["hi"], fillcolor=COLORS[Impl.OURS], opacity=0.08, line_width=0,
                          annotation_text=f"ours passes cuDNN ({run})",
                          # the two runs' bands overlap: one label at the top, the other at the bottom
                          annotation_position="top left" if solid else "bottom left",
                          annotation_font_size=10)
    fig.update_layout(title=f"{pattern}: forward, bf16, B=1, H=16, D=128<br><sup>measured: {_sources(runs)}"
                            f"</sup>", xaxis_title="sequence length N (tokens)", yaxis_title="ms per call (median)",
                      xaxis_type="log", yaxis_type="log", height=520, title_font_size=12,
                      legend=dict(font=dict(size=10), orientation="h", y=-0.2, yanchor="top"),
                      margin=dict(b=150))
    fig.update_xaxes(range=[math.log10(min(xs)) - 0.05, math.log10(max(xs)) + 0.05])
    fig.update_yaxes(range=[math.log10(min(ys)) - 0.1, math.log10(max(ys)) + 0.1])
    return tidy_log(fig)


def four_ways_bars(prefill: BenchFile, crossover: Optional[BenchFile], pattern: str, N: int) -> go.Figure:
    """The four ways at one length, from one run (the run that measured the most of them at N, the newer
    crossover run on a tie): dots on a log axis (ms), with each one's ratio to ours."""
    runs = [f for f in runs_of(prefill, crossover, pattern)
            if any(n == N for n, _, _ in one_run(f, pattern)[Impl.OURS])]
    if not runs:
        have = sorted({n for f in runs_of(prefill, crossover, pattern) for n, _, _ in one_run(f, pattern)[Impl.OURS]})
        raise LookupError(f"{pattern}: ours was not measured at N={N}; lengths: {have}")
    count = lambda f: sum(any(n == N for n, _, _ in pts) for pts in one_run(f, pattern).values())  # noqa: E731
    f = max(runs, key=count)  # runs_of lists the crossover run first: max keeps the first of equals
    series = one_run(f, pattern)
    at = {impl: next((ms for n, ms, _ in pts if n == N), None) for impl, pts in series.items()}
    ours = at[Impl.OURS]
    names, ms, colors, text = [], [], [], []
    for impl, name in FOUR_WAYS:
        if at[impl] is None:
            continue
        names.append(name.split(",")[0].split(" (")[0])
        ms.append(at[impl])
        colors.append(COLORS[impl])
        text.append(f"{at[impl]:.3g} ms ({at[impl] / ours:.2f}x ours)")
    fig = go.Figure(go.Scatter(x=names, y=ms, mode="markers+text", marker=dict(color=colors, size=14), text=text,
                               # the last label to the left of its marker: to the right it runs off the figure
                               textposition=["middle right"] * (len(names) - 1) + ["middle left"],
                               cliponaxis=False, showlegend=False,
                               hovertemplate="%{x}: %{y:.4g} ms<extra></extra>"))
    lo, hi = math.log10(min(ms)), math.log10(max(ms))
    fig.update_layout(title=f"{pattern} at N={N}: forward, all from one run<br><sup>{f.caption()} "
                            f"({f.suite} suite)</sup>",
                      yaxis_title="ms per call (median, log scale)", yaxis_type="log", height=420, title_font_size=12,
                      xaxis_title="implementation", showlegend=False, yaxis_range=[lo - 0.15, hi + 0.15])
    return tidy_log(fig)


# ---------------------------------------------------------------------------------------------------------
# removed, remaining, added: one shape counted and priced
# ---------------------------------------------------------------------------------------------------------
def _clipped(length: int, n: int, block: int) -> torch.Tensor:
    return torch.clamp(length - torch.arange(n) * block, min=0, max=block).double()


def work_ledger(layout: BlockLayout, shape=None, *, index_rebuilt: bool = False, device=None) -> dict:
    """The three kinds of work of one forward call, for ``layout`` at ``shape`` (default: B=1, 16 heads,
    D=128, bf16).

    Counted exactly (tile matmul FLOPs, whole tiles as the kernels multiply them): the envelope's tiles (what
    cuDNN computes: every tile of the causal triangle, or all), the tiles the pattern **removes**, and the
    tiles that **remain**, split into the allowed cells (useful) and the masked cells of the same tiles
    (padding). Priced by the cost model (:func:`sparseattn.roofline.cost`, H200 unless ``device``): our time
    split into full-tile work, partial tiles (their mask work apart), per-program prologues, the tail of the
    last wave, the launch, and the work the pattern **adds**: the index (tables read by the kernel) and,
    with ``index_rebuilt``, building the layout every call."""
    s = as_shape(shape) if shape is not None else PREFILL_SHAPE
    env = envelope_of(layout)
    rows, cols = _clipped(layout.q_len, layout.nq, layout.block_q), _clipped(layout.kv_len, layout.nk, layout.block_k)
    partial, full = (x.cpu() for x in layout.block_classes())
    listed = partial | full
    q_hi = (torch.arange(layout.nq) + 1) * layout.block_q - 1 + layout.q_offset
    k_lo = torch.arange(layout.nk) * layout.block_k
    env_tiles = torch.ones_like(listed) if env == "dense" else (k_lo.view(1, -1) <= q_hi.view(-1, 1)).expand_as(listed)
    heads = s.B * s.Hq / (layout.B * layout.H)  # query heads per layout (b, h)
    per_cell = 4.0 * s.D * heads  # QK^T and PV: 2 D multiply-adds per cell, per query head
    area = rows.view(-1, 1) * cols.view(1, -1)
    st = layout.stats()
    flops = {"envelope": float((env_tiles * area).sum()) * per_cell,
             "remaining": float((listed * area).sum()) * per_cell,
             "useful": st["logical_edges"] * per_cell}
    flops["removed"] = flops["envelope"] - float((env_tiles & listed).double().mul(area).sum()) * per_cell
    flops["padding"] = flops["remaining"] - flops["useful"]
    ours = cost(layout, s, "fwd", rebuild_layout=index_rebuilt, device=device)
    dense = cost(_envelope(env, layout), s, "fwd", impl="cudnn", device=device)
    # our compute term, split by what the programs do (units of one full step, as the model schedules them)
    work = work_of(layout, s, "fwd", device=device)
    p = model_params("sparseattn", "fwd")
    k = work.kernels[0]
    kern = ours.kernels[0]
    unit_ms = kern["balanced_ms"] / max(float((p["program_overhead"] + k.steps_full.double()
                                                + k.steps_partial.double() * (1 + p["partial_overhead"])).sum()), 1e-30)
    full_steps, partial_steps = float(k.steps_full.sum()), float(k.steps_partial.sum())
    time = {"full tiles": full_steps * unit_ms, "partial tiles": partial_steps * unit_ms,
            "mask work in partial tiles": partial_steps * p["partial_overhead"] * unit_ms,
            "program prologues": k.programs * p["program_overhead"] * unit_ms, "last-wave tail": kern["tail_ms"],
            "launch": ours.t_launch_ms, "layout build (index)": ours.t_index_ms}
    if ours.t_memory_ms > ours.t_compute_ms:  # memory-bound: the kernel takes its memory time
        time = {"memory (bytes / W_eff)": ours.t_memory_ms, "launch": ours.t_launch_ms,
                "layout build (index)": ours.t_index_ms}
    return {"layout": layout, "shape": s, "envelope": env, "flops": flops, "time_ms": time,
            "tiles": {"envelope": int(env_tiles.sum()), "listed": int(listed.sum()), "full": int(full.sum()),
                      "partial": int(partial.sum())},
            "index_bytes": ours.bytes_hbm.get("index", 0.0) + ours.bytes_hbm.get("bits", 0.0)
            + ours.bytes_hbm.get("doc", 0.0), "bytes_hbm": ours.D_hbm, "index_build_ms": ours.index_build_ms,
            "ours": ours, "cudnn": dense, "tile_amplification": st["tile_amplification"],
            "logical_density": st["logical_density"]}


def _envelope(env: str, layout: BlockLayout) -> BlockLayout:
    from ..roofline.crossover import envelope_layout
    return envelope_layout(env, layout.q_len, layout.kv_len)


def work_figure(ledger: dict, measured: Optional[Dict[str, float]] = None, title: str = "",
                measured_caption: str = "") -> go.Figure:
    """Top: the envelope's tile FLOPs, split into removed and remaining (allowed cells + masked cells of kept
    tiles). Bottom: time, cuDNN on the envelope against ours split into its terms (cost model), with the
    measured times as black diamonds; ``measured_caption`` says where and when they were measured."""
    f = {k: v / 1e12 for k, v in ledger["flops"].items()}
    fig = make_subplots(rows=2, cols=1, vertical_spacing=0.22,
                        subplot_titles=("work: tile-matmul TFLOP of one forward (exact)",
                                        "time: ms per forward (model, H200; diamonds: measured)"))
    env_name = f"envelope ({ledger['envelope']})"
    for name, value, color in (("removed: tiles never scheduled", f["removed"], "#c7e9c0"),
                               ("remaining: allowed cells", f["useful"], COLORS[Impl.OURS]),
                               ("remaining: masked cells of kept tiles", f["padding"], "#fcbba1")):
        fig.add_trace(go.Bar(y=[env_name], x=[value], name=name, orientation="h", marker_color=color,
                             legendgroup="work", hovertemplate=f"{name}: %{{x:.3g}} TFLOP<extra></extra>"), 1, 1)
    fig.add_trace(go.Bar(y=["cuDNN"], x=[ledger["cudnn"].predicted_ms], orientation="h",
                         name="cuDNN on the envelope", marker_color=COLORS[Impl.CUDNN], legendgroup="time"), 2, 1)
    shades = ["#d62728", "#e15759", "#ff9896", "#f7b6b2", "#fdd0a2", "#9c9ede", "#6b6ecf"]
    for (name, ms), color in zip(ledger["time_ms"].items(), shades):
        label = f"ours: {name}" + (" (0 here)" if ms == 0 else "")  # a zero term has no bar: say so
        fig.add_trace(go.Bar(y=["ours"], x=[ms], orientation="h", name=label, marker_color=color,
                             legendgroup="time", hovertemplate=f"{name}: %{{x:.3g}} ms<extra></extra>"), 2, 1)
    if measured:
        ys = [(y, measured.get(who)) for who, y in (("sparseattn", "ours"), ("cudnn", "cuDNN")) if measured.get(who)]
        if ys:
            fig.add_trace(go.Scatter(y=[y for y, _ in ys], x=[x for _, x in ys], mode="markers", name="measured",
                                     marker=dict(symbol="diamond", size=13, color="black"), legendgroup="time"), 2, 1)
    lay, s = ledger["layout"], ledger["shape"]
    fig.update_layout(barmode="stack", height=640, title_font_size=12,
                      legend=dict(font=dict(size=10), orientation="h", y=-0.12, yanchor="top"),
                      title=title or (f"N={lay.q_len}, B={s.B}, H={s.Hq}, D={s.D}: {ledger['tiles']['listed']} of "
                                      f"{ledger['tiles']['envelope']} envelope tiles kept; tables "
                                      f"{ledger['index_bytes'] / 1e3:.1f} kB")
                      + (f"<br><sup>diamonds: {measured_caption}</sup>" if measured and measured_caption else ""),
                      margin=dict(l=130, b=200))
    fig.update_xaxes(title_text="TFLOP", row=1, col=1)
    fig.update_xaxes(title_text="ms", row=2, col=1)
    fig.update_yaxes(title_text="work", row=1, col=1)
    fig.update_yaxes(title_text="implementation", row=2, col=1)
    return fig


# ---------------------------------------------------------------------------------------------------------
# live: the four ways measured here
# ---------------------------------------------------------------------------------------------------------
def measure_four_ways(layout: BlockLayout, heads: int = 16, head_dim: int = 128, device="cuda",
                      naive_max_bytes: float = 24e9) -> Dict[str, Optional[float]]:
    """Time the four ways on this machine's GPU (bf16, random inputs; the same helpers as the benchmark
    suites): naive masked dense where its scores fit in ``naive_max_bytes``, FlexAttention compiled on
    ``layout.to_flex()``, ours, cuDNN on the envelope. A backend that refuses gives None."""
    from ..bench import _common as C
    from ..ops import sparse_attention
    N = layout.q_len
    lay = layout.to(device)
    q, k, v = (torch.randn(1, heads, N, head_dim, device=device, dtype=torch.bfloat16) for _ in range(3))
    makers = {Impl.OURS: lambda: (lambda: sparse_attention(q, k, v, lay)),
              Impl.FLEX: lambda: C.flex_fn(q, k, v, lay.to_flex()),
              Impl.CUDNN: lambda: C.sdpa_fn(q, k, v, "cudnn", envelope_of(layout) == "causal")}
    if heads * N * N * 2 * 3 <= naive_max_bytes:
        makers[Impl.NAIVE] = lambda: C.naive_fn(q, k, v, lay.to_dense())
    out: Dict[str, Optional[float]] = {impl: None for impl, _ in FOUR_WAYS}
    for impl, make in makers.items():
        try:
            out[impl] = C.time_gpu(make())
        except Exception as e:  # a backend that refuses the shape is reported, not fatal
            C.note(f"{impl}: {type(e).__name__}: {str(e)[:120]}")
    return out


def four_ways_small(L: int = 256, heads: int = 2, head_dim: int = 32, block: int = 32, device="cpu",
                    dtype=torch.float32) -> List[dict]:
    """The four ways on a small shape that runs anywhere (our kernel in the Triton interpreter without a GPU;
    FlexAttention eager off the GPU, compiled on it; cuDNN only on a GPU): ``sinks_window(16, L // 4)``, each
    way's output compared with the fp64 reference on the pattern's mask (``max_err``: max absolute error;
    ``rel_err``: :func:`sparseattn.reference.relative_error`, the measure the tolerance table bounds), and the
    query-key scores it computed
    (naive: every cell of the square; cuDNN: the causal triangle's cells, a lower bound, since a causal kernel
    multiplies its diagonal tiles whole; ours and FlexAttention: the cells of the listed tiles, the compiled
    kernel's count for FlexAttention, whose eager fallback off the GPU computes the whole square)."""
    import warnings
    from .. import patterns as P
    from ..bench import _common as C
    from ..ops import sparse_attention
    from ..reference import reference_attention, relative_error
    mm = P.sinks_window(16, L // 4)
    layout = BlockLayout.from_mask_mod(mm, L, L, block, block, device=device)
    g = torch.Generator(device="cpu").manual_seed(0)
    q, k, v = (torch.randn(1, heads, L, head_dim, generator=g).to(device=device, dtype=dtype) for _ in range(3))
    dense = layout.to_dense()
    ref = reference_attention(q, k, v, dense)
    st = layout.stats()
    cuda = torch.device(device).type == "cuda"
    ways = {Impl.NAIVE: (lambda: C.naive_fn(q, k, v, dense)(), L * L),
            Impl.OURS: (lambda: sparse_attention(q, k, v, layout), st["physical_edges"])}
    if cuda:
        ways[Impl.FLEX] = (C.flex_fn(q, k, v, layout.to_flex()), st["physical_edges"])
        ways[Impl.CUDNN] = (C.sdpa_fn(q, k, v, "cudnn", True), L * (L + 1) // 2)
    else:
        from torch.nn.attention.flex_attention import flex_attention
        ways[Impl.FLEX] = (lambda: flex_attention(q, k, v, block_mask=layout.to_flex()), st["physical_edges"])
    out = []
    for impl, _ in FOUR_WAYS:
        if impl not in ways:
            out.append({"impl": impl, "ran": False, "scores": L * (L + 1) // 2, "max_err": None,
                        "rel_err": None, "note": "cuDNN needs a GPU; its count: the causal cells, a lower bound"})
            continue
        fn, scores = ways[impl]
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # FlexAttention warns that eager mode is unfused
                o = fn()
        except RuntimeError as e:  # a backend that refuses this small shape says so instead of failing the page
            out.append({"impl": impl, "ran": False, "scores": scores, "max_err": None, "rel_err": None,
                        "note": f"refused: {str(e)[:80]}"})
            continue
        is_causal_envelope = impl == Impl.CUDNN  # cuDNN computes the causal envelope: compare where it agrees
        err = float((o.double() - ref).abs().max()) if not is_causal_envelope else None
        rel = relative_error(o, ref) if not is_causal_envelope else None
        note = "computes the causal envelope, not the pattern; its count: the causal cells, a lower bound" \
            if is_causal_envelope else f"the compiled kernel's count; this eager fallback computes all {L * L}" \
            if impl == Impl.FLEX and not cuda else ""
        out.append({"impl": impl, "ran": True, "scores": scores, "max_err": err, "rel_err": rel, "note": note})
    return out


def pattern_layout(pattern: str, N: int, device="cpu") -> BlockLayout:
    """The layout of a recorded pattern name at length ``N``: the prefill suite's (``window1024``, ...) and the
    crossover suite's length families (``window2048``, ``sinks64+window1024``)."""
    import re
    from .. import patterns as P
    from ..roofline.cases import ENVELOPES, prefill_layout
    if pattern in ENVELOPES:
        return prefill_layout(pattern, N, device=device)
    m = re.fullmatch(r"(?:sinks(\d+)\+)?window(\d+)", pattern)
    if m is None:
        raise ValueError(f"pattern must be a recorded prefill pattern {sorted(ENVELOPES)} or 'window<w>' / "
                         f"'sinks<n>+window<w>', got {pattern!r}")
    mm = P.sliding_window(int(m.group(2))) if m.group(1) is None else P.sinks_window(int(m.group(1)), int(m.group(2)))
    return BlockLayout.from_mask_mod(mm, N, N, 128, 128, device=device)
