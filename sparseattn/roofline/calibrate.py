"""Calibrate the cost model on recorded runs, and measure its accuracy on runs it was not fitted to.

The recorded points are the rows of the repository's H200 bench files (``book/data/bench/*-h200.json``) that
the model prices: our forward and backward (deterministic, atomic), FlexAttention's and cuDNN's, our decode
(CUDA-graph replay and eager) and cuDNN's decode, and the layout builds. Each row's layout is rebuilt on the
CPU exactly as the bench built it (:data:`RECORDED_PATTERNS`; the reconstruction is checked against the tile
counts and byte counts the rows carry).

Calibration and evaluation points are disjoint, by a fixed rule per model (:func:`role_of`):

* prefill forward and backward, ours and FlexAttention: fitted on the ``causal`` and ``window1024`` layouts,
  evaluated on ``sinks64+window1024`` and ``random10%+diag`` (layouts the fit never saw);
* cuDNN forward: fitted at N = 4k, 16k, 64k, evaluated at 8k and 32k; cuDNN backward: fitted on dense,
  evaluated on causal;
* our decode: fitted on batch 8 and 32 (decode_keep), evaluated on batch 1 and on the separate decode suite;
  cuDNN decode: fitted on decode_keep, evaluated on the decode suite;
* layout build / transpose: fitted at N = 32k, evaluated at 131k.

Parameters the calibration points cannot identify are tied to another model's (``tied`` in the record).
The fit minimises the mean squared log ratio predicted/measured over the calibration points (Nelder-Mead).

Run ``python -m sparseattn.roofline calibrate`` to refit and rewrite ``sparseattn/data/ceilings-h200.json``.
"""
from __future__ import annotations

import datetime
import functools
import json
import math
import pathlib
import re
import textwrap
from dataclasses import dataclass, field
from typing import Callable, Dict, Iterable, List, Optional, Set

import numpy as np
import torch

from ..layout import BlockLayout
from ..ops import BwdConfig
from .cases import PREFILL_PATTERNS, TABLE_PATTERNS, layout_mask_mod, prefill_layout
from .ceilings import Ceilings, load_record, record_path
from . import host as H
from .counts import Shape
from .model import IMPLS, evaluated_cells_of, model_params, predict, work_of

__all__ = ["RECORDED_PATTERNS", "Point", "load_points", "role_of", "calibrate", "evaluate", "accuracy",
           "summary_table", "failures_table", "sync_docstring", "run", "BENCH_DIR", "FILES", "EVALUATION_FILES"]

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "book" / "data" / "bench"
CALIBRATION_PATTERNS = ("causal", "window1024")


# ---- the recorded layouts ---------------------------------------------------------------------------------------
#: The prefill patterns of the recorded runs, by their recorded names -> ``N -> BlockLayout`` (128 tiles, CPU),
#: built by the same code as the suites (:mod:`.cases`); each rebuilt layout is checked against the tile
#: count its row recorded (:func:`point_work`).
RECORDED_PATTERNS: Dict[str, Callable[[int], BlockLayout]] = {
    name: functools.partial(prefill_layout, name, block=128, device="cpu")
    for name in ["dense"] + PREFILL_PATTERNS + TABLE_PATTERNS}


def _layout_build_mask(name: str, N: int):
    """The layout suite's mask_mods (documents: 32 sorted random ids, drawn here with a seeded CPU generator;
    the suite drew them on the GPU from the same distribution, and only the number of undecided tiles
    matters)."""
    return layout_mask_mod(name, N, device="cpu", generator=torch.Generator().manual_seed(0))


# ---- points ----------------------------------------------------------------------------------------------------
@dataclass
class Point:
    """One recorded timing the model prices."""

    id: str
    group: str  # model key: "sparseattn/fwd", "sparseattn/bwd-atomic", "cudnn/decode", "index/layout", ...
    impl: str
    pass_: str  # "fwd" | "bwd" | "decode" | "layout" | "transpose"
    pattern: str
    N: int
    ms: float
    graph: bool = False
    case: dict = field(default_factory=dict)
    row: dict = field(default_factory=dict)
    role: str = ""
    host_path: Optional[str] = None  # the host path its run used (None: :data:`.host.RECORDED_PATH`)
    host_ms: Optional[float] = None  # the host time its run measured for its op and pass (crossover parts)

    def label(self) -> str:
        extra = (" graph" if self.graph else "") if self.pass_ != "decode" else \
            f" B={self.case.get('B')} ps={self.case.get('page_size')}" + (" graph" if self.graph else " eager")
        source = " (crossover)" if self.id.startswith(EVALUATION_FILES) else ""
        return f"{self.impl} {self.pass_} {self.pattern} N={self.N}{extra}{source}"


_GROUPS = {
    ("sparseattn", "fwd"): "sparseattn/fwd", ("flex", "fwd"): "flex/fwd", ("cudnn", "fwd"): "cudnn/fwd",
    ("sparseattn", "bwd"): "sparseattn/bwd", ("sparseattn-nosplit", "bwd"): "sparseattn/bwd",
    ("sparseattn-atomic", "bwd"): "sparseattn/bwd-atomic", ("flex", "bwd"): "flex/bwd",
    ("cudnn", "bwd"): "cudnn/bwd",
    ("sparseattn", "decode (CUDA graph)"): "sparseattn/decode", ("sparseattn", "decode"): "sparseattn/decode",
    ("cudnn", "decode dense"): "cudnn/decode",
    ("sparseattn", "layout"): "index/layout", ("sparseattn", "transpose"): "index/transpose",
}
#: The bench files the calibration reads (the main runs; sweep and re-check files repeat these points). The
#: decode runs the packaged record was fitted on were later re-recorded (a read ceiling); the fit keeps reading
#: the runs it was made from. The prefill and backward suites were re-recorded on 2026-12-02 with the kernels
#: as they are (the runs before: ``checks/{prefill,backward}-2026-11-29-h200.json``, whose backward rows of ours
#: predated TMA and were replaced in the fit by the ``versus`` suite's rows until then). The layout build is
#: fitted on the current layout suite (its kernels changed).
FILES = ("prefill-h200.json", "backward-h200.json", "decode_keep-h200.json", "decode-sweep-h200.json",
         "layout-h200.json")
