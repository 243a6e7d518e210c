"""Hardware ceilings of one GPU: matmul rate per dtype, HBM read bandwidth, launch latency, SM count.

Recorded values ship as package data (``sparseattn/data/ceilings-<slug>.json``), so CPU readers and pip users
get the H200's numbers without a GPU; every value there says where it came from. On a GPU whose name has no
record, :func:`ceilings` measures once (:func:`measure_ceilings`) and caches the result per device name, in
memory and, when ``SPARSEATTN_CEILINGS_CACHE`` names a directory, in a JSON file there.

Nothing here touches a GPU at import time.
"""
from __future__ import annotations

import dataclasses
import datetime
import functools
import json
import os
import pathlib
import re
from dataclasses import dataclass, field
from typing import Callable, Dict, Optional

import torch

from .timing import graph_step, time_gpu, time_host

__all__ = ["Ceilings", "ceilings", "measure_ceilings", "device_slug", "record_path", "load_record",
           "READ_CONFIGS", "stream_read", "best_read"]

DATA_DIR = pathlib.Path(__file__).resolve().parent.parent / "data"
CACHE_ENV = "SPARSEATTN_CEILINGS_CACHE"
DTYPE_NAMES = {torch.float16: "float16", torch.bfloat16: "bfloat16", torch.float32: "float32"}


@dataclass(frozen=True)
class Ceilings:
    """What one GPU can do at best. ``matmul_tflops`` is keyed by dtype name (``"bfloat16"``, ...; fp32 is
    the IEEE rate, which is what the kernels use for fp32 inputs), ``hbm_read_tbps`` a streaming read,
    ``launch_us`` the device-side cost of one more kernel in a launch sequence (an empty kernel replayed in a
    CUDA graph), ``host_call_us`` the wall time of one eager call of an op on a tiny problem (keyed by op:
    ``"fwd"``, ``"decode"``). ``sources`` says, per field, where each number comes from."""

    device: str
    sm_count: int
    matmul_tflops: Dict[str, float]
    hbm_read_tbps: float
    launch_us: float
    host_call_us: Dict[str, float] = field(default_factory=dict)
    l2_mib: Optional[float] = None
    sources: Dict[str, str] = field(default_factory=dict)

    def matmul(self, dtype) -> float:
        """Matmul ceiling in TFLOP/s for ``dtype`` (a torch dtype or its name)."""
        name = DTYPE_NAMES.get(dtype, dtype)
        if name not in self.matmul_tflops:
            raise ValueError(f"no matmul ceiling for dtype {dtype!r} on {self.device}; "
                             f"known: {sorted(self.matmul_tflops)}")
        return self.matmul_tflops[name]

    def ridge(self, dtype) -> float:
        """FLOP per HBM byte where the matmul and bandwidth ceilings meet (the roofline's ridge point)."""
        return self.matmul(dtype) * 1e12 / (self.hbm_read_tbps * 1e12)

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "Ceilings":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ValueError(f"unknown Ceilings fields {sorted(unknown)}")
        return cls(**d)


