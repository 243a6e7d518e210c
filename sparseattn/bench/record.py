"""The typed record of a benchmark result, shared by the suites that write it and the book that plots it.

A suite writes one JSON file per run::

    {"suite": ..., "device": ..., "date": ..., "torch": ..., "triton": ..., ...,
     "results": [{"case": {...}, "impl": ..., "pass": ..., "ms": ..., ...extra}, ...]}

Each element of ``results`` is a :class:`Record`. Implementation and pass names are the constants of
:class:`Impl` and :class:`Pass`; a record with any other name cannot be built, so a renamed series fails
when a file is loaded or queried instead of silently vanishing from a figure. :func:`load` reads a
recorded file into a :class:`BenchFile`, whose :meth:`~BenchFile.select`, :meth:`~BenchFile.one` and
:meth:`~BenchFile.ms` are the only way the book's figures read measurements.

This module imports neither Triton nor plotly (the GPU machine has no plotly; the book has no GPU).
"""
from __future__ import annotations

import json
import math
import pathlib
from dataclasses import dataclass, field
from typing import Any, Dict, Iterable, List, Optional, Tuple, Union

__all__ = ["Impl", "Pass", "Record", "TIMINGS", "check_timing", "BenchFile", "load", "load_path", "bench_filename", "DEFAULT_DIR"]

#: Where recorded files live in a checkout: ``book/data/bench/``.
DEFAULT_DIR = pathlib.Path(__file__).resolve().parents[2] / "book" / "data" / "bench"


class Impl:
    """Implementation names, as they appear in the ``"impl"`` field."""
    OURS = "sparseattn"  #: our kernels (deterministic backward where a backward runs)
    OURS_ATOMIC = "sparseattn-atomic"  #: our backward with atomically accumulated dQ
    OURS_NOSPLIT = "sparseattn-nosplit"  #: our backward without column splitting
    OURS_SPLIT = "sparseattn-split"  #: our forward with long rows split into tasks and merged (FwdConfig.split)
    OURS_BITS = "sparseattn-bits"  #: our kernels with partial tiles forced to per-tile bits (A/B of the compiler)
    OURS_EAGER_MASK = "sparseattn-eager-mask"  #: our layout build evaluating undecided tiles with torch, not
    #: with the compiled predicate on the device
    FLEX = "flex"  #: FlexAttention, compiled, on the same block mask
    CUDNN = "cudnn"  #: SDPA's CUDNN_ATTENTION backend (dense or causal)
    FA2 = "fa2"  #: SDPA's FLASH_ATTENTION backend (dense or causal)
    NAIVE = "naive"  #: masked dense attention in eager PyTorch
    TORCH_EAGER = "torch eager (reference)"  #: an eager PyTorch reference of one of our kernels
    READ_CEILING = "read-ceiling"  #: one streaming read of the same bytes (a bandwidth ceiling)
    #: every name above
    ALL = frozenset({OURS, OURS_ATOMIC, OURS_NOSPLIT, OURS_SPLIT, OURS_BITS, OURS_EAGER_MASK, FLEX, CUDNN, FA2,
                     NAIVE, TORCH_EAGER, READ_CEILING})


