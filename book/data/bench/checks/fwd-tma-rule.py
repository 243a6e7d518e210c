"""The forward's tensor-descriptor size rule (``ops._launch.TMA_MIN_PAIRS["fwd"]``), A/B on the device: an
eager call (Triton's ``do_bench``: host and device together; a CUDA graph always takes descriptors) with the
rule of 79162fc (pointer loads below 20 000 visited tile pairs) and with descriptors always (rule 0, shipped
since the crossover suite's fwd part of 2026-12-01 08:3x UTC showed the rule 13-15% slower at 4k-8k), on
issue 13's short rows and the crossover suite's window 2048 and sinks 64 + window 1024 lengths.
B=1, H=16, D=128, bf16. One command on a GPU box (a minute or two):

    python book/data/bench/checks/fwd-tma-rule.py   # writes $OUT/fwd-tma-rule-<gpu>.json

The table printed last gives both times per rule and rule / always."""
import os
import statistics

import torch
from triton.testing import do_bench

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import _launch as L

CASES = [("window1024", n) for n in (1024, 2048)] + [("window2048", n) for n in (4096, 8192)] + \
    [("sinks64+window1024", n) for n in (2048, 4096)]
RULES = (20_000, 0)


def _pattern(name):
    if name.startswith("sinks"):
        return sa.patterns.sinks_window(64, 1024)
    return sa.patterns.sliding_window(int(name.removeprefix("window")))


def main(out_dir: str) -> str:
    records, table = [], []
    shipped = L.TMA_MIN_PAIRS["fwd"]
    for name, N in CASES:
        q, k, v = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        calls = {}
        for rule in RULES:  # a launch plan takes the rule when it is built (first call on its layout)
            L.TMA_MIN_PAIRS["fwd"] = rule
            lay = sa.BlockLayout.from_mask_mod(_pattern(name), N, N, 128, 128, device="cuda")
            calls[rule] = lambda lay=lay: sa.sparse_attention(q, k, v, lay)
            calls[rule]()
        L.TMA_MIN_PAIRS["fwd"] = shipped
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16",
                "pairs": 16 * int(lay.stats()["listed_tiles"])}
        eager = {r: [] for r in RULES}
        for _ in range(3):  # interleaved: host speed drifts within a run
            for rule in RULES:
                eager[rule].append(do_bench(calls[rule], warmup=25, rep=100))
        row = {"pattern": name, "N": N, "pairs": case["pairs"]}
        for rule in RULES:
            ms = statistics.median(eager[rule])
            records.append(Record(case, Impl.OURS, Pass.FWD, ms, {"tma_min_pairs": rule, "timing": "eager"}))
            row[f"eager_{rule}"] = round(ms, 4)
        row["eager rule/always"] = round(row["eager_20000"] / row["eager_0"], 3)
        table.append(row)
        print(row, flush=True)
    L.TMA_MIN_PAIRS["fwd"] = shipped
    path = C.write_json("fwd-tma-rule", records, out_dir, C.environment())
    C.print_table(table, list(table[0]))
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
