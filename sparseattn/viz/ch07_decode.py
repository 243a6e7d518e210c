"""Chapter 7, decode over a paged KV cache: how many splits a launch gets, the Quest page bound, and the
recorded ``decode`` and ``decode_keep`` suites (time per case, against the kept fraction, bandwidth, and
the split-count sweep)."""
from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..bench.record import BenchFile, Impl, Pass
from ..ops import DecodeConfig, decode_programs_per_sm, decode_splits
from ..paged import PagedKVCache
from ..routing import page_bounds
from . import COLORS, LIGHT
from ._axes import tidy_log

__all__ = ["split_counts", "splits_figure", "bound_figure", "decode_figure", "decode_keep_figure",
           "read_ceiling", "decode_bandwidth_figure", "keep_crossover", "decode_sweep_figure"]


def split_counts(Hkv: int = 8, L: int = 131072, sms: int = 132, Bs=(1, 2, 4, 8, 16, 32, 64)) -> dict:
    """Splits per row and programs per launch of split-KV decoding against batch size, from shapes alone,
    with the default :class:`DecodeConfig`: ``{"B": [...], "splits": [...], "programs": [...]}``."""
    cfg = DecodeConfig()
    splits = [decode_splits(B, Hkv, L, cfg.block_n, sms, decode_programs_per_sm(cfg, B, Hkv, sms))[0]
              for B in Bs]
    return {"B": list(Bs), "splits": splits, "programs": [n * B * Hkv for n, B in zip(splits, Bs)]}


def splits_figure(Hkv: int = 8, L: int = 131072, page_size: int = 16, sms: int = 132) -> go.Figure:
    """Programs launched by split-KV decoding vs batch size, from shapes alone (the H200 has 132 SMs), with the
    default :class:`DecodeConfig`."""
    sc = split_counts(Hkv, L, sms)
    Bs = [str(b) for b in sc["B"]]
    rows = [b * Hkv for b in sc["B"]]
    fig = go.Figure()
    fig.add_trace(go.Bar(x=Bs, y=rows, name="programs without splitting"))
    fig.add_trace(go.Bar(x=Bs, y=sc["programs"], name="programs with split-KV",
                         text=[f"{n} splits" for n in sc["splits"]], textposition="outside", cliponaxis=False))
    fig.add_hline(y=sms, line_dash="dot", annotation_text=f"{sms} SMs")
    lo = math.log10(min(rows + [sms]))
    hi = math.log10(max(sc["programs"] + [sms]))
    # an explicit range: with text outside the bars, plotly's log autorange runs off to 10^144
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_range=[lo - 0.15, hi + 0.3],
                      xaxis_title="batch (sequences decoded together)", yaxis_title="programs in the launch",
                      height=420, title_font_size=14, legend=dict(orientation="h", y=-0.25),
                      title=f"Split count from shapes only<br><sup>Hkv = {Hkv}, {L} tokens of capacity, default "
                            f"DecodeConfig, {sms} SMs; computed, not measured</sup>")
    return tidy_log(fig)


def bound_figure(page_size: int = 16, L: int = 2048, seed: int = 0, device=None) -> go.Figure:
    """Quest's per-page bound against the true best score of the page (every point must lie above y = x).
    Runs :func:`~sparseattn.routing.page_bounds` on ``device`` (default: the GPU when there is one, where the
    ops refuse CPU tensors)."""
    dev = torch.device(device if device is not None else ("cuda" if torch.cuda.is_available() else "cpu"))
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(L // page_size + 1, page_size, 1, 64, dtype=torch.float32, device=dev, max_seqs=1)
    drift = torch.cumsum(torch.randn(L, 1, 64, generator=g) * 0.1, 0)  # slowly varying keys, like real ones
    keys = drift + torch.randn(L, 1, 64, generator=g) * 0.5
    cache.append(0, keys.to(dev), torch.randn(L, 1, 64, generator=g).to(dev))
    q = torch.randn(1, 1, 64, generator=g).to(dev)
    bound = page_bounds(q, cache)[0, 0, : L // page_size].cpu()
    k, _ = cache.gather_dense(0)
    best = (k[0] @ q[0, 0]).view(-1, page_size).amax(1).cpu()
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=best.tolist(), y=bound.tolist(), mode="markers", name="pages"))
    lo, hi = float(best.min()), float(bound.max())
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line=dict(dash="dot"), name="bound = best"))
    fig.update_layout(title=f"Page bound against the page's true best score<br><sup>page size {page_size}, "
                            f"{L} drifting keys, D = 64; computed on {dev.type}</sup>",
                      xaxis_title="max over the page of q . k", yaxis_title="bound from per-page min/max of K",
                      height=420, title_font_size=14)
    return fig


