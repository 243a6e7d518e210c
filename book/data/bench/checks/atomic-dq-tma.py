"""Does the atomic backward get faster when the copy engine adds dQ (``ops.backward.ATOMIC_DQ_TMA``)?
Issue 13's atomic path (5 tile matmuls, dQ accumulated in float32 inside the dK/dV pass) ran 0.76-1.03x
FlexAttention in versus-h200.json, slower than the deterministic path (7 matmuls) on every D = 128 row: each
step issues BM x D element atomics from the program's threads. With the flag, each step's dQ tile goes out
as one ``cp.reduce.async.bulk.tensor`` through a descriptor of the accumulator. One command on a GPU box (about
three minutes):

    python book/data/bench/checks/atomic-dq-tma.py   # writes $OUT/atomic-dq-tma-<gpu>.json

Per pattern (B=1, H=16, D=128, N=32k, bf16, 128 x 128 tiles), the backward replayed from a CUDA graph
(device ms): the deterministic default, the atomic path with element atomics, the atomic path with the bulk
reduce, and FlexAttention compiled on the same block mask; each atomic variant's dQ against the deterministic
one's (relative error). The table printed last gives each over Flex."""
import os

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.cases import prefill_layout
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import backward as bwd

N, H, D = 32768, 16, 128
DEV = "cuda"
PATTERNS = ["causal", "window1024", "sinks64+window1024", "documents64", "window333"]


def _grads(lay, q, k, v, do, deterministic):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(sa.sparse_attention(q, k, v, lay, deterministic=deterministic), (q, k, v), do)


def main(out_dir: str) -> str:
    records, table = [], []
    default = bwd.ATOMIC_DQ_TMA
    flex = C.compiled_flex()
    for name in PATTERNS:
        lay = prefill_layout(name, N, device=DEV)
        torch.manual_seed(0)
        q, k, v, do = (torch.randn(1, H, N, D, device=DEV, dtype=torch.bfloat16) for _ in range(4))
        case = {"pattern": name, "N": N, "B": 1, "H": H, "D": D, "dtype": "bf16"}
        ref_dq = _grads(lay, q, k, v, do, True)[0].double()
        row = {"pattern": name}
        for label, deterministic, bulk in (("deterministic", True, False), ("atomic", False, False),
                                           ("atomic_bulk", False, True)):
            bwd.ATOMIC_DQ_TMA = bulk
            ms = C.pass_graph_ms(lambda a, b, c, d=deterministic: sa.sparse_attention(a, b, c, lay, deterministic=d),
                                 q, k, v, do)
            extra = {"variant": label, "timing": "device"}
            if not deterministic:
                dq = _grads(lay, q, k, v, do, False)[0].double()
                extra["dq_rel_err_vs_deterministic"] = ((dq - ref_dq).norm() / ref_dq.norm()).item()
            records.append(Record(case, Impl.OURS, Pass.BWD, ms, extra))
            row[f"{label}_ms"] = None if ms is None else round(ms, 3)
        bwd.ATOMIC_DQ_TMA = default
        bm = lay.to_flex()
        ms_f = C.pass_graph_ms(lambda a, b, c: flex(a, b, c, block_mask=bm), q, k, v, do, warm=True)
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms_f, {"timing": "device"}))
        row["flex_ms"] = None if ms_f is None else round(ms_f, 3)
        for label in ("deterministic", "atomic", "atomic_bulk"):
            if ms_f and row[f"{label}_ms"]:
                row[f"flex/{label}"] = round(ms_f / row[f"{label}_ms"], 2)
        table.append(row)
        print(row, flush=True)
        del q, k, v, do
        torch.cuda.empty_cache()
    path = C.write_json("atomic-dq-tma", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "deterministic_ms", "atomic_ms", "atomic_bulk_ms", "flex_ms",
                          "flex/deterministic", "flex/atomic", "flex/atomic_bulk"])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
