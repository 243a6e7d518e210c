"""The cached launch path's direct call of the launcher's C entry point (sparseattn/_fast_launch.py) hands it
exactly the argument list Triton's own Python launcher builds: the same head, the fixed arguments expanded
once at bind time, the per-call tensor descriptors expanded per call -- checked on the CPU with Triton's real
``CudaLauncher.__call__`` and ``wrap_handle_tensordesc`` around a recording entry point."""
import types

import pytest
import torch

from sparseattn import _fast_launch as F

driver = pytest.importorskip("triton.backends.nvidia.driver")


class _FakeDriver:
    """``triton.runtime.driver.active`` for ``make_tensordesc_arg``: a tensor map is a tuple of its inputs."""
    class utils:
        @staticmethod
        def fill_tma_descriptor(ptr, swizzle, elem_size, dtype, block, shape, strides, padding):
            return ("tensormap", ptr, swizzle, elem_size, dtype, tuple(block), tuple(shape), tuple(strides), padding)


def _kernel_and_launcher(meta_for_descs, calls):
    """A stand-in JIT kernel ``k(X, desc_a, n, FLAG: constexpr, desc_b, Y)`` and a compiled kernel whose ``run``
    is Triton's CudaLauncher around a recording entry point."""
    from triton.runtime.jit import JITFunction

    def k(X, desc_a, n, FLAG, desc_b, Y):
        pass
    params = [types.SimpleNamespace(name=p, has_default=False) for p in ("X", "desc_a", "n", "FLAG", "desc_b", "Y")]
    fn = object.__new__(JITFunction)
    fn.params = params
    signature = {"X": "*fp32", "desc_a": "tensordesc<bf16[1, 1, 16, 32]>", "n": "i32", "FLAG": "constexpr",
                 "desc_b": "tensordesc<bf16[1, 1, 16, 32]>", "Y": "*fp32"}
    launcher = object.__new__(driver.CudaLauncher)
    launcher.num_ctas = 1
    launcher.global_scratch_size = launcher.profile_scratch_size = 0
    launcher.global_scratch_align = launcher.profile_scratch_align = 1
    launcher.launch_cooperative_grid, launcher.launch_pdl = False, True

    def entry(*args):
        calls.append(args)
    launcher.launch = driver.wrap_handle_tensordesc(entry, signature, meta_for_descs)
    compiled = types.SimpleNamespace(run=launcher, function=1234, packed_metadata=(4, 1, 0))
    return fn, compiled


def _same_arguments(ours, theirs, addresses: bool):
    """Our entry point's arguments are Triton's, except that with ``addresses`` every tensor Triton's list
    holds is its address (what the C launcher reads from it)."""
    assert len(ours) == len(theirs)
    for got, want in zip(ours, theirs):
        if isinstance(want, torch.Tensor):
            assert (got == want.data_ptr() and type(got) is int) if addresses else got is want
        else:
            assert got is want or got == want


def _desc(t, rows):
    from triton.tools.tensor_descriptor import TensorDescriptor
    return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, t.shape[-1]])


@pytest.mark.parametrize("addresses", [False, True])
@pytest.mark.parametrize("metas", [None, [{"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 1, 16, 32],
                                           "fp4_padded": False}] * 2])
def test_raw_entry_gets_tritons_argument_list(monkeypatch, metas, addresses):
    import triton
    monkeypatch.setattr(F, "_HOST_POINTERS", addresses)  # CPU tensors stand in for CUDA ones
    monkeypatch.setattr(triton.runtime.driver, "_active", _FakeDriver())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    calls = []
    fn, compiled = _kernel_and_launcher(metas, calls)
    monkeypatch.setattr(F, "_jit_fn", lambda kernel: (None, fn))
    F.clear()
    x, y = torch.zeros(4), torch.zeros(4)
    a1, b1, a2 = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    static = F.Static(X=x, n=5, FLAG=True, desc_b=_desc(b1, 16))
    kernel = object()
    F.launch(kernel, (3, 2), static, dict(desc_a=_desc(a1, 16), Y=y), lambda kw: compiled)  # binds
    bound = next(iter(F._CACHE.values()))
    assert bound.raw is not None
    calls.clear()
    F.launch(kernel, (3, 2), static, dict(desc_a=_desc(a2, 16), Y=x), lambda kw: pytest.fail("must hit"))
    ours = calls.pop()
    # what Triton's own launcher hands the entry point for the same arguments
    compiled.run(3, 2, 1, 77, 1234, (4, 1, 0), None, None, None, x, _desc(a2, 16), 5, True, _desc(b1, 16), x)
    theirs = calls.pop()
    _same_arguments(ours, theirs, addresses)
    F.clear()


def _counting_launcher(monkeypatch):
    """``(fills, calls, compiled)``: the fake driver counting its tensor-map encodings (``fills``), a stand-in
    kernel whose launcher records its entry point's arguments (``calls``), the cache cleared."""
    import triton
    fills = []

    class _Counting(_FakeDriver):
        class utils:
            @staticmethod
            def fill_tma_descriptor(*args):
                fills.append(args)
                return _FakeDriver.utils.fill_tma_descriptor(*args)
    monkeypatch.setattr(triton.runtime.driver, "_active", _Counting())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 77, raising=False)
    metas = [{"swizzle": 3, "elem_size": 2, "elem_type": 9, "block_size": [1, 1, 16, 32], "fp4_padded": False}] * 2
    calls = []
    fn, compiled = _kernel_and_launcher(metas, calls)
    monkeypatch.setattr(F, "_jit_fn", lambda kernel: (None, fn))
    F.clear()
    return fills, calls, compiled


