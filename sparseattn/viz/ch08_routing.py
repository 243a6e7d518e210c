"""Chapter 8, dynamic routing: what a routed selection looks like (block and member semantics), the recorded
``routing`` suite (the step's time split against the FlexAttention pipeline, the overhead share against N,
recall against top-k, reuse across heads and stale selections), the gradient error of a backward that routes
again, and the live experiment behind the chapter's widget."""
from __future__ import annotations

import time
from typing import Optional

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..bench.record import BenchFile, Impl, Pass
from ..layout import BlockLayout
from ..ops import sparse_attention
from ..ops.backward import backward
from ..ops.prefill import forward
from ..reference import reference_attention
from ..routing import route, select_blocks, selection_recall
from . import COLORS, LIGHT
from ._axes import tidy_log

__all__ = ["toy_inputs", "selection_figure", "member_figure", "main_case", "split_figure", "split_at_topk",
           "overhead_figure", "sweep_overhead", "sweep_overhead_figure", "recall_figure", "reuse_figure", "reroute_errors", "reroute_figure", "live_step"]

#: the terms of a step, bottom to top, and how their bars are drawn (one colour per implementation)
TERMS = [(Pass.ROUTE, "route (pooled scores + top-k)", "/"), (Pass.INDEX, "index (transposed lists / BlockMask)", "x"),
         (Pass.FWD, "attention forward", "")]


def toy_inputs(N: int = 256, Hq: int = 2, Hkv: int = 1, D: int = 32, block: int = 32, seed: int = 0,
               device=None):
    """Small q, k, v with the benchmark's structure (keys and queries around shared topic directions, one per
    ``block`` tokens), for figures computed on the reader's machine (``device=None``: the GPU when there is
    one, where the kernels run; fp32, whose dots the kernels compute exactly there too)."""
    from ..bench.routing import routing_inputs
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    return routing_inputs(1, Hq, Hkv, N, D, torch.float32, device, seed=seed, block=block)


# ---------------------------------------------------------------------------------------------------------
# what a selection looks like
# ---------------------------------------------------------------------------------------------------------
def selection_figure(layout: BlockLayout, h: int = 0, title: str = "") -> go.Figure:
    """The tiles one layout head lists: full (no mask work), partial (causally masked), or not visited."""
    partial, full = layout.block_classes()
    grid = (full[0, h].int() * 2 + partial[0, h].int()).tolist()  # 0 none, 1 partial, 2 full
    fig = go.Figure(go.Heatmap(z=grid, zmin=0, zmax=2, showscale=False, xgap=1, ygap=1,
                               colorscale=[[0, "#f0f0f0"], [0.33, "#f0f0f0"], [0.34, LIGHT[Impl.OURS]],
                                           [0.66, LIGHT[Impl.OURS]], [0.67, COLORS[Impl.OURS]], [1, COLORS[Impl.OURS]]],
                               hovertemplate="query block %{y}, key block %{x}<extra></extra>"))
    for name, color in (("full tile", COLORS[Impl.OURS]), ("partial tile (causal mask)", LIGHT[Impl.OURS]),
                        ("not visited", "#f0f0f0")):
        fig.add_trace(go.Scatter(x=[None], y=[None], mode="markers", marker=dict(color=color, size=10, symbol="square"),
                                 name=name))
    fig.update_yaxes(autorange="reversed", title_text=f"query block ({layout.block_q} tokens)")
    fig.update_xaxes(title_text=f"key block ({layout.block_k} tokens)")
    fig.update_layout(height=380, title_font_size=12, plot_bgcolor="white",
                      title=title or f"Routed tiles of layout head {h}: {int((partial | full)[0, h].sum())} listed")
    return fig


