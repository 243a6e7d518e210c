"""Backward kernels vs autograd through the fp64 reference on the layout's dense mask (Triton interpreter)."""
import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P
from sparseattn.ops import BwdConfig
from sparseattn.reference import relative_error, tolerance
from test_prefill_fwd import PATTERNS

# elementwise bounds on grads scaled to max |ref| <= 1; the relative Frobenius bound is the package's table
TOL = {torch.float32: dict(atol=5e-5, rtol=5e-5), torch.float16: dict(atol=1e-2, rtol=1e-2)}


def check_grads(layout, q, k, v, deterministic=True, bwd_config=None, scale=None):
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    o = sa.sparse_attention(q, k, v, layout, deterministic=deterministic, bwd_config=bwd_config, scale=scale)
    do = torch.randn_like(o)
    grads = torch.autograd.grad(o, (q, k, v), do)
    qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
    ref = sa.reference_attention(qd, kd, vd, layout.to_dense(), scale=scale)
    ref_grads = torch.autograd.grad(ref, (qd, kd, vd), do.double())
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        assert not torch.isnan(g).any(), f"{name} has NaN"
        scale_ = max(1.0, r.abs().max().item())
        torch.testing.assert_close(g.double() / scale_, r / scale_, **TOL[q.dtype], msg=lambda m: f"{name}: {m}")
        err = relative_error(g, r)
        assert (r == 0).all() or err < tolerance(q.dtype, "bwd"), f"{name}: relative error {err:.2e}"
    return grads


def rand(*shape, dtype=torch.float32):
    return torch.randn(*shape, dtype=dtype)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", list(PATTERNS))
def test_every_pattern_fp32(name, deterministic):
    L = 150
    layout = BlockLayout.from_mask_mod(PATTERNS[name], L, L, 32, 32, device="cpu")
    check_grads(layout, rand(1, 2, L, 32), rand(1, 2, L, 32), rand(1, 2, L, 32), deterministic)


@pytest.mark.parametrize("name", ["sinks+window", "dilated", "document"])
def test_fp16(name):
    L = 100
    layout = BlockLayout.from_mask_mod(PATTERNS[name], L, L, 32, 32, device="cpu")
    check_grads(layout, *(rand(1, 2, L, 32, dtype=torch.float16) for _ in range(3)))


@pytest.mark.parametrize("layout_heads", [1, 2, 4])
@pytest.mark.parametrize("deterministic", [True, False])
def test_gqa_grads_sum_over_the_group(layout_heads, deterministic):
    Hq, Hkv, L = 4, 2, 96
    mm = lambda b, h, q, k: (k <= q) & ((q - k) < 16 + 24 * h)  # noqa: E731
    layout = BlockLayout.from_mask_mod(mm, L, L, 32, 32, H=layout_heads, device="cpu")
    check_grads(layout, rand(1, Hq, L, 32), rand(1, Hkv, L, 32), rand(1, Hkv, L, 32), deterministic)


@pytest.mark.parametrize("Lq,Lk", [(40, 150), (100, 129), (1, 70)])
def test_fewer_queries_than_keys(Lq, Lk):
    layout = BlockLayout.from_mask_mod(PATTERNS["sinks+window"], Lq, Lk, 16, 32, device="cpu")
    check_grads(layout, rand(1, 2, Lq, 32), rand(1, 2, Lk, 32), rand(1, 2, Lk, 32))


@pytest.mark.parametrize("L", [31, 33, 64, 5])
def test_boundary_lengths(L):
    layout = BlockLayout.from_mask_mod(P.causal(), L, L, 32, 32, device="cpu")
    check_grads(layout, *(rand(1, 1, L, 16) for _ in range(3)))


