"""Where sparse starts to win: the crossover against cuDNN on the pattern's envelope, and the one-call report.

The envelope of a pattern is the cheapest dense kernel that covers it: causal cuDNN for patterns inside the
causal triangle, dense cuDNN otherwise. Both sides are priced by the same model (:func:`.model.cost`), ours
with our calibrated efficiencies, cuDNN with its own (fitted on its recorded rows).
"""
from __future__ import annotations

import html
import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence

import torch

from .._checks import check_int
from ..layout import BlockLayout
from ..paged import PagedKVCache
from .. import patterns as P
from .cases import random_diag_layout
from .counts import Shape, as_shape
from .model import IMPLS, Cost, cost

__all__ = ["FAMILIES", "N_GRID", "KEEP_GRID", "Crossover", "crossover", "crossing", "bracket", "describe_bracket", "Report", "report", "TIE_BAND", "verdict_of",
           "envelope_of", "envelope_layout", "family_layout", "family_pattern", "documents_of"]

N_GRID = (1024, 1536, 2048, 3072, 4096, 6144, 8192, 16384)
KEEP_GRID = (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0)
#: family -> what varies along the crossover ("N": sequence length, "keep": the kept fraction at fixed N)
FAMILIES = {"window": "N", "sinks_window": "N", "block_random": "keep", "documents": "keep", "decode": "keep"}
PREFILL_SHAPE = Shape(B=1, Hq=16, D=128, dtype=torch.bfloat16)
DECODE_SHAPE = Shape(B=8, Hq=32, Hkv=8, D=128, dtype=torch.bfloat16, seq_len=131072, page_size=16)


def family_layout(family: str, x, *, N: int = 8192, window: int = 1024, sinks: int = 64, block: int = 128,
                  device="cpu"):
    """``(layout, envelope, kept)`` of a prefill family at grid value ``x`` (a length for window families, a
    kept fraction for the others): the layout, ``"causal"`` or ``"dense"``, and the fraction of the
    envelope's cells the pattern keeps.

    * ``"window"``: ``sliding_window(window)`` at length ``x``;
    * ``"sinks_window"``: ``sinks_window(sinks, window)`` at length ``x``;
    * ``"block_random"``: at length ``N``, whole tiles kept with probability ``x`` plus the diagonal
      (:func:`.cases.random_diag_layout`, seed 0; every listed tile full); ``kept`` is what the draw kept;
    * ``"documents"``: at length ``N``, ``round(1 / x)`` equal documents, causal inside each."""
    if family == "window":
        n = int(x)
        lay = BlockLayout.from_mask_mod(P.sliding_window(window), n, n, block, block, device=device)
        return lay, "causal", _band_cells(n, window) / _band_cells(n, n)
    if family == "sinks_window":
        n = int(x)
        lay = BlockLayout.from_mask_mod(P.sinks_window(sinks, window), n, n, block, block, device=device)
        return lay, "causal", _sinks_window_cells(n, sinks, window) / _band_cells(n, n)
    if family == "block_random":
        lay = random_diag_layout(N, float(x), block, seed=0, device=device)
        return lay, "dense", _listed_cells(lay) / float(N * N)
    if family == "documents":
        n_docs = documents_of(x)
        doc_ids = torch.arange(N, device=device) * n_docs // N  # equal documents
        mm = P.and_masks(P.causal(), P.document(doc_ids))
        lay = BlockLayout.from_mask_mod(mm, N, N, block, block, device=device)
        lengths = torch.bincount(doc_ids.cpu()).double()
        return lay, "causal", float((lengths * (lengths + 1) / 2).sum()) / _band_cells(N, N)
    raise ValueError(f"family must be one of {sorted(FAMILIES)} (decode has no layout), got {family!r}")


def documents_of(keep) -> int:
    """Equal documents a ``"documents"`` family point at kept fraction ``keep`` has: ``round(1 / keep)``."""
    return max(1, round(1 / float(keep)))


