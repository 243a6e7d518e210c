"""The routed backward's host time at 4k, the one prefill curve of the crossover suite where Flex still
crosses cuDNN first (``crossover-h200.json``, backward part 2026-12-02 08:22 UTC): its first point, two key
blocks per query block, took 0.502 ms eager (rounds 0.383-0.567) against 0.220 ms on the device, where a
static backward of that device time runs at about its device time. A routed layout is dynamic: its launch
plan is shared by shape and its tables are passed per call (``ops._launch.dynamic_plan``), its backward
keeps the "lead" order, and its transposed lists come from the layout. This measures, for routed layouts
(top 2, 10 and 16 of 32 key blocks, causal: the curve's first point and the two it meets cuDNN between) and
a static window 2048, the backward from one kept forward: eager (``do_bench`` median of three rotated
rounds), from a CUDA graph, host microseconds per call (``bench.host.host_us``: calls issued back to back,
no synchronisation) and the functions with the most own time (``host_profile``). Each routed layout runs
twice, under ``ops.backward.DYNAMIC_ORDER`` "lead" (the default: split chunks first, then head by head) and
"cost" (every program sorted by the call's own costs, computed on the device per call): a list-schedule
simulation gave "lead" a 9-22% longer launch.
B=1, H=16, D=128, bf16, N = 4096. One command on a GPU box (about two minutes):

    python book/data/bench/checks/routed-bwd-host.py   # writes $OUT/routed-bwd-host-<gpu>.json
"""
import os
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_profile, host_us, rotated_rounds
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import backward as BW

N = 4096


def main(out_dir: str) -> str:
    g = torch.Generator(device="cuda").manual_seed(N)
    q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    layouts = {f"route_top{t}": sa.route(q, k, 128, 128, topk=t, causal=True) for t in (2, 10, 16)}
    layouts["window2048"] = sa.BlockLayout.from_mask_mod(sa.patterns.sliding_window(2048), N, N, 128, 128,
                                                         device="cuda")

    def under(mode, fn):
        """``fn`` run with ``DYNAMIC_ORDER = mode`` (read at every call)"""
        def run(*a):
            BW.DYNAMIC_ORDER = mode
            try:
                return fn(*a)
            finally:
                BW.DYNAMIC_ORDER = "lead"
        return run

    runs = [(name, mode) for name, lay in layouts.items() for mode in (("lead", "cost") if lay.dynamic else ("lead",))]
    calls = {}
    for name, mode in runs:
        lay = layouts[name]
        calls[(name, mode)] = under(mode, C.fwd_bwd(lambda a, b, c, lay=lay: sa.sparse_attention(a, b, c, lay), q, k,
                                                    v, do)[1])
        calls[(name, mode)]()
    eager = rotated_rounds(lambda n: C.time_gpu(calls[n], warmup_ms=25, rep_ms=150), list(calls), 3)
    records, table = [], []
    for name, mode in runs:
        lay, fn = layouts[name], calls[(name, mode)]
        BW.DYNAMIC_ORDER = mode  # read when the backward is captured (the order's device work is in the graph)
        try:
            dev = C.pass_graph_ms(lambda a, b, c, lay=lay: sa.sparse_attention(a, b, c, lay), q, k, v, do)
        finally:
            BW.DYNAMIC_ORDER = "lead"
        host = statistics.median(host_us(fn, "cuda") for _ in range(3))
        prof = host_profile(fn, "cuda")
        ms = statistics.median(eager[(name, mode)])
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16", "dynamic": lay.dynamic}
        records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"dynamic_order": mode, "device_ms": dev,
                                                              "eager_rounds": eager[(name, mode)], "host_us": host,
                                                              "profile": prof}))
        table.append({"pattern": name, "order": mode, "eager_ms": round(ms, 4),
                      "graph_ms": None if dev is None else round(dev, 4), "host_us": round(host, 1),
                      "top_own_us": f"{prof[0]['function'][-48:]} {prof[0]['own_us']:.1f}"})
        print(table[-1], flush=True)
    path = C.write_json("routed-bwd-host", records, out_dir, C.environment())
    C.print_table(table, list(table[0]))
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
