"""Chapter 5, the prefill kernel measured: forward time against N per pattern, the speedup against logical
density, and the N = 32k table, all from the recorded ``prefill`` suite."""
from __future__ import annotations

import plotly.graph_objects as go

from ..bench.cases import PREFILL_PATTERNS, dense_pattern_of
from ..bench.record import BenchFile, Impl, Pass
from . import COLORS

__all__ = ["prefill_time_figure", "prefill_speedup_figure", "prefill_table_figure"]


def prefill_time_figure(doc: BenchFile, pattern: str = "window1024") -> go.Figure:
    """Forward time vs N for one pattern: ours, FlexAttention on the same block mask, cuDNN dense/causal."""
    fig = go.Figure()
    for impl in (Impl.OURS, Impl.FLEX, Impl.NAIVE):
        rs = sorted((r for r in doc.select(impl, Pass.FWD, pattern=pattern) if r.ms), key=lambda r: r.case["N"])
        if rs:
            fig.add_trace(go.Scatter(x=[r.case["N"] for r in rs], y=[r.ms for r in rs], mode="lines+markers",
                                     name=impl, line=dict(color=COLORS[impl])))
    dense_pat = dense_pattern_of(pattern)
    for impl in (Impl.CUDNN, Impl.FA2):
        rs = sorted(doc.select(impl, Pass.FWD, pattern=dense_pat), key=lambda r: r.case["N"])
        if rs:
            fig.add_trace(go.Scatter(x=[r.case["N"] for r in rs], y=[r.ms for r in rs], mode="lines+markers",
                                     name=f"{impl} {dense_pat}", line=dict(color=COLORS[impl], dash="dash")))
    fig.update_layout(title=f"{pattern}: forward time, bf16, B=1, H=16, D=128 ({doc.caption()})",
                      xaxis_title="sequence length N", yaxis_title="ms (median)", xaxis_type="log",
                      yaxis_type="log", height=440, title_font_size=12)
    return fig


def prefill_speedup_figure(doc: BenchFile) -> go.Figure:
    """Speedup over cuDNN (dense, or causal for the causal pattern) and over FlexAttention, every case."""
    fig = go.Figure()
    cudnn = {(r.case["pattern"], r.case["N"]): r.ms for r in doc.select(Impl.CUDNN, Pass.FWD)}
    for base in (Impl.CUDNN, Impl.FLEX):
        xs, ys, text = [], [], []
        for r in doc.select(Impl.OURS, Pass.FWD):
            if "logical_density" not in r.case:
                continue
            c = r.case
            if base == Impl.CUDNN:
                ref = cudnn.get((dense_pattern_of(c["pattern"]), c["N"]))
            else:
                ref = next((x.ms for x in doc.select(Impl.FLEX, Pass.FWD, pattern=c["pattern"], N=c["N"])), None)
            if ref:
                xs.append(c["logical_density"])
                ys.append(ref / r.ms)
                text.append(f"{c['pattern']} N={c['N']}")
        fig.add_trace(go.Scatter(x=xs, y=ys, text=text, mode="markers", name=f"vs {base}",
                                 marker=dict(size=9, color=COLORS[base])))
    fig.add_hline(y=1.0, line_dash="dot")
    fig.update_layout(title=f"Speedup of the sparse kernel vs logical density ({doc.caption()})",
                      xaxis_title="logical density (allowed cells / all cells)", yaxis_title="time(baseline) / time(ours)",
                      xaxis_type="log", yaxis_type="log", height=440, title_font_size=12)
    return fig


def prefill_table_figure(doc: BenchFile, N: int = 32768) -> go.Figure:
    """Ours, FlexAttention and cuDNN on the same work, with the ratios and our tile TFLOP/s, at one N."""
    pats = PREFILL_PATTERNS
    ours = {p: doc.one(Impl.OURS, Pass.FWD, pattern=p, N=N) for p in pats}
    flex = {p: doc.ms(Impl.FLEX, Pass.FWD, pattern=p, N=N) for p in pats}
    cud = {p: doc.ms(Impl.CUDNN, Pass.FWD, pattern=dense_pattern_of(p), N=N) for p in pats}
    cells = [pats, [f"{ours[p].ms:.3f}" for p in pats], [f"{flex[p]:.3f}" for p in pats],
             [f"{flex[p] / ours[p].ms:.2f}x" for p in pats], [f"{cud[p]:.3f}" for p in pats],
             [f"{cud[p] / ours[p].ms:.2f}x" for p in pats], [f"{ours[p].get('tile_tflops'):.0f}" for p in pats]]
    fig = go.Figure(go.Table(header=dict(values=[f"pattern (N={N // 1024}k)", "ours (ms)", "Flex (ms)", "Flex / ours",
                                                 "cuDNN same work (ms)", "cuDNN / ours", "tile TFLOP/s"]),
                             cells=dict(values=cells)))
    fig.update_layout(title=f"Forward at N = {N // 1024}k ({doc.caption()})", height=300, title_font_size=12)
    return fig
