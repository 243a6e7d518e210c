"""GPU-only checks of the compiled mask path (skipped without CUDA): real tile sizes, captured tables on the
device, the compiled predicate against the bits it replaces, and the layout build's device path.

Run on the GPU machine with ``python -m pytest tests/gpu -q``.
"""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, _tiles, patterns as P
from sparseattn.bench import cases
from sparseattn.ops import forced_mask_path, mask_path_name

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


def _masks(L):
    g = torch.Generator(device="cuda").manual_seed(0)
    docs = torch.sort(torch.randint(0, 9, (L,), device="cuda", generator=g)).values
    per_head = torch.randint(0, 3, (4, L), device="cuda", generator=g, dtype=torch.int32)
    return {
        "stripes": cases.stripes_mask(),
        "causal&(window256|dilated8)": cases.prefill_mask_mod("causal&(window256|dilated8)"),
        "per-head table": lambda b, h, q, k: (k <= q) & ((per_head[h, q] == per_head[h, k]) | (q - k < 64)),
        "documents (forced compiled)": P.and_masks(P.causal(), P.document(docs)),
    }


@pytest.mark.parametrize("name", ["stripes", "causal&(window256|dilated8)", "per-head table",
                                  "documents (forced compiled)"])
def test_compiled_path_against_reference_and_bits(name):
    torch.manual_seed(0)
    L, H, D = 3000, 4, 128
    layout = BlockLayout.from_mask_mod(_masks(L)[name], L, L, 128, 128, H=H, device="cuda")
    q, k, v = (torch.randn(1, H, L, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    do = torch.randn_like(q)
    forced = "compiled" if "forced" in name else None
    with forced_mask_path(forced):
        assert mask_path_name(layout).startswith("compiled: ")
        out = torch.full_like(q, float("nan"))
        o = sa.sparse_attention(q.detach(), k.detach(), v.detach(), layout, out=out)
        grads = torch.autograd.grad(sa.sparse_attention(q, k, v, layout), (q, k, v), do)
    dense = layout.to_dense()
    ref = sa.reference_attention(q.double(), k.double(), v.double(), dense)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    assert not torch.isnan(o).any() and _rel(o, ref) < 2e-2
    for g, r in zip(grads, ref_grads):
        assert _rel(g, r) < 3e-2
    with forced_mask_path("bits"):
        o_bits = sa.sparse_attention(q.detach(), k.detach(), v.detach(), layout)
    assert _rel(o, o_bits) < 1e-3  # the same cells masked from registers or from bytes


def test_layout_device_path_equals_the_torch_path():
    for N in (8192, 5000):
        mm = cases.stripes_mask()
        with _tiles.classify_kernel(True):
            a = BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cuda")
        with _tiles.classify_kernel(False):
            b = BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cuda")
        for x, y in zip(a.block_classes(), b.block_classes()):
            assert torch.equal(x, y)


@pytest.mark.parametrize("shape", [(1, 1, 256, 256), (2, 3, 41, 1025), (1, 1, 1024, 1024), (1, 2, 7, 3)])
def test_row_list_kernel_equals_the_torch_lists_on_the_gpu(shape):
    """The compiled row-list kernel (two launches, GPU block sizes) against the torch lists, bit for bit."""
    g = torch.Generator(device="cuda").manual_seed(1)
    for p in (0.0, 0.05, 0.5, 1.0):
        r = torch.rand(*shape, device="cuda", generator=g)
        partial, full = r < p / 2, (r >= p / 2) & (r < p)
        want = _tiles.class_lists(partial, full, use_kernel=False)
        got = _tiles.class_lists(partial, full, use_kernel=True)
        for (wc, wi), (gc, gi) in zip(want, got):
            assert torch.equal(gc, wc) and torch.equal(gi, wi)
