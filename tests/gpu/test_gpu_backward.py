"""GPU-only backward checks: bf16/fp16 at real sizes, bitwise determinism of the default path, the atomic
path's run-to-run spread, sink-column splitting. Run with ``python -m pytest tests/gpu -q``."""
import dataclasses

import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, patterns as P
from sparseattn.ops import BwdConfig
from sparseattn.ops.backward import bwd_config

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _grads(layout, q, k, v, do, **kw):
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    return torch.autograd.grad(sa.sparse_attention(q, k, v, layout, **kw), (q, k, v), do)


def _repeats_bitwise(times, layout, q, k, v, do, **kw):
    """The gradients of one call, after checking that ``times`` more calls give the same bits."""
    first = _grads(layout, q, k, v, do, **kw)
    for _ in range(times):
        assert all(torch.equal(a, b) for a, b in zip(_grads(layout, q, k, v, do, **kw), first))
    return first


def _rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


PATS = {
    "causal": P.causal(),
    "sinks+window": P.sinks_window(64, 512),
    "dilated": P.and_masks(P.causal(), P.dilated(4)),
    "block_random": P.or_masks(P.block_random(0.1, 128, seed=0), P.sliding_window(128)),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", list(PATS))
def test_real_size_grads(name, deterministic, dtype):
    torch.manual_seed(0)
    L, Hq, Hkv, D = 2000, 4, 2, 128
    layout = BlockLayout.from_mask_mod(PATS[name], L, L, 128, 128, device="cuda")
    q = torch.randn(1, Hq, L, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, Hkv, L, D, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)
    got = _grads(layout, q, k, v, do, deterministic=deterministic)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(sa.reference_attention(qd, kd, vd, layout.to_dense()), (qd, kd, vd), do.double())
    for name_, g, r in zip("qkv", got, ref):
        assert not torch.isnan(g).any()
        assert _rel(g, r) < 2e-2, (name_, _rel(g, r))


def test_default_backward_is_bitwise_deterministic_and_atomic_spread_is_small():
    torch.manual_seed(1)
    L = 8192
    layout = BlockLayout.from_mask_mod(PATS["sinks+window"], L, L, device="cuda")
    q, k, v, do = (torch.randn(1, 16, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    first = _repeats_bitwise(5, layout, q, k, v, do)
    atomic = [_grads(layout, q, k, v, do, deterministic=False)[0].float() for _ in range(5)]
    spread = max((a - atomic[0]).abs().max().item() for a in atomic)
    assert spread < 1e-1 * first[0].float().abs().max().item()


def test_split_and_unsplit_columns_agree():
    torch.manual_seed(2)
    L = 8192
    layout = BlockLayout.from_mask_mod(PATS["sinks+window"], L, L, device="cuda")
    q, k, v, do = (torch.randn(1, 4, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tiles = dict(block_m=32, block_n=128, dq_block_m=128, dq_block_n=32, num_warps=4, num_stages=3)
    split = _grads(layout, q, k, v, do, bwd_config=BwdConfig(**tiles, chunk=4))
    whole = _grads(layout, q, k, v, do, bwd_config=BwdConfig(**tiles, chunk=1 << 30))
    for a, b in zip(split, whole):
        assert _rel(a.float(), b.double()) < 1e-2


@pytest.mark.parametrize("dq_split", [None, "auto"])
def test_overlapped_passes_give_the_same_bits_eager_and_in_a_graph(dq_split):
    """BwdConfig.overlap (the dQ programs in the dK/dV pass's launch, ``bwd_kernel``; with ``dq_split`` the
    passes stay two launches) changes no bit of the gradients, at one head (a launch too small to fill the
    GPU: both kinds of program run side by side) and at 16 heads, and a CUDA graph of the backward replays
    the eager result."""
    torch.manual_seed(4)
    L = 16384
    layout = BlockLayout.from_mask_mod(P.causal(), L, L, device="cuda")
    for H in (1, 16):
        q, k, v, do = (torch.randn(1, H, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
        base = dataclasses.replace(bwd_config(q, layout), dq_split=dq_split)
        serial = _grads(layout, q, k, v, do, bwd_config=dataclasses.replace(base, overlap=False))
        side = _grads(layout, q, k, v, do, bwd_config=dataclasses.replace(base, overlap=True))
        assert all(torch.equal(a, b) for a, b in zip(serial, side)), H
    qs, ks, vs = (t.detach().requires_grad_() for t in (q, k, v))
    out = [None]

    def step():
        out[0] = torch.autograd.grad(sa.sparse_attention(qs, ks, vs, layout, bwd_config=base), (qs, ks, vs), do)

    from sparseattn._runtime import graph_step
    graph = graph_step(step)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(out[0], side))


@pytest.mark.parametrize("dq_split", [2, "auto"])
def test_split_dq_pass_agrees_and_repeats(dq_split):
    """The split dQ pass (BwdConfig.dq_split) at a real size: dQ close to the plain pass's, dK/dV identical,
    bitwise repeatable; documents of very different lengths so that rows do split."""
    torch.manual_seed(3)
    L = 8192
    lens = torch.tensor([5000, 100, 1500, 50, 1542])
    ids = torch.repeat_interleave(torch.arange(5), lens).cuda()
    layout = BlockLayout.from_mask_mod(P.and_masks(P.causal(), P.document(ids)), L, L, device="cuda")
    q, k, v, do = (torch.randn(1, 4, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    tiles = dict(block_m=32, block_n=128, dq_block_m=128, dq_block_n=32, num_warps=4, num_stages=3)
    plain = _grads(layout, q, k, v, do, bwd_config=BwdConfig(**tiles))
    split = _grads(layout, q, k, v, do, bwd_config=BwdConfig(**tiles, dq_split=dq_split))
    assert _rel(split[0].float(), plain[0].double()) < 1e-2
    assert torch.equal(split[1], plain[1]) and torch.equal(split[2], plain[2])
    again = _grads(layout, q, k, v, do, bwd_config=BwdConfig(**tiles, dq_split=dq_split))
    assert all(torch.equal(a, b) for a, b in zip(split, again))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("tma", [True, False])
@pytest.mark.parametrize("name", ["causal", "sinks+window"])
def test_tma_on_and_off_vs_reference(name, tma, deterministic, dtype):
    """Both passes through tensor descriptors (``tma=True``) and through pointers (``tma=False``), each pass
    with its own launch options, at a length that ends inside a tile (the descriptor zero-fills past it), GQA;
    against the fp64 reference, and TMA-on equal to TMA-off up to rounding."""
    torch.manual_seed(4)
    L, Hq, Hkv, D = 2000, 4, 2, 128
    layout = BlockLayout.from_mask_mod(PATS[name], L, L, 128, 128, device="cuda")
    q = torch.randn(1, Hq, L, D, device="cuda", dtype=dtype)
    k, v = (torch.randn(1, Hkv, L, D, device="cuda", dtype=dtype) for _ in range(2))
    do = torch.randn_like(q)
    tiles = dict(block_m=64, block_n=128, dq_block_m=128, dq_block_n=64, num_warps=8, num_stages=3,
                 dq_num_warps=8, dq_num_stages=2)
    got = _grads(layout, q, k, v, do, deterministic=deterministic, bwd_config=BwdConfig(**tiles, tma=tma))
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(sa.reference_attention(qd, kd, vd, layout.to_dense()), (qd, kd, vd), do.double())
    for name_, g, r in zip("qkv", got, ref):
        assert not torch.isnan(g).any()
        assert _rel(g, r) < 2e-2, (name_, _rel(g, r))
    other = _grads(layout, q, k, v, do, deterministic=deterministic, bwd_config=BwdConfig(**tiles, tma=not tma))
    for a, b in zip(got, other):
        assert _rel(a.float(), b.double()) < 1e-2


def test_tma_default_is_bitwise_deterministic_and_matches_pointer_path():
    """The default config on an H200 takes the TMA path above ``TMA_MIN_PAIRS["bwd"]`` visited tile pairs
    (this call is below it: forced with tma=True, and the default is checked too); it repeats bitwise and
    agrees with the pointer path. A K that is a view with a 16-byte-misaligned base falls back to pointers
    (same result)."""
    from sparseattn.ops import _launch as LA
    torch.manual_seed(5)
    L = 4096
    layout = BlockLayout.from_mask_mod(PATS["sinks+window"], L, L, device="cuda")
    q, k, v, do = (torch.randn(1, 8, L, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    cfg = bwd_config(q, layout)
    assert LA.too_small_for_tma("bwd", cfg.tma, layout, q)
    first = _repeats_bitwise(3, layout, q, k, v, do, bwd_config=dataclasses.replace(cfg, tma=True))
    default = _repeats_bitwise(1, layout, q, k, v, do)
    for a, b in zip(default, first):
        assert _rel(a.float(), b.double()) < 1e-2
    off = _grads(layout, q, k, v, do, bwd_config=dataclasses.replace(cfg, tma=False))
    for a, b in zip(first, off):
        assert _rel(a.float(), b.double()) < 1e-2
    buf = torch.empty(1 * 8 * L * 128 + 1, device="cuda", dtype=torch.bfloat16)
    k_odd = buf[1:].view(1, 8, L, 128)  # base 2 bytes past a 16-byte boundary: no descriptor possible
    k_odd.copy_(k)
    odd = _grads(layout, q, k_odd, v, do)
    for a, b in zip(odd, first):
        assert _rel(a.float(), b.double()) < 1e-2


@pytest.mark.parametrize("pattern,N", [("window", 2048), ("causal", 2048), ("window", 4096)])
def test_backward_launches_only_its_own_kernels(pattern, N):
    """An eager backward call launches Δ, the dK/dV pass, the column reduce only when the plan cut columns, and
    the dQ pass: no kernel filling a gradient for the LSE (it has none), and as many launches as the cost
    model counts (2026-12-01 on the H200: a zero-fill kernel and a reduce at 2k, both unneeded)."""
    from torch.profiler import ProfilerActivity, profile

    from sparseattn.ops.backward import column_work
    from sparseattn.roofline.model import work_of
    mm = P.sliding_window(1024) if pattern == "window" else P.causal()
    layout = BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cuda")
    q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    o = sa.sparse_attention(q, k, v, layout)
    torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        torch.autograd.grad(o, (q, k, v), do, retain_graph=True)
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
             and not e.name.startswith(("Memcpy", "Memset"))]
    cfg = bwd_config(q, layout)
    reduce = column_work(layout, cfg.block_n, cfg.chunk, 16).reduce.shape[0] > 0
    want = ["delta_kernel", "bwd_kernel"] + (["column_reduce_kernel"] if reduce else [])  # dQ in bwd_kernel
    assert sorted(names) == sorted(want), names
    shape = {"B": 1, "Hq": 16, "D": 128, "dtype": "bf16"}
    assert len(names) == work_of(layout.to("cpu"), shape, "bwd", cfg).launches


@pytest.mark.parametrize("name", ["causal", "sinks+window"])
def test_atomic_dq_through_the_copy_engine(name, monkeypatch):
    """``ops.backward.ATOMIC_DQ_TMA``: the atomic path's dQ added by ``cp.reduce.async.bulk`` through a
    descriptor of the float32 accumulator, tensor-descriptor loads forced on; a length that ends inside a
    tile and GQA. Against the fp64 reference, and dQ against the element atomics' (the same products added
    in another order)."""
    from sparseattn.ops import backward as bwd
    torch.manual_seed(3)
    L, Hq, Hkv, D = 3000, 4, 2, 128
    layout = BlockLayout.from_mask_mod(PATS[name], L, L, 128, 128, device="cuda")
    q = torch.randn(1, Hq, L, D, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(1, Hkv, L, D, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    do = torch.randn_like(q)
    cfg = dataclasses.replace(bwd_config(q, layout), tma=True)
    monkeypatch.setattr(bwd, "ATOMIC_DQ_TMA", True)
    bulk = _grads(layout, q, k, v, do, deterministic=False, bwd_config=cfg)
    monkeypatch.setattr(bwd, "ATOMIC_DQ_TMA", False)
    elementwise = _grads(layout, q, k, v, do, deterministic=False, bwd_config=cfg)
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    ref = torch.autograd.grad(sa.reference_attention(qd, kd, vd, layout.to_dense()), (qd, kd, vd), do.double())
    for name_, g, r in zip("qkv", bulk, ref):
        assert not torch.isnan(g).any()
        assert _rel(g, r) < 2e-2, (name_, _rel(g, r))
    assert _rel(bulk[0].float(), elementwise[0].double()) < 1e-2