def member_figure(block: BlockLayout, member: BlockLayout, h: int = 0) -> go.Figure:
    """Token-level masks of the same selection under both semantics: every row of a query block uses every
    chosen tile (block), or each row only its own best few of them (member)."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=[
        f'semantics="block": {int(block.to_dense()[0, h].sum())} allowed cells',
        f'semantics="member": {int(member.to_dense()[0, h].sum())} allowed cells'], horizontal_spacing=0.08)
    for col, lay in enumerate((block, member), start=1):
        fig.add_trace(go.Heatmap(z=lay.to_dense()[0, h].int().tolist(), showscale=False,
                                 colorscale=[[0, "white"], [1, COLORS[Impl.OURS]]],
                                 hovertemplate="query %{y}, key %{x}<extra></extra>"), row=1, col=col)
        fig.update_yaxes(autorange="reversed", title_text="query position", row=1, col=col)
        fig.update_xaxes(title_text="key position", row=1, col=col)
    fig.update_layout(height=420, title_font_size=12,
                      title="Same tiles loaded, different cells used (computed here on the CPU)")
    return fig


# ---------------------------------------------------------------------------------------------------------
# the recorded suite
# ---------------------------------------------------------------------------------------------------------
def main_case(doc: BenchFile) -> dict:
    """The shape every term was measured at (the suite's main case: the one with a training-step graph):
    ``N``, ``topk``, ``Hkv``, ``share``."""
    r = doc.one(Impl.OURS, Pass.TRAIN_STEP_GRAPH)
    return {k: r.case[k] for k in ("N", "topk", "Hkv", "share")}


def _ms(doc: BenchFile, impl: str, pass_: str, **case) -> Optional[float]:
    rows = doc.select(impl, pass_, **case)
    if len(rows) != 1:
        raise LookupError(f"expected one {impl!r} {pass_!r} record for {case} in {doc.suite!r}, found {len(rows)}")
    return rows[0].ms


def split_figure(doc: BenchFile, topk: Optional[int] = None) -> go.Figure:
    """The step's time split at the main shape: route and attention forward for ours (its forward step
    launches no index), route, index (BlockMask) and attention for the Flex pipeline, as stacked bars;
    markers for the whole step eager and from one CUDA graph; and forward + backward. With ``topk``, our
    split at another top-k of the sweep (the Flex pipeline was measured at the main top-k only)."""
    m = main_case(doc)
    k = m["topk"] if topk is None else topk
    case = dict(N=m["N"], Hkv=m["Hkv"], share=m["share"])
    fig = make_subplots(rows=1, cols=2, column_widths=[0.5, 0.5], horizontal_spacing=0.12,
                        # two lines each: one line overlaps its neighbour in a book-width figure
                        subplot_titles=[f"forward step, top-{k}<br>(terms alone; ours skips the index)"
                                        + ("" if k == m["topk"] else f"<br>(Flex measured at top-{m['topk']} only)"),
                                        f"fwd + bwd, fixed at top-{m['topk']}<br>(measured there only)"])
    impls = [Impl.OURS] + ([Impl.FLEX] if k == m["topk"] else [])
    names = {Impl.OURS: "ours", Impl.FLEX: "Flex pipeline"}
    shown = set()
    for pass_, label, pattern in TERMS:
        for impl in impls:
            if impl == Impl.OURS and pass_ == Pass.INDEX:  # our forward step launches no index
                continue
            ms = _ms(doc, impl, pass_, topk=k, **case)
            fig.add_trace(go.Bar(x=[names[impl]], y=[ms], name=label, legendgroup=label, showlegend=label not in shown,
                                 marker=dict(color=COLORS[impl], pattern_shape=pattern,
                                             opacity={Pass.ROUTE: 0.55, Pass.INDEX: 0.75, Pass.FWD: 1.0}[pass_]),
                                 hovertemplate=f"{label}: %{{y:.3f}} ms<extra>{names[impl]}</extra>"), row=1, col=1)
            shown.add(label)
    for impl in impls:
        for pass_, symbol, label in ((Pass.STEP, "circle-open", "whole step, eager"),
                                     (Pass.STEP_GRAPH, "diamond", "whole step, one CUDA graph")):
            rows = doc.select(impl, pass_, topk=k, **case)
            if rows and rows[0].ms is not None:
                fig.add_trace(go.Scatter(x=[names[impl]], y=[rows[0].ms], mode="markers", name=label, legendgroup=label,
                                         showlegend=impl == Impl.OURS,
                                         marker=dict(symbol=symbol, size=12, color="black")), row=1, col=1)
    fb = dict(topk=m["topk"], **case)
    for impl, pass_, label, step in ((Impl.OURS, Pass.FWD_BWD, "ours<br>attn.", False),
                                     (Impl.OURS, Pass.TRAIN_STEP_GRAPH, "ours<br>step<br>(graph)", True),
                                     (Impl.FLEX, Pass.FWD_BWD, "Flex<br>attn.", False),
                                     (Impl.FLEX, Pass.TRAIN_STEP, "Flex<br>step<br>(eager)", True)):
        ms = _ms(doc, impl, pass_, **fb)
        fig.add_trace(go.Bar(x=[label], y=[ms], showlegend=False, marker_color=COLORS[impl],
                             marker_opacity=1.0 if step else 0.6, hovertemplate="%{y:.3f} ms<extra></extra>"),
                      row=1, col=2)
    fig.update_yaxes(title_text="ms (median)", row=1, col=1)
    fig.update_yaxes(title_text="ms (median)", row=1, col=2)
    fig.update_xaxes(title_text="implementation", row=1, col=1)
    # four short stacked labels: level, so plotly does not turn them on their side, and apart in the narrow panel
    fig.update_xaxes(title_text="attention (attn.) alone / whole step", tickangle=0, tickfont_size=10, row=1, col=2)
    # the legend on the right, so that a slider (book.static_explorer) fits below the plot
    fig.update_annotations(font_size=13)  # the subplot titles
    fig.update_layout(barmode="stack", height=510, title_font_size=12, legend=dict(x=1.02, y=1, font_size=11),
                      margin=dict(t=140),  # room for a third subplot-title line away from the main top-k
                      title=f"Routed attention, N={m['N']}, 16 heads, D=128, 128-token blocks, bf16<br>"
                            f"<sup>{doc.caption()}</sup>")
    return fig


def split_at_topk(doc: BenchFile):
    """A function of ``topk`` giving :func:`split_figure` at that top-k (for ``book.static_explorer``), and the
    top-k values recorded."""
    m = main_case(doc)
    topks = doc.distinct("topk", impl=Impl.OURS, pass_=Pass.ROUTE, N=m["N"], Hkv=m["Hkv"])
    return (lambda topk: split_figure(doc, topk)), topks


def overhead_figure(doc: BenchFile) -> go.Figure:
    """Against N at the main top-k: the share of the step spent routing and indexing (ours: of the step in one
    CUDA graph; Flex: of its eager step), and the step times beside dense causal attention (cuDNN)."""
    m = main_case(doc)
    case = dict(topk=m["topk"], Hkv=m["Hkv"], share=m["share"])
    Ns = doc.distinct("N", impl=Impl.OURS, pass_=Pass.STEP_GRAPH, **case)
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=[
        "route + index as a share of the step", "the whole step"])
    for impl, step_pass, name in ((Impl.OURS, Pass.STEP_GRAPH, "ours (step in one CUDA graph)"),
                                  (Impl.FLEX, Pass.STEP, "Flex pipeline (eager step)")):
        xs, share, step = [], [], []
        for N in Ns:
            parts = [_ms(doc, impl, p, N=N, **case) for p in (Pass.ROUTE, Pass.INDEX, step_pass)]
            if all(p is not None for p in parts):
                xs.append(N)
                share.append(100 * (parts[0] + parts[1]) / parts[2])
                step.append(parts[2])
        fig.add_trace(go.Scatter(x=xs, y=share, mode="lines+markers", name=name, line_color=COLORS[impl],
                                 legendgroup=name), row=1, col=1)
        fig.add_trace(go.Scatter(x=xs, y=step, mode="lines+markers", name=name, line_color=COLORS[impl],
                                 legendgroup=name, showlegend=False), row=1, col=2)
    dense = [(N, _ms(doc, Impl.CUDNN, Pass.FWD, N=N, pattern="causal", **case)) for N in Ns]
    dense = [(N, ms) for N, ms in dense if ms is not None]
    fig.add_trace(go.Scatter(x=[d[0] for d in dense], y=[d[1] for d in dense], mode="lines+markers",
                             name="cuDNN dense causal (no selection)", line=dict(color=COLORS[Impl.CUDNN], dash="dot")),
                  row=1, col=2)
    fig.add_hline(y=10, line_dash="dash", line_color="gray", annotation_text="10% target", row=1, col=1)
    for col in (1, 2):
        fig.update_xaxes(title_text="sequence length N (tokens)", type="log", row=1, col=col)
    fig.update_yaxes(title_text="% of the step", row=1, col=1)
    fig.update_yaxes(title_text="ms (median)", type="log", row=1, col=2)
    fig.update_layout(height=430, title_font_size=12, legend=dict(orientation="h", y=-0.3),
                      title=f"Routing overhead vs N, top-{m['topk']}<br><sup>{doc.caption()}</sup>")
    return fig


def sweep_overhead(xo: BenchFile, keep: float = 0.1) -> list:
    """From the ``crossover`` suite's routing family (``route()`` timed apart from the attention on the
    layout it returns, eager, top-k = ``keep`` of a row's key blocks): per length ``N``, the route time, our
    attention forward on the routed layout, FlexAttention's forward on the same routed blocks (None where the
    run has none) and dense causal cuDNN, in ms. ``[{"N", "topk", "route", "attention", "flex", "cudnn"}]``,
    ascending in N; lengths missing one of ours or cuDNN are left out. The backward part times ``route()``
    again for its own rows; the forward part's route row is the one beside the forward."""
    def fwd_part(rows):  # rows of a file without parts belong to the forward
        return [r for r in rows if r.get("part", "fwd") == "fwd"]

    out = []
    for N in xo.distinct("N", impl=Impl.OURS, pass_=Pass.ROUTE, family="routing", keep=keep):
        routes = fwd_part(xo.select(Impl.OURS, Pass.ROUTE, family="routing", keep=keep, N=N))
        attn = xo.one(Impl.OURS, Pass.FWD, family="routing", keep=keep, N=N)
        flex = [r for r in xo.select(Impl.FLEX, Pass.FWD, family="routing", keep=keep, N=N) if r.ms is not None]
        dense = [r for r in xo.select(Impl.CUDNN, Pass.FWD, pattern="causal", N=N) if r.ms is not None]
        if len(routes) != 1:
            raise LookupError(f"{len(routes)} forward-part route rows at N={N}, keep={keep}; expected one")
        if routes[0].ms is None or attn.ms is None or not dense:
            continue
        out.append({"N": N, "topk": routes[0].case["topk"], "route": routes[0].ms, "attention": attn.ms,
                    "flex": flex[0].ms if flex else None, "cudnn": dense[0].ms})
    if not out:
        raise LookupError(f"no routing rows at keep={keep} in {xo.suite!r} (run the crossover suite with route())")
    return out


