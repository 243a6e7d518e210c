"""Suite ``versus``: issue 13's table against FlexAttention, every row re-measured in one run.

The rows are fixed (``--n``, ``--patterns``, ``--heads`` and ``--head-dim`` do not apply; ``--rows`` picks a
subset by key, ``--budget-s`` bounds the run, ``--no-flex`` leaves FlexAttention out). B = 1, 128 x 128 tiles,
bf16, H = 16, D = 128, N = 32k unless a row says otherwise; FlexAttention compiled on the same block mask
(``layout.to_flex()``); backward = the gradients of q, k, v for a given dO from a kept forward (forward
excluded); medians of ``do_bench``. In the issue's order, most important first:

* the backward (deterministic, and the atomic path) on causal, window 1024, sinks 64 + window 1024, 64
  documents of random lengths (causal inside each, :func:`~sparseattn.roofline.cases.documents_ids`) and
  window 333;
* the forward on the two masks with no hand-written predicate: causal & (window 256 | dilated 8) and the
  stripes plain lambda (:func:`~sparseattn.roofline.cases.stripes_mask`);
* building the stripes layout from the plain lambda against ``create_block_mask``, eager and compiled (the
  ``layout`` suite's calls);
* the forward of window 1024 at N = 1024 and 2048, with cuDNN causal beside it;
* the issue's "other shapes" at N = 32k: D = 64 with 32 heads (causal and window 1024), GQA 32 query / 8 KV
  heads (window 1024), fp16 (window 1024), each forward and backward.

Every table line gives ours, Flex, the ratio ``flex_ms / ours_ms`` (above 1: ours is faster), the issue's
ratio, the issue's target for that line and whether it is met. Each measurement records its first call's
seconds (compiles included), each row its wall time beside the estimate the run order was planned with
(``meta["rows"]``), and the file is rewritten after every row, so a run cut short keeps what it finished. A
row whose estimate no longer fits the budget is recorded with ``ms: null`` and the reason.

``--merge FILE`` (an earlier ``versus`` file of the same device) keeps that file's rows that this run does not
measure (records, table lines and per-row meta), so a few rows re-measured after a change update the record
without re-running the rest: the file's ``date`` is this run's, each row's ``meta["rows"][key]["date"]`` says
when it was measured, and ``merged_from`` names the earlier file's date and the rows taken from it.
"""
from __future__ import annotations

import dataclasses
import time
from typing import Callable, Dict, List, NamedTuple, Optional, Tuple

import torch

from ..layout import BlockLayout
from ..ops import mask_path_name, sparse_attention
from . import _common as C
from .cases import prefill_layout, prefill_mask_mod
from .layout_build import FLEX_MASK_MODES, flex_block_mask_call
from .record import BenchFile, Impl, Pass, Record, check_merge_source, load_path

NAME = "versus"
DEFAULT_N = "32768"  # the rows fix their own lengths; --n does not apply
CONFIG_KIND = None  # no config sweep
BLOCK = 128
COLUMNS = ["line", "ours_ms", "flex_ms", "flex/ours", "issue", "target", "met", "cudnn_ms", "err_vs_flex"]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


# ---------------------------------------------------------------------------------------------------------
# the rows
# ---------------------------------------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Target:
    """An issue-13 target of one table line: ``flex_ms / ours_ms >= min_ratio`` and ``ours_ms <= max_ms``
    (either may be None: not asked)."""
    min_ratio: Optional[float] = None
    max_ms: Optional[float] = None

    def text(self) -> str:
        parts = ([f">={self.min_ratio:.2f}x"] if self.min_ratio is not None else []) + \
                ([f"<={self.max_ms:g} ms"] if self.max_ms is not None else [])
        return ", ".join(parts)

    def met(self, ours_ms: Optional[float], ratio: Optional[float]) -> Optional[bool]:
        """Whether the measured line meets the target (None when a number it needs was not measured)."""
        if ours_ms is None or (self.min_ratio is not None and ratio is None):
            return None
        return ((self.min_ratio is None or ratio >= self.min_ratio)
                and (self.max_ms is None or ours_ms <= self.max_ms))


