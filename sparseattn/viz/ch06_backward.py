"""Chapter 6, the backward pass: the dK/dV work per program with and without column splitting, and the
recorded backward and forward times of the ``backward`` and ``prefill`` suites."""
from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go
import torch

from .. import patterns as P
from ..bench.cases import PREFILL_PATTERNS, dense_pattern_of
from ..bench import versus as V
from ..bench.record import BenchFile, Impl, Pass
from ..layout import BlockLayout
from ..ops import column_work as _column_work
from . import COLORS
from ._axes import log_ticks, tidy_log

__all__ = ["column_work", "column_work_figure", "backward_figure", "versus_bwd", "versus_bwd_figure",
           "versus_caption", "versus_row_dates"]


def column_work(N: int = 32768, chunk: Optional[int] = None) -> dict:
    """The dK/dV work of sinks 64 + window 1024 at length ``N`` (tiles 128): ``per_column`` (query tiles each
    key tile's program walks without splitting) and ``per_item`` (with columns cut into chunks of at most
    ``chunk`` query tiles, the default when None), and the ``chunk`` used."""
    mm = P.sinks_window(64, 1024)
    lay = BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cpu")
    totals = (lay.q_count + lay.full_q_count)[0, 0].long()
    plan = _column_work(lay, 128, chunk)
    work, used_chunk = plan.work, plan.chunk
    per_item = torch.clamp(totals[work[:, 0].long()] - work[:, 1].long() * used_chunk, min=0, max=used_chunk)
    return dict(per_column=totals.tolist(), per_item=per_item.tolist(), chunk=int(used_chunk))


def column_work_figure(N: int = 32768, chunk: Optional[int] = None) -> go.Figure:
    """Work per dK/dV program (listed query tiles) for sinks + window, without and with column splitting."""
    cw = column_work(N, chunk)
    cols = torch.tensor(cw["per_column"])
    fig = go.Figure()
    fig.add_trace(go.Histogram(x=cw["per_column"], name="one program per key tile", opacity=0.7, nbinsx=60))
    fig.add_trace(go.Histogram(x=cw["per_item"], name=f"columns split into chunks of <= {cw['chunk']}",
                               opacity=0.7, nbinsx=60))
    fig.update_layout(barmode="overlay", yaxis_type="log", height=420, title_font_size=14,
                      title=(f"dK/dV work per program, sinks 64 + window 1024, N = {N}<br><sup>the sink column "
                             f"lists {int(cols.max())} query tiles, the median column {int(cols.median())}; "
                             "computed from the block table (tiles 128)</sup>"),
                      xaxis_title="query tiles walked by one program", yaxis_title="programs of one head (count)",
                      legend=dict(orientation="h", y=-0.25))
    # explicit ranges: autorange on a log histogram cuts the tallest bar and the sink column's bin; the counts
    # are binned by plotly, so the labels reach the labelled tick just past the count of every program
    most = max(len(cw["per_column"]), len(cw["per_item"]))
    tv, tt = log_ticks(1, most, outer=True)
    fig.update_xaxes(range=[-2, int(cols.max()) + 6])
    fig.update_yaxes(range=[-0.1, math.log10(tv[-1]) + 0.05], tickmode="array", tickvals=tv, ticktext=tt)
    return fig


def backward_figure(bwd: BenchFile, fwd: BenchFile) -> go.Figure:
    """Backward times per pattern at N = 32k: ours (deterministic, atomic), FlexAttention, our forward for
    scale, and cuDNN's backward on the pattern's envelope (causal for the causal patterns)."""
    N = 32768
    pats = PREFILL_PATTERNS
    fig = go.Figure()
    for impl, label in ((Impl.OURS, "sparseattn deterministic"), (Impl.OURS_ATOMIC, "sparseattn atomic dQ"),
                        (Impl.FLEX, "FlexAttention")):
        fig.add_trace(go.Bar(x=pats, y=[bwd.ms(impl, Pass.BWD, pattern=p, N=N) for p in pats],
                             name=f"{label}: backward", marker_color=COLORS[impl]))
    fig.add_trace(go.Bar(x=pats, y=[fwd.ms(Impl.OURS, Pass.FWD, pattern=p, N=N) for p in pats],
                         name="sparseattn: forward", marker_color="#555555"))
    cud = [bwd.ms(Impl.CUDNN, Pass.BWD, pattern=dense_pattern_of(p), N=N) for p in pats]
    fig.add_trace(go.Scatter(x=pats, y=cud, mode="markers", marker=dict(symbol="line-ew-open", size=40,
                                                                         color=COLORS[Impl.CUDNN]),
                             name="cuDNN backward on the envelope (causal or dense)"))
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="time (ms, median)", xaxis_title="pattern",
                      height=480, title_font_size=14, legend=dict(orientation="h", y=-0.3),
                      title=f"Backward and forward at N = 32k<br><sup>bf16, B=1, H=16, D=128, 128-token tiles; "
                            f"the four patterns the prefill suite also times<br>backward {bwd.caption()}"
                            f"<br>forward {fwd.caption()}</sup>", margin=dict(t=130))
    return tidy_log(fig)


