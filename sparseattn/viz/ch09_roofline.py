"""Chapter 9, the roofline and the crossover: the measured ceilings, arithmetic intensity of prefill and decode work
on the roofline, the model's predictions against the recorded ``crossover`` suite on device time and on eager
time (scatter, ratio against N, accuracy per class, the run's host times), crossover curves per family and pass,
where the model misses (launch tails, host time), where a profiled step's time went, and the kernel-free explorer
of the model's terms."""
from __future__ import annotations

import math
from typing import Dict, List, Optional

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from ..bench.crossover import measured_crossovers, prediction_ratios, ratio_summary
from ..bench.record import BenchFile, Impl, Pass, check_timing
from ..roofline import calibrate, ceilings as recorded_ceilings, cost
from ..roofline.ceilings import Ceilings
from ..roofline.counts import Shape
from ..roofline.crossover import DECODE_SHAPE, PREFILL_SHAPE, bracket, describe_bracket, family_layout, report
from . import COLORS, Table
from ._axes import tidy_log

__all__ = ["run_caption", "ceilings_table", "intensity_points", "roofline_figure", "TIMINGS", "sweep_points",
           "timing_scatter", "timing_ratio_figure", "accuracy_table", "host_table", "length_brackets",
           "crossover_figure", "crossover_table", "worst_points", "tail_points", "tail_figure", "profile_figure",
           "EXPLORER_FAMILIES", "explorer_layout", "terms_figure"]


# ---------------------------------------------------------------------------------------------------------
# ceilings and the roofline
# ---------------------------------------------------------------------------------------------------------
def ceilings_table(ceil: Optional[Ceilings] = None) -> Table:
    """The ceilings the model uses, each with where it comes from (an HTML :class:`Table`)."""
    c = ceil or recorded_ceilings()
    rows = [("SMs", f"{c.sm_count}", c.sources.get("sm_count", "")),
            *((f"matmul, {k}", f"{v:g} TFLOP/s", c.sources.get("matmul_tflops", "") if i == 0 else "same")
              for i, (k, v) in enumerate(c.matmul_tflops.items())),
            ("HBM read", f"{c.hbm_read_tbps:g} TB/s", c.sources.get("hbm_read_tbps", "")),
            ("launch (one more kernel)", f"{c.launch_us:g} us", c.sources.get("launch_us", "")),
            ("L2 cache", f"{c.l2_mib:g} MiB" if c.l2_mib else "-", c.sources.get("l2_mib", ""))]
    return Table(["ceiling", "value", "where it comes from"], rows,
                 caption=f"Ceilings of the {c.device} used by the cost model")


def intensity_points(N: int = 16384, shape: Optional[Shape] = None, decode_shape: Optional[Shape] = None) -> List[dict]:
    """Prefill (forward and backward, four patterns at length ``N``) and decode (all pages and 10% kept) as
    the model prices them on the H200: FLOPs, compulsory HBM bytes (each byte once: K/V reuse served by L2)
    and requested bytes (what the programs load: no reuse across programs), their intensities, and the
    FLOP rate the prediction implies."""
    s = shape or PREFILL_SHAPE
    out = []
    for fam, x, kw, name in (("window", N, dict(window=1024), "window 1024"),
                             ("sinks_window", N, dict(sinks=64, window=1024), "sinks 64 + window 1024"),
                             ("block_random", 0.1, dict(N=N), "block-random 10%"),
                             ("documents", 1.0, dict(N=N), "causal")):
        lay = family_layout(fam, x, **kw)[0]
        for pass_ in ("fwd", "bwd"):
            c = cost(lay, s, pass_)
            out.append({**_point(f"{name}, {pass_}", pass_, c),
                        "shape": f"prefill N={N}, B={s.B}, {s.Hq} heads, D={s.D}"})
    d = decode_shape or DECODE_SHAPE
    G = d.Hq // d.Hkv
    block_g = max(16, 1 << (G - 1).bit_length())  # the kernel's group tile (counts.py): padded rows multiplied
    for keep in (None, 0.1):
        c = cost(None, d, "decode", keep=keep, graph=True)
        out.append({**_point(f"decode B={d.B}, {'all pages' if keep is None else f'{keep:.0%} of the pages'}",
                             "decode", c, useful=G / block_g),
                    "shape": f"decode {d.seq_len} tokens, {d.Hq}/{d.Hkv} heads, D={d.D}"})
    return out


