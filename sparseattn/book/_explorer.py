"""Kernel-free explorers: one plotly figure over a precomputed grid, with one control per parameter.

``static_explorer(make_figure, {"pattern": [...], "block": [16, 32, 64]})`` calls ``make_figure`` for every
combination and stacks the traces of all of them in one figure; the controls switch which combination is
visible. A parameter whose values are numbers gets a slider, any other a dropdown (its buttons read
``name: value``). Controls depend on the ones before them in the grid's order: choosing a value resets the
later controls to their first value and rebuilds them for the new choice, so every control always shows the
state of the figure (a choice edits the later controls' steps or buttons in place). Everything is declarative plotly (``update`` methods), so it works in the static book
with no kernel and no custom JavaScript.
"""
from __future__ import annotations

import itertools
from typing import Callable, Dict, List, Optional, Tuple

_AXIS_ATTRS = ("range", "type", "tickvals", "ticktext", "title.text", "autorange", "dtick")
_DROPDOWN_ROW = 42  # px per row of dropdowns above the plot
_SLIDER_ROW = 78  # px per slider below the plot
_TITLE_LINE = 19  # px per line of a figure title (12 px font, <sup> caption lines included)


def _is_numeric(values) -> bool:
    return all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values)


def _get(d: dict, dotted: str):
    for part in dotted.split("."):
        if not isinstance(d, dict) or part not in d:
            return None
        d = d[part]
    return d


def _layout_updates(figs) -> List[dict]:
    """Per combination: the layout keys that differ between combinations (title, annotations, shapes, and
    any axis attribute that is not the same in all of them)."""
    lays = [f.layout.to_plotly_json() for f in figs]
    axes = sorted({k for lay in lays for k in lay if k.startswith(("xaxis", "yaxis"))})
    varying = [f"{ax}.{attr}" for ax in axes for attr in _AXIS_ATTRS
               if len({repr(_get(lay, f"{ax}.{attr}")) for lay in lays}) > 1]
    out = []
    for lay in lays:
        u = {"title.text": _get(lay, "title.text") or "", "annotations": lay.get("annotations", []),
             "shapes": lay.get("shapes", [])}
        u.update({key: _get(lay, key) for key in varying})
        out.append(u)
    return out


