"""What autograd adds to an eager backward call on the GPU, in one process, variants interleaved.
``checks/routed-bwd-host-split-h200.json`` (2026-12-02 10:39 UTC) measured our window 2048 backward at N = 4k at
286 us of host time per call through ``torch.autograd.grad`` against 83 us for the same
``ops.backward.backward`` called directly; a trivial ``autograd.Function`` costs ~50 us through autograd. On the
CPU (launches stubbed, N = 256; the backward runs on the calling thread) autograd adds only that floor (77 us =
35 direct + 34 floor + 8). On the GPU autograd runs a CUDA node's backward on its device thread; this times,
host us per call (``bench.host.host_us``; rotated rounds, medians):

* ``autograd``: our backward through ``torch.autograd.grad`` from one kept forward;
* ``autograd_enable_grad``: the same with the Function's backward body under ``torch.enable_grad()``
  (grad mode is off in the engine's backward; a probe in a second process measured 186 against 241 us with a
  trivial Function wrapping the direct call, not interleaved);
* ``direct``: ``ops.backward.backward`` on the calling thread;
* ``direct_thread``: the same on a fresh Python thread (a core whose caches the call has not warmed);
* ``trivial``: a Function whose backward returns its input (the engine's floor);
* ``trivial_direct``: a trivial Function whose backward calls ``direct`` (our call inside the engine's thread).

B=1, H=16, D=128, bf16, window 2048 at N = 4096. One command on a GPU box (about one minute):

    python book/data/bench/checks/autograd-host.py   # writes $OUT/autograd-host-<gpu>.json

Run on 2026-12-02 11:39 UTC (``autograd-host-h200.json``; host us per call, medians of five rotated rounds):
autograd 403, autograd_enable_grad 419, direct 155, direct_thread 163, trivial 81, trivial_direct 349. Our
call inside the engine's device thread took ~270 us (349 - 81) against 155 on the calling thread and 163 on
a fresh Python thread; grad mode is not the cause. ``--pin`` runs the same with the process pinned to one
CPU core before any autograd call (the engine's device threads, started at the first backward, inherit the
mask), to test whether the cost is waking the device thread on an idle core (writes
``autograd-host-pinned-<gpu>.json``).
"""
import os
import statistics
import sys
import threading
import time

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_us, rotated_rounds
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import attention as A
from sparseattn.ops.backward import backward

N = 4096
CALLS = 200


def main(out_dir: str, pin: bool = False) -> str:
    if pin:  # before any autograd call: the engine's device threads inherit this thread's mask
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
    g = torch.Generator(device="cuda").manual_seed(N)
    q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16, generator=g)
                   for _ in range(4))
    lay = sa.BlockLayout.from_mask_mod(sa.patterns.sliding_window(2048), N, N, 128, 128, device="cuda")
    o, lse = sa.sparse_attention(q, k, v, lay, return_lse=True)
    scale = 128 ** -0.5

    def direct():
        return backward(do, q, k, v, o, lse, lay, scale, True)

    class Trivial(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return x.clone()

        @staticmethod
        def backward(ctx, grad):
            return grad

    class TrivialDirect(Trivial):
        @staticmethod
        def backward(ctx, grad):
            direct()
            return grad

    _, ours = C.fwd_bwd(lambda a, b, c: sa.sparse_attention(a, b, c, lay), q, k, v, do)
    plain = A._SparseAttention.backward

    def with_grad(ctx, *grads):
        with torch.enable_grad():
            return plain(ctx, *grads)

    def ours_enable_grad():
        A._SparseAttention.backward = staticmethod(with_grad)
        try:
            return ours()
        finally:
            A._SparseAttention.backward = staticmethod(plain)

    qg = q.detach().requires_grad_()
    triv, triv_direct = Trivial.apply(qg), TrivialDirect.apply(qg)

    def in_thread():
        got = []

        def body():
            direct()
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(CALLS):
                direct()
            got.append((time.perf_counter() - t0) / CALLS * 1e6)
        t = threading.Thread(target=body)
        t.start()
        t.join()
        torch.cuda.synchronize()
        return got[0]

    fns = {"autograd": ours, "autograd_enable_grad": ours_enable_grad, "direct": direct,
           "trivial": lambda: torch.autograd.grad(triv, (qg,), do, retain_graph=True),
           "trivial_direct": lambda: torch.autograd.grad(triv_direct, (qg,), do, retain_graph=True)}
    for fn in fns.values():
        fn()

    def measure(name):
        return in_thread() if name == "direct_thread" else host_us(fns[name], "cuda", CALLS)
    got = rotated_rounds(measure, [*fns, "direct_thread"], 5)
    med = {n: statistics.median(x) for n, x in got.items()}
    case = {"pattern": "window2048", "N": N, "B": 1, "H": 16, "D": 128, "dtype": "bf16"}
    records = [Record(case, Impl.OURS, Pass.BWD, med["autograd"] / 1e3, {"host_us": med, "rounds_us": got})]
    table = [{"variant": n, "host_us": round(x, 1), "rounds": " ".join(f"{y:.0f}" for y in got[n])}
             for n, x in med.items()]
    path = C.write_json("autograd-host-pinned" if pin else "autograd-host", records, out_dir, C.environment())
    C.print_table(table, list(table[0]))
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", "."), pin="--pin" in sys.argv[1:]))
