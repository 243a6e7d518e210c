"""Small GPU timings for :func:`~.crossover.report` (``measure=True``) and the GPU check: ours, FlexAttention
and cuDNN on the same shapes, timed with :func:`.timing.time_gpu` (Triton's ``do_bench``: median, L2 flushed
between calls). Imported only when a measurement is asked for; needs CUDA (a CPU test passes its own timer)."""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from ..layout import BlockLayout
from . import timing as T
from .cases import decode_setup
from .counts import Shape

__all__ = ["measure_prefill", "measure_decode"]


def measure_prefill(layout: BlockLayout, s: Shape, pass_: str, envelope: str, *, device="cuda", timer=None,
                    impls=("sparseattn", "flex", "cudnn")) -> Dict[str, Optional[float]]:
    """Median ms of ours, FlexAttention (compiled, same tiles) and cuDNN (``envelope``: causal or dense) for
    the forward (``pass_="fwd"``) or the backward alone (``"bwd"``: gradients from one kept forward). An
    implementation that fails (a backend refusing the shape) gives None. ``device``/``timer``/``impls`` let a
    CPU test walk the code with the interpreter and a mock timer."""
    from ..ops import sparse_attention
    timer = timer or T.time_gpu
    dev = torch.device(device)
    lay = layout.to(dev)
    N, M = lay.q_len, lay.kv_len
    grad = pass_ == "bwd"
    torch.manual_seed(0)
    q = torch.randn(s.B, s.Hq, N, s.D, device=dev, dtype=s.dtype, requires_grad=grad)
    k, v = (torch.randn(s.B, s.Hkv, M, s.D, device=dev, dtype=s.dtype, requires_grad=grad) for _ in range(2))
    gqa = s.Hq != s.Hkv
    makers = {"sparseattn": lambda: (lambda: sparse_attention(q, k, v, lay)),
              "flex": lambda: T.flex_fn(q, k, v, lay.to_flex(num_heads=s.Hq if lay.H not in (1, s.Hq) else None),
                                        enable_gqa=gqa),
              "cudnn": lambda: T.sdpa_fn(q, k, v, "cudnn", envelope == "causal", enable_gqa=gqa)}
    out = {}
    for name in impls:
        try:
            fn = makers[name]()
            if grad:
                o = fn()
                do = torch.randn_like(o)
                out[name] = timer(lambda o=o, do=do: torch.autograd.grad(o, (q, k, v), do, retain_graph=True))
            else:
                out[name] = timer(fn)
        except Exception as e:  # a backend that refuses the shape (or fails to compile) is reported, not fatal
            print(f"# {name}: {type(e).__name__}: {str(e)[:160]}")
            out[name] = None
    return out


def measure_decode(s: Shape, keep: Optional[float], *, device="cuda", timer=None,
                   graph: bool = True) -> Dict[str, Optional[float]]:
    """Ours (decode over the pages ``select_pages`` keeps for ``keep``, or over every page; a CUDA-graph replay
    of the decode alone, as the model prices it without ``routing``) and cuDNN dense decode on contiguous
    K/V holding the same tokens. ``graph=False`` times eager calls (the CPU test's path)."""
    from ..ops import sparse_decode
    from ..routing import select_pages
    timer = timer or T.time_gpu
    kd, vd, cache, q = decode_setup(s.B, s.seq_len, s.page_size, s.Hq, s.Hkv, s.D, s.dtype, device=device)
    sel = None if keep is None else select_pages(q, cache, max(1, round(keep * math.ceil(s.seq_len / s.page_size))))
    step = lambda: sparse_decode(q, cache, pages=sel)  # noqa: E731
    replay = T.graph_step(step).replay if graph else step
    out = {"sparseattn": timer(replay)}
    try:
        out["cudnn"] = timer(T.sdpa_fn(q.view(s.B, s.Hq, 1, s.D), kd, vd, "cudnn", enable_gqa=s.Hq != s.Hkv))
    except Exception as e:  # cuDNN refusing the shape (or absent) is reported, not fatal
        print(f"# cudnn decode: {type(e).__name__}: {str(e)[:160]}")
        out["cudnn"] = None
    return out
