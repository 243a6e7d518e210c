"""The cached launch path (sparseattn/_fast_launch.py) against Triton's own binding, on the GPU: the same
kernels, bitwise the same outputs and gradients, for every mask path, the split columns of the backward, the
split forward, GQA, and tensors whose alignment changes the specialisation. Skipped without CUDA."""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, FwdConfig, patterns as P
from sparseattn import _fast_launch
from sparseattn.roofline.cases import stripes_mask

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _layouts(N):
    docs = torch.sort(torch.randint(0, 6, (N,), device="cuda")).values
    return {
        "causal": BlockLayout.from_mask_mod(P.causal(), N, N, 128, 128, device="cuda"),
        "sinks+window (split columns)": BlockLayout.from_mask_mod(P.sinks_window(64, 512), N, N, 128, 128,
                                                                  device="cuda"),
        "documents": BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(docs)), N, N, 128, 128,
                                               device="cuda"),
        "stripes (compiled mask_mod)": BlockLayout.from_mask_mod(stripes_mask(), N, N, 128, 128, device="cuda"),
        "dense bits": BlockLayout.from_dense(torch.rand(1, 1, N, N, device="cuda") < 0.05, 128, 128),
    }


def _run(q, k, v, layout, do, config=None):
    qg, kg, vg = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = sa.sparse_attention(qg, kg, vg, layout, config=config)
    o.backward(do)
    return o.detach(), qg.grad, kg.grad, vg.grad


NAMES = ["causal", "sinks+window (split columns)", "documents", "stripes (compiled mask_mod)", "dense bits"]


def test_names_cover_the_layouts():
    assert NAMES == list(_layouts(256))


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("hkv", [4, 1])
def test_cached_launch_is_bitwise_triton_binding(name, hkv):
    N, D = 2048, 64
    layout = _layouts(N)[name]
    torch.manual_seed(0)
    q = torch.randn(2, 4, N, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(2, hkv, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    with _fast_launch.enabled(False):
        slow = _run(q, k, v, layout, do)
    hits, direct = _fast_launch.stats["hits"], _fast_launch.stats["direct"]
    _run(q, k, v, layout, do)  # binds (or hits an earlier test's keys)
    fast = _run(q, k, v, layout, do)
    assert _fast_launch.stats["hits"] > hits
    assert _fast_launch.stats["direct"] > direct  # the second call took the launch plans' kept hits
    for a, b in zip(slow, fast):
        assert torch.equal(a, b)
    ref = sa.reference_attention(q, k, v, layout.to_dense())
    assert ((fast[0].double() - ref).norm() / ref.norm()).item() < 1e-2


def test_alignment_change_takes_a_new_specialisation():
    """A tensor 2 bytes off a 16-byte boundary must not reuse a kernel compiled for aligned pointers."""
    N, D = 1024, 64
    layout = BlockLayout.from_mask_mod(P.causal(), N, N, 128, 128, device="cuda")
    q, k, v = (torch.randn(1, 2, N, D, device="cuda", dtype=torch.float16) for _ in range(3))
    sa.sparse_attention(q, k, v, layout)
    sa.sparse_attention(q, k, v, layout)
    buf = torch.empty(q.numel() + 1, device="cuda", dtype=q.dtype)
    q_off = buf[1:].view_as(q)
    q_off.copy_(q)
    assert q_off.data_ptr() % 16
    got = sa.sparse_attention(q_off, k, v, layout)
    ref = sa.reference_attention(q, k, v, layout.to_dense())
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_split_forward_through_the_cache():
    N, D = 4096, 64
    layout = BlockLayout.from_mask_mod(P.causal(), N, N, 128, 128, device="cuda")
    q, k, v = (torch.randn(1, 1, N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    cfg = FwdConfig(block_m=128, block_n=64, num_warps=8, num_stages=2, split="auto")
    with _fast_launch.enabled(False):
        slow = sa.sparse_attention(q, k, v, layout, config=cfg)
    sa.sparse_attention(q, k, v, layout, config=cfg)
    assert torch.equal(slow, sa.sparse_attention(q, k, v, layout, config=cfg))
