"""The eager call's host term ``T_host``: what the host spends issuing one call, per implementation and pass.

An eager call is host work (argument checks, building and binding the launch arguments, the autograd engine
for a backward) followed by its kernels. The bench times calls back to back with Triton's ``do_bench``: it
enqueues call after call without waiting for the device, so the host prepares call i+1 while the device runs
call i. In that pipeline the time per call is the slower of the two sides, not their sum -- the device waits
for the host when the host is slower, the host runs ahead when it is not::

    T = max(T_device, T_host),   T_host = host_ms + host_launch_ms x (launches - 1)

(``do_bench`` also flushes the L2 cache between calls with a device memset, which hides a little host time
more; the host suite's event times sit at the host time, not below it, so that slack is left out). The host
suite (``python -m sparseattn.bench host``) measures both sides of the same call: ``device_ms`` (CUDA-graph
replay), ``host_us`` (200 calls issued without a sync) and the event-timed ``ms``; :func:`combination_check`
compares ``max`` and ``sum`` on its rows.

Host time depends on the code's host path, not on the layout, so it is calibrated per path, from the host
suite recorded with that path:

* ``"triton-binding"``: every launch bound by Triton per call (the code before the cached launch, commit
  914c8dd); measured in ``book/data/bench/checks/host-before-delta-kernel-h200.json`` (commit c3e0121, N = 1k,
  2k, 4k). Every recorded bench file the calibration reads, the crossover sweep included (commit 9c166ce),
  ran this path, so it prices their eager calls.
* ``"fast-launch"``: the cached launch (``sparseattn/_fast_launch.py``); measured in
  ``book/data/bench/host-h200.json`` (N = 2048). :func:`sparseattn.roofline.cost` prices the code as it is
  now, so it uses this path.

Disjointness: a host-suite row whose layout and shape the crossover sweep also measured (the same block
tables, B, H, D, dtype) is left out of the calibration of the path that prices the sweep
(:func:`sweep_fingerprints`), so no evaluated point's own call is in the fit. ``launches`` is the model's
count of the op's kernel launches per call (:attr:`.counts.Work.launches`; a test counts the ops' real
launches in the interpreter against it); ``host_launch_ms`` is fitted only where the calibration rows have
more than one launch count, else 0.
"""
from __future__ import annotations

import hashlib
import json
import pathlib
from typing import Dict, Iterable, List, Optional, Set

import numpy as np

from .counts import Shape

__all__ = ["HOST_FILES", "CURRENT_PATH", "RECORDED_PATH", "host_ms", "host_rows", "fit_host", "fit_paths",
           "fingerprint", "sweep_fingerprints", "combination_check"]

BENCH_DIR = pathlib.Path(__file__).resolve().parents[2] / "book" / "data" / "bench"
#: The host suite recorded with each host path.
HOST_FILES = {"triton-binding": "checks/host-before-delta-kernel-h200.json", "fast-launch": "host-h200.json"}
#: The path of the code as it is now (what :func:`sparseattn.roofline.cost` prices).
CURRENT_PATH = "fast-launch"
#: The path every recorded bench file the calibration reads ran (all recorded before the cached launch).
RECORDED_PATH = "triton-binding"
_IMPLS = {"sparseattn": "sparseattn", "flex": "flex", "cudnn": "cudnn"}


def host_ms(params: Optional[dict], launches: int) -> float:
    """``T_host`` of one call from its path's parameters for the op and pass (0 without parameters)."""
    if not params:
        return 0.0
    return params["host_ms"] + params.get("host_launch_ms", 0.0) * max(int(launches) - 1, 0)


def fingerprint(layout, shape: dict) -> str:
    """What makes two prefill measurements the same call: the block tables and the shape."""
    h = hashlib.sha1()
    for t in (layout.kv_count, layout.kv_index, layout.full_count, layout.full_index):
        h.update(t.cpu().contiguous().numpy().tobytes())
        h.update(str(tuple(t.shape)).encode())
    h.update(repr((layout.q_len, layout.kv_len, layout.block_q, layout.block_k, shape.get("B"),
                   shape.get("H", shape.get("Hq")), shape.get("D"), shape.get("dtype"))).encode())
    return h.hexdigest()


def sweep_fingerprints(points: Iterable) -> Set[str]:
    """Fingerprints of the prefill layouts and shapes of the crossover sweep's points (``calibrate.Point``)."""
    from .calibrate import EVALUATION_FILES, _family_layout
    out = set()
    for p in points:
        if p.id.startswith(EVALUATION_FILES) and p.pass_ in ("fwd", "bwd") and "family" in p.case:
            out.add(fingerprint(_family_layout(p.case), p.case))
    return out


def _launches(pattern: str, N: int, pass_: str) -> int:
    from .calibrate import _layout
    from .model import work_of
    return work_of(_layout(pattern, N), Shape(B=1, Hq=16, D=128, dtype="bf16"), pass_).launches


def host_rows(path: str, bench_dir=None, exclude: Set[str] = frozenset()) -> List[dict]:
    """The host suite rows of ``path``: impl, pass, pattern, N, host time (ms), launches (the model's count
    for ours; 1 for the baselines, whose host term is one number per call) and ``role`` (``"calibration"``,
    or ``"excluded"`` when the sweep measured the same layout and shape)."""
    from .calibrate import _layout
    bench_dir = pathlib.Path(bench_dir) if bench_dir is not None else BENCH_DIR
    doc = json.loads((bench_dir / HOST_FILES[path]).read_text())
    rows = []
    for r in doc["results"]:
        impl, pass_, c = r["impl"], r["pass"], r["case"]
        if impl not in _IMPLS or pass_ not in ("fwd", "bwd") or r.get("host_us") is None:
            continue
        fp = fingerprint(_layout(c["pattern"], c["N"]), c)
        rows.append({"impl": impl, "pass": pass_, "pattern": c["pattern"], "N": c["N"],
                     "host_ms": r["host_us"] * 1e-3, "ms": r.get("ms"), "device_ms": r.get("device_ms"),
                     "launches": _launches(c["pattern"], c["N"], pass_) if impl == "sparseattn" else 1,
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
    for path, fname in HOST_FILES.items():
        rows = host_rows(path, bench_dir, exclude=sweep if path == RECORDED_PATH else frozenset())
        paths[path] = {"file": fname, "params": fit_host(rows),
                       "rows": [{k: (round(v, 6) if isinstance(v, float) else v) for k, v in r.items()}
                                for r in rows]}
    return {"current": CURRENT_PATH, "recorded": RECORDED_PATH, "paths": paths,
            "combination": combination_check(bench_dir),
            "rule": ("host-suite rows with the block tables and shape of a crossover-sweep point are left out of "
                     f"the {RECORDED_PATH!r} fit (role 'excluded'); see sparseattn.roofline.host")}


def combination_check(bench_dir=None) -> dict:
    """On every host-suite recording (rows with a device time): the event-timed ms against ``max(device,
    host)`` and ``device + host`` -- the share within 25% and the median ratio of each."""
    bench_dir = pathlib.Path(bench_dir) if bench_dir is not None else BENCH_DIR
    ms, dev, host = [], [], []
    for f in sorted(set(HOST_FILES.values()) | {"checks/host-inert-cache-h200.json",
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
    for name, pred in (("max", np.maximum(dev, host)), ("sum", dev + host)):
        q = pred / ms
        out[name] = {"within_25pct": float(np.mean(np.abs(q - 1) <= 0.25)), "median": float(np.median(q))}
    return out
