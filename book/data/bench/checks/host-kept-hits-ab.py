"""Kept launch hits against the keyed cache, host time per eager call, many interleaved rounds. One command on
a GPU box:

    python book/data/bench/checks/host-kept-hits-ab.py     # writes $OUT/host-kept-hits-ab-<gpu>.json

The ``host`` suite's three-round A/B (``checks/host-4-h200.json``) put the kept hits 7-18% ahead on the
forward and mixed on the backward (-7% to +48%, the +48% on the run's first case). Here each (pattern, pass)
is measured ``ROUNDS`` times per path, the order of the two paths alternating from round to round
(kept-keyed, keyed-kept, ...), after a warm-up round that is not kept; the JSON has every round.
B=1, H=16, D=128, bf16, N=2048; ``sparseattn.bench.host.host_us`` (200 calls issued without a sync).
"""
import os
import statistics

import torch

import sparseattn as sa
from sparseattn import _fast_launch as F
from sparseattn.bench import _common as C
from sparseattn.bench.cases import prefill_layout
from sparseattn.bench.host import host_us
from sparseattn.bench.record import Impl, Record

ROUNDS = 7
N, H, D = 2048, 16, 128
PATTERNS = ["window1024", "sinks64+window1024", "causal", "random10%+diag"]
PATHS = {"kept": lambda: F.kept_hits(True), "keyed": lambda: F.kept_hits(False)}


def main():
    dev = "cuda"
    torch.manual_seed(0)
    q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    records, lines = [], []
    for pattern in PATTERNS:
        layout = prefill_layout(pattern, N, device=dev)
        fwd, bwd = C.fwd_bwd(lambda a, b, c: sa.sparse_attention(a, b, c, layout), q, k, v, do)
        for pass_, fn in (("fwd", fwd), ("bwd", bwd)):
            for path in PATHS.values():  # warm-up round: plans, kept hits, tensor maps
                with path():
                    host_us(fn, dev)
            got = {name: [] for name in PATHS}
            for r in range(ROUNDS):
                order = list(PATHS) if r % 2 == 0 else list(reversed(PATHS))
                for name in order:
                    with PATHS[name]():
                        got[name].append(host_us(fn, dev))
            med = {name: statistics.median(v) for name, v in got.items()}
            case = dict(pattern=pattern, N=N, B=1, H=H, D=D, dtype="bf16")
            records.append(Record(case, Impl.OURS, pass_, None, {
                "host_us": med["kept"], "host_us_no_kept_hits": med["keyed"], "rounds_kept": got["kept"],
                "rounds_keyed": got["keyed"], "rounds": ROUNDS}))
            lines.append(f"{pattern:20s} {pass_}  kept {med['kept']:7.1f} us  keyed {med['keyed']:7.1f} us  "
                         f"kept/keyed {med['kept'] / med['keyed']:.2f}  rounds kept "
                         f"{min(got['kept']):.0f}-{max(got['kept']):.0f}, keyed "
                         f"{min(got['keyed']):.0f}-{max(got['keyed']):.0f}")
    path = C.write_json("host-kept-hits-ab", records, os.environ.get("OUT", "."), C.environment())
    print(f"wrote {path}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
