"""The roofline cost model: its counts against loops over the dense mask, its terms, the calibration record,
the crossover, the report and the profiling helper (CPU)."""
import json
import math
import sys
import textwrap

import numpy as np
import pytest
import torch

from conftest import brute_classes
from sparseattn import BlockLayout, PageSelection, PagedKVCache, patterns as P
from sparseattn.ops import BwdConfig, DecodeConfig, FwdConfig, column_work, decode_programs_per_sm, decode_splits
import sparseattn.roofline as R
from sparseattn.roofline import host as H
from sparseattn.roofline.ceilings import Ceilings
from sparseattn.roofline import calibrate as C
from sparseattn.roofline.ceilings import device_slug
from sparseattn.roofline.counts import Shape, bwd_work, decode_input, decode_work, fwd_work
from sparseattn.roofline.crossover import crossing, envelope_of
from sparseattn.roofline.model import makespan
from sparseattn.roofline.profile import _split, bucket_of, busy_ms


# ---- brute force over the dense mask ---------------------------------------------------------------------------
def _lh(layout, s, hq):
    if layout.H == s.Hq:
        return hq
    return hq // s.group if layout.H == s.Hkv else 0


def _rows_of(layout):
    """Per (lb, lh, qi): ascending lists of (kj, full?) from the dense mask, tile by tile."""
    partial, full = brute_classes(layout.to_dense(), layout.block_q, layout.block_k)
    return partial, full


def _clip(length, i, block):
    return max(0, min(block, length - i * block))