def test_kept_expansions_are_the_ones_a_new_encoding_gives(monkeypatch):
    """A descriptor's expansion (its tensor map) is encoded once per address, shape, strides and padding: the
    same tensor again reuses it, another tensor gets its own (another shape or strides is another cache key
    altogether) -- each launch's arguments stay the ones Triton's launcher builds for that call."""
    fills, calls, compiled = _counting_launcher(monkeypatch)
    x = torch.zeros(4)
    b1, a1, a2 = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    static = F.Static(X=x, n=5, FLAG=True, desc_b=_desc(b1, 16))
    kernel = object()
    F.launch(kernel, (1,), static, dict(desc_a=_desc(a1, 16), Y=x), lambda kw: compiled)  # binds
    for t, new_fill in ((a2, True), (a2, False), (a1, True), (a1, False), (a2, False)):
        before = len(fills)
        F.launch(kernel, (1,), static, dict(desc_a=_desc(t, 16), Y=x), lambda kw: pytest.fail("must hit"))
        assert len(fills) - before == int(new_fill)
        ours = calls.pop()
        compiled.run(1, 1, 1, 77, 1234, (4, 1, 0), None, None, None, x, _desc(t, 16), 5, True, _desc(b1, 16), x)
        theirs = calls.pop()
        assert [g for g in ours if not isinstance(g, torch.Tensor)] == \
            [w for w in theirs if not isinstance(w, torch.Tensor)]
    F.clear()


@pytest.mark.parametrize("addresses", [False, True])
def test_a_kept_hit_matches_the_key_it_skips(monkeypatch, addresses):
    """A launch plan's kept hit (``direct_for`` / ``launch_direct``) hands the launcher the list Triton's own
    launcher builds for the new call, encodes a tensor map once per base address, and refuses (launches
    nothing, returns False) every call whose key would differ: another dtype, an unaligned base, another
    shape or block, another value or launch option, the cache switched off."""
    fills, calls, compiled = _counting_launcher(monkeypatch)
    monkeypatch.setattr(F, "_HOST_POINTERS", addresses)  # CPU tensors stand in for CUDA ones
    x, y = torch.zeros(4), torch.zeros(4)
    a1, a2, b1 = (torch.randn(1, 2, 64, 32, dtype=torch.bfloat16) for _ in range(3))
    lazy = lambda t, rows=16: F.Desc(t, (1, 1, rows, 32))  # noqa: E731
    static = F.Static(X=x, n=5, FLAG=True, desc_b=_desc(b1, 16))
    kernel = object()
    F.launch(kernel, (3, 2), static, dict(desc_a=lazy(a1), Y=y, num_stages=2), lambda kw: compiled)  # binds
    d = F.direct_for(kernel, static, dict(desc_a=lazy(a1), Y=y, num_stages=2))
    assert d is not None
    for t, new_fill in ((a2, True), (a2, False), (a1, True)):
        calls.clear()
        before = len(fills)
        assert F.launch_direct(d, (3, 2), dict(desc_a=lazy(t), Y=x, num_stages=2))
        assert len(fills) - before == int(new_fill)
        ours = calls.pop()
        compiled.run(3, 2, 1, 77, 1234, (4, 1, 0), None, None, None, x, _desc(t, 16), 5, True, _desc(b1, 16), x)
        theirs = calls.pop()
        _same_arguments(ours, theirs, addresses)
        with F.pointer_ints(False):  # the A/B switch: tensors again
            assert F.launch_direct(d, (3, 2), dict(desc_a=lazy(t), Y=x, num_stages=2))
        _same_arguments(calls.pop(), theirs, False)
    odd = torch.randn(2 * 64 * 32 + 1, dtype=torch.bfloat16)[1:].view(1, 2, 64, 32)
    refused = [dict(desc_a=lazy(a2.half()), Y=x, num_stages=2), dict(desc_a=lazy(odd), Y=x, num_stages=2),
               dict(desc_a=lazy(torch.randn(1, 2, 48, 32, dtype=torch.bfloat16)), Y=x, num_stages=2),
               dict(desc_a=lazy(a2, 32), Y=x, num_stages=2), dict(desc_a=lazy(a2), Y=x.double(), num_stages=2),
               dict(desc_a=lazy(a2), Y=torch.zeros(5)[1:], num_stages=2), dict(desc_a=lazy(a2), Y=x, num_stages=3),
               dict(desc_a=_desc(a2, 16), Y=x, num_stages=2)]
    calls.clear()
    for kw in refused:
        assert not F.launch_direct(d, (3, 2), kw), kw
    for off in (F.enabled(False), F.kept_hits(False)):
        with off:
            assert not F.launch_direct(d, (3, 2), dict(desc_a=lazy(a2), Y=x, num_stages=2))
    assert calls == []
    F.clear()
