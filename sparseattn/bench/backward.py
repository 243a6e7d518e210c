"""Suite ``backward``: the deterministic and the atomic backward against FlexAttention (same block mask)
and SDPA's cuDNN and FA2 (dense and causal), with bitwise repeatability over repeated runs and, for the
sinks pattern, the backward without column splitting; the patterns with no hand-written predicate
(``MASKC_PATTERNS``) also with per-tile bits (``sparseattn-bits``) against the compiled mask_mod. Issue 13's
``documents64`` and ``window333`` (``TABLE_PATTERNS``) are measured when ``--patterns`` names them (not by
default: two more patterns at both lengths would not fit the suite's 10 minutes).
``--sweep`` also times backward tile configs for two patterns at the largest N."""
from __future__ import annotations

from typing import List

import torch

from ..ops import BwdConfig, mask_path_name, sparse_attention
from . import _common as C
from .cases import MASKC_PATTERNS, dense_pattern_of, prefill_layout
from .prefill import bits_ab, setup
from .record import Impl, Pass, Record

NAME = "backward"
DEFAULT_N = "8192,32768"
CONFIG_KIND = "bwd"
COLUMNS = ["pattern", "N", "det_bwd_ms", "atomic_bwd_ms", "nosplit_bwd_ms", "flex_bwd_ms", "flex/det", "cudnn_bwd_ms",
           "det_repeatable", "atomic_repeatable", "err_vs_flex", "bits_bwd_ms", "bits/det"]
SWEEP_PATTERNS = ("causal", "window1024")

#: One dK/dV program per key tile however long its column (the H200 default tiles, no chunking).
NOSPLIT = BwdConfig(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=2,
                    chunk=1 << 30)


def sweep_configs() -> List[BwdConfig]:
    """The backward tile configs ``--sweep`` times (the third is the H200 default)."""
    return [BwdConfig(block_m=32, block_n=128, dq_block_m=128, dq_block_n=32, num_warps=4, num_stages=3),
            BwdConfig(block_m=32, block_n=128, dq_block_m=128, dq_block_n=32, num_warps=8, num_stages=3),
            BwdConfig(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=2),
            BwdConfig(block_m=64, block_n=64, dq_block_m=64, dq_block_n=64, num_warps=4, num_stages=3),
            BwdConfig(block_m=32, block_n=64, dq_block_m=64, dq_block_n=32, num_warps=4, num_stages=3)]