#: the table lines a row kind gives: (line kind, our measurement, FlexAttention's), keys of a row's results
LINES = {"fwd": [("fwd", "ours fwd", "flex fwd")],
         "bwd": [("bwd", "ours bwd", "flex bwd"), ("bwd atomic", "atomic bwd", "flex bwd")],
         "fwd+bwd": [("fwd", "ours fwd", "flex fwd"), ("bwd", "ours bwd", "flex bwd"),
                     ("bwd atomic", "atomic bwd", "flex bwd")],
         "layout": [("layout eager", "ours layout", "flex layout eager"),
                    ("layout compiled", "ours layout", "flex layout compiled")]}
#: the record series of our measurements (a row the budget skips records each with the reason)
OURS_SERIES = {"ours fwd": (Impl.OURS, Pass.FWD), "ours bwd": (Impl.OURS, Pass.BWD),
               "atomic bwd": (Impl.OURS_ATOMIC, Pass.BWD), "ours layout": (Impl.OURS, Pass.LAYOUT)}
#: how a line kind is named in the table (``{}``: the row's label)
LINE_NAMES = {"fwd": "fwd {}", "bwd": "bwd {}", "bwd atomic": "bwd {}, atomic",
              "layout eager": "layout {} vs create_block_mask eager",
              "layout compiled": "layout {} vs create_block_mask compiled"}

#: the issue's targets: the deterministic backward >= 1.10x Flex on every sparse pattern and >= 1.0x on causal;
#: the atomic path >= 1.25x (and causal <= 25 ms); the two compiled-mask forwards >= 1.10x; a mask_mod's
#: layout <= 5 ms and >= 4x faster than create_block_mask both ways; at N <= 2k ours <= Flex; the analytic
#: forward at D = 64 >= 1.10x; where ours already wins (fwd GQA, fp16) at least the issue's ratio.
BWD_SPARSE = {"bwd": Target(1.10), "bwd atomic": Target(1.25)}
BWD_CAUSAL = {"bwd": Target(1.0), "bwd atomic": Target(1.25, max_ms=25.0)}


@dataclasses.dataclass(frozen=True)
class Row:
    """One row of issue 13's table: ``key`` (for ``--rows``), ``label`` (the issue's words), ``kind`` (a key
    of :data:`LINES`), ``pattern`` (a :func:`~sparseattn.roofline.cases.prefill_layout` name), the shape,
    ``issue`` (the issue's Flex/ours ratio per line kind), ``targets`` (per line kind) and ``cudnn_causal``
    (also time SDPA's cuDNN on the causal mask, as the issue's short-sequence rows do)."""
    key: str
    label: str
    kind: str
    pattern: str
    N: int = 32768
    H: int = 16
    Hkv: int = 16
    D: int = 128
    dtype: str = "bf16"
    issue: Dict[str, float] = dataclasses.field(default_factory=dict)
    targets: Dict[str, Target] = dataclasses.field(default_factory=dict)
    cudnn_causal: bool = False

    def shape(self) -> tuple:
        return (self.N, self.H, self.Hkv, self.D, self.dtype)

    def case(self) -> dict:
        return {"row": self.key, "pattern": self.pattern, "N": self.N, "B": 1, "H": self.H, "Hkv": self.Hkv,
                "D": self.D, "dtype": self.dtype, "block": BLOCK}


