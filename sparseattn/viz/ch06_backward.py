"""Chapter 6, the backward pass: the dK/dV work per program with and without column splitting, and the
recorded backward and forward times of the ``backward`` and ``prefill`` suites."""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
import torch

from .. import patterns as P
from ..bench.cases import PREFILL_PATTERNS, dense_pattern_of
from ..bench.record import BenchFile, Impl, Pass
from ..layout import BlockLayout
from ..ops import column_work as _column_work
from . import COLORS
from ._axes import tidy_log

__all__ = ["column_work", "column_work_figure", "backward_figure"]


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
                      xaxis_title="query tiles walked by one program", yaxis_title="programs (count)",
                      legend=dict(orientation="h", y=-0.25))
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
                             name="cuDNN backward, same work (causal or dense)"))
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="time (ms, median)", xaxis_title="pattern",
                      height=480, title_font_size=14, legend=dict(orientation="h", y=-0.3),
                      title=f"Backward and forward at N = 32k<br><sup>bf16, H=16, D=128; {bwd.caption()}</sup>")
    return tidy_log(fig)
