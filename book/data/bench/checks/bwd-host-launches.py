"""Where an eager backward call's time goes at N = 1k-4k on the GPU: for our default backward config, the
same with whole dK/dV columns (``chunk`` unbounded: no column reduce) and without the overlapped dQ pass,
per call: the CUDA kernels it launches (torch.profiler), its device time (one CUDA graph replay), its eager
``do_bench`` time and its host time (200 calls issued without a sync). One command on a GPU box:

    python book/data/bench/checks/bwd-host-launches.py      # writes $OUT/bwd-host-launches-<gpu>.json

Recorded as ``bwd-host-launches-h200.json`` beside this script (H200, 2026-12-01, commit 5bff8d7); the
kernels it lists led to ``set_materialize_grads(False)`` (a zero dLSE was filled per call) and to cutting
dK/dV columns only when a launch has fewer columns than SMs.
"""
import os
from dataclasses import replace

import torch
from torch.profiler import ProfilerActivity, profile

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_us
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops.backward import bwd_config

CASES = (("window1024", 2048), ("window1024", 4096), ("causal", 2048), ("window1024", 1024))


def main(out_dir: str) -> str:
    records = []
    for pattern, N in CASES:
        mm = sa.patterns.sliding_window(1024) if pattern == "window1024" else sa.patterns.causal()
        lay = sa.BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cuda")
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        base = bwd_config(q, lay)
        for name, cfg in (("default", base), ("nosplit", replace(base, chunk=1 << 30)),
                          ("nooverlap", replace(base, overlap=False))):
            make = lambda a, b, c, cfg=cfg: sa.sparse_attention(a, b, c, lay, bwd_config=cfg)  # noqa: E731
            side = torch.cuda.Stream()
            _, bwd = C.fwd_bwd(make, q, k, v, do, side)
            device_ms = C.graph_ms(bwd, side)
            _, bwd = C.fwd_bwd(make, q, k, v, do)
            ms = C.time_gpu(bwd)
            h = host_us(bwd, "cuda")
            bwd()
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                bwd()
                torch.cuda.synchronize()
            kernels = [e.name[:40] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            case = {"pattern": pattern, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16", "config": name}
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"device_ms": device_ms, "host_us": h,
                                                                 "kernels": kernels}))
            print(records[-1].to_json(), flush=True)
    return C.write_json("bwd-host-launches", records, out_dir, C.environment())


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
