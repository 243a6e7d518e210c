"""Benchmarks: ``python -m sparseattn.bench <suite> [--out DIR] [options]``.

Each suite fits in one 10-minute GPU run, measures our kernels and the strongest baselines on the same
work in the same process, prints a short table last and writes ``<suite>-<gpu>.json`` into ``--out``
(default ``book/data/bench/``). Suites: ``prefill`` (forward kernel vs FlexAttention, cuDNN, FA2, naive),
``decode`` (paged-cache decode, dense and Quest-selected, vs SDPA and FlexAttention decode; ``--sweep``
adds the tile/split configs), ``decode_keep`` (decode and the CUDA-graph step vs the fraction of pages kept),
``backward`` (deterministic and atomic backward vs FlexAttention, cuDNN, FA2; determinism; column
splitting), ``layout`` (building the block table vs FlexAttention's ``create_block_mask``).
"""
from __future__ import annotations

import argparse
import dataclasses
import datetime
import json
import math
import os
import platform
import re
import statistics
import sys
import time
from typing import Callable, Optional

import torch

import sparseattn
from .layout import BlockLayout
from .paged import PagedKVCache
from . import patterns as P

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "book", "data", "bench")


# ---------------------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------------------
def gpu_slug(name: str) -> str:
    """``"NVIDIA H200"`` -> ``"h200"``."""
    name = name.lower().replace("nvidia", "").replace("geforce", "")
    m = re.search(r"([a-z]+\d+[a-z]*)", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-") or "gpu"


def environment() -> dict:
    import triton
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


def time_gpu(fn: Callable, warmup_ms: float = 50, rep_ms: float = 300) -> float:
    """Median milliseconds of ``fn`` by CUDA events (triton's do_bench, which also flushes L2 between runs)."""
    import triton.testing
    return float(triton.testing.do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median"))


def time_host(fn: Callable, repeat: int = 15, warmup: int = 3) -> float:
    """Median wall milliseconds of a host-synchronising ``fn`` (layout builds read counts back to the host)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def write_json(suite: str, results: list, out_dir: str, extra: Optional[dict] = None) -> str:
    env = environment()
    doc = {"suite": suite, **env, **(extra or {}), "results": results}
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"{suite}-{gpu_slug(env['device'])}.json")
    with open(path, "w") as f:
        json.dump(doc, f, indent=1)
    return path


def print_table(rows: list, cols: list) -> None:
    widths = [max(len(c), *(len(str(r.get(c, ""))) for r in rows)) for c in cols]
    print("  ".join(c.rjust(w) for c, w in zip(cols, widths)))
    for r in rows:
        print("  ".join(str(r.get(c, "")).rjust(w) for c, w in zip(cols, widths)))


# ---------------------------------------------------------------------------------------------------------
# the prefill patterns of the book
# ---------------------------------------------------------------------------------------------------------
def prefill_layout(pattern: str, N: int, block: int = 128, device="cuda") -> BlockLayout:
    if pattern == "causal":
        return BlockLayout.from_mask_mod(P.causal(), N, N, block, block, device=device)
    if pattern == "window1024":
        return BlockLayout.from_mask_mod(P.sliding_window(1024), N, N, block, block, device=device)
    if pattern == "sinks64+window1024":
        mm = P.sinks_window(64, 1024)
        return BlockLayout.from_mask_mod(mm, N, N, block, block, device=device)
    if pattern == "random10%+diag":
        # 10% of the 128-blocks at random plus the diagonal, every listed tile full (a block-level pattern)
        n = math.ceil(N / block)
        g = torch.Generator(device="cpu").manual_seed(0)
        blocks = (torch.rand(n, n, generator=g) < 0.10) | torch.eye(n, dtype=torch.bool)
        return BlockLayout.from_block_mask(blocks.view(1, 1, n, n).to(device), N, N, block, block)
    raise ValueError(f"unknown prefill pattern {pattern!r}")


PREFILL_PATTERNS = ["causal", "window1024", "sinks64+window1024", "random10%+diag"]


def _tile_flops(layout: BlockLayout, H: int, D: int) -> float:
    tiles = int(layout.kv_count.sum() + layout.full_count.sum()) * (H if layout.H == 1 else 1)
    return tiles * 4.0 * layout.block_q * layout.block_k * D


def _flex_fn(q, k, v, block_mask, **kwargs):
    from torch.nn.attention.flex_attention import flex_attention
    import torch._dynamo
    cfg = torch._dynamo.config
    if hasattr(cfg, "recompile_limit"):
        cfg.recompile_limit = max(cfg.recompile_limit, 1024)
    if hasattr(cfg, "cache_size_limit"):
        cfg.cache_size_limit = max(cfg.cache_size_limit, 1024)
    compiled = _flex_fn.__dict__.setdefault("compiled", torch.compile(flex_attention, dynamic=False))
    return lambda: compiled(q, k, v, block_mask=block_mask, **kwargs)


def _sdpa_fn(q, k, v, backend, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel
    be = {"cudnn": SDPBackend.CUDNN_ATTENTION, "fa2": SDPBackend.FLASH_ATTENTION}[backend]

    def run():
        with sdpa_kernel(be):
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)
    return run


def _naive_fn(q, k, v, dense_mask):
    scale = 1.0 / math.sqrt(q.shape[-1])

    def run():
        s = torch.matmul(q, k.transpose(-1, -2)) * scale
        s = s.masked_fill(~dense_mask, float("-inf"))
        return torch.matmul(torch.softmax(s.float(), dim=-1).to(q.dtype), v)
    return run


def _rel_err(a, b) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


def _prefill_setup(args):
    """Shapes shared by the prefill and backward suites: B=1, H heads, head dim D, bf16, lengths, patterns."""
    Ns = [int(x) for x in args.n.split(",")]
    patterns = args.patterns.split(",") if args.patterns else PREFILL_PATTERNS
    return 1, args.heads, args.head_dim, torch.bfloat16, Ns, patterns


def suite_prefill(args) -> tuple:
    from .ops import sparse_attention
    B, H, D, dtype, Ns, patterns = _prefill_setup(args)
    results, table = [], []
    for N in Ns:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype) for _ in range(3))
        base = dict(N=N, B=B, H=H, D=D, dtype="bf16")
        dense_ms = {}
        for impl in ("cudnn", "fa2"):
            for causal in (False, True):
                try:
                    ms = time_gpu(_sdpa_fn(q, k, v, impl, causal))
                except RuntimeError as e:  # backend refused the shape
                    print(f"# {impl} causal={causal} N={N}: {e}", file=sys.stderr)
                    continue
                pat = "causal" if causal else "dense"
                dense_ms[(impl, pat)] = ms
                flops = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
                results.append({"case": {**base, "pattern": pat}, "impl": impl, "pass": "fwd", "ms": ms,
                                "tflops": flops / ms / 1e9})
        for pattern in patterns:
            layout = prefill_layout(pattern, N)
            flops = _tile_flops(layout, H, D)
            st = layout.stats()
            case = {**base, "pattern": pattern, "block": 128, "tiles": st["listed_tiles"],
                    "full_tiles": st["full_tiles"], "partial_tiles": st["partial_tiles"],
                    "logical_density": st["logical_density"], "tile_amplification": st["tile_amplification"]}
            ours = lambda: sparse_attention(q, k, v, layout)  # noqa: E731
            o_ours = ours()
            ms_ours = time_gpu(ours)
            row = {"pattern": pattern, "N": N, "ours_ms": round(ms_ours, 3),
                   "tile_TF/s": round(flops / ms_ours / 1e9)}
            results.append({"case": case, "impl": "sparseattn", "pass": "fwd", "ms": ms_ours,
                            "tile_tflops": flops / ms_ours / 1e9})
            if not args.no_flex:
                bm = layout.to_flex()
                flex = _flex_fn(q, k, v, bm)
                o_flex = flex()
                ms_flex = time_gpu(flex)
                err = _rel_err(o_ours, o_flex)
                results.append({"case": case, "impl": "flex", "pass": "fwd", "ms": ms_flex,
                                "tile_tflops": flops / ms_flex / 1e9, "rel_err_ours_vs_flex": err})
                row.update({"flex_ms": round(ms_flex, 3), "flex/ours": round(ms_flex / ms_ours, 2),
                            "err_vs_flex": f"{err:.1e}"})
            same_work = dense_ms.get(("cudnn", "causal" if pattern == "causal" else "dense"))
            if same_work:
                row["cudnn_ms"] = round(same_work, 3)
                row["cudnn/ours"] = round(same_work / ms_ours, 2)
            if B * H * N * N * 2 * 3 <= args.naive_max_bytes:
                dense_mask = layout.to_dense()
                ms_naive = time_gpu(_naive_fn(q, k, v, dense_mask))
                results.append({"case": case, "impl": "naive", "pass": "fwd", "ms": ms_naive})
                row["naive_ms"] = round(ms_naive, 2)
                del dense_mask
            table.append(row)
            if args.sweep and N == max(Ns):
                for cfg in _sweep_configs(D):
                    try:
                        ms = time_gpu(lambda: sparse_attention(q, k, v, layout, config=cfg))
                    except Exception as e:  # a config that does not compile (shared memory) is skipped
                        print(f"# config {cfg} failed: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
                        continue
                    results.append({"case": case, "impl": "sparseattn", "pass": "fwd", "ms": ms,
                                    "config": cfg.__dict__, "sweep": True, "tile_tflops": flops / ms / 1e9})
                    print(f"# sweep {pattern} N={N} {cfg}: {ms:.3f} ms", file=sys.stderr)
        torch.cuda.empty_cache()
    cols = ["pattern", "N", "ours_ms", "tile_TF/s", "flex_ms", "flex/ours", "cudnn_ms", "cudnn/ours", "naive_ms",
            "err_vs_flex"]
    return results, table, cols


def _sweep_configs(D):
    from .ops import FwdConfig
    return [FwdConfig(*c) for c in ((128, 128, 8, 3, None, False), (128, 128, 8, 3, None, True),
                                    (128, 128, 4, 3, None, True), (128, 128, 8, 2, None, True),
                                    (128, 64, 4, 3, None, True), (128, 128, 8, 4, None, False),
                                    (64, 64, 4, 3, None, False), (128, 128, 8, 3, False, False))]


# ---------------------------------------------------------------------------------------------------------
# layout build
# ---------------------------------------------------------------------------------------------------------
def _layout_cases(N):
    docs = torch.sort(torch.randint(0, 32, (N,), device="cuda", generator=None)).values
    return {
        "causal": P.causal(),
        "window1024": P.sliding_window(1024),
        "sinks64+window1024": P.sinks_window(64, 1024),
        "dilated4&causal": P.and_masks(P.causal(), P.dilated(4)),
        "documents&causal": P.and_masks(P.causal(), P.document(docs)),
        "block_random10%": P.block_random(0.1, 128, seed=0),
        "arbitrary(no rule)": lambda b, h, q, k: (k <= q) & ((q - k) % 7 != 3),
    }


def suite_layout(args) -> tuple:
    results, table = [], []
    Ns = [int(x) for x in args.n.split(",")]
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        create_block_mask = None
    for N in Ns:
        for name, mm in _layout_cases(N).items():
            case = {"pattern": name, "N": N, "block": 128}
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
            build = lambda: BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cuda")  # noqa: E731
            ms = time_host(build)
            peak_mb = (torch.cuda.max_memory_allocated() - before) / 2**20
            layout = build()
            ms_t = time_gpu(lambda: layout.transpose(width=layout.nq))  # fixed capacity: no host sync
            st = layout.stats()
            results.append({"case": case, "impl": "sparseattn", "pass": "layout", "ms": ms,
                            "peak_mb": peak_mb, "tiles": st["listed_tiles"]})
            results.append({"case": case, "impl": "sparseattn", "pass": "transpose", "ms": ms_t})
            row = {"pattern": name, "N": N, "build_ms": round(ms, 3), "transpose_ms": round(ms_t, 3),
                   "peak_MB": round(peak_mb, 1), "tiles": st["listed_tiles"]}
            if create_block_mask is not None:
                fm = mm
                try:
                    flex_ms = time_host(lambda: create_block_mask(fm, None, None, N, N, device="cuda",
                                                                  BLOCK_SIZE=128))
                except torch.OutOfMemoryError:  # it materialises the N x N mask
                    torch.cuda.empty_cache()
                    results.append({"case": case, "impl": "flex", "pass": "layout", "ms": None,
                                    "error": f"out of memory (N x N = {N * N / 2**30:.0f} Gi cells)"})
                    row["flex_create_block_mask_ms"] = "OOM"
                else:
                    results.append({"case": case, "impl": "flex", "pass": "layout", "ms": flex_ms})
                    row["flex_create_block_mask_ms"] = round(flex_ms, 3)
                    row["flex/ours"] = round(flex_ms / ms, 1)
            table.append(row)
    cols = ["pattern", "N", "build_ms", "transpose_ms", "peak_MB", "tiles", "flex_create_block_mask_ms", "flex/ours"]
    return results, table, cols


def _grad_fn(fwd, inputs, do):
    """Time the backward alone: one forward kept alive, gradients recomputed from it every call."""
    out = fwd()
    return lambda: torch.autograd.grad(out, inputs, do, retain_graph=True)


def suite_backward(args) -> tuple:
    from .ops import BwdConfig, sparse_attention
    B, H, D, dtype, Ns, patterns = _prefill_setup(args)
    results, table = [], []
    for N in Ns:
        torch.manual_seed(0)
        q, k, v = (torch.randn(B, H, N, D, device="cuda", dtype=dtype, requires_grad=True) for _ in range(3))
        do = torch.randn(B, H, N, D, device="cuda", dtype=dtype)
        base = dict(N=N, B=B, H=H, D=D, dtype="bf16")
        dense_bwd = {}
        for impl in ("cudnn", "fa2"):
            for causal in (False, True):
                pat = "causal" if causal else "dense"
                try:
                    fwd = _sdpa_fn(q, k, v, impl, causal)
                    ms_b = time_gpu(_grad_fn(fwd, (q, k, v), do))
                    ms_fb = time_gpu(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
                except RuntimeError as e:
                    print(f"# {impl} causal={causal}: {e}", file=sys.stderr)
                    continue
                dense_bwd[(impl, pat)] = ms_b
                results.append({"case": {**base, "pattern": pat}, "impl": impl, "pass": "bwd", "ms": ms_b})
                results.append({"case": {**base, "pattern": pat}, "impl": impl, "pass": "fwd+bwd", "ms": ms_fb})
        for pattern in patterns:
            layout = prefill_layout(pattern, N)
            st = layout.stats()
            flops = _tile_flops(layout, H, D) * 2.5  # backward: 5 tile matmuls of the forward's 2
            case = {**base, "pattern": pattern, "block": 128, "tiles": st["listed_tiles"],
                    "logical_density": st["logical_density"], "max_col_tiles": st["max_col_tiles"]}
            row = {"pattern": pattern, "N": N}
            grads = {}
            variants = [("sparseattn", dict(deterministic=True)), ("sparseattn-atomic", dict(deterministic=False))]
            if pattern.startswith("sinks"):
                variants.append(("sparseattn-nosplit", dict(deterministic=True,
                                                            bwd_config=BwdConfig(64, 128, 128, 64, 8, 2, chunk=1 << 30))))
            for impl, kw in variants:
                fwd = lambda kw=kw: sparse_attention(q, k, v, layout, **kw)  # noqa: E731
                ms_b = time_gpu(_grad_fn(fwd, (q, k, v), do))
                ms_fb = time_gpu(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
                g = torch.autograd.grad(fwd(), (q, k, v), do)
                grads[impl] = g
                extra = {}
                if impl != "sparseattn-nosplit":
                    reps = [torch.autograd.grad(fwd(), (q, k, v), do) for _ in range(4)]
                    spread = max(float((r[0].float() - g[0].float()).abs().max()) for r in reps)
                    extra = {"bitwise_repeatable": all(all(torch.equal(a, b) for a, b in zip(r, g)) for r in reps),
                             "dq_run_to_run_max_abs": spread}
                results.append({"case": case, "impl": impl, "pass": "bwd", "ms": ms_b,
                                "tile_tflops": flops / ms_b / 1e9, **extra})
                results.append({"case": case, "impl": impl, "pass": "fwd+bwd", "ms": ms_fb})
                key = {"sparseattn": "det", "sparseattn-atomic": "atomic", "sparseattn-nosplit": "nosplit"}[impl]
                row[f"{key}_bwd_ms"] = round(ms_b, 3)
                if extra:
                    row[f"{key}_repeatable"] = extra["bitwise_repeatable"]
            if not args.no_flex:
                bm = layout.to_flex()
                flex = _flex_fn(q, k, v, bm)
                ms_b = time_gpu(_grad_fn(flex, (q, k, v), do))
                ms_fb = time_gpu(lambda: torch.autograd.grad(flex(), (q, k, v), do))
                gf = torch.autograd.grad(flex(), (q, k, v), do)
                err = max(_rel_err(a, b) for a, b in zip(grads["sparseattn"], gf))
                results.append({"case": case, "impl": "flex", "pass": "bwd", "ms": ms_b,
                                "rel_err_ours_vs_flex": err})
                results.append({"case": case, "impl": "flex", "pass": "fwd+bwd", "ms": ms_fb})
                row.update({"flex_bwd_ms": round(ms_b, 3), "flex/det": round(ms_b / row["det_bwd_ms"], 2),
                            "err_vs_flex": f"{err:.1e}"})
            same = dense_bwd.get(("cudnn", "causal" if pattern == "causal" else "dense"))
            if same:
                row["cudnn_bwd_ms"] = round(same, 3)
            table.append(row)
            if args.sweep and N == max(Ns) and pattern in ("causal", "window1024"):
                for cfg in [BwdConfig(*c) for c in ((32, 128, 128, 32, 4, 3), (32, 128, 128, 32, 8, 3),
                                                    (64, 128, 128, 64, 8, 2), (64, 64, 64, 64, 4, 3),
                                                    (32, 64, 64, 32, 4, 3))]:
                    fwd = lambda cfg=cfg: sparse_attention(q, k, v, layout, bwd_config=cfg)  # noqa: E731
                    try:
                        ms = time_gpu(_grad_fn(fwd, (q, k, v), do))
                    except Exception as e:
                        print(f"# bwd config {cfg} failed: {type(e).__name__}: {str(e)[:100]}", file=sys.stderr)
                        continue
                    results.append({"case": case, "impl": "sparseattn", "pass": "bwd", "ms": ms, "sweep": True,
                                    "config": cfg.__dict__})
                    print(f"# bwd sweep {pattern} N={N} {cfg}: {ms:.3f} ms", file=sys.stderr)
        torch.cuda.empty_cache()
    cols = ["pattern", "N", "det_bwd_ms", "atomic_bwd_ms", "nosplit_bwd_ms", "flex_bwd_ms", "flex/det", "cudnn_bwd_ms",
            "det_repeatable", "atomic_repeatable", "err_vs_flex"]
    return results, table, cols


def _decode_sweep_configs():
    from .ops import DecodeConfig
    for block_n in (64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                for pps in (4, 8, 16, 32):
                    for head_fastest in (False, True):
                        yield DecodeConfig(block_n, warps, stages, pps, head_fastest)


def _flex_decode_mask(block_keep: torch.Tensor, Hq: int, Hkv: int):
    """A FlexAttention BlockMask for one query per row from kept 128-token blocks ``[B, Hkv, nb]`` (bool)."""
    from torch.nn.attention.flex_attention import BlockMask
    keep = block_keep.repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, nb]: the group shares the blocks
    count = keep.sum(-1, dtype=torch.int32)[..., None]  # [B, Hq, 1]
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # kept blocks first
    order = order[:, :, None, :].contiguous()  # [B, Hq, 1, nb]
    # every kept block is full (no mask_mod call inside it); no partial blocks
    return BlockMask.from_kv_blocks(torch.zeros_like(count), order, count, order, BLOCK_SIZE=128,
                                    seq_lengths=(1, keep.shape[-1] * 128))


def _decode_setup(B: int, L: int, ps: int, Hq: int, Hkv: int, D: int, dtype):
    """Seeded random K/V ``[B, Hkv, L, D]`` (contiguous, for the baselines), the same tokens in a full paged
    cache of page size ``ps``, and one query per sequence ``[B, Hq, D]``."""
    torch.manual_seed(0)
    kd = torch.randn(B, Hkv, L, D, device="cuda", dtype=dtype)
    vd = torch.randn_like(kd)
    cache = PagedKVCache(B * (L // ps), ps, Hkv, D, dtype=dtype, device="cuda", max_seqs=B,
                         max_pages_per_seq=L // ps)
    for b in range(B):
        cache.append(b, kd[b].transpose(0, 1), vd[b].transpose(0, 1))
    return kd, vd, cache, torch.randn(B, Hq, D, device="cuda", dtype=dtype)


def suite_decode(args) -> tuple:
    """Decode over the paged cache (dense and with Quest selection) vs SDPA (cuDNN, FA2) and FlexAttention
    decode on contiguous KV holding the same keys and values."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from .ops import sparse_decode
    from .reference import select_pages_reference
    from .routing import page_bounds, select_pages
    Hq, Hkv, D, dtype = 32, 8, 128, torch.bfloat16
    results, table = [], []
    cases = [(8, 131072, 16, None), (8, 131072, 16, 0.13), (8, 131072, 64, 0.13), (8, 131072, 128, 0.13),
             (32, 32768, 16, 0.16), (1, 131072, 16, None), (8, 131072, 64, None)]
    if args.n:
        cases = [c for c in cases if c[1] in {int(x) for x in args.n.split(",")}]
    for B, L, ps, keep in cases:
        n_pages_seq = L // ps
        kd, vd, cache, q = _decode_setup(B, L, ps, Hq, Hkv, D, dtype)
        q4 = q.view(B, Hq, 1, D)
        case = {"pattern": "dense" if keep is None else f"keep{keep:.2f}", "N": L, "B": B, "Hq": Hq, "Hkv": Hkv,
                "D": D, "dtype": "bf16", "page_size": ps}
        full_bytes = 2 * B * Hkv * L * D * 2
        row = {"case": f"B={B} L={L // 1024}k ps={ps} " + case["pattern"]}

        def record(impl, pass_, ms, nbytes=None, **extra):
            r = {"case": case, "impl": impl, "pass": pass_, "ms": ms, **extra}
            if nbytes is not None and ms:
                r.update(bytes=nbytes, tbps=nbytes / ms / 1e9)
            results.append(r)

        # SDPA dense decode on contiguous KV (same bytes as the full cache)
        for impl, be in (("cudnn", SDPBackend.CUDNN_ATTENTION), ("fa2", SDPBackend.FLASH_ATTENTION)):
            def run(be=be):
                with sdpa_kernel(be):
                    return torch.nn.functional.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True)
            try:
                ms_b = time_gpu(run)
            except RuntimeError as e:
                record(impl, "decode dense", None, error=str(e)[:200])
                continue
            record(impl, "decode dense", ms_b, full_bytes)
            row[f"{impl}_dense"] = round(ms_b, 4)
        ref_dense = torch.nn.functional.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True)[:, :, 0]
        if keep is None:
            ms = time_gpu(lambda: sparse_decode(q, cache))
            err = _rel_err(sparse_decode(q, cache), ref_dense)  # same keys and values, paged vs contiguous
            record("sparseattn", "decode", ms, full_bytes, rel_err_vs_sdpa=err)
            row.update(ours=round(ms, 4), TB_s=round(full_bytes / ms / 1e9, 2))
            if not args.no_flex:
                ms_f = time_gpu(_flex_fn(q4, kd, vd, None, enable_gqa=True))
                record("flex", "decode dense", ms_f, full_bytes)
                row["flex"] = round(ms_f, 4)
        else:
            topk = max(1, round(keep * n_pages_seq))
            sel = select_pages(q, cache, topk)
            sel_bytes = int(sel.count.sum()) * ps * D * 2 * 2
            ms = time_gpu(lambda: sparse_decode(q, cache, pages=sel))
            ms_sel = time_gpu(lambda: select_pages(q, cache, topk))
            ms_sel_eager = time_gpu(lambda: select_pages_reference(q, cache, topk))
            ms_step = time_gpu(lambda: sparse_decode(q, cache, pages=select_pages(q, cache, topk)))
            # the same step captured once in a CUDA graph (fixed capacity: one graph for every step)
            graph_out = []
            graph = _graph_step(lambda: graph_out.append(sparse_decode(q, cache, pages=select_pages(q, cache, topk))))
            o_graph = graph_out[-1]  # the captured call's output buffer, rewritten by every replay
            ms_graph = time_gpu(graph.replay)
            record("sparseattn", "decode", ms, sel_bytes, keep_fraction=sel_bytes / full_bytes)
            record("sparseattn", "select", ms_sel)
            record("torch eager (reference)", "select", ms_sel_eager)
            record("sparseattn", "select+decode", ms_step)
            record("sparseattn", "select+decode (CUDA graph)", ms_graph,
                   graph_equals_eager=bool(torch.equal(o_graph, sparse_decode(q, cache, pages=sel))))
            row.update(ours=round(ms, 4), TB_s=round(sel_bytes / ms / 1e9, 2), select=round(ms_sel, 4),
                       step=round(ms_step, 4), graph=round(ms_graph, 4))
            if not args.no_flex:
                # FlexAttention keeps the same fraction of 128-token blocks: the blocks with the best Quest
                # bound (max of their pages' bounds), first and last forced. With ps=128 these are exactly our
                # pages, and the outputs are compared.
                nb = L // 128
                if ps == 128:
                    block_keep = torch.zeros(B, Hkv, nb, dtype=torch.bool, device="cuda")
                    valid = torch.arange(sel.capacity, device="cuda") < sel.count[..., None]
                    block_keep.scatter_(2, sel.index.long(), valid)
                else:
                    block_keep = torch.zeros(B, Hkv, nb, dtype=torch.bool, device="cuda")
                    bb = page_bounds(q, cache).view(B, Hkv, nb, 128 // ps).amax(-1)  # [B, Hkv, nb]
                    bb[..., 0] = bb[..., -1] = float("inf")
                    block_keep.scatter_(2, bb.topk(max(1, round(keep * nb)), dim=-1).indices, True)
                bm = _flex_decode_mask(block_keep, Hq, Hkv)
                flex_bytes = int(block_keep.sum()) * 128 * D * 2 * 2
                fn = _flex_fn(q4, kd, vd, bm, enable_gqa=True)
                ms_f = time_gpu(fn)
                extra = {}
                if ps == 128:  # the same pages: the outputs must agree
                    extra["rel_err_vs_ours"] = _rel_err(fn()[:, :, 0], sparse_decode(q, cache, pages=sel))
                    row["flex_err"] = f"{extra['rel_err_vs_ours']:.1e}"
                record("flex", "decode block mask", ms_f, flex_bytes, **extra)
                row["flex"] = round(ms_f, 4)
        if args.sweep and ps == 16:  # the tile configs, on the page size of the targets
            sweep = {}
            for cfg in _decode_sweep_configs():
                fn = (lambda cfg=cfg: sparse_decode(q, cache, config=cfg)) if keep is None else \
                    (lambda cfg=cfg: sparse_decode(q, cache, pages=sel, config=cfg))
                try:
                    sweep[cfg] = time_gpu(fn, warmup_ms=10, rep_ms=40)
                except Exception as e:  # a config the GPU cannot compile is recorded, not fatal
                    results.append({"case": case, "impl": "sparseattn", "pass": "sweep",
                                    "config": dataclasses.asdict(cfg),
                                    "ms": None, "error": str(e)[:120]})
                    continue
                results.append({"case": case, "impl": "sparseattn", "pass": "sweep", "config": dataclasses.asdict(cfg),
                                "ms": sweep[cfg]})
            best = min(sweep, key=sweep.get)
            row["sweep_best"] = round(sweep[best], 4)
            row["best_cfg"] = f"{best.block_n}/{best.num_warps}w/{best.num_stages}s/{best.programs_per_sm}pps" \
                              f"{'/hf' if best.head_fastest else ''}"
        table.append(row)
        del cache, kd, vd
        torch.cuda.empty_cache()
    cols = ["case", "ours", "TB_s", "select", "step", "graph", "cudnn_dense", "fa2_dense", "flex", "flex_err",
            "sweep_best", "best_cfg"]
    return results, table, cols


def _graph_step(fn):
    """Capture ``fn`` (fixed shapes, no host sync) in a CUDA graph after two warm-up calls; return the graph."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph):
        fn()
    return graph


def suite_decode_keep(args) -> tuple:
    """Decode time and effective bandwidth vs the fraction of pages kept, per batch; the whole step (select
    + decode, CUDA graph) against dense decode through the cache and cuDNN on contiguous KV."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from .ops import sparse_decode
    from .routing import select_pages
    Hq, Hkv, D, dtype, ps = 32, 8, 128, torch.bfloat16, 16
    keeps = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]
    results, table = [], []
    for B, L in ((1, 131072), (8, 131072), (32, 32768)):
        n_pages_seq = L // ps
        kd, vd, cache, q = _decode_setup(B, L, ps, Hq, Hkv, D, dtype)
        full_bytes = 2 * B * Hkv * L * D * 2
        base = {"N": L, "B": B, "Hq": Hq, "Hkv": Hkv, "D": D, "dtype": "bf16", "page_size": ps}
        ms_dense = time_gpu(_graph_step(lambda: sparse_decode(q, cache)).replay)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            q4 = q.view(B, Hq, 1, D)
            ms_cudnn = time_gpu(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True))
        results.append({"case": {**base, "pattern": "dense"}, "impl": "sparseattn", "pass": "decode (CUDA graph)",
                        "ms": ms_dense,
                        "bytes": full_bytes, "tbps": full_bytes / ms_dense / 1e9})
        results.append({"case": {**base, "pattern": "dense"}, "impl": "cudnn", "pass": "decode dense", "ms": ms_cudnn,
                        "bytes": full_bytes, "tbps": full_bytes / ms_cudnn / 1e9})
        for keep in keeps:
            topk = max(1, round(keep * n_pages_seq))
            sel = select_pages(q, cache, topk)
            sel_bytes = int(sel.count.sum()) * ps * D * 2 * 2
            ms = time_gpu(lambda: sparse_decode(q, cache, pages=sel))  # eager: includes host launch time
            ms_graph = time_gpu(_graph_step(lambda: sparse_decode(q, cache, pages=sel)).replay)
            graph = _graph_step(lambda: sparse_decode(q, cache, pages=select_pages(q, cache, topk)))
            ms_step = time_gpu(graph.replay)
            case = {**base, "pattern": f"keep{keep:.2f}", "keep": keep}
            results.append({"case": case, "impl": "sparseattn", "pass": "decode", "ms": ms, "bytes": sel_bytes,
                            "tbps": sel_bytes / ms / 1e9, "keep_fraction": sel_bytes / full_bytes})
            results.append({"case": case, "impl": "sparseattn", "pass": "decode (CUDA graph)", "ms": ms_graph,
                            "bytes": sel_bytes, "tbps": sel_bytes / ms_graph / 1e9,
                            "keep_fraction": sel_bytes / full_bytes})
            results.append({"case": case, "impl": "sparseattn", "pass": "select+decode (CUDA graph)", "ms": ms_step})
            table.append({"B": B, "L": L, "keep": keep, "eager_ms": round(ms, 4), "graph_ms": round(ms_graph, 4),
                          "TB_s": round(sel_bytes / ms_graph / 1e9, 2), "step_graph_ms": round(ms_step, 4),
                          "dense_ms": round(ms_dense, 4), "cudnn_ms": round(ms_cudnn, 4)})
        del cache, kd, vd
        torch.cuda.empty_cache()
    return results, table, ["B", "L", "keep", "eager_ms", "graph_ms", "TB_s", "step_graph_ms", "dense_ms", "cudnn_ms"]


SUITES = {"prefill": suite_prefill, "layout": suite_layout, "backward": suite_backward,
          "decode": suite_decode, "decode_keep": suite_decode_keep}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m sparseattn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--out", default=DEFAULT_OUT, help="directory for <suite>-<gpu>.json")
    ap.add_argument("--n", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--patterns", default=None, help="comma-separated prefill patterns")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sweep", action="store_true", help="also time a set of kernel tile configs")
    ap.add_argument("--naive-max-bytes", type=float, default=24e9)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    if args.n is None:
        args.n = {"prefill": "4096,8192,16384,32768,65536", "layout": "32768,131072",
                  "backward": "8192,32768", "decode": "", "decode_keep": ""}[args.suite]
    results, table, cols = SUITES[args.suite](args)
    path = write_json(args.suite, results, args.out)
    print(f"\nwrote {path}")
    print_table(table, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
