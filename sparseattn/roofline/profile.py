"""Where did a step's time go? ``profile_step`` runs a step under ``torch.profiler`` and splits it the way the
cost model does: route / index / kernel on the device, and launch = wall time the device was not busy.

Buckets, by device-kernel name (regular expressions, matched against the start of the name):

* ``kernel``: our attention kernels — ``sparse_fwd_kernel``, ``dkdv_kernel``, ``dq_kernel``,
  ``decode_split_kernel``, ``merge_splits_kernel``;
* ``route``: selection — ``page_bound_kernel``, ``topk_pages_kernel`` (and any name in ``route=``);
* ``index``: every other device kernel and copy (torch ops: layout building, transposition, the backward's
  delta and split-column sums, casts), plus any name in ``index=``;
* ``launch``: wall time minus the time some kernel was running (host work, launch gaps, synchronisation).

On a machine without CUDA the profiler records CPU operators only: device buckets stay empty, ``index`` is
the time inside top-level torch operators and ``launch`` the rest of the wall time (the Triton interpreter's
work shows up there), so the helper still runs and its arithmetic can be checked.
"""
from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Dict, Iterable, List, Sequence, Tuple

import torch

__all__ = ["StepProfile", "profile_step", "KERNEL_PATTERNS", "ROUTE_PATTERNS", "bucket_of", "busy_ms",
           "example_steps"]

KERNEL_PATTERNS = (r"sparse_fwd_kernel", r"dkdv_kernel", r"dq_kernel", r"bwd_kernel", r"decode_split_kernel",
                   r"merge_splits_kernel")
ROUTE_PATTERNS = (r"page_bound_kernel", r"topk_pages_kernel")


def bucket_of(name: str, route: Sequence[str] = (), index: Sequence[str] = ()) -> str:
    """``"kernel"``, ``"route"`` or ``"index"`` for a device kernel's name."""
    for pat in (*ROUTE_PATTERNS, *route):
        if re.match(pat, name):
            return "route"
    for pat in index:
        if re.match(pat, name):
            return "index"
    for pat in KERNEL_PATTERNS:
        if re.match(pat, name):
            return "kernel"
    return "index"


def busy_ms(intervals: Iterable[Tuple[float, float]]) -> float:
    """Length of the union of ``(start, end)`` intervals (same unit in, milliseconds out when given in ms)."""
    total, cur_s, cur_e = 0.0, None, None
    for s, e in sorted(intervals):
        if cur_e is None or s > cur_e:
            if cur_e is not None:
                total += cur_e - cur_s
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    if cur_e is not None:
        total += cur_e - cur_s
    return total


@dataclass
class StepProfile:
    """Milliseconds per bucket for one step; ``kernels``: ``(name, bucket, ms, calls)`` per device kernel name
    (CPU operators on a machine without CUDA)."""

    wall_ms: float
    device_busy_ms: float
    buckets: Dict[str, float]
    kernels: List[tuple] = field(default_factory=list)
    device: str = "cuda"

    def as_dict(self, top: int = 20) -> dict:
        """JSON-ready: the totals, the buckets and the ``top`` device kernels by time."""
        return {"wall_ms": self.wall_ms, "device_busy_ms": self.device_busy_ms, "buckets": dict(self.buckets),
                "device": self.device, "kernels": [list(k) for k in sorted(self.kernels, key=lambda x: -x[2])[:top]]}

    def __str__(self) -> str:
        lines = [f"step: {self.wall_ms:.4g} ms wall, device busy {self.device_busy_ms:.4g} ms ({self.device})"]
        for b in ("route", "index", "kernel", "launch"):
            lines.append(f"  {b:7s} {self.buckets[b]:9.4g} ms")
        for name, b, ms, n in sorted(self.kernels, key=lambda k: -k[2])[:12]:
            lines.append(f"    {b:7s} {ms:9.4g} ms  x{n:<4d} {name[:70]}")
        return "\n".join(lines)


