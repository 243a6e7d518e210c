"""Suite ``errors``: how far each implementation is from the exact answer, as distributions over rows, versus
sequence length and dtype — not one ``allclose``.

For every length ``N`` and dtype (bf16, fp16), on the same random inputs: our forward kernel (the causal
block table), FlexAttention (compiled, the same block mask via ``to_flex()``) and SDPA's cuDNN backend
(``is_causal``), each against the float64 reference computed on the *same* inputs (rounded to the dtype, then
widened) and the same edges. At long lengths a dense float64 score matrix does not fit (128k x 128k x 8 bytes
is 128 GiB per head), so the reference is computed for a sample of rows, a chunk of rows at a time; every
row's error is exact, and the percentiles are over the sampled (head, row) pairs.

A record per (N, dtype, implementation) with ``"check": "error"`` holds the maximum absolute error, the
relative Frobenius error over the sampled rows, the 50/90/99th percentiles of the per-row maximum absolute
and relative errors, the same against the reference rounded to the dtype (``max_abs_vs_rounded``: 0 for a
correctly rounded output; the plain errors have half an ulp of output rounding as a floor every
implementation shares, ``rounding_max_abs``), the LSE's maximum absolute error (ours and FlexAttention; SDPA
does not return it) and the forward time. Records with ``"check": "repeat"`` run the same call several times at one length:
``bitwise_repeatable`` for our forward, our deterministic backward, FlexAttention's and cuDNN's forward, and,
for our atomic backward, the spread of dQ over runs (``dq_run_to_run_max_abs``).
"""
from __future__ import annotations

import math
from typing import Callable, Dict, List, Optional

import torch

from ..ops import sparse_attention
from ..patterns import causal
from ..reference import reference_attention
from . import _common as C
from .cases import prefill_layout
from .record import Impl, Pass, Record

NAME = "errors"
DEFAULT_N = "1024,8192,32768,131072"  # one FlexAttention compile per (N, dtype): 8 in all
CONFIG_KIND = None
COLUMNS = ["N", "dtype", "check", "rows", "ours_max_abs", "flex_max_abs", "cudnn_max_abs", "ours_rel_fro",
           "flex_rel_fro", "cudnn_rel_fro", "ours_vs_rounded", "flex_vs_rounded", "cudnn_vs_rounded",
           "ours_lse_err"]
_SHORT = {Impl.OURS: "ours", Impl.FLEX: "flex", Impl.CUDNN: "cudnn", Impl.OURS_ATOMIC: "ours-atomic"}
#: the dtypes measured (names as in the records) and their torch dtypes
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
PATTERN = "causal"  # the one pattern every implementation computes (cuDNN takes is_causal)
FULL_ROWS = 4096  # up to this length every row is checked; beyond it SAMPLED_ROWS rows are
SAMPLED_ROWS = 1024
REFERENCE_CELLS = 1 << 27  # float64 scores per reference chunk (1 GiB; the softmax holds a few such)
REPEAT_N = 8192  # the length of the repeatability checks (the largest measured length below it if absent)
REPEATS = 5
PERCENTILES = (50, 90, 99)