# ---- issue 13's table in one run (suite ``versus``) ----------------------------------------------------------
#: the two backward paths of a ``versus`` row: (line kind, our series, legend name)
_VERSUS_PATHS = (("bwd", Impl.OURS, "ours, deterministic (two passes)"),
                 ("bwd atomic", Impl.OURS_ATOMIC, "ours, atomic dQ"))


def _shape_note(row: V.Row) -> str:
    """What a ``versus`` row changes from the suite's default shape (N = 32k, H = 16, D = 128, bf16)."""
    base = V.Row("", "", "", "")
    parts = [f"N={row.N}"] if row.N != base.N else []
    parts += [f"D={row.D}"] if row.D != base.D else []
    parts += [f"H={row.H}/{row.Hkv}" if row.Hkv != row.H else f"H={row.H}"] if (row.H, row.Hkv) != (base.H, base.Hkv) \
        else []
    parts += [row.dtype] if row.dtype != base.dtype else []
    return ", ".join(parts)


def versus_bwd(doc: BenchFile) -> list:
    """The backward lines of a recorded ``versus`` file, in the suite's row order: one dict per (row, path) with
    ``row`` (key), ``label`` (the pattern, and the shape where it differs from the default), ``kind`` ("bwd" or
    "bwd atomic"), ``ours_ms``, ``flex_ms`` (FlexAttention's backward, same run, same block mask), ``ratio``
    (flex / ours: above 1, ours is faster), ``issue`` (the issue's ratio for that line, None if it gave none),
    ``target`` (the issue's minimum ratio), ``max_ms`` (its time cap, or None) and ``met`` (None when a time
    is missing). Rows the file does not hold are left out; a failed measurement gives ``ratio`` None."""
    if doc.suite != V.NAME:
        raise ValueError(f"doc must be a '{V.NAME}' file, got suite {doc.suite!r}")
    out = []
    have = {r.case.get("row") for r in doc.records}
    for row in V.ROWS:
        if "bwd" not in row.kind or row.key not in have:
            continue
        flex = doc.select(Impl.FLEX, Pass.BWD, row=row.key)
        flex_ms = flex[0].ms if flex else None
        pattern = row.label.split(",")[0]
        note = _shape_note(row)
        for kind, impl, _ in _VERSUS_PATHS:
            mine = doc.select(impl, Pass.BWD, row=row.key)
            ours = mine[0].ms if mine else None
            ratio = flex_ms / ours if flex_ms and ours else None
            t = row.targets[kind]
            out.append({"row": row.key, "label": f"{pattern} ({note})" if note else pattern, "kind": kind,
                        "ours_ms": ours, "flex_ms": flex_ms, "ratio": ratio, "issue": row.issue.get(kind),
                        "target": t.min_ratio, "max_ms": t.max_ms, "met": t.met(ours, ratio)})
    return out


