"""Chapter 10, load balance: per-program work of the plain grid and of the split plan on the balance suite's
layouts (exact, from the block tables, on the CPU), what splitting and a fixed capacity cost, the roofline's
per-tile time for predicted milliseconds, and the recorded ``balance`` suite (its table, its rows per case and a
figure of the grids' times)."""
from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np
import plotly.graph_objects as go

from .. import balance as BAL
from .. import patterns as P
from ..bench import balance as BB
from ..bench.record import BenchFile, Impl, Pass
from ..layout import BlockLayout
from . import COLORS, Table
from ._axes import full_log_ticks

__all__ = ["CASES", "case_report", "case_table", "cost_table", "histogram_figure", "tile_ms", "docs_layout",
           "explorer_figure", "recorded_table", "recorded_cases", "recorded_figure", "best_ours", "flex_target",
           "SKEWED", "FLEX_TARGET", "IDEAL_TARGET", "flex_verdict", "bucket_table", "bwd_near_ideal", "ideal_calibration",
           "flex_error", "flex_cell", "flex_failures", "recorded_bwd_cases", "recorded_bwd_table",
           "recorded_bwd_figure", "D", "SMS"]

CASES = list(BB.CASES)  #: the balance suite's cases, by name
D = 128  #: head dim of the suite (the workspace of a split row is block_m x (D + 1) floats)
SMS = BAL.H200_SMS
BASE_N = int(BB.DEFAULT_N)
#: the issue's skewed cases (heavy-tailed row lengths), where the target against FlexAttention applies
SKEWED = ("documents lognormal", "documents lognormal 2N", "routed skewed (synthetic)")
FLEX_TARGET = 1.2  #: the issue's target on the skewed cases: FlexAttention's time / ours >= this
IDEAL_TARGET = 1.15  #: ... and on every case: ours / the ideal balanced time <= this


def _n_heads(name: str):
    H, mult = BB.CASES[name]
    return max(BB.BLOCK, int(BASE_N * mult)), H


@functools.lru_cache(maxsize=None)
def _layout(name: str) -> BlockLayout:
    N, H = _n_heads(name)
    return BB.case_layout(name, N, H, "cpu")


@functools.lru_cache(maxsize=None)
def case_report(name: str, split="auto") -> BAL.BalanceReport:
    """:func:`sparseattn.balance.report` of a suite case at its recorded shape (B=1, H200's 132 SMs)."""
    N, H = _n_heads(name)
    return BAL.report(_layout(name), 1, H, block_m=BB.BLOCK, split=split, sms=SMS, head_dim=D)


def case_table(split="auto") -> Table:
    """Per case: programs, the longest one, the balanced ideal, the makespans and tail shares of the plain grid
    and of the split plan (all in tiles of 128 x 128)."""
    rows = []
    for name in CASES:
        r = case_report(name, split)
        N, H = _n_heads(name)
        rows.append([name, N, H, r.programs_plain, r.longest_plain, f"{r.ideal:.0f}", f"{r.makespan_plain:.0f}",
                     f"{r.tail_plain:.1%}", r.chunk, r.tasks_split * r.heads, f"{r.makespan_split:.0f}",
                     f"{r.tail_split:.1%}"])
    return Table(["case", "N", "heads", "programs", "longest program", "ideal", "makespan plain", "tail plain",
                  "chunk", "split programs", "makespan split", "tail split"], rows,
                 caption=f"Computed from the block tables (tiles 128, split={split!r}); times in tile steps per "
                         f"SM on {SMS} SMs. Ideal = listed tiles / SMs; tail = (makespan - ideal) / makespan.")


def merge_bytes(r: BAL.BalanceReport, head_dim: int = D) -> float:
    """Workspace traffic of a split plan: each task of a split row writes ``block_m x (D + 1)`` floats (o and
    LSE) and the merge reads them back once (the merge's O write replaces the direct one)."""
    return 2.0 * r.split_row_tasks * r.heads * r.block_m * (head_dim + 1) * 4