#: The host path of each file recorded after the cached launch (the others ran :data:`.host.RECORDED_PATH`):
#: its eager points are priced with that path's host term.
FILE_HOST_PATHS = {"prefill-h200.json": "fast-launch", "backward-h200.json": "fast-launch"}
#: Files whose points only ever evaluate the model, read when present: the crossover sweep
#: (``python -m sparseattn.bench crossover``), recorded after the fit.
EVALUATION_FILES = ("crossover-h200.json",)


def _points_of(fname: str, i: int, r: dict) -> List[Point]:
    """The points of one recorded row: its event-timed ``ms`` and, for a prefill row that carries one, its
    CUDA-graph replay ``device_ms`` (id ``...#i:graph``: the device time alone, no host work)."""
    p = _point_of(fname, i, r)
    if p is None:
        return []
    out = [p]
    if p.pass_ in ("fwd", "bwd") and r.get("device_ms"):
        out.append(Point(id=f"{p.id}:graph", group=p.group, impl=p.impl, pass_=p.pass_, pattern=p.pattern, N=p.N,
                         ms=float(r["device_ms"]), graph=True, case=p.case, row=r))
    return out


def _point_of(fname: str, i: int, r: dict) -> Optional[Point]:
    key = (r["impl"], r["pass"])
    if key not in _GROUPS or r.get("ms") is None or r.get("sweep") or r.get("config"):
        return None
    c = r["case"]
    if c.get("family") == "routing":  # a routed layout cannot be rebuilt on the CPU
        return None
    pass_ = {"decode (CUDA graph)": "decode", "decode": "decode", "decode dense": "decode"}.get(r["pass"], r["pass"])
    return Point(id=f"{fname}#{i}", group=_GROUPS[key], impl=r["impl"], pass_=pass_, pattern=c["pattern"],
                 N=int(c["N"]), ms=float(r["ms"]), graph=r["pass"] == "decode (CUDA graph)", case=c, row=r)


def load_points(bench_dir=None, docs: Optional[Dict[str, dict]] = None) -> List[Point]:
    """Every row of the recorded files that the model prices, with its role: ``"calibration"`` or
    ``"evaluation"`` by :func:`role_of` for :data:`FILES`; ``"evaluation"`` for the points of
    :data:`EVALUATION_FILES` (when present), except ``"repeat"`` for one that re-measures the layout and
    shape of a calibration point (left out of the accuracy, so evaluation stays disjoint from the fit).
    ``docs``: the files' JSON documents by file name, instead of reading them from ``bench_dir``."""
    bench_dir = pathlib.Path(bench_dir) if bench_dir is not None else BENCH_DIR

    def doc_of(fname):
        if docs is not None:
            return docs.get(fname)
        path = bench_dir / fname
        return json.loads(path.read_text()) if path.exists() or fname in FILES else None

    points = []
    for fname in FILES:
        doc = doc_of(fname)
        if doc is None:
            raise FileNotFoundError(f"the calibration needs {fname} (docs has {sorted(docs or {})})")
        for i, r in enumerate(doc["results"]):
            for p in _points_of(fname, i, r):
                p.role = role_of(p)
                p.host_path = FILE_HOST_PATHS.get(fname)
                points.append(p)
    points += host_suite_device_points(bench_dir, docs)
    sweep_points = []
    for fname in EVALUATION_FILES:
        doc = doc_of(fname)
        if doc is None:
            continue
        parts = doc.get("parts", {})
        for i, r in enumerate(doc["results"]):
            for p in _points_of(fname, i, r):
                # the host path the row's part ran (recorded since the cached launch; before it, every run
                # bound its launches through Triton), and the host time the part measured for the row's op
                part = parts.get(r.get("part"), {})
                p.host_path = part.get("host_path")
                p.host_ms = part.get("host_ms", {}).get(f"{r['impl']}/{p.pass_}")
                sweep_points.append(p)
    # a host-suite device point whose call the sweep also measured is kept out of the fit (disjointness) ...
    sweep = sweep_fingerprints(sweep_points)
    for p in points:
        if p.role == "calibration" and p.id.startswith(HOST_DEVICE_PREFIX) and \
                H.fingerprint(_layout(p.pattern, p.N), p.case) in sweep:
            p.role = "repeat"
    # ... and a sweep point that re-measures a fitted layout and shape is left out of the evaluation
    fitted = {_shape_key(p) for p in points if p.role == "calibration"}
    for p in sweep_points:
        p.role = "repeat" if _shape_key(p) in fitted else "evaluation"
    return points + sweep_points


#: The id prefix of the host suites' device points (:func:`host_suite_device_points`) and their files.
HOST_DEVICE_PREFIX = "host:"
#: (the host suites of both paths as first recorded: a later host-only re-recording, such as the fast-launch
#: path's current file, prices ``T_host`` and adds no device point)
HOST_DEVICE_FILES = ("checks/host-before-delta-kernel-h200.json", "host-h200.json", "checks/host-bwd-profile-h200.json")
#: Ops whose short-end device points come only from these files: recorded with the op's current kernels
#: (our backward changed after the other host recordings).
DEVICE_CURRENT = {("sparseattn", "bwd"): ("checks/host-bwd-profile-h200.json",)}
#: Every file :func:`load_points` reads (a notebook passes them as ``docs``).
READ_FILES = FILES + EVALUATION_FILES + HOST_DEVICE_FILES


def sweep_repeats(points: Iterable) -> Set[int]:
    """Row indices of the crossover file whose event-timed point is a ``"repeat"`` (a fitted layout and
    shape measured again: left out of the accuracy)."""
    return {int(p.id.split("#")[1]) for p in points
            if p.id.startswith(EVALUATION_FILES) and not p.graph and p.role == "repeat"}


