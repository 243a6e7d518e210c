"""The cost model: ``T = T_route + T_index + max(F_tile / P_eff, D_HBM / W_eff) + T_launch``, per launch.

For each kernel launch of a pass (:mod:`.counts` gives its programs, steps, flops and bytes):

* compute side: every program costs ``program_overhead + full steps + (1 + partial_overhead) x partial
  steps`` in units of one full step at one SM's share of the calibrated matmul rate,
  ``u = flops_per_step / (P x eff_compute / SMs)``. Programs are dealt to the SMs in dispatch order, each to
  the SM that frees first (what the hardware's block scheduler does); the finish time of the last one is the
  compute term. So ``F_tile / P_eff`` includes the partial-tile mask work, per-program prologues and the
  tail of the last wave; ``P_eff = F_tile / compute term`` is reported.
* memory side: ``D_HBM / (W x eff_memory)`` with the compulsory HBM bytes.
* a launch takes the larger of the two. Eager torch ops around the kernels (the backward's delta, split-column
  sums) are memory-bound: their bytes over ``W_eff`` plus ``launch_us`` each.
* decode: a step of the split kernel reads ``block_n`` tokens of K and V and does two skinny matmuls; its
  time is one SM's share of the bandwidth, or the load latency when few programs are in flight, so the
  step time ``step_us`` is calibrated directly and the schedule term counts on the memory side.
* ``T_launch``: a calibrated fixed device-side cost per call, plus, for an eager call, the host's excess:
  calls issued back to back take ``max(device time, T_host)`` (:mod:`.host`: ``T_host`` per op and pass,
  from the host suite, with the model's launch count); timed by ``do_bench``, with an L2 flush before every
  call, the device time while ``T_host`` fits in the flush and the device time (``flush_ms``). Eager decode:
  the larger of its host time and the device time likewise. A CUDA-graph replay has no host term.
* ``T_index``: rebuilding the layout (and, for the backward, its transposed lists), from the layout bench:
  a fixed cost plus the cells a mask_mod without an exact tile rule must evaluate. Zero unless
  ``rebuild_layout=True`` (the bench times the op on a prebuilt layout). ``T_route``: given (ms) or 0.

Efficiencies and overheads are fitted on recorded H200 runs (see :mod:`.calibrate`) and stored in the
ceilings record, per implementation (ours, FlexAttention, cuDNN) and pass.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Dict, List, Optional

import numpy as np
import torch

from ..balance import makespan  # one home: the load-balance module (re-exported here)
from ..layout import BlockLayout
from ..ops.config import BwdConfig, DecodeConfig, FwdConfig, clip_tiles, default_config
from ..paged import PagedKVCache, PageSelection
from ..patterns import TileGrid, tile_rule_of
from .ceilings import Ceilings, ceilings as _ceilings, device_slug, load_record
from .counts import Shape, Work, as_shape, bwd_work, decode_input, decode_work, fwd_work
from .host import eager_ms as _eager_ms
from .host import flush_ms as _flush_ms
from .host import host_ms as _host_ms

__all__ = ["Cost", "cost", "work_of", "predict", "makespan", "model_params", "host_params", "IMPLS"]

IMPLS = ("sparseattn", "flex", "cudnn")
PASSES = ("fwd", "bwd", "decode")


def model_params(impl: str, pass_: str, *, deterministic: bool = True, record: Optional[dict] = None) -> dict:
    """The calibrated parameters of ``impl`` for ``pass_`` from the ceilings record (the H200's by default)."""
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    record = record if record is not None else load_record("h200")
    key = f"{impl}/{pass_}" if (pass_ != "bwd" or deterministic or impl != "sparseattn") else "sparseattn/bwd-atomic"
    model = record["model"]
    if key not in model:
        raise ValueError(f"the ceilings record has no calibrated model for {key!r}; known: {sorted(model)}")
    params = dict(model[key]["params"])
    for name, src in model[key].get("tied", {}).items():  # a parameter the data cannot identify: shared
        g, p = src.split(":")
        params[name] = model[g]["params"][p]
    return params


def host_params(impl: str, pass_: str, *, path: Optional[str] = None, record: Optional[dict] = None) -> Optional[dict]:
    """The host-term parameters (:mod:`.host`) of ``impl``'s eager ``pass_`` for a host path (default: the
    code's current one) from the ceilings record; None for decode (its own ``host_ms``) or a record without
    a host section."""
    record = record if record is not None else load_record("h200")
    sec = record.get("host")
    if pass_ == "decode" or not sec:
        return None
    return sec["paths"][path or sec["current"]]["params"].get(f"{impl}/{pass_}")


@dataclass
class Cost:
    """Every term of the model for one call (milliseconds unless named otherwise).

    ``predicted_ms = t_route_ms + t_index_ms + kernels_ms + t_launch_ms`` where ``kernels_ms`` sums, over
    the launches of the pass, ``max(compute, memory)`` (and the eager torch ops' memory time);
    ``t_compute_ms`` and ``t_memory_ms`` are the sums of the two sides; ``t_latency_ms`` is decode's schedule
    term (steps of ``step_us`` dealt to the SMs). ``bound`` names the largest of compute, memory (for decode
    the larger of bytes / W_eff and the schedule) and overhead (launch + index + route)."""

    impl: str
    pass_: str
    shape: Shape
    config: object
    flops: float
    bytes_requested: Dict[str, float]
    bytes_hbm: Dict[str, float]
    launches: int
    t_route_ms: float
    t_index_ms: float
    t_compute_ms: float
    t_memory_ms: float
    t_latency_ms: float
    kernels_ms: float
    t_launch_ms: float
    predicted_ms: float
    bound: str
    P_eff_tflops: float
    W_eff_tbps: float
    index_build_ms: float
    kernels: List[dict] = field(default_factory=list)
    ceilings: Optional[Ceilings] = None
    t_host_ms: float = 0.0  # the eager call's host time (0 for a CUDA-graph replay); in t_launch_ms when it wins
    t_flush_ms: float = 0.0  # the L2 flush before each call the host may hide behind (``l2_flush``; else 0)

    @property
    def D_hbm(self) -> float:
        return float(sum(self.bytes_hbm.values()))

    @property
    def intensity(self) -> float:
        """FLOP per compulsory HBM byte."""
        return self.flops / max(self.D_hbm, 1.0)

    @property
    def tile_intensity(self) -> float:
        """FLOP per requested byte: the intensity a tile has when nothing is reused across programs."""
        return self.flops / max(sum(self.bytes_requested.values()), 1.0)

    @property
    def terms(self) -> Dict[str, float]:
        return {"route": self.t_route_ms, "index": self.t_index_ms, "compute": self.t_compute_ms,
                "memory": self.t_memory_ms, "latency": self.t_latency_ms, "launch": self.t_launch_ms}

    def as_dict(self) -> dict:
        return {"impl": self.impl, "pass": self.pass_, "flops": self.flops, "bytes_hbm": self.bytes_hbm,
                "bytes_requested": self.bytes_requested, "launches": self.launches, **{
                    f"t_{k}_ms": v for k, v in self.terms.items()}, "kernels_ms": self.kernels_ms,
                "predicted_ms": self.predicted_ms, "bound": self.bound, "P_eff_tflops": self.P_eff_tflops,
                "W_eff_tbps": self.W_eff_tbps, "t_host_ms": self.t_host_ms, "t_flush_ms": self.t_flush_ms,
                "kernels": self.kernels}

    def __str__(self) -> str:
        # a term the model does not price for this call (decode's schedule is a latency term, not compute;
        # no route, no index build) reads "not priced", not "0 TFLOP/s -> 0 ms"
        compute = (f"at P_eff {self.P_eff_tflops:.4g} TFLOP/s -> {self.t_compute_ms:.4g} ms" if self.t_compute_ms
                   else "(compute term not priced)")
        lines = [f"{self.impl} {self.pass_}: predicted {self.predicted_ms:.4g} ms ({self.bound}-bound)",
                 f"  F_tile {self.flops / 1e12:.4g} TFLOP {compute}",
                 f"  D_HBM {self.D_hbm / 1e9:.4g} GB at W_eff {self.W_eff_tbps:.3g} TB/s -> {self.t_memory_ms:.4g} ms"
                 f" (requested {sum(self.bytes_requested.values()) / 1e9:.4g} GB)"]
        if self.t_latency_ms:
            lines.append(f"  latency-bound schedule {self.t_latency_ms:.4g} ms")
        if self.t_host_ms and self.t_flush_ms:
            lines.append(f"  T_host {self.t_host_ms:.4g} ms per eager call, timed with a {self.t_flush_ms:.3g} ms L2 "
                         f"flush before it (the device time while T_host fits in the flush and the device time, "
                         f"else max(device, host))")
        elif self.t_host_ms:
            lines.append(f"  T_host {self.t_host_ms:.4g} ms per eager call (calls back to back take max(device, "
                         f"host))")
        priced = lambda t: f"{t:.4g} ms" if t else "not priced"  # noqa: E731
        lines.append(f"  T_launch {self.t_launch_ms:.4g} ms ({self.launches} launches), T_index "
                     f"{priced(self.t_index_ms)}, T_route {priced(self.t_route_ms)}")
        return "\n".join(lines)


# ---- configs ---------------------------------------------------------------------------------------------------
def _family(ceil: Ceilings) -> str:
    return "sm90" if device_slug(ceil.device) in ("h200", "h100", "h800", "h20", "gh200") else "default"


def _config(pass_: str, impl: str, layout: Optional[BlockLayout], s: Shape, ceil: Ceilings, config):
    if config is not None:
        want = {"fwd": FwdConfig, "bwd": BwdConfig, "decode": DecodeConfig}[pass_]
        if not isinstance(config, want):
            raise TypeError(f"config for pass_={pass_!r} must be a {want.__name__}, got {type(config).__name__}")
        return config if pass_ == "decode" else clip_tiles(config, layout.block_q, layout.block_k)
    if impl != "sparseattn" and pass_ != "decode":  # baselines: 128-row query tiles (their own kernels)
        cfg = FwdConfig(block_m=128, block_n=128, num_warps=8, num_stages=2) if pass_ == "fwd" else \
            BwdConfig(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=2)
    else:
        cfg = default_config(pass_, _family(ceil), s.dtype, s.D)
    return cfg if pass_ == "decode" else clip_tiles(cfg, layout.block_q, layout.block_k)


def work_of(layout, shape=None, pass_: str = "fwd", config=None, deterministic: bool = True, *, pages=None,
            keep=None, seqs=None, impl: str = "sparseattn", device=None) -> Work:
    """The :class:`~.counts.Work` of one call (what :func:`cost` prices)."""
    ceil = device if isinstance(device, Ceilings) else _ceilings(device)
    s = _shape_for(layout, shape, pass_)
    cfg = _config(pass_, impl, layout if pass_ != "decode" else None, s, ceil, config)
    if pass_ == "fwd":
        return fwd_work(layout, s, cfg, order="natural" if impl == "flex" else "longest", sms=ceil.sm_count)
    if pass_ == "bwd":
        # FlexAttention's backward recomputes S for dQ in programs of its own (7 tile matmuls, like ours);
        # cuDNN's accumulates dQ inside the dK/dV loop (5, like our atomic path)
        det = {"sparseattn": deterministic, "flex": True, "cudnn": False}[impl]
        return bwd_work(layout, s, cfg, deterministic=det)
    inp = decode_input(s, cache=layout, pages=pages, keep=keep, seqs=seqs)
    return decode_work(s, inp, cfg, ceil.sm_count)


def _shape_for(layout, shape, pass_: str) -> Shape:
    if pass_ not in PASSES:
        raise ValueError(f"pass_ must be one of {PASSES}, got {pass_!r}")
    if pass_ == "decode":
        if layout is not None and not isinstance(layout, PagedKVCache):
            raise TypeError(f"decode takes a PagedKVCache or None as its first argument, got {type(layout).__name__}")
        if shape is None:
            raise ValueError("decode needs a shape (at least B and Hq)")
        s = as_shape(shape)
        if layout is not None:  # the cache fixes KV heads, head dim and dtype
            s = Shape(B=s.B, Hq=s.Hq, Hkv=layout.num_kv_heads, D=layout.head_dim, dtype=layout.dtype,
                      seq_len=s.seq_len, page_size=layout.page_size)
        return s
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"pass_={pass_!r} needs a BlockLayout, got {type(layout).__name__}")
    return as_shape(shape) if shape is not None else Shape(B=layout.B, Hq=layout.H)