_DECODE_SERIES = [  # (impl, pass, legend, color)
    (Impl.OURS, Pass.DECODE, "ours: decode through the paged cache", COLORS[Impl.OURS]),
    (Impl.OURS, Pass.SELECT_DECODE_GRAPH, "ours: select + decode, one CUDA graph", LIGHT[Impl.OURS]),
    (Impl.CUDNN, Pass.DECODE_DENSE, "cuDNN dense, contiguous KV", COLORS[Impl.CUDNN]),
    (Impl.FA2, Pass.DECODE_DENSE, "FlashAttention-2 dense, contiguous KV", COLORS[Impl.FA2]),
    (Impl.FLEX, Pass.DECODE_DENSE, "FlexAttention dense", COLORS[Impl.FLEX]),
    (Impl.FLEX, Pass.DECODE_BLOCK_MASK, "FlexAttention, same keep fraction in 128-token blocks", LIGHT[Impl.FLEX]),
]


def _case_label(c: dict) -> str:
    return f"B={c['B']}, {c['N'] // 1024}k<br>ps {c['page_size']}<br>{c['pattern']}"


def decode_figure(doc: BenchFile) -> go.Figure:
    """Decode time per case from the ``decode`` suite: ours through the paged cache (dense or selected) and
    the whole selected step, against SDPA dense decode and FlexAttention on contiguous KV."""
    cases = []
    for r in doc.select():
        if r.pass_ != Pass.SWEEP and r.ms is not None and _case_label(r.case) not in cases:
            cases.append(_case_label(r.case))
    fig = go.Figure()
    for impl, pass_, name, color in _DECODE_SERIES:
        cells = {_case_label(r.case): r.ms for r in doc.select(impl, pass_) if r.ms is not None}
        ys = [cells.get(k) for k in cases]
        if any(y is not None for y in ys):
            fig.add_trace(go.Bar(x=cases, y=ys, name=name, marker_color=color))
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="time per decode step (ms, median)",
                      xaxis_title="case: batch, history, page size, pages kept", height=600,
                      title_font_size=14, legend=dict(orientation="h", y=-0.38), xaxis_tickangle=0,
                      title=f"Decode step time per case<br><sup>bf16, 32 query / 8 KV heads, D=128; "
                            f"{doc.caption()}</sup>")
    return tidy_log(fig)


def decode_keep_figure(doc: BenchFile) -> go.Figure:
    """From the ``decode_keep`` suite, per batch: decode and the whole step (select + decode), both in a
    CUDA graph, vs the fraction of K/V bytes kept, against dense decode through the cache and cuDNN."""
    batches = doc.distinct("B")
    fig = make_subplots(rows=1, cols=len(batches), horizontal_spacing=0.1, subplot_titles=[
        f"B={b}, L={doc.distinct('N', B=b)[0] // 1024}k" for b in batches])
    for col, b in enumerate(batches, start=1):
        for pass_, name, color in ((Pass.DECODE_GRAPH, "decode", COLORS[Impl.OURS]),
                                   (Pass.SELECT_DECODE_GRAPH, "select + decode", LIGHT[Impl.OURS])):
            pts = sorted((r.case["keep"], r.ms) for r in doc.select(Impl.OURS, pass_, B=b) if "keep" in r.case)
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                     line_color=color, legendgroup=name, showlegend=col == 1), row=1, col=col)
        for impl, pass_, name in ((Impl.OURS, Pass.DECODE_GRAPH, "dense decode through the cache"),
                                  (Impl.CUDNN, Pass.DECODE_DENSE, "cuDNN dense, contiguous")):
            ms = doc.ms(impl, pass_, B=b, pattern="dense")
            fig.add_trace(go.Scatter(x=[0, 1], y=[ms, ms], mode="lines", name=name, legendgroup=name,
                                     line=dict(color=COLORS[impl], dash="dot"), showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title_text="fraction of pages kept", row=1, col=col)
    for col in range(1, len(batches) + 1):
        fig.update_yaxes(title_text="time per step (ms)" if col == 1 else "time (ms)", type="log", row=1,
                         col=col)
    fig.update_layout(height=450, title_font_size=14, legend=dict(orientation="h", y=-0.3),
                      title=f"Selected decode against the kept fraction<br><sup>page size 16, CUDA graphs; "
                            f"{doc.caption()}</sup>")
    return tidy_log(fig)


def read_ceiling(doc: BenchFile) -> dict:
    """The ``decode`` suite's streaming-read rows (one read of the cache's K/V bytes per case), as
    ``{(B, N, page_size, pattern): (ms, TB/s)}``; empty for a file recorded before the suite measured them."""
    return {(r.case["B"], r.case["N"], r.case["page_size"], r.case["pattern"]): (r.ms, r.get("tbps"))
            for r in doc.select(Impl.READ_CEILING, Pass.READ) if r.ms is not None}


def decode_bandwidth_figure(doc: BenchFile, ceiling: Optional[BenchFile] = None) -> go.Figure:
    """Effective bandwidth (bytes of the selected K/V / time, decode in a CUDA graph) vs the kept fraction,
    one line per batch, from the ``decode_keep`` suite; with cuDNN's dense decode and, when ``ceiling`` (the
    ``decode`` suite's file) has them, the streaming-read rate of the same bytes."""
    fig = go.Figure()
    for b in doc.distinct("B"):
        pts = sorted((r.get("keep_fraction"), r.get("tbps")) for r in doc.select(Impl.OURS, Pass.DECODE_GRAPH, B=b)
                     if "keep_fraction" in r.extra)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                 name=f"B={b}"))
    cud = [r.get("tbps") for r in doc.select(Impl.CUDNN, Pass.DECODE_DENSE)]
    fig.add_hline(y=max(cud), line_dash="dot", line_color=COLORS[Impl.CUDNN],
                  annotation_text="cuDNN dense decode (best batch)")
    reads = read_ceiling(ceiling) if ceiling is not None else {}
    if reads:
        fig.add_hline(y=max(t for _, t in reads.values()), line_dash="dash", line_color=COLORS[Impl.READ_CEILING],
                      annotation_text="streaming read of the same bytes", annotation_position="bottom right")
    fig.update_layout(xaxis_title="fraction of K/V bytes selected", yaxis_title="effective bandwidth (TB/s)",
                      height=420, title_font_size=14, xaxis_type="log",
                      title=f"Effective bandwidth of selected decode<br><sup>decode in a CUDA graph; "
                            f"{doc.caption()}</sup>")
    return tidy_log(fig)