def kv_bytes(r: BAL.BalanceReport, head_dim: int = D, block_k: int = 128) -> float:
    """K and V bytes the programs load (bf16), one tile of keys and values per listed tile and head."""
    return 2.0 * r.total_tiles * block_k * head_dim * 2


def cost_table(split="auto") -> Table:
    """What the split plan costs per case: its workspace traffic against the K/V bytes of the tiles, and for a
    CUDA graph the fixed capacity against the tasks this layout uses (programs that start and exit at once)
    and the workspace the capacity reserves."""
    rows = []
    for name in CASES:
        r = case_report(name, split)
        ws_mb = r.ws_capacity * r.heads * r.block_m * (D + 1) * 4 / 2**20
        rows.append([name, r.chunk, r.merged_rows, r.split_row_tasks, f"{merge_bytes(r) / kv_bytes(r):.2%}",
                     r.capacity, r.tasks_split, f"{1 - r.tasks_split / r.capacity:.0%}", f"{ws_mb:.0f}"])
    return Table(["case", "chunk", "split rows", "tasks of split rows", "merge traffic / K,V loads",
                  "capacity (tasks)", "tasks used", "empty slots", "workspace reserved (MiB)"], rows,
                 caption="Computed from the block tables and the planner's shape-only capacity (tasks per head, "
                         "workspace for all heads; bf16 "
                         f"K/V, float32 workspace, D={D}, {SMS} SMs).")


def _count_range(r: BAL.BalanceReport) -> list:
    """A log count axis that stays near the bars: from a third of a decade under the smallest to a fifth
    over the largest."""
    counts = list(r.hist_plain.values()) + list(r.hist_split.values())
    return [math.log10(min(counts)) - 0.3, math.log10(max(counts)) + 0.2]


def histogram_figure(name: str, split="auto") -> go.Figure:
    """Tiles per program for a suite case: the plain grid against the split plan, on a log count axis."""
    r = case_report(name, split)
    return _work_histogram(r, 430, f"{name}, N = {_n_heads(name)[0]}, {r.heads} heads: work per program<br><sup>"
                                   f"makespan {r.makespan_plain:.0f} -> {r.makespan_split:.0f} tile steps, ideal "
                                   f"{r.ideal:.0f} ({SMS} SMs); computed from the block table</sup>")


def _work_histogram(r: BAL.BalanceReport, height: int, title: str) -> go.Figure:
    """Tiles per program of a report, plain grid and split plan side by side as bars on a log count axis."""
    fig = go.Figure()
    for hist, impl, label in ((r.hist_plain, Impl.OURS, "one program per row"),
                              (r.hist_split, Impl.OURS_SPLIT, f"split, chunk {r.chunk}")):
        xs = sorted(hist)
        fig.add_trace(go.Bar(x=xs, y=[hist[x] for x in xs], name=label, marker_color=COLORS[impl]))
    fig.update_layout(barmode="group", height=height, title_font_size=14, legend=dict(orientation="h", y=-0.25),
                      yaxis=dict(type="log", range=_count_range(r), title="programs (count)"),
                      xaxis_title="listed tiles walked by one program", title=title)
    return full_log_ticks(fig)


@functools.lru_cache(maxsize=None)
def tile_ms(program_overhead: bool = True):
    """The roofline's time of one full 128 x 128 tile step of the forward on one H200 SM (bf16, D=128) and its
    per-program overhead in tile steps, from the calibrated ceilings record: ``(ms, overhead)``."""
    from ..roofline import ceilings
    from ..roofline.model import model_params
    c = ceilings()
    p = model_params("sparseattn", "fwd")
    per_sm = c.matmul("bfloat16") * 1e12 * p["eff_compute"] / c.sm_count
    return 4.0 * 128 * 128 * D / per_sm * 1e3, (p["program_overhead"] if program_overhead else 0.0)