@pytest.mark.parametrize("deterministic", [True, False])
def test_empty_rows_and_never_attended_keys_get_zero_grads(deterministic):
    L = 64
    mm = lambda b, h, q, k: (k <= q) & (q % 3 != 0) & (k % 5 != 0)  # noqa: E731
    layout = BlockLayout.from_mask_mod(mm, L, L, 16, 16, device="cpu")
    dq, dk, dv = check_grads(layout, *(rand(1, 1, L, 16) for _ in range(3)), deterministic=deterministic)
    rows = torch.arange(L)
    assert (dq[0, 0, rows % 3 == 0] == 0).all()
    assert (dk[0, 0, rows % 5 == 0] == 0).all() and (dv[0, 0, rows % 5 == 0] == 0).all()


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("chunk", [1, 2, 3])
def test_split_sink_columns(chunk, deterministic):
    """Sink columns visited by every query tile are cut into chunks and reduced in a fixed order."""
    L = 160
    layout = BlockLayout.from_mask_mod(PATTERNS["sinks+window"], L, L, 32, 32, device="cpu")
    cfg = BwdConfig(block_m=32, block_n=16, dq_block_m=16, dq_block_n=32, num_warps=4, num_stages=1,
                    chunk=chunk)  # sub-tiles of the layout tiles, 1..3 query tiles a chunk
    check_grads(layout, *(rand(1, 2, L, 32) for _ in range(3)), deterministic=deterministic, bwd_config=cfg)


def test_random_dense_layouts_and_custom_scale():
    g = torch.Generator().manual_seed(5)
    dense = torch.rand(2, 2, 70, 90, generator=g) < 0.2
    dense[:, :, :, :16] |= torch.rand(2, 2, 70, 1, generator=g) < 0.5
    layout = BlockLayout.from_dense(dense, 16, 32)
    check_grads(layout, rand(2, 2, 70, 32), rand(2, 2, 90, 32), rand(2, 2, 90, 32), scale=0.7)


def test_batched_documents():
    docs = torch.stack([torch.arange(100) // 30, torch.arange(100) // 45])
    layout = BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(docs)), 100, 100, 32, 32, B=2,
                                       device="cpu")
    check_grads(layout, *(rand(2, 2, 100, 32) for _ in range(3)))


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("name", ["sinks+window", "document"])
def test_tma_loads_both_passes(name, dtype, deterministic):
    """``tma=True`` runs both passes through tensor descriptors in the interpreter (``load_rows``' TMA branch:
    rows past the end zero-filled by the descriptor), GQA, lengths that end inside a tile, each pass with its
    own launch options; same gradients as the fp64 reference."""
    L = 150
    layout = BlockLayout.from_mask_mod(PATTERNS[name], L, L, 32, 32, device="cpu")
    cfg = BwdConfig(block_m=16, block_n=32, dq_block_m=32, dq_block_n=16, num_warps=4, num_stages=1, chunk=2,
                    dq_num_warps=2, dq_num_stages=2, tma=True)
    q = rand(1, 4, L, 32, dtype=dtype)
    k, v = (rand(1, 2, L, 32, dtype=dtype) for _ in range(2))
    check_grads(layout, q, k, v, deterministic=deterministic, bwd_config=cfg)


def _descriptor_reduce(self, kind, desc, value, indices):
    """The copy engine's bulk reduce-add (``desc.atomic_add``) for Triton 3.6's interpreter, which lacks it:
    rows and columns outside the descriptor's shape are dropped as the hardware clips them. The interpreter
    runs one program at a time, so a load, add and store is the atomic add."""
    assert kind == kind.ADD
    ptrs, mask = desc.materialize_pointers(indices)
    old = self.create_masked_load(ptrs, mask, None, cache_modifier=None, eviction_policy=None, is_volatile=False)
    return self.create_masked_store(ptrs, self.create_fadd(old, value), mask, None, None)


