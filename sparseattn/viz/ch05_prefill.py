"""Chapter 5, the prefill kernel: the tile walk of one program (which key tiles it loads in which order, and
its running softmax state), and the recorded ``prefill`` suite: forward time against N per pattern, the
speedup against logical density, the N = 32k table and the tile-configuration sweep."""
from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..bench.cases import PREFILL_PATTERNS, dense_pattern_of
from ..bench.record import BenchFile, Impl, Pass
from . import COLORS, TILE_COLORS, Table
from ._axes import tidy_log
from .ch03_layout import book_layout, tile_trace

__all__ = ["tile_walk", "tile_walk_figure", "prefill_time_figure", "prefill_speedup_figure", "prefill_table",
           "prefill_sweep_table", "BASELINE_LABEL"]

#: How the figures name the dense baseline that does a pattern's work (its envelope).
BASELINE_LABEL = {"causal": "cuDNN causal", "dense": "cuDNN dense"}


# ---------------------------------------------------------------------------------------------------------
# the tile walk: one program's loop, replayed in eager PyTorch (no kernel)
# ---------------------------------------------------------------------------------------------------------
def tile_walk(pattern: str = "sinks + window", L: int = 256, block: int = 32, q_tile: Optional[int] = None,
              window: Optional[int] = None, D: int = 16, seed: int = 0) -> dict:
    """Replay the forward kernel's loop for query tile ``q_tile`` (default: the last) of a chapter-3 pattern:
    partial tiles first, then full tiles, each folded into the running state with the online softmax.

    Returns ``layout``, ``q_tile``, ``steps`` (one dict per loaded tile: ``tile``, ``kind`` "partial" or
    "full", ``m`` and ``l`` per query row of the tile after the step, natural log units, ``None`` for a row
    that has seen no allowed key yet) and ``error`` (max |o - reference| after the last step, fp64)."""
    layout = book_layout(pattern, L, block, block, window=window if window is not None else L // 4)
    qi = layout.nq - 1 if q_tile is None else q_tile
    if not 0 <= qi < layout.nq:
        raise ValueError(f"q_tile must be in [0, {layout.nq}) for L={L}, block={block}, got {q_tile}")
    g = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(L, D, generator=g, dtype=torch.float64) for _ in range(3))
    rows = torch.arange(qi * block, min((qi + 1) * block, L))
    allowed = layout.to_dense()[0, 0][rows]  # [BM, L]
    scores = (q[rows] @ k.T) / math.sqrt(D)  # [BM, L]
    order = [(int(j), "partial") for j in layout.kv_index[0, 0, qi, : layout.kv_count[0, 0, qi]]]
    order += [(int(j), "full") for j in layout.full_index[0, 0, qi, : layout.full_count[0, 0, qi]]]
    m = torch.full((len(rows),), -math.inf, dtype=torch.float64)
    lsum = torch.zeros(len(rows), dtype=torch.float64)
    acc = torch.zeros(len(rows), D, dtype=torch.float64)
    steps = []
    for j, kind in order:
        cols = slice(j * block, min((j + 1) * block, L))
        s = scores[:, cols].masked_fill(~allowed[:, cols], -math.inf)  # [BM, BN]
        m_new = torch.maximum(m, s.max(1).values)
        m_sub = torch.where(torch.isinf(m_new), torch.zeros_like(m_new), m_new)  # the kernel's guard
        alpha = torch.exp(m - m_sub)
        p = torch.exp(s - m_sub[:, None])
        lsum = lsum * alpha + p.sum(1)
        acc = acc * alpha[:, None] + p @ v[cols]
        m = m_new
        seen = ~torch.isinf(m)
        steps.append(dict(tile=j, kind=kind, m=[float(x) if ok else None for x, ok in zip(m, seen)],
                          l=[float(x) if ok else None for x, ok in zip(lsum, seen)]))
    o = torch.where(lsum[:, None] > 0, acc / lsum.clamp_min(1e-300)[:, None], torch.zeros_like(acc))
    w = torch.softmax(scores.masked_fill(~allowed, -math.inf), 1).nan_to_num(0.0)
    return dict(layout=layout, q_tile=qi, steps=steps, error=float((o - w @ v).abs().max()))