@functools.lru_cache(maxsize=None)
def docs_layout(sigma: float, N: int = 32768, median: int = 1024) -> BlockLayout:
    """Causal documents with log-normal lengths (log-space spread ``sigma``) packed into ``N`` tokens."""
    lens = BB.doc_lengths(N, seed=1, median=median, sigma=sigma)
    ids = np.repeat(np.arange(len(lens)), lens.numpy())
    import torch
    return BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(torch.from_numpy(ids))), N, N, 128, 128,
                                     device="cpu")


def explorer_figure(sigma: float = 1.5, chunk="auto", heads: int = 1) -> go.Figure:
    """The widget: documents with log-normal lengths at N = 32k, ``heads`` heads, a chunk size -> tiles per
    program (plain and split) and the predicted time of both (makespan x the roofline's tile time, plus its
    per-program overhead), beside the balanced ideal."""
    layout = docs_layout(sigma)
    ms, over = tile_ms()
    r = BAL.report(layout, 1, heads, block_m=128, split=chunk, sms=SMS, program_overhead=over, head_dim=D)
    lens = BB.doc_lengths(32768, seed=1, median=1024, sigma=sigma)
    return _work_histogram(
        r, 450, f"{len(lens)} documents in 32k tokens (longest {int(lens.max())}), {heads} "
                f"{'head' if heads == 1 else 'heads'}, chunk {chunk!r}<br><sup>"
                f"predicted: plain {r.makespan_plain * ms:.3f} ms, split {r.makespan_split * ms:.3f} ms, ideal "
                f"{r.ideal * ms:.3f} ms (roofline tile time, {SMS} SMs)</sup>")


def recorded_table(bf: BenchFile) -> Table:
    """The recorded ``balance`` suite: per case (its length and heads) our plain grid, the split plan ("auto"
    and the best chunk), the persistent grid over the "auto" plan (files that predate it: "not measured"),
    FlexAttention ("Flex failed to compile" where its row failed, the error in the caption) and cuDNN on the
    causal envelope, beside the ideal balanced time (the roofline's prediction is in :func:`recorded_cases`;
    the table holds the columns that fit the page)."""
    def fmt(x: Optional[float]) -> str:
        return "failed" if x is None else f"{x:.3f}"

    def maybe(x: Optional[float]) -> str:
        return "not measured" if x is None else fmt(x)
    rows = []
    cases = recorded_cases(bf)
    for name, c in cases.items():
        auto = c["split"].get("auto")
        timed = [r for r in c["split"].values() if r.ms is not None]
        best = min(timed, key=lambda r: r.ms) if timed else None
        plain, ideal = c["plain"], c["ideal_ms"]
        ours, _ = best_ours(c)
        rows.append([name, f"{c['N'] // 1024}k x {c['H']}", fmt(plain), fmt(auto.ms if auto else None),
                     f"{best.case['split']}:\u00a0{best.ms:.3f}" if best else "failed",  # one unbroken token
                     maybe(c["persistent"]), flex_cell(c), maybe(c["cudnn"]), fmt(ideal),
                     f"{plain / ideal:.2f}" if plain and ideal else "",
                     f"{best.ms / ideal:.2f}" if best and ideal else "",
                     flex_ratio_cell(c, ours)])
    mode = next(iter(cases.values()))["persistent_mode"] if cases else "dealt"
    header = ["case", "tokens x heads", "plain (ms)", "split auto (ms)", "best split: ms", f"persistent, {mode} (ms)",
              "FlexAttention (ms)", "cuDNN causal (ms)", "ideal (ms)", "plain / ideal",
              "best split / ideal", "FlexAttention / our fastest"]
    # a column no case measured (FlexAttention in a run without it) is left out and named in the caption
    empty = [j for j in range(len(header)) if rows and all(r[j] == "not measured" for r in rows)]
    keep = [j for j in range(len(header)) if j not in empty]
    note = _not_in_run(header, empty)
    return Table([header[j] for j in keep], [[r[j] for j in keep] for r in rows],
                 caption=f"Forward, bf16, D=128; {bf.caption()}{note}{flex_failures(cases)}")