@pytest.mark.parametrize("name", ["sinks+window", "document"])
def test_atomic_dq_through_a_descriptor(name, monkeypatch):
    """``ops.backward.ATOMIC_DQ_TMA``: the atomic path's dQ added tile by tile through a descriptor of the
    float32 accumulator (``cp.reduce.async.bulk`` on the GPU), with an interpreter stand-in for the bulk
    reduce; GQA and a length that ends inside a tile (the last tile's rows past the end must be dropped,
    not written). Same gradients as the fp64 reference, and dQ within float32 rounding of the element
    atomics' (they add the same products in another order)."""
    from triton.runtime.interpreter import InterpreterBuilder
    from sparseattn.ops import backward as bwd
    monkeypatch.setattr(InterpreterBuilder, "create_descriptor_reduce", _descriptor_reduce, raising=False)
    L = 150
    layout = BlockLayout.from_mask_mod(PATTERNS[name], L, L, 32, 32, device="cpu")
    cfg = BwdConfig(block_m=16, block_n=32, dq_block_m=32, dq_block_n=16, num_warps=4, num_stages=1, chunk=2,
                    tma=True)
    torch.manual_seed(0)
    q = rand(1, 4, L, 32)
    k, v = (rand(1, 2, L, 32) for _ in range(2))
    launched = []
    real = bwd.L.launch
    monkeypatch.setattr(bwd.L, "launch", lambda kernel, grid, **kw: launched.append(kw.get("DQ_ACC"))
                        or real(kernel, grid, **kw))
    monkeypatch.setattr(bwd, "ATOMIC_DQ_TMA", True)
    torch.manual_seed(1)
    bulk = check_grads(layout, q, k, v, deterministic=False, bwd_config=cfg)
    assert any(type(a).__name__ == "Desc" for a in launched)  # the bulk path really ran
    monkeypatch.setattr(bwd, "ATOMIC_DQ_TMA", False)
    torch.manual_seed(1)
    elementwise = check_grads(layout, q, k, v, deterministic=False, bwd_config=cfg)
    torch.testing.assert_close(bulk[0], elementwise[0], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("value", [1, None, "yes"])
def test_bad_overlap_names_the_field(value):
    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 32, 32, device="cpu")
    x = rand(1, 1, 64, 32)
    cfg = BwdConfig(block_m=16, block_n=32, dq_block_m=32, dq_block_n=16, num_warps=4, num_stages=1, overlap=value)
    with pytest.raises(ValueError, match="bwd_config: overlap must be True or False"):
        sa.sparse_attention(x, x, x, layout, bwd_config=cfg)


@pytest.mark.parametrize("field,value", [("num_warps", 3), ("num_stages", 0), ("dq_num_warps", 6),
                                         ("dq_num_warps", True), ("dq_num_stages", 0), ("dq_num_stages", 1.5),
                                         ("tma", "yes")])
def test_bad_launch_options_name_the_field(field, value):
    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 32, 32, device="cpu")
    base = dict(block_m=16, block_n=32, dq_block_m=32, dq_block_n=16, num_warps=4, num_stages=1)
    x = rand(1, 1, 64, 32)
    with pytest.raises(ValueError, match=f"bwd_config: {field} must be"):
        sa.sparse_attention(x, x, x, layout, bwd_config=BwdConfig(**{**base, field: value}))
    fwd_field = field.replace("dq_", "")
    with pytest.raises(ValueError, match=f"config: {fwd_field} must be"):
        sa.sparse_attention(x, x, x, layout, config=sa.FwdConfig(
            **{**dict(block_m=32, block_n=32, num_warps=4, num_stages=1), fwd_field: value}))


def test_backward_fills_no_gradient_for_the_lse():
    """The LSE output has no gradient: a backward call allocates its outputs and workspaces but never fills a
    zero dLSE (autograd would materialise one, a kernel launch more per call on a GPU); with only the LSE
    used downstream nothing flows back."""
    from torch.profiler import ProfilerActivity, profile
    L = 64
    layout = BlockLayout.from_mask_mod(P.causal(), L, L, 16, 16, device="cpu")
    q, k, v = (rand(1, 2, L, 16).requires_grad_() for _ in range(3))
    o, lse = sa.sparse_attention(q, k, v, layout, return_lse=True)
    do = torch.randn_like(o)
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)  # plans and caches built
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    ops = {e.key for e in prof.key_averages()}
    assert not ops & {"aten::zeros", "aten::zeros_like", "aten::zero_", "aten::fill_"}, ops
    assert not lse.requires_grad


def test_fill_split_only_when_columns_cannot_fill_the_gpu(monkeypatch):
    """The default chunk is capped at half an SM's fair share only when the launch has fewer columns than
    the GPU has SMs (one head of a long causal layout); with a column per SM or more the columns stay whole
    and the pass needs no reduce launch."""
    from sparseattn.ops import _launch
    from sparseattn.ops.backward import column_work
    monkeypatch.setattr(_launch, "num_sms", lambda device: 132)
    L = 2048  # 16 key tiles of 128
    window = BlockLayout.from_mask_mod(P.sliding_window(1024), L, L, 128, 128, device="cpu")
    many = column_work(window, 128, None, programs=16)  # 256 columns on 132 SMs
    assert many.n_ws == 0 and many.reduce.shape[0] == 0 and many.chunk >= 9
    causal = BlockLayout.from_mask_mod(P.causal(), 16384, 16384, 128, 128, device="cpu")
    few = column_work(causal, 128, None, programs=1)  # 128 columns on 132 SMs: the long ones are cut
    assert few.n_ws > 0 and few.reduce.shape[0] > 0 and few.chunk < 128