class Pass:
    """Pass names, as they appear in the ``"pass"`` field."""
    FWD = "fwd"  #: the forward pass
    BWD = "bwd"  #: the backward pass alone (from a kept forward)
    FWD_BWD = "fwd+bwd"  #: forward and backward
    FWD_GRAPH = "fwd (CUDA graph)"  #: the forward replayed from a CUDA graph (a dynamic layout's fixed capacity)
    LAYOUT = "layout"  #: building a block table
    TRANSPOSE = "transpose"  #: transposing a block table on the device
    DECODE = "decode"  #: decode over the paged cache (all pages or a selection)
    DECODE_DENSE = "decode dense"  #: a dense decode baseline on contiguous K/V
    DECODE_BLOCK_MASK = "decode block mask"  #: FlexAttention decode over kept 128-token blocks
    DECODE_GRAPH = "decode (CUDA graph)"  #: decode replayed from a CUDA graph
    SELECT = "select"  #: page selection alone
    SELECT_DECODE = "select+decode"  #: page selection then decode, eager
    SELECT_DECODE_GRAPH = "select+decode (CUDA graph)"  #: the same step replayed from one CUDA graph
    SWEEP = "sweep"  #: one decode tile/split config of a sweep
    BWD_DKDV = "bwd dK/dV pass"  #: device time of the backward's dK/dV pass (its kernel and its column sums)
    BWD_DQ = "bwd dQ pass"  #: device time of the backward's dQ pass (its kernel and its split-row sums)
    READ = "read"  #: a streaming read of the K/V bytes
    POOL = "pool"  #: pooling Q and K by blocks alone (the first kernel of a route)
    ROUTE = "route"  #: content routing: pooled scores and the top-k per query block (no index yet)
    INDEX = "index"  #: the index a routed selection needs before attention (transposed lists; Flex's BlockMask)
    STEP = "route+index+fwd"  #: a routed attention step, eager
    STEP_GRAPH = "route+index+fwd (CUDA graph)"  #: the same step replayed from one CUDA graph
    TRAIN_STEP = "route+index+fwd+bwd"  #: a routed training step (forward and backward), eager
    TRAIN_STEP_GRAPH = "route+index+fwd+bwd (CUDA graph)"  #: the same training step from one CUDA graph
    #: every name above
    ALL = frozenset({FWD, BWD, FWD_BWD, FWD_GRAPH, LAYOUT, TRANSPOSE, DECODE, DECODE_DENSE, DECODE_BLOCK_MASK,
                     DECODE_GRAPH,
                     SELECT, SELECT_DECODE, SELECT_DECODE_GRAPH, SWEEP, BWD_DKDV, BWD_DQ, READ, POOL, ROUTE, INDEX, STEP, STEP_GRAPH,
                     TRAIN_STEP, TRAIN_STEP_GRAPH})


_ROW_KEYS = ("case", "impl", "pass", "ms")


def _check_name(what: str, value: Any, known: frozenset) -> None:
    if not isinstance(value, str) or value not in known:
        raise ValueError(f"{what} must be one of {sorted(known)} (the {what.rstrip('_')} constants of "
                         f"sparseattn.bench.record), got {value!r}")


#: How a row's call was timed: the eager event-timed call, or its CUDA-graph replay (:meth:`Record.time`).
TIMINGS = ("eager", "device")


def check_timing(timing: str) -> str:
    """``timing`` if it is one of :data:`TIMINGS`, else a ValueError naming the argument."""
    if timing not in TIMINGS:
        raise ValueError(f"timing must be 'eager' or 'device', got {timing!r}")
    return timing


