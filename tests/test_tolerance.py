"""The one tolerance table (sparseattn.reference.TOLERANCES): its readers, and that it can tell a bug from rounding."""
import re
from pathlib import Path

import pytest
import torch

import sparseattn as sa
from sparseattn.reference import TOLERANCES, relative_error, tolerance

ROOT = Path(__file__).resolve().parents[1]


def test_table_is_complete_and_ordered():
    assert set(TOLERANCES) == {(d, p) for d in ("fp32", "fp16", "bf16") for p in ("fwd", "bwd")}
    for d in ("fp32", "fp16", "bf16"):
        assert 0 < TOLERANCES[(d, "fwd")] <= TOLERANCES[(d, "bwd")]  # gradients chain more roundings
    # a coarser format never gets a tighter bound
    assert TOLERANCES[("fp32", "fwd")] < TOLERANCES[("fp16", "fwd")] < TOLERANCES[("bf16", "fwd")]


def test_tolerance_reads_the_table_by_dtype_or_name():
    for dt, name in ((torch.float32, "fp32"), (torch.float16, "fp16"), (torch.bfloat16, "bf16")):
        for p in ("fwd", "bwd"):
            assert tolerance(dt, p) == tolerance(name, p) == TOLERANCES[(name, p)]
        assert tolerance(dt) == TOLERANCES[(name, "fwd")]


@pytest.mark.parametrize("dtype, exc, word", [(torch.float64, ValueError, "dtype"), (torch.int32, ValueError, "dtype"),
                                              ("float32", ValueError, "dtype"), (32, TypeError, "dtype"),
                                              (None, TypeError, "dtype")])
def test_tolerance_rejects_unknown_dtypes(dtype, exc, word):
    with pytest.raises(exc, match=word):
        tolerance(dtype)


@pytest.mark.parametrize("pass_, exc", [("fw", ValueError), ("grad", ValueError), (1, TypeError), (None, TypeError)])
def test_tolerance_rejects_unknown_passes(pass_, exc):
    with pytest.raises(exc, match="pass_"):
        tolerance(torch.float16, pass_)


def test_relative_error_values():
    ref = torch.tensor([3.0, 4.0], dtype=torch.float64)
    assert relative_error(torch.tensor([3.0, 4.0]), ref) == 0.0
    assert relative_error(torch.tensor([3.0, 4.5]), ref) == pytest.approx(0.1, rel=1e-12)  # 0.5 / 5
    assert relative_error(torch.tensor([3.0, 4.0], dtype=torch.float16), ref) == 0.0  # exact in fp16
    # computed in float64: a float32 difference below float32's resolution of the norm still shows
    x = torch.full((10_000,), 1.0) + torch.tensor([1e-7] + [0.0] * 9_999)
    assert 0 < relative_error(x, torch.ones(10_000, dtype=torch.float64)) < 1e-8
    zero = torch.zeros(4, dtype=torch.float64)
    assert relative_error(torch.zeros(4), zero) == 0.0
    assert relative_error(torch.tensor([0.0, 1e-30, 0.0, 0.0]), zero) == float("inf")
    nan = relative_error(torch.tensor([float("nan"), 4.0]), ref)
    assert nan != nan and not nan < tolerance("bf16", "bwd")  # a NaN fails every bound


@pytest.mark.parametrize("args, exc, word", [((1.0, torch.ones(2)), TypeError, "x"),
                                             ((torch.ones(2), [1.0, 1.0]), TypeError, "ref"),
                                             ((torch.ones(2, dtype=torch.int64), torch.ones(2)), TypeError, "x"),
                                             ((torch.ones(2), torch.ones(3)), ValueError, "same shape")])
def test_relative_error_rejects_bad_arguments(args, exc, word):
    with pytest.raises(exc, match=word):
        relative_error(*args)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_a_dropped_tile_exceeds_every_bound_while_the_kernel_is_within_its_own(dtype):
    """The bounds separate rounding from a bug: dropping one of eight tiles of one query tile of a causal
    layout (a kernel that forgets a tile) gives a relative error above 5e-2, above every entry of the table."""
    L, blk = 512, 64
    layout = sa.BlockLayout.from_mask_mod(sa.patterns.causal(), L, L, blk, blk)
    n = L // blk
    tiles = torch.ones(n, n, dtype=torch.bool).tril()
    tiles[n - 1, 0] = False  # the last query tile forgets its first key tile
    dropped = sa.BlockLayout.from_block_mask(tiles[None, None], L, L, blk, blk, mask_mod=sa.patterns.causal())
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, L, 32, generator=g).to(dtype) for _ in range(3))
    ref = sa.reference_attention(q, k, v, layout.to_dense())
    good = relative_error(sa.sparse_attention(q, k, v, layout), ref)
    bad = relative_error(sa.sparse_attention(q, k, v, dropped), ref)
    assert good < tolerance(dtype) < max(TOLERANCES.values()) < 5e-2 < bad, (good, bad)


# ---------------------------------------------------------------------------------------------------------
# the prose that states tolerances must state the table's numbers
# ---------------------------------------------------------------------------------------------------------
PROSE = {"book/reading_guide.md": "The correctness method used throughout", "book/design.md": "**Correctness.**"}
NAMES = {"float32": "fp32", "fp32": "fp32", "float16": "fp16", "fp16": "fp16", "bfloat16": "bf16", "bf16": "bf16"}


def stated_tolerances(text: str):
    """Every ``<dtype> ... <number>`` pair the paragraph states, as {(dtype, pass): number}; a sentence about
    gradients (it says "gradient") states "bwd" bounds, any other "fwd"."""
    found = {}
    for sentence in re.split(r"(?<=\.)\s+(?=[A-Z])", text):
        pass_ = "bwd" if "gradient" in sentence.lower() else "fwd"
        for name, num in re.findall(r"\b(float32|float16|bfloat16|fp32|fp16|bf16)\b[^0-9;.]*?(\d+(?:\.\d+)?e-\d+)",
                                    sentence):
            found[(NAMES[name], pass_)] = float(num)
    return found


@pytest.mark.parametrize("path", sorted(PROSE))
def test_pages_state_the_table(path):
    text = (ROOT / path).read_text()
    para = next(p for p in text.split("\n\n") if PROSE[path] in p)
    assert "TOLERANCES" in para, f"{path}: the correctness paragraph must point at sparseattn.reference.TOLERANCES"
    stated = stated_tolerances(para)
    assert stated, f"{path}: no tolerance found in the correctness paragraph"
    for key, value in stated.items():
        assert value == TOLERANCES[key], f"{path} states {key} = {value:g}, the table says {TOLERANCES[key]:g}"


def test_the_prose_parser_can_fail():
    assert stated_tolerances("Tolerances: fp16 3e-3 and bfloat16 1e-2.") == {("fp16", "fwd"): 3e-3,
                                                                           ("bf16", "fwd"): 1e-2}
    assert stated_tolerances("For gradients: float32 5e-5.") == {("fp32", "bwd"): 5e-5}
