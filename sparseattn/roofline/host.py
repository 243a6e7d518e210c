"""The eager call's host term ``T_host``: what the host spends issuing one call, per implementation and pass.

An eager call is host work (argument checks, building and binding the launch arguments, the autograd engine
for a backward) followed by its kernels. This module prices it; :mod:`.calibrate` fits it (``fit_paths``).
Calls issued back to back, as a training loop issues them, take the slower of the two sides, not their sum:
the host prepares call i+1 while the device runs call i, and the device waits for the host only when the
host is slower::

    T = max(T_device, T_host),   T_host = host_ms + host_launch_ms x (launches - 1)

The bench times its eager calls with Triton's ``do_bench`` (``timing.time_gpu``), which zeroes a 256 MiB
buffer on the device before every timed call, outside the events it reads, to flush the L2 cache; the host
prepares the call while that memset runs. So a host that needs less than the memset and the kernels per call
stays ahead, and the events see the device time alone; past that the host sets the rate::

    T_do_bench = T_device              if T_host <= T_flush + T_device
               = max(T_device, T_host) otherwise

with ``T_flush`` the memset's time at the ceilings' HBM rate (:func:`flush_ms`, 0.058 ms on the H200; not
fitted). ``cost(..., l2_flush=True)`` prices a call timed that way, and the calibration prices every recorded
eager prefill point with it (all were timed by ``do_bench``). On the crossover sweep of 2026-12-02 it put 88%
of the eager points within 25% where ``max`` alone put 76% (below 8k tokens: 79% against 60%); on the host
suite's calls, whose host and event times are measured one after the other, 72% against 74%. The host
suite (``python -m sparseattn.bench host``) measures both sides of the same call: ``device_ms`` (CUDA-graph
replay), ``host_us`` (200 calls issued without a sync) and the event-timed ``ms``; :func:`.calibrate.combination_check`
compares ``max`` and ``sum`` on its rows.

Host time depends on the code's host path, not on the layout, so it is calibrated per path, from the host
suite recorded with that path:

* ``"triton-binding"``: every launch bound by Triton per call (the code before the cached launch, commit
  914c8dd); measured in ``book/data/bench/checks/host-before-delta-kernel-h200.json`` (commit c3e0121, N = 1k,
  2k, 4k). Every recorded bench file the calibration reads, the crossover sweep included (commit 9c166ce),
  ran this path, so it prices their eager calls.
* ``"fast-launch"``: the cached launch (``sparseattn/_fast_launch.py``), with the tensor maps of its
  descriptors kept per launch slot, launch plans keeping their hits and CUDA tensors handed to the launcher
  as device addresses (2026-12-02); measured in ``book/data/bench/checks/host-5-h200.json`` (N = 2048; the
  same suite with only the tensor-map cache is ``checks/host-desc-cache-h200.json``, and
  ``book/data/bench/host-h200.json`` holds it before that cache, N = 1k, 2k, 4k, and stays one of the
  calibration's device files). :func:`sparseattn.roofline.cost` prices the code as it is
  now, so it uses this path.

The host's own speed moves between runs on the lent H200 machines and within one (the same eager call: 0.030
and 0.177 ms sixteen minutes apart), so a recorded ``T_host`` prices another run's host-bound calls only
roughly. The crossover suite therefore measures ``T_host`` of every op at the start of each part, on a layout
it does not sweep, and prices that part's eager rows with it (``cost(host_ms=...)``).

Disjointness: a host-suite row whose layout and shape the crossover sweep also measured (the same block
tables, B, H, D, dtype) is left out of the calibration of the path that prices the sweep
(:func:`.calibrate.sweep_fingerprints`), so no evaluated point's own call is in the fit. ``launches`` is the model's
count of the op's kernel launches per call (:attr:`.counts.Work.launches`; a test counts the ops' real
launches in the interpreter against it); ``host_launch_ms`` is fitted only where the calibration rows have
more than one launch count, else 0.
"""
from __future__ import annotations

import hashlib
import pathlib
from typing import Optional

__all__ = ["HOST_FILES", "CURRENT_PATH", "RECORDED_PATH", "DO_BENCH_FLUSH_BYTES", "host_ms", "flush_ms",
           "eager_ms", "fingerprint"]

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "book" / "data" / "bench"
#: The host suite recorded with each host path.
HOST_FILES = {"triton-binding": "checks/host-before-delta-kernel-h200.json",
              "fast-launch": "checks/host-5-h200.json"}
#: The path of the code as it is now (what :func:`sparseattn.roofline.cost` prices).
CURRENT_PATH = "fast-launch"
#: The path the recorded bench files the calibration reads ran (recorded before the cached launch), but those
#: :data:`.calibrate.FILE_HOST_PATHS` names.
RECORDED_PATH = "triton-binding"


def host_ms(params: Optional[dict], launches: int) -> float:
    """``T_host`` of one call from its path's parameters for the op and pass (0 without parameters)."""
    if not params:
        return 0.0
    return params["host_ms"] + params.get("host_launch_ms", 0.0) * max(int(launches) - 1, 0)


#: The buffer Triton's ``do_bench`` zeroes before every timed call to flush the L2 cache (its NVIDIA driver's
#: ``get_empty_cache_for_benchmark``: 256 MiB)
DO_BENCH_FLUSH_BYTES = 256 * 2 ** 20


def flush_ms(ceil) -> float:
    """``T_flush``: ``do_bench``'s L2 flush on the device, :data:`DO_BENCH_FLUSH_BYTES` at the ceilings' HBM
    rate (a read rate standing in for the memset's write rate), in ms."""
    return DO_BENCH_FLUSH_BYTES / (ceil.hbm_read_tbps * 1e12) * 1e3


def eager_ms(device_ms: float, host_ms_: float, flush_ms_: float = 0.0) -> float:
    """One eager call's time from its device and host times: ``max(device, host)`` back to back; with a
    device-side flush of ``flush_ms_`` before each call (``do_bench``), the device time while the host time
    fits in the flush and the device time."""
    return device_ms if host_ms_ <= flush_ms_ + device_ms else host_ms_


def fingerprint(layout, shape: dict) -> str:
    """What makes two prefill measurements the same call: the block tables and the shape."""
    h = hashlib.sha1()
    for t in (layout.kv_count, layout.kv_index, layout.full_count, layout.full_index):
        h.update(t.cpu().contiguous().numpy().tobytes())
        h.update(str(tuple(t.shape)).encode())
    h.update(repr((layout.q_len, layout.kv_len, layout.block_q, layout.block_k, shape.get("B"),
                   shape.get("H", shape.get("Hq")), shape.get("D"), shape.get("dtype"))).encode())
    return h.hexdigest()