ROWS: List[Row] = [
    Row("bwd-causal", "causal", "bwd", "causal", issue={"bwd": 0.86}, targets=BWD_CAUSAL),
    Row("bwd-window1024", "window 1024", "bwd", "window1024", issue={"bwd": 0.66}, targets=BWD_SPARSE),
    Row("bwd-sinks", "sinks 64 + window 1024", "bwd", "sinks64+window1024", issue={"bwd": 0.82},
        targets=BWD_SPARSE),
    Row("bwd-documents64", "documents (64 random lengths)", "bwd", "documents64", issue={"bwd": 0.69},
        targets=BWD_SPARSE),
    Row("bwd-window333", "window 333", "bwd", "window333", issue={"bwd": 0.58}, targets=BWD_SPARSE),
    Row("fwd-composed", "causal&(window256|dilated8)", "fwd", "causal&(window256|dilated8)", issue={"fwd": 0.68},
        targets={"fwd": Target(1.10)}),
    Row("fwd-stripes", "stripes (plain lambda)", "fwd", "stripes(plain lambda)", issue={"fwd": 0.80},
        targets={"fwd": Target(1.10)}),
    Row("layout-stripes", "stripes (plain lambda)", "layout", "stripes(plain lambda)", issue={"layout eager": 0.71},
        targets={"layout eager": Target(4.0, max_ms=5.0), "layout compiled": Target(4.0, max_ms=5.0)}),
    Row("fwd-window1024-n1024", "window 1024 at N=1024", "fwd", "window1024", N=1024, issue={"fwd": 0.29},
        targets={"fwd": Target(1.0)}, cudnn_causal=True),
    Row("fwd-window1024-n2048", "window 1024 at N=2048", "fwd", "window1024", N=2048, issue={"fwd": 0.72},
        targets={"fwd": Target(1.0)}, cudnn_causal=True),
    Row("d64-causal", "causal, D=64 H=32", "fwd+bwd", "causal", H=32, Hkv=32, D=64,
        issue={"fwd": 0.99, "bwd": 0.79}, targets={"fwd": Target(1.10), **BWD_CAUSAL}),
    Row("d64-window1024", "window 1024, D=64 H=32", "fwd+bwd", "window1024", H=32, Hkv=32, D=64,
        issue={"fwd": 1.00, "bwd": 0.66}, targets={"fwd": Target(1.10), **BWD_SPARSE}),
    Row("gqa-window1024", "window 1024, GQA 32/8", "fwd+bwd", "window1024", H=32, Hkv=8,
        issue={"fwd": 1.13, "bwd": 0.67}, targets={"fwd": Target(1.13), **BWD_SPARSE}),
    Row("fp16-window1024", "window 1024, fp16", "fwd+bwd", "window1024", dtype="fp16",
        issue={"fwd": 1.12, "bwd": 0.65}, targets={"fwd": Target(1.12), **BWD_SPARSE}),
]

#: seconds a row's pieces are expected to take on the H200, to plan the run (each measurement records its
#: first call as ``first_call_s``, each row its wall time, so a run checks these): building the row's layout
#: (a compiled predicate's first build compiles it), a first call of ours (Triton compiles the forward kernel;
#: the backward's kernels of both paths), FlexAttention's first call (Inductor compiles the forward: 2-8 s in
#: the recorded crossover run; the forward and backward of a graph with gradients), one ``do_bench`` timing
#: (about 0.4 s plus the first calls it makes), create_block_mask's compile.
EST_S = {"build": 1.0, "ours fwd": 3.0, "ours bwd": 8.0, "flex fwd": 8.0, "flex bwd": 20.0, "timing": 0.7,
         "cbm compile": 15.0}


def estimate_s(row: Row) -> float:
    """Seconds ``row`` is expected to take (compiles and timings; see :data:`EST_S`)."""
    e = EST_S
    if row.kind == "layout":
        return e["build"] + e["cbm compile"] + 6 * e["timing"]
    t = e["build"]
    if "fwd" in row.kind:
        t += e["ours fwd"] + e["flex fwd"] + 2 * e["timing"] + (e["timing"] if row.cudnn_causal else 0.0)
    if "bwd" in row.kind:
        t += e["ours bwd"] + e["flex bwd"] + 4 * e["timing"]  # det, atomic, Flex, and the gradients compared
    return t


def select_rows(spec: Optional[str]) -> List[Row]:
    """The rows ``--rows`` names (comma-separated keys; None or ``"all"``: every row), in :data:`ROWS` order."""
    if spec is None or spec.strip() == "all":
        return list(ROWS)
    keys = [s.strip() for s in spec.split(",") if s.strip()]
    known = [r.key for r in ROWS]
    bad = [k for k in keys if k not in known]
    if bad or not keys:
        raise ValueError(f"--rows must be 'all' or a comma-separated subset of {known}, got {spec!r}")
    return [r for r in ROWS if r.key in keys]


def row_layout(row: Row, N: Optional[int] = None, device="cpu") -> BlockLayout:
    """The block table a row measures, at its length (or ``N``): the ``prefill`` suite's layout of its
    pattern (the layout row builds the same table from the plain lambda, timed)."""
    return prefill_layout(row.pattern, N or row.N, BLOCK, device=device)