def static_explorer(make_figure: Callable, grid: Dict[str, list], title: str = "", start: Optional[dict] = None,
                    space_below: int = 0):
    """One figure over every combination of ``grid`` (``name -> list of values``), one control per parameter
    with more than one value (numbers: a slider; anything else: a dropdown). The first value of each
    parameter is shown first, or the value ``start`` gives for it. ``title`` is used where a combination's
    figure has none. ``space_below`` (px) moves the sliders that much further under the plot, for a figure
    whose tick labels and axis title under the plot are taller than one line each.

    Raises ValueError for an empty grid, a parameter without values, or a ``start`` value not in the grid."""
    import plotly.graph_objects as go
    if not grid:
        raise ValueError("grid must name at least one parameter with its values")
    if isinstance(space_below, bool) or not isinstance(space_below, int) or space_below < 0:
        raise ValueError(f"space_below must be a whole number of pixels >= 0, got {space_below!r}")
    for name, values in grid.items():
        if not isinstance(values, (list, tuple)) or len(values) == 0:
            raise ValueError(f"grid[{name!r}] must be a non-empty list of values, got {values!r}")
    names = list(grid)
    sizes = [len(grid[n]) for n in names]
    start = dict(start or {})
    for name, value in start.items():
        if name not in grid or value not in grid[name]:
            raise ValueError(f"start[{name!r}] = {value!r} is not one of the grid's values "
                             f"{grid.get(name, 'no such parameter')}")
    combos = list(itertools.product(*(range(s) for s in sizes)))
    figs = [make_figure(**{n: grid[n][i] for n, i in zip(names, c)}) for c in combos]
    base = tuple(grid[n].index(start[n]) if n in start else 0 for n in names)
    out = go.Figure(layout=figs[combos.index(base)].layout)
    spans, start = {}, 0
    for c, f in zip(combos, figs):
        for tr in f.data:
            out.add_trace(tr)
        spans[c] = (start, start + len(f.data))
        start += len(f.data)
    n_traces = start
    updates = dict(zip(combos, _layout_updates(figs)))
    for c in combos:
        if not updates[c]["title.text"]:
            updates[c]["title.text"] = title
    controlled = [k for k, s in enumerate(sizes) if s > 1]
    kind = {k: "slider" if _is_numeric(grid[names[k]]) else "dropdown" for k in controlled}
    slot = {}
    for k in controlled:  # position of each control in layout.updatemenus / layout.sliders
        slot[k] = sum(1 for j in controlled if j < k and kind[j] == kind[k])

    def visible(state):
        a, b = spans[state]
        return [a <= i < b for i in range(n_traces)]

    def control(k: int, prefix: Tuple[int, ...]) -> dict:
        """Control k with the earlier parameters fixed at ``prefix`` and the later ones at their first value."""
        options = []
        for v in range(sizes[k]):
            state = prefix + (v,) + (0,) * (len(sizes) - k - 1)
            lay = dict(updates[state])
            for j in controlled:  # rebuild the later controls for this choice (edit their items in place:
                if j > k:  # a whole new item under "sliders[i]" would be inserted, not replaced)
                    key, items = ("sliders", "steps") if kind[j] == "slider" else ("updatemenus", "buttons")
                    lay[f"{key}[{slot[j]}].{items}"] = control(j, state[:j])[items]
                    lay[f"{key}[{slot[j]}].active"] = 0
            options.append((v, [{"visible": visible(state)}, lay]))
        name, values = names[k], grid[names[k]]
        active = 0
        if kind[k] == "slider":
            return dict(active=active, currentvalue={"prefix": f"{name}: "}, x=0.0, len=1.0, y=0.0,
                        yanchor="top", pad={"t": 64 + _SLIDER_ROW * slot[k], "b": 8},
                        steps=[dict(method="update", label=str(values[v]), args=args) for v, args in options])
        return dict(type="dropdown", direction="down", active=active, showactive=True, x=0.26 * slot[k], y=1.0,
                    xanchor="left", yanchor="bottom", pad={"b": 6},
                    buttons=[dict(method="update", label=f"{name}: {values[v]}", args=args) for v, args in options])

    for i, tr in enumerate(out.data):
        tr.visible = spans[base][0] <= i < spans[base][1]
    first = {k: dict(control(k, base[:k]), active=base[k]) for k in controlled}
    sliders = [first[k] for k in controlled if kind[k] == "slider"]
    menus = [first[k] for k in controlled if kind[k] == "dropdown"]
    margin = out.layout.margin.to_plotly_json() if out.layout.margin else {}
    top, bottom = max(margin.get("t", 80), 90), margin.get("b", 60)
    extra_top = _DROPDOWN_ROW if menus else 0
    if menus:  # the title (with its measured-where-and-when caption) keeps the top of the figure, the menus
        # the row under it: size the top margin for the longest title of any combination, so no menu covers it
        lines = max(1 + (u["title.text"] or "").count("<br>") for u in updates.values())
        top = max(top, _TITLE_LINE * lines + 60)  # title from 24 px down; the menu row 20 px above `top`
        out.update_layout(title=dict(yref="container", y=1 - 24 / ((out.layout.height or 450) + _DROPDOWN_ROW),
                                     yanchor="top"))
    extra_bottom = _SLIDER_ROW * len(sliders)
    if sliders and space_below:
        for sl in sliders:
            sl["pad"] = {**sl["pad"], "t": sl["pad"]["t"] + space_below}
        extra_bottom += space_below
    height = (out.layout.height or 450) + extra_top + extra_bottom
    plot_h = height - (top + extra_top) - (bottom + extra_bottom)
    legend = out.layout.legend
    if sliders and legend is not None and legend.orientation == "h" and (legend.y or 0) < 0:
        # a legend under the plot: put the sliders under the legend (about three entries a row, 22 px each)
        entries = sum(1 for i, tr in enumerate(out.data) if spans[base][0] <= i < spans[base][1]
                      and tr.showlegend is not False)
        below = -legend.y * max(plot_h, 100) + 22 * -(-entries // 3) + 16
        extra = max(0, int(below) - 64)
        for sl in sliders:
            sl["pad"] = {**sl["pad"], "t": sl["pad"]["t"] + extra}
        height += extra
        extra_bottom += extra
    for m in menus:  # between the title and the subplot titles: 30 px above the plotting area
        m["y"] = 1 + 30 / max(plot_h, 100)
    out.update_layout(sliders=sliders, updatemenus=menus, height=height, title_text=updates[base]["title.text"],
                      margin={**margin, "t": top + extra_top, "b": bottom + extra_bottom})
    return out