def _point(label: str, pass_: str, c, useful: float = 1.0) -> dict:
    """``useful``: the share of the priced FLOPs that are useful (decode multiplies a group tile padded to 16
    rows for G query heads: G / 16). ``intensity`` and ``tflops`` count useful FLOPs; ``padded_intensity``
    what the tensor cores multiply."""
    requested = sum(c.bytes_requested.values())
    return {"label": label, "pass": pass_, "flops": c.flops * useful, "hbm_bytes": c.D_hbm,
            "requested_bytes": requested, "intensity": c.intensity * useful,
            "padded_intensity": c.intensity, "requested_intensity": c.tile_intensity * useful,
            "predicted_ms": c.predicted_ms, "tflops": c.flops * useful / (c.predicted_ms * 1e9), "bound": c.bound}


def roofline_figure(points: List[dict], ceil: Optional[Ceilings] = None, dtype: str = "bfloat16") -> go.Figure:
    """Attainable FLOP rate against arithmetic intensity: the matmul roof and the bandwidth slope, each
    point at its compulsory intensity (filled) joined to its intensity without any reuse (open), at the
    rate its predicted time implies."""
    c = ceil or recorded_ceilings()
    P, W = c.matmul(dtype), c.hbm_read_tbps
    xs = [p[k] for p in points for k in ("intensity", "requested_intensity", "padded_intensity")]
    lo, hi = min(xs) / 2, max(xs) * 2
    grid = [lo * (hi / lo) ** (i / 200) for i in range(201)]
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=grid, y=[min(P, g * W) for g in grid], mode="lines", name="roof: min(P, I x W)",
                             line=dict(color="black")))
    fig.add_vline(x=P / W, line_dash="dot", annotation_text=f"ridge {P / W:.0f} FLOP/B")
    colors = {"fwd": COLORS[Impl.OURS], "bwd": "#8c564b", "decode": "#17becf"}
    for p in points:
        col = colors[p["pass"]]
        fig.add_trace(go.Scatter(x=[p["requested_intensity"], p["intensity"]], y=[p["tflops"], p["tflops"]],
                                 mode="lines+markers", name=p["label"], line=dict(color=col, width=1),
                                 marker=dict(symbol=["circle-open", "circle"], size=[8, 11], color=col),
                                 hovertemplate=f"{p['label']}: %{{x:.3g}} FLOP/B, {p['tflops']:.0f} TFLOP/s "
                                               f"({p['bound']}-bound)<extra></extra>"))
        if p["padded_intensity"] != p["intensity"]:  # decode: what the padded group tile multiplies
            fig.add_trace(go.Scatter(x=[p["padded_intensity"]], y=[p["tflops"]], mode="markers",
                                     name=f"{p['label']}: padded tile ({p['padded_intensity']:.0f} FLOP/B "
                                          "multiplied, not useful)",
                                     marker=dict(symbol="x-thin-open", size=10, color=col, line=dict(width=2))))
    ys = [p["tflops"] for p in points] + [min(P, lo * W)]
    fig.update_layout(xaxis_type="log", yaxis_type="log", height=820, title_font_size=12, margin=dict(t=150),
                      xaxis_title="arithmetic intensity (FLOP per HBM byte)", yaxis_title="TFLOP/s (predicted)",
                      title=f"Roofline of the {c.device}, {dtype}<br><sup>"
                            + "; ".join(dict.fromkeys(p["shape"] for p in points if "shape" in p))
                            + "<br>filled: compulsory bytes (each byte "
                            f"once); open: bytes the programs request<br>(no reuse across programs); useful FLOPs "
                            f"(decode's padded group tile marked x); rates from the cost model</sup>",
                      legend=dict(font=dict(size=10), orientation="h", y=-0.22))
    fig.update_xaxes(range=[math.log10(lo), math.log10(hi)])
    fig.update_yaxes(range=[math.log10(min(ys) / 1.5), math.log10(P * 1.5)])
    return tidy_log(fig)


