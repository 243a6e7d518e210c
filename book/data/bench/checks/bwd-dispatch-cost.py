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

``--edge`` times instead the lengths where 16 heads' inputs just outgrow the L2 (N = 3k-6k; window 2048,
causal, 2, 4 and 8 documents, sinks + window) in the three orders, to choose the "auto" rule there
(writes ``bwd-dispatch-l2-<gpu>.json``; about three minutes). ``--held-out`` times layouts the "auto"
rule's long-tail test was not chosen on (``HELD_OUT_CASES``).

Per (pattern, N): the backward replayed from a CUDA graph (device ms) in each order and FlexAttention's,
compiled on the same block mask; B=1, H=16, D=128, bf16; the table printed last gives ours / Flex.
"""
import os
import statistics
import sys

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import backward as B

#: (label, DISPATCH, L2_SHARE)
VARIANTS = (("head", "head", None), ("lead", "lead", None), ("cost-all", "cost", None), ("cost-0.5", "cost", 0.5),
            ("cost-0.25", "cost", 0.25))
ROUNDS = 3
CASES = [("window2048", n) for n in (2048, 4096, 8192)] + \
    [("sinks64+window1024", 4096), ("documents8", 4096), ("causal", 2048), ("window1024", 32768),
     ("causal", 32768)]
#: ``--edge``: around the size where every head's inputs outgrow the L2 (50 MiB: N = 3276 at 16 heads, D = 128)
EDGE_CASES = [("window2048", n) for n in (3072, 4096, 6144)] + [("causal", 4096)] + \
    [(f"documents{d}", 4096) for d in (2, 4, 8)] + [("sinks64+window1024", 4096)]
EDGE_VARIANTS = VARIANTS[:3]  # head, lead, cost across every head
#: ``--held-out``: layouts past the L2 that the "auto" rule of the time (``long_tail``: the longest program at
#: least 0.2 of one SM's share, mean >= 10) was not chosen on, with "auto" itself beside the three orders
#: (writes ``bwd-dispatch-held-out-<gpu>.json``; about three minutes). The run of 2026-12-02 10:35 UTC
#: measured that rule more than 0.5% slower than "lead" on five of the eight (random tiles at 30% and 50% at
#: 4k, sinks + window, causal and two documents at 6k; up to 8.8%); its successor,
#: ``ops.backward.uneven_programs`` with ``COST_ORDER_MAX_L2``, was chosen on these rows and the edge rows
#: together.
HELD_OUT_CASES = [("random0.2", 4096), ("random0.3", 4096), ("random0.5", 4096), ("sinks64+window1024", 6144),
                  ("documents2", 6144), ("documents2", 8192), ("causal", 6144), ("window1024", 4096)]
HELD_OUT_VARIANTS = VARIANTS[:3] + (("auto", "auto", 1.0),)
#: ``--far``: layouts far past the L2 (N = 16k: 5x it at 16 heads), where "auto" goes "lead" (or head by head),
#: against ``DISPATCH = "group"``: the cost order within groups of heads whose inputs fit half or all of the
#: L2 together (writes ``bwd-dispatch-far-<gpu>.json``; about three minutes). The recording of 2026-12-02
#: 10:46 UTC had ours 0.7% behind Flex on the device for two documents of 8k tokens at 16k, "lead".
FAR_CASES = [("documents2", 16384), ("documents4", 16384), ("causal", 16384), ("window2048", 16384),
             ("sinks64+window1024", 16384), ("random0.5", 16384)]
FAR_VARIANTS = (("head", "head", None), ("lead", "lead", None), ("group-0.5", "group", 0.5),
                ("group-1", "group", 1.0))


def _pattern(name, N):
    if name.startswith("sinks"):
        return sa.patterns.sinks_window(64, 1024)
    if name.startswith("window"):
        return sa.patterns.sliding_window(int(name[len("window"):]))
    if name.startswith("documents"):  # equal documents, causal inside each (the crossover suite's family)
        ids = torch.arange(N, device="cuda") // (N // int(name[len("documents"):]))
        return sa.patterns.and_masks(sa.patterns.causal(), sa.patterns.document(ids))
    return sa.patterns.causal()


def _layout(name, N):
    if name.startswith("random"):  # the crossover suite's block-random family (whole tiles, seed 0, + diagonal)
        from sparseattn.roofline.crossover import family_layout
        return family_layout("block_random", float(name[len("random"):]), N=N, device="cuda")[0]
    return sa.BlockLayout.from_mask_mod(_pattern(name, N), N, N, 128, 128, device="cuda")


def main(out_dir: str, edge: bool = False, held_out: bool = False, far: bool = False) -> str:
    cases, variants = (FAR_CASES, FAR_VARIANTS) if far else (HELD_OUT_CASES, HELD_OUT_VARIANTS) if held_out else \
        (EDGE_CASES, EDGE_VARIANTS) if edge else (CASES, VARIANTS)
    orders = tuple(v[0] for v in variants)
    records, table = [], []
    flex = C.compiled_flex()
    for name, N in cases:
        lay = _layout(name, N)
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16"}
        row = {"pattern": name, "N": N}
        times = {label: [] for label in orders}
        for r in range(ROUNDS):
            for label, dispatch, share in variants[r % len(variants):] + variants[:r % len(variants)]:
                B.DISPATCH, B.L2_SHARE = dispatch, share
                ms = C.pass_graph_ms(lambda a, b, c: sa.sparse_attention(a, b, c, lay), q, k, v, do)
                if ms is not None:
                    times[label].append(ms)
        for label, dispatch, share in variants:
            ms = statistics.median(times[label]) if times[label] else None
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"dispatch": dispatch, "l2_share": share,
                                                                 "rounds_ms": times[label], "timing": "device"}))
            row[label] = None if ms is None else round(ms, 4)
        B.DISPATCH, B.L2_SHARE = "auto", 1.0  # the defaults
        bm = lay.to_flex()
        ms = C.pass_graph_ms(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, do, warm=True)
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms, {"timing": "device"}))
        row["flex"] = None if ms is None else round(ms, 4)
        for key in orders:
            if row.get(key) and row.get("flex"):
                row[f"{key}/flex"] = round(row[key] / row["flex"], 3)
        table.append(row)
        print(row, flush=True)
    suite = "bwd-dispatch-far" if far else "bwd-dispatch-held-out" if held_out else "bwd-dispatch-l2" if edge \
        else "bwd-dispatch-cost"
    path = C.write_json(suite, records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", *orders, "flex", *(f"{k}/flex" for k in orders)])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", "."), edge="--edge" in sys.argv[1:], held_out="--held-out" in sys.argv[1:],
               far="--far" in sys.argv[1:]))
