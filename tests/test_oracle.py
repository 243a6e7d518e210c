"""An independent oracle: PyTorch's own FlexAttention (eager, on the CPU) computes the same attention from the
same mask_mod without any of our code, so agreeing with it checks our layout, our converters and our kernels
together against someone else's implementation.

* every pattern of the catalogue (and compositions, per-head and per-batch masks, fewer queries than keys):
  our output and LSE against Flex on ``layout.to_flex()`` *and* on ``create_block_mask`` of the same mask_mod;
* ``from_flex`` / ``to_flex`` round trips, in both directions;
* compiled evaluation: every pattern means the same under ``torch.compile`` with the int32 indices Flex's
  compiled kernels use, and compiled ``flex_attention`` (CPU) agrees with eager on the patterns that index.
"""
import warnings

import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P
from sparseattn.bench.errors import flex_out_lse

flex_mod = pytest.importorskip("torch.nn.attention.flex_attention")
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile",
                                        "ignore:return_lse is deprecated")
TOL = dict(atol=2e-5, rtol=2e-5)


def flex(q, k, v, block_mask):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return flex_out_lse(flex_mod.flex_attention, q, k, v, block_mask)


def patterns(L: int):
    """One instance of every catalogue pattern plus compositions, at sizes that make every tile class occur."""
    docs = torch.repeat_interleave(torch.arange(5), torch.tensor([7, 30, 1, 40, L - 78]))
    return {
        "full": P.full(), "causal": P.causal(), "sliding_window": P.sliding_window(23), "sinks": P.sinks(5),
        "sinks_window": P.sinks_window(5, 23), "dilated": P.and_masks(P.causal(), P.dilated(3)),
        "block_random": P.block_random(0.3, 16, 7), "document": P.and_masks(P.causal(), P.document(docs)),
        "prefix_lm": P.prefix_lm(20),
        "random|window (issue 11)": P.and_masks(P.causal(), P.or_masks(P.block_random(0.2, 32, 7),
                                                                      P.sliding_window(16))),
        "not(window)": P.not_mask(P.sliding_window(40)),
        "user function": lambda b, h, q, k: ((q * 7 + k * 3) % 5) < 2,
    }


def test_every_catalogue_pattern_is_covered():
    assert set(P.CATALOGUE) <= set(patterns(96))


@pytest.mark.parametrize("name", list(patterns(96)))
def test_ours_equals_flex_on_to_flex_and_on_create_block_mask(name):
    L = 96
    mm = patterns(L)[name]
    layout = BlockLayout.from_mask_mod(mm, L, L, 32, 32, device="cpu")
    q, k, v = (torch.randn(1, 2, L, 16) for _ in range(3))
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True)
    for bm in (layout.to_flex(), flex_mod.create_block_mask(mm, None, None, L, L, device="cpu", BLOCK_SIZE=32)):
        fo, flse = flex(q, k, v, bm)
        torch.testing.assert_close(o, fo, **TOL)
        fin = torch.isfinite(flse)
        assert torch.equal(torch.isfinite(lse), fin), "empty rows must agree"
        torch.testing.assert_close(lse[fin], flse[fin], **TOL)


@pytest.mark.parametrize("name", ["causal", "sinks_window", "dilated", "document"])
def test_fewer_queries_than_keys(name):
    """Flex's queries are local: our layout with q_offset=0 is Flex's mask; the default layout's to_flex()
    carries our offset into Flex."""
    Lq, Lk = 40, 96
    mm = patterns(Lk)[name]
    q = torch.randn(1, 2, Lq, 16)
    k, v = torch.randn(1, 2, Lk, 16), torch.randn(1, 2, Lk, 16)
    local = BlockLayout.from_mask_mod(mm, Lq, Lk, 16, 32, device="cpu", q_offset=0)
    bm = flex_mod.create_block_mask(mm, None, None, Lq, Lk, device="cpu", BLOCK_SIZE=(16, 32))
    torch.testing.assert_close(sa.sparse_attention(q, k, v, local), flex(q, k, v, bm)[0], **TOL)
    default = BlockLayout.from_mask_mod(mm, Lq, Lk, 16, 32, device="cpu")
    torch.testing.assert_close(sa.sparse_attention(q, k, v, default), flex(q, k, v, default.to_flex())[0], **TOL)


