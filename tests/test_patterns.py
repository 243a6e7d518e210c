import pytest
import torch

from sparseattn import patterns as P
from conftest import dense_of


def test_causal_small():
    m = dense_of(P.causal(), 4, 4)[0, 0]
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_sliding_window_near_start():
    m = dense_of(P.sliding_window(2), 4, 4)[0, 0]
    assert m.tolist() == [[1, 0, 0, 0], [1, 1, 0, 0], [0, 1, 1, 0], [0, 0, 1, 1]]


def test_sliding_window_queries_are_last_positions():
    # 2 queries over 5 keys: they sit at absolute positions 3 and 4
    m = dense_of(P.sliding_window(2), 2, 5)[0, 0]
    assert m.tolist() == [[0, 0, 1, 1, 0], [0, 0, 0, 1, 1]]


def test_sinks_overlapping_window():
    m = dense_of(P.and_masks(P.causal(), P.or_masks(P.sinks(2), P.sliding_window(2))), 5, 5)[0, 0]
    assert m.tolist() == [[1, 0, 0, 0, 0],
                          [1, 1, 0, 0, 0],
                          [1, 1, 1, 0, 0],
                          [1, 1, 1, 1, 0],
                          [1, 1, 0, 1, 1]]


def test_dilated():
    m = dense_of(P.and_masks(P.causal(), P.dilated(2)), 4, 4)[0, 0]
    assert m.tolist() == [[1, 0, 0, 0], [0, 1, 0, 0], [1, 0, 1, 0], [0, 1, 0, 1]]


def test_document_with_length_one_document():
    ids = torch.tensor([0, 0, 1, 2, 2])
    m = dense_of(P.document(ids), 5, 5)[0, 0]
    assert m.tolist() == [[1, 1, 0, 0, 0], [1, 1, 0, 0, 0], [0, 0, 1, 0, 0], [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]


def test_document_batched():
    ids = torch.tensor([[0, 0, 1], [0, 1, 1]])
    m = dense_of(P.document(ids), 3, 3, B=2)
    assert m[0, 0].tolist() == [[1, 1, 0], [1, 1, 0], [0, 0, 1]]
    assert m[1, 0].tolist() == [[1, 0, 0], [0, 1, 1], [0, 1, 1]]


def test_prefix_lm():
    m = dense_of(P.prefix_lm(2), 4, 4)[0, 0]
    assert m.tolist() == [[1, 1, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]


def test_not_mask_and_full():
    m = dense_of(P.not_mask(P.causal()), 3, 3)[0, 0]
    assert m.tolist() == [[0, 1, 1], [0, 0, 1], [0, 0, 0]]
    assert dense_of(P.full(), 2, 3).all()


def test_block_random_keeps_whole_squares_and_density():
    mm = P.block_random(0.3, block=4, seed=7)
    m = dense_of(mm, 256, 256)[0, 0]
    squares = m.view(64, 4, 64, 4)
    assert (squares.all(dim=(1, 3)) == squares.any(dim=(1, 3))).all()  # squares are all-or-nothing
    frac = squares.any(dim=(1, 3)).float().mean().item()
    assert 0.25 < frac < 0.35
    assert torch.equal(m, dense_of(P.block_random(0.3, block=4, seed=7), 256, 256)[0, 0])  # deterministic
    assert not torch.equal(m, dense_of(P.block_random(0.3, block=4, seed=8), 256, 256)[0, 0])


def test_names_are_readable():
    assert P.causal().__name__ == "causal"
    assert P.sliding_window(128).__name__ == "sliding_window_128"
    assert P.and_masks(P.causal(), P.sinks(4)).__name__ == "and(causal, sinks_4)"
    assert P.not_mask(P.causal()).__name__ == "not(causal)"


@pytest.mark.parametrize("bad", [
    lambda: P.sliding_window(0), lambda: P.sinks(-1), lambda: P.dilated(0),
    lambda: P.block_random(1.5), lambda: P.document(torch.zeros(2, 2, 2, dtype=torch.long)),
])
def test_bad_arguments_raise_value_error(bad):
    with pytest.raises(ValueError):
        bad()


@pytest.mark.parametrize("bad", [
    lambda: P.sliding_window(2.0), lambda: P.document(torch.zeros(4)), lambda: P.and_masks(3),
    lambda: P.document([0, 1]),
])
def test_bad_types_raise_type_error(bad):
    with pytest.raises(TypeError):
        bad()


def test_mask_mods_work_in_flex_create_block_mask():
    fa = pytest.importorskip("torch.nn.attention.flex_attention")
    mm = P.and_masks(P.causal(), P.or_masks(P.sinks(4), P.sliding_window(16)))
    bm = fa.create_block_mask(mm, None, None, 64, 64, device="cpu", BLOCK_SIZE=16)
    assert torch.equal(bm.to_dense()[0, 0].bool(), dense_of(mm, 64, 64)[0, 0].view(4, 16, 4, 16).any(dim=(1, 3)))


def test_sinks_window_is_the_named_composition():
    named = dense_of(P.sinks_window(4, 16), 70, 70)
    composed = dense_of(P.and_masks(P.causal(), P.or_masks(P.sinks(4), P.sliding_window(16))), 70, 70)
    assert torch.equal(named, composed)
    assert P.sinks_window(4, 16).__name__ == "sinks_window_4_16"


def test_catalogue_names_every_generator_once():
    assert len(set(P.CATALOGUE.values())) == len(P.CATALOGUE)
    for name, gen in P.CATALOGUE.items():
        assert gen is getattr(P, name) and name in P.__all__