def versus_caption(doc: BenchFile, sep: str = "; ", rows=None) -> str:
    """Where, when and with which versions a ``versus`` file was measured (from its meta): the file's caption,
    then CUDA, cuDNN and sparseattn versions where recorded, then, for a merged file, which rows ran when;
    joined by ``sep``. ``rows`` (row keys) limits the times to the rows a figure shows."""
    m = dict(doc.meta)
    if isinstance(m.get("cudnn"), int):  # torch.backends.cudnn.version(): 91900 is 9.19.0
        v = m["cudnn"]
        m["cudnn"] = f"{v // 10000}.{v % 10000 // 100}.{v % 100}"
    extra = ", ".join(f"{name} {m[k]}" for k, name in (("cuda", "CUDA"), ("cudnn", "cuDNN"),
                                                       ("sparseattn", "sparseattn")) if k in m)
    parts = [doc.caption()] + ([extra] if extra else [])
    dates = versus_row_dates(doc)
    merged = len(set(dates.values())) > 1
    by_date = {}
    for row, date in dates.items():
        if rows is None or row in rows:
            by_date.setdefault(date, []).append(row)
    if len(by_date) == 1:  # the shown rows ran together: when (a whole one-run file: when it started)
        when = next(iter(by_date))[11:16]
        parts.append(f"all rows shown at {when} UTC" if merged else f"every row in one run from {when} UTC")
    elif len(by_date) > 1:  # rows re-measured over earlier runs (``--merge``, maybe more than once): which ran when
        most = max(by_date, key=lambda d: len(by_date[d]))
        # one part per run: a figure caption puts each on its own line (``sep``), so none outgrows the figure
        parts += [f"rows {', '.join(rows)} at {d[11:16]} UTC" for d, rows in sorted(by_date.items()) if d != most]
        parts.append(f"the other rows at {most[11:16]} UTC")
    return sep.join(parts)


def versus_row_dates(doc: BenchFile) -> dict:
    """When each row of a ``versus`` file was measured (ISO date), in table order: the date its meta carries
    (stamped by ``--merge``), else the file's."""
    m = doc.meta
    return {k: m.get("rows", {}).get(k, {}).get("date", m["date"])
            for k in dict.fromkeys(x["row"] for x in m.get("lines", []))}


def versus_bwd_figure(doc: BenchFile) -> go.Figure:
    """FlexAttention's backward time over ours, per ``versus`` row, for the deterministic and the atomic path
    (bars), with 1.0 (as fast as FlexAttention) and each line's target from issue 13 (ticks)."""
    lines = versus_bwd(doc)
    labels = list(dict.fromkeys(x["label"] for x in lines))
    pos = {lab: i for i, lab in enumerate(labels)}
    fig = go.Figure()
    for j, (kind, impl, name) in enumerate(_VERSUS_PATHS):
        mine = [x for x in lines if x["kind"] == kind]
        xs = [pos[x["label"]] + (j - 0.5) * 0.4 for x in mine]
        fig.add_trace(go.Bar(x=xs, y=[x["ratio"] for x in mine], width=0.38, name=name,
                             marker_color=COLORS[impl],
                             customdata=[[x["ours_ms"], x["flex_ms"]] for x in mine],
                             hovertemplate="%{y:.2f}x (ours %{customdata[0]:.3f} ms, Flex %{customdata[1]:.3f} ms)"
                                           "<extra></extra>"))
        fig.add_trace(go.Scatter(x=xs, y=[x["target"] for x in mine], mode="markers", showlegend=j == 0,
                                 name="issue 13's target for that bar", legendgroup="target",
                                 marker=dict(symbol="line-ew", size=26, line=dict(width=3, color="#000000")),
                                 hovertemplate="target %{y:.2f}x<extra></extra>"))
    fig.add_hline(y=1.0, line_dash="dash", line_color=COLORS[Impl.FLEX],
                  annotation_text="1.0: as fast as FlexAttention (above: ours faster)",
                  annotation_position="top right")
    ys = [x["ratio"] for x in lines if x["ratio"]] + [x["target"] for x in lines if x["target"]] + [1.0]
    # up to eight title lines (a merged file's caption gives each run a line), hung from the top of the figure
    # (a centred title grows into the plot; at 0.985 the first line's ascenders were cut off by the top edge)
    fig.update_layout(height=630, title_font_size=14, legend=dict(orientation="h", y=-0.42), bargap=0.1,
                      margin=dict(t=165, b=170),
                      title=dict(y=0.97, yanchor="top", text=(
                          "Backward against FlexAttention, each row in one run (issue 13's rows)<br><sup>"
                          "dQ, dK, dV from a kept forward; B=1, H=16, D=128, N=32k, bf16, tiles 128 unless noted"
                          "<br>FlexAttention compiled on the same block mask, same run (sparseattn.bench versus)"
                          f"<br>{versus_caption(doc, '<br>', {x['row'] for x in lines})}</sup>")),
                      xaxis=dict(title="pattern (shape where it differs)", tickvals=list(range(len(labels))),
                                 ticktext=labels, tickangle=-20),
                      yaxis=dict(title="FlexAttention / ours (time ratio, x)",
                                 range=[0, max(ys) * 1.1]))
    return fig
