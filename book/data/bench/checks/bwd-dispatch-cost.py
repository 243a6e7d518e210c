"""The one-launch backward's dispatch order, A/B on the device (`ops.backward.DISPATCH`, `L2_SHARE`): head
by head, the split chunks of every head first ("lead", the default before), and programs sorted by their
estimated cost, most expensive first ("cost"), across every head (share None) or within groups of heads
whose inputs fit a share of the L2. A list-schedule simulation of window 2048 at N = 1k-8k (16 heads, 132
SMs, one program per SM at a time) gave the cost order a 6-25% shorter launch than head by head. The first
run (`checks/bwd-dispatch-cost-1-h200.json`: head, lead, cost across every head, each measured once in that
order) found the cost order 15-20% faster at N <= 2k and 3-10% slower where the heads' inputs exceed the L2;
this run adds the grouped variants and interleaves the variants in rounds (the median of ``ROUNDS``
replays, each round in a rotated order), so a slow drift of the clock cannot favour the first variant.
One command on a GPU box (about four minutes):

    python book/data/bench/checks/bwd-dispatch-cost.py   # writes $OUT/bwd-dispatch-cost-<gpu>.json

Per (pattern, N): the backward replayed from a CUDA graph (device ms) in each order and FlexAttention's,
compiled on the same block mask; B=1, H=16, D=128, bf16; the table printed last gives ours / Flex.
"""
import os
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import backward as B

#: (label, DISPATCH, L2_SHARE)
VARIANTS = (("head", "head", None), ("lead", "lead", None), ("cost-all", "cost", None), ("cost-0.5", "cost", 0.5),
            ("cost-0.25", "cost", 0.25))
ORDERS = tuple(v[0] for v in VARIANTS)
ROUNDS = 3
CASES = [("window2048", n) for n in (2048, 4096, 8192)] + \
    [("sinks64+window1024", 4096), ("documents8", 4096), ("causal", 2048), ("window1024", 32768),
     ("causal", 32768)]


def _pattern(name, N):
    if name.startswith("sinks"):
        return sa.patterns.sinks_window(64, 1024)
    if name.startswith("window"):
        return sa.patterns.sliding_window(int(name[len("window"):]))
    if name == "documents8":  # eight equal documents, causal inside each (the crossover suite's family)
        ids = torch.arange(N, device="cuda") // (N // 8)
        return sa.patterns.and_masks(sa.patterns.causal(), sa.patterns.document(ids))
    return sa.patterns.causal()


def main(out_dir: str) -> str:
    records, table = [], []
    flex = C.compiled_flex()
    for name, N in CASES:
        lay = sa.BlockLayout.from_mask_mod(_pattern(name, N), N, N, 128, 128, device="cuda")
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16"}
        row = {"pattern": name, "N": N}
        times = {label: [] for label in ORDERS}
        for r in range(ROUNDS):
            for label, dispatch, share in VARIANTS[r % len(VARIANTS):] + VARIANTS[:r % len(VARIANTS)]:
                B.DISPATCH, B.L2_SHARE = dispatch, share
                ms = C.pass_graph_ms(lambda a, b, c: sa.sparse_attention(a, b, c, lay), q, k, v, do)
                if ms is not None:
                    times[label].append(ms)
        for label, dispatch, share in VARIANTS:
            ms = statistics.median(times[label]) if times[label] else None
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"dispatch": dispatch, "l2_share": share,
                                                                 "rounds_ms": times[label], "timing": "device"}))
            row[label] = None if ms is None else round(ms, 4)
        B.DISPATCH, B.L2_SHARE = "cost", 0.5
        bm = lay.to_flex()
        ms = C.pass_graph_ms(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, do, warm=True)
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms, {"timing": "device"}))
        row["flex"] = None if ms is None else round(ms, 4)
        for key in ORDERS:
            if row.get(key) and row.get("flex"):
                row[f"{key}/flex"] = round(row[key] / row["flex"], 3)
        table.append(row)
        print(row, flush=True)
    path = C.write_json("bwd-dispatch-cost", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", *ORDERS, "flex", *(f"{k}/flex" for k in ORDERS)])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
