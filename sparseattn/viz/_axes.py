"""Axis and mark fixes shared by every chapter's figures: full tick labels on log axes (plotly's default labels
the 2s and 5s of a decade with a bare digit, so a reader sees "2, 5, 1, 2, 5, 10"), and dots instead of bars
on a log value axis (a bar's length on a log axis starts nowhere and means nothing)."""
from __future__ import annotations

import math
from typing import List, Tuple

import plotly.graph_objects as go

__all__ = ["log_ticks", "full_log_ticks", "dots_not_bars", "log_rule_labels", "tidy_log"]

_STEPS = ((1, 2, 5), (1, 2, 3, 5, 7), (1, 1.5, 2, 3, 4, 5, 6, 7, 8, 9))
_NEAR = 0.05


def log_ticks(lo: float, hi: float, at_least: int = 3, outer: bool = False) -> Tuple[List[float], List[str]]:
    """Tick values from ``lo`` to ``hi`` (> 0) on a 1-2-5 ladder (finer when the span is short, so there are
    ``at_least`` ticks where it can), each labelled with its full value ("0.2", "5", "20", "1e+04").
    ``outer``: reach the ladder's ticks just outside ``lo`` and ``hi`` too (or within 5% inside), so the
    lowest and the highest value sit between labels (a ladder that would more than square the span's ratio,
    plus 30%, gives way to the next finer one)."""
    if not (lo > 0 and hi > 0):
        raise ValueError(f"log axis ends must be positive, got lo={lo!r}, hi={hi!r}")
    lo, hi = min(lo, hi), max(lo, hi)
    vals: List[float] = []
    for i, steps in enumerate(_STEPS):
        ladder = sorted({float(f"{m * 10.0 ** e:.6g}") for m in steps
                         for e in range(math.floor(math.log10(lo)) - 1, math.ceil(math.log10(hi)) + 2)})
        a, b = lo, hi
        if outer:  # a value within 5% of a tick counts as at it (the range's padding shows it)
            a = max(v for v in ladder if v <= lo * (1 + _NEAR))
            b = min(v for v in ladder if v >= hi * (1 - _NEAR))
        vals = [v for v in ladder if a * (1 - 1e-9) <= v <= b * (1 + 1e-9)]
        wide = outer and b / a > 1.3 * (hi / lo) ** 2 and i + 1 < len(_STEPS)
        if len(vals) >= at_least and not wide:
            break
    while len(vals) > 12:  # a wide span: keep every other tick, the powers of ten first (and the outer ends)
        keep = [i % 2 == 0 or math.log10(v).is_integer() or (outer and i == len(vals) - 1)
                for i, v in enumerate(vals)]
        fewer = [v for v, k in zip(vals, keep) if k]
        if len(fewer) == len(vals):  # only powers of ten left: keep every other one
            fewer = vals[::2] + ([vals[-1]] if outer and len(vals) % 2 == 0 else [])
        vals = fewer
    return vals, [f"{v:g}" for v in vals]


def _positive(values) -> List[float]:
    """The finite positive numbers among ``values`` (what a log axis can draw)."""
    return [float(v) for v in values
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0]


def _values(tr, letter: str) -> List[float]:
    return _positive(getattr(tr, letter, None) or ())


def full_log_ticks(fig: go.Figure) -> go.Figure:
    """Give every log axis of ``fig`` that has no explicit ticks yet ticks with full labels (:func:`log_ticks`),
    so that no value it draws (traces and rules) lies beyond its outermost labels: the labelled ticks reach just
    past the lowest and the highest value, and the axis's range reaches those ticks -- a range the figure set
    is only ever widened, and only by the values inside it (it may leave outliers out on purpose); an x and a
    y axis that shared one range keep sharing it. An axis some of whose traces are hidden (an explorer's other
    states) gets ticks over all its values and keeps plotly's range per state. Returns ``fig``."""
    lay = fig.layout
    names = [k for k in lay.to_plotly_json() if k.startswith(("xaxis", "yaxis"))]
    given = {n: tuple(lay[n].range) for n in names if lay[n].range is not None and None not in lay[n].range}
    for name in names:
        ax = lay[name]
        if ax.type != "log" or ax.tickvals is not None:  # explicit ticks (the measured lengths) stay
            continue
        letter, ident = name[0], name[0] + name[5:]
        on_axis = [tr for tr in fig.data if (getattr(tr, f"{letter}axis", None) or letter) == ident]
        vals = [v for tr in on_axis for v in _values(tr, letter)] + _shape_values(fig, letter, ident)
        rng = given.get(name)
        if rng is not None:
            vals = [v for v in vals if 10 ** min(rng) <= v <= 10 ** max(rng)]
        if not vals or any(tr.visible is False for tr in on_axis):  # nothing to reach, or an explorer's states
            span = (10 ** min(rng), 10 ** max(rng)) if rng is not None else (min(vals), max(vals)) if vals else None
            if span:
                tv, tt = log_ticks(*span)
                ax.update(tickmode="array", tickvals=tv, ticktext=tt)
            continue
        tv = log_ticks(min(vals), max(vals), outer=True)[0]
        lo, hi = math.log10(min(tv[0], min(vals))), math.log10(max(tv[-1], max(vals)))
        pad = 0.02  # decades: the outer labels stay inside the plot (with a 2-to-5 step, 0.42 past the data)
        lo, hi = lo - pad, hi + pad
        if rng is not None:  # the figure's range, widened to the outer ticks; its ladder labels the rest
            lo, hi = min(lo, min(rng)), max(hi, max(rng))
            tv = sorted(set(tv) | {v for v in log_ticks(10 ** lo, 10 ** hi)[0] if v < tv[0] or v > tv[-1]})
        reverse = rng is not None and rng[0] > rng[1]
        ax.update(tickmode="array", tickvals=tv, ticktext=[f"{v:g}" for v in tv],
                  range=[hi, lo] if reverse else [lo, hi], autorange=False)
    for x in [n for n in names if n.startswith("xaxis")]:  # a shared range (a y = x diagonal) stays shared
        y = "y" + x[1:]
        if y in given and given.get(x) == given[y] and lay[y].type == lay[x].type == "log":
            a, b = lay[x].range, lay[y].range
            both = [min(min(a), min(b)), max(max(a), max(b))]
            for n in (x, y):
                lay[n].range = both[::-1] if given[n][0] > given[n][1] else both
    return fig