# ---------------------------------------------------------------------------------------------------------
# predicted against measured
# ---------------------------------------------------------------------------------------------------------
# ---------------------------------------------------------------------------------------------------------
# predicted against measured, device time and eager time, as the calibration record prices them
# ---------------------------------------------------------------------------------------------------------
#: The two ways the sweep timed a call: the CUDA-graph replay (device time) and the event-timed eager call,
#: each with the accuracy classes of :data:`sparseattn.roofline.calibrate.SWEEP_TIMINGS` it summarises.
TIMINGS = {"device": "crossover sweep: device (all)", "eager": "crossover sweep: eager (all)"}
_PASS_MARK = {"fwd": "circle", "bwd": "square", "decode": "diamond"}


def sweep_points(cal: dict) -> List[dict]:
    """The crossover sweep's evaluation points as the calibration record (``load_record(...)["calibration"]``)
    prices them, each with ``"timing"``: ``"device"`` for a CUDA-graph replay (a prefill row's ``device_ms``,
    decode from a graph, cuDNN's decode) or ``"eager"`` for an event-timed call, by the record's own accuracy
    classes; repeats of fitted points and the routing rows (not rebuilt on the CPU) are not in it."""
    classes = calibrate.CLASSES
    keys = {t: {k for c in calibrate.SWEEP_TIMINGS[name] for k in classes[c]} for t, name in TIMINGS.items()}
    out = []
    for p in cal["points"]:
        if p["role"] != "evaluation" or not p["id"].startswith(calibrate.EVALUATION_FILES):
            continue
        key = calibrate._class_key(p)
        timing = next((t for t, ks in keys.items() if key in ks), None)
        if timing is None:
            raise LookupError(f"sweep point {p['id']} ({key}) is in no timing class of the record")
        out.append({**p, "timing": timing})
    if not out:
        raise LookupError("the calibration record has no evaluation point of the crossover sweep")
    return out


def _pass_of(p: dict) -> str:
    return "decode" if p["pass"].startswith("decode") else p["pass"]


def run_caption(doc: BenchFile, sep: str = "; ") -> str:
    """The file's caption and, for a file whose parts ran at different times (the crossover sweep), when each
    part ran (``meta.parts.<part>.date``), joined by ``sep``."""
    parts = {k: m["date"] for k, m in doc.meta.get("parts", {}).items() if m.get("date")}
    if len(set(parts.values())) < 2:
        return doc.caption()
    when = ", ".join(f"{k} {d[:10]} {d[11:16]}" for k, d in sorted(parts.items(), key=lambda kv: kv[1],
                                                                    reverse=True))
    return f"{doc.caption()}{sep}parts: {when} UTC"


def _part_caption(doc: BenchFile, part: str) -> str:
    """Where and when one part of a multi-part file ran (its own date), else the file's caption."""
    m = doc.meta.get("parts", {}).get(part)
    if not m or not m.get("date"):
        return doc.caption()
    d = m["date"]
    return (f"measured on {m.get('device', doc.meta['device'])}, {d[:10]} {d[11:16]} UTC ({part} part), "
            f"torch {m.get('torch', doc.meta['torch'])}, triton {m.get('triton', doc.meta['triton'])}")


def _hung_title(text: str, height: int) -> dict:
    """A title hung from the top of a figure ``height`` px tall: more title lines grow down into the top
    margin, not into the panels' own titles."""
    return dict(text=text, yref="container", y=1 - 24 / height, yanchor="top")