def brute_fwd(layout, s, BM, BN):
    """Per program (b, hq, m): (partial steps, full steps, requested K/V bytes, Q rows); unique K/V rows."""
    partial, full = _rows_of(layout)
    Bq, Bk, Lq, Lk = layout.block_q, layout.block_k, layout.q_len, layout.kv_len
    progs = {}
    for b in range(s.B):
        lb = b if layout.B > 1 else 0
        for hq in range(s.Hq):
            lh = _lh(layout, s, hq)
            for m in range(math.ceil(Lq / BM)):
                qi = m * BM // Bq
                n_p = int(partial[lb, lh, qi].sum())
                n_f = int(full[lb, lh, qi].sum())
                keys = sum(_clip(Lk, kj, Bk) for kj in range(layout.nk) if partial[lb, lh, qi, kj] or full[lb, lh, qi, kj])
                progs[(b, hq, m)] = (n_p * (Bk // BN), n_f * (Bk // BN), 2 * keys * s.D * s.elt, _clip(Lq, m, BM))
    unique = 0
    for b in range(s.B):
        lb = b if layout.B > 1 else 0
        for hkv in range(s.Hkv):
            cols = set()
            for hq in range(hkv * s.group, (hkv + 1) * s.group):
                lh = _lh(layout, s, hq)
                cols |= {kj for kj in range(layout.nk) if (partial[lb, lh, :, kj] | full[lb, lh, :, kj]).any()}
            unique += sum(_clip(Lk, kj, Bk) for kj in cols)
    return progs, unique


LAYOUTS = {
    "causal": lambda: BlockLayout.from_mask_mod(P.causal(), 256, 256, 64, 64, device="cpu"),
    "window_ragged": lambda: BlockLayout.from_mask_mod(P.sliding_window(70), 200, 328, 32, 64, device="cpu"),
    "sinks_window": lambda: BlockLayout.from_mask_mod(P.sinks_window(16, 64), 300, 300, 32, 32, device="cpu"),
    "block_random_compiled": lambda: BlockLayout.from_mask_mod(P.block_random(0.4, 16, seed=3), 160, 192, 32, 32,
                                                           device="cpu"),
    "documents": lambda: BlockLayout.from_mask_mod(
        P.and_masks(P.causal(), P.document(torch.tensor([0] * 50 + [1] * 90 + [2] * 60))), 200, 200, 32, 32,
        device="cpu"),
    "dense_bits": lambda: BlockLayout.from_dense(torch.rand(1, 1, 96, 160) < 0.3, 32, 32),
}
SHAPES = {"mha": Shape(B=1, Hq=2, D=32, dtype=torch.float16), "gqa": Shape(B=2, Hq=4, Hkv=2, D=64, dtype=torch.float32)}


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("tiles", [(None, None), (16, 16)])
def test_forward_counts_match_a_loop_over_the_dense_mask(name, shape, tiles):
    layout, s = LAYOUTS[name](), SHAPES[shape]
    BM, BN = tiles[0] or layout.block_q, tiles[1] or layout.block_k
    work = fwd_work(layout, s, FwdConfig(block_m=BM, block_n=BN, num_warps=4, num_stages=1))
    k = work.kernels[0]
    progs, unique = brute_fwd(layout, s, BM, BN)
    n_m = math.ceil(layout.q_len / BM)
    assert k.programs == len(progs) == n_m * s.B * s.Hq
    # per (batch x head): the same programs, longest first when the layout is shared by every head
    sp, sf = k.steps_partial.view(s.B * s.Hq, n_m), k.steps_full.view(s.B * s.Hq, n_m)
    for bh in range(s.B * s.Hq):
        b, hq = divmod(bh, s.Hq)
        want = sorted((progs[(b, hq, m)][0], progs[(b, hq, m)][1]) for m in range(n_m))
        assert sorted(zip(sp[bh].tolist(), sf[bh].tolist())) == want
        total = (sp[bh] + sf[bh]).tolist()
        assert total == sorted(total, reverse=True), "programs must be dispatched longest row first"
    steps = sum(p[0] + p[1] for p in progs.values())
    assert k.flops == steps * 4 * BM * BN * s.D
    assert work.requested["kv"] == sum(p[2] for p in progs.values())
    assert work.requested["q"] == work.requested["o"] == sum(p[3] for p in progs.values()) * s.D * s.elt
    assert work.requested["lse"] == s.B * s.Hq * layout.q_len * 4
    assert work.hbm["kv"] == 2 * unique * s.D * s.elt
    assert work.requested["index"] == 4 * steps + 12 * len(progs)
    bits = R.counts._mask_flags(layout)[0]
    assert bits == name.endswith("bits")
    partial_steps = sum(p[0] for p in progs.values())
    assert work.requested["bits"] == (partial_steps * BM * BN / 8 if bits else 0)


@pytest.mark.parametrize("H", [2, 4])
def test_forward_counts_with_per_batch_and_per_head_layouts(H):
    s = Shape(B=2, Hq=4, Hkv=2, D=32, dtype=torch.float16)
    layout = BlockLayout.from_mask_mod(lambda b, h, q, k: (q >= k) & (q - k < 24 * (h + 1) + 40 * b), 160, 160, 32, 32,
                                       B=2, H=H, device="cpu")
    work = fwd_work(layout, s, FwdConfig(block_m=16, block_n=32, num_warps=4, num_stages=1))
    k = work.kernels[0]
    progs, unique = brute_fwd(layout, s, 16, 32)
    n_m = 10
    for bh in range(s.B * s.Hq):
        b, hq = divmod(bh, s.Hq)
        got = sorted(zip(k.steps_partial.view(-1, n_m)[bh].tolist(), k.steps_full.view(-1, n_m)[bh].tolist()))
        assert got == sorted(progs[(b, hq, m)][:2] for m in range(n_m)), (b, hq)
    assert work.requested["kv"] == sum(p[2] for p in progs.values())
    assert work.hbm["kv"] == 2 * unique * s.D * s.elt


def test_forward_flops_are_4_bq_bk_d_per_listed_tile_per_query_head():
    layout = LAYOUTS["sinks_window"]()  # 300 is not a multiple of 32: physical tiles still count whole
    s = Shape(B=3, Hq=6, Hkv=3, D=64)
    partial, full = _rows_of(layout)
    tiles = int((partial | full).sum())
    work = fwd_work(layout, s, FwdConfig(block_m=32, block_n=32, num_warps=4, num_stages=1))
    assert work.flops == tiles * s.B * s.Hq * 4 * 32 * 32 * 64
    assert work.matmuls == 2


@pytest.mark.parametrize("name", ["causal", "window_ragged", "sinks_window", "documents"])
@pytest.mark.parametrize("chunk", [None, 2])
def test_backward_counts_match_a_loop_over_the_dense_mask(name, chunk):
    layout, s = LAYOUTS[name](), Shape(B=2, Hq=4, Hkv=2, D=32, dtype=torch.float16)
    cfg = BwdConfig(block_m=16, block_n=layout.block_k, dq_block_m=layout.block_q, dq_block_n=16, num_warps=4,
                    num_stages=1, chunk=chunk)
    work = bwd_work(layout, s, cfg, deterministic=True)
    dkdv, dq = work.kernels
    partial, full = _rows_of(layout)
    Bq, Bk, Lq = layout.block_q, layout.block_k, layout.q_len
    plan = column_work(layout, cfg.block_n, chunk)
    steps_p, steps_f, q_rows = [], [], 0
    for b in range(s.B):
        for hkv in range(s.Hkv):
            for sub, c, _ in plan.work.tolist():
                kj = sub * cfg.block_n // Bk
                n_p = n_f = 0
                for hq in range(hkv * s.group, (hkv + 1) * s.group):
                    lh = _lh(layout, s, hq)
                    col = [(qi, False) for qi in range(layout.nq) if partial[0, lh, qi, kj]] + \
                          [(qi, True) for qi in range(layout.nq) if full[0, lh, qi, kj]]
                    chunk_ = col[c * plan.chunk:(c + 1) * plan.chunk]
                    n_p += sum(not f for _, f in chunk_) * (Bq // cfg.block_m)
                    n_f += sum(f for _, f in chunk_) * (Bq // cfg.block_m)
                    q_rows += sum(_clip(Lq, qi, Bq) for qi, _ in chunk_)
                steps_p.append(n_p)
                steps_f.append(n_f)
    assert dkdv.steps_partial.tolist() == steps_p
    assert dkdv.steps_full.tolist() == steps_f
    assert work.requested["do"] == q_rows * s.D * s.elt + s.B * s.Hq * Lq * s.D * s.elt  # dkdv + dq programs
    # every listed (query tile, key tile) pair per query head: 4 whole-tile matmuls in dK/dV, 3 in dQ, against
    # the forward's 2 (a forward with block_m = block_q also multiplies whole tiles at the ragged end)
    fwd = fwd_work(layout, s, FwdConfig(block_m=Bq, block_n=16, num_warps=4, num_stages=1))
    assert dkdv.flops + dq.flops == pytest.approx(fwd.flops * 7 / 2)
    assert dkdv.matmuls == 4 and dq.matmuls == 3 and work.matmuls == 7


def test_atomic_backward_has_five_tile_matmuls():
    layout = LAYOUTS["causal"]()
    s = Shape(Hq=2, D=64)
    cfg = BwdConfig(block_m=64, block_n=64, dq_block_m=64, dq_block_n=64, num_warps=4, num_stages=1)
    det, atomic = bwd_work(layout, s, cfg, True), bwd_work(layout, s, cfg, False)
    fwd = fwd_work(layout, s, FwdConfig(block_m=64, block_n=64, num_warps=4, num_stages=1))
    assert det.matmuls == 7 and atomic.matmuls == 5
    assert det.flops == fwd.flops * 7 / 2 and atomic.flops == fwd.flops * 5 / 2
    assert [k.name for k in atomic.kernels] == ["dkdv_kernel"]
    assert {op.name for op in atomic.torch_ops} == {"delta", "dq_zero", "dq_cast"}


def test_counts_never_read_list_padding():
    """Padding past a list's count is never read (the fused transpose leaves it unwritten): garbage there must
    not change the counts (the crossover suite's routing family once died on an out-of-range padding index)."""
    s, cfg = Shape(Hq=2, D=32), BwdConfig(block_m=32, block_n=32, dq_block_m=32, dq_block_n=32, num_warps=4,
                                          num_stages=1)
    clean = LAYOUTS["sinks_window"]()
    want, stats = bwd_work(clean, s, cfg), clean.stats()
    dirty = LAYOUTS["sinks_window"]()
    t = dirty.transposed_lists()
    for count, index in ((t.q_count, t.q_index), (t.full_q_count, t.full_q_index),
                         (dirty.kv_count, dirty.kv_index), (dirty.full_count, dirty.full_index)):
        pad = torch.arange(index.shape[-1]) >= count[..., None].cpu()
        assert pad.any()
        index.masked_fill_(pad.to(index.device), 123456)  # in place: what an unwritten buffer may hold
    got = bwd_work(dirty, s, cfg)
    assert (got.flops, got.hbm, got.requested) == (want.flops, want.hbm, want.requested)
    assert dirty.stats() == stats


# ---- decode ---------------------------------------------------------------------------------------------------------
def _cache(lens, ps=16, Hkv=2, D=32):
    cache = PagedKVCache(sum(-(-n // ps) for n in lens) + 1, ps, Hkv, D, dtype=torch.float16, device="cpu",
                         max_seqs=len(lens))
    for b, n in enumerate(lens):
        cache.append(b, torch.randn(n, Hkv, D, dtype=torch.float16), torch.randn(n, Hkv, D, dtype=torch.float16))
    return cache


def test_decode_bytes_are_pages_times_page_size():
    cache = _cache([160, 96, 320])  # whole pages only
    idx = torch.tensor([[[0, 3, 7, 9], [1, 2, 0, 0]], [[0, 5, 0, 0], [2, 3, 4, 5]], [[0, 1, 19, 0], [4, 0, 0, 0]]],
                       dtype=torch.int32)
    count = torch.tensor([[4, 2], [2, 4], [3, 1]], dtype=torch.int32)
    sel = PageSelection(idx, count, cache=cache)
    s = Shape(B=3, Hq=4, Hkv=2, D=32, dtype=torch.float16)
    work = R.model.work_of(cache, s, "decode", pages=sel)
    pages = int(count.sum())
    assert work.kernels[0].hbm["kv"] == pages * 16 * 32 * 2 * 2
    assert work.kernels[0].requested["kv"] == pages * 16 * 32 * 2 * 2


def test_decode_steps_and_partial_last_page_match_a_token_loop():
    lens = [150, 37]
    cache = _cache(lens)
    idx = torch.tensor([[[0, 4, 9], [2, 9, 0]], [[0, 2, 0], [1, 0, 0]]], dtype=torch.int32)
    count = torch.tensor([[3, 2], [2, 1]], dtype=torch.int32)
    sel = PageSelection(idx, count, cache=cache)
    s = Shape(B=2, Hq=2, Hkv=2, D=32, dtype=torch.float16)
    cfg = DecodeConfig(block_n=32)
    work = decode_work(s, decode_input(s, cache=cache, pages=sel), cfg, num_sms=4)
    n_splits, per = decode_splits(2, 2, 3 * 16, 32, 4, decode_programs_per_sm(cfg, 2, 2, 4))
    steps, tokens = [], 0
    for b in range(2):
        for sp in range(n_splits):
            for h in range(2):  # head fastest
                n_virtual = int(count[b, h]) * 16
                first, last = sp * per, min(sp * per + per, -(-n_virtual // 32))
                steps.append(max(0, last - first))
                for blk in range(first, last):
                    for v in range(blk * 32, min(blk * 32 + 32, n_virtual)):
                        page = int(idx[b, h, v // 16])
                        tokens += page * 16 + v % 16 < lens[b]
    assert work.kernels[0].steps_full.tolist() == steps
    assert work.kernels[0].hbm["kv"] == tokens * 32 * 2 * 2


def test_kept_fraction_selects_like_select_pages():
    s = Shape(B=2, Hq=8, Hkv=2, D=64, seq_len=1000, page_size=16)  # 63 pages, the last one partly filled
    inp = decode_input(s, keep=0.25)
    assert inp.capacity == round(0.25 * 63)
    assert inp.sel_tokens.tolist() == [[(16 - 1) * 16 + 1000 - 62 * 16] * 2] * 2
    with pytest.raises(ValueError, match="keep"):
        decode_input(s, keep=1.5)


# ---- the model ----------------------------------------------------------------------------------------------------
def test_makespan_is_the_greedy_schedule():
    assert makespan(np.array([3.0, 1, 1, 1]), 2) == 3
    assert makespan(np.ones(5), 2) == 3
    rng = np.random.default_rng(0)
    for _ in range(20):
        units, slots = rng.integers(1, 20, size=rng.integers(1, 40)).astype(float), int(rng.integers(1, 6))
        free = [0.0] * slots
        for u in units:  # the obvious simulation: the next program goes to the SM that frees first
            i = free.index(min(free))
            free[i] += u
        assert makespan(units, slots) == max(free)


def test_cost_terms_add_up_and_name_the_bound():
    layout = BlockLayout.from_mask_mod(P.sliding_window(1024), 8192, 8192, device="cpu")
    s = {"B": 1, "Hq": 16, "D": 128, "dtype": "bf16"}
    c = R.cost(layout, s, "fwd")
    assert c.predicted_ms == pytest.approx(c.t_route_ms + c.t_index_ms + c.kernels_ms + c.t_launch_ms)
    assert c.kernels_ms == pytest.approx(max(c.t_compute_ms, c.t_memory_ms))
    assert c.bound == "compute" and c.P_eff_tflops < R.ceilings().matmul("bfloat16")
    routed = R.cost(layout, s, "fwd", routing=0.5, rebuild_layout=True)
    assert routed.predicted_ms == pytest.approx(c.predicted_ms + 0.5 + routed.index_build_ms)
    decode = R.cost(None, {"B": 8, "Hq": 32, "Hkv": 8, "D": 128, "seq_len": 131072}, "decode", keep=0.5, graph=True)
    assert decode.bound == "memory" and decode.t_compute_ms == 0
    # terms that do not apply print as such, not as "0 TFLOP/s -> 0 ms"
    assert "compute term not priced" in str(decode) and "T_route not priced" in str(decode)
    assert "0 TFLOP/s" not in str(decode) and "not priced" not in str(c).split("T_launch")[0]
    assert "T_route 0.5 ms" in str(routed)
    tiny = R.cost(None, {"B": 1, "Hq": 32, "Hkv": 8, "D": 128, "seq_len": 4096}, "decode", keep=0.05, graph=True)
    assert tiny.bound == "overhead"
    assert R.cost(layout, s, "bwd").flops == pytest.approx(c.flops * 3.5)


def test_cost_rejects_bad_arguments():
    layout = LAYOUTS["causal"]()
    with pytest.raises(ValueError, match="pass_"):
        R.cost(layout, {"Hq": 2}, "backward")
    with pytest.raises(ValueError, match="unknown keys"):
        R.cost(layout, {"Hq": 2, "heads": 2})
    with pytest.raises(ValueError, match="multiple of Hkv"):
        R.cost(layout, {"Hq": 3, "Hkv": 2})
    with pytest.raises(ValueError, match="layout has H=2"):
        R.cost(BlockLayout.from_mask_mod(P.causal(), 64, 64, 32, 32, H=2, device="cpu"), {"Hq": 3})
    with pytest.raises(TypeError, match="routing"):
        R.cost(layout, {"Hq": 2}, routing=-1.0)
    with pytest.raises(TypeError, match="FwdConfig"):
        R.cost(layout, {"Hq": 2}, config=DecodeConfig())
    with pytest.raises(ValueError, match="seq_len"):
        R.cost(None, {"Hq": 2}, "decode", keep=0.1)
    with pytest.raises(TypeError, match="dtype"):
        R.cost(layout, {"Hq": 2, "dtype": "int8"})


def test_recorded_ceilings_say_where_every_value_comes_from():
    c = R.ceilings()
    assert c.device == "NVIDIA H200" and c.sm_count == 132
    for name in ("sm_count", "matmul_tflops", "hbm_read_tbps", "launch_us", "host_call_us", "l2_mib"):
        assert c.sources.get(name), f"no source for {name}"
    assert R.ceilings("cpu") == c == R.ceilings("NVIDIA H200")
    with pytest.raises(ValueError, match="no recorded ceilings"):
        R.ceilings("NVIDIA B300")


def test_measure_ceilings_runs_with_mocked_timers():
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return 2.0

    c = R.measure_ceilings("cpu", matmul_n=64, read_bytes=1 << 12, launches=3, timer=timer,
                           wall_timer=lambda fn: (fn(), 0.5)[1])
    assert c.matmul_tflops["bfloat16"] == pytest.approx(2 * 64 ** 3 / 2e-3 / 1e12)
    assert c.hbm_read_tbps == pytest.approx((1 << 12) / 2e-3 / 1e12)
    assert c.launch_us == pytest.approx(2.0 * 1e3 / 3)
    assert c.host_call_us == {"fwd": 500.0, "decode": 500.0}
    from sparseattn.roofline.ceilings import READ_CONFIGS
    assert len(calls) == 3 + 1 + len(READ_CONFIGS) + 1  # matmul per dtype, torch.sum and each read config, launch
    with pytest.raises(ValueError, match="CUDA"):
        R.measure_ceilings("cpu")


# ---- the calibration record -----------------------------------------------------------------------------------------
def test_calibration_and_evaluation_points_are_disjoint():
    rec = json.loads(C.record_path("h200").read_text())
    cal = rec["calibration"]
    assert set(cal["calibration_points"]).isdisjoint(cal["evaluation_points"])
    assert cal["evaluation_points"], "no evaluation points"
    for key, m in rec["model"].items():
        assert set(m["calibration_points"]) <= set(cal["calibration_points"]), key
    roles = {r["id"]: r["role"] for r in cal["points"]}
    points = C.load_points()
    fitted = {C._shape_key(p) for p in points if p.role == "calibration"}
    for p in points:  # the stored roles follow the rule of the code
        if p.id.startswith(C.EVALUATION_FILES):  # the sweep only evaluates; a re-measured fitted point is a repeat
            assert roles[p.id] == p.role == ("repeat" if C._shape_key(p) in fitted else "evaluation"), p.id
        elif p.id.startswith(C.HOST_DEVICE_PREFIX):  # short-end device points: fitted unless the sweep has them
            assert roles[p.id] == p.role in ("calibration", "repeat"), p.id
        else:
            assert roles[p.id] == p.role == C.role_of(p)
    assert {roles[i] for i in cal["repeated_points"]} <= {"repeat"}  # left out of the accuracy, listed apart
    # same layouts never on both sides within a prefill model
    for key in ("sparseattn/fwd", "flex/fwd", "sparseattn/bwd"):
        pts = [r for r in cal["points"] if r["group"] == key]
        cal_pat = {r["label"].split()[2] for r in pts if r["role"] == "calibration"}
        ev_pat = {r["label"].split()[2] for r in pts if r["role"] == "evaluation"}
        assert cal_pat and ev_pat and cal_pat.isdisjoint(ev_pat), key


def test_stored_predictions_follow_from_the_stored_parameters():
    rec = json.loads(C.record_path("h200").read_text())
    stored = {r["id"]: r for r in rec["calibration"]["points"]}
    ceil = R.Ceilings.from_json(rec["ceilings"])
    points = [p for p in C.load_points() if p.group in ("sparseattn/fwd", "sparseattn/bwd", "sparseattn/decode")]
    rows = C.evaluate(points, rec["model"], ceil, rec.get("host"))
    for r in rows:
        assert r["predicted_ms"] == pytest.approx(stored[r["id"]]["predicted_ms"], rel=1e-4), r["label"]
    assert C.accuracy(rec["calibration"]["points"]) == rec["calibration"]["accuracy"]


def test_package_docstring_quotes_the_recorded_accuracy():
    acc = json.loads(C.record_path("h200").read_text())["calibration"]["accuracy"]
    assert textwrap.indent(C.summary_table(acc), "    ") in R.__doc__
    assert textwrap.indent(C.failures_table(acc, C.DOCSTRING_FAILURES), "    ") in R.__doc__


def test_bench_and_roofline_share_one_home_for_cases_timers_and_slugs():
    """The suites measure the layouts the calibration rebuilds, with the timers the roofline uses: the same
    objects, not copies."""
    import sparseattn.bench as bench
    from sparseattn.bench import _common as BC, cases as bench_cases
    from sparseattn.roofline import cases, timing
    for name in ("prefill_layout", "prefill_mask_mod", "dense_pattern_of", "layout_mask_mod", "decode_setup",
                 "PREFILL_PATTERNS", "LAYOUT_PATTERNS"):
        assert getattr(bench_cases, name) is getattr(cases, name), name
    for name in ("time_gpu", "time_host", "time_loop", "graph_step", "compiled_flex", "flex_fn", "sdpa_fn", "sdpa_backend"):
        assert getattr(BC, name) is getattr(timing, name) is getattr(bench, name, getattr(timing, name)), name
    assert BC.gpu_slug is device_slug
    for name in ("NVIDIA H200", "NVIDIA GeForce RTX 4090", "Tesla T4", "NVIDIA A100-SXM4-80GB"):
        assert device_slug(name) == {"NVIDIA H200": "h200", "NVIDIA GeForce RTX 4090": "rtx-4090", "Tesla T4": "t4",
                                     "NVIDIA A100-SXM4-80GB": "a100"}[name]
    for pattern in ("causal", "window1024", "sinks64+window1024", "random10%+diag"):
        lay = C.RECORDED_PATTERNS[pattern](1024)
        assert lay.block_q == lay.block_k == 128 and lay.device.type == "cpu"


def test_rebuilt_layouts_must_match_the_recorded_tile_counts():
    """The calibration refuses a recorded row whose rebuilt layout lists another number of tiles (a builder
    changed after the data was recorded)."""
    p = next(p for p in C.load_points() if p.group == "sparseattn/fwd" and p.pattern == "window1024")
    C.point_work(p, R.ceilings())  # the recorded count matches
    bad = C.Point(**{**p.__dict__, "case": {**p.case, "tiles": p.case["tiles"] + 1}})
    with pytest.raises(AssertionError, match="tiles"):
        C.point_work(bad, R.ceilings())


# ---- crossover and report ---------------------------------------------------------------------------------------------
def test_cross_interpolates_the_log_ratio():
    value, state = crossing([1000, 2000, 4000], [2.0, 1.0, 0.5], [1.0, 1.0, 1.0], "N")
    assert state == "crosses" and value == pytest.approx(2000)
    value, _ = crossing([1000, 4000], [2.0, 0.5], [1.0, 1.0], "N")
    assert value == pytest.approx(2000)  # log-log midpoint
    assert crossing([1, 2], [0.5, 0.5], [1, 1], "N") == (None, "always")
    assert crossing([1, 2], [2, 2], [1, 1], "keep") == (None, "never")
    value, state = crossing([0.1, 0.2, 0.4], [0.5, 1.0, 2.0], [1, 1, 1], "keep")
    assert state == "crosses" and value == pytest.approx(0.2)


def test_a_wider_window_crosses_later():
    grid = (2048, 3072, 4096, 6144, 8192, 16384, 32768)
    values = [R.crossover("window", grid=grid, window=w).value for w in (2048, 4096, 8192)]
    assert all(v is not None for v in values), values
    assert values == sorted(values) and len(set(values)) == 3
    x = R.crossover("block_random", grid=(0.1, 0.3, 0.6, 1.0), N=4096)
    assert x.ours_ms == sorted(x.ours_ms) and x.envelope == "dense"
    d = R.crossover("decode", grid=(0.05, 0.2, 1.0))
    assert d.ours_ms == sorted(d.ours_ms) and d.flex_ms == [None] * 3


def test_envelope_of_a_layout():
    assert envelope_of(LAYOUTS["sinks_window"]()) == "causal"
    assert envelope_of(LAYOUTS["documents"]()) == "causal"
    assert envelope_of(LAYOUTS["block_random_compiled"]()) == "dense"
    assert envelope_of(BlockLayout.from_mask_mod(P.full(), 128, 128, 64, 64, device="cpu")) == "dense"


def test_report_without_a_gpu():
    fp32 = R.report(P.sliding_window(1024), Shape(B=1, Hq=16, D=128, dtype=torch.float32), N=8192)
    assert fp32.verdict.startswith("float32: PyTorch has no cuDNN attention in float32")
    r = R.report(P.sliding_window(1024), N=8192)
    assert not r.verdict.startswith("float32")
    assert set(r.predicted) == {"sparseattn", "flex", "cudnn"} and r.envelope == "causal"
    assert all(v is None for v in r.measured.values())
    ratio = r.predicted["cudnn"] / r.predicted["sparseattn"]
    assert r.verdict.startswith("sparse is faster here") == (ratio > 1.25)
    assert "sparseattn" in str(r) and "verdict" in str(r)
    d = R.report(None, pass_="decode", keep=0.1)
    assert d.predicted["flex"] is None and d.predicted["sparseattn"] < d.predicted["cudnn"]
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            R.report(P.causal(), N=1024, measure=True)


# ---- profiling ------------------------------------------------------------------------------------------------------
def test_buckets_by_kernel_name():
    assert bucket_of("sparse_fwd_kernel") == "kernel"
    assert bucket_of("dkdv_kernel_0d1d2d") == "kernel"
    assert bucket_of("topk_pages_kernel") == "route"
    assert bucket_of("void at::native::vectorized_elementwise_kernel<4>") == "index"
    assert bucket_of("my_router", route=[r"my_router"]) == "route"
    assert busy_ms([(0, 2), (1, 3), (5, 6)]) == 4
    p = _split([("sparse_fwd_kernel", 1.0, 3.0), ("sort", 0.0, 1.5), ("page_bound_kernel", 4.0, 4.5)], wall_ms=10.0)
    assert p.buckets == {"route": 0.5, "index": 1.5, "kernel": 2.0, "launch": 10.0 - 3.5}


def test_profile_step_on_cpu():
    x = torch.randn(256, 256)
    p = R.profile_step(lambda: (x @ x).relu().sum())
    assert p.wall_ms > 0 and p.buckets["kernel"] == 0 and p.buckets["route"] == 0
    assert p.buckets["index"] > 0 and p.device_busy_ms <= p.wall_ms + 1e-6
    assert p.buckets["launch"] == pytest.approx(p.wall_ms - p.device_busy_ms)
    assert "step:" in str(p)


def test_roofline_imports_no_plotting_and_touches_no_gpu():
    import subprocess
    code = ("import sys, sparseattn.roofline as R, sparseattn.roofline.calibrate as C; "
            "R.cost(C.RECORDED_PATTERNS['causal'](1024), "
            "{'Hq': 2}); bad = [m for m in sys.modules if m.split('.')[0] in ('plotly', 'ipywidgets')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_docstring_failure_notes_follow_the_data():
    """The numbers the package docstring gives for the failing points, recomputed from the bench files."""
    def rows(name):
        return json.loads((C.BENCH_DIR / name).read_text())["results"]
    bwd_rows = {(r["impl"], r["case"]["pattern"]): r for r in rows("backward-h200.json") if r["pass"] == "bwd"}
    over_window = {i: bwd_rows[(i, "sinks64+window1024")]["ms"] / bwd_rows[(i, "window1024")]["ms"]
                   for i in ("flex", "sparseattn")}
    tiles = bwd_rows[("sparseattn", "sinks64+window1024")]["case"]["tiles"] / \
        bwd_rows[("sparseattn", "window1024")]["case"]["tiles"]
    doc = " ".join(R.__doc__.split())
    assert f"took {over_window['flex']:.2f}x its window time on ``sinks64+window1024`` (ours " \
           f"{over_window['sparseattn']:.2f}x) with {round(100 * (tiles - 1))}% more tiles" in doc
    rec = json.loads(C.record_path("h200").read_text())
    ratio = {r["label"]: r["ratio"] for r in rec["calibration"]["points"]}
    assert f"predicts Flex {ratio['flex bwd sinks64+window1024 N=32768']:.2f}x of what it took" in doc
    assert f"``window333``, predicted {ratio['sparseattn-atomic bwd window333 N=32768']:.1f}x what it took" in doc
    assert f"the deterministic path there: {ratio['sparseattn bwd window333 N=32768']:.2f}x, inside" in doc
    fwd = rec["model"]["sparseattn/fwd"]["params"]
    assert f"it put {fwd['partial_overhead']:.2f} tile-equivalents on each partial tile and none on a program" in doc
    assert fwd["program_overhead"] == 0.0
    xo = rows("crossover-h200.json")
    at = {(r["impl"], r["pass"], r["case"]["pattern"], r["case"]["N"]): (i, r) for i, r in enumerate(xo)
          if r["case"].get("family")}
    host = json.loads((C.BENCH_DIR / "crossover-h200.json").read_text())["parts"]["fwd"]["host_ms"]
    flush = H.flush_ms(Ceilings.from_json(rec["ceilings"]))
    cudnn_1k = next(r for r in xo if r["impl"] == "cudnn" and r["pass"] == "fwd" and r["case"]["N"] == 1024)
    assert f"{cudnn_1k['ms']:.3f} ms eager, its probe\n  {host['cudnn/fwd']:.3f} ms of host per call, the " \
           f"flush {flush:.3f} ms" in R.__doc__
    assert host["cudnn/fwd"] < flush + cudnn_1k["device_ms"]  # priced at its device time by the flush rule
    _, r = at[("sparseattn", "fwd", "documents16&causal", 2048)]
    assert f"took {r['ms']:.3f} ms eager, its device time, and was priced at the probe's " \
           f"{host['sparseattn/fwd']:.3f} ms" in R.__doc__
    edge = flush + r["device_predicted_ms"]
    assert f"predicted kernels ({edge:.3f} ms)" in R.__doc__
    assert edge < host["sparseattn/fwd"] and abs(r["ms"] / r["device_ms"] - 1) < 0.05
    bwd = [at[("sparseattn", "bwd", "window2048", n)][1] for n in (1024, 1536, 2048)]
    eager = [r["ms"] for r in bwd]
    over = [r["ms"] / r["device_ms"] for r in bwd]
    assert f"N = 1k-2k ({min(eager):.2f}-{max(eager):.2f} ms) are {min(over):.1f}-{max(over):.1f}x its device times" \
        in R.__doc__
    keep = rows("decode_keep-h200.json")
    low = [r["ms"] * 1e3 for r in keep if r["pass"] == "decode (CUDA graph)" and r["case"]["B"] == 1
           and r["case"].get("keep", 1) <= 0.05]
    assert f"(CUDA graph): {min(low):.0f}-{max(low):.0f} us" in R.__doc__
    assert f"replay ({rec['model']['sparseattn/decode']['params']['call_ms'] * 1e3:.0f} us)" in R.__doc__
    graph = {(r["case"]["B"], r["case"].get("keep")): r["ms"] for r in keep if r["pass"] == "decode (CUDA graph)"}
    host_bound = [r["ms"] * 1e3 for r in keep if r["pass"] == "decode"
                  and r["ms"] > 1.5 * graph[(r["case"]["B"], r["case"]["keep"])]]
    assert f"each call in {min(host_bound):.0f}-{max(host_bound):.0f} us" in R.__doc__
    builds = {n: [r["ms"] for r in rows("layout-h200.json") if r["impl"] == "sparseattn" and r["pass"] == "layout"
                  and r["case"]["N"] == n] for n in (32768, 131072)}  # the fit's run
    fixed = rec["model"]["index/layout"]["params"]["fixed_ms"]
    assert f"fitted at 32k ({fixed:.2f} ms; the seven builds\n  there took {min(builds[32768]):.2f}-" \
           f"{max(builds[32768]):.2f} ms)" in R.__doc__
    big = builds[131072]
    assert f"took {min(big) / fixed:.2f}-{max(big) / fixed:.2f}x of it ({min(big):.2f}-{max(big):.2f} ms)" \
        in " ".join(R.__doc__.split())


def test_measure_paths_run_on_cpu_with_a_mock_timer():
    """The GPU measurement code, walked on the CPU: our op in the interpreter, cuDNN refused (None)."""
    from sparseattn.roofline.measure import measure_decode, measure_prefill
    calls = []

    def timer(fn):
        fn()
        calls.append(fn)
        return 1.0

    layout = BlockLayout.from_mask_mod(P.causal(), 64, 64, 32, 32, device="cpu")
    s = Shape(B=1, Hq=2, Hkv=1, D=16, dtype=torch.float32)
    for pass_ in ("fwd", "bwd"):
        got = measure_prefill(layout, s, pass_, "causal", device="cpu", timer=timer, impls=("sparseattn", "cudnn"))
        assert got["sparseattn"] == 1.0 and (got["cudnn"] is None or torch.cuda.is_available())
    got = measure_decode(Shape(B=1, Hq=2, Hkv=1, D=16, dtype=torch.float32, seq_len=64, page_size=16), 0.5,
                         device="cpu", timer=timer, graph=False)
    assert got["sparseattn"] == 1.0
    assert len(calls) == 3


def test_gpu_check_walks_on_cpu(tmp_path):
    """``python -m sparseattn.roofline check`` minus the GPU: predictions, measurements (interpreter, mock
    timer), the JSON it writes after every case."""
    from sparseattn.roofline.__main__ import main, run_check
    if not torch.cuda.is_available():
        assert main(["check", "--out", str(tmp_path)]) == 2
    doc = run_check(tmp_path, [64], ["causal", "random10%+diag"], R.ceilings(), device="cpu", timer=lambda fn: 1.0,
                    impls=("sparseattn", "cudnn"), prefill_shape=Shape(B=1, Hq=2, D=16, dtype=torch.float32),
                    decode_shape=Shape(B=1, Hq=2, Hkv=1, D=16, dtype=torch.float32, seq_len=64, page_size=16),
                    keeps=(0.5,), profiles=False)
    saved = json.loads((tmp_path / "roofline-check-h200.json").read_text())
    assert saved["results"] == doc["results"] and len(doc["results"]) == 2 * 2 * 2 + 2
    ours = [r for r in doc["results"] if r["impl"] == "sparseattn"]
    assert all(r["ms"] == 1.0 and r["predicted_ms"] > 0 for r in ours)
    assert {r["case"]["pattern"] for r in doc["results"] if r["impl"] == "cudnn"} >= {"causal", "dense"}


# ---- the crossover sweep as evaluation points -------------------------------------------------------------------
def _crossover_rows():
    """A few rows shaped like the crossover suite's (as it writes them), with made-up times."""
    from sparseattn.roofline.crossover import family_layout
    base = {"B": 1, "H": 16, "D": 128, "dtype": "bf16"}
    rows = []
    for fam, x, N, params in (("window", 2048, 2048, {"window": 2048}), ("block_random", 0.2, 4096, {}),
                              ("documents", 0.25, 4096, {})):
        lay = family_layout(fam, x, N=N, **params)[0]
        case = {**base, "N": N, "family": fam, "pattern": f"{fam}-point", **params, "envelope": "causal",
                "tiles": int(lay.kv_count.sum() + lay.full_count.sum())}
        if fam != "window":
            case["keep"] = x
        rows.append({"case": case, "impl": "sparseattn", "pass": "fwd", "ms": 0.1, "predicted_ms": 0.1})
    rows.append({"case": {**base, "N": 4096, "pattern": "causal", "envelope": "causal"}, "impl": "cudnn",
                 "pass": "fwd", "ms": 0.15})  # the layout and shape of a calibration point: a repeat
    lay = family_layout("documents", 1.0, N=4096)[0]  # one document: the causal layout under another name
    rows.append({"case": {**base, "N": 4096, "family": "documents", "pattern": "documents1&causal", "keep": 1.0,
                          "envelope": "causal", "tiles": int(lay.kv_count.sum() + lay.full_count.sum())},
                 "impl": "sparseattn", "pass": "fwd", "ms": 0.25})
    rows.append({"case": {**base, "N": 2048, "pattern": "causal", "envelope": "causal"}, "impl": "cudnn",
                 "pass": "fwd", "ms": 0.15})
    dec = {"family": "decode", "N": 16384, "B": 16, "Hq": 32, "Hkv": 8, "D": 128, "dtype": "bf16", "page_size": 16}
    rows.append({"case": {**dec, "pattern": "keep0.10", "keep": 0.1}, "impl": "sparseattn",
                 "pass": "decode (CUDA graph)", "ms": 0.05, "bytes": 16 * round(0.1 * 1024) * 16 * 8 * 128 * 4})
    rows.append({"case": {**dec, "pattern": "route_top3", "family": "routing"}, "impl": "sparseattn", "pass": "fwd",
                 "ms": 0.1})  # a routed layout: not rebuilt, not evaluated
    return rows


def test_crossover_file_is_evaluated_never_fitted(tmp_path):
    import shutil
    for name in C.FILES + C.HOST_DEVICE_FILES:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(C.BENCH_DIR / name, tmp_path / name)
    without = C.load_points(tmp_path)
    (tmp_path / "crossover-h200.json").write_text(json.dumps({"suite": "crossover", "device": "NVIDIA H200",
                                                              "date": "2026-12-01", "torch": "2.11", "triton": "3.6",
                                                              "results": _crossover_rows()}))
    points = C.load_points(tmp_path)
    extra = [p for p in points if p.id.startswith("crossover")]
    # the fit's points unchanged, except a short-end device point whose call the sweep now measures too
    changed = [(a.id, a.role, b.role) for a, b in zip(points, without) if a.role != b.role]
    assert changed and all(i.startswith(C.HOST_DEVICE_PREFIX) and (x, y) == ("repeat", "calibration")
                           for i, x, y in changed)
    sweep = C.sweep_fingerprints(points)
    assert all(R.host.fingerprint(C._layout(p.pattern, p.N), p.case) in sweep
               for p in points if p.id in {i for i, _, _ in changed})
    assert [p.role for p in extra] == ["evaluation"] * 3 + ["repeat", "repeat", "evaluation", "evaluation"]
    assert all(p.label().endswith("(crossover)") for p in extra)
    rec = json.loads(C.record_path("h200").read_text())
    rows = C.evaluate(extra, rec["model"], R.Ceilings.from_json(rec["ceilings"]))  # layouts rebuilt, tiles checked
    acc = C.accuracy([dict(r) for r in rows])
    assert acc["crossover sweep (all)"]["n"] == 5  # the repeat is left out
    cls = acc["classes"]
    assert cls["crossover sweep: ours, eager"]["n"] == 3 and cls["crossover sweep: ours, device"]["n"] == 1  # decode
    assert cls["crossover sweep: Flex, cuDNN, eager"]["n"] == 1
    assert cls["crossover sweep: Flex, cuDNN, device"]["n"] == 0
    assert acc["crossover sweep: eager (all)"]["n"] == 4 and acc["crossover sweep: device (all)"]["n"] == 1
    assert acc["classes"]["prefill (fwd + bwd, ours)"]["n"] == 0
    bad = json.loads((tmp_path / "crossover-h200.json").read_text())
    bad["results"][0]["case"]["tiles"] += 1
    (tmp_path / "crossover-h200.json").write_text(json.dumps(bad))
    with pytest.raises(AssertionError, match="tiles"):
        C.evaluate([p for p in C.load_points(tmp_path) if p.id.startswith("crossover")][:1], rec["model"],
                   R.Ceilings.from_json(rec["ceilings"]))


def test_sync_docstring_rewrites_only_the_tables(tmp_path):
    import sparseattn.roofline as pkg
    acc = json.loads(C.record_path("h200").read_text())["calibration"]["accuracy"]
    copy = tmp_path / "__init__.py"
    copy.write_text(open(pkg.__file__).read())
    assert not C.sync_docstring(acc, copy)  # the packaged docstring quotes the packaged record
    changed = json.loads(json.dumps(acc))
    changed["outside_25pct"] = changed["outside_25pct"][:2] + [dict(changed["outside_25pct"][0], label=f"p{i}")
                                                               for i in range(40)]
    changed["classes"]["decode (cuDNN)"]["median"] = 1.5
    assert C.sync_docstring(changed, copy)
    text = copy.read_text()
    assert textwrap.indent(C.summary_table(changed), "    ") in text and "1.50" in text
    assert "... and 17 more (python -m sparseattn.roofline accuracy)" in text
    before, after = open(pkg.__file__).read(), text
    head = before.index("Predicted / measured on the evaluation points::")
    assert before[:head] == after[:head]  # nothing before the tables moved
    assert before[before.index("Why those fail:"):] == after[after.index("Why those fail:"):]


def test_report_is_the_one_call_answer():
    r = R.report("sinks64+window1024", N=16384)
    assert r.envelope == "causal" and r.source == "predicted"
    assert r.speedup == pytest.approx(r.predicted["cudnn"] / r.predicted["sparseattn"]) and r.faster == (r.speedup > 1)
    assert f"{r.speedup:.2f}x over causal cuDNN" in r.verdict and r.tie == (1 / 1.25 <= r.speedup <= 1.25)
    assert f"FlexAttention {r.predicted['cudnn'] / r.predicted['flex']:.2f}x" in r.verdict
    same = R.report(C.RECORDED_PATTERNS["sinks64+window1024"](16384))
    assert same.predicted == r.predicted  # a name, the layout it names: the same answer
    rows = {x["impl"]: x for x in r.rows()}
    assert rows["sparseattn"]["compute_ms"] == r.costs["sparseattn"].t_compute_ms
    assert "<table>" in r._repr_html_() and json.dumps(r.as_dict())
    slow = R.report(P.causal(), N=1024, pass_="bwd", rebuild_layout=True, routing=0.5)
    assert slow.predicted["sparseattn"] == pytest.approx(
        R.cost(C.RECORDED_PATTERNS["causal"](1024), {"B": 1, "Hq": 16, "D": 128}, "bwd",
               routing=0.5, rebuild_layout=True).predicted_ms)
    assert not slow.faster and slow.verdict.startswith("dense is faster here")
    for bad, match in ((dict(pattern_or_layout="window 1024", N=1024), "pattern name"),
                       (dict(pattern_or_layout="causal"), "needs N"),
                       (dict(pattern_or_layout=P.causal(), N=0), "N"),
                       (dict(pattern_or_layout=P.causal(), N=1024, pass_="backward"), "pass_")):
        with pytest.raises(ValueError, match=match):
            R.report(**bad)
    with pytest.raises(TypeError, match="pattern_or_layout"):
        R.report(3.0, N=1024)


def test_recorded_envelopes_follow_the_layouts():
    from sparseattn.roofline.cases import ENVELOPES, dense_pattern_of
    for pattern in ENVELOPES:
        assert dense_pattern_of(pattern) == envelope_of(C.RECORDED_PATTERNS[pattern](1024)), pattern
    with pytest.raises(ValueError, match="pattern"):
        dense_pattern_of("window2048")


def test_load_points_from_documents_as_a_notebook_passes_them():
    from sparseattn.bench.record import load
    docs = {f: load(f.rsplit("-", 1)[0]).to_json() for f in C.READ_FILES}
    assert [(p.id, p.role) for p in C.load_points(docs=docs)] == [(p.id, p.role) for p in C.load_points()]
    with pytest.raises(FileNotFoundError, match="prefill-h200.json"):
        C.load_points(docs={k: v for k, v in docs.items() if k != "prefill-h200.json"})


def test_report_calls_a_tie_within_the_models_error():
    """A predicted ratio within +-25% of 1 is a tie, not a win (the model's error is of that order); a measured
    ratio decides alone; the band's edges and bad input."""
    from sparseattn.roofline.crossover import TIE_BAND, verdict_of
    assert TIE_BAND == 1.25
    for ratio in (1.0, 1.002, 0.81, 1.24, 1 / 1.25, 1.25):
        v = verdict_of(ratio, "predicted", "causal")
        assert v.startswith("tie (within the model's error") and f"{ratio:.2f}x" in v, v
    assert verdict_of(1.26, "predicted", "causal").startswith("sparse is faster here (predicted 1.26x")
    assert verdict_of(0.79, "predicted", "dense").startswith("dense is faster here (dense cuDNN predicted 1.27x")
    assert verdict_of(1.002, "measured", "causal").startswith("sparse is faster here (measured 1.00x")
    assert verdict_of(0.99, "measured", "causal").startswith("dense is faster here")
    with pytest.raises(ValueError, match="source"):
        verdict_of(1.0, "guessed", "causal")
    with pytest.raises(ValueError, match="ratio"):
        verdict_of(0.0, "predicted", "causal")
    # the report's own verdict follows the band: chapter 1's example, both passes
    for pass_ in ("fwd", "bwd"):
        r = R.report("sinks64+window1024", N=4096, pass_=pass_)
        assert r.tie == (1 / 1.25 <= r.speedup <= 1.25)
        assert r.verdict.startswith("tie (within the model's error") == r.tie
    far = R.report(P.causal(), N=1024, pass_="bwd", rebuild_layout=True, routing=0.5)
    assert not far.tie and far.verdict.startswith("dense is faster here")