def sweep_overhead_figure(xo: BenchFile, keep: float = 0.1) -> go.Figure:
    """Against N (the crossover sweep's routing family, eager calls): the route time and our attention on the
    routed layout, stacked, beside FlexAttention's attention on the same routed blocks (no route time: the
    two share ``route()``) and dense causal cuDNN; and the route's share of our routed step."""
    pts = sweep_overhead(xo, keep)
    Ns = [p["N"] for p in pts]
    c = xo.one(Impl.OURS, Pass.FWD, family="routing", keep=keep, N=Ns[0]).case
    shape = f"B={c['B']}, H={c['H']}, D={c['D']}, {c['dtype']}" + (f", {c['block']}-token blocks" if "block" in c
                                                                   else "")
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12, subplot_titles=[
        "routed step (eager) vs dense causal", "route as a share of the routed step"])
    fig.add_trace(go.Bar(x=Ns, y=[p["route"] for p in pts], name="ours: route()", marker_color=LIGHT[Impl.OURS],
                         marker_pattern_shape="/"), row=1, col=1)
    fig.add_trace(go.Bar(x=Ns, y=[p["attention"] for p in pts], name="ours: attention forward",
                         marker_color=COLORS[Impl.OURS]), row=1, col=1)
    fig.add_trace(go.Scatter(x=Ns, y=[p["cudnn"] for p in pts], mode="lines+markers",
                             name="cuDNN dense causal (no selection)",
                             line=dict(color=COLORS[Impl.CUDNN], dash="dot")), row=1, col=1)
    fig.add_trace(go.Scatter(x=Ns, y=[100 * p["route"] / (p["route"] + p["attention"]) for p in pts],
                             mode="lines+markers", name="route share", line_color=COLORS[Impl.OURS],
                             showlegend=False), row=1, col=2)
    fl = [p for p in pts if p["flex"] is not None]
    if fl:
        fig.add_trace(go.Scatter(x=[p["N"] for p in fl], y=[p["flex"] for p in fl], mode="lines+markers",
                                 name="FlexAttention forward on the routed blocks (route() not included)",
                                 line=dict(color=COLORS[Impl.FLEX])), row=1, col=1)
    fig.update_layout(barmode="stack", height=460, title_font_size=12, legend=dict(orientation="h", y=-0.3),
                      margin=dict(t=120), title=f"Routing against N, top-k = {keep:.0%} of a row's key blocks"
                            f"<br><sup>{shape}, eager calls<br>crossover suite, {xo.caption()}</sup>")
    for col in (1, 2):
        fig.update_xaxes(title_text="sequence length N (tokens)", type="category", row=1, col=col)
    fig.update_yaxes(title_text="ms (median)", row=1, col=1)
    fig.update_yaxes(title_text="% of the routed step", row=1, col=2)
    return fig