def _not_in_run(header: list, empty: list) -> str:
    """The caption's note naming the series a run did not measure (their ratio columns go with them)."""
    names = [header[j].split(" (")[0] for j in empty if " / " not in header[j]]
    return "; not in this run: " + ", ".join(names) if names else ""


def best_ours(c: dict):
    """Our fastest variant of a :func:`recorded_cases` entry: ``(ms, label)`` over the plain grid, every split
    and the persistent grid (``(None, "")`` when none was timed)."""
    timed = [(c["plain"], "plain")] + [(r.ms, f"split {s}") for s, r in c["split"].items()] + \
        [(c["persistent"], "persistent")]
    timed = [(ms, label) for ms, label in timed if ms is not None]
    return min(timed) if timed else (None, "")


def flex_target(bf: BenchFile, target: float = FLEX_TARGET) -> Optional[dict]:
    """The issue's target against FlexAttention on the skewed cases (:data:`SKEWED` present in the file):
    ``{case: {"flex", "ours", "variant", "ratio", "met"}}`` with ratio = FlexAttention's ms / our fastest
    variant's ms and met = ratio >= ``target``; a case whose Flex or our time failed has ratio None and met
    False ("flex_error": the first line of Flex's error when its compile failed). None when the file has no FlexAttention forward row (a ``--no-flex`` run)."""
    if not bf.select(Impl.FLEX, Pass.FWD):
        return None
    out = {}
    for name, c in recorded_cases(bf).items():
        if name not in SKEWED:
            continue
        ours, label = best_ours(c)
        ratio = c["flex"] / ours if c["flex"] and ours else None
        out[name] = {"flex": c["flex"], "ours": ours, "variant": label, "ratio": ratio,
                     "met": ratio is not None and ratio >= target, "flex_error": c.get("flex_error")}
    return out


def flex_verdict(target: dict) -> str:
    """The sentence that states :func:`flex_target`'s result: met or missed, and each case's ratio."""
    met = [n for n, t in target.items() if t["met"]]
    def one(n, t):
        if t["ratio"] is not None:
            return f"{n}: {t['ratio']:.2f}x ({t['variant']})"
        if t.get("flex_error"):
            return f"{n}: Flex failed to compile ({t['flex_error']}), not tested"
        return f"{n}: failed"
    each = "; ".join(one(n, t) for n, t in target.items())
    failed = [n for n, t in target.items() if t["ratio"] is None and t.get("flex_error")]
    untested = f", {len(failed)} not tested: Flex failed to compile" if failed else ""
    return (f">= {FLEX_TARGET}x FlexAttention on the skewed cases: "
            f"{'met' if target and len(met) == len(target) else 'missed'} ({len(met)} of {len(target)} met{untested}; "
            f"FlexAttention / our fastest: {each})")


def bucket_table(bf: BenchFile) -> Optional[Table]:
    """The CUDA-graph bucket rows of the ``balance`` suite (case ``"routed buckets"``): per bucket the layout's
    length, the replay time, the same layout eager and in a graph of its exact length, the copy into the
    bucket, and the capacity's waste (tokens, table slots, plan tasks). None when the file has none."""
    rows = bf.select(Impl.OURS_SPLIT, Pass.FWD_GRAPH, case=BB.BUCKETS_CASE) if "bucket" in bf.case_fields() \
        else []
    if not rows:
        return None

    def fmt(x):
        return "failed" if x is None else f"{x:.3f}"
    out = []
    for r in rows:
        w = r.get("waste") or {}
        pct = lambda k: f"{w[k]:.0%}" if w.get(k) is not None else ""  # noqa: E731
        out.append([r.case["bucket"], r.case["N"], r.case["H"], fmt(r.ms), fmt(r.get("exact_graph_ms")),
                    fmt(r.get("eager_ms")), fmt(r.get("load_ms")), pct("tokens_waste"), pct("slots_waste"),
                    pct("tasks_waste"), {True: "yes", False: "no"}.get(r.get("graph_equals_eager"), "")])
    return Table(["bucket (tokens)", "layout length", "heads", "replay (ms)", "graph at exact length (ms)",
                  "eager (ms)", "copy into bucket (ms)", "tokens padded", "table slots unused",
                  "task slots unused", "replay = eager"], out,
                 caption=f"Split forward (auto) of routed layouts from CUDA-graph buckets, bf16, D=128; "
                         f"{bf.caption()}")