def timing_scatter(points: List[dict], caption: str = "") -> go.Figure:
    """Predicted against measured ms of :func:`sweep_points`, two panels: device time (left) and eager time
    (right); one colour per implementation, one marker per pass, y = x and the +-25% band; each panel's title
    gives its share within 25% and its median ratio."""
    panels = list(TIMINGS)
    summ = {t: ratio_summary([p["ratio"] for p in points if p["timing"] == t]) for t in panels}
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.1, subplot_titles=[
        f"{t} time: {summ[t]['n']} points, {summ[t]['within_25pct']:.0%} within 25%, median "
        f"{summ[t]['median']:.2f}" for t in panels])
    v = [p[k] for p in points for k in ("measured_ms", "predicted_ms")]
    lo, hi = min(v) / 1.3, max(v) * 1.3
    seen = set()
    for col, t in enumerate(panels, 1):
        for impl, pass_ in sorted({(p["impl"], _pass_of(p)) for p in points if p["timing"] == t}):
            ps = [p for p in points if p["timing"] == t and (p["impl"], _pass_of(p)) == (impl, pass_)]
            name = f"{impl} {pass_}"
            fig.add_trace(go.Scatter(x=[p["measured_ms"] for p in ps], y=[p["predicted_ms"] for p in ps],
                                     mode="markers", name=name, legendgroup=name, showlegend=name not in seen,
                                     marker=dict(color=COLORS.get(impl, "#7f7f7f"), size=6, opacity=0.75,
                                                 symbol=_PASS_MARK.get(pass_, "circle")),
                                     text=[p["label"] for p in ps],
                                     hovertemplate="%{text}: measured %{x:.3g} ms, predicted %{y:.3g} ms"
                                                   "<extra></extra>"), row=1, col=col)
            seen.add(name)
        for f, name, dash in ((1.0, "predicted = measured", "solid"), (1.25, "+-25%", "dot"), (0.75, None, "dot")):
            fig.add_trace(go.Scatter(x=[lo, hi], y=[lo * f, hi * f], mode="lines", name=name, legendgroup=str(f),
                                     showlegend=name is not None and col == 1, hoverinfo="skip",
                                     line=dict(color="gray", dash=dash, width=1)), row=1, col=col)
        fig.update_xaxes(type="log", range=[math.log10(lo), math.log10(hi)], title_text="measured ms (median)",
                         row=1, col=col)
        fig.update_yaxes(type="log", range=[math.log10(lo), math.log10(hi)], row=1, col=col)
    fig.update_yaxes(title_text="predicted ms (cost model, fitted elsewhere)", row=1, col=1)
    fig.update_yaxes(title_text="predicted ms", row=1, col=2)
    extra = 20 * caption.count("<br>")  # a caption of several lines: more room above, the same plot below
    fig.update_layout(height=580 + extra, title_font_size=12,
                      legend=dict(orientation="h", y=-0.22, font=dict(size=10)),
                      title=_hung_title(f"Predicted vs measured on the crossover sweep<br><sup>left: the call "
                                        f"replayed from a CUDA graph (no host work)<br>right: the eager call, "
                                        f"event-timed<br>{caption}</sup>", 580 + extra),
                      margin=dict(t=170 + extra))  # 4+ title lines over the panels' titles
    fig.update_annotations(font_size=11)
    return tidy_log(fig)


def timing_ratio_figure(points: List[dict], caption: str = "") -> go.Figure:
    """Predicted / measured of :func:`sweep_points` against the length N, device time (left) and eager time
    (right), one colour per implementation, with the +-25% band: where the eager points scatter. Each panel
    has its own ratio axis (the eager panel's spread would flatten the device panel's)."""
    fig = make_subplots(rows=1, cols=2, horizontal_spacing=0.08, subplot_titles=[f"{t} time" for t in TIMINGS])
    seen = set()
    for col, t in enumerate(TIMINGS, 1):
        for impl in sorted({p["impl"] for p in points if p["timing"] == t}):
            ps = [p for p in points if p["timing"] == t and p["impl"] == impl]
            fig.add_trace(go.Scatter(x=[p["N"] for p in ps], y=[p["ratio"] for p in ps], mode="markers",
                                     name=impl, legendgroup=impl, showlegend=impl not in seen,
                                     marker=dict(color=COLORS.get(impl, "#7f7f7f"), size=6, opacity=0.7,
                                                 symbol=[_PASS_MARK.get(_pass_of(p), "circle") for p in ps]),
                                     text=[p["label"] for p in ps],
                                     hovertemplate="%{text}: ratio %{y:.2f}<extra></extra>"), row=1, col=col)
            seen.add(impl)
        fig.add_hrect(y0=0.75, y1=1.25, fillcolor="gray", opacity=0.12, line_width=0, row=1, col=col)
    for col, t in enumerate(TIMINGS, 1):  # each panel's own lengths: a log axis never runs past its data
        ns = [p["N"] for p in points if p["timing"] == t]
        fig.update_xaxes(type="log", title_text="sequence length N (tokens)", row=1, col=col,
                         range=[math.log10(min(ns)) - 0.05, math.log10(max(ns)) + 0.05])
    for col, t in enumerate(TIMINGS, 1):  # each panel's own ratios, the +-25% band always in view
        ys = [p["ratio"] for p in points if p["timing"] == t]
        fig.update_yaxes(type="log", title_text="predicted / measured", row=1, col=col,
                         range=[math.log10(min(min(ys), 0.7) / 1.1), math.log10(max(max(ys), 1.3) * 1.1)])
    extra = 20 * caption.count("<br>")  # a caption of several lines: more room above, the same plot below
    fig.update_layout(height=440 + extra, title_font_size=12, legend=dict(orientation="h", y=-0.25),
                      title=_hung_title(f"Predicted / measured against N (band: +-25%)<br><sup>circles "
                                        f"forward, squares backward, diamonds decode<br>{caption}</sup>",
                                        440 + extra),
                      margin=dict(t=120 + extra))
    return tidy_log(fig)