def host_suite_device_points(bench_dir=None, docs: Optional[Dict[str, dict]] = None) -> List[Point]:
    """Calibration points at the short end: the host suites' CUDA-graph replays (``device_ms``) of our
    forward and backward and FlexAttention's on the calibration layouts, N = 1k to 4k (:data:`HOST_DEVICE_FILES`).
    They pin the per-call device cost that the long-sequence points cannot separate from the per-tile rate;
    their event times are not used (host-bound). cuDNN's rows are left out: their envelopes are the sweep's
    own cuDNN points. A row whose layout and shape the sweep measured is a ``"repeat"`` (:func:`load_points`)."""
    bench_dir = pathlib.Path(bench_dir) if bench_dir is not None else BENCH_DIR
    out = []
    for fname in HOST_DEVICE_FILES:
        if docs is not None and fname not in docs:
            raise FileNotFoundError(f"the calibration needs {fname} (docs has {sorted(docs)})")
        doc = docs[fname] if docs is not None else json.loads((bench_dir / fname).read_text())
        for i, r in enumerate(doc["results"]):
            key = (r["impl"], r["pass"])
            if r["impl"] not in ("sparseattn", "flex") or key not in _GROUPS or not r.get("device_ms") \
                    or r["case"]["pattern"] not in CALIBRATION_PATTERNS \
                    or fname not in DEVICE_CURRENT.get(key, (fname,)):
                continue
            c = r["case"]
            out.append(Point(id=f"{HOST_DEVICE_PREFIX}{fname}#{i}:graph", group=_GROUPS[key], impl=r["impl"],
                             pass_=r["pass"], pattern=c["pattern"], N=int(c["N"]), ms=float(r["device_ms"]),
                             graph=True, case=c, row=r, role="calibration"))
    return out


def _canonical_pattern(p: Point) -> str:
    """The recorded name of the layout a point ran: a crossover family point that is the causal or the dense
    layout under another name (one document, a window as long as the sequence, every tile kept) says so."""
    c = p.case
    fam = c.get("family")
    if fam == "documents" and round(1 / float(c["keep"])) <= 1:
        return "causal"
    if fam in ("window", "sinks_window") and c.get("window", 0) >= p.N:
        return "causal"
    if fam == "block_random" and float(c["keep"]) >= 1.0:
        return "dense"
    return p.pattern


def _shape_key(p: Point) -> tuple:
    """What makes two points the same measurement: model, layout, length and shape."""
    c = p.case
    keep = None if c.get("family") in ("documents", "block_random") and _canonical_pattern(p) != p.pattern \
        else c.get("keep")
    return (p.group, p.graph, _canonical_pattern(p), p.N, c.get("B"), c.get("H", c.get("Hq")), c.get("Hkv"),
            c.get("D"), c.get("dtype"), c.get("page_size"), keep)


def role_of(p: Point) -> str:
    """``"calibration"`` or ``"evaluation"`` by the fixed rule of the module docstring."""
    g = p.group
    if p.id.startswith(HOST_DEVICE_PREFIX):
        ok = True  # the short-end device points (sweep repeats are set apart by load_points)
    elif g in ("sparseattn/fwd", "flex/fwd", "sparseattn/bwd", "sparseattn/bwd-atomic", "flex/bwd"):
        ok = p.pattern in CALIBRATION_PATTERNS and p.impl != "sparseattn-nosplit"
    elif g == "cudnn/fwd":
        ok = p.N in (4096, 16384, 65536)
    elif g == "cudnn/bwd":
        ok = p.pattern == "dense"
    elif g == "sparseattn/decode":
        ok = p.id.startswith("decode_keep") and p.case["B"] in (8, 32)
    elif g == "cudnn/decode":
        ok = p.id.startswith("decode_keep")
    elif g in ("index/layout", "index/transpose"):
        ok = p.N == 32768
    else:
        raise ValueError(f"no split rule for group {g!r}")
    return "calibration" if ok else "evaluation"


# ---- each point's work -------------------------------------------------------------------------------------------
_LAYOUTS: Dict[tuple, BlockLayout] = {}


def _layout(pattern: str, N: int) -> BlockLayout:
    if (pattern, N) not in _LAYOUTS:
        _LAYOUTS[(pattern, N)] = RECORDED_PATTERNS[pattern](N)
    return _LAYOUTS[(pattern, N)]


def _family_layout(case: dict) -> BlockLayout:
    """A crossover-suite point's layout, rebuilt from its family and parameters."""
    from .crossover import family_layout
    key = ("family", case["family"], case.get("keep"), case["N"], case.get("window"), case.get("sinks"))
    if key not in _LAYOUTS:
        x = case["N"] if case.get("keep") is None else case["keep"]
        params = {k: case[k] for k in ("window", "sinks") if k in case}
        _LAYOUTS[key] = family_layout(case["family"], x, N=case["N"], **params)[0]
    return _LAYOUTS[key]


def _keep_of(pattern: str) -> Optional[float]:
    m = re.fullmatch(r"keep([0-9.]+)", pattern)
    return float(m.group(1)) if m else None