def test_per_head_per_batch_and_gqa_layouts():
    L, Hq, Hkv = 64, 4, 2
    per_head = lambda b, h, q, k: (k <= q) & (q - k < 8 * (h + 1) + 4 * b)  # noqa: E731
    layout = BlockLayout.from_mask_mod(per_head, L, L, 16, 16, B=2, H=Hkv, device="cpu")  # one mask per KV head
    q = torch.randn(2, Hq, L, 16)
    k, v = torch.randn(2, Hkv, L, 16), torch.randn(2, Hkv, L, 16)
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True)
    kk, vv = k.repeat_interleave(Hq // Hkv, 1), v.repeat_interleave(Hq // Hkv, 1)
    fo, flse = flex(q, kk, vv, layout.to_flex(num_heads=Hq))
    torch.testing.assert_close(o, fo, **TOL)
    torch.testing.assert_close(lse, flse, **TOL)


# ---- round trips -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["causal", "block_random", "document", "user function"])
def test_layout_to_flex_to_layout(name):
    mm = patterns(100)[name]
    layout = BlockLayout.from_mask_mod(mm, 100, 100, 16, 32, device="cpu")
    back = BlockLayout.from_flex(layout.to_flex())
    assert torch.equal(back.to_dense(), layout.to_dense())
    for a, b in zip(back.block_classes(), layout.block_classes()):
        assert torch.equal(a, b)


def test_dense_layout_to_flex_to_layout():
    g = torch.Generator().manual_seed(0)
    dense = torch.rand(2, 1, 70, 90, generator=g) < 0.3
    dense[:, :, 32:64, :32] = True  # a full tile
    layout = BlockLayout.from_dense(dense, 32, 32)
    back = BlockLayout.from_flex(layout.to_flex())
    assert torch.equal(back.to_dense(), dense)
    q, k, v = torch.randn(2, 2, 70, 16), torch.randn(2, 2, 90, 16), torch.randn(2, 2, 90, 16)
    torch.testing.assert_close(sa.sparse_attention(q, k, v, layout), flex(q, k, v, layout.to_flex())[0], **TOL)


@pytest.mark.parametrize("name", ["sliding_window", "prefix_lm", "random|window (issue 11)"])
def test_block_mask_to_layout_to_block_mask(name):
    mm = patterns(128)[name]
    bm = flex_mod.create_block_mask(mm, None, None, 128, 128, device="cpu", BLOCK_SIZE=32)
    layout = BlockLayout.from_flex(bm)
    again = layout.to_flex()
    q, k, v = (torch.randn(1, 1, 128, 16) for _ in range(3))
    torch.testing.assert_close(flex(q, k, v, again)[0], flex(q, k, v, bm)[0], **TOL)
    assert torch.equal(again.to_dense(), bm.to_dense())  # the same listed tiles


# ---- compiled evaluation -----------------------------------------------------------------------------------------
def _compiled_equal(mm, Lq=3000, Lk=3000):
    import torch._dynamo
    q = torch.arange(0, Lq, 3, dtype=torch.int32).view(-1, 1)
    k = torch.arange(0, Lk, 7, dtype=torch.int32).view(1, -1)
    zero = torch.zeros(1, 1, dtype=torch.int32)  # broadcasting like the indices (a 0-d index would be a scalar)
    torch._dynamo.reset()
    got = torch.compile(mm, fullgraph=True, dynamic=False)(zero, zero, q, k)
    want = mm(zero.long(), zero.long(), q.long(), k.long())
    return torch.equal(torch.broadcast_to(got, want.shape), want)


#: the patterns whose mask_mod does index arithmetic or table lookups (the bands are plain comparisons, and
#: test_fixes.py checks every pattern on int32 indices eagerly); tests/gpu compiles every pattern in Flex
COMPILED = ["sinks_window", "dilated", "block_random", "document", "random|window (issue 11)"]


@pytest.mark.parametrize("name", COMPILED)
def test_compiled_int32_evaluation_equals_eager(name):
    """What Flex's compiled kernels do: evaluate the mask_mod inside a compiled graph on int32 indices."""
    assert _compiled_equal(patterns(3000)[name])


def test_compiled_flex_equals_eager_flex():
    """Compiled FlexAttention on the CPU (inductor) against eager, on masks that index or hash."""
    compiled = torch.compile(flex_mod.flex_attention, dynamic=False)
    L = 128
    q, k, v = (torch.randn(1, 1, L, 16) for _ in range(3))
    for layout in (BlockLayout.from_mask_mod(patterns(L)["random|window (issue 11)"], L, L, 32, 32, device="cpu"),):
        bm = layout.to_flex()
        ours = sa.sparse_attention(q, k, v, layout)
        torch.testing.assert_close(compiled(q, k, v, block_mask=bm), flex(q, k, v, bm)[0], **TOL)
        torch.testing.assert_close(compiled(q, k, v, block_mask=bm), ours, **TOL)