def accuracy_table(acc: dict, caption: str = "") -> Table:
    """Predicted / measured on the crossover sweep per accuracy class of the calibration record
    (``record["calibration"]["accuracy"]``): n, median, p10, p90 and the share within 25%, for each class,
    the two timings and the whole sweep, then the sweep below and from N = 8k by timing."""
    names = [(c, acc["classes"][c]) for c in calibrate.CROSSOVER_CLASSES]
    names += [(n, acc[n]) for n in calibrate.SWEEP_TIMINGS] + [("crossover sweep (all)", acc["crossover sweep (all)"])]
    series = acc["sweep_series"]
    names += [(f"crossover sweep: {n}", series[n]) for n in ("N < 8k, device", "N < 8k, eager", "N >= 8k, device",
                                                             "N >= 8k, eager")]
    rows = [[n, d["n"], f"{d['median']:.2f}", f"{d['p10']:.2f}", f"{d['p90']:.2f}", f"{d['within_25pct']:.0%}"]
            for n, d in names if d["n"]]
    return Table(["class", "n", "median", "p10", "p90", "within 25%"], rows,
                 caption=caption or "Predicted / measured on the crossover sweep, per accuracy class")


def host_table(doc: BenchFile) -> Table:
    """The host time of one eager call of each op, as each prefill part of the crossover run measured it before
    its sweep (``meta.parts.<part>.host_ms``, on the part's ``host_probe`` layout, on its ``host_path``)."""
    parts = doc.meta.get("parts", {})
    rows = []
    for part in ("fwd", "bwd"):
        m = parts.get(part, {})
        for op, ms in sorted(m.get("host_ms", {}).items()):
            probe = m.get("host_probe", {})
            rows.append([part, op.split("/")[0], f"{ms * 1e3:.0f}", f"{probe.get('pattern')} N={probe.get('N')}",
                         m.get("host_path", ""), m.get("date", "")[:16].replace("T", " ")])
    if not rows:
        raise LookupError(f"{doc.suite!r} records no host_ms in its parts (recorded before the host probe)")
    return Table(["part", "implementation", "host us per call", "probe", "host path", "measured (UTC)"], rows,
                 caption=f"Host time per eager call, measured at the start of each part of the crossover run "
                         f"(wall time per call of back-to-back calls, not waiting for the device). "
                         f"{doc.caption()}")


def length_brackets(doc: BenchFile, timing: str = "eager") -> List[dict]:
    """For each length family (window, sinks + window) and prefill pass of the crossover run: where ours and
    FlexAttention pass cuDNN on the envelope, bracketed by two measured lengths
    (:func:`~sparseattn.roofline.crossover.bracket`), on the lengths all three were measured at, timed
    ``"eager"`` (``ms``) or on ``"device"`` time (``device_ms``, the CUDA-graph replay).
    ``[{"family", "pattern", "pass", "timing", "N", "ours", "flex"}]``."""
    check_timing(timing)

    def ms(r):
        return r.time(timing)

    out = []
    for fam in ("window", "sinks_window"):
        for pass_ in (Pass.FWD, Pass.BWD):
            rows = {i: {r.case["N"]: r for r in doc.select(i, pass_, family=fam) if ms(r) is not None}
                    for i in (Impl.OURS, Impl.FLEX)}
            if not rows[Impl.OURS]:
                continue
            env = next(iter(rows[Impl.OURS].values())).case["envelope"]
            cud = {r.case["N"]: r for r in doc.select(Impl.CUDNN, pass_, pattern=env) if ms(r) is not None}
            Ns = sorted(set(rows[Impl.OURS]) & set(rows[Impl.FLEX]) & set(cud))
            if len(Ns) < 2:
                continue
            b = {i: bracket(Ns, [ms(rows[i][n]) for n in Ns], [ms(cud[n]) for n in Ns], "N") for i in rows}
            out.append({"family": fam, "pattern": next(iter(rows[Impl.OURS].values())).case["pattern"],
                        "pass": pass_, "timing": timing, "N": Ns, "ours": b[Impl.OURS], "flex": b[Impl.FLEX]})
    if not out:
        raise LookupError(f"no length family of {doc.suite!r} has ours, FlexAttention and cuDNN {timing} times")
    return out