def _shape_values(fig: go.Figure, letter: str, ident: str) -> List[float]:
    """The positive coordinates that the shapes of ``fig`` (rules drawn with ``add_hline``/``add_vline``) place
    on axis ``ident``: plotly's own range would include them."""
    return _positive(getattr(sh, f"{letter}{end}", None) for sh in fig.layout.shapes or ()
                     if (getattr(sh, f"{letter}ref", None) or letter) == ident for end in (0, 1))


def dots_not_bars(fig: go.Figure) -> go.Figure:
    """Redraw the bars of ``fig`` that stand on a log value axis as dots (grouped side by side as the bars
    were), keeping name, colour, text and hover. Returns ``fig``."""
    lay = fig.layout
    changed = False
    data = []
    for tr in fig.data:
        if tr.type != "bar":
            data.append(tr)
            continue
        horizontal = tr.orientation == "h"
        value = ("x" if horizontal else "y")
        axis = getattr(tr, f"{value}axis", None) or value
        ax = lay[f"{value}axis{axis[1:]}"]
        if ax.type != "log":
            data.append(tr)
            continue
        changed = True
        color = tr.marker.color if tr.marker is not None else None
        data.append(go.Scatter(x=tr.x, y=tr.y, name=tr.name, mode="markers+text" if tr.text is not None else "markers",
                               text=tr.text, textposition="middle right" if horizontal else "top center",
                               cliponaxis=False, marker=dict(size=11, color=color, line=dict(width=1, color="white")),
                               hovertemplate=tr.hovertemplate, showlegend=tr.showlegend, legendgroup=tr.legendgroup,
                               xaxis=tr.xaxis, yaxis=tr.yaxis, offsetgroup=tr.offsetgroup or tr.name))
    if changed:
        fig.data = []
        fig.add_traces(data)
        fig.update_layout(scattermode="group", scattergap=0.4)
    return fig


def log_rule_labels(fig: go.Figure) -> go.Figure:
    """Move the labels of ``add_hline`` / ``add_vline`` / ``add_vrect`` onto log axes. Plotly draws the shape
    in data units but places its ``annotation_text`` at the same number read as log10 units, so a label at
    y=132 lands at 10^132, off the plot. A label on a log data axis whose coordinate equals one of a shape's
    ends on that axis is moved to log10 of it. Returns ``fig``."""
    lay = fig.layout
    for ann in lay.annotations or ():
        for letter in ("x", "y"):
            ref = getattr(ann, f"{letter}ref") or letter
            if "domain" in ref or ref == "paper":
                continue
            ax = lay[f"{letter}axis{ref[1:]}"]
            v = getattr(ann, letter)
            if ax.type != "log" or not isinstance(v, (int, float)) or v <= 0:
                continue
            ends = {getattr(sh, f"{letter}{i}") for sh in lay.shapes or ()
                    if (getattr(sh, f"{letter}ref") or letter) == ref for i in (0, 1)}
            if v in ends:
                ann[letter] = math.log10(v)
    return fig


def tidy_log(fig: go.Figure) -> go.Figure:
    """:func:`dots_not_bars`, :func:`full_log_ticks` and :func:`log_rule_labels`: what every figure with a log
    axis gets last."""
    return log_rule_labels(full_log_ticks(dots_not_bars(fig)))
