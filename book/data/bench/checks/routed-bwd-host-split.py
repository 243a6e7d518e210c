"""Where a routed backward's host time goes at N = 4k. ``checks/routed-bwd-host.py`` (2026-12-02 10:33 UTC)
measured ~490 us of host time per eager backward call for routed layouts (top 2, 10, 16 of 32 key blocks)
against 236 us for a static window 2048 of similar device time, so the routed backward at the sparse end of
the crossover curve runs at its host rate (0.53 ms eager, 0.22 ms from a CUDA graph). This splits one call
into layers, host microseconds per call (``bench.host.host_us``, calls back to back, no sync), median of
three rounds each:

* ``autograd``: the backward through ``torch.autograd.grad`` from one kept forward (as the suites time it);
* ``direct``: ``ops.backward.backward`` called with the saved tensors (no autograd engine);
* ``python``: the same with every launch stubbed out (``bench.host.launches_stubbed``): our Python alone;
* ``forward``: the forward call, for scale;

and a ``cProfile`` of the direct call (the 40 functions with the most own time). B=1, H=16, D=128, bf16.
One command on a GPU box (about one minute):

    python book/data/bench/checks/routed-bwd-host-split.py   # writes $OUT/routed-bwd-host-split-<gpu>.json
"""
import os
import statistics

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_profile, host_us, launches_stubbed
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops.backward import backward

N = 4096


def main(out_dir: str) -> str:
    g = torch.Generator(device="cuda").manual_seed(N)
    q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    layouts = {f"route_top{t}": sa.route(q, k, 128, 128, topk=t, causal=True) for t in (2, 16)}
    layouts["window2048"] = sa.BlockLayout.from_mask_mod(sa.patterns.sliding_window(2048), N, N, 128, 128,
                                                         device="cuda")
    scale = 128 ** -0.5
    records, table = [], []
    for name, lay in layouts.items():
        fwd, bwd = C.fwd_bwd(lambda a, b, c, lay=lay: sa.sparse_attention(a, b, c, lay), q, k, v, do)
        o, lse = sa.sparse_attention(q, k, v, lay, return_lse=True)

        def direct(lay=lay, o=o, lse=lse):
            return backward(do, q, k, v, o, lse, lay, scale, True)

        def python(direct=direct):
            with launches_stubbed():
                return direct()
        fns = {"autograd": bwd, "direct": direct, "python": python, "forward": fwd}
        for fn in fns.values():
            fn()
        got = {n: statistics.median(host_us(fn, "cuda") for _ in range(3)) for n, fn in fns.items()}
        prof = host_profile(direct, "cuda", top=40)
        case = {"pattern": name, "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16", "dynamic": lay.dynamic}
        records.append(Record(case, Impl.OURS, Pass.BWD, got["autograd"] / 1e3,
                              {"host_us": got, "profile_direct": prof}))
        table.append({"pattern": name, **{f"{n}_us": round(x, 1) for n, x in got.items()}})
        print(table[-1], flush=True)
        for p in prof[:25]:
            print(f"   {p['function'][-70:]:70s} own {p['own_us']:7.1f} cum {p['cum_us']:7.1f} n {p['calls']:.0f}")
    path = C.write_json("routed-bwd-host-split", records, out_dir, C.environment())
    C.print_table(table, list(table[0]))
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
