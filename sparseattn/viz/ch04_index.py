"""Chapter 4, index formats and traversal direction: the same tiles listed by rows and by columns, what
the tables cost in bytes against the K/V they index, and the on-device transpose."""
from __future__ import annotations

import datetime
import functools
import platform

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .. import patterns as P
from ..layout import BlockLayout
from ._axes import tidy_log

__all__ = ["table_heatmaps", "index_bytes", "index_bytes_figure", "transpose_path", "transpose_cost_figure"]


def table_heatmaps(layout: BlockLayout, title: str = "") -> go.Figure:
    """Forward rows (which key tiles each query tile visits) next to the transposed columns (which query
    tiles visit each key tile), drawn as ``rank within the list`` so the traversal order shows."""
    import numpy as np
    nq, nk = layout.nq, layout.nk
    def ranks(count, index, by_row: bool) -> "np.ndarray":
        """Rank of each tile in its list (rows' lists when ``by_row``, else columns'), in a [nq, nk] grid; NaN
        where the list does not hold the tile."""
        z = np.full((nq, nk), np.nan)
        for a in range(index.shape[2]):
            for r, b in enumerate(index[0, 0, a, : int(count[0, 0, a])].tolist()):
                z[(a, b) if by_row else (b, a)] = r
        return z

    fig = make_subplots(rows=1, cols=2, subplot_titles=("rows (O, dQ)", "columns (dK, dV)"),
                        horizontal_spacing=0.12)
    panels = ((True, "Blues", ((layout.kv_count, layout.kv_index), (layout.full_count, layout.full_index))),
              (False, "Oranges", ((layout.q_count, layout.q_index), (layout.full_q_count, layout.full_q_index))))
    for col, (by_row, scale, (partial, full)) in enumerate(panels, start=1):
        for (count, index), colors, kind in ((partial, scale, "partial"), (full, "Greys", "full")):
            z = ranks(count, index, by_row)
            # zmin below 0: position 0 is drawn light, not white
            fig.add_trace(go.Heatmap(z=z.tolist(), colorscale=colors, showscale=False, xgap=1, ygap=1,
                                     zmin=-0.25 * max(1, np.nanmax(z, initial=0)),
                                     hovertemplate=(f"q tile %{{y}}, kv tile %{{x}}: {kind} tile, position "
                                                    "%{z} in its list<extra></extra>")), 1, col)
    for c in (1, 2):
        fig.update_yaxes(autorange="reversed", title_text="query tile", row=1, col=c)
        fig.update_xaxes(title_text="key tile", row=1, col=c)
    fig.update_layout(title=title or "The same tiles, listed by rows and by columns<br><sup>shade = position "
                      "in the tile's list (darker: later); partial tiles in colour, full tiles in grey, each kind "
                      "in its own list</sup>", height=430, title_font_size=14)
    return fig


def index_bytes(Ns=(4096, 8192, 16384, 32768, 65536, 131072), H: int = 16, D: int = 128) -> dict:
    """Bytes of the block tables (forward + transposed) over the bytes of K and V they index (bf16, one table
    shared by ``H`` heads), per pattern and N: ``{pattern: [ratio, ...]}``."""
    pats = {"window 1024": P.sliding_window(1024),
            "sinks 64 + window 1024": P.sinks_window(64, 1024),
            "causal": P.causal()}
    out = {}
    for name, mm in pats.items():
        ratios = []
        for N in Ns:
            st = BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cpu").stats()
            kv_bytes = 2 * N * H * D * 2  # K and V, bf16, one layout shared by H heads
            ratios.append((st["index_bytes"] + st["transposed_index_bytes"]) / kv_bytes)
        out[name] = ratios
    return out


