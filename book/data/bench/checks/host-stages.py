"""Where an eager call's host time goes, stage by stage, without a profiler (cProfile inflates every Python
call; here each stage is a wall-clock total over ``CALLS`` calls issued back to back). One command on a GPU box:

    python book/data/bench/checks/host-stages.py     # writes $OUT/host-stages-<gpu>.json

For window 1024 at N = 2048 (B=1, H=16, D=128, bf16) it records host microseconds per call of:
* the autograd floor: ``torch.autograd.grad`` through a custom Function whose backward returns its inputs
  (no kernel), and FlexAttention's backward (compiled on the same block mask);
* our backward through autograd, our backward op called directly (no autograd), and the direct call with
  the dQ pass not overlapped and with tensor descriptors off;
* each stage of the direct call (time inside every kernel launch, the tensor descriptors, the stream fork
  and join, allocations) as the share of the direct call they take;
* our forward on a static and on a routed (dynamic) layout, with the same stage split.

Since the launch plans keep their cache hits (2026-12-01, late), a launch's own stages are ``launch_direct``
(a kept hit), the keyed ``_fast_launch.launch`` and ``direct_for``. Recorded on 2026-12-01 (H200): ``host-stages-1-h200.json`` on c23a5da (backward with five launches
and a side stream), ``-2`` after the raw launcher entry, the kept fork/join events and the shape-keyed plans of
dynamic layouts, ``-3`` after the one-launch backward; ``-4`` on 2026-12-02 (02:45 UTC) with the kept hits,
before the launcher got device addresses (``checks/bwd-host-split.py`` measures that A/B). Host times move by
a third between runs (the autograd floor read 114, 88 and 113 us): compare rows within one file.
"""
import collections
import os
import time
from dataclasses import replace

import torch

import sparseattn as sa
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_us
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.ops import _launch as L
from sparseattn.ops import backward as B
from sparseattn.ops import prefill as P

CALLS = 300
N, H, D = 2048, 16, 128


class _Stages:
    """Wrap module attributes so each call adds its wall time to a named total."""

    def __init__(self):
        self.total = collections.defaultdict(float)
        self.saved = []

    def wrap(self, module, attr, name=None):
        fn = getattr(module, attr)
        name = name or attr
        total = self.total

        def timed(*a, **kw):
            t = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                total[name] += time.perf_counter() - t
        self.saved.append((module, attr, fn))
        setattr(module, attr, timed)

    def restore(self):
        for module, attr, fn in reversed(self.saved):
            setattr(module, attr, fn)
        self.saved.clear()


def staged(fn, wraps):
    """(host us per call, {stage: us per call}) of ``fn`` with the ``wraps`` stages timed."""
    st = _Stages()
    for w in wraps:
        st.wrap(*w)
    try:
        fn()
        torch.cuda.synchronize()
        st.total.clear()
        t0 = time.perf_counter()
        for _ in range(CALLS):
            fn()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
    finally:
        st.restore()
    return (t1 - t0) / CALLS * 1e6, {k: v / CALLS * 1e6 for k, v in st.total.items()}


def _launch_internals():
    """Stages inside a launch: a kept hit's argument check and launch (``launch_direct``), the keyed cache
    (``launch``, its key ``_arg_key``), keeping a new hit (``direct_for``), and Triton's encoding of a tensor
    descriptor into a tensor map."""
    from triton.backends.nvidia import driver

    from sparseattn import _fast_launch
    return [(_fast_launch, "launch_direct"), (_fast_launch, "launch", "_fast_launch.launch (keyed)"),
            (_fast_launch, "direct_for"), (_fast_launch, "_arg_key"), (driver, "make_tensordesc_arg")]


class _Nothing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return q + 0

    @staticmethod
    def backward(ctx, do):
        return do, do, do