def recall_figure(doc: BenchFile) -> go.Figure:
    """At the main N: the share of full causal attention each top-k keeps (sampled rows; synthetic inputs), and
    our step time in one CUDA graph."""
    m = main_case(doc)
    case = dict(N=m["N"], Hkv=m["Hkv"], share=m["share"])
    routes = sorted(doc.select(Impl.OURS, Pass.ROUTE, **case), key=lambda r: r.case["topk"])
    topks = [r.case["topk"] for r in routes]
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.12,
                        subplot_titles=["recall: full-attention mass kept", "step time (one CUDA graph)"])
    fig.add_trace(go.Scatter(x=topks, y=[r.get("recall") for r in routes], mode="lines+markers",
                             name="recall", line_color=COLORS[Impl.OURS]), row=1, col=1)
    fig.add_trace(go.Scatter(x=topks, y=[_ms(doc, Impl.OURS, Pass.STEP_GRAPH, topk=t, **case) for t in topks],
                             mode="lines+markers", name="step", line_color=COLORS[Impl.OURS], showlegend=False),
                  row=1, col=2)
    for col in (1, 2):
        fig.update_xaxes(title_text="top-k (blocks per query block)", type="log", tickvals=topks, row=1, col=col)
    fig.update_yaxes(title_text="recall (share of softmax mass)", row=1, col=1)
    fig.update_yaxes(title_text="ms (median)", row=1, col=2)
    fig.update_layout(height=430, title_font_size=12, showlegend=False,
                      title=f"Recall vs speed, N={m['N']}<br><sup>synthetic topic inputs, "
                            f"{routes[0].get('recall_rows')} sampled rows per head; each query block keeps its "
                            f"top-k blocks + 1 local + 1 sink<br>{doc.caption()}</sup>", margin=dict(t=140))
    return fig