# ---- pricing ---------------------------------------------------------------------------------------------------
def predict(work: Work, params: dict, ceil: Ceilings, dtype, *, graph: bool = False,
            host: Optional[dict] = None, flush_ms: float = 0.0) -> dict:
    """Price a :class:`~.counts.Work` with a parameter set: the terms of :class:`Cost` (without route/index).
    ``host``: the host-term parameters of the op and pass (:mod:`.host`); an eager prefill call then takes
    ``max(device time, T_host)`` (calls issued back to back: the slower side sets the rate), or, timed with a
    device-side L2 flush of ``flush_ms`` before each call (``do_bench``), its device time for as long as
    ``T_host`` fits in the flush and the device time."""
    S = ceil.sm_count
    W = ceil.hbm_read_tbps * 1e12 * params["eff_memory"]  # bytes/s
    kernels, compute, memory, latency, total = [], 0.0, 0.0, 0.0, 0.0
    decode = work.pass_ == "decode"
    for k in work.kernels:
        mem_ms = k.hbm_bytes / W * 1e3
        units = (params["program_overhead"] + k.steps_full.double()
                 + k.steps_partial.double() * (1.0 + params.get("partial_overhead", 0.0))).numpy()
        if k.flops_per_step == 0:  # the merge: a handful of bytes per program
            sched_ms, unit_ms = 0.0, 0.0
        elif decode:
            unit_ms = params["step_us"] * 1e-3
            sched_ms = makespan(units, S) * unit_ms
        else:
            P = ceil.matmul(dtype) * 1e12 * params["eff_compute"] / S  # flop/s of one SM
            unit_ms = k.flops_per_step / P * 1e3
            sched_ms = makespan(units, S) * unit_ms
        ideal_ms = float(units.sum()) / S * unit_ms
        t = max(sched_ms, mem_ms)
        total += t
        memory += mem_ms
        if decode:
            latency += sched_ms
        else:
            compute += sched_ms
        kernels.append({"name": k.name, "programs": k.programs, "steps": k.steps, "flops": k.flops,
                        "hbm_bytes": k.hbm_bytes, "requested_bytes": k.requested_bytes,
                        "schedule_ms": sched_ms, "balanced_ms": ideal_ms, "tail_ms": sched_ms - ideal_ms,
                        "memory_ms": mem_ms, "ms": t})
    for op in work.torch_ops:
        ms = op.hbm_bytes / W * 1e3 + op.launches * ceil.launch_us * 1e-3
        total += ms
        memory += op.hbm_bytes / W * 1e3
        kernels.append({"name": op.name, "programs": 0, "steps": 0, "flops": 0.0, "hbm_bytes": op.hbm_bytes,
                        "requested_bytes": op.hbm_bytes, "schedule_ms": 0.0, "balanced_ms": 0.0, "tail_ms": 0.0,
                        "memory_ms": op.hbm_bytes / W * 1e3, "ms": ms})
    launch = params["call_ms"]
    t_host = 0.0
    if decode and not graph:  # eager: the host issues the step while the device runs the previous one
        t_host = params["host_ms"]
        launch = params["call_ms"] + max(0.0, t_host - (total + params["call_ms"]))
    elif not decode and params.get("call_form", "sum") == "max":  # records fitted before the host term
        launch = max(0.0, params["call_ms"] - total)
    if not decode and not graph and host:
        t_host = _host_ms(host, work.launches)
        eager = _eager_ms(total + launch, t_host, flush_ms)
        if eager > total + launch:  # the host's excess over the device side, when it shows
            launch = eager - total
    return {"compute": compute, "memory": memory, "latency": latency, "kernels_ms": total, "launch": launch,
            "host": t_host, "kernels": kernels}


