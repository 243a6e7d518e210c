"""Chapter 11, how to know a sparse kernel is right: the two baselines (and how mixing them hides a bug), error
growth with length from the recorded ``errors`` suite, repeatability, the edge cases, and the bad-input table
rendered from :mod:`sparseattn._catalogue`."""
from __future__ import annotations

import math
from typing import Dict, List, Optional, Sequence

import plotly.graph_objects as go
import torch

from .. import _catalogue
from .. import patterns as P
from ..bench import errors as E
from ..bench.record import BenchFile, Impl, Pass
from ..exercises.ch11_correctness import drop_one_tile
from ..layout import BlockLayout
from ..ops import sparse_attention
from ..reference import reference_attention, relative_error, tolerance
from . import COLORS, Table
from ._axes import tidy_log

__all__ = ["two_baselines", "baselines_figure", "cpu_error_growth", "error_growth_figure", "repeat_rows",
           "EDGE_CASES", "edge_case_table", "bad_input_table"]

#: the two baselines and the pattern's own effect, one colour each (these are comparisons, not implementations)
BASELINE_COLORS = {"baseline 1: fp64 on the same edges": "#d62728",
                   "baseline 2: fp64 dense causal attention": "#7f7f7f"}
LABELS = {Impl.OURS: "sparseattn (ours)", Impl.FLEX: "FlexAttention (compiled, same block mask)",
          Impl.CUDNN: "cuDNN (SDPA, is_causal)"}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return relative_error(a, b)


def two_baselines(window: int = 24, L: int = 128, block: int = 32, seed: int = 0) -> Dict[str, Dict[str, float]]:
    """Relative Frobenius errors of a correct kernel and of one that skips a tile (``drop_one_tile``), each
    against the fp64 reference on the layout's edges (baseline 1) and against fp64 dense causal attention, every
    key up to the query (baseline 2: the dense model the causal pattern approximates), for
    ``sinks_window(4, window)`` at ``L`` tokens, fp32, in whatever backend runs the kernels."""
    g = torch.Generator().manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    layout = BlockLayout.from_mask_mod(P.sinks_window(4, window), L, L, block, block, device=dev)
    q, k, v = (torch.randn(1, 2, L, 32, generator=g).to(dev) for _ in range(3))
    same = reference_attention(q, k, v, layout.to_dense())
    full = reference_attention(q, k, v, torch.ones(L, L, dtype=torch.bool, device=dev).tril()[None, None])
    out = {}
    for name, run_layout in (("correct kernel", layout), ("kernel that skips one tile", drop_one_tile(layout))):
        o = sparse_attention(q, k, v, run_layout)
        out[name] = {"baseline 1: fp64 on the same edges": _rel(o, same),
                     "baseline 2: fp64 dense causal attention": _rel(o, full)}
    out["pattern alone"] = {"baseline 2: fp64 dense causal attention": _rel(same, full)}
    return out


def baselines_figure(window: int = 24, L: int = 128, errors: Optional[dict] = None) -> go.Figure:
    """Bars of :func:`two_baselines`: against its own edges the skipped tile stands out by orders of magnitude;
    against dense causal attention the correct and the broken kernel look alike while the window is short."""
    errors = errors or two_baselines(window, L)
    where = "on the GPU" if torch.cuda.is_available() else "in the Triton interpreter on a CPU"
    kernels = ["correct kernel", "kernel that skips one tile"]
    fig = go.Figure()
    for base, color in BASELINE_COLORS.items():
        fig.add_trace(go.Bar(x=kernels, y=[errors[k][base] for k in kernels], name=base, marker_color=color,
                             text=[f"{errors[k][base]:.1e}" for k in kernels], textposition="outside"))
    tol = tolerance(torch.float32)  # the package's one table (sparseattn.reference.TOLERANCES)
    fig.add_hline(y=tol, line_dash="dot", annotation_text=f"fp32 tolerance {tol:.0e}", annotation_position="top left")
    vals = [errors[k][b] for k in kernels for b in BASELINE_COLORS] + [tol]
    lo, hi = math.log10(min(vals)), math.log10(max(vals))
    fig.update_yaxes(range=[lo - 0.4, hi + 0.6])  # room for the labels above the bars, no decade past them
    fig.update_layout(barmode="group", yaxis_type="log", height=420, title_font_size=12,
                      yaxis_title="relative Frobenius error (dimensionless)", xaxis_title="kernel under test",
                      title=(f"Same kernel output, two yardsticks<br><sup>sinks 4 + window {window}, {L} tokens "
                             f"(fp32, 2 heads, D=32), computed {where}<br>(the pattern alone: relative error "
                             f"{errors['pattern alone']['baseline 2: fp64 dense causal attention']:.2f} against "
                             "dense causal attention)</sup>"),
                      margin=dict(t=100),
                      legend=dict(orientation="h", y=-0.25))
    return tidy_log(fig)