def reuse_figure(doc: BenchFile) -> go.Figure:
    """Reuse, with its cost: one selection per query head, per KV head, for all heads (GQA rows): routing time
    and recall; and the recall of a selection routed on inputs that have drifted (a selection reused across
    layers or steps)."""
    m = main_case(doc)
    gqa = [r for r in doc.select(Impl.OURS, Pass.ROUTE, N=m["N"]) if r.case["Hkv"] != m["Hkv"]]
    order = {"none": 0, "kv_head": 1, "all": 2}
    gqa.sort(key=lambda r: order[r.case["share"]])
    labels = [f"{r.case['share']}<br>({r.get('layout_heads')} sel.)" for r in gqa]
    main = doc.one(Impl.OURS, Pass.ROUTE, **m)  # the main shape: the stale selection's panel
    # two-line titles and a wider gap: in a book-width figure one-line titles run into the next panel
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.12, subplot_titles=[
        f"routing time,<br>{gqa[0].case['Hq']} query / {gqa[0].case['Hkv']} KV heads",
        f"recall,<br>{gqa[0].case['Hq']} query / {gqa[0].case['Hkv']} KV heads",
        f"stale selection's recall,<br>{main.case['Hq']} query / {main.case['Hkv']} KV heads"])
    fig.add_trace(go.Bar(x=labels, y=[r.ms for r in gqa], marker_color=COLORS[Impl.OURS], showlegend=False),
                  row=1, col=1)
    fig.add_trace(go.Bar(x=labels, y=[r.get("recall") for r in gqa], marker_color=LIGHT[Impl.OURS], showlegend=False),
                  row=1, col=2)
    drift = sorted((float(d), rec) for d, rec in main.get("recall_drifted").items())
    # bars from 0: a flat line on a zoomed axis would make differences in the 4th decimal look large
    fig.add_trace(go.Bar(x=["fresh"] + [f"drift<br>{d:g}" for d, _ in drift],
                         y=[main.get("recall")] + [rec for _, rec in drift], marker_color=LIGHT[Impl.OURS],
                         text=[f"{x:.4f}" for x in [main.get("recall")] + [rec for _, rec in drift]],
                         textposition="outside", showlegend=False), row=1, col=3)
    fig.update_yaxes(title_text="ms (median)", row=1, col=1)
    fig.update_yaxes(title_text="recall (softmax mass kept)", range=[0, 1.02], row=1, col=2)
    fig.update_yaxes(title_text="recall (softmax mass kept)", range=[0, 1.02], row=1, col=3)
    fig.update_xaxes(title_text="selections (share=)", title_standoff=12, tickangle=0, row=1, col=1)
    fig.update_xaxes(title_text="selections (share=)", title_standoff=12, tickangle=0, row=1, col=2)
    fig.update_xaxes(title_text="routed on", title_standoff=12, tickangle=0, row=1, col=3)
    fig.update_annotations(font_size=13)  # the subplot titles
    fig.update_layout(height=440, title_font_size=12, margin=dict(t=120),
                      title=f"Reusing one selection, N={m['N']}, top-{m['topk']}<br><sup>{doc.caption()}</sup>")
    return fig


