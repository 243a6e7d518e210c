"""Suite ``prefill``: the forward kernel against FlexAttention (same block mask), SDPA's cuDNN and FA2
(dense and causal: the work of the pattern's envelope) and naive masked attention where it fits.
The patterns with no hand-written predicate (``MASKC_PATTERNS``) are also timed with their partial tiles forced
to per-tile bits (``sparseattn-bits``), so the compiled mask_mod and the bits it replaces are compared in one
run; each row records its ``mask_path``. Issue 13's ``documents64`` and ``window333`` (``TABLE_PATTERNS``) are
measured when ``--patterns`` names them (the ``versus`` suite measures them at 32k). ``--sweep`` also times a
set of forward tile configs at the largest N (recorded patterns only)."""
from __future__ import annotations

from typing import List

import torch

from ..ops import FwdConfig, forced_mask_path, mask_path_name, sparse_attention
from . import _common as C
from .cases import MASKC_PATTERNS, PREFILL_PATTERNS, dense_pattern_of, prefill_layout
from .record import Impl, Pass, Record

NAME = "prefill"
DEFAULT_N = "4096,8192,16384,32768,65536"
CONFIG_KIND = "fwd"  # the row kind of tuned_configs.json its sweep tunes
COLUMNS = ["pattern", "N", "ours_ms", "tile_TF/s", "flex_ms", "flex/ours", "cudnn_ms", "cudnn/ours", "naive_ms",
           "err_vs_flex", "bits_ms", "bits/ours"]


def setup(args):
    """Shapes shared by the prefill and backward suites: B=1, H heads, head dim D, bf16, lengths, patterns."""
    Ns = [int(x) for x in args.n.split(",")]
    patterns = args.patterns.split(",") if args.patterns else PREFILL_PATTERNS + MASKC_PATTERNS
    return 1, args.heads, args.head_dim, torch.bfloat16, Ns, patterns


def sweep_configs(D: int) -> List[FwdConfig]:
    """The forward tile configs ``--sweep`` times at head dim ``D`` (the first is the H200 default for it)."""
    grid = SWEEP_D64 if D <= 64 else SWEEP_D128
    return [FwdConfig(block_m=m, block_n=n, num_warps=w, num_stages=st, tma=tma, warp_specialize=ws)
            for m, n, w, st, tma, ws in grid]


#: (block_m, block_n, num_warps, num_stages, tma, warp_specialize) of the D = 128 grid
SWEEP_D128 = [(128, 128, 8, 3, None, False), (128, 128, 8, 3, None, True), (128, 128, 4, 3, None, True),
              (128, 128, 8, 2, None, True), (128, 64, 4, 3, None, True), (128, 128, 8, 4, None, False),
              (64, 64, 4, 3, None, False), (128, 128, 8, 3, False, False)]
#: The D <= 64 grid, same fields (issue 13: the D = 64 forward is at parity with Flex and was never swept).
#: ptxas for sm_90a on a CPU (``tests/tools/compile_sm90.py``'s compile, tensor-descriptor loads, D = 64),
#: registers a thread / shared KiB / CTAs an SM can hold by both: 128 x 64 w4 s3 (the default) 209 / 65 / 2;
#: 128 x 64 w8 s3 128 / 65 / 2 (twice the warps resident); 128 x 64 w4 s4 209 / 81 / 2; 64 x 128 w4 s3
#: 200 / 105 / 2; 128 x 128 w8 s2 197 / 81 / 1; 128 x 128 w8 s3 200 / 113 / 1; 128 x 128 w4 s3 255 and 12
#: bytes of spills, left out. No config spills below.
SWEEP_D64 = [(128, 64, 4, 3, None, False), (128, 64, 8, 3, None, False), (128, 64, 4, 4, None, False),
             (128, 64, 8, 4, None, False), (128, 64, 4, 2, None, False), (64, 128, 4, 3, None, False),
             (64, 64, 4, 3, None, False), (128, 128, 8, 2, None, False), (128, 128, 8, 3, None, False),
             (128, 64, 4, 3, None, True), (128, 64, 4, 3, False, False)]


def run(args) -> tuple:
    """Measure every (N, pattern); return (records, table rows, table columns)."""
    B, H, D, dtype, Ns, patterns = setup(args)
    dev = args.device
    records, table = [], []
    with C.progress(len(Ns) * len(patterns), NAME) as bar:
        for N in Ns:
            torch.manual_seed(0)
            q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
            base = dict(N=N, B=B, H=H, D=D, dtype="bf16")
            dense_ms = {}
            bar.set_postfix_str(f"dense baselines N={N}")
            for impl in (Impl.CUDNN, Impl.FA2):
                for causal in (False, True):
                    try:
                        ms = C.time_gpu(C.sdpa_fn(q, k, v, impl, causal))
                    except RuntimeError as e:  # backend refused the shape
                        C.note(f"{impl} causal={causal} N={N}: {e}")
                        continue
                    pat = "causal" if causal else "dense"
                    dense_ms[(impl, pat)] = ms
                    flops = 4.0 * B * H * N * N * D * (0.5 if causal else 1.0)
                    records.append(Record({**base, "pattern": pat}, impl, Pass.FWD, ms,
                                          {"tflops": flops / ms / 1e9}))
            for pattern in patterns:
                bar.set_postfix_str(f"{pattern} N={N}")
                _pattern(args, q, k, v, base, pattern, N, Ns, dense_ms, records, table)
                bar.update()
            C.empty_cache()
    return records, table, COLUMNS


