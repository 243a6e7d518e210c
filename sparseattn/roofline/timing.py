"""Timing on the GPU, in one place: device timers, CUDA-graph capture, and the baselines' callables
(FlexAttention compiled, SDPA with a forced backend).

The roofline package measures with these (:mod:`.ceilings`, :mod:`.measure`) and the benchmark suites use
them through :mod:`sparseattn.bench._common`, which re-exports them: the bench sits above the roofline in the
layering, so the helpers both need live here. Nothing here touches a GPU at import time, and Triton is
imported only when a device timer runs.

Every helper is looked up through this module at call time (``flex_fn`` calls :func:`compiled_flex`,
``sdpa_fn`` enters :func:`sdpa_backend`), so a test can replace one of them here and walk the GPU-only code
on the CPU.
"""
from __future__ import annotations

import statistics
import time
from typing import Callable

import torch

from .._runtime import graph_step  # noqa: F401 (one home, below the layers that capture)

__all__ = ["time_gpu", "time_host", "time_loop", "synchronize", "graph_step", "compiled_flex", "flex_fn", "sdpa_backend",
           "sdpa_fn"]


def time_gpu(fn: Callable, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds of ``fn`` by CUDA events (Triton's ``do_bench``, which also flushes the L2 cache
    between calls). Back-to-back eager calls: a call whose host work outlasts its kernels is timed at its
    host rate, as it would run in a loop."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def synchronize(device) -> None:
    """Wait for the device's queued work (nothing on the CPU)."""
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_host(fn: Callable, repeat: int = 15, warmup: int = 3, device="cuda") -> float:
    """Median wall milliseconds of one call of ``fn`` followed by a device synchronisation (host work that
    reads results back, such as a layout build, or a whole eager call)."""
    for _ in range(warmup):
        fn()
    synchronize(device)
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        synchronize(device)
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def time_loop(fn: Callable, budget_ms: float = 50.0, max_calls: int = 200, device="cuda") -> float:
    """Wall milliseconds per call of ``fn`` issued back to back, no L2 flush and no sync between calls, one
    sync at the end: what a user's eager loop pays per call (the host's time where it is the slower side, the
    device's otherwise). The number of calls fills about ``budget_ms`` (at least 5, at most ``max_calls``).
    Recorded beside ``do_bench``'s median for the host-bound points, whose event times split into two groups
    about 2x apart in the recorded crossover sweep."""
    for _ in range(3):
        fn()
    synchronize(device)
    t0 = time.perf_counter()
    fn()
    synchronize(device)
    one = max((time.perf_counter() - t0) * 1e3, 1e-3)
    calls = int(min(max_calls, max(5, budget_ms / one)))
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) * 1e3 / calls


_FLEX = {}


def raise_recompile_limits() -> None:
    """Let torch.compile recompile for every shape and mask_mod of a suite: past dynamo's default limit it
    falls back silently to a very slow eager path."""
    import torch._dynamo
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))


def compiled_flex():
    """``torch.compile(flex_attention, dynamic=False)``, once per process, with the recompile limit raised
    (:func:`raise_recompile_limits`). Every new sequence length, and every new constant captured by a
    mask_mod (a window size), compiles again."""
    if "fn" not in _FLEX:
        from torch.nn.attention.flex_attention import flex_attention
        raise_recompile_limits()
        _FLEX["fn"] = torch.compile(flex_attention, dynamic=False)
    return _FLEX["fn"]


def flex_fn(q, k, v, block_mask, **kwargs) -> Callable:
    """A call of compiled FlexAttention on fixed inputs (``block_mask`` from ``layout.to_flex()``)."""
    flex = compiled_flex()
    return lambda: flex(q, k, v, block_mask=block_mask, **kwargs)


def sdpa_backend(name: str):
    """The ``sdpa_kernel`` context that forces SDPA's backend ``"cudnn"`` or ``"fa2"`` (KeyError otherwise)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[name])


def sdpa_fn(q, k, v, backend: str, causal: bool = False, **kwargs) -> Callable:
    """SDPA on ``backend`` ("cudnn" or "fa2"), the backend forced inside every call."""
    def run():
        with sdpa_backend(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    return run