def index_build_ms(layout: BlockLayout, pass_: str, record: Optional[dict] = None) -> float:
    """Estimated time to rebuild ``layout`` on the device (and, for the backward, its transposed lists)."""
    record = record if record is not None else load_record("h200")
    p = record["model"]["index/layout"]["params"]
    ms = p["fixed_ms"] + p["ns_per_cell"] * 1e-6 * evaluated_cells(layout)
    if pass_ == "bwd":
        ms += record["model"]["index/transpose"]["params"]["fixed_ms"]
    return ms


def evaluated_cells(layout: BlockLayout) -> int:
    """Cells ``from_mask_mod`` evaluates for this layout: the tiles its mask_mod's tile rule leaves undecided
    (every tile when the mask_mod has no rule; none for a layout without a mask_mod)."""
    if layout.mask_mod is None:
        return 0
    return evaluated_cells_of(layout.mask_mod, layout.q_len, layout.kv_len, layout.block_q, layout.block_k,
                              layout.B, layout.H)


def evaluated_cells_of(mask_mod, q_len: int, kv_len: int, block_q: int = 128, block_k: int = 128, B: int = 1,
                       H: int = 1) -> int:
    """Cells ``BlockLayout.from_mask_mod(mask_mod, q_len, kv_len, ...)`` evaluates one by one: those of the
    tiles the mask_mod's tile rule cannot classify."""
    grid = TileGrid(max(kv_len - q_len, 0), q_len, kv_len, block_q, block_k, B, H, torch.device("cpu"))
    shape = (grid.B, grid.H, grid.nq, grid.nk)
    any_lo, any_hi, all_lo, all_hi = (torch.broadcast_to(x.cpu(), shape) for x in tile_rule_of(mask_mod)(grid))
    undecided = any_hi & ~all_lo & ~(any_lo & ~all_hi)
    rows = torch.clamp(q_len - torch.arange(grid.nq) * block_q, max=block_q)
    cols = torch.clamp(kv_len - torch.arange(grid.nk) * block_k, max=block_k)
    return int((undecided.long() * rows.view(-1, 1) * cols.view(1, -1)).sum())


