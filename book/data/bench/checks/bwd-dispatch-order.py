"""The one-launch backward's dispatch order, A/B on the device (then `ops.backward.LEAD_FIRST`, now the "lead"
and "head" values of `ops.backward.DISPATCH`, which this script sets so it still measures the same two orders;
`checks/bwd-dispatch-cost.py` is the later A/B with the cost order): head by head (the default
then) against the longest work items of every head first. The one launch made the sinks + window backward
1.12-1.18x FlexAttention's device time at N = 1.5k-3k where the two-launch version was 0.85-0.99x (perf notes,
"The backward's host path and the one-launch backward"). One command on a GPU box (a few minutes):

    python book/data/bench/checks/bwd-dispatch-order.py   # writes $OUT/bwd-dispatch-order-<gpu>.json

Per (pattern, N): the backward replayed from a CUDA graph (device ms) for both orders and for FlexAttention
compiled on the same block mask, B=1, H=16, D=128, bf16; the table printed last gives ours / Flex.
"""
import os

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import backward as B

CASES = [("sinks64+window1024", n) for n in (1536, 2048, 3072, 4096, 8192, 32768)] + \
    [("window1024", n) for n in (2048, 32768)]


def _pattern(name):
    return sa.patterns.sinks_window(64, 1024) if name.startswith("sinks") else sa.patterns.sliding_window(1024)


def main(out_dir: str) -> str:
    records, table = [], []
    flex = C.compiled_flex()
    for name, N in CASES:
        lay = sa.BlockLayout.from_mask_mod(_pattern(name), N, N, 128, 128, device="cuda")
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16"}
        row = {"pattern": name, "N": N}
        for lead in (False, True):
            B.DISPATCH = "lead" if lead else "head"
            ms = C.pass_graph_ms(lambda a, b, c: sa.sparse_attention(a, b, c, lay), q, k, v, do)
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"lead_first": lead, "timing": "device"}))
            row["lead_first" if lead else "head_major"] = None if ms is None else round(ms, 4)
        B.DISPATCH = "auto"
        bm = lay.to_flex()
        ms = C.pass_graph_ms(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, do, warm=True)
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms, {"timing": "device"}))
        row["flex"] = None if ms is None else round(ms, 4)
        for key in ("head_major", "lead_first"):
            if row.get(key) and row.get("flex"):
                row[f"{key}/flex"] = round(row[key] / row["flex"], 3)
        table.append(row)
        print(row, flush=True)
    path = C.write_json("bwd-dispatch-order", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", "head_major", "lead_first", "flex", "head_major/flex", "lead_first/flex"])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