def point_work(p: Point, ceil: Ceilings):
    """The Work of a recorded point (checked against the tile and byte counts its row recorded); None for a
    layout build or transpose."""
    c = p.case
    if p.pass_ in ("layout", "transpose"):
        return None
    impl = "sparseattn" if p.impl.startswith("sparseattn") else p.impl
    if p.pass_ == "decode":
        s = Shape(B=c["B"], Hq=c["Hq"], Hkv=c["Hkv"], D=c["D"], dtype=c["dtype"], seq_len=p.N,
                  page_size=c["page_size"])
        keep = None if impl == "cudnn" else c.get("keep", _keep_of(p.pattern))  # cuDNN reads the whole cache
        work = work_of(None, s, "decode", keep=keep, impl="sparseattn", device=ceil)
        if "bytes" in p.row and impl == "sparseattn":
            got = work.kernels[0].hbm["kv"]
            if abs(got - p.row["bytes"]) > 1e-6 * p.row["bytes"]:
                raise AssertionError(f"{p.label()}: rebuilt decode reads {got:.0f} bytes, the row says {p.row['bytes']}")
        return work
    layout = _layout(p.pattern, p.N) if "family" not in c else _family_layout(c)
    if "tiles" in c:
        tiles = int(layout.kv_count.sum() + layout.full_count.sum())
        if tiles != c["tiles"]:
            raise AssertionError(f"{p.label()}: rebuilt layout lists {tiles} tiles, the row says {c['tiles']}")
    s = Shape(B=c["B"], Hq=c["H"], Hkv=c["H"], D=c["D"], dtype=c["dtype"])
    config = None
    if p.impl == "sparseattn-nosplit":  # the suite's variant: one chunk per column
        config = BwdConfig(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=2,
                           chunk=1 << 30)
    return work_of(layout, s, p.pass_, config, deterministic=p.impl != "sparseattn-atomic", impl=impl,
                   device=ceil)


# ---- the fit -------------------------------------------------------------------------------------------------------
#: Per model: free parameters (name, start, low, high), fixed values, and parameters tied to another model's.
SPECS = {
    "sparseattn/decode": dict(free=[("eff_memory", 0.9, 0.3, 1.3), ("step_us", 1.0, 0.01, 50.0),
                                    ("program_overhead", 1.0, 0.0, 50.0), ("call_ms", 0.005, 0.0, 0.1),
                                    ("host_ms", 0.08, 0.0, 0.5)],
                              fixed={"partial_overhead": 0.0}),
    "cudnn/decode": dict(free=[("eff_memory", 0.9, 0.3, 1.3), ("call_ms", 0.01, 0.0, 0.1)],
                         fixed={"step_us": 0.0, "program_overhead": 0.0, "partial_overhead": 0.0, "host_ms": 0.0}),
    "sparseattn/fwd": dict(free=[("eff_compute", 0.6, 0.1, 1.2), ("partial_overhead", 0.5, 0.0, 5.0),
                                 ("program_overhead", 1.0, 0.0, 30.0), ("call_ms", 0.05, 0.0, 0.3)],
                           tied={"eff_memory": "sparseattn/decode:eff_memory"}),
    "flex/fwd": dict(free=[("eff_compute", 0.6, 0.1, 1.2), ("partial_overhead", 0.5, 0.0, 5.0),
                           ("program_overhead", 1.0, 0.0, 30.0), ("call_ms", 0.05, 0.0, 0.3)],
                     tied={"eff_memory": "sparseattn/decode:eff_memory"}),
    "cudnn/fwd": dict(free=[("eff_compute", 0.8, 0.1, 1.2), ("program_overhead", 1.0, 0.0, 30.0),
                            ("call_ms", 0.02, 0.0, 0.3)],
                      fixed={"partial_overhead": 0.0}, tied={"eff_memory": "sparseattn/decode:eff_memory"}),
    # the backward's per-program prologue/epilogue (K, V loads; dK, dV stores) is its own; a partial step's
    # extra mask work is taken to cost the forward's fraction (two backward points per model cannot fit both)
    # the short-end device points give the backward its own per-call cost (Δ, the two passes, the reduces)
    "sparseattn/bwd": dict(free=[("eff_compute", 0.5, 0.05, 1.2), ("program_overhead", 1.0, 0.0, 30.0),
                                 ("call_ms", 0.05, 0.0, 0.3)],
                           tied={"eff_memory": "sparseattn/decode:eff_memory",
                                 "partial_overhead": "sparseattn/fwd:partial_overhead"}),
    "sparseattn/bwd-atomic": dict(free=[("eff_compute", 0.5, 0.05, 1.2)],
                                  tied={"eff_memory": "sparseattn/decode:eff_memory",
                                        "partial_overhead": "sparseattn/fwd:partial_overhead",
                                        "program_overhead": "sparseattn/bwd:program_overhead",
                                        "call_ms": "sparseattn/bwd:call_ms"}),
    "flex/bwd": dict(free=[("eff_compute", 0.5, 0.05, 1.2), ("program_overhead", 1.0, 0.0, 30.0),
                           ("call_ms", 0.05, 0.0, 0.3)],
                     tied={"eff_memory": "sparseattn/decode:eff_memory",
                           "partial_overhead": "flex/fwd:partial_overhead"}),
    "cudnn/bwd": dict(free=[("eff_compute", 0.5, 0.05, 1.2)],
                      fixed={"partial_overhead": 0.0},
                      tied={"eff_memory": "sparseattn/decode:eff_memory", "program_overhead": "cudnn/fwd:program_overhead",
                            "call_ms": "cudnn/fwd:call_ms"}),
    "index/layout": dict(free=[("fixed_ms", 1.5, 0.0, 20.0), ("ns_per_cell", 0.02, 0.0, 10.0)]),
    "index/transpose": dict(free=[("fixed_ms", 1.0, 0.0, 20.0)]),
}
ORDER = list(SPECS)  # tied parameters always point to a model fitted earlier in this order


def _nelder_mead(f, x0: np.ndarray, scale: np.ndarray, iters: int = 600, tol: float = 1e-10) -> np.ndarray:
    """Minimise ``f`` from ``x0`` (a plain Nelder-Mead; the models have at most five parameters)."""
    n = len(x0)
    simplex = [x0] + [x0 + np.eye(n)[i] * scale[i] for i in range(n)]
    values = [f(x) for x in simplex]
    for _ in range(iters):
        order = np.argsort(values)
        simplex, values = [simplex[i] for i in order], [values[i] for i in order]
        if abs(values[-1] - values[0]) < tol:
            break
        centroid = np.mean(simplex[:-1], axis=0)
        xr = centroid + (centroid - simplex[-1])
        fr = f(xr)
        if fr < values[0]:
            xe = centroid + 2 * (centroid - simplex[-1])
            fe = f(xe)
            simplex[-1], values[-1] = (xe, fe) if fe < fr else (xr, fr)
        elif fr < values[-2]:
            simplex[-1], values[-1] = xr, fr
        else:
            xc = centroid + 0.5 * (simplex[-1] - centroid)
            fc = f(xc)
            if fc < values[-1]:
                simplex[-1], values[-1] = xc, fc
            else:
                best = simplex[0]
                simplex = [best + 0.5 * (x - best) for x in simplex]
                values = [f(x) for x in simplex]
    return simplex[int(np.argmin(values))]