@dataclass(frozen=True)
class Record:
    """One measurement: ``case`` (the shape and pattern measured: ``pattern``, ``N``, ``B``, ``dtype``, ...),
    ``impl`` (an :class:`Impl` name), ``pass_`` (a :class:`Pass` name), ``ms`` (median milliseconds, or None
    when the measurement failed and ``extra["error"]`` says why) and ``extra`` (any other fields: ``tflops``,
    ``tbps``, ``config``, ``sweep``, ...).

    Raises:
        ValueError: unknown ``impl`` or ``pass_``, an ``extra`` key that is a row key, or a non-finite ``ms``.
        TypeError: ``case``/``extra`` not dicts with string keys, or ``ms`` not a number or None.
    """
    case: Dict[str, Any]
    impl: str
    pass_: str
    ms: Optional[float]
    extra: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        _check_name("impl", self.impl, Impl.ALL)
        _check_name("pass_", self.pass_, Pass.ALL)
        for name in ("case", "extra"):
            value = getattr(self, name)
            if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
                raise TypeError(f"{name} must be a dict with string keys, got {value!r}")
            object.__setattr__(self, name, dict(value))  # a private copy: the caller's dict may change
        clash = set(self.extra) & set(_ROW_KEYS)
        if clash:
            raise ValueError(f"extra must not repeat the row keys {_ROW_KEYS}, got {sorted(clash)}")
        if self.ms is not None:
            if isinstance(self.ms, bool) or not isinstance(self.ms, (int, float)):
                raise TypeError(f"ms must be a number of milliseconds or None, got {self.ms!r}")
            if not math.isfinite(self.ms):
                raise ValueError(f"ms must be finite (None marks a failed measurement), got {self.ms!r}")

    __hash__ = None  # holds dicts

    @property
    def is_sweep(self) -> bool:
        """A row of a prefill/backward config sweep (``"sweep": true``), not a default-config measurement."""
        return self.extra.get("sweep") is True

    def time(self, timing: str) -> Optional[float]:
        """The row's milliseconds as ``timing`` says: ``"eager"`` the event-timed call (``ms``), ``"device"`` the
        same call replayed from a CUDA graph (``device_ms``; None for a row without one or a failed one)."""
        check_timing(timing)
        return self.ms if timing == "eager" or self.ms is None else self.get("device_ms")

    def get(self, key: str, default=None):
        """A field of ``extra`` (``tflops``, ``tbps``, ``bytes``, ...)."""
        return self.extra.get(key, default)

    def to_json(self) -> dict:
        """The JSON row: ``{"case", "impl", "pass", "ms", ...extra}``."""
        return {"case": dict(self.case), "impl": self.impl, "pass": self.pass_, "ms": self.ms, **self.extra}

    @classmethod
    def from_json(cls, row: dict) -> "Record":
        """A record from a JSON row (the inverse of :meth:`to_json`)."""
        if not isinstance(row, dict):
            raise TypeError(f"a result row must be a dict, got {type(row).__name__}")
        missing = [k for k in _ROW_KEYS if k not in row]
        if missing:
            raise ValueError(f"a result row needs the keys {_ROW_KEYS}; missing {missing} in {row!r}")
        return cls(case=row["case"], impl=row["impl"], pass_=row["pass"], ms=row["ms"],
                   extra={k: v for k, v in row.items() if k not in _ROW_KEYS})


def _match(value: Any, want: Any) -> bool:
    if isinstance(want, (list, tuple, set, frozenset)):
        return value in want
    return value == want


