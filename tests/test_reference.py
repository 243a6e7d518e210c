import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from sparseattn import merge_states, reference_attention


def explicit_softmax_attention(q, k, v, mask, scale):
    """Loop-per-row attention with Python math: an independent check of the reference."""
    B, Hq, Lq, D = q.shape
    Hkv = k.shape[1]
    o = torch.zeros(B, Hq, Lq, v.shape[-1], dtype=torch.float64)
    lse = torch.full((B, Hq, Lq), -math.inf, dtype=torch.float64)
    for b in range(B):
        for h in range(Hq):
            kh = h // (Hq // Hkv)
            mh = mask[b if mask.shape[0] > 1 else 0, h if mask.shape[1] == Hq else (kh if mask.shape[1] > 1 else 0)]
            for i in range(Lq):
                keys = mh[i].nonzero().flatten().tolist()
                if not keys:
                    continue
                s = [float(q[b, h, i].double() @ k[b, kh, j].double()) * scale for j in keys]
                m = max(s)
                w = [math.exp(x - m) for x in s]
                z = sum(w)
                o[b, h, i] = sum(wj * v[b, kh, j].double() for wj, j in zip(w, keys)) / z
                lse[b, h, i] = m + math.log(z)
    return o, lse


@pytest.mark.parametrize("Hq,Hkv,mask_heads", [(2, 2, 1), (4, 2, 2), (4, 2, 4), (4, 1, 1)])
def test_reference_matches_explicit_softmax(Hq, Hkv, mask_heads):
    B, Lq, Lk, D = 2, 7, 9, 8
    q = torch.randn(B, Hq, Lq, D)
    k = torch.randn(B, Hkv, Lk, D)
    v = torch.randn(B, Hkv, Lk, D)
    mask = torch.rand(B, mask_heads, Lq, Lk) < 0.5
    mask[0, 0, 3] = False  # an empty row
    o, lse = reference_attention(q, k, v, mask, return_lse=True)
    o2, lse2 = explicit_softmax_attention(q, k, v, mask, 1 / math.sqrt(D))
    assert o.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(o, o2, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse2, rtol=1e-12, atol=1e-12)
    assert lse[0, 0, 3] == -math.inf and (o[0, 0, 3] == 0).all()


def test_reference_without_mask_equals_sdpa():
    q, k, v = torch.randn(1, 4, 16, 32), torch.randn(1, 2, 20, 32), torch.randn(1, 2, 20, 32)
    o = reference_attention(q, k, v, scale=0.3)
    want = torch.nn.functional.scaled_dot_product_attention(q.double(), k.double(), v.double(), scale=0.3,
                                                            enable_gqa=True)
    torch.testing.assert_close(o, want)


def test_empty_rows_zero_output_zero_grad_no_nan():
    q = torch.randn(1, 2, 5, 4, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 2, 6, 4, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(1, 1, 5, 6, dtype=torch.bool)
    mask[..., 2, :] = False
    mask[..., :, 5] = False  # key 5 is never attended
    o, lse = reference_attention(q, k, v, mask, return_lse=True)
    (o.sum() + torch.where(torch.isfinite(lse), lse, 0).sum()).backward()
    for t in (o, lse, q.grad, k.grad, v.grad):
        assert not torch.isnan(t).any()
    assert (o[:, :, 2] == 0).all() and (lse[:, :, 2] == -math.inf).all()
    assert (q.grad[:, :, 2] == 0).all()
    assert (k.grad[:, :, 5] == 0).all() and (v.grad[:, :, 5] == 0).all()


def test_gradient_against_finite_differences():
    q = torch.randn(1, 2, 4, 3, dtype=torch.float64, requires_grad=True)
    k = torch.randn(1, 1, 5, 3, dtype=torch.float64, requires_grad=True)
    v = torch.randn(1, 1, 5, 3, dtype=torch.float64, requires_grad=True)
    mask = torch.rand(1, 1, 4, 5) < 0.7
    mask[..., 1, :] = False
    def f(q, k, v):
        o, lse = reference_attention(q, k, v, mask, return_lse=True)
        return o, torch.where(torch.isfinite(lse), lse, 0.0)  # -inf has no finite difference

    assert torch.autograd.gradcheck(f, (q, k, v))


def test_large_scores_do_not_overflow():
    q = torch.full((1, 1, 2, 4), 1e4)
    k = torch.randn(1, 1, 3, 4) * 1e3
    v = torch.randn(1, 1, 3, 4)
    o = reference_attention(q, k, v, dtype=torch.float32)
    assert torch.isfinite(o).all()


def test_nan_stays_in_its_row():
    q = torch.randn(1, 1, 3, 4)
    q[0, 0, 1, 0] = float("nan")
    o = reference_attention(q, torch.randn(1, 1, 5, 4), torch.randn(1, 1, 5, 4))
    assert torch.isnan(o[0, 0, 1]).all() and torch.isfinite(o[0, 0, [0, 2]]).all()


@pytest.mark.parametrize("args,exc,match", [
    ((torch.randn(1, 3, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), ValueError, "multiple"),
    ((torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 4), torch.randn(1, 2, 4, 4)), ValueError, "head dim"),
    ((torch.randn(2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), ValueError, "4 dimensions"),
    ((torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8)), ValueError, "v must match"),
    ((torch.randn(1, 2, 4, 8), torch.randn(2, 2, 4, 8), torch.randn(2, 2, 4, 8)), ValueError, "batch"),
    ((torch.ones(1, 2, 4, 8, dtype=torch.long), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8)), TypeError,
     "floating"),
])
def test_bad_inputs(args, exc, match):
    with pytest.raises(exc, match=match):
        reference_attention(*args)


