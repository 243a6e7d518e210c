"""The one-launch backward with a pipeline depth per kind of program, A/B on the device: the tuned sm90 D = 128
config (3 stages in both loops) against the dK/dV loop at 2 stages and the dQ loop at 3 (`BwdConfig(num_stages=2,
dq_num_stages=3)`; before per-loop depths the one launch needed one depth for both). Why: ptxas for sm_90a
(`tests/tools/compile_sm90.py --ptxas`) spills 312 bytes a thread in `bwd_kernel` at 3/3 and 92 at 2/3, and the
second pass sweep (`checks/backward-pass-sweep-2-h200.json`, two launches) timed the dK/dV pass 1-6% faster at 2
stages on every pattern and the dQ pass fastest at 3. One command on a GPU box (about two minutes):

    python book/data/bench/checks/bwd-loop-stages.py   # writes $OUT/bwd-loop-stages-<gpu>.json

Per pattern: the backward replayed from a CUDA graph (device ms), the median of ``ROUNDS`` rounds with the
variants in rotated order, and whether both variants give the same gradient bits (they must: the depth changes
when a tile is loaded, not the arithmetic). B=1, H=16, D=128, bf16.
"""
import dataclasses
import os
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.cases import prefill_layout
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops.config import default_config

ROUNDS = 3
CASES = [("window1024", 32768), ("sinks64+window1024", 32768), ("documents64", 32768), ("window333", 32768),
         ("window1024", 2048)]


def main(out_dir: str) -> str:
    base = default_config("bwd", "sm90", torch.bfloat16, 128)
    variants = {"3/3": dataclasses.replace(base, num_stages=3, dq_num_stages=3),
                "2/3": dataclasses.replace(base, num_stages=2, dq_num_stages=3)}
    records, table = [], []
    for name, N in CASES:
        lay = prefill_layout(name, N, 128, device="cuda")
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16"}
        grads = {}
        for label, cfg in variants.items():
            qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
            o = sa.sparse_attention(qg, kg, vg, lay, bwd_config=cfg)
            grads[label] = torch.autograd.grad(o, (qg, kg, vg), do)
        same = all(torch.equal(a, b) for a, b in zip(*grads.values()))
        times = {label: [] for label in variants}
        items = list(variants.items())
        for r in range(ROUNDS):
            for label, cfg in items[r % 2:] + items[:r % 2]:
                ms = C.pass_graph_ms(lambda a, b, c: sa.sparse_attention(a, b, c, lay, bwd_config=cfg), q, k, v, do)
                if ms is not None:
                    times[label].append(ms)
        row = {"pattern": name, "N": N, "same_bits": same}
        for label, cfg in variants.items():
            ms = statistics.median(times[label]) if times[label] else None
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"stages": label, "rounds_ms": times[label],
                                                                 "config": C.config_dict(cfg), "same_bits": same,
                                                                 "timing": "device"}))
            row[label] = None if ms is None else round(ms, 4)
        if row.get("3/3") and row.get("2/3"):
            row["2/3 vs 3/3"] = round(row["2/3"] / row["3/3"], 3)
        table.append(row)
        print(row, flush=True)
    path = C.write_json("bwd-loop-stages", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", "3/3", "2/3", "2/3 vs 3/3", "same_bits"])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