# ---------------------------------------------------------------------------------------------------------
# measuring
# ---------------------------------------------------------------------------------------------------------
class _Run:
    """One run's state: records, the inputs of the current shape, the budget, the file rewritten per row."""

    def __init__(self, args, kept: Optional["Kept"] = None):
        self.args, self.dev = args, args.device
        self.kept = kept or Kept([], [], {}, None)
        self.records: List[Record] = []
        self.inputs: Dict[tuple, tuple] = {}
        self.budget = C.Budget(getattr(args, "budget_s", None) or 500.0)
        self.env = C.environment()
        self.meta = {"rows": dict(self.kept.rows), "lines": list(self.kept.lines)}
        if self.kept.source is not None:
            self.meta["merged_from"] = self.kept.source

    def qkv(self, row: Row, grad: bool):
        """Seeded random q ``[1, H, N, D]``, k/v ``[1, Hkv, N, D]`` and dO for the row's shape (kept while the
        shape repeats)."""
        key = row.shape() + (grad,)
        if key not in self.inputs:
            self.inputs.clear()
            C.empty_cache()
            torch.manual_seed(0)
            dt = DTYPES[row.dtype]
            q = torch.randn(1, row.H, row.N, row.D, device=self.dev, dtype=dt, requires_grad=grad)
            k, v = (torch.randn(1, row.Hkv, row.N, row.D, device=self.dev, dtype=dt, requires_grad=grad)
                    for _ in range(2))
            self.inputs[key] = (q, k, v, torch.randn_like(q, requires_grad=False))
        return self.inputs[key]

    def measure(self, case: dict, impl: str, pass_: str, make: Callable[[], Callable], timer=None,
                extra: Optional[dict] = None) -> Tuple[Optional[float], object]:
        """Record ``impl``'s median ms of the call ``make()`` returns (its first call, compiles included, timed
        apart as ``first_call_s``); return ``(ms, first call's output)``, or ``(None, None)`` with the error
        recorded when it fails (a failing baseline or compile is a result, not the end of the run)."""
        timer = timer or C.time_gpu
        try:
            t0 = time.perf_counter()
            fn = make()
            out = fn()
            C.synchronize(self.dev)
            first = time.perf_counter() - t0
            ms = timer(fn)
        except Exception as e:  # noqa: BLE001
            msg = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
            C.note(f"{case['row']} {impl} {pass_}: {msg}")
            self.records.append(Record(case, impl, pass_, None, {**(extra or {}), "error": msg}))
            return None, None
        self.records.append(Record(case, impl, pass_, ms, {**(extra or {}), "first_call_s": first}))
        return ms, out

    def host_timer(self, fn):
        return C.time_host(fn, device=self.dev)

    def save(self) -> None:
        out = getattr(self.args, "out", None)
        if out:
            C.write_json(NAME, self.kept.records + self.records, out, self.env, meta=self.meta)


def _err(a, b) -> Optional[float]:
    """Largest relative error of ours against Flex over the outputs (one tensor, or the three gradients)."""
    if a is None or b is None:
        return None
    a, b = (a,) if isinstance(a, torch.Tensor) else a, (b,) if isinstance(b, torch.Tensor) else b
    return max(C.rel_err(x, y) for x, y in zip(a, b))


def _flex_kwargs(row: Row) -> dict:
    return {"enable_gqa": True} if row.H != row.Hkv else {}


def _fwd(run: _Run, row: Row, layout: BlockLayout, case: dict, res: dict) -> None:
    q, k, v, _ = run.qkv(row, grad=False)
    ms, o = run.measure(case, Impl.OURS, Pass.FWD, lambda: lambda: sparse_attention(q, k, v, layout),
                        extra={"mask_path": mask_path_name(layout)})
    res["ours fwd"] = ms
    if not run.args.no_flex:
        res["flex fwd"], of = run.measure(case, Impl.FLEX, Pass.FWD,
                                          lambda: C.flex_fn(q, k, v, layout.to_flex(num_heads=row.H),
                                                            **_flex_kwargs(row)))
        res["err fwd"] = _err(o, of)
    if row.cudnn_causal:
        res["cudnn fwd"], _ = run.measure({**case, "pattern": "causal"}, Impl.CUDNN, Pass.FWD,
                                          lambda: C.sdpa_fn(q, k, v, Impl.CUDNN, causal=True))