def test_bad_mask():
    q = k = v = torch.randn(1, 2, 4, 8)
    with pytest.raises(TypeError, match="bool"):
        reference_attention(q, k, v, torch.ones(1, 1, 4, 4))
    with pytest.raises(ValueError, match="shape"):
        reference_attention(q, k, v, torch.ones(1, 3, 4, 4, dtype=torch.bool))


# ---- merge law -------------------------------------------------------------------------------------------
def _part(s, v):
    """(o, lse) of one chunk of scores s [n] over values v [n, D] (empty chunk -> 0, -inf)."""
    if s.numel() == 0:
        return torch.zeros(v.shape[-1], dtype=torch.float64), torch.tensor(-math.inf, dtype=torch.float64)
    lse = torch.logsumexp(s, 0)
    return torch.softmax(s, 0) @ v, lse


@settings(max_examples=60, deadline=None)
@given(st.integers(1, 40), st.lists(st.integers(0, 40), min_size=0, max_size=6), st.integers(0, 2**31 - 1))
def test_merge_any_split_any_order_equals_whole(n, cuts, seed):
    g = torch.Generator().manual_seed(seed)
    s = torch.randn(n, generator=g, dtype=torch.float64) * 5
    v = torch.randn(n, 3, generator=g, dtype=torch.float64)
    bounds = sorted({0, n, *[min(c, n) for c in cuts]})
    parts = [_part(s[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    parts.append(_part(s[:0], v[:0]))  # an empty part anywhere changes nothing
    order = torch.randperm(len(parts), generator=g).tolist()
    o, lse = parts[order[0]]
    for i in order[1:]:
        o, lse = merge_states(o, lse, *parts[i])
    o_ref, lse_ref = _part(s, v)
    torch.testing.assert_close(o, o_ref, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(lse, lse_ref, rtol=1e-12, atol=1e-12)


def test_merge_two_empty_states_and_garbage_in_empty_state():
    o = torch.full((2, 4), float("nan"))
    lse = torch.full((2,), -math.inf)
    mo, ml = merge_states(o, lse, o, lse)
    assert (mo == 0).all() and (ml == -math.inf).all()
    real_o, real_lse = torch.randn(2, 4), torch.randn(2)
    mo, ml = merge_states(o, lse, real_o, real_lse)
    torch.testing.assert_close(mo, real_o)
    torch.testing.assert_close(ml, real_lse)


def test_merge_duplicate_part_changes_result():
    s, v = torch.randn(6, dtype=torch.float64), torch.randn(6, 2, dtype=torch.float64)
    a, b = _part(s[:3], v[:3]), _part(s[3:], v[3:])
    once = merge_states(*a, *b)
    twice = merge_states(*merge_states(*a, *b), *b)  # tile b counted twice
    assert not torch.allclose(once[0], twice[0])
    assert torch.allclose(twice[1], once[1] + torch.log1p(torch.exp(b[1] - once[1])))


def test_merge_bad_shapes():
    with pytest.raises(ValueError, match="same shape"):
        merge_states(torch.zeros(2, 3), torch.zeros(2), torch.zeros(2, 4), torch.zeros(2))
    with pytest.raises(ValueError, match="lse"):
        merge_states(torch.zeros(2, 3), torch.zeros(3), torch.zeros(2, 3), torch.zeros(3))
    with pytest.raises(TypeError):
        merge_states(torch.zeros(2, 3), [0, 0], torch.zeros(2, 3), torch.zeros(2))