def index_bytes_figure(Ns=(4096, 8192, 16384, 32768, 65536, 131072), H: int = 16, D: int = 128) -> go.Figure:
    """:func:`index_bytes` against N."""
    fig = go.Figure()
    for name, ratios in index_bytes(Ns, H, D).items():
        fig.add_trace(go.Scatter(x=list(Ns), y=ratios, mode="lines+markers", name=name))
    fig.update_layout(title=f"Index bytes over the K+V bytes they index<br><sup>tiles 128x128, H={H}, D={D}, "
                            "bf16, one table shared by the heads; computed on the CPU</sup>",
                      xaxis_title="sequence length N (tokens)", yaxis_title="index bytes / K+V bytes",
                      xaxis_type="log", yaxis_type="log", height=400, title_font_size=14)
    return tidy_log(fig)


def transpose_path(device: str) -> str:
    """Which transpose :func:`transpose_cost_figure` times on ``device``: the fused Triton kernel on a GPU
    (what :meth:`~sparseattn.BlockLayout.transpose` runs there), the torch stable-sort transpose on a CPU (the
    package's path for CPU layouts when kernels run on a GPU): timing the kernel in the Triton interpreter
    would measure the interpreter, not the algorithm."""
    return "fused Triton kernel" if device == "cuda" else "torch stable sort"


def _transpose_once(lay: BlockLayout, device: str, width: int, full_width: int) -> None:
    """Both lists transposed once, each at the width its longest column needs (counted before the timing)."""
    if device == "cuda":
        lay.transpose(width=max(width, full_width))
        return
    from .._tiles import _transpose_one_torch
    _transpose_one_torch(lay.kv_count, lay.kv_index, lay.nk, width)
    _transpose_one_torch(lay.full_count, lay.full_index, lay.nk, full_width)


def _median_ms(run, repeat: int, sync=None, clock=None) -> float:
    """Median wall time of ``run()`` over ``repeat`` timed calls after one untimed warm-up, in ms. The median,
    not the mean or a single run: a build machine shared with other jobs stalls now and then, and one
    stalled call must not draw a spike. ``sync`` (e.g. ``torch.cuda.synchronize``) brackets every call;
    ``clock`` defaults to ``time.perf_counter`` (a test passes a fake one)."""
    import statistics
    import time
    if not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"repeat must be a positive int, got {repeat!r}")
    clock = clock or time.perf_counter
    sync = sync or (lambda: None)
    run()  # warm-up: first-call allocations and caches are not what the figure is about
    times = []
    for _ in range(repeat):
        sync()
        t0 = clock()
        run()
        sync()
        times.append(clock() - t0)
    return statistics.median(times) * 1e3


def transpose_cost_figure(Ns=(2048, 4096, 8192, 16384, 32768), block: int = 64, repeat: int = 21) -> go.Figure:
    """Time of a transpose of both lists against the number of listed tiles, measured live on this machine:
    the fused kernel on a GPU, the torch stable-sort path on a CPU (:func:`transpose_path` says which; the
    title says it too). Each point is the median of ``repeat`` runs (:func:`_median_ms`)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    sync = torch.cuda.synchronize if dev == "cuda" else None
    fig = go.Figure()
    for name, mm in (("window 1024", P.sliding_window(1024)), ("causal", P.causal())):
        xs, ys = [], []
        for N in Ns:
            lay = BlockLayout.from_mask_mod(mm, N, N, block, block, device=dev)
            xs.append(int(lay.kv_count.sum() + lay.full_count.sum()))
            widths = [max(1, int(c.max())) for c in (lay.q_count, lay.full_q_count)]  # longest columns
            ys.append(_median_ms(functools.partial(_transpose_once, lay, dev, *widths), repeat, sync))
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name))
    where = torch.cuda.get_device_name(0) if dev == "cuda" else f"a CPU ({platform.machine()})"
    fig.update_layout(title=f"Transpose time against listed tiles: the {transpose_path(dev)}<br><sup>tiles "
                            f"{block}x{block}, each list as wide as its longest column, median of {repeat} runs, "
                            f"<br>measured live on {where} (torch {torch.__version__}) when the page was built, "
                            f"{datetime.date.today().isoformat()}</sup>",
                      xaxis_title="listed tiles (nnz)", yaxis_title="transpose time (ms)", xaxis_type="log",
                      yaxis_type="log", height=400, title_font_size=14)
    return tidy_log(fig)