def _span(values, pad: float = 0.06):
    vals = [x for x in values if x is not None]
    lo, hi = min(vals), max(vals)
    d = (hi - lo) or abs(hi) or 1.0
    return [lo - pad * d, hi + pad * d]


def tile_walk_figure(pattern: str = "sinks + window", L: int = 256, block: int = 32,
                     q_tile: Optional[int] = None, window: Optional[int] = None) -> go.Figure:
    """:func:`tile_walk` as an animation: the tile grid with the program's row and the tiles it has loaded
    (numbered in load order; the current one ringed), and the running max ``m`` and sum ``l`` of each query
    row after every step. A slider and a play button step through the loop."""
    walk = tile_walk(pattern, L, block, q_tile, window)
    lay, qi, steps = walk["layout"], walk["q_tile"], walk["steps"]
    rows = list(range(len(steps[0]["m"]))) if steps else []
    fig = make_subplots(rows=2, cols=2, column_widths=[0.5, 0.5], specs=[[{"rowspan": 2}, {}], [None, {}]],
                        subplot_titles=("tiles in load order", "running max m", "running sum l"),
                        horizontal_spacing=0.16, vertical_spacing=0.24)
    key = tile_trace(lay)
    key.colorbar.update(orientation="h", x=0.0, xanchor="left", y=-0.15, yanchor="top", len=0.42, thickness=12)
    fig.add_trace(key, 1, 1)
    fig.add_shape(type="rect", x0=-0.5, x1=lay.nk - 0.5, y0=qi - 0.5, y1=qi + 0.5, line=dict(color="#d62728",
                  width=2), row=1, col=1)

    def frame_data(t):
        done = steps[: t + 1]
        cur = steps[t]
        return [
            go.Scatter(x=[s["tile"] for s in done], y=[qi] * len(done), mode="markers+text",
                       text=[str(i + 1) for i in range(len(done))], textfont=dict(color="white", size=10),
                       marker=dict(symbol="square", size=15, color=[TILE_COLORS[s["kind"]] for s in done],
                                   line=dict(color="black", width=1)), name="loaded, in order",
                       hovertemplate="step %{text}: kv tile %{x}<extra></extra>"),
            go.Scatter(x=[cur["tile"]], y=[qi], mode="markers", name="loading now",
                       marker=dict(symbol="circle-open", size=24, color="#d62728", line=dict(width=3))),
            go.Scatter(x=rows, y=cur["m"], mode="lines+markers", name="m (max score so far)",
                       line=dict(color="#1f77b4")),
            go.Scatter(x=rows, y=cur["l"], mode="lines+markers", name="l (sum of exp(s - m))",
                       line=dict(color="#ff7f0e")),
        ]
    first = frame_data(0)
    for tr, (r, c) in zip(first, [(1, 1), (1, 1), (1, 2), (2, 2)]):
        fig.add_trace(tr, r, c)
    n0 = len(fig.data) - 4
    fig.frames = [go.Frame(data=frame_data(t), traces=list(range(n0, n0 + 4)), name=str(t))
                  for t in range(len(steps))]
    labels = [f"tile {s['tile']}, {s['kind']}" for s in steps]
    fig.update_layout(
        sliders=[dict(active=0, currentvalue={"prefix": "loading: "}, pad={"t": 125}, x=0.14, len=0.86,
                      font=dict(size=10),
                      steps=[dict(method="animate", label=lab, args=[[str(t)], {"mode": "immediate",
                             "frame": {"duration": 0, "redraw": True}, "transition": {"duration": 0}}])
                             for t, lab in enumerate(labels)])],
        updatemenus=[dict(type="buttons", showactive=False, x=0.0, y=0.0, xanchor="left", yanchor="top",
                          pad={"t": 150, "r": 10},
                          buttons=[dict(label="play", method="animate", args=[None, {
                              "frame": {"duration": 700, "redraw": True}, "fromcurrent": True,
                              "transition": {"duration": 0}}])])],
        title=(f"One program's walk: query tile {qi} of {pattern}<br><sup>L = {L}, tiles {block}x{block}: "
               f"{sum(s['kind'] == 'partial' for s in steps)} partial tiles, then "
               f"{sum(s['kind'] == 'full' for s in steps)} full; eager fp64 replay on the CPU, "
               f"final error {walk['error']:.0e}</sup>"),
        height=660, title_font_size=14, margin=dict(t=100, b=210), showlegend=False)
    fig.update_yaxes(autorange="reversed", title_text="query tile", row=1, col=1)
    fig.update_xaxes(title_text="key tile", range=[-0.5, lay.nk - 0.5], row=1, col=1)
    fig.update_xaxes(title_text="query row in the tile", row=1, col=2)
    fig.update_xaxes(title_text="query row in the tile", row=2, col=2)
    fig.update_yaxes(title_text="m (score units)", range=_span([x for s in steps for x in s["m"]]), row=1, col=2)
    fig.update_yaxes(title_text="l (sum of exp, unitless)", range=_span([x for s in steps for x in s["l"]]),
                     row=2, col=2)
    return fig


