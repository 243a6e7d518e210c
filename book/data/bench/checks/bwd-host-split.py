"""Where the host time of one eager backward call goes, against FlexAttention's and cuDNN's, in interleaved
rounds. One command on a GPU box:

    python book/data/bench/checks/bwd-host-split.py     # writes $OUT/bwd-host-split-<gpu>.json

Window 1024 at N = 2048 (B=1, H=16, D=128, bf16: the crossover suite's host probe). Each variant is the host
time of ``CALLS`` calls issued without a sync (``sparseattn.bench.host.host_us``), measured ``ROUNDS`` times,
the variants' order rotating from round to round; the JSON keeps every round and the median. Variants:

* ``floor``: ``torch.autograd.grad`` through a custom Function whose backward returns its incoming gradient
  three times (no allocation, no kernel); ``floor, cpu tensors``: the same on CPU tensors, where autograd
  runs the backward on the calling thread (on CUDA tensors it hands it to a device thread and back);
* ``our Function's shape``: our Function's structure (five saved tensors, a non-differentiable LSE output)
  whose backward only allocates dQ, dK, dV;
* ``ours (autograd)``, ``flex (autograd)``, ``cudnn (autograd)``: the real backward calls;
* ``ours direct``: ``ops.backward.backward`` called without autograd, and the same with every kernel launch
  replaced by nothing (``launches stubbed``: the op's Python without the launches);
* ``..., tensor pointers``: ours with the launch cache handing Triton's launcher tensors instead of their
  device addresses (``_fast_launch.pointer_ints(False)``, the path before 2026-12-02).
The device kernels each backward call runs are counted with ``torch.profiler``. Recorded twice on 2026-12-02
(H200): ``bwd-host-split-1-h200.json`` (02:45 UTC, before the addresses; no ``tensor pointers`` rows) and
``bwd-host-split-h200.json`` (02:55 UTC, the A/B).
"""
import os
import statistics

import torch

import sparseattn as sa
from sparseattn import _fast_launch as F
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_us, kernel_launches, launches_stubbed, rotated_rounds
from sparseattn.bench.record import Record
from sparseattn.ops import backward as B
from sparseattn.ops import prefill as P

ROUNDS, CALLS = 7, 200
N, H, D = 2048, 16, 128


class _Floor(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        return torch.empty_like(q)

    @staticmethod
    def backward(ctx, do):
        return do, do, do


class _OurShape(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v):
        o, lse = torch.empty_like(q), torch.empty(q.shape[:-1], device=q.device)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def main():
    dev = "cuda"
    torch.manual_seed(0)
    lay = sa.BlockLayout.from_mask_mod(sa.patterns.sliding_window(1024), N, N, 128, 128, device=dev)
    q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=torch.bfloat16) for _ in range(4))
    qg, kg, vg = (t.clone().requires_grad_() for t in (q, k, v))
    qc, kc, vc, doc = (torch.randn(1, H, 64, D, dtype=torch.bfloat16) for _ in range(4))
    qc, kc, vc = (t.requires_grad_() for t in (qc, kc, vc))
    scale = D ** -0.5
    with torch.no_grad():
        o, lse = P.forward(q, k, v, lay, scale, None, None)

    def grad(out, inputs, g):
        return lambda: torch.autograd.grad(out, inputs, g, retain_graph=True)

    variants = {
        "floor": grad(_Floor.apply(qg, kg, vg), (qg, kg, vg), do),
        "floor, cpu tensors": grad(_Floor.apply(qc, kc, vc), (qc, kc, vc), doc),
        "our Function's shape": grad(_OurShape.apply(qg, kg, vg)[0], (qg, kg, vg), do),
        "ours (autograd)": grad(sa.sparse_attention(qg, kg, vg, lay), (qg, kg, vg), do),
        "ours direct": lambda: B.backward(do, q, k, v, o, lse, lay, scale, True),
    }
    variants["ours (autograd), tensor pointers"] = variants["ours (autograd)"]
    variants["ours direct, tensor pointers"] = variants["ours direct"]
    stubbed = {"ours direct, launches stubbed": lambda: B.backward(do, q, k, v, o, lse, lay, scale, True)}
    try:
        flex, bm = C.compiled_flex(), lay.to_flex()
        variants["flex (autograd)"] = grad(flex(qg, kg, vg, block_mask=bm), (qg, kg, vg), do)
    except Exception as e:  # noqa: BLE001
        C.note(f"flex: {type(e).__name__}: {str(e)[:200]}")
    try:
        variants["cudnn (autograd)"] = grad(C.sdpa_fn(qg, kg, vg, "cudnn", True)(), (qg, kg, vg), do)
    except Exception as e:  # noqa: BLE001
        C.note(f"cudnn: {type(e).__name__}: {str(e)[:200]}")
    names = list(variants) + list(stubbed)

    def measure(name):
        if name in stubbed:
            with launches_stubbed():
                return host_us(stubbed[name], dev, CALLS)
        with F.pointer_ints("tensor pointers" not in name):
            return host_us(variants[name], dev if "cpu" not in name else "cpu", CALLS)

    got = rotated_rounds(measure, names, ROUNDS)
    launches = {name: kernel_launches(fn, dev) for name, fn in variants.items() if "cpu" not in name}
    case = dict(pattern="window1024", N=N, B=1, H=H, D=D, dtype="bf16")
    records, lines = [], []
    for name in names:
        med = statistics.median(got[name])
        impl = "flex" if name.startswith("flex") else "cudnn" if name.startswith("cudnn") else "sparseattn"
        records.append(Record({**case, "what": name}, impl, "bwd", None, {
            "host_us": med, "rounds_us": got[name], "kernels_per_call": launches.get(name)}))
        lines.append(f"{name:32s} {med:7.1f} us  rounds {min(got[name]):6.1f}-{max(got[name]):6.1f}  kernels "
                     f"{launches.get(name)}")
    path = C.write_json("bwd-host-split", records, os.environ.get("OUT", "."), C.environment(),
                        meta={"rounds": ROUNDS, "calls": CALLS})
    print(f"wrote {path}")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
