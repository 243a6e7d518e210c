"""Chapter 4's live transpose figure: on a CPU it times the torch stable-sort transpose (not the Triton
kernel in the interpreter) and says so; that path computes the same lists as the layout's own transpose."""
import pytest
import torch

from sparseattn import BlockLayout, patterns as P
from sparseattn._tiles import _transpose_one_torch

pytest.importorskip("plotly")


def test_cpu_figure_times_the_torch_path_and_says_so():
    from sparseattn.viz import ch04_index as V
    assert V.transpose_path("cpu") == "torch stable sort" and V.transpose_path("cuda") == "fused Triton kernel"
    fig = V.transpose_cost_figure(Ns=(256, 512), block=64, repeat=1)
    assert "torch stable sort" in fig.layout.title.text and "CPU" in fig.layout.title.text
    assert [len(t.x) for t in fig.data] == [2, 2] and all(y > 0 for t in fig.data for y in t.y)


def test_the_timed_torch_path_equals_the_layout_transpose():
    lay = BlockLayout.from_mask_mod(P.sinks_window(16, 100), 512, 512, 64, 64, device="cpu")
    want = lay.transpose(width=lay.nq)
    count, index, slot = _transpose_one_torch(lay.kv_count, lay.kv_index, lay.nk, lay.nq)
    fcount, findex, _ = _transpose_one_torch(lay.full_count, lay.full_index, lay.nk, lay.nq)
    assert torch.equal(count, want.q_count) and torch.equal(fcount, want.full_q_count)
    for c, got, ref in ((count, index, want.q_index), (fcount, findex, want.full_q_index)):
        valid = torch.arange(got.shape[-1]) < c[..., None]
        assert torch.equal(got[valid], ref[valid])
    valid = torch.arange(slot.shape[-1]) < count[..., None]
    assert torch.equal(slot[valid], want.q_slot[valid])


def test_transpose_timing_is_a_median_one_stalled_run_draws_no_spike():
    from sparseattn.viz import ch04_index as V
    durations = iter([1e-3, 1e-3, 0.08, 1e-3, 1e-3])  # one run stalled by another job on the machine
    ticks, now = [], [0.0]

    def clock():  # every second call closes a timed run of the next duration
        if len(ticks) % 2:
            now[0] += next(durations)
        ticks.append(now[0])
        return now[0]

    calls = []
    ms = V._median_ms(lambda: calls.append(1), 5, clock=clock)
    assert abs(ms - 1.0) < 1e-9 and len(calls) == 6  # warm-up + 5 timed runs
    with pytest.raises(ValueError, match="repeat"):
        V._median_ms(lambda: None, 0)


def test_unsorted_row_spares_the_sort_path_but_not_the_fused_kernel():
    """Chapter 4, exercise 2's answer: a row listing its tiles out of order leaves the stable-sort transpose
    unchanged (entries arrive row by row) but makes the fused kernel's binary search miss tiles."""
    from sparseattn._tiles import transpose_lists
    lay = BlockLayout.from_mask_mod(P.causal(), 256, 256, 64, 64, device="cpu")
    fc, fi = lay.full_count.clone(), lay.full_index.clone()
    n = int(fc[0, 0, 3])
    assert n == 3
    shuffled = fi.clone()
    shuffled[0, 0, 3, :n] = shuffled[0, 0, 3, :n].flip(0)  # [2, 1, 0]
    sort_ok = _transpose_one_torch(fc, fi, lay.nk, lay.nq)
    sort_bad = _transpose_one_torch(fc, shuffled, lay.nk, lay.nq)
    assert torch.equal(sort_ok[0], sort_bad[0]) and torch.equal(sort_ok[1], sort_bad[1])
    args = (lay.kv_count, lay.kv_index)
    fused_ok = transpose_lists(*args, fc, fi, lay.nk, lay.nq, lay.nq)[3]
    fused_bad = transpose_lists(*args, fc, shuffled, lay.nk, lay.nq, lay.nq)[3]
    assert torch.equal(fused_ok, sort_ok[0]) and fused_bad.sum() < fused_ok.sum()