# ---------------------------------------------------------------------------------------------------------
# the recorded prefill suite
# ---------------------------------------------------------------------------------------------------------
def prefill_time_figure(doc: BenchFile, pattern: str = "window1024") -> go.Figure:
    """Forward time vs N for one pattern: ours, FlexAttention on the same block mask, naive masked dense, and
    cuDNN / FlashAttention-2 on the pattern's envelope (causal for causal patterns, else dense)."""
    fig = go.Figure()
    for impl, label in ((Impl.OURS, "sparseattn"), (Impl.FLEX, "FlexAttention (same block table)"),
                        (Impl.NAIVE, "naive masked dense")):
        rs = sorted((r for r in doc.select(impl, Pass.FWD, pattern=pattern) if r.ms), key=lambda r: r.case["N"])
        if rs:
            fig.add_trace(go.Scatter(x=[r.case["N"] for r in rs], y=[r.ms for r in rs], mode="lines+markers",
                                     name=label, line=dict(color=COLORS[impl])))
    dense_pat = dense_pattern_of(pattern)
    for impl, label in ((Impl.CUDNN, "cuDNN"), (Impl.FA2, "FlashAttention-2")):
        rs = sorted(doc.select(impl, Pass.FWD, pattern=dense_pat), key=lambda r: r.case["N"])
        if rs:
            fig.add_trace(go.Scatter(x=[r.case["N"] for r in rs], y=[r.ms for r in rs], mode="lines+markers",
                                     name=f"{label} {dense_pat} (same work)",
                                     line=dict(color=COLORS[impl], dash="dash")))
    Ns = doc.distinct("N")
    fig.update_layout(title=f"{pattern}: forward time<br><sup>bf16, B=1, H=16, D=128, tiles 128x128; "
                            f"{doc.caption()}</sup>",
                      xaxis_title="sequence length N (tokens)", yaxis_title="time (ms, median)", xaxis_type="log",
                      yaxis_type="log", height=500, title_font_size=14, legend=dict(orientation="h", y=-0.22))
    fig.update_xaxes(tickvals=Ns, ticktext=[f"{n // 1024}k" for n in Ns])
    return tidy_log(fig)


def speedups(doc: BenchFile) -> list:
    """Every recorded case: ``(pattern, N, logical density, cuDNN-same-work / ours, Flex / ours)``; the
    cuDNN baseline is the pattern's envelope (:func:`~sparseattn.bench.cases.dense_pattern_of`)."""
    cudnn = {(r.case["pattern"], r.case["N"]): r.ms for r in doc.select(Impl.CUDNN, Pass.FWD)}
    out = []
    for r in doc.select(Impl.OURS, Pass.FWD):
        c = r.case
        flex = doc.ms(Impl.FLEX, Pass.FWD, pattern=c["pattern"], N=c["N"])
        out.append((c["pattern"], c["N"], c["logical_density"], cudnn[(dense_pattern_of(c["pattern"]), c["N"])] / r.ms,
                    flex / r.ms))
    return out


#: marker of each prefill pattern in :func:`prefill_speedup_figure` (named in its subtitle)
_PATTERN_SYMBOLS = {"causal": "circle", "window1024": "square", "sinks64+window1024": "diamond",
                    "random10%+diag": "triangle-up"}