def _predict_point(p: Point, work, params: dict, ceil: Ceilings, host: Optional[dict] = None) -> float:
    if p.pass_ == "layout":
        return params["fixed_ms"] + params["ns_per_cell"] * 1e-6 * p.row["_cells"]
    if p.pass_ == "transpose":
        return params["fixed_ms"]
    # cuDNN decode is a single eager SDPA call whose host work the fitted call_ms covers
    # every recorded eager prefill call was timed by do_bench, an L2 flush on the device before each call
    t = predict(work, params, ceil, work_dtype(p), graph=p.graph or (p.impl == "cudnn" and p.pass_ == "decode"),
                host=_host_for(p, host), flush_ms=H.flush_ms(ceil))
    return t["kernels_ms"] + t["launch"]


def _host_for(p: Point, host: Optional[dict]) -> Optional[dict]:
    """The host-term parameters that price a recorded eager prefill point: its op and pass on the host path
    its run used (a crossover part records it; every other recorded file ran :data:`.host.RECORDED_PATH`)."""
    if host is None or p.pass_ not in ("fwd", "bwd") or p.graph:
        return None
    if p.host_ms is not None:  # measured in the point's own run, on a layout it did not sweep
        return {"host_ms": float(p.host_ms), "host_launch_ms": 0.0}
    impl = "sparseattn" if p.impl.startswith("sparseattn") else p.impl
    path = p.host_path or host["recorded"]
    return host["paths"][path]["params"].get(f"{impl}/{p.pass_}")


def work_dtype(p: Point):
    return Shape(dtype=p.case.get("dtype", "bf16")).dtype


def _params_of(model: dict, key: str, free_values: Dict[str, float]) -> dict:
    spec = SPECS[key]
    params = dict(spec.get("fixed", {}))
    for name, src in spec.get("tied", {}).items():
        g, q = src.split(":")
        params[name] = model[g]["params"][q]
    params.update(free_values)
    return params


def calibrate(points: List[Point], ceil: Ceilings, iters: int = 600, host: Optional[dict] = None) -> dict:
    """Fit every model on its calibration points; returns the ``model`` section of the record. ``host``: the
    record's host section (:func:`.host.fit_paths`), fitted first; eager prefill points are priced with it."""
    works = {p.id: point_work(p, ceil) for p in points}
    for p in points:
        if p.pass_ == "layout":
            p.row["_cells"] = evaluated_cells_of(_layout_build_mask(p.pattern, p.N), p.N, p.N)
    model: Dict[str, dict] = {}
    for key in ORDER:
        spec = SPECS[key]
        cal = [p for p in points if p.group == key and p.role == "calibration"]
        if not cal:
            raise ValueError(f"no calibration points for {key}")
        names = [f[0] for f in spec["free"]]
        lo = np.array([f[2] for f in spec["free"]])
        hi = np.array([f[3] for f in spec["free"]])

        def unpack(x):
            return {n: float(v) for n, v in zip(names, np.clip(x, lo, hi))}

        def loss(x, forms=None):
            free = unpack(x)
            params = _params_of(model, key, free)
            if forms:
                params["call_form"] = forms
            errs = [math.log(max(_predict_point(p, works[p.id], params, ceil, host), 1e-9) / p.ms) for p in cal]
            penalty = float(np.sum((x - np.clip(x, lo, hi)) ** 2))
            return float(np.mean(np.square(errs))) + penalty

        x0 = np.array([f[1] for f in spec["free"]])
        scale = np.maximum(np.abs(x0) * 0.5, (hi - lo) * 0.05)
        best_x, best_form, best_loss = None, None, float("inf")
        # with the host term the per-call constant is device-side only: it adds to the kernels ("sum")
        forms = ["sum"] if key.endswith("/fwd") and host is not None else \
            ["sum", "max"] if key.endswith("/fwd") else [None]
        for form in forms:
            for start in (x0, lo + 0.3 * (hi - lo), lo + 0.7 * (hi - lo)):
                x = _nelder_mead(lambda z: loss(z, form), start.astype(float), scale, iters=iters)
                x = _nelder_mead(lambda z: loss(z, form), x, scale * 0.1, iters=iters)
                val = loss(x, form)
                if val < best_loss:
                    best_x, best_form, best_loss = x, form, val
        params = unpack(best_x)
        for name, value in spec.get("fixed", {}).items():
            params[name] = value
        if best_form:
            params["call_form"] = best_form
        model[key] = {"params": params, "tied": dict(spec.get("tied", {})),
                      "calibration_points": [p.id for p in cal], "calibration_rms_log": math.sqrt(best_loss)}
    return model


def evaluate(points: List[Point], model: dict, ceil: Ceilings, host: Optional[dict] = None) -> List[dict]:
    """Predicted/measured for every point (calibration and evaluation) with the fitted model."""
    record = {"model": model}
    rows = []
    for p in points:
        work = point_work(p, ceil)
        if p.pass_ == "layout" and "_cells" not in p.row:
            p.row["_cells"] = evaluated_cells_of(_layout_build_mask(p.pattern, p.N), p.N, p.N)
        if p.pass_ in ("layout", "transpose"):
            params = model[p.group]["params"]
        else:
            impl = "sparseattn" if p.impl.startswith("sparseattn") else p.impl
            params = model_params(impl, p.pass_, deterministic=p.impl != "sparseattn-atomic", record=record)
        pred = _predict_point(p, work, params, ceil, host)
        rows.append({"id": p.id, "label": p.label(), "group": p.group, "role": p.role, "measured_ms": p.ms,
                     "predicted_ms": pred, "ratio": pred / p.ms, "N": p.N, "family": p.case.get("family"),
                     "pass": p.pass_, "impl": "sparseattn" if p.impl.startswith("sparseattn") else p.impl})
    return rows


