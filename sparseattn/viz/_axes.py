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


def _values(tr, letter: str) -> List[float]:
    out = []
    for v in (getattr(tr, letter, None) or ()):
        if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
            out.append(float(v))
    return out


def full_log_ticks(fig: go.Figure) -> go.Figure:
    """Give every log axis of ``fig`` that has no explicit ticks yet ticks with full labels (:func:`log_ticks`),
    over its range when it has one, else over the values its traces and rules draw, and then (unless some of
    its traces are hidden, as an explorer's other states are) a range from the labelled tick just below the
    lowest value to the one just above the highest. Returns ``fig``."""
    lay = fig.layout
    for name in [k for k in lay.to_plotly_json() if k.startswith(("xaxis", "yaxis"))] or []:
        ax = lay[name]
        if ax.type != "log" or ax.tickvals is not None:  # explicit ticks (the measured lengths) stay
            continue
        letter, ident = name[0], name[0] + name[5:]
        if ax.range is not None and None not in ax.range:
            tv, tt = log_ticks(10 ** min(ax.range), 10 ** max(ax.range))
            ax.update(tickmode="array", tickvals=tv, ticktext=tt)
            continue
        on_axis = [tr for tr in fig.data if (getattr(tr, f"{letter}axis", None) or letter) == ident]
        vals = [v for tr in on_axis for v in _values(tr, letter)] + _shape_values(fig, letter, ident)
        if not vals:
            continue
        if any(tr.visible is False for tr in on_axis):  # an explorer: each state keeps plotly's own range
            tv, tt = log_ticks(min(vals), max(vals))
            ax.update(tickmode="array", tickvals=tv, ticktext=tt)
            continue
        # no range given: the axis reaches the labelled ticks just outside the data, so no point sits above
        # the highest label or below the lowest (plotly's own range pads the data by a few percent)
        tv, tt = log_ticks(min(vals), max(vals), outer=True)
        lo, hi = math.log10(min(tv[0], min(vals))), math.log10(max(tv[-1], max(vals)))
        pad = min(0.03 * max(hi - lo, 0.5), 0.06)  # decades: with a 2-to-5 step, under half a decade past data
        ax.update(tickmode="array", tickvals=tv, ticktext=tt, range=[lo - pad, hi + pad], autorange=False)
    return fig


def _shape_values(fig: go.Figure, letter: str, ident: str) -> List[float]:
    """The positive coordinates that the shapes of ``fig`` (rules drawn with ``add_hline``/``add_vline``) place
    on axis ``ident``: plotly's own range would include them."""
    out = []
    for sh in fig.layout.shapes or ():
        if (getattr(sh, f"{letter}ref", None) or letter) != ident:
            continue
        for v in (getattr(sh, f"{letter}0", None), getattr(sh, f"{letter}1", None)):
            if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0:
                out.append(float(v))
    return out


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