def cpu_error_growth(Ns: Sequence[int] = (64, 128, 256), dtype: torch.dtype = torch.float16,
                     heads: int = 2, D: int = 32) -> List[dict]:
    """Our causal forward against the fp64 reference at small lengths (the interpreter on a CPU): per N the
    :func:`sparseattn.bench.errors.error_stats` of every row."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    out = []
    for N in Ns:
        g = torch.Generator().manual_seed(N)
        q, k, v = (torch.randn(1, heads, N, D, generator=g).to(device=dev, dtype=dtype) for _ in range(3))
        layout = BlockLayout.from_mask_mod(P.causal(), N, N, 32, 32, device=dev)
        o, lse = sparse_attention(q, k, v, layout, return_lse=True)
        ref_o, ref_lse = reference_attention(q, k, v, layout.to_dense(), return_lse=True)
        out.append({"N": N, **E.error_stats(o, ref_o, lse, ref_lse)})
    return out


def error_growth_figure(bf: BenchFile, dtype: str = "bf16", stats: Optional[List[dict]] = None) -> go.Figure:
    """Recorded error distributions vs length: per implementation (one colour each) the maximum absolute error
    over the sampled rows (circles), the 99th (triangles) and 50th (crosses) percentile of the per-row maximum.
    Markers only: the recorded lengths are few and not measured alike (all rows vs a sample), so no line joins
    them into a trend."""
    fig = go.Figure()
    Ns = bf.distinct("N", check="error", dtype=dtype)
    for impl in (Impl.OURS, Impl.FLEX, Impl.CUDNN):
        rows = {r.case["N"]: r for r in bf.select(impl, Pass.FWD, check="error", dtype=dtype) if r.ms is not None}
        if not rows:
            raise LookupError(f"no error rows of {impl!r} for {dtype} in {bf.suite!r}")
        x = [n for n in Ns if n in rows]
        # the three sit on the same values (the output's rounding): offset each a little along N so all show
        shift = {Impl.OURS: 0.94, Impl.FLEX: 1.0, Impl.CUDNN: 1.06}[impl]
        for key, symbol, what in (("max_abs", "circle", "max"), ("row_max_abs_p99", "triangle-up", "p99"),
                                  ("row_max_abs_p50", "x", "p50")):
            fig.add_trace(go.Scatter(x=[n * shift for n in x], y=[rows[n].get(key) for n in x],
                                     mode="markers", marker=dict(symbol=symbol, size=9, color=COLORS[impl]),
                                     name=f"{LABELS[impl]}: {what}",
                                     legendgroup=impl, customdata=x,
                                     hovertemplate=f"{LABELS[impl]} {what}, N=%{{customdata}}: %{{y:.4g}}"
                                                   "<extra></extra>"))
    case = bf.select(Impl.OURS, Pass.FWD, check="error", dtype=dtype, N=max(Ns))[0].case  # the longest: sampled
    fig.update_layout(xaxis=dict(type="log", title="sequence length N (tokens, log scale)", tickvals=Ns,
                                 ticktext=[f"{n // 1024}k" for n in Ns], range=_log_range([Ns[0] * 0.9, Ns[-1] * 1.1])),
                      yaxis=dict(type="log", title="per-row max |O - O_fp64| (output units, log scale)"),
                      height=480, title_font_size=12, legend=dict(orientation="h", y=-0.3),
                      title=(f"Error against fp64 at the recorded lengths: causal, {dtype}, H={case['H']}"
                             f"<br><sup>D={case['D']}; all rows up to N={E.FULL_ROWS}, else {case['rows']} "
                             f"sampled; the three implementations offset along N<br>{bf.caption()}</sup>"),
                      margin=dict(t=110))
    return fig


def _log_range(xs: Sequence[float]):
    import math
    lo, hi = math.log10(min(xs)), math.log10(max(xs))
    pad = 0.04 * (hi - lo if hi > lo else 1)
    return [lo - pad, hi + pad]


def repeat_rows(bf: BenchFile) -> List[dict]:
    """The repeatability records: implementation, pass, dtype, N, runs, bitwise equal, dQ spread (atomic)."""
    out = []
    for r in bf.select(pass_=[Pass.FWD, Pass.BWD], check="repeat"):
        out.append({"impl": r.impl, "pass": r.pass_, "dtype": r.case["dtype"], "N": r.case["N"],
                    "runs": r.case["runs"], "bitwise": r.get("bitwise_repeatable"),
                    "dq_spread": r.get("dq_run_to_run_max_abs"), "ms": r.ms})
    return out


#: The edge cases of the source material: what each exercises, what a bug there does, where it is tested.
EDGE_CASES = [
    ("block boundary ±1", "the clipped last tile: masks on loads, tile classes of ragged tiles",
     "an unmasked load past L (wrong rows) or a ragged tile classified full", "tests/test_edges.py"),
    ("length below one block", "a single clipped tile in both directions", "garbage rows beyond L",
     "tests/test_edges.py"),
    ("one valid key", "rows whose softmax is a single 1", "an off-by-one in the window drops it: an empty row",
     "tests/test_edges.py"),
    ("sinks ∩ window overlap", "keys that two patterns allow", "a key counted twice shifts the softmax",
     "tests/test_edges.py"),
    ("a tile missing one allowed cell", "the full/partial classification", "the cell is attended anyway",
     "tests/test_planted.py"),
    ("kernel tiles inside layout tiles", "row/column offsets into tile bits", "the mask of the tile's first rows "
     "is used for all", "tests/test_planted.py"),
    ("duplicate / out-of-range indices", "validation", "double counting or reads past the table",
     "tests/test_edges.py, the bad-input table"),
    ("empty rows", "o = 0, LSE = −∞, zero gradient", "NaN from 0/0", "tests/test_edges.py"),
    ("pages shared by forks", "copy-on-write and shared page bounds", "one sequence sees the other's tokens",
     "tests/test_edges.py"),
    ("decode merge over many splits", "the merge across chunks of splits", "a missing rescale between chunks",
     "tests/test_planted.py"),
    ("page key min/max", "the selection bound", "a stale bound ranks the page wrongly", "tests/test_planted.py"),
    ("ties in top-k", "the tie rule: lower page first", "kernel and reference choose different pages",
     "tests/test_fixes.py, test_5_*"),
    ("NaN and ±huge logits", "the NaN rule, the fp32 range", "NaN spreads to rows that never see it",
     "tests/test_fixes.py, test_6_*; tests/test_edges.py"),
    ("dQ, dK, dV separately", "each gradient on its own", "one wrong gradient hidden by the others",
     "tests/test_properties.py"),
]


def edge_case_table() -> Table:
    """:data:`EDGE_CASES` as an HTML :class:`~sparseattn.viz.Table`."""
    return Table(["edge case", "what it exercises", "what a bug there does", "tested in"], EDGE_CASES,
                 caption="The edge cases of a block-sparse kernel and the tests that cover them")


def bad_input_table(rows: Optional[List[tuple]] = None, max_message: int = 110) -> Table:
    """The bad-input catalogue as an HTML :class:`~sparseattn.viz.Table`: every row is run now and its actual
    message shown (a row that no longer raises what it should fails here, so the table cannot drift from the
    code)."""
    rows = rows if rows is not None else _catalogue.table()
    shown = [(f, a, k, e, m if len(m) <= max_message else m[: max_message - 1] + "…") for f, a, k, e, m in rows]
    return Table(["function", "argument", "bad value", "raises", "message (as raised now)"], shown,
                 caption=f"The bad-input catalogue: {len(shown)} rows, each run while this page was built")