def _dist(ratios: List[float]) -> dict:
    if not ratios:
        return {"n": 0}
    r = np.array(ratios)
    return {"n": int(r.size), "median": float(np.median(r)), "p10": float(np.quantile(r, 0.1)),
            "p90": float(np.quantile(r, 0.9)), "within_25pct": float(np.mean(np.abs(r - 1) <= 0.25))}


#: How the accuracy is summarised: the kernel-time models (what the crossover needs) and the rest, on the
#: calibration files' evaluation points; then the crossover sweep (:data:`EVALUATION_FILES`), which the
#: issue's acceptance is about.
CLASSES = {
    "prefill (fwd + bwd, ours)": ("sparseattn/fwd", "sparseattn/bwd", "sparseattn/bwd-atomic"),
    "prefill baselines (Flex, cuDNN)": ("flex/fwd", "flex/bwd", "cudnn/fwd", "cudnn/bwd"),
    "decode, CUDA graph (ours)": ("sparseattn/decode:graph",),
    "decode, eager (ours)": ("sparseattn/decode:eager",),
    "decode (cuDNN)": ("cudnn/decode",),
    "layout build + transpose": ("index/layout", "index/transpose"),
    # the sweep's CUDA-graph replays (device time: the kernels and their per-call device cost) and its eager
    # event times (device + the host's excess, which follows the machine's host speed of the moment)
    "crossover sweep: ours, device": ("crossover:sparseattn/fwd:graph", "crossover:sparseattn/bwd:graph",
                                      "crossover:sparseattn/decode:graph"),
    "crossover sweep: Flex, cuDNN, device": ("crossover:flex/fwd:graph", "crossover:flex/bwd:graph",
                                             "crossover:cudnn/fwd:graph", "crossover:cudnn/bwd:graph",
                                             "crossover:cudnn/decode"),
    "crossover sweep: ours, eager": ("crossover:sparseattn/fwd", "crossover:sparseattn/bwd"),
    "crossover sweep: Flex, cuDNN, eager": ("crossover:flex/fwd", "crossover:flex/bwd", "crossover:cudnn/fwd",
                                            "crossover:cudnn/bwd"),
}
CROSSOVER_CLASSES = ("crossover sweep: ours, device", "crossover sweep: Flex, cuDNN, device",
                     "crossover sweep: ours, eager", "crossover sweep: Flex, cuDNN, eager")
#: The sweep summarised by how it was timed (the issue's acceptance is read on each, reported side by side).
SWEEP_TIMINGS = {"crossover sweep: device (all)": CROSSOVER_CLASSES[:2],
                 "crossover sweep: eager (all)": CROSSOVER_CLASSES[2:]}


def _class_key(row: dict) -> str:
    src = "crossover:" if row["id"].startswith(EVALUATION_FILES) else ""
    if row["group"] == "sparseattn/decode":
        return src + "sparseattn/decode:" + ("graph" if " graph" in row["label"] else "eager")
    return src + row["group"] + (":graph" if row["id"].endswith(":graph") else "")


def accuracy(rows: List[dict]) -> dict:
    """Distribution of predicted/measured on the evaluation points, per class and per model, plus the list of
    evaluation points outside +-25%."""
    ev = [r for r in rows if r["role"] == "evaluation"]
    out = {"classes": {}, "groups": {}, "outside_25pct": []}
    for name, keys in CLASSES.items():
        out["classes"][name] = _dist([r["ratio"] for r in ev if _class_key(r) in keys])
    for g in sorted({r["group"] for r in rows}):
        out["groups"][g] = {"evaluation": _dist([r["ratio"] for r in ev if r["group"] == g]),
                            "calibration": _dist([r["ratio"] for r in rows
                                                  if r["group"] == g and r["role"] == "calibration"])}
    kernel = [r["ratio"] for r in ev if not r["group"].startswith("index") and _class_key(r) != "sparseattn/decode:eager"]
    out["kernels (all evaluation points except eager decode and layout builds)"] = _dist(kernel)
    sweep = {k for c in CROSSOVER_CLASSES for k in CLASSES[c]}
    out["crossover sweep (all)"] = _dist([r["ratio"] for r in ev if _class_key(r) in sweep])
    for name, classes in SWEEP_TIMINGS.items():
        keys = {k for c in classes for k in CLASSES[c]}
        out[name] = _dist([r["ratio"] for r in ev if _class_key(r) in keys])
    out["sweep_series"] = sweep_series(rows)
    out["outside_25pct"] = [{"label": r["label"], "ratio": round(r["ratio"], 3), "measured_ms": r["measured_ms"],
                             "predicted_ms": round(r["predicted_ms"], 5)} for r in ev if abs(r["ratio"] - 1) > 0.25]
    return out


def sweep_series(rows: List[dict]) -> Dict[str, dict]:
    """The crossover sweep's evaluation points, predicted/measured per implementation, pass and family, and
    per length (N < 8k, N >= 8k): where the model holds and where it does not."""
    ev = [r for r in rows if r["role"] == "evaluation" and r["id"].startswith(EVALUATION_FILES)]

    def series_of(r):
        impl = r.get("impl") or r["group"].split("/")[0]
        pass_ = r.get("pass") or r["group"].split("/")[1]
        graph = " graph" if r["id"].endswith(":graph") else ""
        family = r.get("family") or ""
        return f"{impl} {pass_}" + (f" {family}" if family and family != pass_ else "") + graph

    out = {name: _dist([r["ratio"] for r in ev if series_of(r) == name]) for name in sorted({series_of(r) for r in ev})}
    for name, keep in (("N < 8k", lambda r: r.get("N", 0) < 8192), ("N >= 8k", lambda r: r.get("N", 0) >= 8192)):
        out[name] = _dist([r["ratio"] for r in ev if keep(r)])
        for timing, graph in ((", device", True), (", eager", False)):
            out[name + timing] = _dist([r["ratio"] for r in ev if keep(r) and r["id"].endswith(":graph") == graph
                                        and r.get("pass") != "decode"])
    return out