def flex_error(rows) -> Optional[str]:
    """The first line of the error a failed FlexAttention record carries (its ``ms`` is None), else None."""
    if not rows or rows[0].ms is not None:
        return None
    err = str(rows[0].get("error") or "no error recorded")
    if not err.strip():
        return "no error recorded"
    line = err.splitlines()[0]
    # the suite keeps ERROR_CHARS characters of a message after its type name: say where it was cut
    return line.rstrip() + " [...]" if len(line.partition(": ")[2]) >= BB.ERROR_CHARS else line


def flex_cell(c: dict) -> str:
    """A table cell for FlexAttention's time: ms, "Flex failed to compile" for a row that failed (the first line
    of its error goes in the caption, :func:`flex_failures`: a long exception name would widen the table past
    the page), or "not measured" when the run has no row for the case."""
    if c["flex"] is not None:
        return f"{c['flex']:.3f}"
    if c.get("flex_error"):
        return "Flex failed to compile (error below)"
    return "not measured"


def flex_failures(cases: dict) -> str:
    """The caption's note for the cases whose FlexAttention row failed: each distinct first line of an error,
    with the cases that gave it ("" when none failed)."""
    by_error: dict = {}
    for name, c in cases.items():
        if c["flex"] is None and c.get("flex_error"):
            by_error.setdefault(c["flex_error"], []).append(name)
    return "".join(f"; FlexAttention failed to compile on {', '.join(names)}: {err}"
                   for err, names in by_error.items())


def flex_ratio_cell(c: dict, ours: Optional[float]) -> str:
    """FlexAttention's time / ours as a table cell, or why there is none (a failed Flex row is not a 0)."""
    if c["flex"] is not None and ours:
        return f"{c['flex'] / ours:.2f}"
    return "Flex failed to compile" if c.get("flex_error") else "not measured"


def suite_order(names) -> list:
    """The distinct case names in the suite's order (:data:`sparseattn.bench.balance.CASES`; names it does not
    know after them, in recording order): a file merged from several runs holds its cases in the order they
    were measured."""
    names = list(dict.fromkeys(names))
    known = [n for n in BB.CASES if n in names]
    return known + [n for n in names if n not in BB.CASES]


def recorded_cases(bf: BenchFile) -> dict:
    """The recorded ``balance`` suite per case, in the suite's order: ``{case: {"N", "H", "plain", "persistent",
    "persistent_mode" ("pulled" or "dealt"), "graph", "cudnn", "flex", "ideal_ms", "predicted_ms", "split":
    {split: record}}}``, times in ms (``None``
    where a row is missing or failed: "graph" exists for the routed case only, "cudnn" and "flex" where they ran;
    "flex_error": the first line of the error of a FlexAttention row that failed, else None). ``split`` holds the split grid's records
    ("auto", 16, 64), each with its ``chunk``, ``tasks``, ``merged_rows`` and ``predicted_ms``."""
    out = {}
    for name in suite_order(r.case["case"] for r in bf.select(Impl.OURS, Pass.FWD)):
        if name == "equal rows":  # the ideal's calibration, not a case
            continue
        plain = bf.one(Impl.OURS, Pass.FWD, case=name)
        both = bf.select(Impl.OURS_SPLIT, Pass.FWD, case=name)
        persist = [r for r in both if r.case.get("persistent")]
        graph = bf.select(Impl.OURS_SPLIT, Pass.FWD_GRAPH, case=name)
        cud = bf.select(Impl.CUDNN, Pass.FWD, case=name)
        flex = bf.select(Impl.FLEX, Pass.FWD, case=name)
        out[name] = {"N": plain.case["N"], "H": plain.case["H"], "plain": plain.ms, "ideal_ms": plain.get("ideal_ms"),
                     "predicted_ms": plain.get("predicted_ms"),
                     "split": {r.case["split"]: r for r in both if not r.case.get("persistent")},
                     "persistent": persist[0].ms if persist else None,
                     # how its programs got their items (files from before the counter dealt them)
                     "persistent_mode": "pulled" if persist and persist[0].get("pull") else "dealt",
                     "graph": graph[0].ms if graph else None,
                     "graph_record": graph[0] if graph else None, "cudnn": cud[0].ms if cud else None,
                     "flex": flex[0].ms if flex else None, "flex_error": flex_error(flex)}
    return out