# ---------------------------------------------------------------------------------------------------------
# crossover curves
# ---------------------------------------------------------------------------------------------------------
def _entry(doc: BenchFile, family: str, pass_: str, N: Optional[int] = None) -> dict:
    entries = [e for e in measured_crossovers(doc) if e["family"] == family and e["pass"] == pass_
               and (N is None or e["N"] == N)]
    if not entries:
        have = sorted({(e["family"], e["pass"], e["N"]) for e in measured_crossovers(doc)}, key=str)
        raise LookupError(f"no crossover data for {family} {pass_} N={N}; have {have}")
    return entries[0]


def crossover_figure(doc: BenchFile, family: str, pass_: str, N: Optional[int] = None) -> go.Figure:
    """Speedup over cuDNN on the envelope (cuDNN ms / ms) along the family's grid: ours and FlexAttention
    measured, ours predicted; sparse wins above 1. The interpolated crossovers are marked."""
    e = _entry(doc, family, pass_, N)
    x = e["grid"]
    fig = go.Figure()
    series = [("ours, measured", e["ours_ms"], e["cudnn_ms"], COLORS[Impl.OURS], "solid"),
              ("FlexAttention, measured", e["flex_ms"], e["cudnn_ms"], COLORS[Impl.FLEX], "solid"),
              ("ours, predicted", e["ours_predicted_ms"], e["cudnn_predicted_ms"], COLORS[Impl.OURS], "dot")]
    if e.get("step_ms"):
        series.append(("ours, select + decode", e["step_ms"], e["cudnn_ms"], "#ff9896", "solid"))
    ys = []
    for name, num, den, color, dash in series:
        pts = [(g, d / m) for g, m, d in zip(x, num, den) if m and d]
        if not pts:
            continue
        ys += [p[1] for p in pts]
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                 line=dict(color=color, dash=dash)))
    fig.add_hline(y=1.0, line_color="black", line_width=1)
    for key, color in (("ours", COLORS[Impl.OURS]), ("flex", COLORS[Impl.FLEX])):
        b = e[f"{key}_bracket"]
        if b["state"] == "crosses":  # shaded between the two measured points around the crossing
            fig.add_vrect(x0=b["lo"], x1=b["hi"], fillcolor=color, opacity=0.08, line_width=0)
    what = {"N": "sequence length N (tokens)", "keep": "kept fraction of the envelope's cells" if family != "decode"
            else "kept fraction of the cache's bytes"}[e["variable"]]
    where = "" if e["N"] is None else (f", B={e['B']}, L={e['N']}" if e["B"] else f", N={e['N']}")
    v = e["variable"]
    fig.update_layout(xaxis_type="log", yaxis_type="log", height=450, title_font_size=12, xaxis_title=what,
                      yaxis_title=f"speedup over {e['envelope']} cuDNN", legend=dict(font=dict(size=10)),
                      title=f"{e['pattern']}{'' if e['pattern'] == pass_ else ' ' + pass_}{where}, eager "
                            f"calls<br><sup>crossover: ours "
                            f"{_bfmt(e['ours_bracket'], v)}, "
                            f"FlexAttention {_bfmt(e['flex_bracket'], v)}<br>predicted (ours) "
                            f"{_fmt(e['ours_predicted'])}<br>{_part_caption(doc, pass_)}</sup>")
    fig.update_xaxes(range=[math.log10(min(x)) - 0.05, math.log10(max(x)) + 0.05])
    fig.update_yaxes(range=[math.log10(min(ys + [1.0]) / 1.3), math.log10(max(ys + [1.0]) * 1.3)])
    return tidy_log(fig)


def _fmt(vs) -> str:
    value, state = vs
    if value is None:
        return state
    return f"~{value:.3g}" if value < 1 else f"~{value:.0f}"


def _bfmt(b: dict, variable: str) -> str:
    return b["state"] if b["state"] == "not measured" else describe_bracket(b, variable)