def main(out_dir: str) -> str:
    torch.manual_seed(0)
    lay = sa.BlockLayout.from_mask_mod(sa.patterns.sliding_window(1024), N, N, 128, 128, device="cuda")
    q, k, v, do = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    scale = D ** -0.5
    case = {"pattern": "window1024", "N": N, "B": 1, "H": H, "D": D, "dtype": "bf16"}
    records = []

    def add(name, impl, pass_, us, stages=None):
        records.append(Record({**case, "what": name}, impl, pass_, us / 1e3,
                              {"host_us": us, **({"stages_us": stages} if stages else {})}))
        print(f"{name:40s} {us:8.1f} us" + ("" if not stages else "  " + ", ".join(
            f"{k} {v:.1f}" for k, v in sorted(stages.items(), key=lambda kv: -kv[1]))), flush=True)

    # autograd floor
    o0 = _Nothing.apply(qg, kg, vg)
    add("autograd floor (no kernel)", Impl.OURS, Pass.BWD,
        host_us(lambda: torch.autograd.grad(o0, (qg, kg, vg), do, retain_graph=True), "cuda", CALLS))
    # FlexAttention
    try:
        flex, bm = C.compiled_flex(), lay.to_flex()
        of = flex(qg, kg, vg, block_mask=bm)
        make = lambda a, b, c: flex(a, b, c, block_mask=bm)  # noqa: E731
        add("flex bwd (autograd)", Impl.FLEX, Pass.BWD,
            host_us(lambda: torch.autograd.grad(of, (qg, kg, vg), do, retain_graph=True), "cuda", CALLS))
        add("flex fwd", Impl.FLEX, Pass.FWD, host_us(lambda: make(q, k, v), "cuda", CALLS))
    except Exception as e:  # noqa: BLE001
        C.note(f"flex: {type(e).__name__}: {str(e)[:200]}")
    # ours, backward
    from sparseattn.ops import attention as A
    o = sa.sparse_attention(qg, kg, vg, lay)
    us, stages = staged(lambda: torch.autograd.grad(o, (qg, kg, vg), do, retain_graph=True),
                        [(A, "backward", "op backward inside autograd"), (B.L, "launch")])
    add("ours bwd (autograd)", Impl.OURS, Pass.BWD, us, stages)
    rl0 = sa.route(q, k, 128, 128, topk=4, causal=True)
    o_r = sa.sparse_attention(qg, kg, vg, rl0)
    us, stages = staged(lambda: torch.autograd.grad(o_r, (qg, kg, vg), do, retain_graph=True),
                        [(A, "backward", "op backward inside autograd"), (B.L, "launch"),
                         (B, "dynamic_column_work"), (B.L, "dynamic_plan")])
    add("ours bwd routed top4 (autograd)", Impl.OURS, Pass.BWD, us, stages)
    with torch.no_grad():
        od, lse = P.forward(q, k, v, lay, scale, None, None)
    cfg = B.bwd_config(q, lay)
    wraps = [(B.L, "launch"), (B, "_descriptors"), (B, "dq_split_launch"), (B, "column_work"),
             (B.L, "tma_ok"), (B, "bwd_config"), (torch, "empty"), (torch, "empty_like"),
             (torch.cuda, "stream", "torch.cuda.stream"), (torch.cuda, "current_stream")] + _launch_internals()
    for name, c in (("direct", cfg), ("direct, no overlap", replace(cfg, overlap=False)),
                    ("direct, no tma", replace(cfg, tma=False))):
        us, stages = staged(lambda c=c: B.backward(do, q, k, v, od, lse, lay, scale, True, c), wraps)
        add(f"ours bwd {name}", Impl.OURS, Pass.BWD, us, stages)
    # ours, forward: static and routed layouts
    rl = sa.route(q, k, 128, 128, topk=4, causal=True)
    fw = [(P.L, "launch"), (P.L, "tensor_descriptors"), (P.L, "dynamic_plan"), (P, "_static_kwargs"),
          (P.L, "tma_ok"), (torch, "empty"), (torch, "empty_like")] + _launch_internals()
    for name, l in (("static window1024", lay), ("routed top4", rl)):
        add(f"ours fwd {name} (op)", Impl.OURS, Pass.FWD,
            host_us(lambda l=l: sa.sparse_attention(q, k, v, l), "cuda", CALLS))
        us, stages = staged(lambda l=l: P.forward(q, k, v, l, scale, None, None), fw)
        add(f"ours fwd {name} direct", Impl.OURS, Pass.FWD, us, stages)
    return C.write_json("host-stages", records, out_dir, C.environment())


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