#: Short axis labels for the suite's cases (the table beside the figure names them in full).
_SHORT = {"documents lognormal": "documents", "documents lognormal 2N": "documents 2N",
          "causal&(sinks64|window1024)": "sinks | window", "routed skewed (synthetic)": "routed",
          "causal H=1 N/4": "causal, 1 head"}


def recorded_figure(bf: BenchFile) -> go.Figure:
    """The recorded ``balance`` suite, one group of bars per case: the plain grid, the split grid with the
    planner's "auto" chunk, the split grid with the faster of the fixed chunks, the persistent grid over the
    "auto" plan and, when the run measured it, FlexAttention, beside the ideal balanced time (a marker; not a strict bound). Times in ms on a log axis (the
    cases span two decades), clipped to the data."""
    cases = recorded_cases(bf)
    labels = [f"{_SHORT.get(n, n)}<br>{c['N'] // 1024}k, H={c['H']}" for n, c in cases.items()]

    def fixed(c):
        timed = [r for s, r in c["split"].items() if s != "auto" and r.ms is not None]
        return min(timed, key=lambda r: r.ms) if timed else None
    best = [fixed(c) for c in cases.values()]
    series = [("one program per row", [c["plain"] for c in cases.values()], COLORS[Impl.OURS], "", None),
              ('split, chunk "auto"', [c["split"]["auto"].ms if "auto" in c["split"] else None
                                       for c in cases.values()], COLORS[Impl.OURS_SPLIT], "",
               [f"chunk {c['split']['auto'].get('chunk')}" if "auto" in c["split"] else "" for c in cases.values()]),
              ("split, faster fixed chunk", [b.ms if b else None for b in best], COLORS[Impl.OURS_SPLIT], "/",
               [f"chunk {b.case['split']}" if b else "" for b in best]),
              (f'persistent ({next(iter(cases.values()))["persistent_mode"]}), chunk "auto"',
               [c["persistent"] for c in cases.values()], COLORS[Impl.OURS_SPLIT], "x", None)]
    if any(c["flex"] is not None for c in cases.values()):  # only runs that measured it
        series.append(("FlexAttention (compiled, same block mask)", [c["flex"] for c in cases.values()],
                       COLORS[Impl.FLEX], "", None))
    fig = _bars_with_ideal(labels, series, [c["ideal_ms"] for c in cases.values()], 520,
                           f"Forward of the balance cases, bf16, D=128, B=1<br><sup>{bf.caption()}</sup>")
    return _mark_flex_failures(fig, labels, cases)


def _mark_flex_failures(fig: go.Figure, labels: list, cases: dict) -> go.Figure:
    """Write "Flex failed to compile" under the group of a case whose FlexAttention row failed, so a missing bar
    reads as a failure, not as a 0 or an omission (the table beside the figure gives the error)."""
    for label, c in zip(labels, cases.values()):
        if c["flex"] is None and c.get("flex_error"):
            # beside the group, where FlexAttention's bar would stand (the last of the group)
            fig.add_annotation(x=label, y=0, yref="paper", yanchor="bottom", xanchor="left", xshift=12,
                               showarrow=False, text="Flex failed<br>to compile", bgcolor="rgba(255,255,255,0.85)",
                               font=dict(size=10, color=COLORS[Impl.FLEX]))
    return fig


