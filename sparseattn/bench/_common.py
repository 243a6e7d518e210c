"""What every suite shares: the environment block, timers, CUDA-graph capture, output files, the table,
progress, and the baseline callables (FlexAttention compiled, SDPA's cuDNN and FlashAttention-2 backends,
naive masked dense attention, a streaming read).

Suites call these through the module (``from . import _common as C``; ``C.time_gpu(...)``), so a test can
replace the GPU-only pieces (timers, graph capture, the compiled FlexAttention) and run a suite's code on the
CPU through the Triton interpreter.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Callable, Iterable, List, Optional

import torch

from .record import DEFAULT_DIR, Record, bench_filename

DEFAULT_OUT = str(DEFAULT_DIR)


# ---------------------------------------------------------------------------------------------------------
# environment and output
# ---------------------------------------------------------------------------------------------------------
def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``."""
    name = name.lower().replace("nvidia", "").replace("geforce", "")
    m = re.search(r"([a-z]+\d+[a-z]*)", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def environment() -> dict:
    """The meta block of a results file: date, versions and the device measured."""
    import triton

    import sparseattn
    env = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
           "sparseattn": sparseattn.__version__}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        env.update(device=p.name, sm_count=p.multi_processor_count, cuda=torch.version.cuda,
                   cudnn=torch.backends.cudnn.version())
    else:
        env.update(device="cpu")
    return env


def write_json(suite: str, records: List[Record], out_dir: str, env: dict, variant: Optional[str] = None) -> str:
    """Write ``<suite>[-<variant>]-<gpu>.json`` (the results file) into ``out_dir``; return its path."""
    doc = {"suite": suite, **env, "results": [r.to_json() for r in records]}
    return write_doc(doc, out_dir, bench_filename(suite, gpu_slug(env["device"]), variant))


def write_doc(doc: dict, out_dir: str, name: str) -> str:
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, name)
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def print_table(rows: list, cols: list, file=None) -> None:
    """A right-aligned text table of the columns ``cols`` (missing cells blank)."""
    file = file or sys.stdout
    if not rows:
        print("(no rows)", file=file)
        return
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)), file=file)
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)), file=file)


class _PlainProgress:
    """What :func:`progress` returns when tqdm is not installed: one line per step on stderr."""

    def __init__(self, total: int, desc: str):
        self.total, self.desc, self.n, self.note = total, desc, 0, ""

    def set_postfix_str(self, note: str) -> None:
        self.note = note

    def update(self, n: int = 1) -> None:
        self.n += n
        print(f"# {self.desc}: {self.n}/{self.total} {self.note}", file=sys.stderr, flush=True)

    def close(self) -> None:
        pass


@contextlib.contextmanager
def progress(total: int, desc: str):
    """A progress bar over a suite's cases on stderr (tqdm when installed, plain lines otherwise). Suites
    call ``bar.set_postfix_str(case)`` before a case and ``bar.update()`` after it."""
    try:
        from tqdm import tqdm
        bar = tqdm(total=total, desc=desc, file=sys.stderr, dynamic_ncols=True)
    except ImportError:
        bar = _PlainProgress(total, desc)
    try:
        yield bar
    finally:
        bar.close()


def note(msg: str) -> None:
    """A diagnostic line on stderr (a refused backend, a config that did not compile)."""
    print(f"# {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------------------
# timing
# ---------------------------------------------------------------------------------------------------------
def time_gpu(fn: Callable, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds of ``fn`` by CUDA events (triton's do_bench, which also flushes L2 between runs)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def synchronize(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def time_host(fn: Callable, repeat: int = 15, warmup: int = 3, device="cuda") -> float:
    """Median wall milliseconds of a host-synchronising ``fn`` (layout builds read counts back to the host)."""
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


def graph_step(fn: Callable):
    """Capture ``fn`` (fixed shapes, no host sync) in a CUDA graph after two warm-up calls; return the graph
    (``graph.replay()`` reruns it)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    return graph


def grad_fn(fwd: Callable, inputs, do) -> Callable:
    """Time the backward alone: one forward kept alive, gradients recomputed from it every call."""
    out = fwd()
    return lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)


@contextlib.contextmanager
def peak_memory(device):
    """Track the peak device memory allocated inside the block: yields a dict whose ``"mb"`` is filled on
    exit (MiB above what was allocated before; NaN off CUDA)."""
    out = {"mb": float("nan")}
    cuda = torch.device(device).type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    yield out
    if cuda:
        out["mb"] = (torch.cuda.max_memory_allocated() - before) / 2**20


def empty_cache() -> None:
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------------------
# baselines
# ---------------------------------------------------------------------------------------------------------
def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative Frobenius error of ``a`` against ``b``."""
    return float((a.float() - b.float()).norm() / b.float().norm())


def tile_flops(layout, H: int, D: int) -> float:
    """Matmul FLOPs of the listed tiles (whole tiles, as the kernel computes them) for ``H`` heads."""
    tiles = int(layout.kv_count.sum() + layout.full_count.sum()) * (H if layout.H == 1 else 1)
    return tiles * 4.0 * layout.block_q * layout.block_k * D


_FLEX = {}


def raise_recompile_limits() -> None:
    """Let torch.compile recompile for every shape and mask_mod of a suite: past the default limit it falls
    back silently to a very slow eager path."""
    import torch._dynamo
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, 1024)
    if hasattr(cfg, "cache_size_limit"):
        cfg.cache_size_limit = max(cfg.cache_size_limit, 1024)


def compiled_flex():
    """``torch.compile(flex_attention)``, once per process, with the recompile limit raised."""
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
    """The ``sdpa_kernel`` context that forces SDPA's backend ``"cudnn"`` or ``"fa2"``."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    return sdpa_kernel({"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[name])


def sdpa_fn(q, k, v, backend: str, causal: bool = False, **kwargs) -> Callable:
    """SDPA on ``backend`` ("cudnn" or "fa2"), the backend forced inside every call."""
    def run():
        with sdpa_backend(backend):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, **kwargs)
    return run


def naive_fn(q, k, v, dense_mask) -> Callable:
    """Masked dense attention in eager PyTorch: scores, mask, softmax (fp32), values."""
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = s.masked_fill(~dense_mask, float("-inf"))
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)
    return run


def read_fn(tensors: Iterable[torch.Tensor]) -> Callable:
    """A streaming read of every byte of ``tensors`` (a float32-accumulated sum of each), the bandwidth
    ceiling of a kernel that must read those bytes once."""
    tensors = list(tensors)
    return lambda: [t.sum(dtype=torch.float32) for t in tensors]


def config_dict(cfg) -> dict:
    """A config object as the JSON ``config`` field (its fields, in declaration order)."""
    import dataclasses
    return dataclasses.asdict(cfg)
