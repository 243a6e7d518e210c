"""What tensor descriptors cost an eager backward call on the host, and where. The backward's descriptor rule
(``ops._launch.TMA_MIN_PAIRS["bwd"]``) weighs that cost against the device time descriptors save (about 8% of
the kernel at 3k-8k tokens); its eager A/Bs (``bwd-tma-rule-*-h200.json``) move by more than that from run to
run, so this script measures the host side alone. One command on a GPU box (about a minute):

    python book/data/bench/checks/bwd-host-desc.py   # writes $OUT/bwd-host-desc-<gpu>.json

Two layouts at the rule's edge (B=1, H=16, D=128, bf16): window 2048 at N = 3072 (4 352 visited tile pairs,
two launches a call) and sinks 64 + window 1024 at N = 4096 (4 400 pairs; its sink column is split, so a third
launch sums the chunks). Per layout, descriptors always (``BwdConfig(tma=True)``) and never (``tma=False``),
each as: ``autograd`` (``torch.autograd.grad`` from a kept forward), ``direct`` (``ops.backward.backward``) and
``direct, launches stubbed`` (the op's Python with every launch replaced by nothing). Host microseconds per
call of ``CALLS`` calls issued without a sync (``bench.host.host_us``), the median of ``ROUNDS`` rounds with the
variants' order rotating. Last, ``cProfile`` of ``CALLS`` direct calls per variant: the functions whose own time
differs most between descriptors and pointers.
"""
import contextlib
import cProfile
import dataclasses
import os
import pstats
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_us, launches_stubbed, rotated_rounds
from sparseattn.bench.record import Record
from sparseattn.ops import backward as B
from sparseattn.ops import prefill as P
from sparseattn.ops.config import layout_default

ROUNDS, CALLS = 7, 200
H, D = 16, 128
CASES = [("window2048", 3072, sa.patterns.sliding_window(2048)),
         ("sinks64+window1024", 4096, sa.patterns.sinks_window(64, 1024))]


def _own_us(fn) -> dict:
    """Own (not cumulative) microseconds per call of every function ``fn`` runs, over ``CALLS`` calls."""
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(CALLS):
        fn()
    prof.disable()
    torch.cuda.synchronize()
    st = pstats.Stats(prof)
    return {f"{os.path.basename(k[0])}:{k[2]}": v[2] / CALLS * 1e6 for k, v in st.stats.items()}


def main():
    dev = "cuda"
    records, lines = [], []
    for name, N, pattern in CASES:
        torch.manual_seed(0)
        lay = sa.BlockLayout.from_mask_mod(pattern, N, N, 128, 128, device=dev)
        q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
        qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
        scale = D ** -0.5
        with torch.no_grad():
            o, lse = P.forward(q, k, v, lay, scale, None, None)
        base = layout_default("bwd", q.device, False, q.dtype, D, 128, 128)
        variants, stubbed = {}, set()
        for tma in (True, False):
            cfg = dataclasses.replace(base, tma=tma)
            tag = "descriptors" if tma else "pointers"
            out = sa.sparse_attention(qg, kg, vg, lay, bwd_config=cfg)
            variants[f"{tag}, autograd"] = (lambda out=out: torch.autograd.grad(out, (qg, kg, vg), do,
                                                                               retain_graph=True))
            variants[f"{tag}, direct"] = lambda cfg=cfg: B.backward(do, q, k, v, o, lse, lay, scale, True, cfg)
            variants[f"{tag}, direct, launches stubbed"] = variants[f"{tag}, direct"]
            stubbed.add(f"{tag}, direct, launches stubbed")
        names = list(variants)

        def measure(n):
            with launches_stubbed() if n in stubbed else contextlib.nullcontext():
                return host_us(variants[n], dev, CALLS)

        got = rotated_rounds(measure, names, ROUNDS)
        own = {tag: _own_us(variants[f"{tag}, direct"]) for tag in ("descriptors", "pointers")}
        diff = sorted(((own["descriptors"].get(f, 0.0) - own["pointers"].get(f, 0.0), f)
                       for f in set(own["descriptors"]) | set(own["pointers"])), reverse=True)[:8]
        case = dict(pattern=name, N=N, B=1, H=H, D=D, dtype="bf16", pairs=16 * int(lay.stats()["listed_tiles"]))
        for n in names:
            med = statistics.median(got[n])
            records.append(Record({**case, "what": n}, "sparseattn", "bwd", None,
                                  {"host_us": med, "rounds_us": got[n]}))
            lines.append(f"{name:20s} {n:38s} {med:7.1f} us  rounds {min(got[n]):6.1f}-{max(got[n]):6.1f}")
        records.append(Record({**case, "what": "cProfile own us per direct call, descriptors - pointers"},
                              "sparseattn", "bwd", None, {"profile_diff_us": [[f, round(d, 2)] for d, f in diff],
                                                          "profile_total_us": {t: sum(o.values()) for t, o in
                                                                               own.items()}}))
        lines.append(f"{name:20s} profile, own us desc - ptr: " + ", ".join(f"{f} {d:+.1f}" for d, f in diff[:5]))
    path = C.write_json("bwd-host-desc", records, os.environ.get("OUT", "."), C.environment(),
                        meta={"rounds": ROUNDS, "calls": CALLS})
    print(f"wrote {path}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
