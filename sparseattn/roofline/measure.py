"""Small GPU timings for :func:`~.crossover.report` (``measure=True``) and the GPU check: ours, FlexAttention
and cuDNN on the same shapes, timed with Triton's ``do_bench`` (median, L2 flushed between calls). Imported
only when a measurement is asked for; needs CUDA."""
from __future__ import annotations

import math
from typing import Dict, Optional

import torch

from ..layout import BlockLayout
from .counts import Shape

__all__ = ["time_ms", "measure_prefill", "measure_decode", "graph_of"]


def time_ms(fn) -> float:
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=25, rep=200, return_mode="median"))


def graph_of(fn):
    """Capture ``fn`` in a CUDA graph after two warm-up calls on a side stream."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    return graph


def _flex():
    from torch.nn.attention.flex_attention import flex_attention
    import torch._dynamo
    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name):
            setattr(cfg, name, max(getattr(cfg, name), 1024))
    if not hasattr(_flex, "compiled"):
        _flex.compiled = torch.compile(flex_attention, dynamic=False)
    return _flex.compiled


def measure_prefill(layout: BlockLayout, s: Shape, pass_: str, envelope: str, *, device="cuda", timer=None,
                    impls=("sparseattn", "flex", "cudnn")) -> Dict[str, Optional[float]]:
    """Median ms of ours, FlexAttention (compiled, same tiles) and cuDNN (``envelope``: causal or dense) for
    the forward (``pass_="fwd"``) or the backward alone (``"bwd"``: gradients from one kept forward). An
    implementation that fails (a backend refusing the shape) gives None. ``device``/``timer``/``impls`` let a
    CPU test walk the code with the interpreter and a mock timer."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from ..ops import sparse_attention
    timer = timer or time_ms
    dev = torch.device(device)
    lay = layout.to(dev)
    N, M = lay.q_len, lay.kv_len
    grad = pass_ == "bwd"
    torch.manual_seed(0)
    q = torch.randn(s.B, s.Hq, N, s.D, device=dev, dtype=s.dtype, requires_grad=grad)
    k, v = (torch.randn(s.B, s.Hkv, M, s.D, device=dev, dtype=s.dtype, requires_grad=grad) for _ in range(2))
    gqa = s.Hq != s.Hkv

    def flex():
        block_mask = lay.to_flex(num_heads=s.Hq if lay.H not in (1, s.Hq) else None)
        compiled = _flex()
        return lambda: compiled(q, k, v, block_mask=block_mask, enable_gqa=gqa)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=envelope == "causal",
                                                                    enable_gqa=gqa)
    makers = {"sparseattn": lambda: (lambda: sparse_attention(q, k, v, lay)), "flex": flex, "cudnn": lambda: cudnn}
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
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from ..ops import sparse_decode
    from ..paged import PagedKVCache
    from ..routing import select_pages
    timer = timer or time_ms
    dev = torch.device(device)
    B, L, ps = s.B, s.seq_len, s.page_size
    torch.manual_seed(0)
    kd = torch.randn(B, s.Hkv, L, s.D, device=dev, dtype=s.dtype)
    vd = torch.randn_like(kd)
    cache = PagedKVCache(B * math.ceil(L / ps), ps, s.Hkv, s.D, dtype=s.dtype, device=dev, max_seqs=B,
                         max_pages_per_seq=math.ceil(L / ps))
    for b in range(B):
        cache.append(b, kd[b].transpose(0, 1), vd[b].transpose(0, 1))
    q = torch.randn(B, s.Hq, s.D, device=dev, dtype=s.dtype)
    sel = None if keep is None else select_pages(q, cache, max(1, round(keep * math.ceil(L / ps))))
    step = lambda: sparse_decode(q, cache, pages=sel)  # noqa: E731
    replay = graph_of(step).replay if graph else step
    q4 = q.view(B, s.Hq, 1, s.D)

    def cudnn():
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            return torch.nn.functional.scaled_dot_product_attention(q4, kd, vd, enable_gqa=s.Hq != s.Hkv)
    out = {"sparseattn": timer(replay)}
    try:
        out["cudnn"] = timer(cudnn)
    except Exception as e:  # cuDNN refusing the shape (or absent) is reported, not fatal
        print(f"# cudnn decode: {type(e).__name__}: {str(e)[:160]}")
        out["cudnn"] = None
    return out
