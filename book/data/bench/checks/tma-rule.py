"""A tensor-descriptor size rule (``ops._launch.TMA_MIN_PAIRS[pass]``), A/B on the device: eager calls of one
pass (Triton's ``do_bench``: host and device together; a CUDA graph always takes descriptors) with the rule
of that pass below ``RULES[pass][0]`` visited tile pairs against descriptors always (rule 0), interleaved in
one process, on issue 13's short rows and the crossover suite's window 2048 and sinks 64 + window 1024
lengths. The forward's first rule (20 000 pairs, set from the descriptors' host cost alone) made eager
forwards at 2k-8k 13-15% slower in the crossover suite; this A/B set it at 1 024 and checked the backward's
12 000. B=1, H=16, D=128, bf16. One command on a GPU box (a minute or two per pass):

    python book/data/bench/checks/tma-rule.py fwd   # writes $OUT/fwd-tma-rule-<gpu>.json
    python book/data/bench/checks/tma-rule.py bwd   # writes $OUT/bwd-tma-rule-<gpu>.json
    python book/data/bench/checks/tma-rule.py bwd 1000000000   # pointer loads always vs descriptors always

A second argument replaces the rule under test (a rule above every case's pairs: pointer loads always).

The backward is timed as dQ, dK, dV from a kept forward. The table printed last gives both times per rule
and rule / always. Each time is the median of ``do_bench``'s calls (``C.time_gpu``, as the crossover suite
times), in three rounds that each start at the next variant; until 2026-12-02 this script took
``do_bench``'s default, the mean, which a host hiccup pulls up: its eager backward times sat 2-3x above the
crossover suite's medians for the same calls at 2k (``bwd-tma-rule-3-h200.json``: window 2048 at N = 2048,
0.457 ms against 0.167), so the recorded rule files
(``fwd-tma-rule-h200.json``, ``bwd-tma-rule-h200.json`` to ``-3``) are means."""
import os
import statistics
import sys

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import rotated_rounds
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import _launch as L

#: per pass: (the rule under test, descriptors always), and the cases, the likeliest to change first
RULES = {"fwd": (20_000, 0), "bwd": (12_000, 0)}
CASES = {"fwd": [("window1024", 1024), ("window1024", 2048), ("window2048", 4096), ("window2048", 8192),
                 ("sinks64+window1024", 2048), ("sinks64+window1024", 4096)],
         "bwd": [("window1024", 2048), ("window2048", 3072), ("window2048", 4096), ("sinks64+window1024", 4096),
                 ("window1024", 1024), ("sinks64+window1024", 2048), ("window2048", 2048), ("window2048", 6144),
                 ("window2048", 8192), ("sinks64+window1024", 8192),
                 # between 2 176 and 4 352 pairs (added 2026-12-02 to place the backward's rule)
                 ("window1024", 2560), ("sinks64+window1024", 2560), ("window1024", 3072),
                 ("sinks64+window1024", 3072), ("window2048", 2560)]}


def _pattern(name):
    if name.startswith("sinks"):
        return sa.patterns.sinks_window(64, 1024)
    return sa.patterns.sliding_window(int(name.removeprefix("window")))


def _call(pass_: str, lay, q, k, v, do):
    if pass_ == "fwd":
        return lambda: sa.sparse_attention(q, k, v, lay)
    return C.fwd_bwd(lambda a, b, c: sa.sparse_attention(a, b, c, lay), q, k, v, do)[1]


def main(pass_: str, out_dir: str, rule=None) -> str:
    if pass_ not in RULES:
        raise ValueError(f"pass must be one of {sorted(RULES)}, got {pass_!r}")
    records, table = [], []
    shipped, rules = L.TMA_MIN_PAIRS[pass_], RULES[pass_]
    if rule is not None:
        rules = (int(rule), rules[1])
    for name, N in CASES[pass_]:
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        calls = {}
        for rule in rules:  # a launch plan takes the rule when it is built (first call on its layout)
            L.TMA_MIN_PAIRS[pass_] = rule
            lay = sa.BlockLayout.from_mask_mod(_pattern(name), N, N, 128, 128, device="cuda")
            calls[rule] = _call(pass_, lay, q, k, v, do)
            calls[rule]()
        L.TMA_MIN_PAIRS[pass_] = shipped
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16",
                "pairs": 16 * int(lay.stats()["listed_tiles"])}
        # interleaved, each round starting at the next variant: host speed drifts within a run
        eager = rotated_rounds(lambda r: C.time_gpu(calls[r], warmup_ms=25, rep_ms=100), rules, 3)
        row = {"pattern": name, "N": N, "pairs": case["pairs"]}
        for rule in rules:
            ms = statistics.median(eager[rule])
            records.append(Record(case, Impl.OURS, Pass.FWD if pass_ == "fwd" else Pass.BWD, ms,
                                  {"tma_min_pairs": rule, "timing": "eager"}))
            row[f"eager_{rule}"] = round(ms, 4)
        row["eager rule/always"] = round(row[f"eager_{rules[0]}"] / row["eager_0"], 3)
        table.append(row)
        print(row, flush=True)
    path = C.write_json(f"{pass_}-tma-rule", records, out_dir, C.environment())
    C.print_table(table, list(table[0]))
    return path


if __name__ == "__main__":
    print(main(sys.argv[1] if len(sys.argv) > 1 else "fwd", os.environ.get("OUT", "."),
               sys.argv[2] if len(sys.argv) > 2 else None))