def keep_crossover(doc: BenchFile) -> dict:
    """Per batch of the ``decode_keep`` suite: where selecting pages stops paying. The whole selected step
    (select + decode, one CUDA graph) against the best dense decode (cuDNN on contiguous K/V, or ours through
    the cache in a CUDA graph). Returns ``{B: dict(dense_ms, pays=[keep...], last_paying, first_not,
    crossover)}`` with ``crossover`` linearly interpolated between the two bracketing kept fractions (None
    when selection pays at every measured fraction or at none)."""
    out = {}
    for b in doc.distinct("B"):
        dense = min(doc.ms(Impl.CUDNN, Pass.DECODE_DENSE, B=b),
                    doc.ms(Impl.OURS, Pass.DECODE_GRAPH, B=b, pattern="dense"))
        steps = sorted((r.case["keep"], r.ms) for r in doc.select(Impl.OURS, Pass.SELECT_DECODE_GRAPH, B=b))
        pays = [k for k, ms in steps if ms < dense]
        not_ = [k for k, ms in steps if ms >= dense]
        last, first = (max(pays) if pays else None), (min((k for k in not_ if not pays or k > max(pays)),
                                                          default=None))
        cross = None
        if last is not None and first is not None:
            (k0, t0), (k1, t1) = [(k, ms) for k, ms in steps if k in (last, first)]
            cross = k0 + (dense - t0) * (k1 - k0) / (t1 - t0)
        out[b] = dict(dense_ms=dense, pays=pays, last_paying=last, first_not=first, crossover=cross)
    return out


def decode_sweep_figure(doc: BenchFile) -> go.Figure:
    """The split-count sweep of the ``decode`` suite: time relative to the case's best config, vs programs per
    SM, for the default tile (64 tokens, 4 warps, 2 stages, heads adjacent)."""
    fig = go.Figure()
    by_case = {}
    for r in doc.select(Impl.OURS, Pass.SWEEP):
        if r.ms is None:
            continue
        c = r.case
        by_case.setdefault(f"B={c['B']} L={c['N'] // 1024}k {c['pattern']}", []).append(r)
    if not by_case:
        raise LookupError(f"no decode sweep rows in this {doc.suite!r} file (measured {doc.meta['date'][:10]}); "
                          "a sweep run writes them: load it with book.load_bench('decode', sweep=True)")
    for name, rows in by_case.items():
        best = min(r.ms for r in rows)
        pts = sorted((r.extra["config"]["programs_per_sm"], r.ms / best) for r in rows
                     if (r.extra["config"]["block_n"], r.extra["config"]["num_warps"], r.extra["config"]["num_stages"],
                         r.extra["config"]["head_fastest"]) == (64, 4, 2, True))
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name))
    fig.update_xaxes(tickvals=sorted({r.extra["config"]["programs_per_sm"] for rs in by_case.values() for r in rs}))
    fig.update_layout(xaxis_title="split target: programs per SM", xaxis_type="log", height=420,
                      yaxis_title="time / best config of the case", title_font_size=14,
                      legend=dict(orientation="h", y=-0.25),
                      title=f"How many splits? The default tile at other split targets<br><sup>{doc.caption()}</sup>")
    return tidy_log(fig)