def _split(device_events: List[tuple], wall_ms: float, route=(), index=(), device="cuda") -> StepProfile:
    """Buckets from ``(name, start_ms, end_ms)`` device events and the step's wall time."""
    buckets = {"route": 0.0, "index": 0.0, "kernel": 0.0}
    per: Dict[str, list] = {}
    for name, s, e in device_events:
        b = bucket_of(name, route, index)
        buckets[b] += e - s
        entry = per.setdefault(name, [b, 0.0, 0])
        entry[1] += e - s
        entry[2] += 1
    busy = busy_ms((s, e) for _, s, e in device_events)
    buckets["launch"] = max(0.0, wall_ms - busy)
    return StepProfile(wall_ms, busy, buckets, [(n, b, ms, c) for n, (b, ms, c) in per.items()], device)


def profile_step(fn, *args, warmup: int = 1, route: Sequence[str] = (), index: Sequence[str] = (),
                 **kwargs) -> StepProfile:
    """Run ``fn(*args, **kwargs)`` ``warmup`` times, then once under ``torch.profiler``, and split its time
    into route / index / kernel / launch (see the module docstring for the name patterns; ``route`` and
    ``index`` add patterns of your own, e.g. a routing kernel of your model)."""
    from torch.profiler import ProfilerActivity, profile
    cuda = torch.cuda.is_available()
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    for _ in range(warmup):
        fn(*args, **kwargs)
    sync()
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        t0 = time.perf_counter()
        fn(*args, **kwargs)
        sync()
        wall_ms = (time.perf_counter() - t0) * 1e3
    events = prof.events()
    if cuda:
        dev = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in events
               if _is_device(e)]
        return _split(dev, wall_ms, route, index, "cuda")
    # CPU: the top-level operators (no parent) stand in for device work
    top = [(e.name, e.time_range.start / 1e3, e.time_range.end / 1e3) for e in events
           if getattr(e, "cpu_parent", None) is None and e.name.startswith("aten::")]
    return _split(top, wall_ms, route, index, "cpu")


def _is_device(e) -> bool:
    dt = getattr(e, "device_type", None)
    return dt is not None and getattr(dt, "name", str(dt)).upper().endswith(("CUDA", "PRIVATEUSE1")) \
        and e.time_range.end > e.time_range.start



def example_steps(device="cuda", *, N: int = 16384, heads: int = 16, head_dim: int = 128, dtype=torch.bfloat16,
                  batch: int = 8, seq_len: int = 32768, page_size: int = 16, keep: float = 0.1) -> Dict[str, tuple]:
    """The two steps the book profiles, as ``name -> (fn, description)`` with ``fn`` taking no argument:

    * a training step of ``sinks_window(64, 1024)`` attention at length ``N``: the layout built inside the
      step (as a model that builds its mask every step), forward and backward;
    * a decode step: :func:`~sparseattn.select_pages` keeping ``keep`` of the pages, then
      :func:`~sparseattn.sparse_decode`, eager, ``batch`` sequences of ``seq_len`` tokens, 32 query and 8
      KV heads."""
    from .. import patterns as P
    from ..layout import BlockLayout
    from ..ops import sparse_attention, sparse_decode
    from ..routing import select_pages
    from .cases import decode_setup
    dev = torch.device(device)
    q, k, v = (torch.randn(1, heads, N, head_dim, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
    do = torch.randn(1, heads, N, head_dim, device=dev, dtype=dtype)

    def train_step():
        layout = BlockLayout.from_mask_mod(P.sinks_window(64, 1024), N, N, 128, 128, device=dev)
        sparse_attention(q, k, v, layout).backward(do)

    _, _, cache, qd = decode_setup(batch, seq_len, page_size, 32, 8, head_dim, dtype, device=dev)
    topk = max(1, round(keep * -(-seq_len // page_size)))

    def decode_step():
        sparse_decode(qd, cache, pages=select_pages(qd, cache, topk))

    return {f"train_step_sinks64+window1024_N{N}": (train_step, f"layout build + forward + backward, "
                                                               f"sinks64+window1024, B=1, H={heads}, N={N}, "
                                                               f"D={head_dim}"),
            f"decode_step_keep{keep:.2f}_L{seq_len}": (decode_step, f"select_pages + sparse_decode (eager), "
                                                                     f"B={batch}, 32/8 heads, L={seq_len}, "
                                                                     f"page size {page_size}, keep {keep:.2f}")}
