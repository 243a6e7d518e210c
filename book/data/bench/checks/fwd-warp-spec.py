"""The forward with Triton's warp specialisation, A/B on the device. Triton 3.6 splits a loop into a producer
warp group (TMA loads) and two consumer warp groups (dots, softmax) on Hopper only for a kernel launched with
4 warps (12 run), and its pass aborts on a kernel with two specialised loops; the first sessions' attempt had
two loops (partial tiles, then full) and 8 warps, where the flag does nothing. ``FwdConfig(warp_specialize=
True)`` now walks both lists in one loop (``prefill_fwd._fwd_tiles_one_loop``). One command on a GPU box:

    python book/data/bench/checks/fwd-warp-spec.py   # writes $OUT/fwd-warp-spec-<gpu>.json

Per case: the forward replayed from a CUDA graph (device ms), median of ``ROUNDS`` rounds with the variants
in rotated order; the relative error of each variant's output against the default's (both are checked
against fp64 by the tests). bf16, B=1, 128 x 128 layout tiles.
"""
import os
import statistics
import sys

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import FwdConfig
from sparseattn.ops.config import default_config
from sparseattn.roofline.cases import prefill_layout

ROUNDS = 3
WS = {128: {"ws 128x128 s2": FwdConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, warp_specialize=True),
            "ws 128x64 s3": FwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, warp_specialize=True),
            "ws 128x64 s4": FwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=4, warp_specialize=True)},
      64: {"ws 128x128 s2": FwdConfig(block_m=128, block_n=128, num_warps=4, num_stages=2, warp_specialize=True),
           "ws 128x128 s3": FwdConfig(block_m=128, block_n=128, num_warps=4, num_stages=3, warp_specialize=True),
           "ws 128x64 s3": FwdConfig(block_m=128, block_n=64, num_warps=4, num_stages=3, warp_specialize=True)}}
# (pattern, N, Hq, Hkv, D, dtype)
CASES = [("causal", 32768, 16, 16, 128, torch.bfloat16), ("window1024", 32768, 16, 16, 128, torch.bfloat16),
         ("sinks64+window1024", 32768, 16, 16, 128, torch.bfloat16),
         ("random10%+diag", 32768, 16, 16, 128, torch.bfloat16),
         ("stripes(plain lambda)", 32768, 16, 16, 128, torch.bfloat16),
         ("causal&(window256|dilated8)", 32768, 16, 16, 128, torch.bfloat16),
         ("window333", 32768, 16, 16, 128, torch.bfloat16),
         ("window1024", 32768, 32, 8, 128, torch.bfloat16), ("window1024", 32768, 16, 16, 128, torch.float16),
         ("window1024", 2048, 16, 16, 128, torch.bfloat16),
         ("causal", 32768, 32, 32, 64, torch.bfloat16), ("window1024", 32768, 32, 32, 64, torch.bfloat16)]


def main(out_dir: str) -> str:
    records, table, env = [], [], C.environment()
    for name, N, Hq, Hkv, D, dtype in CASES:
        lay = prefill_layout(name, N, 128, device="cuda")
        q = torch.randn(1, Hq, N, D, device="cuda", dtype=dtype)
        k, v = (torch.randn(1, Hkv, N, D, device="cuda", dtype=dtype) for _ in range(2))
        variants = {"default": default_config("fwd", "sm90", dtype, D), **WS[D]}
        outs = {label: sa.sparse_attention(q, k, v, lay, config=cfg) for label, cfg in variants.items()}
        errs = {label: C.rel_err(o, outs["default"]) for label, o in outs.items()}
        del outs
        times = {label: [] for label in variants}
        items = list(variants.items())
        for r in range(ROUNDS):
            for label, cfg in items[r % len(items):] + items[:r % len(items)]:
                ms = C.graph_ms(lambda: sa.sparse_attention(q, k, v, lay, config=cfg))
                if ms is not None:
                    times[label].append(ms)
        case = {"pattern": name, "N": N, "B": 1, "H": Hq, "Hkv": Hkv, "D": D, "dtype": str(dtype)[6:]}
        med = {label: statistics.median(t) if t else None for label, t in times.items()}
        for label, cfg in variants.items():
            records.append(Record(case, Impl.OURS, Pass.FWD, med[label], {
                "variant": label, "rounds_ms": times[label], "config": C.config_dict(cfg),
                "rel_err_vs_default": errs[label], "timing": "device"}))
        best = min((l for l in WS[D] if med[l]), key=lambda l: med[l])
        table.append({"case": f"{name} N={N} H={Hq}/{Hkv} D={D} {case['dtype']}", "default": round(med["default"], 4),
                      **{l: round(med[l], 4) for l in WS[D] if med[l]},
                      "best/default": round(med[best] / med["default"], 3), "max err": f"{max(errs.values()):.1e}"})
        print(table[-1], flush=True)
        path = C.write_json("fwd-warp-spec", records, out_dir, env)  # after every case: a cut run keeps its rows
        del q, k, v, lay
        C.empty_cache()
    for row in table:
        print(" | ".join(f"{k}={v}" for k, v in row.items()))
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", sys.argv[1] if len(sys.argv) > 1 else ".")))