def series_table(series: Dict[str, dict], before: Optional[Dict[str, dict]] = None,
                 before_label: str = "before") -> str:
    """:func:`sweep_series` as a fixed-width table, with a ``before`` model's share within 25% beside it (its
    column headed ``before_label``)."""
    lines = [f"{'sweep series':32s} {'n':>3s} {'median':>7s} {'p10':>6s} {'p90':>6s} {'in +-25%':>8s}"
             + (f"  {before_label}" if before else "")]
    for name, d in series.items():
        if not d["n"]:
            continue
        extra = f"  {before[name]['within_25pct'] * 100:5.0f}%" if before and before.get(name, {}).get("n") else ""
        lines.append(f"{name:32s} {d['n']:3d} {d['median']:7.2f} {d['p10']:6.2f} {d['p90']:6.2f} "
                     f"{d['within_25pct'] * 100:7.0f}%{extra}")
    return "\n".join(lines)


def summary_table(acc: dict) -> str:
    """The accuracy classes as a fixed-width table (what the package docstring quotes)."""
    lines = [f"{'evaluation points':36s} {'n':>3s} {'median':>7s} {'p10':>6s} {'p90':>6s} {'in +-25%':>8s}"]
    items = list(acc["classes"].items())
    items.append(("all kernel models (no eager decode)",
                  acc["kernels (all evaluation points except eager decode and layout builds)"]))
    items += [(name, acc.get(name, {"n": 0})) for name in SWEEP_TIMINGS]
    items.append(("crossover sweep (all)", acc.get("crossover sweep (all)", {"n": 0})))
    for name, d in items:
        if d["n"] == 0:
            continue
        lines.append(f"{name:36s} {d['n']:3d} {d['median']:7.2f} {d['p10']:6.2f} {d['p90']:6.2f} "
                     f"{d['within_25pct'] * 100:7.0f}%")
    return "\n".join(lines)


def failures_table(acc: dict, limit: Optional[int] = None) -> str:
    """The evaluation points outside +-25%, one a line (what the package docstring quotes: the first
    ``limit`` of them, then how many more ``python -m sparseattn.roofline accuracy`` lists)."""
    rows = acc["outside_25pct"]
    shown = rows if limit is None else rows[:limit]
    lines = [f"{r['label']:52s} {r['ratio']:5.2f}" for r in shown]
    if len(shown) < len(rows):
        lines.append(f"... and {len(rows) - len(shown)} more (python -m sparseattn.roofline accuracy)")
    return "\n".join(lines)


#: The docstring blocks :func:`sync_docstring` rewrites: the line that introduces each, and its contents.
DOCSTRING_BLOCKS = (("Predicted / measured on the evaluation points::", summary_table),
                    ("Outside +-25%::", lambda acc: failures_table(acc, DOCSTRING_FAILURES)))
DOCSTRING_FAILURES = 25


def sync_docstring(acc: dict, path=None) -> bool:
    """Rewrite the accuracy tables of the package docstring (``sparseattn/roofline/__init__.py``) from
    ``acc``; return whether the file changed. Each table is the indented block after its introducing line."""
    path = pathlib.Path(path) if path is not None else pathlib.Path(__file__).with_name("__init__.py")
    text = path.read_text()
    new = text
    for intro, make in DOCSTRING_BLOCKS:
        head = new.index(intro + "\n\n") + len(intro) + 2
        end = new.index("\n\n", head)  # the block ends at the next blank line
        new = new[:head] + textwrap.indent(make(acc), "    ") + new[end:]
    if new != text:
        path.write_text(new)
    return new != text


def _family_of_id(pid: str, bench_dir=None) -> Optional[str]:
    """The crossover family of a recorded point id (``file#row``), None for the other files."""
    fname, i = pid.split("#")
    if not fname.startswith(EVALUATION_FILES):
        return None
    doc = _doc_cached(str(pathlib.Path(bench_dir or BENCH_DIR) / fname))
    return doc["results"][int(i)]["case"].get("family")


@functools.lru_cache(maxsize=None)
def _doc_cached(path: str) -> dict:
    return json.loads(pathlib.Path(path).read_text())


def run(bench_dir=None, out: Optional[pathlib.Path] = None, slug: str = "h200", iters: int = 600) -> dict:
    """Refit on the recorded files and write the record (the packaged one by default)."""
    record = json.loads(json.dumps(load_record(slug)))
    ceil = Ceilings.from_json(record["ceilings"])
    previous = record.get("calibration", {})
    points = load_points(bench_dir)
    host = fit_paths(points, bench_dir)
    model = calibrate(points, ceil, iters=iters, host=host)
    rows = [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
            for r in evaluate(points, model, ceil, host)]
    acc = accuracy(rows)  # from the stored (rounded) rows, so a reader can recompute it from the record
    record["model"] = model
    record["host"] = host
    record["calibration"] = {
        "date": datetime.date.today().isoformat(),
        "files": list(FILES),
        "evaluation_files": [f for f in EVALUATION_FILES if (pathlib.Path(bench_dir or BENCH_DIR) / f).exists()],
        "rule": role_of.__doc__.strip() + " See sparseattn.roofline.calibrate.",
        "calibration_points": [p.id for p in points if p.role == "calibration"],
        "evaluation_points": [p.id for p in points if p.role == "evaluation"],
        "repeated_points": [p.id for p in points if p.role == "repeat"],
        "points": rows,
        "accuracy": acc,
        # the model this fit replaced, on the same sweep points: its summary kept for the before/after table
        "previous": previous.get("previous") or ({"date": previous.get("date"), "accuracy": {
            k: previous["accuracy"][k] for k in ("classes", "crossover sweep (all)")},
            "sweep_series": sweep_series([{**r, "N": int(r["label"].split("N=")[1].split()[0]),
                                           "family": _family_of_id(r["id"], bench_dir)}
                                          for r in previous.get("points", [])])} if previous else None),
    }
    path = pathlib.Path(out) if out is not None else record_path(slug)
    path.write_text(json.dumps(record, indent=1) + "\n")
    load_record.cache_clear()
    return record