def _pattern(args, q, k, v, base, pattern, N, Ns, dense_ms, records, table) -> None:
    B, H, _, D = q.shape
    layout = prefill_layout(pattern, N, device=args.device)
    flops = C.tile_flops(layout, H, D)
    st = layout.stats()
    case = {**base, "pattern": pattern, "block": 128, "tiles": st["listed_tiles"],
            "full_tiles": st["full_tiles"], "partial_tiles": st["partial_tiles"],
            "logical_density": st["logical_density"], "tile_amplification": st["tile_amplification"]}
    ours = lambda: sparse_attention(q, k, v, layout)  # noqa: E731
    o_ours = ours()
    ms_ours = C.time_gpu(ours)
    row = {"pattern": pattern, "N": N, "ours_ms": round(ms_ours, 3), "tile_TF/s": round(flops / ms_ours / 1e9)}
    records.append(Record(case, Impl.OURS, Pass.FWD, ms_ours, {"tile_tflops": flops / ms_ours / 1e9,
                                                               "mask_path": mask_path_name(layout)}))
    if pattern in MASKC_PATTERNS:
        ms_bits, err = bits_ab(lambda: sparse_attention(q, k, v, layout), o_ours)
        records.append(Record(case, Impl.OURS_BITS, Pass.FWD, ms_bits, {
            "tile_tflops": flops / ms_bits / 1e9, "mask_path": "bits", "max_abs_vs_ours": err,
            "bits_bytes": int(layout.partial_tile_bits().numel())}))
        row.update({"bits_ms": round(ms_bits, 3), "bits/ours": round(ms_bits / ms_ours, 2)})
    if not args.no_flex:
        flex = C.flex_fn(q, k, v, layout.to_flex())
        o_flex = flex()
        ms_flex = C.time_gpu(flex)
        err = C.rel_err(o_ours, o_flex)
        records.append(Record(case, Impl.FLEX, Pass.FWD, ms_flex,
                              {"tile_tflops": flops / ms_flex / 1e9, "rel_err_ours_vs_flex": err}))
        row.update({"flex_ms": round(ms_flex, 3), "flex/ours": round(ms_flex / ms_ours, 2),
                    "err_vs_flex": f"{err:.1e}"})
    same_work = dense_ms.get((Impl.CUDNN, dense_pattern_of(pattern)))
    if same_work:
        row["cudnn_ms"] = round(same_work, 3)
        row["cudnn/ours"] = round(same_work / ms_ours, 2)
    if B * H * N * N * 2 * 3 <= args.naive_max_bytes:
        dense_mask = layout.to_dense()
        ms_naive = C.time_gpu(C.naive_fn(q, k, v, dense_mask))
        records.append(Record(case, Impl.NAIVE, Pass.FWD, ms_naive))
        row["naive_ms"] = round(ms_naive, 2)
        del dense_mask
    table.append(row)
    if args.sweep and N == max(Ns) and pattern in PREFILL_PATTERNS:
        for cfg in sweep_configs(D):
            try:
                ms = C.time_gpu(lambda: sparse_attention(q, k, v, layout, config=cfg))
            except Exception as e:  # a config that does not compile (shared memory) is skipped
                C.note(f"config {cfg} failed: {type(e).__name__}: {str(e)[:120]}")
                continue
            records.append(Record(case, Impl.OURS, Pass.FWD, ms, {"config": C.config_dict(cfg), "sweep": True,
                                                                  "tile_tflops": flops / ms / 1e9}))
            C.note(f"sweep {pattern} N={N} {cfg}: {ms:.3f} ms")


def bits_ab(call, reference):
    """``(ms, max |out - reference|)`` of ``call`` with the layout's partial tiles forced to per-tile bits (the
    A/B of the compiled mask_mod; the two paths mask the same cells, so outputs should agree to rounding)."""
    def forced():
        with forced_mask_path("bits"):
            return call()
    out = forced()
    outs = out if isinstance(out, tuple) else (out,)
    refs = reference if isinstance(reference, tuple) else (reference,)
    err = max(float((a.float() - b.float()).abs().max()) for a, b in zip(outs, refs))
    return C.time_gpu(forced), err


def sweep_rows(records: List[Record]) -> List[Record]:
    """The rows of the config sweep (each with its ``config``)."""
    return [r for r in records if r.is_sweep and r.pass_ == Pass.FWD]