def family_pattern(family: str, x=None, *, window: int = 1024, sinks: int = 64) -> str:
    """The recorded pattern name of a family point: ``window2048``, ``sinks64+window1024``,
    ``random0.2+diag``, ``documents5&causal``, ``keep0.10`` (decode)."""
    if family == "window":
        return f"window{window}"
    if family == "sinks_window":
        return f"sinks{sinks}+window{window}"
    if family == "block_random":
        return f"random{float(x):g}+diag"
    if family == "documents":
        return f"documents{documents_of(x)}&causal"
    if family == "decode":
        return f"keep{float(x):.2f}"
    raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")


def _listed_cells(layout: BlockLayout) -> float:
    """Cells inside the listed tiles (clipped to the lengths): for a layout of full tiles, its allowed cells."""
    rows = torch.clamp(layout.q_len - torch.arange(layout.nq) * layout.block_q, max=layout.block_q).double()
    cols = torch.clamp(layout.kv_len - torch.arange(layout.nk) * layout.block_k, max=layout.block_k).double()
    partial, full = (x.cpu() for x in layout.block_classes())
    return float(((partial | full).double() * rows.view(-1, 1) * cols.view(1, -1)).sum())


def _band_cells(n: int, w: int) -> float:
    """Cells of ``0 <= q - kv < w`` in an n x n matrix."""
    w = min(w, n)
    return float(w * n - w * (w - 1) // 2)


def _sinks_window_cells(n: int, s: int, w: int) -> float:
    band = _band_cells(n, w)
    extra = sum(max(0, min(s, q - w + 1)) for q in range(n))  # sink keys older than the window
    return band + extra


def envelope_of(layout: BlockLayout) -> str:
    """``"causal"`` when no listed tile lies above the diagonal and no full tile crosses it (a full crossing
    tile holds cells above the diagonal), else ``"dense"``."""
    nq, nk = layout.nq, layout.nk
    q_hi = (torch.clamp((torch.arange(nq) + 1) * layout.block_q, max=layout.q_len) - 1 + layout.q_offset).view(-1, 1)
    k_lo = (torch.arange(nk) * layout.block_k).view(1, -1)
    k_hi = (torch.clamp((torch.arange(nk) + 1) * layout.block_k, max=layout.kv_len) - 1).view(1, -1)
    q_lo = (torch.arange(nq) * layout.block_q + layout.q_offset).view(-1, 1)
    partial, full = (x.cpu() for x in layout.block_classes())
    above = (k_lo > q_hi)  # the whole tile is above the diagonal
    crossing = (k_hi > q_lo) & ~above
    if bool(((partial | full) & above).any()) or bool((full & crossing).any()):
        return "dense"
    return "causal"


def envelope_layout(kind: str, q_len: int, kv_len: int) -> BlockLayout:
    """The layout of an envelope (``"causal"`` or ``"dense"``, 128 tiles, CPU): what cuDNN is priced on."""
    if kind not in ("causal", "dense"):
        raise ValueError(f"envelope must be 'causal' or 'dense', got {kind!r}")
    mm = P.causal() if kind == "causal" else P.full()
    return BlockLayout.from_mask_mod(mm, q_len, kv_len, 128, 128, device="cpu")


@dataclass
class Crossover:
    """Predicted times along a family's grid and where ours drops below cuDNN on the envelope.

    ``value``: the crossover (a length for ``variable == "N"``: ours is faster above it; a kept fraction for
    ``"keep"``: ours is faster below it), interpolated on the log of the time ratio between the two grid
    points that bracket it; None with ``state`` ``"always"`` (ours faster on the whole grid) or ``"never"``.
    ``flex_value``/``flex_state``: the same for FlexAttention against cuDNN."""

    family: str
    pass_: str
    variable: str
    envelope: str
    grid: List[float]
    kept: List[float]
    ours_ms: List[float]
    cudnn_ms: List[float]
    flex_ms: List[Optional[float]]
    value: Optional[float]
    state: str
    flex_value: Optional[float] = None
    flex_state: str = "not modelled"
    bounds: List[str] = field(default_factory=list)

    def __str__(self) -> str:
        head = f"{self.family} {self.pass_}: " + (
            f"crossover at {self.variable} = {self.value:.4g}" if self.value is not None else
            {"always": "ours faster on the whole grid", "never": "cuDNN faster on the whole grid"}[self.state])
        head += f" (envelope: {self.envelope} cuDNN)"
        rows = [f"{self.variable:>8s} {'kept':>6s} {'ours ms':>9s} {'flex ms':>9s} {self.envelope + ' ms':>11s} bound"]
        for x, k, o, f, c, b in zip(self.grid, self.kept, self.ours_ms, self.flex_ms, self.cudnn_ms, self.bounds):
            rows.append(f"{x:8.4g} {k:6.3f} {o:9.4g} {'-' if f is None else format(f, '9.4g'):>9s} {c:11.4g} {b}")
        return head + "\n" + "\n".join(rows)


def crossing(grid: Sequence[float], ours: Sequence[float], dense: Sequence[float], variable: str):
    """Where ``ours`` drops below ``dense`` for good along an ascending ``grid``: ``(value, state)``.

    ``variable="N"``: the length above which ours stays faster, interpolated on the log of the time ratio
    against log N between the last grid point where ours loses and the next one. ``"keep"``: the kept
    fraction below which ours stays faster (between the sparsest point where ours loses and the point
    before it). ``state``: ``"crosses"``, ``"always"`` (ours faster at every grid point) or ``"never"``
    (no such value inside the grid: ours loses at the longest length, or at the sparsest fraction)."""
    if len(grid) != len(ours) or len(grid) != len(dense) or not grid:
        raise ValueError(f"grid, ours and dense must have one value per grid point, got {len(grid)}, {len(ours)}, "
                         f"{len(dense)}")
    if variable not in ("N", "keep"):
        raise ValueError(f"variable must be 'N' or 'keep', got {variable!r}")
    r = [math.log(o / d) for o, d in zip(ours, dense)]  # < 0: ours faster
    wins = [x < 0 for x in r]
    if all(wins):
        return None, "always"
    if not any(wins):
        return None, "never"
    xs = [math.log(g) for g in grid]
    if variable == "N":  # ours wins above the crossover: the last loss before the first lasting win
        i = max(j for j, w in enumerate(wins) if not w)
        if i == len(grid) - 1:
            return None, "never"
        a, b = i, i + 1
    else:  # ours wins below the crossover: the first loss after the last win from the sparse end
        i = min(j for j, w in enumerate(wins) if not w)
        if i == 0:
            return None, "never"
        a, b = i - 1, i
    t = r[a] / (r[a] - r[b])
    return math.exp(xs[a] + t * (xs[b] - xs[a])), "crosses"


def bracket(grid: Sequence[float], ours: Sequence[float], dense: Sequence[float], variable: str) -> dict:
    """A measured crossover as the two grid points that bracket it, with no interpolation: one median per point
    cannot place it more finely (the short-N points vary from run to run).

    Returns ``{"state", "lo", "hi", "n"}``: ``state`` is ``"crosses"`` (``variable="N"``: ours loses at ``lo``
    and wins at every grid point from ``hi`` on; ``"keep"``: ours wins at every fraction up to ``lo`` and loses
    at ``hi``), ``"always"``/``"never"`` (ahead / behind at all ``n`` points), or ``"too few"`` when ``n < 2``
    (one point says nothing about a crossing). Same arguments and errors as :func:`crossing`."""
    value, state = crossing(grid, ours, dense, variable)
    n = len(grid)
    wins = [o < d for o, d in zip(ours, dense)]
    out = {"state": state, "lo": None, "hi": None, "n": n, "wins": sum(wins)}
    if n < 2:
        out["state"] = "too few"
    elif state == "crosses" and variable == "N":
        i = max(j for j, w in enumerate(wins) if not w)
        out.update(lo=grid[i], hi=grid[i + 1])
    elif state == "crosses":
        i = min(j for j, w in enumerate(wins) if not w)
        out.update(lo=grid[i - 1], hi=grid[i])
    return out


def describe_bracket(b: dict, variable: str = "N") -> str:
    """A :func:`bracket` in words: "between N = 4096 and 8192", "ahead at all 5 lengths", "not enough points
    (n=1)"."""
    what = "lengths" if variable == "N" else "kept fractions"
    fmt = (lambda x: f"{x:.0f}") if variable == "N" else (lambda x: f"{x:.3g}")
    if b["state"] == "too few":
        return f"not enough points (n={b['n']})"
    if b["state"] == "always":
        return f"ahead at all {b['n']} {what}"
    if b["state"] == "never" and b["wins"] == 0:
        return f"behind at all {b['n']} {what}"
    if b["state"] == "never":  # ahead somewhere, behind at the end that decides
        return (f"behind at the longest length (ahead at {b['wins']} of {b['n']})" if variable == "N" else
                f"behind at the sparsest fraction (ahead at {b['wins']} of {b['n']})")
    if variable == "N":
        return f"between N = {fmt(b['lo'])} and {fmt(b['hi'])}"
    return f"between kept {fmt(b['lo'])} and {fmt(b['hi'])}"


def crossover(family: str, pass_: str = "fwd", *, shape=None, grid: Optional[Sequence[float]] = None,
              N: int = 8192, window: int = 1024, sinks: int = 64, deterministic: bool = True, graph: bool = True,
              device=None) -> Crossover:
    """Predicted crossover of ``family`` against cuDNN on its envelope.

    Families: ``"window"`` and ``"sinks_window"`` vary the sequence length (grid default
    ``1k, 1.5k, 2k, 3k, 4k, 6k, 8k, 16k``; envelope causal); ``"block_random"`` (envelope dense) and
    ``"documents"`` (``round(1 / keep)`` equal documents, causal; envelope causal) vary the kept fraction at
    length ``N`` (the crossover is interpolated on the fraction the layouts keep; grid values giving the same
    layout are merged);
    ``"decode"`` varies the kept fraction of pages (envelope: cuDNN dense decode; ``pass_`` is ignored;
    ``graph`` prices our step as a CUDA-graph replay). ``shape`` defaults to the book's benchmarks: B=1,
    16 heads, D=128, bf16 for prefill; B=8, 32/8 heads, 128k tokens, 16-token pages for decode."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    variable = FAMILIES[family]
    if grid is None:
        grid = N_GRID if variable == "N" else KEEP_GRID
    grid = [float(g) for g in grid]
    if not grid or any(g <= 0 for g in grid) or sorted(grid) != grid:
        raise ValueError(f"grid must be ascending positive values, got {grid}")
    if family == "decode":
        s = as_shape(shape) if shape is not None else DECODE_SHAPE
        if s.seq_len is None:
            raise ValueError("decode crossover needs shape.seq_len")
        dense = cost(None, s, "decode", impl="cudnn", device=device)
        ours = [cost(None, s, "decode", keep=k, graph=graph, device=device) for k in grid]
        o = [c.predicted_ms for c in ours]
        d = [dense.predicted_ms] * len(grid)
        value, state = crossing(grid, o, d, variable)
        return Crossover(family, "decode", variable, "dense", grid, grid, o, d, [None] * len(grid), value, state,
                         bounds=[c.bound for c in ours])
    if pass_ not in ("fwd", "bwd"):
        raise ValueError(f"pass_ must be 'fwd' or 'bwd' for a prefill family, got {pass_!r}")
    s = as_shape(shape) if shape is not None else PREFILL_SHAPE
    o, f, d, kept, bounds = [], [], [], [], []
    env = None
    for x in grid:
        lay, env, k = family_layout(family, x, N=N, window=window, sinks=sinks)
        ours = cost(lay, s, pass_, deterministic=deterministic, device=device)
        o.append(ours.predicted_ms)
        bounds.append(ours.bound)
        f.append(cost(lay, s, pass_, impl="flex", device=device).predicted_ms)
        d.append(cost(envelope_layout(env, lay.q_len, lay.kv_len), s, pass_, impl="cudnn",
                      device=device).predicted_ms)
        kept.append(k)
    if variable == "keep":  # interpolate on the fraction the layouts really keep (documents round to 1/n)
        first = sorted({k: i for i, k in reversed(list(enumerate(kept)))}.values())
        grid, kept, o, d, f, bounds = ([xs[i] for i in first] for xs in (kept, kept, o, d, f, bounds))
    value, state = crossing(grid, o, d, variable)
    fvalue, fstate = crossing(grid, f, d, variable)
    return Crossover(family, pass_, variable, env, grid, kept, o, d, f, value, state, fvalue, fstate, bounds)


# ---- the one-call report -------------------------------------------------------------------------------------------
@dataclass
class Report:
    """Will sparse be faster here? Predicted (and, with ``measure=True`` on a GPU, measured) times of ours,
    FlexAttention and cuDNN on the envelope; the verdict, our speedup over cuDNN (measured when measured,
    else predicted), the dominant term of our cost, and the three costs (:class:`~.model.Cost`) with every term.

    ``str(report)`` is a small text table; in a notebook the report shows as an HTML table."""

    what: str
    pass_: str
    envelope: str
    predicted: Dict[str, Optional[float]]
    measured: Dict[str, Optional[float]]
    costs: Dict[str, Cost]
    verdict: str
    dominant: str
    speedup: float = float("nan")  #: cuDNN time / our time (> 1: sparse faster)
    source: str = "predicted"  #: where ``speedup`` comes from: ``"predicted"`` or ``"measured"``

    @property
    def faster(self) -> bool:
        """Whether our kernel beats cuDNN on the envelope here (the ratio alone; see :attr:`tie`)."""
        return self.speedup > 1

    @property
    def tie(self) -> bool:
        """A predicted ratio too close to 1 for the model to call (within ``TIE_BAND``): the verdict says tie."""
        return self.source == "predicted" and 1 / TIE_BAND <= self.speedup <= TIE_BAND

    def rows(self) -> List[dict]:
        """One dict per implementation: predicted and measured ms, the bound and the terms (ms)."""
        out = []
        for impl in IMPLS:
            c = self.costs.get(impl)
            out.append({"impl": impl, "predicted_ms": self.predicted.get(impl), "measured_ms": self.measured.get(impl),
                        "bound": c.bound if c else None, **({f"{k}_ms": v for k, v in c.terms.items()} if c else {})})
        return out

    def as_dict(self) -> dict:
        return {"what": self.what, "pass": self.pass_, "envelope": self.envelope, "verdict": self.verdict,
                "dominant": self.dominant, "speedup": self.speedup, "source": self.source, "rows": self.rows()}

    def __str__(self) -> str:
        lines = [f"{self.what} ({self.pass_}); envelope: {self.envelope} cuDNN",
                 f"{'impl':12s} {'predicted ms':>13s} {'measured ms':>12s}  bound"]
        for r in self.rows():
            p, m = r["predicted_ms"], r["measured_ms"]
            lines.append(f"{r['impl']:12s} {'-' if p is None else format(p, '13.4g'):>13s} "
                         f"{'-' if m is None else format(m, '12.4g'):>12s}  {r['bound'] or '-'}")
        lines.append(f"verdict: {self.verdict}")
        lines.append(f"our dominant term: {self.dominant}")
        return "\n".join(lines)

    def _repr_html_(self) -> str:
        def cell(x):
            return "-" if x is None else (f"{x:.4g}" if isinstance(x, float) else html.escape(str(x)))
        head = "".join(f"<th>{h}</th>" for h in ("impl", "predicted ms", "measured ms", "bound", "compute ms",
                                                  "memory ms", "launch ms"))
        body = "".join("<tr>" + "".join(f"<td>{cell(r.get(k))}</td>" for k in (
            "impl", "predicted_ms", "measured_ms", "bound", "compute_ms", "memory_ms", "launch_ms")) + "</tr>"
            for r in self.rows())
        return (f"<p><b>{html.escape(self.what)}</b> ({self.pass_}); envelope: {self.envelope} cuDNN</p>"
                f"<table><tr>{head}</tr>{body}</table><p>verdict: {html.escape(self.verdict)}; our dominant term: "
                f"{html.escape(self.dominant)}</p>")


def _dominant(c: Cost) -> str:
    terms = {"compute (F_tile / P_eff)": c.t_compute_ms, "memory (D_HBM / W_eff)": c.t_memory_ms,
             "launch": c.t_launch_ms, "index": c.t_index_ms, "route": c.t_route_ms, "latency": c.t_latency_ms}
    name = max(terms, key=terms.get)
    return f"{name} {terms[name]:.3g} ms of {c.predicted_ms:.3g}"


def _named_layout(name: str, N: Optional[int]) -> BlockLayout:
    from .cases import PREFILL_PATTERNS, prefill_layout
    if name not in ["dense"] + PREFILL_PATTERNS:
        raise ValueError(f"a pattern name must be one of {['dense'] + PREFILL_PATTERNS} (or pass a mask_mod or a "
                         f"BlockLayout), got {name!r}")
    if N is None:
        raise ValueError("a pattern needs N (the sequence length)")
    check_int("N", N)
    return prefill_layout(name, N, 128, device="cpu")


def report(pattern_or_layout, shape=None, *, N: Optional[int] = None, pass_: str = "fwd", keep: Optional[float] = None,
           pages=None, routing=None, rebuild_layout: bool = False, measure: bool = False, device=None) -> Report:
    """Will sparse be faster here? Predicted times of ours, FlexAttention and cuDNN (on the pattern's envelope)
    for one pattern and shape, the verdict and our dominant term; with ``measure=True`` (CUDA) also the
    measured times, which then decide the verdict. Eager calls are priced as a loop issues them, back to back
    (``max(device, host)``); with ``measure=True`` as the measurement times them (Triton's ``do_bench``, an L2
    flush before each call: ``cost(..., l2_flush=True)``), so the two columns compare like with like.

    ``pattern_or_layout``: a mask_mod (with ``N``, the sequence length, 128 x 128 tiles), a recorded pattern
    name (``"causal"``, ``"window1024"``, ``"sinks64+window1024"``, ``"random10%+diag"``, with ``N``), a
    :class:`BlockLayout`, or, for ``pass_="decode"``, a :class:`PagedKVCache` or None (with ``keep`` or
    ``pages``). ``shape``: a :class:`~.counts.Shape` or dict (default: B=1, 16 heads, D=128, bf16 for
    prefill; B=8, 32/8 heads, 128k tokens for decode). ``routing``: the routing step's time in ms (added to
    ours); ``rebuild_layout=True`` adds building the layout every call.

    Raises ValueError/TypeError naming the argument: an unknown pass, a pattern without ``N``, ``measure``
    without CUDA.

    A float32 ``shape`` gets its verdict with a warning in it: PyTorch's cuDNN attention takes float16 and
    bfloat16 only, so the dense side is then a kernel PyTorch does not run (cuDNN's fitted efficiency on the
    float32 matmul rate), and the model was fitted on bfloat16 calls."""
    if pass_ not in ("fwd", "bwd", "decode"):
        raise ValueError(f"pass_ must be 'fwd', 'bwd' or 'decode', got {pass_!r}")
    if measure and not torch.cuda.is_available():
        raise ValueError("measure=True needs a CUDA GPU; with measure=False the report is predicted only")
    if pass_ == "decode":
        s = as_shape(shape) if shape is not None else DECODE_SHAPE
        cache = pattern_or_layout
        if cache is not None and not isinstance(cache, PagedKVCache):
            raise TypeError(f"decode reports take a PagedKVCache or None, got {type(cache).__name__}")
        ours = cost(cache, s, "decode", routing=routing, keep=keep, pages=pages, graph=True, device=device)
        dense = cost(cache, s, "decode", impl="cudnn", device=device)
        costs = {"sparseattn": ours, "cudnn": dense}
        predicted = {"sparseattn": ours.predicted_ms, "flex": None, "cudnn": dense.predicted_ms}
        measured = {"sparseattn": None, "flex": None, "cudnn": None}
        if measure:
            from .measure import measure_decode
            measured.update(measure_decode(s, keep))
        what = f"decode B={s.B} Hq={s.Hq} Hkv={s.Hkv} " + (f"keep={keep}" if keep is not None else "all pages")
        return _finish(what, "decode", "dense", predicted, measured, costs, s.dtype)
    if isinstance(pattern_or_layout, BlockLayout):
        layout = pattern_or_layout.to("cpu") if pattern_or_layout.device.type != "cpu" else pattern_or_layout
        mask = getattr(layout.mask_mod, "__name__", None) or ("tile bits" if layout.tile_bits is not None
                                                              else "block mask")
        name = f"layout ({mask}) Lq={layout.q_len} Lk={layout.kv_len}"
    elif isinstance(pattern_or_layout, str):
        layout = _named_layout(pattern_or_layout, N)
        name = f"{pattern_or_layout} N={N}"
    elif callable(pattern_or_layout):
        if N is None:
            raise ValueError("a pattern needs N (the sequence length)")
        check_int("N", N)
        layout = BlockLayout.from_mask_mod(pattern_or_layout, N, N, 128, 128, device="cpu")
        name = f"{getattr(pattern_or_layout, '__name__', 'pattern')} N={N}"
    else:
        raise TypeError(f"pattern_or_layout must be a mask_mod, a pattern name, a BlockLayout or (decode) a "
                        f"PagedKVCache, got {type(pattern_or_layout).__name__}")
    s = as_shape(shape) if shape is not None else PREFILL_SHAPE
    env = envelope_of(layout)
    flush = bool(measure)  # measured with do_bench: priced as it times the calls (an L2 flush before each)
    ours = cost(layout, s, pass_, routing=routing, rebuild_layout=rebuild_layout, device=device, l2_flush=flush)
    flex = cost(layout, s, pass_, impl="flex", device=device, l2_flush=flush)
    dense = cost(envelope_layout(env, layout.q_len, layout.kv_len), s, pass_, impl="cudnn", device=device,
                 l2_flush=flush)
    costs = {"sparseattn": ours, "flex": flex, "cudnn": dense}
    predicted = {k: c.predicted_ms for k, c in costs.items()}
    measured = {"sparseattn": None, "flex": None, "cudnn": None}
    if measure:
        from .measure import measure_prefill
        measured.update(measure_prefill(layout, s, pass_, env))
    return _finish(f"{name} B={s.B} Hq={s.Hq} Hkv={s.Hkv} D={s.D}", pass_, env, predicted, measured, costs,
                   s.dtype)


#: A predicted ratio within this factor of 1 is a tie: the model's error on the held-out sweep is of this order
#: (chapter 9: "within 25%" is its accuracy target), so it cannot say which side wins.
TIE_BAND = 1.25


def verdict_of(ratio: float, source: str, env: str) -> str:
    """The verdict on ``ratio`` = cuDNN time / our time (> 1: sparse faster). A ``"predicted"`` ratio inside
    ``[1 / TIE_BAND, TIE_BAND]`` is a tie within the model's error; a ``"measured"`` one decides alone."""
    if source not in ("predicted", "measured"):
        raise ValueError(f"source must be 'predicted' or 'measured', got {source!r}")
    if not ratio > 0:
        raise ValueError(f"ratio must be a positive time ratio, got {ratio!r}")
    if source == "predicted" and 1 / TIE_BAND <= ratio <= TIE_BAND:
        return (f"tie (within the model's error: predicted {ratio:.2f}x over {env} cuDNN, "
                f"inside the +-{TIE_BAND - 1:.0%} band")
    return (f"sparse is faster here ({source} {ratio:.2f}x over {env} cuDNN" if ratio > 1 else
            f"dense is faster here ({env} cuDNN {source} {1 / ratio:.2f}x faster")


#: What a float32 report's verdict says first (:func:`report`).
FP32_WARNING = ("float32: PyTorch has no cuDNN attention in float32; the dense side prices a kernel it does not "
                "run, and the model was fitted on bfloat16 calls -- ")


def _finish(what, pass_, env, predicted, measured, costs, dtype=None) -> Report:
    use = measured if measured.get("sparseattn") is not None and measured.get("cudnn") is not None else predicted
    src = "measured" if use is measured else "predicted"
    ratio = use["cudnn"] / use["sparseattn"]
    verdict = verdict_of(ratio, src, env)
    if use.get("flex") is not None:
        verdict += f"; FlexAttention {use['cudnn'] / use['flex']:.2f}x"
    verdict += ")"
    if dtype == torch.float32:
        verdict = FP32_WARNING + verdict
    return Report(what, pass_, env, predicted, measured, costs, verdict, _dominant(costs["sparseattn"]), ratio, src)
