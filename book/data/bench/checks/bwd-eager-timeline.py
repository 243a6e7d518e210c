"""Where an eager backward's time goes at 3k-4k, the lengths where the crossover suite's backward curves are
decided. The recorded suite (``crossover-h200.json``, bwd part 2026-12-02 02:56 UTC) timed our eager
backward 18-30 us above its CUDA-graph replay on every point under 5 300 visited tile pairs (window 2048 at
N = 3k: 0.298 against 0.275 ms; two documents at 4k: 0.340 against 0.312), while FlexAttention's eager and
replayed times agree within 3 us. Under the rule ``ops._launch.TMA_MIN_PAIRS["bwd"]`` those eager calls load
through pointers and the replay through tensor descriptors: is the gap the loads (device) or the host (the
flush no longer hiding the call's preparation)? This traces the ``do_bench`` loop (flush, call) with
``torch.profiler`` (:func:`sparseattn.bench.host.eager_timeline`) for our backward with descriptors always,
with pointers always, and FlexAttention, and times each with ``do_bench`` (median of three rotated rounds)
and from a CUDA graph. B=1, H=16, D=128, bf16. One command on a GPU box (~3 min, FlexAttention compiles per
case):

    python book/data/bench/checks/bwd-eager-timeline.py   # writes $OUT/bwd-eager-timeline-<gpu>.json
"""
import os
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import eager_timeline, rotated_rounds
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import _launch as L
from sparseattn.roofline.crossover import family_layout

#: (name, family, grid value, N, family keywords): the crossover suite's points under the backward's rule
CASES = [("window2048", "window", 3072, 3072, dict(window=2048)),
         ("documents2", "documents", 0.5, 4096, {}),
         ("sinks64+window1024", "sinks_window", 4096, 4096, dict(sinks=64, window=1024)),
         ("window2048", "window", 4096, 4096, dict(window=2048))]
#: our variants: the backward's TMA_MIN_PAIRS while the layout's launch plan is built
VARIANTS = {"descriptors": 0, "pointers": 10**9}
FIELDS = ("total_us", "lead_us", "gaps_us", "busy_us", "kernels", "host_first_us", "host_span_us")


def main(out_dir: str) -> str:
    records, table = [], []
    shipped = L.TMA_MIN_PAIRS["bwd"]
    for name, fam, x, N, kw in CASES:
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        calls, lays = {}, {}
        for variant, rule in VARIANTS.items():  # a launch plan takes the rule when its layout's first call builds it
            L.TMA_MIN_PAIRS["bwd"] = rule
            lays[variant] = lay = family_layout(fam, x, N=N, device="cuda", **kw)[0]
            calls[variant] = C.fwd_bwd(lambda a, b, c, lay=lay: sa.sparse_attention(a, b, c, lay), q, k, v, do)[1]
            calls[variant]()
        L.TMA_MIN_PAIRS["bwd"] = shipped
        bm = lays["descriptors"].to_flex()
        flex = C.compiled_flex()
        make_flex = lambda a, b, c: flex(a, b, c, block_mask=bm)  # noqa: E731
        calls["flex"] = C.fwd_bwd(make_flex, q, k, v, do)[1]
        calls["flex"]()
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16",
                "pairs": 16 * int(lays["descriptors"].stats()["listed_tiles"])}
        eager = rotated_rounds(lambda n: C.time_gpu(calls[n], warmup_ms=25, rep_ms=150), list(calls), 3)
        device = {"descriptors": C.pass_graph_ms(lambda a, b, c: sa.sparse_attention(a, b, c, lays["descriptors"]),
                                                 q, k, v, do),
                  "flex": C.pass_graph_ms(make_flex, q, k, v, do, warm=True)}
        for variant, fn in calls.items():
            tl = eager_timeline(fn)
            ms = statistics.median(eager[variant])
            impl = Impl.FLEX if variant == "flex" else Impl.OURS
            records.append(Record(case, impl, Pass.BWD, ms, {"variant": variant, "eager_rounds": eager[variant],
                                                             "device_ms": device.get(variant), "timeline": tl}))
            row = {"pattern": name, "N": N, "variant": variant, "eager_ms": round(ms, 4),
                   "graph_ms": None if device.get(variant) is None else round(device[variant], 4)}
            row.update({f: round(tl[f], 1) for f in FIELDS if f in tl})
            table.append(row)
            print(row, {n[:40]: round(u, 1) for n, u in tl["kernel_us"].items()}, flush=True)
    path = C.write_json("bwd-eager-timeline", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", "variant", "eager_ms", "graph_ms", *FIELDS])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