def crossover_table(doc: BenchFile) -> Table:
    """Every family and pass: the measured crossovers of ours and FlexAttention, bracketed by grid points ("not
    enough points (n=1)" for a curve of one point), and the predicted one of ours (a length: sparse faster
    above it; a kept fraction: faster below it), as an HTML :class:`Table`."""
    es = measured_crossovers(doc)
    rows = [[e["pattern"], e["pass"],
             "all N" if e["N"] is None else (f"B={e['B']}, L={e['N']}" if e["B"] else f"N={e['N']}"),
             e["variable"], _bfmt(e["ours_bracket"], e["variable"]), _bfmt(e["flex_bracket"], e["variable"]),
             _fmt(e["ours_predicted"])] for e in es]
    return Table(["family", "pass", "at", "varies", "ours (measured)", "FlexAttention (measured)",
                  "ours (predicted)"], rows,
                 caption=f"Crossover against cuDNN on the envelope: measured ones (eager calls) between the two "
                         f"grid points around them (one median per point), the model's interpolated "
                         f"({run_caption(doc)})")


# ---------------------------------------------------------------------------------------------------------
# where the model fails
# ---------------------------------------------------------------------------------------------------------
def worst_points(doc: BenchFile, k: int = 10, exclude=()) -> List[dict]:
    """The ``k`` rows farthest from their prediction (largest |log(predicted / measured)|), worst first."""
    return sorted(prediction_ratios(doc, exclude), key=lambda r: -abs(math.log(r["ratio"])))[:k]


def tail_points(family: str = "window", pass_: str = "fwd", grid=(1024, 2048, 4096, 8192, 16384, 65536),
                **params) -> List[dict]:
    """Along a length family, the share of our predicted time that is the last wave's tail, the program
    prologues and the launch (cost model): what short sequences pay beyond their tiles."""
    out = []
    for N in grid:
        lay = family_layout(family, N, **params)[0]
        c = cost(lay, PREFILL_SHAPE, pass_)
        tail = sum(k["tail_ms"] for k in c.kernels)
        balanced = sum(k["balanced_ms"] for k in c.kernels)
        out.append({"N": N, "predicted_ms": c.predicted_ms, "tail_ms": tail, "launch_ms": c.t_launch_ms,
                    "balanced_ms": balanced, "programs": sum(k["programs"] for k in c.kernels),
                    "tail_share": tail / c.predicted_ms, "launch_share": c.t_launch_ms / c.predicted_ms})
    return out


def tail_figure(points: List[dict], title: str = "") -> go.Figure:
    """Launch and last-wave tail as shares of the predicted time, against N."""
    fig = go.Figure()
    for key, name, color in (("launch_share", "launch and host excess", "#7f7f7f"),
                             ("tail_share", "last-wave tail (SMs idle while the longest programs finish)", "#ff7f0e")):
        fig.add_trace(go.Scatter(x=[p["N"] for p in points], y=[p[key] for p in points], mode="lines+markers",
                                 name=name, line=dict(color=color)))
    fig.update_layout(xaxis_type="log", height=380, title_font_size=12, yaxis_tickformat=".0%",
                      xaxis_title="sequence length N (tokens)", yaxis_title="share of our predicted time",
                      title=title or "What short sequences pay beyond their tiles (cost model, H200)",
                      legend=dict(orientation="h", y=-0.3))
    fig.update_xaxes(range=[math.log10(points[0]["N"]) - 0.05, math.log10(points[-1]["N"]) + 0.05])
    return tidy_log(fig)


# ---------------------------------------------------------------------------------------------------------
# profiles
# ---------------------------------------------------------------------------------------------------------
def profile_figure(profiles: Dict[str, dict], title: str = "") -> go.Figure:
    """Stacked bars of route / index / kernel / launch per profiled step (``StepProfile.as_dict()`` entries,
    as the crossover suite records them under ``profiles``)."""
    if not profiles:
        raise LookupError("no profiles to draw")
    names = list(profiles)
    fig = go.Figure()
    for bucket, color in (("kernel", COLORS[Impl.OURS]), ("index", "#9467bd"), ("route", "#17becf"),
                          ("launch", "#7f7f7f")):
        # "launch" is recorded as the wall time the device ran nothing: host work, launch gaps and syncs
        label = "host / idle" if bucket == "launch" else bucket
        fig.add_trace(go.Bar(y=names, x=[profiles[n]["buckets"][bucket] for n in names], name=label,
                             orientation="h", marker_color=color,
                             hovertemplate=f"{label}: %{{x:.3g}} ms<extra></extra>"))
    fig.update_layout(barmode="stack", height=160 + 80 * len(names), title_font_size=12,
                      xaxis_title="ms of the step (wall)", yaxis_title="profiled step", title=title,
                      legend=dict(orientation="h", y=-0.35))
    return fig