def _bars_with_ideal(labels, series, ideal, height: int, title: str) -> go.Figure:
    """Grouped bars per case (``series``: (name, ms per case, colour, bar pattern, hover text or None)) with the
    ideal balanced time of each case as a tick, on a log time axis that stays within the data."""
    fig = go.Figure()
    for name, ys, color, pattern, hover in series:
        fig.add_trace(go.Bar(x=labels, y=ys, name=name, marker=dict(color=color, pattern_shape=pattern,
                                                                    pattern_fgcolor="white"),
                             hovertext=hover, hovertemplate="%{x}: %{y:.3f} ms %{hovertext}<extra></extra>"))
    fig.add_trace(go.Scatter(x=labels, y=ideal, mode="markers", name="ideal (tile time x tiles; not a strict bound)",
                             marker=dict(symbol="line-ew", size=34, line=dict(width=3, color=COLORS[Impl.READ_CEILING])),
                             hovertemplate="%{x}: ideal %{y:.3f} ms<extra></extra>"))
    vals = [v for _, ys, *_ in series for v in ys if v] + [v for v in ideal if v]
    fig.update_layout(barmode="group", height=height, title_font_size=14, legend=dict(orientation="h", y=-0.28),
                      title=title, xaxis=dict(title="case (query and key length, heads)", tickangle=0),
                      yaxis=dict(type="log", title="ms per call (median)",
                                 range=[math.log10(min(vals)) - 0.1, math.log10(max(vals)) + 0.1]))
    return full_log_ticks(fig)  # labelled ticks (0.2, 0.5, 2, ...), not plotly's bare minor digits


# ---- the recorded backward (suite balance_bwd) ----------------------------------------------------------------
def recorded_bwd_cases(bf: BenchFile) -> dict:
    """The recorded ``balance_bwd`` suite per case: ``{case: {"N", "H", "plain", "dq_split", "flex", "flex_error",
    "ideal_ms", "split_record"}}`` (backward ms; None where a row is missing or failed; "flex_error" as in
    :func:`recorded_cases`)."""
    out = {}
    for name in suite_order(r.case["case"] for r in bf.select(Impl.OURS, Pass.BWD)):
        if name == "equal rows":
            continue
        plain = bf.one(Impl.OURS, Pass.BWD, case=name)
        split = bf.select(Impl.OURS_SPLIT, Pass.BWD, case=name)
        flex = bf.select(Impl.FLEX, Pass.BWD, case=name)
        out[name] = {"N": plain.case["N"], "H": plain.case["H"], "plain": plain.ms,
                     "dq_split": split[0].ms if split else None, "split_record": split[0] if split else None,
                     "flex": flex[0].ms if flex else None, "flex_error": flex_error(flex),
                     "ideal_ms": plain.get("ideal_ms")}
    return out


def bwd_near_ideal(bf: BenchFile, target: float = IDEAL_TARGET) -> dict:
    """Per case of the recorded ``balance_bwd`` suite: our fastest backward (plain or split dQ) / its ideal, and
    whether that is within ``target`` (None where a time failed). ``below`` marks a case measured *faster* than
    its ideal: there the ideal is no lower bound (its calibration did not price a tile as this case runs it),
    so the case neither meets nor misses the target and ``met`` is False."""
    out = {}
    for n, c in recorded_bwd_cases(bf).items():
        ours = min([x for x in (c["plain"], c["dq_split"]) if x is not None], default=None)
        ratio = ours / c["ideal_ms"] if ours and c["ideal_ms"] else None
        below = ratio is not None and ratio < 1
        out[n] = {"ratio": ratio, "below": below, "met": ratio is not None and not below and ratio <= target}
    return out


