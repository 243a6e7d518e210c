"""What every suite shares: the environment block, timers, CUDA-graph capture, output files, the table,
progress, and the baseline callables (FlexAttention compiled, SDPA's cuDNN and FlashAttention-2 backends,
naive masked dense attention, a streaming read).

The timers, graph capture, FlexAttention and SDPA helpers live in :mod:`sparseattn.roofline.timing` (the
roofline measures with them too and sits below the bench) and the file-name slug of a device in
:func:`sparseattn.roofline.ceilings.device_slug`; they are re-exported here. Suites call everything through
this module (``from . import _common as C``; ``C.time_gpu(...)``), so a test can replace the GPU-only pieces
(here and in ``roofline.timing``) and run a suite's code on the CPU through the Triton interpreter.
"""
from __future__ import annotations

import contextlib
import datetime
import json
import math
import os
import platform
import sys
import time
from typing import Callable, Iterable, List, Optional

import torch

from ..roofline.ceilings import best_read, stream_read  # noqa: F401
from ..roofline.ceilings import device_slug as gpu_slug  # noqa: F401
from ..roofline.timing import (compiled_flex, flex_fn, graph_step, raise_recompile_limits,  # noqa: F401
                               sdpa_backend, sdpa_fn, synchronize, time_gpu, time_host, time_loop)
from .record import DEFAULT_DIR, Record, bench_filename

DEFAULT_OUT = str(DEFAULT_DIR)


# ---------------------------------------------------------------------------------------------------------
# environment and output
# ---------------------------------------------------------------------------------------------------------
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


def write_json(suite: str, records: List[Record], out_dir: str, env: dict, variant: Optional[str] = None,
               meta: Optional[dict] = None) -> str:
    """Write ``<suite>[-<variant>]-<gpu>.json`` (the results file) into ``out_dir``; return its path. ``meta``:
    more keys of the file's meta block (a suite's grid, its profiles)."""
    doc = {"suite": suite, **env, **(meta or {}), "results": [r.to_json() for r in records]}
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
#: seconds a :class:`Budget` keeps free at its end to write the file and print the table
RESERVE_S = 15.0


class Budget:
    """Seconds left of a suite run's time budget (``--budget-s``), so that a run whose FlexAttention compiles
    are slow stops starting new work before the GPU slot ends (``clock`` is replaceable for tests)."""

    def __init__(self, seconds: float, clock=time.monotonic):
        self.seconds, self.clock, self.t0 = float(seconds), clock, clock()

    def left(self) -> float:
        return self.seconds - (self.clock() - self.t0)

    def allows(self, estimate_s: float) -> bool:
        """Whether work estimated at ``estimate_s`` seconds still fits, :data:`RESERVE_S` kept free."""
        return self.left() - RESERVE_S > estimate_s


def grad_fn(fwd: Callable, inputs, do) -> Callable:
    """Time the backward alone: one forward kept alive, gradients recomputed from it every call."""
    out = fwd()
    return lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)


def graph_ms(fn: Callable, stream=None, tries: int = 2) -> Optional[float]:
    """Device milliseconds of ``fn`` replayed from one CUDA graph captured on ``stream``. In the recorded runs
    the first backward captured in a process failed twice (``cudaErrorStreamCaptureInvalidated``) while its
    kept forward ran on the default stream; :func:`fwd_bwd` now runs it on the capture stream, which removes
    one documented cause (pytorch/pytorch#180090), not yet checked on the GPU. A failed capture is tried
    again, and after ``tries`` failures the row keeps ``device_ms = None`` with a note rather than losing its
    eager numbers."""
    for attempt in range(tries):
        try:
            graph = graph_step(fn, stream)
        except RuntimeError as e:
            torch.cuda.synchronize()
            note(f"graph capture {attempt + 1}/{tries} failed: {type(e).__name__}: {str(e)[:120]}")
            continue
        ms = time_gpu(graph.replay)
        del graph
        return ms
    return None


def fwd_bwd(make: Callable, q, k, v, do, stream=None):
    """``(forward call, backward call)`` of an attention ``make(q, k, v)``; the backward recomputes the
    gradients of q, k, v from one kept forward (:func:`grad_fn`), run on ``stream`` when given (the stream
    the backward's CUDA-graph capture uses: autograd runs a node's backward on its forward's stream)."""
    qg, kg, vg = (t.detach().requires_grad_() for t in (q, k, v))
    if stream is None:
        return (lambda: make(q, k, v)), grad_fn(lambda: make(qg, kg, vg), (qg, kg, vg), do)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        bwd = grad_fn(lambda: make(qg, kg, vg), (qg, kg, vg), do)
    torch.cuda.current_stream().wait_stream(stream)
    return (lambda: make(q, k, v)), bwd


def pass_graph_ms(make: Callable, q, k, v, do, pass_: str = "bwd", warm: bool = False) -> Optional[float]:
    """Device ms of ``make(q, k, v)``'s forward, or of its backward alone from one kept forward (captured on
    a side stream: autograd runs a node's backward on its forward's stream), replayed from one CUDA graph
    (:func:`graph_ms`). ``warm``: call it once first -- FlexAttention's compiled backward must be compiled
    by a call that retains the graph, as the timed calls do (donated buffers otherwise, see the crossover
    suite)."""
    side = torch.cuda.Stream() if pass_ == "bwd" else None
    fwd, bwd = fwd_bwd(make, q, k, v, do, side)
    fn = fwd if pass_ == "fwd" else bwd
    if warm:
        fn()
    return graph_ms(fn, side)


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


def naive_fn(q, k, v, dense_mask) -> Callable:
    """Masked dense attention in eager PyTorch: scores, mask, softmax (fp32), values."""
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = s.masked_fill(~dense_mask, float("-inf"))
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)
    return run


def read_fn(tensors: Iterable[torch.Tensor], block=None, num_warps: int = 4, programs_per_sm: int = 4) -> Callable:
    """A streaming read of every byte of ``tensors``: ``torch.sum`` (``block=None``) or the streaming-read
    kernel (:func:`sparseattn.roofline.ceilings.stream_read`); the suites time the fastest of several as the
    bandwidth ceiling of a kernel that must read those bytes once (:func:`sparseattn.roofline.ceilings.best_read`)."""
    return stream_read(tensors, block, num_warps, programs_per_sm)


def config_dict(cfg) -> dict:
    """A config object as the JSON ``config`` field (its fields, in declaration order)."""
    import dataclasses
    return dataclasses.asdict(cfg)
