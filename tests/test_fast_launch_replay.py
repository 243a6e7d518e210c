"""The cached launch path hands each kernel the argument list Triton's binding would (tests/tools/
fast_launch_replay.py): the launches of real op calls are recorded here in the interpreter (forward, backward
with split columns and the atomic path, a dynamic layout, the split forward, decode with and without a page
selection) and replayed in a fresh process where the kernels are compiled JIT functions."""
import os
import subprocess
import sys

import pytest
import torch

import sparseattn as sa
from sparseattn import BlockLayout, BwdConfig, FwdConfig, patterns as P
from sparseattn.ops import _launch as L

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "fast_launch_replay.py")


def _record(monkeypatch):
    calls = []
    real = L.launch

    def recording(kernel, grid, *, num_stages, static=None, **kwargs):
        name = kernel.fn.__name__ if hasattr(kernel, "fn") and hasattr(kernel.fn, "__name__") else kernel.__name__
        calls.append((name, tuple(grid), num_stages, None if static is None else dict(static), dict(kwargs)))
        return real(kernel, grid, num_stages=num_stages, static=static, **kwargs)
    monkeypatch.setattr(L, "launch", recording)
    return calls


def test_cached_launch_replays_the_arguments_triton_would_bind(monkeypatch, tmp_path):
    calls = _record(monkeypatch)
    torch.manual_seed(0)
    bwd = BwdConfig(block_m=32, block_n=32, dq_block_m=32, dq_block_n=32, num_warps=4, num_stages=1, chunk=2)
    for mm, n in ((P.sinks_window(16, 64), 512), (P.causal(), 256)):
        layout = BlockLayout.from_mask_mod(mm, n, n, 64, 64)
        q = torch.randn(1, 2, n, 32, requires_grad=True)
        k, v = (torch.randn(1, 1, n, 32, requires_grad=True) for _ in range(2))
        for deterministic in (True, False):
            sa.sparse_attention(q, k, v, layout, bwd_config=bwd, deterministic=deterministic).sum().backward()
    # each pass with its own launch config, loading through tensor descriptors
    per_pass = BwdConfig(block_m=32, block_n=64, dq_block_m=64, dq_block_n=32, num_warps=4, num_stages=1,
                         dq_num_warps=2, dq_num_stages=2, tma=True)
    sa.sparse_attention(q, k, v, layout, bwd_config=per_pass).sum().backward()
    layout = BlockLayout.from_mask_mod(P.causal(), 256, 256, 64, 64)
    x = torch.randn(1, 1, 256, 32)
    sa.sparse_attention(x, x, x, layout, config=FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1,
                                                          split=2))
    cache = sa.PagedKVCache(64, 16, 2, 32, dtype=torch.float32, device="cpu", max_seqs=2)
    for s in range(2):
        cache.append(s, torch.randn(100, 2, 32), torch.randn(100, 2, 32))
    qd = torch.randn(2, 4, 32)
    sa.sparse_decode(qd, cache)
    sa.sparse_decode(qd, cache, pages=sa.select_pages(qd, cache, topk=3))
    names = {c[0] for c in calls}
    assert {"sparse_fwd_kernel", "delta_kernel", "dkdv_kernel", "column_reduce_kernel", "dq_kernel", "bwd_kernel",
            "merge_rows_kernel", "decode_split_kernel", "merge_splits_kernel"} <= names, names
    assert any(c[3] is not None for c in calls) and any(c[3] is None for c in calls)
    # the per-pass options reached the launches: the dK/dV pass 4 warps 1 stage, the dQ pass 2 warps 2 stages,
    # both with descriptors of their own kernel tiles (Q/dO in the pass's query rows, K/V in its key rows)
    dkdv, dq = [next(c for c in reversed(calls) if c[0] == name) for name in ("dkdv_kernel", "dq_kernel")]
    assert (dkdv[2], dkdv[3]["num_warps"], dq[2], dq[3]["num_warps"]) == (1, 4, 2, 2)
    for call, rows_q, rows_k in ((dkdv, 32, 64), (dq, 64, 32)):
        d = call[4]
        assert [d[f"desc_{n}"].block for n in ("q", "do", "k", "v")] == \
            [(1, 1, rows_q, 32)] * 2 + [(1, 1, rows_k, 32)] * 2
    assert all(c[4]["desc_q"] is None for c in calls if c[0] in ("dkdv_kernel", "dq_kernel") and c not in (dkdv, dq))
    path = tmp_path / "launches.pt"
    torch.save(calls, path)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, SCRIPT, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert res.stdout.count("ok    ") == len(calls), res.stdout


@pytest.mark.parametrize("rows,head_dim", [(64, 128), (16, 32), (128, 64)])
def test_trusted_tensor_descriptors_equal_tritons_validated_ones(rows, head_dim):
    """``_launch.tensor_descriptors`` gives a ``Desc`` whose descriptor skips Triton's per-descriptor
    validation (its callers checked the tensors with ``tma_ok``): every field equals what the validating
    constructor builds, and a block that is not a power of two still goes through (and fails) Triton's
    checks."""
    from triton.tools.tensor_descriptor import TensorDescriptor
    from sparseattn import _fast_launch as F
    from sparseattn.ops import _launch as L
    t = torch.randn(2, 3, 40, head_dim).transpose(1, 2).contiguous().transpose(1, 2)  # non-trivial strides
    assert L.tma_ok(t)
    lazy = L.tensor_descriptors(head_dim, q=(t, rows))["desc_q"]
    got = lazy.descriptor()
    want = TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, head_dim])
    assert isinstance(got, TensorDescriptor) and got == want and got.base is t
    assert F.materialised({"desc_q": lazy, "n": 3}) == {"desc_q": want, "n": 3}
    with pytest.raises(ValueError, match="power of 2"):
        L.tensor_descriptors(head_dim, q=(t, 48))["desc_q"].descriptor()


def test_a_call_checks_its_bases_the_plan_its_strides():
    """A launch plan is keyed by its tensors' strides, so ``plan_tma`` checks them once and ``call_tma`` only
    the bases: a view one element into its storage (same strides) is refused per call, a stride that is not a
    multiple of 16 bytes when the plan is built."""
    from sparseattn.ops import _launch as L
    buf = torch.randn(2 * 40 * 64 + 1, dtype=torch.bfloat16)
    q = buf[:-1].view(1, 2, 40, 64)
    shifted = buf[1:].view(1, 2, 40, 64)  # same strides, base 2 bytes off
    plan = {"tma": L.plan_tma(True, q.device, True, q, q), "small": False}
    assert plan["tma"] and L.call_tma(plan, q, q) and not L.call_tma(plan, shifted, q)
    assert not L.call_tma(plan, q, shifted) and L.tma_ok(q) and not L.tma_ok(shifted)
    odd = torch.randn(1, 2, 40, 65, dtype=torch.bfloat16)[..., :64]  # row stride 130 bytes
    assert not L.plan_tma(True, q.device, True, q, odd) and not L.tma_ok(odd)
