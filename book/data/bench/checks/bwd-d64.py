"""Why the backward at head dim 64 trails FlexAttention more than at 128 (issue 13's D = 64, H = 32 rows:
0.80x causal, 0.83x window 1024 in versus-h200.json of 2026-12-01, against 0.98x / 0.99x at D = 128, H = 16).
One command on a GPU box (a few minutes):

    python book/data/bench/checks/bwd-d64.py   # writes $OUT/bwd-d64-<gpu>.json

Per (pattern, D, config): the backward replayed from a CUDA graph (device ms), B=1, N=32k, bf16, H*D = 2048,
for the tuned default (one launch), the same config as two launches (``overlap=False``), FlexAttention's dQ
tile (128 x 64), pointer loads instead of tensor descriptors, and FlexAttention compiled on the same block
mask; the table printed last gives ours / Flex."""
import os
from dataclasses import replace

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops.backward import bwd_config

N = 32768
CASES = [("window1024", 64, 32), ("causal", 64, 32), ("window1024", 128, 16)]


def _variants(default):
    return {"default": default, "two_launches": replace(default, overlap=False),
            "dq128x64": replace(default, dq_block_n=64), "no_tma": replace(default, tma=False),
            "dq128x64_no_tma": replace(default, dq_block_n=64, tma=False)}


def main(out_dir: str) -> str:
    records, table = [], []
    flex = C.compiled_flex()
    for name, D, H in CASES:
        mod = sa.patterns.sliding_window(1024) if name == "window1024" else sa.patterns.causal()
        lay = sa.BlockLayout.from_mask_mod(mod, N, N, 128, 128, device="cuda")
        q, k, v, do = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        case = {"pattern": name, "N": N, "B": 1, "H": H, "D": D, "dtype": "bf16"}
        default = bwd_config(q, lay)
        for label, cfg in _variants(default).items():
            ms = C.pass_graph_ms(lambda a, b, c, cfg=cfg: sa.sparse_attention(a, b, c, lay, bwd_config=cfg),
                                 q, k, v, do)
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, {"variant": label, "config": C.config_dict(cfg),
                                                                   "timing": "device"}))
            table.append({"pattern": name, "D": D, "variant": label, "ms": None if ms is None else round(ms, 3)})
        bm = lay.to_flex()
        ms_f = C.pass_graph_ms(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, do, warm=True)
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms_f, {"timing": "device"}))
        for row in table:
            if row["pattern"] == name and row["D"] == D and "ours/flex" not in row and row["ms"] and ms_f:
                row["flex_ms"], row["ours/flex"] = round(ms_f, 3), round(row["ms"] / ms_f, 3)
        for row in table[-5:]:
            print(row, flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    path = C.write_json("bwd-d64", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "D", "variant", "ms", "flex_ms", "ours/flex"])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
