"""The backward's tensor-descriptor size rule (``ops._launch.TMA_MIN_PAIRS["bwd"]``, 12 000 visited tile pairs),
A/B on the device: an eager backward (Triton's ``do_bench`` over dQ, dK, dV from a kept forward: host and
device together; a CUDA graph always takes descriptors) with the rule as shipped and with descriptors always
(rule 0). The rule was set from the host cost of the descriptors alone (116 us a call); the forward's first
rule, set the same way, turned out 9-15% slower where the calls are device-bound
(``checks/fwd-tma-rule-h200.json``), and a model of eager time as max(host, device) put the backward's
break-even near 4 000 pairs. Measured (``checks/bwd-tma-rule-h200.json``): pointer loads faster at every
case, up to 6 528 pairs; the rule stands (perf notes). B=1, H=16, D=128, bf16; one command on a GPU box (a
minute or two):

    python book/data/bench/checks/bwd-tma-rule.py   # writes $OUT/bwd-tma-rule-<gpu>.json

The table printed last gives both times per rule and rule / always."""
import os
import statistics

import torch
from triton.testing import do_bench

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import _launch as L

CASES = [("window1024", 2048), ("window2048", 3072), ("window2048", 4096), ("sinks64+window1024", 4096),
         ("window1024", 1024), ("sinks64+window1024", 2048)]  # the likeliest to change first
RULES = (12_000, 0)


def _pattern(name):
    if name.startswith("sinks"):
        return sa.patterns.sinks_window(64, 1024)
    return sa.patterns.sliding_window(int(name.removeprefix("window")))


def main(out_dir: str) -> str:
    records, table = [], []
    shipped = L.TMA_MIN_PAIRS["bwd"]
    for name, N in CASES:
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        calls = {}
        for rule in RULES:  # a launch plan takes the rule when it is built (first call on its layout)
            L.TMA_MIN_PAIRS["bwd"] = rule
            lay = sa.BlockLayout.from_mask_mod(_pattern(name), N, N, 128, 128, device="cuda")
            _, calls[rule] = C.fwd_bwd(lambda a, b, c, lay=lay: sa.sparse_attention(a, b, c, lay), q, k, v, do)
            calls[rule]()
        L.TMA_MIN_PAIRS["bwd"] = shipped
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16",
                "pairs": 16 * int(lay.stats()["listed_tiles"])}
        eager = {r: [] for r in RULES}
        for _ in range(3):  # interleaved: host speed drifts within a run
            for rule in RULES:
                eager[rule].append(do_bench(calls[rule], warmup=25, rep=100))
        row = {"pattern": name, "N": N, "pairs": case["pairs"]}
        for rule in RULES:
            ms = statistics.median(eager[rule])
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"tma_min_pairs": rule, "timing": "eager"}))
            row[f"eager_{rule}"] = round(ms, 4)
        row["eager rule/always"] = round(row[f"eager_{RULES[0]}"] / row["eager_0"], 3)
        table.append(row)
        print(row, flush=True)
    path = C.write_json("bwd-tma-rule", records, out_dir, C.environment())
    C.print_table(table, list(table[0]))
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