def ideal_calibration(bf: BenchFile, name: str, pass_: str = Pass.BWD) -> dict:
    """How a case's ``ideal_ms`` was calibrated: the ``equal rows`` record of the same length made for the
    case's heads (``N``, ``H`` = the heads it ran, ``rows`` = its listed tiles / its tiles per row, over all heads: one program per row,
    ``tiles_per_row``, ``ms``), and ``sms`` from the file, so a page can say whether the calibration launch
    filled the GPU."""
    case = bf.one(Impl.OURS, pass_, case=name)
    # the calibration may run more heads than the case (``for_heads``: the case's; records before that have none)
    eq = next(r for r in bf.select(Impl.OURS, pass_, case="equal rows", N=case.case["N"])
              if r.case.get("for_heads", r.case["H"]) == case.case["H"])
    per_row = eq.case.get("tiles_per_row", BB.EQUAL_ROW_TILES)
    return {"N": eq.case["N"], "H": eq.case["H"], "rows": eq.get("listed_tiles") // per_row,
            "tiles_per_row": per_row, "ms": eq.ms, "sms": bf.meta.get("sm_count")}


def recorded_bwd_table(bf: BenchFile) -> Table:
    """The recorded ``balance_bwd`` suite: per case the backward with the plain dQ pass and with the split dQ
    pass, FlexAttention's backward where it ran, the backward's ideal balanced time and the ratios (ours /
    ideal against the issue's 1.15, FlexAttention / our fastest)."""
    def fmt(x):
        return "not measured" if x is None else f"{x:.3f}"
    rows = []
    cases = recorded_bwd_cases(bf)
    for name, c in cases.items():
        ours = min([x for x in (c["plain"], c["dq_split"]) if x is not None], default=None)
        ideal = c["ideal_ms"]
        rows.append([name, c["N"], c["H"], fmt(c["plain"]), fmt(c["dq_split"]), flex_cell(c), fmt(ideal),
                     f"{ours / ideal:.2f}" if ours and ideal else "",
                     flex_ratio_cell(c, ours)])
    header = ["case", "N", "heads", "plain dQ (ms)", "split dQ (ms)", "FlexAttention (ms)", "ideal (ms)",
              "our fastest / ideal", "FlexAttention / our fastest"]
    empty = [j for j in range(len(header)) if rows and all(r[j] == "not measured" for r in rows)]
    keep = [j for j in range(len(header)) if j not in empty]
    note = _not_in_run(header, empty)
    return Table([header[j] for j in keep], [[r[j] for j in keep] for r in rows],
                 caption=f"Backward alone (from a kept forward), bf16, D=128; ideal = the backward's time per tile "
                         f"on long equal rows x the case's tiles; {bf.caption()}{note}{flex_failures(cases)}")


def recorded_bwd_figure(bf: BenchFile) -> go.Figure:
    """The recorded ``balance_bwd`` suite: per case the backward with the plain and the split dQ pass and
    FlexAttention's backward (where it ran), beside the backward's ideal; ms on a log axis clipped to the data."""
    cases = recorded_bwd_cases(bf)
    labels = [f"{_SHORT.get(n, n)}<br>{c['N'] // 1024}k, H={c['H']}" for n, c in cases.items()]
    series = [("plain dQ pass", [c["plain"] for c in cases.values()], COLORS[Impl.OURS], "", None),
              ('split dQ pass', [c["dq_split"] for c in cases.values()], COLORS[Impl.OURS_SPLIT], "", None)]
    if any(c["flex"] is not None for c in cases.values()):
        series.append(("FlexAttention backward", [c["flex"] for c in cases.values()], COLORS[Impl.FLEX], "", None))
    fig = _bars_with_ideal(labels, series, [c["ideal_ms"] for c in cases.values()], 480,
                           f"Backward of the balance cases, bf16, D=128, B=1<br><sup>{bf.caption()}</sup>")
    return _mark_flex_failures(fig, labels, cases)