# ---------------------------------------------------------------------------------------------------------
# training: why the backward must not route again
# ---------------------------------------------------------------------------------------------------------
def reroute_errors(eps=(0.0, 0.1, 0.2, 0.3, 0.5, 1.0), N: int = 128, block: int = 16, topk: int = 2, seed: int = 0):
    """Relative error of dq, dk, dv against the true gradient of the forward's function when the backward walks
    a layout routed again on inputs perturbed by ``eps`` (relative noise: dropout, recomputation in another
    precision), computed here with the package's kernels on small shapes. ``eps = 0`` re-routes on the same
    inputs. Returns ``[(eps, tiles that changed, {name: error})]``."""
    q, k, v = toy_inputs(N=N, block=block, seed=seed)
    do = torch.randn_like(q)
    layout = route(q, k, block, block, topk=topk)
    scale = q.shape[-1] ** -0.5
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    truth = torch.autograd.grad(reference_attention(qd, kd, vd, layout.to_dense()), (qd, kd, vd), do.double())
    o, lse = forward(q, k, v, layout, scale, None, None)
    g = torch.Generator().manual_seed(seed + 1)
    out = []
    for e in eps:
        noisy = [t + e * t.std() * torch.randn(t.shape, generator=g).to(t.device) for t in (q, k)]
        again = route(*noisy, block, block, topk=topk)
        changed = int((torch.stack(again.block_classes()) != torch.stack(layout.block_classes())).sum())
        grads = backward(do, q, k, v, o, lse, again, scale, True)  # a backward on the re-routed layout
        errs = {name: float((a.double() - b).norm() / b.norm()) for name, a, b in zip(("dq", "dk", "dv"), grads, truth)}
        out.append((e, changed, errs))
    return out


