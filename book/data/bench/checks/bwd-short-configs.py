"""The backward's tile config at short lengths, on the device: the crossover suite's backward curves that Flex
still wins (window 2048 at N = 3k, documents and routed layouts at 4k) are decided by device time within a few
percent, and the tuned config (``tuned_configs.json``, sm90 bf16 D = 128: dK/dV 64 x 128, dQ 128 x 64, 8
warps, 3 stages) was swept at N = 32k only, where every SM has dozens of programs. At 3k-4k with 16 heads
the one launch has 4-8 programs per SM, and smaller tiles, fewer stages or other column chunks change the
tail. B=1, H=16, D=128, bf16. One command on a GPU box (a few minutes, one compile per config):

    python book/data/bench/checks/bwd-short-configs.py   # writes $OUT/bwd-short-configs-<gpu>.json

Per case: the backward from one kept forward replayed from a CUDA graph (device ms, descriptors as a graph
capture takes them) for each config, and FlexAttention compiled on the same block mask; the median of two
interleaved rounds. The table printed last gives each config / Flex.
"""
import os
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops.config import BwdConfig
from sparseattn.roofline.crossover import family_layout

#: (name, BwdConfig fields); "tuned" is the shipped default
CONFIGS = [
    ("tuned", dict(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=3)),
    ("s2", dict(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=2)),
    ("m32w4", dict(block_m=32, block_n=128, dq_block_m=128, dq_block_n=32, num_warps=4, num_stages=3)),
    ("t64w4", dict(block_m=64, block_n=64, dq_block_m=64, dq_block_n=64, num_warps=4, num_stages=3)),
    ("n64w8", dict(block_m=64, block_n=64, dq_block_m=64, dq_block_n=64, num_warps=8, num_stages=3)),
    ("chunk4", dict(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=3, chunk=4)),
]


def _cases():
    """(name, N, layout on the GPU) of the short backward points Flex wins or nearly wins."""
    cases = (("window2048", "window", 3072, 3072, dict(window=2048)),
             ("sinks64+window1024", "sinks_window", 3072, 3072, dict(sinks=64, window=1024)),
             ("documents2", "documents", 0.5, 4096, {}), ("documents4", "documents", 0.25, 4096, {}),
             ("causal", "documents", 1.0, 4096, {}))
    return [(name, N, family_layout(fam, x, N=N, device="cuda", **kw)[0]) for name, fam, x, N, kw in cases]


def main(out_dir: str) -> str:
    records, table = [], []
    flex = C.compiled_flex()
    cases = _cases()
    for topk in (10, 16):  # routed at 4k, as the crossover suite routes (random inputs, causal)
        g = torch.Generator(device="cuda").manual_seed(4096)
        q, k = (torch.randn(1, 16, 4096, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
        cases.append((f"route_top{topk}", 4096, sa.route(q, k, 128, 128, topk=topk, causal=True)))
    for name, N, lay in cases:
        q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16",
                "tiles": int(lay.to("cpu").stats()["listed_tiles"])}
        times = {}
        bm = lay.to_flex()
        for _ in range(2):
            for cname, fields in CONFIGS:
                cfg = BwdConfig(**fields)
                ms = C.pass_graph_ms(lambda a, b, c, cfg=cfg: sa.sparse_attention(a, b, c, lay, bwd_config=cfg),
                                     q, k, v, do)
                times.setdefault(cname, []).append(ms)
            ms = C.pass_graph_ms(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, do, warm=True)
            times.setdefault("flex", []).append(ms)
        row = {"pattern": name, "N": N}
        for cname, ts in times.items():
            ts = [t for t in ts if t is not None]
            ms = statistics.median(ts) if ts else None
            extra = {"timing": "device"}
            if cname != "flex":
                extra["config"] = dict(CONFIGS)[cname]
            records.append(Record(case, Impl.FLEX if cname == "flex" else Impl.OURS, Pass.BWD, ms,
                                  {**extra, "variant": cname}))
            row[cname] = None if ms is None else round(ms, 4)
        for cname, _ in CONFIGS:
            if row.get(cname) and row.get("flex"):
                row[f"{cname}/flex"] = round(row[cname] / row["flex"], 3)
        table.append(row)
        print(row, flush=True)
    path = C.write_json("bwd-short-configs", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", "flex"] + [f"{c}/flex" for c, _ in CONFIGS])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