def run(args) -> tuple:
    """Measure every (N, pattern); return (records, table rows, table columns)."""
    B, H, D, dtype, Ns, patterns = setup(args)
    dev = args.device
    records, table = [], []
    with C.progress(len(Ns) * len(patterns), NAME) as bar:
        for N in Ns:
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
            do = torch.randn(B, H, N, D, device=dev, dtype=dtype)
            base = dict(N=N, B=B, H=H, D=D, dtype="bf16")
            dense_bwd = {}
            bar.set_postfix_str(f"dense baselines N={N}")
            for impl in (Impl.CUDNN, Impl.FA2):
                for causal in (False, True):
                    pat = "causal" if causal else "dense"
                    try:
                        fwd = C.sdpa_fn(q, k, v, impl, causal)
                        ms_b = C.time_gpu(C.grad_fn(fwd, (q, k, v), do))
                        ms_fb = C.time_gpu(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
                    except RuntimeError as e:
                        C.note(f"{impl} causal={causal}: {e}")
                        continue
                    dense_bwd[(impl, pat)] = ms_b
                    records.append(Record({**base, "pattern": pat}, impl, Pass.BWD, ms_b))
                    records.append(Record({**base, "pattern": pat}, impl, Pass.FWD_BWD, ms_fb))
            for pattern in patterns:
                bar.set_postfix_str(f"{pattern} N={N}")
                _pattern(args, q, k, v, do, base, pattern, N, Ns, dense_bwd, records, table)
                bar.update()
            C.empty_cache()
    return records, table, COLUMNS


def _pattern(args, q, k, v, do, base, pattern, N, Ns, dense_bwd, records, table) -> None:
    H, D = q.shape[1], q.shape[3]
    layout = prefill_layout(pattern, N, device=args.device)
    st = layout.stats()
    flops = C.tile_flops(layout, H, D) * 2.5  # backward: 5 tile matmuls of the forward's 2
    case = {**base, "pattern": pattern, "block": 128, "tiles": st["listed_tiles"],
            "logical_density": st["logical_density"], "max_col_tiles": st["max_col_tiles"]}
    row = {"pattern": pattern, "N": N}
    grads = {}
    variants = [(Impl.OURS, dict(deterministic=True)), (Impl.OURS_ATOMIC, dict(deterministic=False))]
    if pattern.startswith("sinks"):
        variants.append((Impl.OURS_NOSPLIT, dict(deterministic=True, bwd_config=NOSPLIT)))
    for impl, kw in variants:
        fwd = lambda kw=kw: sparse_attention(q, k, v, layout, **kw)  # noqa: E731
        ms_b = C.time_gpu(C.grad_fn(fwd, (q, k, v), do))
        ms_fb = C.time_gpu(lambda: torch.autograd.grad(fwd(), (q, k, v), do))
        g = torch.autograd.grad(fwd(), (q, k, v), do)
        grads[impl] = g
        extra = {}
        if impl != Impl.OURS_NOSPLIT:
            reps = [torch.autograd.grad(fwd(), (q, k, v), do) for _ in range(4)]
            spread = max(float((r[0].float() - g[0].float()).abs().max()) for r in reps)
            extra = {"bitwise_repeatable": all(all(torch.equal(a, b) for a, b in zip(r, g)) for r in reps),
                     "dq_run_to_run_max_abs": spread}
        if impl == Impl.OURS:
            extra["mask_path"] = mask_path_name(layout)
        records.append(Record(case, impl, Pass.BWD, ms_b, {"tile_tflops": flops / ms_b / 1e9, **extra}))
        records.append(Record(case, impl, Pass.FWD_BWD, ms_fb))
        key = {Impl.OURS: "det", Impl.OURS_ATOMIC: "atomic", Impl.OURS_NOSPLIT: "nosplit"}[impl]
        row[f"{key}_bwd_ms"] = round(ms_b, 3)
        if extra:
            row[f"{key}_repeatable"] = extra["bitwise_repeatable"]
    if pattern in MASKC_PATTERNS:  # the same backward with per-tile bits (the forward kept is ours, compiled)
        ms_bits, err = bits_ab(C.grad_fn(lambda: sparse_attention(q, k, v, layout), (q, k, v), do),
                               grads[Impl.OURS])
        records.append(Record(case, Impl.OURS_BITS, Pass.BWD, ms_bits, {
            "tile_tflops": flops / ms_bits / 1e9, "mask_path": "bits", "max_abs_vs_ours": err}))
        row.update({"bits_bwd_ms": round(ms_bits, 3), "bits/det": round(ms_bits / row["det_bwd_ms"], 2)})
    if not args.no_flex:
        flex = C.flex_fn(q, k, v, layout.to_flex())
        ms_b = C.time_gpu(C.grad_fn(flex, (q, k, v), do))
        ms_fb = C.time_gpu(lambda: torch.autograd.grad(flex(), (q, k, v), do))
        gf = torch.autograd.grad(flex(), (q, k, v), do)
        err = max(C.rel_err(a, b) for a, b in zip(grads[Impl.OURS], gf))
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms_b, {"rel_err_ours_vs_flex": err}))
        records.append(Record(case, Impl.FLEX, Pass.FWD_BWD, ms_fb))
        row.update({"flex_bwd_ms": round(ms_b, 3), "flex/det": round(ms_b / row["det_bwd_ms"], 2),
                    "err_vs_flex": f"{err:.1e}"})
    same = dense_bwd.get((Impl.CUDNN, dense_pattern_of(pattern)))
    if same:
        row["cudnn_bwd_ms"] = round(same, 3)
    table.append(row)
    if args.sweep and N == max(Ns) and pattern in SWEEP_PATTERNS:
        for cfg in sweep_configs():
            fwd = lambda cfg=cfg: sparse_attention(q, k, v, layout, bwd_config=cfg)  # noqa: E731
            try:
                ms = C.time_gpu(C.grad_fn(fwd, (q, k, v), do))
            except Exception as e:
                C.note(f"bwd config {cfg} failed: {type(e).__name__}: {str(e)[:100]}")
                continue
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"sweep": True, "config": C.config_dict(cfg)}))
            C.note(f"bwd sweep {pattern} N={N} {cfg}: {ms:.3f} ms")


def sweep_rows(records: List[Record]) -> List[Record]:
    """The rows of the config sweep (each with its ``config``)."""
    return [r for r in records if r.is_sweep and r.pass_ == Pass.BWD]