def _bwd(run: _Run, row: Row, layout: BlockLayout, case: dict, res: dict) -> None:
    q, k, v, do = run.qkv(row, grad=True)
    inputs = (q, k, v)
    grads = {}
    for key, impl, det in (("ours bwd", Impl.OURS, True), ("atomic bwd", Impl.OURS_ATOMIC, False)):
        fwd = lambda det=det: sparse_attention(q, k, v, layout, deterministic=det)  # noqa: E731
        res[key], grads[impl] = run.measure(case, impl, Pass.BWD, lambda fwd=fwd: C.grad_fn(fwd, inputs, do),
                                            extra={"mask_path": mask_path_name(layout)})
    if not run.args.no_flex:
        flex = lambda: C.flex_fn(q, k, v, layout.to_flex(num_heads=row.H), **_flex_kwargs(row))  # noqa: E731
        res["flex bwd"], gf = run.measure(case, Impl.FLEX, Pass.BWD, lambda: C.grad_fn(flex(), inputs, do))
        res["err bwd"] = _err(grads[Impl.OURS], gf)


def _layout(run: _Run, row: Row, res: dict) -> None:
    """Our build from the plain lambda (made once, as a user would) against create_block_mask both ways."""
    N, dev, case = row.N, run.dev, row.case()
    mm = prefill_mask_mod(row.pattern, N, dev)
    build = lambda: BlockLayout.from_mask_mod(mm, N, N, BLOCK, BLOCK, device=dev)  # noqa: E731
    with C.peak_memory(dev) as peak:
        res["ours layout"], lay = run.measure(case, Impl.OURS, Pass.LAYOUT, lambda: build, timer=run.host_timer)
    if lay is not None:  # what the build made and how much device memory it took on the way
        rec = run.records[-1]
        run.records[-1] = dataclasses.replace(rec, extra={**rec.extra, "peak_mb": peak["mb"],
                                                          "tiles": lay.stats()["listed_tiles"],
                                                          "mask_path": mask_path_name(lay)})
    if run.args.no_flex:
        return
    from torch.nn.attention.flex_attention import create_block_mask
    for compiled in FLEX_MASK_MODES:
        call = flex_block_mask_call(create_block_mask, compiled)
        label = {"compiled": compiled, "call": f"create_block_mask(..., BLOCK_SIZE={BLOCK}, _compile={compiled})"}
        res[f"flex layout {'compiled' if compiled else 'eager'}"], _ = run.measure(
            case, Impl.FLEX, Pass.LAYOUT, lambda call=call: lambda: call(mm, N, dev), timer=run.host_timer,
            extra=label)


def measure_row(run: _Run, row: Row) -> dict:
    """Measure one row; return its results by the keys of :data:`LINES` (None: not measured)."""
    res: dict = {}
    if row.kind == "layout":
        _layout(run, row, res)
        return res
    layout = row_layout(row, device=run.dev)
    st = layout.stats()
    case = {**row.case(), **{k: st[k] for k in ("listed_tiles", "full_tiles", "partial_tiles", "logical_density",
                                                "tile_amplification")}}
    if "fwd" in row.kind:
        _fwd(run, row, layout, case, res)
    if "bwd" in row.kind:
        _bwd(run, row, layout, case, res)
    return res


# ---------------------------------------------------------------------------------------------------------
# the table
# ---------------------------------------------------------------------------------------------------------
def _round(x: Optional[float], digits: int = 3):
    return "" if x is None else round(x, digits)


def row_lines(row: Row, res: dict, skipped: Optional[str] = None) -> List[dict]:
    """The table lines of a measured row: ours, Flex, ``flex/ours`` (``flex_ms / ours_ms``), the issue's ratio,
    the target and whether it is met (``yes``/``no``; blank when not measured; ``skipped`` when the budget
    left the row out)."""
    lines = []
    for kind, ours_key, flex_key in LINES[row.kind]:
        ours, flex = res.get(ours_key), res.get(flex_key)
        ratio = flex / ours if ours and flex else None
        target = row.targets.get(kind)
        met = target.met(ours, ratio) if target else None
        err = res.get("err " + kind.split()[0]) if kind in ("fwd", "bwd") else None
        lines.append({"line": LINE_NAMES[kind].format(row.label), "row": row.key, "kind": kind,
                      "ours_ms": _round(ours), "flex_ms": _round(flex),
                      "flex/ours": _round(ratio, 2), "issue": row.issue.get(kind, ""),
                      "target": target.text() if target else "",
                      "met": skipped or ("" if met is None else "yes" if met else "no"),
                      "cudnn_ms": _round(res.get("cudnn fwd")) if kind == "fwd" else "",
                      "err_vs_flex": "" if err is None else f"{err:.1e}"})
    return lines