def reroute_figure(results) -> go.Figure:
    """:func:`reroute_errors` as a figure: gradient error against the perturbation, with the number of tile
    decisions that changed."""
    fig = go.Figure()
    xs = [e for e, _, _ in results]
    for name, dash in (("dq", "solid"), ("dk", "dash"), ("dv", "dot")):
        fig.add_trace(go.Scatter(x=xs, y=[r[name] for _, _, r in results], mode="lines+markers", name=name,
                                 line=dict(color=COLORS[Impl.OURS], dash=dash),
                                 text=[f"{c} tile decisions changed" for _, c, _ in results],
                                 hovertemplate="%{text}: error %{y:.1e}<extra></extra>"))
    fig.update_layout(height=380, title_font_size=12, yaxis_type="log",
                      xaxis_title="relative perturbation of the inputs the backward routes on",
                      yaxis_title="relative error vs the true gradient",
                      title="Re-routing in the backward: gradient error (computed here, fp32)")
    return tidy_log(fig)


# ---------------------------------------------------------------------------------------------------------
# the live experiment (the widget)
# ---------------------------------------------------------------------------------------------------------
def live_step(topk: int = 4, block: int = 32, share: str = "kv_head", N: Optional[int] = None,
              device: Optional[str] = None, repeat: int = 3) -> go.Figure:
    """Route and attend once on this machine: recall of the selection and the time of each term (best of
    ``repeat``; on a GPU bf16 at N = 16k with 16 query / 4 KV heads; on a CPU the Triton interpreter at a
    small shape, where times say nothing about a GPU), as a figure whose title says what ran."""
    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = dev == "cuda"
    N = N or (16384 if gpu else 256)
    Hq, Hkv, D = (16, 4, 128) if gpu else (2, 1, 32)
    from ..bench.routing import routing_inputs
    q, k, v = routing_inputs(1, Hq, Hkv, N, D, torch.bfloat16 if gpu else torch.float32, dev, block=block)
    kw = dict(block_q=block, block_k=block, topk=topk, share=share)

    def best(fn):
        times = []
        for _ in range(repeat):
            if gpu:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = fn()
            if gpu:
                torch.cuda.synchronize()
            times.append((time.perf_counter() - t0) * 1e3)
        return min(times), out
    t_route, sel = best(lambda: select_blocks(q, k, **kw))
    t_index, layout = best(sel.to_layout)
    t_fwd, _ = best(lambda: sparse_attention(q, k, v, layout))
    recall = selection_recall(q, k, layout, sample=256 if gpu else None).mean()
    where = f"{torch.cuda.get_device_name(0)}, bf16" if gpu else "CPU, Triton interpreter, fp32 (not GPU times)"
    fig = go.Figure()
    for (pass_, label, pattern), ms in zip(TERMS, (t_route, t_index, t_fwd)):
        fig.add_trace(go.Bar(x=["ours"], y=[ms], name=label, marker=dict(color=COLORS[Impl.OURS], pattern_shape=pattern,
                                                                        opacity={Pass.ROUTE: 0.55, Pass.INDEX: 0.75,
                                                                                 Pass.FWD: 1.0}[pass_])))
    fig.update_layout(barmode="stack", height=380, title_font_size=12, yaxis_title="ms (best of %d, wall)" % repeat,
                      title=f"top-{topk}, block {block}, share={share}: recall {recall:.3f}; N={N}, {Hq} query / "
                            f"{Hkv} KV heads, D={D}<br><sup>measured live on {where}</sup>")
    return fig