# ---------------------------------------------------------------------------------------------------------
# the measurement pieces (also used by the tests and the book)
# ---------------------------------------------------------------------------------------------------------
def sample_rows(N: int, n_rows: int, seed: int = 0, device="cpu") -> torch.Tensor:
    """Sorted distinct query rows: all of them when ``N <= n_rows``, else ``n_rows`` rows, half evenly spaced
    (the first and last row included) and half at random, so both ends and the middle are covered."""
    if N <= n_rows:
        return torch.arange(N, device=device)
    g = torch.Generator().manual_seed(seed)
    even = torch.linspace(0, N - 1, n_rows // 2).round().long()
    rand = torch.randint(0, N, (n_rows - even.numel(),), generator=g)
    rows = torch.unique(torch.cat([even, rand]))  # sorted
    return rows.to(device)


def reference_rows(q, k, v, rows: torch.Tensor, mask_mod: Callable, q_offset: int = 0,
                   cells: int = REFERENCE_CELLS):
    """float64 ``(o, lse)`` of the query ``rows`` only (``[B, H, R, D]``, ``[B, H, R]``), a chunk of rows at a
    time so that no more than about ``cells`` scores exist at once. The mask of a chunk is ``mask_mod`` at the
    chunk's positions (``row + q_offset``) against every key: the same edges the layout lists."""
    B, H, N, D = q.shape
    Lk = k.shape[2]
    k64, v64 = k.double(), v.double()
    keys = torch.arange(Lk, device=q.device)
    step = max(1, cells // max(1, B * H * Lk))
    outs, lses = [], []
    for s in range(0, rows.numel(), step):
        r = rows[s:s + step]
        zero = torch.zeros((), dtype=torch.long, device=q.device)
        mask = torch.broadcast_to(mask_mod(zero, zero, (r + q_offset)[:, None], keys[None, :]), (r.numel(), Lk))
        o, lse = reference_attention(q[:, :, r], k64, v64, mask=mask[None, None], return_lse=True)
        outs.append(o)
        lses.append(lse)
    return torch.cat(outs, 2), torch.cat(lses, 2)


def error_stats(o: torch.Tensor, ref: torch.Tensor, lse: Optional[torch.Tensor] = None,
                ref_lse: Optional[torch.Tensor] = None) -> Dict[str, float]:
    """Errors of ``o`` (``[B, H, R, D]``, the sampled rows) against the float64 ``ref``: ``max_abs``,
    ``rel_fro`` (relative Frobenius norm over every row), the percentiles of the per-row maximum absolute
    error (``row_max_abs_p50`` ...) and of the per-row relative error (``row_rel_p50`` ...), and the LSE's
    ``lse_max_abs`` over finite rows when both LSEs are given.

    Against float64 a bf16/fp16 output's error is at least the rounding of the exact result to the dtype (half
    a unit in the last place), which every implementation pays, so ``max_abs`` cannot rank kernels. The
    ``*_vs_rounded`` entries compare with the reference rounded to ``o``'s dtype instead: 0 for a kernel whose
    output is the correctly rounded result, a few units in the last place for one that accumulates error;
    ``rounding_max_abs`` is the floor every implementation shares (reference rounded vs reference)."""
    diff = o.double() - ref
    row_max = diff.abs().amax(-1).flatten()  # one value per (batch, head, row)
    row_rel = (diff.norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-300)).flatten()
    out = {"max_abs": float(row_max.max()), "rel_fro": float(diff.norm() / ref.norm().clamp_min(1e-300))}
    rounded = ref.to(o.dtype).double()  # the correctly rounded output in o's dtype
    out["rounding_max_abs"] = float((rounded - ref).abs().max())
    excess = o.double() - rounded
    out["max_abs_vs_rounded"] = float(excess.abs().max())
    out["rel_fro_vs_rounded"] = float(excess.norm() / ref.norm().clamp_min(1e-300))
    qs = torch.tensor([p / 100 for p in PERCENTILES], dtype=torch.float64, device=row_max.device)
    for name, x in (("row_max_abs", row_max), ("row_rel", row_rel)):
        for p, val in zip(PERCENTILES, torch.quantile(x, qs).tolist()):
            out[f"{name}_p{p}"] = val
    if lse is not None and ref_lse is not None:
        fin = torch.isfinite(ref_lse)
        out["lse_max_abs"] = float((lse.double()[fin] - ref_lse[fin]).abs().max()) if bool(fin.any()) else 0.0
    return out


def flex_out_lse(flex: Callable, q, k, v, block_mask):
    """``(o, lse)`` of a FlexAttention callable (eager or compiled): ``return_aux`` where this torch has it,
    the older ``return_lse`` otherwise. The LSE is a natural log, like ours."""
    try:
        from torch.nn.attention.flex_attention import AuxRequest
    except ImportError:
        return flex(q, k, v, block_mask=block_mask, return_lse=True)
    o, aux = flex(q, k, v, block_mask=block_mask, return_aux=AuxRequest(lse=True))
    return o, aux.lse


def _same_bits(a, b) -> bool:
    if isinstance(a, (tuple, list)):
        return all(_same_bits(x, y) for x, y in zip(a, b))
    return torch.equal(a, b)


# ---------------------------------------------------------------------------------------------------------
# the suite
# ---------------------------------------------------------------------------------------------------------
def run(args) -> tuple:
    """Measure every (N, dtype); return (records, table rows, table columns)."""
    Ns = [int(x) for x in args.n.split(",")]
    B, H, D, dev = 1, args.heads, args.head_dim, args.device
    records: List[Record] = []
    table: List[dict] = []
    repeat_n = REPEAT_N if REPEAT_N in Ns else max([n for n in Ns if n <= REPEAT_N] or [min(Ns)])
    mm = causal()
    with C.progress(len(Ns) * len(DTYPES), NAME) as bar:
        for N in Ns:
            layout = prefill_layout(PATTERN, N, device=dev)
            block_mask = None if args.no_flex else layout.to_flex()
            rows = sample_rows(N, FULL_ROWS if N <= FULL_ROWS else SAMPLED_ROWS, device=dev)
            for dname, dtype in DTYPES.items():
                bar.set_postfix_str(f"N={N} {dname}")
                torch.manual_seed(0)
                q, k, v = (torch.randn(B, H, N, D, device=dev, dtype=dtype) for _ in range(3))
                ref_o, ref_lse = reference_rows(q, k, v, rows, mm, q_offset=layout.q_offset)
                case = dict(pattern=PATTERN, N=N, B=B, H=H, D=D, dtype=dname, rows=int(rows.numel()),
                            check="error")
                impls = {Impl.OURS: lambda: sparse_attention(q, k, v, layout, return_lse=True)}
                if block_mask is not None:
                    flex = C.compiled_flex()
                    impls[Impl.FLEX] = lambda: flex_out_lse(flex, q, k, v, block_mask)
                impls[Impl.CUDNN] = C.sdpa_fn(q, k, v, Impl.CUDNN, causal=True)
                row = {"N": N, "dtype": dname, "check": "error", "rows": int(rows.numel())}
                for impl, fn in impls.items():
                    try:
                        res = fn()
                        ms = C.time_gpu(fn)
                    except RuntimeError as e:  # a backend that refuses the shape is noted, not fatal
                        C.note(f"{impl} N={N} {dname}: {e}")
                        records.append(Record(case, impl, Pass.FWD, None, {"error": str(e)[:200]}))
                        continue
                    o, lse = res if isinstance(res, tuple) else (res, None)
                    stats = error_stats(o[:, :, rows], ref_o, None if lse is None else lse[:, :, rows], ref_lse)
                    records.append(Record(case, impl, Pass.FWD, ms, stats))
                    row[f"{_SHORT[impl]}_max_abs"] = f"{stats['max_abs']:.1e}"
                    row[f"{_SHORT[impl]}_rel_fro"] = f"{stats['rel_fro']:.1e}"
                    row[f"{_SHORT[impl]}_vs_rounded"] = f"{stats['max_abs_vs_rounded']:.1e}"
                    if impl == Impl.OURS:
                        row["ours_lse_err"] = f"{stats['lse_max_abs']:.1e}"
                    del res, o, lse
                table.append(row)
                if N == repeat_n:
                    _repeat(args, q, k, v, layout, block_mask, dict(case, check="repeat", runs=REPEATS),
                            records, table)
                C.empty_cache()
                bar.update()
    return records, table, COLUMNS


def _repeat(args, q, k, v, layout, block_mask, case, records, table) -> None:
    """Run each call ``REPEATS`` times on the same inputs and compare the bits with the first run."""
    do = torch.randn_like(q)
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))

    def grads(deterministic):
        o = sparse_attention(qg, kg, vg, layout, deterministic=deterministic)
        return torch.autograd.grad(o, (qg, kg, vg), do)

    calls = [(Impl.OURS, Pass.FWD, lambda: sparse_attention(q, k, v, layout, return_lse=True)),
             (Impl.OURS, Pass.BWD, lambda: grads(True)),
             (Impl.OURS_ATOMIC, Pass.BWD, lambda: grads(False))]
    if block_mask is not None:
        flex = C.compiled_flex()
        calls.append((Impl.FLEX, Pass.FWD, lambda: flex_out_lse(flex, q, k, v, block_mask)))  # the compiled call
    calls.append((Impl.CUDNN, Pass.FWD, C.sdpa_fn(q, k, v, Impl.CUDNN, causal=True)))
    for impl, pass_, fn in calls:
        try:
            first = fn()
            runs = [fn() for _ in range(REPEATS - 1)]
            ms = C.time_gpu(fn)
        except RuntimeError as e:
            C.note(f"repeat {impl} {pass_}: {e}")
            records.append(Record(case, impl, pass_, None, {"error": str(e)[:200]}))
            continue
        same = all(_same_bits(first, r) for r in runs)
        extra = {"bitwise_repeatable": same}
        if pass_ == Pass.BWD:
            extra["dq_run_to_run_max_abs"] = max(float((r[0].float() - first[0].float()).abs().max()) for r in runs)
        records.append(Record(case, impl, pass_, ms, extra))
        spread = f" dQ+-{extra['dq_run_to_run_max_abs']:.0e}" if impl == Impl.OURS_ATOMIC else ""
        table.append({"N": case["N"], "dtype": case["dtype"],
                      "check": f"{_SHORT[impl]} {pass_} x{REPEATS} same bits: {same}{spread}"})
        del first, runs


def summary(bf) -> List[dict]:
    """The headline numbers of a recorded file, for the book: per (dtype, impl) the max-abs error at the
    shortest and the longest length and their ratio (the growth over the measured range)."""
    out = []
    Ns = bf.distinct("N", check="error")
    for dname in bf.distinct("dtype", check="error"):
        for impl in (Impl.OURS, Impl.FLEX, Impl.CUDNN):
            rows = {r.case["N"]: r for r in bf.select(impl, Pass.FWD, check="error", dtype=dname) if r.ms is not None}
            if min(Ns) in rows and max(Ns) in rows:
                lo, hi = rows[min(Ns)].get("max_abs"), rows[max(Ns)].get("max_abs")
                out.append({"dtype": dname, "impl": impl, "N_lo": min(Ns), "N_hi": max(Ns), "max_abs_lo": lo,
                            "max_abs_hi": hi, "growth": hi / lo if lo > 0 else math.inf})
    return out
