"""The backward's preprocess, ``Δ = rowsum(dO ∘ O)`` (``kernels.prefill_bwd.delta_kernel``), by tile and warp
count. At N = 4k with 16 heads it took 13.4 us of a 0.31 ms backward (``bwd-eager-timeline-h200.json``), while
reading its 32 MiB at the H200's ~4.6 TB/s takes ~7 us; the crossover suite's backward curves still lost to
FlexAttention at 4k (documents, routed) were 1-2% behind on the device. Each variant is timed with
``do_bench`` (median, L2 flushed before every call, as in the crossover suite), interleaved over three
rotated rounds, at N = 4k and 32k, B=1, H=16, D=128, bf16; checked against the float32 eager sum first. One
command on a GPU box (under a minute):

    python book/data/bench/checks/delta-configs.py   # writes $OUT/delta-configs-<gpu>.json
"""
import math
import os
import statistics

import torch

from sparseattn.bench import _common as C
from sparseattn.bench.host import rotated_rounds
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.kernels import prefill_bwd

#: (BLOCK_M, num_warps); the first is the shipped one
VARIANTS = [(64, 4), (32, 4), (16, 2), (32, 2), (128, 8), (64, 8), (128, 4), (16, 4)]


def _call(o, do, delta, block_m: int, warps: int):
    B, H, L, D = o.shape
    grid = (math.ceil(L / block_m), B * H)
    return lambda: prefill_bwd.delta_kernel[grid](
        O=o, DO=do, DELTA=delta, stride_ob=o.stride(0), stride_oh=o.stride(1), stride_om=o.stride(2),
        stride_dob=do.stride(0), stride_doh=do.stride(1), stride_dom=do.stride(2), Hq=H, Lq=L, HEAD_DIM=D,
        BLOCK_M=block_m, num_warps=warps, num_stages=1)


def main(out_dir: str) -> str:
    records, table = [], []
    for N in (4096, 32768):
        o, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
        want = (o.float() * do.float()).sum(-1)
        calls = {}
        for bm, w in VARIANTS:
            delta = torch.full((1, 16, N), float("nan"), device="cuda")
            calls[(bm, w)] = _call(o, do, delta, bm, w)
            calls[(bm, w)]()
            torch.testing.assert_close(delta, want, rtol=1e-5, atol=1e-4)
        calls["torch"] = lambda: (o.float() * do.float()).sum(-1)
        got = rotated_rounds(lambda v: C.time_gpu(calls[v], warmup_ms=25, rep_ms=100), list(calls), 3)
        gb = 2 * o.numel() * o.element_size() / 1e9
        case = {"N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16"}
        for v, times in got.items():
            ms = statistics.median(times)
            name = v if isinstance(v, str) else f"m{v[0]}w{v[1]}"
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"variant": name, "rounds": times,
                                                                  "tbps": gb / ms}))
            table.append({"N": N, "variant": name, "us": round(ms * 1e3, 2), "TB/s": round(gb / ms, 2)})
    path = C.write_json("delta-configs", records, out_dir, C.environment())
    C.print_table(table, ["N", "variant", "us", "TB/s"])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