# ---------------------------------------------------------------------------------------------------------
# the kernel-free explorer: pattern, N, density, dtype -> the model's terms and verdict
# ---------------------------------------------------------------------------------------------------------
#: The explorer's patterns -> how a density picks the pattern's parameter
EXPLORER_FAMILIES = ("window", "sinks_window", "block_random", "documents")


def explorer_layout(family: str, N: int, density: float):
    """The layout of an explorer setting: windows of ``density * N / 2`` tokens (about ``density`` of the causal
    triangle), block-random tiles with probability ``density``, ``1 / density`` equal documents."""
    if family in ("window", "sinks_window"):
        w = max(1, round(density * N / 2))
        params = {"window": w} if family == "window" else {"window": w, "sinks": 64}
        return family_layout(family, N, **params)[0]
    return family_layout(family, density, N=N)[0]


def _trust(accuracy: Optional[Dict[str, dict]], N: int) -> str:
    if not accuracy:
        return ""
    band, a = ("N < 8k", accuracy["short"]) if N < 8192 else ("N >= 8k", accuracy["long"])
    return (f"<br>model on the recorded H200 sweep at {band}: {a['within_25pct']:.0%} of {a['n']} rows within "
            f"25%, median predicted / measured {a['median']:.2f}")


def terms_figure(family: str = "sinks_window", N: int = 16384, density: float = 0.1, dtype: str = "bf16",
                 pass_: str = "fwd", accuracy: Optional[Dict[str, dict]] = None) -> go.Figure:
    """The model's terms (compute, memory, launch; index only when a layout is rebuilt per call, never here)
    for ours, FlexAttention and cuDNN on the envelope, and the verdict of :func:`~sparseattn.roofline.report`,
    for one setting (B=1, 16 heads, D=128).
    ``accuracy``: ``{"short": summary, "long": summary}`` of :func:`~sparseattn.bench.crossover.ratio_summary`
    over the recorded sweep's rows below and from N = 8192; the title then shows the one for this N below the
    verdict, so a reader sees how far to trust it."""
    lay = explorer_layout(family, N, density)
    s = Shape(B=1, Hq=16, D=128, dtype=dtype)
    r = report(lay, s, pass_=pass_)
    fig = go.Figure()
    impls = ["sparseattn", "flex", "cudnn"]
    # the bars are terms, the implementations are on the x axis: colours outside COLORS, so that no term
    # reads as an implementation (red is ours, blue FlexAttention everywhere else)
    for term, color in (("compute", "#ff7f0e"), ("memory", "#17becf"), ("launch", "#bcbd22"), ("index", "#393b79")):
        ys = [r.costs[i].terms[term] for i in impls]
        if term == "index" and not any(ys):  # the layout is built once here, not per call: no bar of zeros
            continue
        fig.add_trace(go.Bar(x=impls, y=ys, name=term, marker_color=color,
                             hovertemplate=f"{term}: %{{y:.3g}} ms<extra></extra>"))
    fig.add_trace(go.Scatter(x=impls, y=[r.predicted[i] for i in impls], mode="markers", name="predicted total",
                             marker=dict(symbol="line-ew-open", size=30, color="black", line=dict(width=2))))
    fig.update_layout(barmode="group", height=470, margin=dict(t=135), title_font_size=12,
                      yaxis_title="ms (cost model, H200)",
                      xaxis_title="implementation",
                      # the verdict on a line of its own: a "tie" verdict alone is ~110 characters
                      title=f"{family}, N={N}, density {density:g}, {dtype}, {pass_}<br><sup>envelope: "
                            f"{r.envelope} cuDNN; our dominant term: {r.dominant}<br>{r.verdict}"
                            f"{_trust(accuracy, N)}</sup>",
                      legend=dict(orientation="h", y=-0.2))
    return fig