@dataclass(frozen=True)
class BenchFile:
    """A recorded benchmark file: ``meta`` (suite, device, date, versions) and its ``records``."""
    meta: Dict[str, Any]
    records: Tuple[Record, ...]

    __hash__ = None

    @property
    def suite(self) -> str:
        return self.meta["suite"]

    def caption(self) -> str:
        """Where and when the file was measured, for figure titles."""
        m = self.meta
        return f"measured on {m['device']}, {m['date'][:10]}, torch {m['torch']}, triton {m['triton']}"

    def case_fields(self) -> set:
        """Every case field used by some record."""
        return {k for r in self.records for k in r.case}

    def select(self, impl: Union[str, Iterable[str], None] = None, pass_: Union[str, Iterable[str], None] = None,
               *, sweep: Optional[bool] = False, **case) -> List[Record]:
        """Records with this ``impl`` and ``pass_`` (a name or a collection of names; None: any) whose case
        has these field values (a value or a collection of values), in file order. ``sweep=False`` (default)
        leaves out the rows of a config sweep, ``True`` keeps only them, ``None`` keeps both.

        Raises ValueError for an unknown impl or pass name or a case field that no record has: a typo or a
        rename fails here instead of giving an empty series."""
        for what, value, known in (("impl", impl, Impl.ALL), ("pass_", pass_, Pass.ALL)):
            for v in ([] if value is None else [value] if isinstance(value, str) else value):
                _check_name(what, v, known)
        unknown = set(case) - self.case_fields()
        if unknown:
            raise ValueError(f"no record of {self.suite!r} has the case field(s) {sorted(unknown)}; "
                             f"fields: {sorted(self.case_fields())}")
        out = []
        for r in self.records:
            if impl is not None and not _match(r.impl, impl):
                continue
            if pass_ is not None and not _match(r.pass_, pass_):
                continue
            if sweep is not None and r.is_sweep != sweep:
                continue
            if all(k in r.case and _match(r.case[k], v) for k, v in case.items()):
                out.append(r)
        return out

    def one(self, impl: str, pass_: str, *, sweep: Optional[bool] = False, **case) -> Record:
        """The single record of this series and case. Raises LookupError when there is none or several."""
        rows = self.select(impl, pass_, sweep=sweep, **case)
        if len(rows) != 1:
            have = sorted({(r.impl, r.pass_) for r in self.records})
            raise LookupError(f"{len(rows)} records of {self.suite!r} match impl={impl!r} pass={pass_!r} {case}; "
                              f"expected exactly one (series in the file: {have})")
        return rows[0]

    def ms(self, impl: str, pass_: str, *, sweep: Optional[bool] = False, **case) -> Optional[float]:
        """Milliseconds of the single matching record (None if that measurement failed and says why in
        ``error``). Raises LookupError when the record is missing or ambiguous."""
        return self.one(impl, pass_, sweep=sweep, **case).ms

    def distinct(self, field_name: str, **filters) -> list:
        """Sorted distinct values of a case field over the records :meth:`select` returns for ``filters``."""
        return sorted({r.case[field_name] for r in self.select(**filters) if field_name in r.case})

    def to_json(self) -> dict:
        """The file's JSON document (meta keys, then ``results``)."""
        return {**self.meta, "results": [r.to_json() for r in self.records]}

    @classmethod
    def from_json(cls, doc: dict) -> "BenchFile":
        if not isinstance(doc, dict) or not isinstance(doc.get("results"), list):
            raise ValueError("a benchmark file is a JSON object with a 'results' list")
        for key in ("suite", "device", "date", "torch", "triton"):
            if key not in doc:
                raise ValueError(f"a benchmark file needs the meta key {key!r}")
        meta = {k: v for k, v in doc.items() if k != "results"}
        return cls(meta=meta, records=tuple(Record.from_json(r) for r in doc["results"]))


def bench_filename(suite: str, gpu: str, variant: Optional[str] = None) -> str:
    """``<suite>-<gpu>.json``, or ``<suite>-<variant>-<gpu>.json`` (variants: ``sweep``, ``defaults``)."""
    return f"{suite}-{variant}-{gpu}.json" if variant else f"{suite}-{gpu}.json"


def load_path(path: Union[str, pathlib.Path]) -> BenchFile:
    """Read one recorded file."""
    with open(path) as f:
        return BenchFile.from_json(json.load(f))


def check_merge_source(old: BenchFile, suite: str, device: Optional[str], where: str = "the file") -> BenchFile:
    """``old`` if a ``--merge`` run of ``suite`` on ``device`` may keep its rows: the same suite, measured on the
    same device (``device`` None: not checked, e.g. a CPU test); else ValueError naming ``where``."""
    if old.suite != suite:
        raise ValueError(f"--merge expects a {suite!r} file, got suite {old.suite!r} ({where})")
    if device is not None and old.meta.get("device") != device:
        raise ValueError(f"--merge: {where} was measured on {old.meta.get('device')!r}, this run is on {device!r}")
    return old


def load(suite: str, gpu: str = "h200", *, sweep: bool = False,
         directory: Union[str, pathlib.Path, None] = None) -> BenchFile:
    """The recorded ``<suite>-<gpu>.json`` (``sweep=True``: ``<suite>-sweep-<gpu>.json``) from ``directory``
    (default: ``book/data/bench`` of this checkout)."""
    d = pathlib.Path(directory) if directory is not None else DEFAULT_DIR
    return load_path(d / bench_filename(suite, gpu, "sweep" if sweep else None))