def device_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"`` (the suffix of bench and ceilings files)."""
    name = name.lower().replace("nvidia", "").replace("geforce", "")
    m = re.search(r"([a-z]+\d+[a-z]*)", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def record_path(slug: str) -> pathlib.Path:
    return DATA_DIR / f"ceilings-{slug}.json"


@functools.lru_cache(maxsize=None)
def load_record(slug: str = "h200") -> dict:
    """The packaged record for a device slug: ``{"device", "ceilings", "model", "calibration", ...}``.
    Raises FileNotFoundError when there is none."""
    path = record_path(slug)
    if not path.exists():
        raise FileNotFoundError(f"no recorded ceilings for {slug!r} ({path.name} is not in {DATA_DIR})")
    return json.loads(path.read_text())


def _recorded(slug: str) -> Optional[Ceilings]:
    try:
        rec = load_record(slug)
    except FileNotFoundError:
        return None
    return Ceilings.from_json(rec["ceilings"])


_MEASURED: Dict[str, Ceilings] = {}


def ceilings(device=None) -> Ceilings:
    """Ceilings for ``device``: a device name (``"NVIDIA H200"``, ``"h200"``), a ``torch.device``, or None.

    None or a CPU device gives the recorded H200 (what the book's figures were measured on). A CUDA device
    whose name has a record gives the record; otherwise the GPU is measured once (about a minute) and cached
    per device name, in memory and in ``$SPARSEATTN_CEILINGS_CACHE/ceilings-<slug>.json`` when that variable
    is set."""
    if device is None:
        return _recorded("h200")
    if isinstance(device, str) and not device.startswith(("cuda", "cpu")):
        found = _recorded(device_slug(device)) or _recorded(device.lower())
        if found is None:
            raise ValueError(f"no recorded ceilings for device {device!r}; pass a CUDA device to measure them")
        return found
    dev = torch.device(device)
    if dev.type == "cpu":
        return _recorded("h200")
    if dev.type != "cuda":
        raise ValueError(f"device must be a CUDA device, a device name or None, got {device!r}")
    name = torch.cuda.get_device_name(dev)
    slug = device_slug(name)
    found = _recorded(slug)
    if found is not None:
        return found
    if name in _MEASURED:
        return _MEASURED[name]
    cache_dir = os.environ.get(CACHE_ENV)
    cache_file = pathlib.Path(cache_dir) / f"ceilings-{slug}.json" if cache_dir else None
    if cache_file is not None and cache_file.exists():
        c = Ceilings.from_json(json.loads(cache_file.read_text())["ceilings"])
    else:
        c = measure_ceilings(dev)
        if cache_file is not None:
            cache_file.parent.mkdir(parents=True, exist_ok=True)
            cache_file.write_text(json.dumps({"device": name, "ceilings": c.to_json()}, indent=1))
    _MEASURED[name] = c
    return c


# ---- measuring -------------------------------------------------------------------------------------------
def measure_ceilings(device=None, *, matmul_n: int = 8192, read_bytes: int = 4 << 30, launches: int = 200,
                     timer: Optional[Callable[[Callable], float]] = None,
                     wall_timer: Optional[Callable[[Callable], float]] = None) -> Ceilings:
    """Measure the ceilings of a CUDA device (about a minute on an H200).

    - matmul: ``torch.matmul`` of random ``matmul_n``-square matrices per dtype (fp32 with TF32 off: the
      kernels use IEEE dots for fp32), 2 n^3 / time;
    - HBM read: the best of ``torch.sum`` and the streaming-read kernel (:func:`best_read`) over
      ``read_bytes`` of random bf16;
    - launch latency: ``launches`` tiny kernels captured in one CUDA graph, replay time / launches;
    - host call time: wall time of one eager ``sparse_attention`` on one 128 x 128 tile and one
      ``sparse_decode`` on one page (Python checks, the launch, the synchronisation).

    ``timer(fn) -> ms`` times device work (default: Triton's ``do_bench``), ``wall_timer(fn) -> ms`` the
    host calls; passing both (tests do, with small sizes) lets this run on a CPU."""
    dev = torch.device(device) if device is not None else torch.device("cuda")
    if (timer is None or wall_timer is None) and dev.type != "cuda":
        raise ValueError(f"measure_ceilings needs a CUDA device (got {dev}) unless timer and wall_timer are given")
    timer = timer or (lambda fn: time_gpu(fn, warmup_ms=25, rep_ms=200))
    wall_timer = wall_timer or (lambda fn: time_host(fn, repeat=50, warmup=5, device=dev))
    sources = {}
    when = datetime.date.today().isoformat()
    where = f"measure_ceilings() on {when}, torch {torch.__version__}"

    matmul = {name: _matmul_tflops(dev, dtype, matmul_n, timer) for dtype, name in DTYPE_NAMES.items()}
    sources["matmul_tflops"] = f"{where}: torch.matmul, {matmul_n}^3, TF32 off"

    hbm = _read_tbps(dev, read_bytes, timer)
    sources["hbm_read_tbps"] = f"{where}: best streaming read (torch.sum or stream_read_kernel) over " \
        f"{read_bytes / 2**30:.1f} GiB of bf16"

    launch_us = _launch_latency_us(dev, launches, timer)
    sources["launch_us"] = f"{where}: {launches} one-element adds in a CUDA graph, replay time / {launches}" \
        if dev.type == "cuda" else f"{where}: {launches} one-element adds, timed eagerly (no CUDA graph)"

    host = _host_call_us(dev, wall_timer)
    sources["host_call_us"] = f"{where}: wall time of one eager call on one tile / one page, synchronised"

    props = torch.cuda.get_device_properties(dev) if dev.type == "cuda" else None
    sm = props.multi_processor_count if props is not None else (os.cpu_count() or 1)
    l2 = getattr(props, "L2_cache_size", 0) / 2**20 if props is not None else None
    sources["sm_count"] = "torch.cuda.get_device_properties" if props is not None else "os.cpu_count() (CPU test)"
    name = torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu"
    return Ceilings(device=name, sm_count=sm, matmul_tflops=matmul, hbm_read_tbps=hbm, launch_us=launch_us,
                    host_call_us=host, l2_mib=l2, sources=sources)


def _matmul_tflops(dev: torch.device, dtype: torch.dtype, n: int, timer) -> float:
    a = torch.randn(n, n, device=dev, dtype=dtype)
    b = torch.randn(n, n, device=dev, dtype=dtype)
    tf32 = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 at the IEEE rate, as the kernels run it
    try:
        ms = timer(lambda: torch.matmul(a, b))
    finally:
        torch.backends.cuda.matmul.allow_tf32 = tf32
    return 2.0 * n ** 3 / (ms * 1e-3) / 1e12


def _read_tbps(dev: torch.device, nbytes: int, timer) -> float:
    n = nbytes // 2
    x = torch.randn(n, device=dev, dtype=torch.bfloat16)
    ms, _ = best_read([x], timer)
    return n * 2 / (ms * 1e-3) / 1e12


#: Launch configs of the streaming-read kernel that :func:`best_read` tries: (elements per load, warps,
#: programs per SM). A read ceiling is the best rate seen, so several are timed and the fastest kept.
READ_CONFIGS = ((4096, 4, 4), (8192, 8, 4), (8192, 8, 8), (16384, 8, 2), (4096, 4, 16))


def stream_read(tensors, block: Optional[int] = None, num_warps: int = 4,
                programs_per_sm: int = 4) -> Callable[[], list]:
    """A callable that reads every element of each contiguous tensor once. ``block=None``: ``torch.sum``
    (float32 accumulation); otherwise :func:`sparseattn.kernels.stream.stream_read_kernel` with ``block``
    elements per load and ``programs_per_sm`` programs per SM, returning each tensor's per-program partial
    sums (their sum is the tensor's sum)."""
    tensors = list(tensors)
    for i, t in enumerate(tensors):
        if not t.is_contiguous():
            raise ValueError(f"tensors[{i}] must be contiguous: the read walks its storage as one flat array")
    if block is None:
        return lambda: [t.sum(dtype=torch.float32) for t in tensors]
    from ..kernels.stream import stream_read_kernel
    if block <= 0 or block & (block - 1):
        raise ValueError(f"block must be a positive power of two, got {block}")
    dev = tensors[0].device
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev.type == "cuda" else 1
    jobs = []
    for t in tensors:
        flat = t.view(-1)
        grid = max(1, min(sms * programs_per_sm, -(-flat.numel() // block)))
        jobs.append((flat, torch.empty(grid, device=dev, dtype=torch.float32), grid))

    def read():
        for flat, partial, grid in jobs:
            stream_read_kernel[(grid,)](X=flat, PARTIAL=partial, n=flat.numel(), BLOCK=block, num_warps=num_warps,
                                        num_stages=3)
        return [partial for _, partial, _ in jobs]
    return read


def best_read(tensors, timer: Callable[[Callable], float], configs=READ_CONFIGS) -> tuple:
    """``(ms, how)``: the fastest of ``torch.sum`` and the streaming-read kernel's ``configs`` over the same
    bytes, timed with ``timer(fn) -> ms``; ``how`` names the winner."""
    tensors = list(tensors)
    best = (timer(stream_read(tensors)), "torch.sum")
    for block, warps, per_sm in configs:
        ms = timer(stream_read(tensors, block, warps, per_sm))
        if ms < best[0]:
            best = (ms, f"stream_read_kernel, {block} elements per load, {warps} warps, {per_sm} programs/SM")
    return best


def _launch_latency_us(dev: torch.device, launches: int, timer) -> float:
    x = torch.zeros(1, device=dev)

    def many():
        for _ in range(launches):
            x.add_(1)
    if dev.type != "cuda":
        return timer(many) * 1e3 / launches
    with torch.cuda.device(dev):
        graph = graph_step(many)
    return timer(graph.replay) * 1e3 / launches


def _host_call_us(dev: torch.device, wall_timer) -> Dict[str, float]:
    from ..layout import BlockLayout
    from ..ops import sparse_attention, sparse_decode
    from ..paged import PagedKVCache
    from .. import patterns
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    q, k, v = (torch.randn(1, 1, 128, 64, device=dev, dtype=dtype) for _ in range(3))
    layout = BlockLayout.from_mask_mod(patterns.causal(), 128, 128, 128, 128, device=dev)
    sparse_attention(q, k, v, layout)  # compile / warm the caches outside the timing
    fwd = wall_timer(lambda: sparse_attention(q, k, v, layout)) * 1e3
    cache = PagedKVCache(1, 16, 1, 64, dtype=dtype, device=dev, max_seqs=1)
    cache.append(0, torch.randn(16, 1, 64, dtype=dtype), torch.randn(16, 1, 64, dtype=dtype))
    qd = torch.randn(1, 1, 64, device=dev, dtype=dtype)
    sparse_decode(qd, cache)
    dec = wall_timer(lambda: sparse_decode(qd, cache)) * 1e3
    return {"fwd": fwd, "decode": dec}
