"""A process for Nsight Compute: one backward of ours and one of FlexAttention's on the same block mask, each
inside its own NVTX range (``ours``, ``flex``), after ``--warmup`` untimed calls; ``ncu`` picks the kernels
by name (FlexAttention's generated template kernels are ``triton_tem_*``)::

    ncu --clock-control none --kernel-name regex:"dkdv_kernel|dq_kernel|triton_tem|flex" \\
        --section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats \\
        python -m sparseattn.bench.ncu_target --pattern window1024 --n 32768 --warmup 0

(``--pass fwd`` profiles the forward instead.) Shapes are the suites' (B=1, H=16, D=128, bf16). Nothing is
timed here; the counters are ncu's."""
from __future__ import annotations

import argparse

import torch

from ..ops import sparse_attention
from . import _common as C
from .cases import prefill_layout


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(prog="python -m sparseattn.bench.ncu_target", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pattern", default="window1024")
    ap.add_argument("--n", type=int, default=32768)
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--pass", dest="pass_", choices=("fwd", "bwd"), default="bwd")
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--warmup", type=int, default=3, help="untimed calls before the profiled one")
    args = ap.parse_args(argv)
    torch.manual_seed(0)
    shape = (1, args.heads, args.n, args.head_dim)
    q, k, v = (torch.randn(shape, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn(shape, device="cuda", dtype=torch.bfloat16)
    layout = prefill_layout(args.pattern, args.n, device="cuda")
    calls = {"ours": lambda: sparse_attention(q, k, v, layout)}
    if not args.no_flex:
        calls["flex"] = C.flex_fn(q, k, v, layout.to_flex())
    for name, fwd in calls.items():
        step = fwd if args.pass_ == "fwd" else C.grad_fn(fwd, (q, k, v), do)
        for _ in range(args.warmup):  # compile, autotune, warm caches: outside the profiled range
            step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_push(name)
        step()
        torch.cuda.synchronize()
        torch.cuda.nvtx.range_pop()
        print(f"profiled {name} {args.pass_} on {args.pattern}, N={args.n}")


if __name__ == "__main__":
    main()
