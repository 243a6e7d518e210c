"""GPU checks of the fused scores + select launch (``routing.FUSED``) at real sizes (bf16, D=128, 128-token
blocks): its lists and member bits are CURRENT's (scores kernel, then select kernel) bit for bit for every
selection rule, at 256 key blocks and at 512 (the most it takes), with the queries the last positions of the
keys (its CUDA-graph and no-sync check is a parametrisation of ``test_gpu_routing.py``'s step-graph test). Its
time is the routing suite's ``ms_fused_kernels`` (``python -m sparseattn.bench routing``).
Run with ``python -m pytest tests/gpu -q``."""
import pytest
import torch

import sparseattn as sa
from sparseattn import routing
from sparseattn._checks import check_route

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
DEV = "cuda"
LISTS = ("kv_count", "kv_index", "full_count", "full_index")


def _inputs(N, Hq=16, Hkv=4, D=128, seed=0, device=None):
    from sparseattn.bench.routing import routing_inputs
    return routing_inputs(1, Hq, Hkv, N, D, torch.bfloat16, device or DEV, seed=seed)


def fused_equals_current(q, k, block=128, **kw):
    """Route ``q, k`` under CURRENT and under FUSED; assert FUSED took the fused launch and gave the same
    lists and member bits."""
    kw = dict(dict(threshold=None, causal=True, local=1, sinks=1, share="kv_head", pool="mean", semantics="block",
                   capacity=None, member_topk=None, scale=None), **kw)
    spec = check_route(q, k, block, block, **kw)
    assert routing.fused_fits(spec, routing.FUSED), spec.nk
    two = sa.route(q, k, block, block, **kw)
    with routing.route_kernels(routing.FUSED):
        fused = sa.route(q, k, block, block, **kw)
    for name in LISTS:
        assert torch.equal(getattr(fused, name), getattr(two, name)), name
    assert (fused.row_slot is None) == (two.row_slot is None)
    if two.row_slot is not None:
        assert torch.equal(fused.row_slot, two.row_slot), "member bits"
    return fused


@pytest.mark.parametrize("N,kw", [
    (32768, dict(topk=16)),
    (32768, dict(topk=16, share="none", pool="bound")),
    (32768, dict(topk=32, threshold=0.9, share="all")),
    (32768, dict(topk=8, semantics="member", member_topk=4, causal=False)),
    (65536, dict(topk=16, local=2, sinks=2)),  # 512 key blocks: the largest fused launch
])
def test_fused_select_equals_current(N, kw):
    q, k, _ = _inputs(N)
    fused_equals_current(q, k, **kw)


def test_fused_select_with_the_queries_at_the_end():
    q, k, _ = _inputs(32768, seed=1)
    fused_equals_current(q[:, :, -5000:], k, topk=16, threshold=0.8)  # q_offset, a clipped last query block