def prefill_speedup_figure(doc: BenchFile) -> go.Figure:
    """Speedup over cuDNN doing the same work (causal cuDNN for causal patterns, dense for block-random) and
    over FlexAttention, one marker shape per pattern."""
    fig = go.Figure()
    rows = speedups(doc)
    for k, (impl, label) in ((3, (Impl.CUDNN, "vs cuDNN, same work")), (4, (Impl.FLEX, "vs FlexAttention"))):
        fig.add_trace(go.Scatter(x=[r[2] for r in rows], y=[r[k] for r in rows], mode="markers", name=label,
                                 text=[f"{r[0]} N={r[1]}" for r in rows],
                                 marker=dict(size=9, color=COLORS[impl],
                                             symbol=[_PATTERN_SYMBOLS[r[0]] for r in rows]),
                                 hovertemplate="%{text}: %{y:.2f}x<extra></extra>"))
    fig.add_hline(y=1.0, line_dash="dot")
    shapes = ", ".join(f"{_PATTERN_SYMBOLS[p].split('-')[0]} {p}" for p in dict.fromkeys(r[0] for r in rows))
    fig.update_layout(title=f"Speedup of the sparse kernel against logical density<br><sup>every pattern and "
                            f"N of the prefill suite (bf16, B=1, H=16, D=128, tiles 128x128)<br>markers: {shapes}"
                            f"<br>same work: causal cuDNN (dense for random10%+diag)<br>{doc.caption()}</sup>",
                      xaxis_title="logical density (allowed cells / all cells)",
                      yaxis_title="time(baseline) / time(ours)", xaxis_type="log", yaxis_type="log", height=520,
                      title_font_size=14, legend=dict(orientation="h", y=-0.22), margin=dict(t=160))
    return tidy_log(fig)


def prefill_table(doc: BenchFile, N: int = 32768) -> Table:
    """Ours, FlexAttention and cuDNN on the same work (the pattern's envelope), with the ratios and our tile
    TFLOP/s, at one N. Raises LookupError when a series is missing from ``doc``."""
    rows = []
    for p in PREFILL_PATTERNS:
        ours = doc.one(Impl.OURS, Pass.FWD, pattern=p, N=N)
        flex = doc.ms(Impl.FLEX, Pass.FWD, pattern=p, N=N)
        base = dense_pattern_of(p)
        cud = doc.ms(Impl.CUDNN, Pass.FWD, pattern=base, N=N)
        rows.append([p, f"{ours.ms:.3f}", f"{flex:.3f}", f"{flex / ours.ms:.2f}x", BASELINE_LABEL[base],
                     f"{cud:.3f}", f"{cud / ours.ms:.2f}x", f"{ours.get('tile_tflops'):.0f}"])
    return Table([f"pattern (N={N // 1024}k)", "ours (ms)", "Flex (ms)", "Flex / ours", "same work",
                  "cuDNN (ms)", "cuDNN / ours", "ours, tile TFLOP/s"], rows,
                 caption=f"Forward at N = {N // 1024}k, bf16, H=16, D=128 ({doc.caption()})")


def prefill_sweep_table(sweep: BenchFile) -> Table:
    """The recorded tile-configuration sweep: each config's time per pattern, relative to the fastest."""
    rs = sweep.select(Impl.OURS, Pass.FWD, sweep=True)
    pats = [p for p in PREFILL_PATTERNS if any(r.case["pattern"] == p for r in rs)]

    def key(cfg):
        tma = {None: "auto", True: "on", False: "off"}[cfg["tma"]]
        return (f"{cfg['block_m']}x{cfg['block_n']}, {cfg['num_warps']} warps, {cfg['num_stages']} stages, "
                f"TMA {tma}{', warp-specialized' if cfg['warp_specialize'] else ''}")
    configs = list(dict.fromkeys(key(r.get("config")) for r in rs))
    best = {p: min(r.ms for r in rs if r.case["pattern"] == p) for p in pats}
    rows = []
    for c in configs:
        cells = [c]
        for p in pats:
            ms = [r.ms for r in rs if r.case["pattern"] == p and key(r.get("config")) == c]
            cells.append(f"{ms[0]:.3f} ({ms[0] / best[p]:.2f}x)" if ms else "not measured")
        rows.append(cells)
    N = rs[0].case["N"] if rs else 0
    return Table(["config"] + [f"{p} (ms, vs best)" for p in pats], rows,
                 caption=f"Forward tile-configuration sweep at N = {N // 1024}k ({sweep.caption()})")