class Kept(NamedTuple):
    """The rows an earlier file contributes to a merged one: its records, table lines and per-row meta of the
    rows not measured now, and ``source`` (the file's date and those row keys; None: nothing merged)."""
    records: List[Record]
    lines: List[dict]
    rows: Dict[str, dict]
    source: Optional[dict]


def kept_rows(old: Optional[BenchFile], measured: List[str], device: str) -> Kept:
    """What ``--merge`` keeps of ``old`` (a ``versus`` file of ``device``): every row not in ``measured``, each
    row's meta stamped with the date it was measured (the old file's, unless it already carries one)."""
    if old is None:
        return Kept([], [], {}, None)
    check_merge_source(old, NAME, device)
    date = old.meta["date"]
    records = [r for r in old.records if r.case.get("row") not in measured]
    lines = [x for x in old.meta.get("lines", []) if x["row"] not in measured]
    rows = {k: {**v, "date": v.get("date", date)} for k, v in old.meta.get("rows", {}).items()
            if k not in measured}
    keys = list(dict.fromkeys(x["row"] for x in lines))
    return Kept(records, lines, rows, {"date": date, "rows": keys})


def merged_doc(old: BenchFile, new: BenchFile) -> dict:
    """The file ``--merge`` would have written had the run of ``new`` (a ``versus`` file of some rows) been
    given ``old``: ``new``'s rows and meta, and ``old``'s rows that ``new`` does not hold (for a re-measure that
    ran without ``--merge``)."""
    measured = list(dict.fromkeys(x["row"] for x in new.meta.get("lines", [])))
    kept = kept_rows(old, measured, new.meta["device"])
    rows = {**kept.rows, **{k: {**v, "date": v.get("date", new.meta["date"])}
                            for k, v in new.meta.get("rows", {}).items()}}
    meta = {**new.meta, "rows": rows, "lines": in_row_order(kept.lines + list(new.meta.get("lines", []))),
            "merged_from": kept.source}
    return BenchFile(meta=meta, records=tuple(kept.records) + tuple(new.records)).to_json()


def in_row_order(lines: List[dict]) -> List[dict]:
    """Table lines in :data:`ROWS` order (a merged table interleaves kept and new rows); stable within a row."""
    order = {r.key: i for i, r in enumerate(ROWS)}
    return sorted(lines, key=lambda x: order[x["row"]])


def run(args) -> tuple:
    """Measure the rows ``args.rows`` names, most important first, while the budget lasts; return (records,
    table lines, table columns)."""
    rows = select_rows(getattr(args, "rows", None))
    if getattr(args, "patterns", None) or str(getattr(args, "n", DEFAULT_N)) != DEFAULT_N:
        C.note("versus: --n and --patterns do not apply (the rows are issue 13's, fixed); use --rows")
    merge = getattr(args, "merge", None)
    env_device = C.environment()["device"]
    r = _Run(args, kept_rows(load_path(merge) if merge else None, [row.key for row in rows], env_device))
    r.meta["budget_s"] = r.budget.seconds
    table = []
    with C.progress(len(rows), NAME) as bar:
        for row in rows:
            bar.set_postfix_str(row.key)
            est = estimate_s(row)
            if not r.budget.allows(est):
                why = f"skipped: {r.budget.left():.0f} s left of the time budget, the row takes about {est:.0f} s"
                C.note(f"{row.key}: {why}")
                for impl, pass_ in dict.fromkeys(OURS_SERIES[ours] for _, ours, _ in LINES[row.kind]):
                    r.records.append(Record(row.case(), impl, pass_, None, {"error": why}))
                lines = row_lines(row, {}, skipped="skipped")
            else:
                t0 = r.budget.clock()
                res = measure_row(r, row)
                r.meta["rows"][row.key] = {"s": r.budget.clock() - t0, "estimate_s": est, "date": r.env["date"]}
                lines = row_lines(row, res)
            table += lines
            r.meta["lines"] = in_row_order(r.kept.lines + table)
            r.save()
            bar.update()
    if hasattr(args, "meta"):
        args.meta.update(r.meta)
    return r.kept.records + r.records, r.meta["lines"], COLUMNS