# ---- the eager host term (sparseattn.roofline.host): fitted here, priced there ---------------------------
def sweep_fingerprints(points: Iterable) -> Set[str]:
    """Fingerprints of the prefill layouts and shapes of the crossover sweep's points (``calibrate.Point``)."""
    out = set()
    for p in points:
        if p.id.startswith(EVALUATION_FILES) and p.pass_ in ("fwd", "bwd") and "family" in p.case:
            out.add(H.fingerprint(_family_layout(p.case), p.case))
    return out


def _host_launches(pattern: str, N: int, pass_: str) -> int:
    return work_of(_layout(pattern, N), Shape(B=1, Hq=16, D=128, dtype="bf16"), pass_).launches


def host_rows(path: str, bench_dir=None, exclude: Set[str] = frozenset()) -> List[dict]:
    """The host suite rows of ``path``: impl, pass, pattern, N, host time (ms), launches (the model's count
    for ours; 1 for the baselines, whose host term is one number per call) and ``role`` (``"calibration"``,
    or ``"excluded"`` when the sweep measured the same layout and shape)."""
    bench_dir = pathlib.Path(bench_dir) if bench_dir is not None else H.BENCH_DIR
    doc = json.loads((bench_dir / H.HOST_FILES[path]).read_text())
    rows = []
    for r in doc["results"]:
        impl, pass_, c = r["impl"], r["pass"], r["case"]
        if impl not in IMPLS or pass_ not in ("fwd", "bwd") or r.get("host_us") is None:
            continue
        fp = H.fingerprint(_layout(c["pattern"], c["N"]), c)
        rows.append({"impl": impl, "pass": pass_, "pattern": c["pattern"], "N": c["N"],
                     "host_ms": r["host_us"] * 1e-3, "ms": r.get("ms"), "device_ms": r.get("device_ms"),
                     "launches": _host_launches(c["pattern"], c["N"], pass_) if impl == "sparseattn" else 1,
                     "role": "excluded" if fp in exclude else "calibration"})
    return rows


def fit_host(rows: List[dict]) -> Dict[str, dict]:
    """Per ``impl/pass``: ``host_ms`` (and ``host_launch_ms`` when the rows have several launch counts) by
    least squares on the calibration rows; one count: the median host time."""
    out = {}
    for key in sorted({f"{r['impl']}/{r['pass']}" for r in rows}):
        cal = [r for r in rows if f"{r['impl']}/{r['pass']}" == key and r["role"] == "calibration"]
        if not cal:
            continue
        L = np.array([r["launches"] - 1 for r in cal], dtype=float)
        y = np.array([r["host_ms"] for r in cal])
        if len(set(L)) > 1:
            A = np.stack([np.ones_like(L), L], 1)
            a, b = np.linalg.lstsq(A, y, rcond=None)[0]
            if b < 0:
                a, b = float(np.median(y)), 0.0
        else:
            a, b = float(np.median(y)), 0.0
        out[key] = {"host_ms": float(a), "host_launch_ms": float(b), "n": len(cal),
                    "launches": sorted({int(r["launches"]) for r in cal})}
    return out


def fit_paths(points: Iterable, bench_dir=None) -> dict:
    """The ``host`` section of the ceilings record: each path's parameters and rows, the path of the current
    code, and the rule that kept the sweep's own calls out of the recorded path's fit."""
    sweep = sweep_fingerprints(points)
    paths = {}
    for path, fname in H.HOST_FILES.items():
        rows = host_rows(path, bench_dir, exclude=sweep if path == H.RECORDED_PATH else frozenset())
        paths[path] = {"file": fname, "params": fit_host(rows),
                       "rows": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
                                for r in rows]}
    return {"current": H.CURRENT_PATH, "recorded": H.RECORDED_PATH, "paths": paths,
            "combination": combination_check(bench_dir),
            "rule": ("host-suite rows with the block tables and shape of a crossover-sweep point are left out of "
                     f"the {H.RECORDED_PATH!r} fit (role 'excluded'); see sparseattn.roofline.calibrate.fit_paths")}


def combination_check(bench_dir=None) -> dict:
    """On every host-suite recording (rows with a device time): the event-timed ms against ``max(device,
    host)``, ``device + host`` and the flush rule (``flush``: the device time while the host time fits in
    ``do_bench``'s L2 flush and the device time, else ``max``; :mod:`.host`) -- the share within 25% and the
    median ratio of each."""
    bench_dir = pathlib.Path(bench_dir) if bench_dir is not None else H.BENCH_DIR
    ms, dev, host = [], [], []
    for f in sorted(set(H.HOST_FILES.values()) | {"host-h200.json", "checks/host-inert-cache-h200.json",
                                                 "checks/host-cache-v1-h200.json"}):
        path = bench_dir / f
        if not path.exists():
            continue
        for r in json.loads(path.read_text())["results"]:
            if r.get("device_ms") is None or r.get("host_us") is None or r.get("ms") is None:
                continue
            ms.append(r["ms"])
            dev.append(r["device_ms"])
            host.append(r["host_us"] * 1e-3)
    ms, dev, host = map(np.array, (ms, dev, host))
    out = {"n": int(ms.size)}
    flush = H.flush_ms(Ceilings.from_json(load_record("h200")["ceilings"]))
    rule = np.array([H.eager_ms(d, h, flush) for d, h in zip(dev, host)])
    for name, pred in (("max", np.maximum(dev, host)), ("sum", dev + host), ("flush", rule)):
        q = pred / ms
        out[name] = {"within_25pct": float(np.mean(np.abs(q - 1) <= 0.25)), "median": float(np.median(q))}
    return out