def cost(layout, shape=None, pass_: str = "fwd", routing=None, config=None, deterministic: bool = True, *,
         pages: Optional[PageSelection] = None, keep: Optional[float] = None, seqs=None, impl: str = "sparseattn",
         graph: bool = False, rebuild_layout: bool = False, device=None,
         host_ms: Optional[float] = None, l2_flush: bool = False) -> Cost:
    """Predict one call of ``impl`` (``"sparseattn"``, ``"flex"`` or ``"cudnn"``) on ``device``'s ceilings.

    - prefill (``pass_="fwd"`` / ``"bwd"``): ``layout`` is the :class:`BlockLayout` (for cuDNN, its dense or
      causal envelope), ``shape`` a :class:`Shape` or dict ``(B, Hq, Hkv, D, dtype)``; ``config`` a
      ``FwdConfig``/``BwdConfig`` (default: the tuned table for the device's family); ``deterministic=False``
      prices the atomic backward.
    - decode: ``layout`` is a :class:`PagedKVCache` (with ``pages`` a :class:`PageSelection`, or ``keep`` a
      kept fraction) or None with ``shape`` carrying ``seq_len`` and ``page_size``. ``graph=True`` prices a
      CUDA-graph replay (no host time).
    - ``routing``: the routing step's time in ms (a number) or None; ``rebuild_layout=True`` adds the layout
      build to the step. ``device``: None (the recorded H200), a device name, a CUDA device or a
      :class:`Ceilings`.
    - eager prefill (``graph=False``): calls issued back to back take the slower of device and host time;
      ``host_ms``: this machine's host time of one call of the op in ms (measured, e.g. by the crossover
      suite at the start of each part) instead of the recorded one; ``l2_flush=True``: priced as the bench
      times the call (Triton's ``do_bench``, a device-side L2 flush before every call), where host work hides
      behind the flush and the kernels until it outlasts both (:mod:`.host`).
    """
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")
    if routing is not None and (isinstance(routing, bool) or not isinstance(routing, (int, float))
                                or not math.isfinite(routing) or routing < 0):
        raise TypeError(f"routing must be the routing time in ms (a number >= 0) or None, got {routing!r}")
    ceil = device if isinstance(device, Ceilings) else _ceilings(device)
    record = _record_for(ceil)
    s = _shape_for(layout, shape, pass_)
    if pass_ == "decode" and impl == "flex":
        raise ValueError("FlexAttention decode is not modelled (its recorded times do not follow the bytes read)")
    if pass_ != "decode" and (pages is not None or keep is not None):
        raise ValueError("pages/keep apply to pass_='decode' only")
    work = work_of(layout, s, pass_, config, deterministic, pages=pages, keep=keep, seqs=seqs, impl=impl,
                   device=ceil)
    params = model_params(impl, pass_, deterministic=deterministic, record=record)
    host = host_params(impl, pass_, record=record)
    if host_ms is not None:
        if isinstance(host_ms, bool) or not isinstance(host_ms, (int, float)) or not host_ms >= 0:
            raise TypeError(f"host_ms must be a host time in ms (a number >= 0) or None, got {host_ms!r}")
        host = {"host_ms": float(host_ms), "host_launch_ms": 0.0}
    if not isinstance(l2_flush, bool):
        raise TypeError(f"l2_flush must be a bool, got {type(l2_flush).__name__}")
    t_flush = _flush_ms(ceil) if l2_flush and not graph else 0.0
    terms = predict(work, params, ceil, s.dtype, graph=graph, host=host, flush_ms=t_flush)
    t_route = float(routing or 0.0)
    build = index_build_ms(layout, pass_, record) if pass_ != "decode" else 0.0
    t_index = build if rebuild_layout else 0.0
    predicted = t_route + t_index + terms["kernels_ms"] + terms["launch"]
    # decode's schedule term is each SM's share of the bandwidth (and latency when few programs are in
    # flight): bytes moving, so it counts on the memory side
    overhead = terms["launch"] + t_route + t_index
    memory_side = max(terms["memory"], terms["latency"])
    bound = max((("compute", terms["compute"]), ("memory", memory_side), ("overhead", overhead)),
                key=lambda x: x[1])[0]
    return Cost(impl=impl, pass_=pass_, shape=s, config=work.config, flops=work.flops,
                bytes_requested=work.requested, bytes_hbm=work.hbm, launches=work.launches, t_route_ms=t_route,
                t_index_ms=t_index, t_compute_ms=terms["compute"], t_memory_ms=terms["memory"],
                t_latency_ms=terms["latency"], kernels_ms=terms["kernels_ms"], t_launch_ms=terms["launch"],
                predicted_ms=predicted, bound=bound,
                P_eff_tflops=work.flops / (terms["compute"] * 1e9) if terms["compute"] else 0.0,
                W_eff_tbps=ceil.hbm_read_tbps * params["eff_memory"], index_build_ms=build,
                kernels=terms["kernels"], ceilings=ceil, t_host_ms=terms["host"],
                t_flush_ms=t_flush if terms["host"] else 0.0)


def _record_for(ceil: Ceilings) -> dict:
    """The record whose calibrated efficiencies apply: the device's own, else the H200's (efficiencies are
    fractions of the ceilings, so they carry over approximately; re-calibrate for accuracy)."""
    try:
        return load_record(device_slug(ceil.device))
    except FileNotFoundError:
        return load_record("h200")
