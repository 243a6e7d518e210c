"""The benchmark package on the CPU: typed records and the loader over every recorded file, the CLI without
a GPU or plotly, output file names, the tuned-defaults writer, and every suite's code path run through the
Triton interpreter at tiny shapes with the GPU-only pieces (CUDA-event timers, CUDA graphs, compiled
FlexAttention, SDPA backend forcing) replaced by stand-ins."""
import argparse
import contextlib
import itertools
import json
import math
import pathlib
import sys
import types

import pytest
import torch

from sparseattn import BwdConfig
from sparseattn.bench import _common as C
from sparseattn.bench.record import BenchFile, Impl, Pass, Record, bench_filename, load, load_path

ROOT = pathlib.Path(__file__).resolve().parent.parent
#: recorded runs (a sweep's ``*-defaults-*`` file holds tuned-config rows, not results)
RECORDED = sorted(p for p in (ROOT / "book" / "data" / "bench").rglob("*.json") if "-defaults-" not in p.name)
ENV = {"date": "2026-01-01T00:00:00+00:00", "torch": "2.11.0", "triton": "3.6.0", "device": "NVIDIA H200"}


# ---------------------------------------------------------------------------------------------------------
# records and the loader
# ---------------------------------------------------------------------------------------------------------
def test_there_are_recorded_files():
    assert len(RECORDED) >= 5


@pytest.mark.parametrize("path", RECORDED, ids=lambda p: p.relative_to(ROOT / "book" / "data" / "bench").as_posix())
def test_recorded_file_loads_and_round_trips(path):
    doc = json.loads(path.read_text())
    bf = load_path(path)
    assert len(bf.records) == len(doc["results"]) > 0
    assert bf.to_json() == doc  # every row, every extra field, the meta block
    for row, rec in zip(doc["results"], bf.records):
        assert rec.to_json() == row
        assert list(rec.to_json())[:4] == ["case", "impl", "pass", "ms"]
        assert rec.impl in Impl.ALL and rec.pass_ in Pass.ALL


def test_load_by_suite_name_and_sweep_variant():
    assert load("prefill").suite == "prefill"
    assert any(r.is_sweep for r in load("prefill", sweep=True).records)
    assert not any(r.is_sweep for r in load("prefill").records)
    with pytest.raises(FileNotFoundError):
        load("prefill", gpu="no-such-gpu")


@pytest.mark.parametrize("field,value", [("impl", "sparse-attn"), ("impl", "FLEX"), ("pass_", "forward"),
                                         ("pass_", None)])
def test_unknown_names_raise(field, value):
    kw = dict(case={"N": 1}, impl=Impl.OURS, pass_=Pass.FWD, ms=1.0)
    kw[field] = value
    with pytest.raises(ValueError, match=field):
        Record(**kw)


def test_record_checks_its_fields():
    with pytest.raises(ValueError, match="row keys"):
        Record({}, Impl.OURS, Pass.FWD, 1.0, {"ms": 2.0})
    with pytest.raises(TypeError, match="ms"):
        Record({}, Impl.OURS, Pass.FWD, "1.0")
    with pytest.raises(TypeError, match="ms"):
        Record({}, Impl.OURS, Pass.FWD, True)
    with pytest.raises(ValueError, match="finite"):
        Record({}, Impl.OURS, Pass.FWD, float("nan"))
    with pytest.raises(TypeError, match="case"):
        Record([("N", 1)], Impl.OURS, Pass.FWD, 1.0)
    with pytest.raises(ValueError, match="impl"):
        Record.from_json({"case": {}, "impl": "renamed", "pass": "fwd", "ms": 1.0})
    with pytest.raises(ValueError, match="missing"):
        Record.from_json({"case": {}, "impl": "flex", "ms": 1.0})
    case = {"N": 4}
    r = Record(case, Impl.FLEX, Pass.FWD, None, {"error": "out of memory"})
    case["N"] = 5  # the record keeps its own copy
    assert r.case == {"N": 4} and r.ms is None and r.get("error") == "out of memory"


def _file(rows):
    return BenchFile.from_json({"suite": "prefill", **ENV, "results": rows})


def _row(impl, pattern, N, ms, pass_="fwd", **extra):
    return {"case": {"pattern": pattern, "N": N}, "impl": impl, "pass": pass_, "ms": ms, **extra}


def test_select_one_and_ms():
    bf = _file([_row("sparseattn", "causal", 1024, 1.0), _row("flex", "causal", 1024, 2.0),
                _row("sparseattn", "causal", 2048, 3.0), _row("sparseattn", "causal", 2048, 2.5, sweep=True,
                                                             config={"block_m": 64})])
    assert [r.ms for r in bf.select(Impl.OURS, Pass.FWD, pattern="causal")] == [1.0, 3.0]
    assert [r.ms for r in bf.select(Impl.OURS, Pass.FWD, sweep=True)] == [2.5]
    assert len(bf.select(Impl.OURS, sweep=None)) == 3
    assert [r.ms for r in bf.select([Impl.OURS, Impl.FLEX], N=1024)] == [1.0, 2.0]
    assert bf.ms(Impl.FLEX, Pass.FWD, N=1024) == 2.0
    assert bf.distinct("N") == [1024, 2048]
    with pytest.raises(LookupError, match="expected exactly one"):
        bf.ms(Impl.OURS, Pass.FWD, pattern="causal")  # two lengths
    with pytest.raises(LookupError, match="0 records"):
        bf.ms(Impl.CUDNN, Pass.FWD, N=1024)  # a series the file does not have
    with pytest.raises(ValueError, match="impl"):
        bf.select("sparseattn-v2")  # a renamed series fails, it does not come back empty
    with pytest.raises(ValueError, match="case field"):
        bf.select(Impl.OURS, patern="causal")  # a typo in a case field too
    assert bf.caption() == "measured on NVIDIA H200, 2026-01-01, torch 2.11.0, triton 3.6.0"


def test_book_loader_is_the_record_loader():
    pytest.importorskip("plotly")
    from sparseattn import book
    bf = book.load_bench("decode_keep")
    assert isinstance(bf, BenchFile) and bf.suite == "decode_keep"
    assert book.caption(bf) == bf.caption()


# ---------------------------------------------------------------------------------------------------------
# the CLI and the output files
# ---------------------------------------------------------------------------------------------------------
def test_help_works_without_gpu_plotly_or_triton():
    from conftest import run_fresh_python
    code = ("import sys\n"
            "from sparseattn.bench.__main__ import main, suite_module, SUITES\n"
            "for s in SUITES: suite_module(s)\n"
            "try:\n    main(['--help'])\nexcept SystemExit as e:\n    assert e.code == 0, e.code\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in ('plotly', 'ipywidgets', 'triton')]\n"
            "assert not bad, bad\n"
            "import torch; assert not torch.cuda.is_initialized()\n")
    run_fresh_python(code)
    import subprocess
    out = subprocess.run([sys.executable, "-m", "sparseattn.bench", "--help"], capture_output=True, text=True,
                         check=True, cwd=ROOT).stdout
    assert "decode_keep" in out and "--sweep" in out


def test_main_without_gpu_returns_2(monkeypatch, capsys):
    from sparseattn.bench.__main__ import main
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["prefill"]) == 2
    assert "CUDA" in capsys.readouterr().err


def test_sweep_only_for_suites_with_configs():
    from sparseattn.bench.__main__ import main
    with pytest.raises(SystemExit) as e:
        main(["layout", "--sweep"])
    assert e.value.code == 2


def test_sweep_shapes_option():
    """``--sweep-shapes``: HxD pairs for ``backward --sweep`` only; one shape gets the whole budget."""
    from sparseattn.bench import backward as BW
    from sparseattn.bench.__main__ import main
    assert BW.parse_sweep_shapes("16x128, 32X64") == ((16, 128), (32, 64))
    assert BW.parse_sweep_shapes(None) == BW.SWEEP_SHAPES
    for bad in ("16x", "x128", "16*128", "0x128", ""):
        with pytest.raises(ValueError, match="sweep-shapes"):
            BW.parse_sweep_shapes(bad)
    assert BW.shape_shares(1) == (1.0,) and BW.shape_shares(2) == BW.SHAPE_SHARE
    assert BW.shape_shares(3)[-1] == 1.0
    for argv in (["backward", "--sweep-shapes", "16x128"], ["prefill", "--sweep", "--sweep-shapes", "16x128"],
                 ["backward", "--sweep", "--sweep-shapes", "16by128"]):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2


def test_gpu_slug():
    assert C.gpu_slug("NVIDIA H200") == "h200"
    assert C.gpu_slug("NVIDIA GeForce RTX 4090") == "rtx-4090"
    assert C.gpu_slug("Tesla T4") == "t4"


def _sweep_records():
    """Two cases of a forward sweep: config A wins case 1 by 5% and loses case 2 by 2x; B is 10% off the best
    on case 1 only. B has the smaller geometric mean; a failed row (ms None) is ignored."""
    a = dict(block_m=128, block_n=128, num_warps=8, num_stages=3, tma=None, warp_specialize=False)
    b = dict(a, num_warps=4)
    recs = []
    for pattern, ms_a, ms_b in (("causal", 1.0, 1.05), ("window1024", 2.0, 1.0)):
        case = {"pattern": pattern, "N": 1024, "B": 1, "H": 2, "D": 64, "dtype": "bf16"}
        recs.append(Record(case, Impl.OURS, Pass.FWD, ms_a * 1.1, {}))  # the default-config row, not swept
        recs.append(Record(case, Impl.OURS, Pass.FWD, ms_a, {"config": a, "sweep": True}))
        recs.append(Record(case, Impl.OURS, Pass.FWD, ms_b, {"config": b, "sweep": True}))
    recs.append(Record(recs[0].case, Impl.OURS, Pass.FWD, None, {"config": dict(a, num_stages=9), "sweep": True,
                                                                 "error": "out of shared memory"}))
    return recs, a, b


def test_sweep_writes_sweep_and_defaults_files_not_the_suite_file(tmp_path):
    from sparseattn.bench import prefill
    from sparseattn.bench.__main__ import write_outputs
    recs, _, _ = _sweep_records()
    paths = write_outputs(prefill, recs, str(tmp_path), ENV, sweep=True, family="sm90")
    assert [pathlib.Path(p).name for p in paths] == ["prefill-sweep-h200.json", "prefill-defaults-h200.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefill-defaults-h200.json", "prefill-sweep-h200.json"]
    assert load("prefill", "h200", sweep=True, directory=tmp_path).to_json()["results"] == [r.to_json() for r in recs]
    paths = write_outputs(prefill, recs[:1], str(tmp_path), ENV, sweep=False, family="sm90")
    assert pathlib.Path(paths[0]).name == bench_filename("prefill", "h200") == "prefill-h200.json"
    assert load("prefill", "h200", directory=tmp_path).records == (recs[0],)


@pytest.fixture
def table_file(monkeypatch):
    """Point sparseattn.ops.config at another defaults table for one test, then restore its caches."""
    from sparseattn.ops import config

    def use(path):
        monkeypatch.setattr(config, "_TABLE", pathlib.Path(path))
        config._table.cache_clear()
        config.default_config.cache_clear()
    yield use
    monkeypatch.undo()
    config._table.cache_clear()
    config.default_config.cache_clear()


def test_defaults_file_is_readable_as_the_tuned_table(tmp_path, table_file):
    from sparseattn.bench import prefill
    from sparseattn.bench.__main__ import write_outputs
    from sparseattn.ops import FwdConfig
    from sparseattn.ops.config import default_config
    recs, a, b = _sweep_records()
    path = write_outputs(prefill, recs, str(tmp_path), ENV, sweep=True, family="sm90")[1]
    doc = json.loads(pathlib.Path(path).read_text())
    assert doc["families"]["sm90"]["fwd"] == [{"dtypes": ["bfloat16"], "max_head_dim": 64, "config": b}]
    assert doc["evidence"][0]["cases"] == 2 and doc["evidence"][0]["worst_vs_case_best"] == pytest.approx(1.05)
    table_file(path)
    assert default_config("fwd", "sm90", torch.bfloat16, 64) == FwdConfig(**b)
    with pytest.raises(LookupError):
        default_config("fwd", "sm90", torch.float16, 64)  # only what was measured


def test_best_rows_per_dtype_and_head_dim_and_kind_checks():
    from sparseattn.bench.defaults import best_rows
    recs, a, b = _sweep_records()
    other = [Record(dict(r.case, D=128, dtype="fp16"), r.impl, r.pass_, r.ms, r.extra) for r in recs if r.ms]
    rows, _ = best_rows([r for r in recs + other if r.is_sweep], "fwd")
    assert [(r["dtypes"], r["max_head_dim"]) for r in rows] == [(["bfloat16"], 64), (["float16"], 128)]
    with pytest.raises(ValueError, match="kind"):
        best_rows(recs, "prefill")
    with pytest.raises(TypeError):
        best_rows([r for r in recs if r.is_sweep], "bwd")  # a forward config is not a BwdConfig


def test_progress_without_and_with_tqdm(monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "tqdm", None)  # import fails: plain lines on stderr
    with C.progress(2, "suite") as bar:
        bar.set_postfix_str("case a")
        bar.update()
    assert "suite: 1/2 case a" in capsys.readouterr().err
    seen = []

    class FakeTqdm:
        def __init__(self, total, desc, file, dynamic_ncols):
            seen.append((total, desc, file))

        def set_postfix_str(self, s):
            seen.append(s)

        def update(self, n=1):
            seen.append(n)

        def close(self):
            seen.append("closed")
    monkeypatch.setitem(sys.modules, "tqdm", types.SimpleNamespace(tqdm=FakeTqdm))
    with C.progress(3, "suite") as bar:
        bar.set_postfix_str("x")
        bar.update()
    assert seen == [(3, "suite", sys.stderr), "x", 1, "closed"]


def test_table_and_timers_on_cpu(capsys):
    C.print_table([{"a": 1, "b": "x"}, {"a": 22}], ["a", "b"])
    assert capsys.readouterr().out.splitlines() == [" a  b", " 1  x", "22   "]
    calls = []
    assert C.time_host(lambda: calls.append(1), repeat=3, warmup=1, device="cpu") >= 0 and len(calls) == 4
    calls.clear()
    assert C.time_loop(lambda: calls.append(1), max_calls=7, device="cpu") >= 0 and len(calls) == 3 + 1 + 7
    x = torch.arange(6, dtype=torch.bfloat16).view(2, 3)
    assert [float(s) for s in C.read_fn([x, x + 1])()] == [15.0, 21.0]


def test_stream_read_kernel_reads_every_element():
    """The read ceiling's kernel (interpreter): each tensor's partial sums add up to its sum, for sizes that
    are and are not a multiple of the block, and more programs than blocks; the best-of timer names the
    winner; a non-contiguous tensor or a bad block is refused."""
    from sparseattn._runtime import is_interpreter
    if not is_interpreter():
        pytest.skip("runs the Triton kernel on CPU tensors: needs TRITON_INTERPRET=1")
    x = torch.arange(1000, dtype=torch.bfloat16) % 7
    y = torch.ones(64, 3, dtype=torch.bfloat16)
    for block, per_sm in ((64, 4), (256, 1), (16, 2)):
        parts = C.read_fn([x, y], block=block, programs_per_sm=per_sm)()
        assert [float(p.sum()) for p in parts] == [float(x.float().sum()), 192.0]
    times = iter([3.0, 2.0, 5.0])
    ms, how = C.best_read([x], lambda fn: (fn(), next(times))[1], configs=((64, 4, 1), (128, 4, 1)))
    assert ms == 2.0 and how.startswith("stream_read_kernel, 64 elements")
    with pytest.raises(ValueError, match="tensors\\[0\\] must be contiguous"):
        C.read_fn([torch.ones(4, 4).t()], block=64)
    with pytest.raises(ValueError, match="block must be a positive power of two"):
        C.read_fn([x], block=48)


def test_cases_are_the_recorded_names():
    from sparseattn import patterns as P
    from sparseattn.bench import cases
    recorded = {r.case["pattern"] for r in load("prefill").records} - {"dense", "causal"}
    assert recorded <= set(cases.PREFILL_PATTERNS) | set(cases.MASKC_PATTERNS)
    assert {r.case["pattern"] for r in load("layout").records} == set(cases.LAYOUT_PATTERNS)
    lay = cases.prefill_layout("sinks64+window1024", 512, block=128, device="cpu")
    ref = P.sinks_window(64, 1024)
    from conftest import dense_of
    assert torch.equal(lay.to_dense(), dense_of(ref, 512, 512))
    for name in cases.LAYOUT_PATTERNS:
        mm = cases.layout_mask_mod(name, 256, device="cpu")
        assert mm(torch.tensor(0), torch.tensor(0), torch.arange(4)[:, None], torch.arange(4)[None]).shape == (4, 4)
    with pytest.raises(ValueError, match="pattern"):
        cases.prefill_layout("window 1024", 256, device="cpu")
    with pytest.raises(ValueError, match="pattern"):
        cases.layout_mask_mod("causal!", 256, device="cpu")


# ---------------------------------------------------------------------------------------------------------
# every suite's code path on the CPU (interpreter, tiny shapes, stand-ins for the GPU-only pieces)
# ---------------------------------------------------------------------------------------------------------
# eager FlexAttention says it is unfused; bf16 arithmetic in the interpreter overflows (numbers are not checked)
STAND_IN_WARNINGS = [pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
                     pytest.mark.filterwarnings("ignore:overflow encountered")]


@pytest.fixture
def cpu_stand_ins(monkeypatch):
    """Timers that call the function once and return a distinct number, graph capture that just calls,
    FlexAttention eager (SDPA where FlexAttention has no CPU backward), no SDPA backend forcing."""
    from torch.nn.attention.flex_attention import flex_attention
    counter = itertools.count(1)

    def fake_time(fn, *args, **kwargs):
        fn()
        return 1.0 + next(counter) / 64

    def fake_graph(fn, stream=None):
        fn()
        return types.SimpleNamespace(replay=fn)

    def fake_flex(q, k, v, block_mask=None, **kwargs):
        if q.requires_grad:
            return torch.nn.functional.scaled_dot_product_attention(q, k, v, **kwargs)
        return flex_attention(q, k, v, block_mask=block_mask, **kwargs)
    from sparseattn.roofline import timing
    for mod in (C, timing):  # the suites call C.*; the helpers re-exported from roofline.timing call timing.*
        monkeypatch.setattr(mod, "time_gpu", fake_time)
        monkeypatch.setattr(mod, "time_host", lambda fn, *a, **k: fake_time(fn))
        monkeypatch.setattr(mod, "time_loop", lambda fn, *a, **k: fake_time(fn))
        monkeypatch.setattr(mod, "graph_step", fake_graph)
        monkeypatch.setattr(mod, "compiled_flex", lambda: fake_flex)
        monkeypatch.setattr(mod, "sdpa_backend", lambda name: contextlib.nullcontext())
    return monkeypatch


def _args(**kw):
    base = dict(n="256", patterns=None, heads=1, head_dim=32, no_flex=False, sweep=False, naive_max_bytes=24e9,
                device="cpu")
    return argparse.Namespace(**{**base, **kw})


def _check_run(module, records, table, cols, *series):
    assert records and table and all(isinstance(r, Record) for r in records)
    assert all(set(row) <= set(cols) for row in table)
    bf = BenchFile.from_json({"suite": module.NAME, **ENV, "results": [r.to_json() for r in records]})
    have = {(r.impl, r.pass_) for r in bf.records}
    assert set(series) <= have, set(series) - have
    return bf


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_prefill_suite_on_cpu(cpu_stand_ins, tmp_path):
    from sparseattn.bench import prefill
    from sparseattn.bench.__main__ import write_outputs
    records, table, cols = prefill.run(_args(sweep=True))
    bf = _check_run(prefill, records, table, cols, (Impl.OURS, Pass.FWD), (Impl.FLEX, Pass.FWD),
                    (Impl.CUDNN, Pass.FWD), (Impl.FA2, Pass.FWD), (Impl.NAIVE, Pass.FWD), (Impl.OURS_BITS, Pass.FWD))
    for p in prefill.PREFILL_PATTERNS:  # what chapter 5 reads, by the names it asks for
        assert bf.ms(Impl.OURS, Pass.FWD, pattern=p, N=256) > 0
    for p in prefill.MASKC_PATTERNS:  # issue 13's rows: compiled mask_mod against per-tile bits, same output
        assert bf.one(Impl.OURS, Pass.FWD, pattern=p).get("mask_path").startswith("compiled: ")
        bits = bf.one(Impl.OURS_BITS, Pass.FWD, pattern=p)
        assert bits.get("mask_path") == "bits" and bits.get("max_abs_vs_ours") < 1e-2 and bits.get("bits_bytes") > 0
    assert len(prefill.sweep_rows(records)) == len(prefill.PREFILL_PATTERNS) * len(prefill.sweep_configs(32))
    write_outputs(prefill, records, str(tmp_path), ENV, sweep=True, family="sm90")
    rows = json.loads((tmp_path / "prefill-defaults-h200.json").read_text())["families"]["sm90"]["fwd"]
    assert rows[0]["max_head_dim"] == 32 and rows[0]["config"] in [C.config_dict(c) for c in prefill.sweep_configs(32)]


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_backward_suite_on_cpu(cpu_stand_ins):
    from sparseattn.bench import backward
    records, table, cols = backward.run(_args(patterns="causal,sinks64+window1024,stripes(plain lambda)"))
    bf = _check_run(backward, records, table, cols, (Impl.OURS, Pass.BWD), (Impl.OURS_ATOMIC, Pass.BWD),
                    (Impl.OURS_NOSPLIT, Pass.BWD), (Impl.FLEX, Pass.BWD), (Impl.CUDNN, Pass.BWD),
                    (Impl.OURS, Pass.FWD_BWD), (Impl.OURS_BITS, Pass.BWD))
    bits = bf.one(Impl.OURS_BITS, Pass.BWD, pattern="stripes(plain lambda)")
    assert bits.get("mask_path") == "bits" and bits.get("max_abs_vs_ours") < 5e-2
    assert bf.one(Impl.OURS, Pass.BWD, pattern="stripes(plain lambda)").get("mask_path").startswith("compiled: ")
    assert bf.one(Impl.OURS, Pass.BWD, pattern="causal").get("bitwise_repeatable") is True
    assert not backward.sweep_rows(records)


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_backward_per_pass_sweep_on_cpu(cpu_stand_ins, tmp_path):
    """``backward --sweep`` on the CPU: two paired configs (TMA on and off, each pass its own launch options)
    on two patterns, per-pass times from the launch timer, the best combination timed whole and written as
    tuned defaults; its table names each pass's best config."""
    from sparseattn.bench import backward
    from sparseattn.bench.__main__ import write_outputs
    dk = [dict(block_m=32, block_n=64, num_warps=4, num_stages=1)]
    dq = [dict(dq_block_m=64, dq_block_n=32, dq_num_warps=2, dq_num_stages=2)]
    cpu_stand_ins.setattr(backward, "pass_grid", lambda D: {True: (dk, dq), False: (dk, dq)})
    cpu_stand_ins.setattr(backward, "REPS", 1)
    args = _args(patterns="causal,documents64", sweep=True, budget_s=1e6, sweep_shapes=((1, 32),))
    records, table, cols = backward.run(args)
    assert cols == backward.SWEEP_COLUMNS and [r["pattern"] for r in table] == ["causal", "documents64"]
    bf = _check_run(backward, records, table, cols, (Impl.OURS, Pass.BWD_DKDV), (Impl.OURS, Pass.BWD_DQ),
                    (Impl.OURS, Pass.BWD), (Impl.FLEX, Pass.BWD))
    parts = bf.select(Impl.OURS, Pass.BWD_DKDV, sweep=True, pattern="causal")
    assert len(parts) == 2 and all(r.ms > 0 and r.get("stage_fallbacks") == [] for r in parts)
    assert {r.extra["config"]["tma"] for r in parts} == {True, False}
    assert all(r["best_dkdv"].startswith("32x64 w4 s1") and r["best_dq"].startswith("64x32 w2 s2") for r in table)
    combined = [r for r in backward.sweep_rows(records) if r.get("combined")]
    assert len(combined) == 2 and combined[0].extra["config"]["dq_num_warps"] == 2
    write_outputs(backward, records, str(tmp_path), ENV, sweep=True, family="sm90")
    rows = json.loads((tmp_path / "backward-defaults-h200.json").read_text())["families"]["sm90"]["bwd"]
    assert rows[0]["max_head_dim"] == 32 and BwdConfig(**rows[0]["config"])


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_layout_suite_on_cpu(cpu_stand_ins):
    from sparseattn.bench import layout_build
    cpu_stand_ins.setattr(layout_build, "FLEX_MASK_MODES", (False,))  # compiled: see the next test
    records, table, cols = layout_build.run(_args())
    bf = _check_run(layout_build, records, table, cols, (Impl.OURS, Pass.LAYOUT), (Impl.OURS, Pass.TRANSPOSE),
                    (Impl.FLEX, Pass.LAYOUT), (Impl.OURS_EAGER_MASK, Pass.LAYOUT))
    assert bf.distinct("pattern") == sorted(layout_build.LAYOUT_PATTERNS)
    for name in layout_build.EAGER_MASK_AB:  # the device path and the eager one list the same tiles
        assert bf.one(Impl.OURS_EAGER_MASK, Pass.LAYOUT, pattern=name).get("same_tiles_as_compiled") is True


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_decode_suite_on_cpu(cpu_stand_ins, tmp_path):
    from sparseattn.bench import decode
    from sparseattn.bench.__main__ import write_outputs
    cpu_stand_ins.setattr(decode, "HQ", 4)
    cpu_stand_ins.setattr(decode, "HKV", 2)
    cpu_stand_ins.setattr(decode, "CASES", [(1, 256, 16, None), (2, 256, 16, 0.25), (1, 256, 128, 0.5),
                                            (1, 512, 64, 0.5)])
    configs = list(decode.sweep_configs())
    cpu_stand_ins.setattr(decode, "sweep_configs", lambda: iter(configs[::9]))
    records, table, cols = decode.run(_args(n="", sweep=True))
    bf = _check_run(decode, records, table, cols, (Impl.OURS, Pass.DECODE), (Impl.CUDNN, Pass.DECODE_DENSE),
                    (Impl.FA2, Pass.DECODE_DENSE), (Impl.FLEX, Pass.DECODE_DENSE), (Impl.FLEX, Pass.DECODE_BLOCK_MASK),
                    (Impl.OURS, Pass.SELECT), (Impl.TORCH_EAGER, Pass.SELECT), (Impl.OURS, Pass.SELECT_DECODE),
                    (Impl.OURS, Pass.SELECT_DECODE_GRAPH), (Impl.OURS, Pass.SWEEP), (Impl.READ_CEILING, Pass.READ))
    full = 2 * 2 * 2 * 256 * 128 * 2  # B=2 sequences of 256 tokens, 2 KV heads, D=128, K and V, bf16
    assert bf.one(Impl.READ_CEILING, Pass.READ, B=2).get("bytes") == full
    assert bf.one(Impl.OURS, Pass.SELECT_DECODE_GRAPH, B=2).get("graph_equals_eager") is True
    assert "rel_err_vs_ours" in bf.one(Impl.FLEX, Pass.DECODE_BLOCK_MASK, page_size=128).extra
    assert len(decode.sweep_rows(records)) == 2 * len(configs[::9])  # the two page-size-16 cases
    paths = write_outputs(decode, records, str(tmp_path), ENV, sweep=True, family="sm90")
    rows = json.loads(pathlib.Path(paths[1]).read_text())["families"]["sm90"]["decode"]
    assert [(r["dtypes"], r["max_head_dim"]) for r in rows] == [(["bfloat16"], 128)]


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_decode_keep_suite_on_cpu(cpu_stand_ins):
    from sparseattn.bench import decode_keep
    cpu_stand_ins.setattr(decode_keep, "HQ", 4)
    cpu_stand_ins.setattr(decode_keep, "HKV", 2)
    cpu_stand_ins.setattr(decode_keep, "SHAPES", [(1, 256)])
    cpu_stand_ins.setattr(decode_keep, "KEEPS", [0.25, 1.0])
    records, table, cols = decode_keep.run(_args(n=""))
    bf = _check_run(decode_keep, records, table, cols, (Impl.OURS, Pass.DECODE), (Impl.OURS, Pass.DECODE_GRAPH),
                    (Impl.OURS, Pass.SELECT_DECODE_GRAPH), (Impl.CUDNN, Pass.DECODE_DENSE))
    # what chapter 7 reads: the dense lines and one point per kept fraction
    assert bf.ms(Impl.OURS, Pass.DECODE_GRAPH, B=1, pattern="dense") > 0
    assert [r.case["keep"] for r in bf.select(Impl.OURS, Pass.SELECT_DECODE_GRAPH, B=1)] == [0.25, 1.0]


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_host_suite_on_cpu(cpu_stand_ins):
    from sparseattn.bench import host
    cpu_stand_ins.setattr(host, "HOST_CALLS", 2)
    cpu_stand_ins.setattr(host, "PROFILE_N", 128)
    records, table, cols = host.run(_args(n="128", patterns="window1024,random10%+diag"))
    bf = _check_run(host, records, table, cols, *[(i, p) for i in (Impl.OURS, Impl.FLEX, Impl.CUDNN)
                                                  for p in (Pass.FWD, Pass.BWD)])
    assert len(table) == 4 and all(row["ours_host_us"] > 0 for row in table)
    ours = bf.one(Impl.OURS, Pass.BWD, pattern="window1024")
    assert ours.get("host_syncs") == "not checked" and ours.get("device_ms") > 0
    prof = ours.get("profile")
    assert 0 < len(prof) <= host.PROFILE_TOP and prof[0]["own_us"] >= prof[-1]["own_us"]
    assert all(r["function"].endswith(")") and ":" in r["function"] and r["calls"] > 0 for r in prof)
    assert bf.one(Impl.CUDNN, Pass.FWD, pattern="random10%+diag").get("envelope") == "dense"


def test_host_time_counts_calls_without_syncing(monkeypatch):
    from sparseattn.bench import host
    calls, syncs = [], []
    monkeypatch.setattr(C, "synchronize", lambda device: syncs.append(len(calls)))
    assert host.host_us(lambda: calls.append(1), "cpu", calls=10) > 0
    assert len(calls) == 11 and syncs == [1, 11]  # drained before the clock, once after; none in between
    from sparseattn._checks import check_int
    prof = host.host_profile(lambda: check_int("n", 3), "cpu", calls=5)
    assert any(r["function"].startswith("sparseattn/_checks.py:") for r in prof)  # paths shortened to the package


# ---------------------------------------------------------------------------------------------------------
# the book's side: figures read recorded files only through the loader
# ---------------------------------------------------------------------------------------------------------
def test_bench_imports_neither_viz_nor_book():
    import ast
    for path in (ROOT / "sparseattn" / "bench").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                names = [a.name for a in node.names] + ([node.module] if isinstance(node, ast.ImportFrom) and
                                                        node.module else [])
                assert not any(n and n.split(".")[0] in ("plotly", "ipywidgets") for n in names), path
                assert not any(n and ("viz" in n.split(".") or "book" in n.split(".")) for n in names), path


def test_recorded_figures_fail_loudly_on_a_missing_series():
    pytest.importorskip("plotly")
    from sparseattn.viz import ch05_prefill, ch06_backward, ch07_decode
    prefill = load("prefill")
    assert len(ch05_prefill.prefill_time_figure(prefill, "window1024").data) == 5  # ours, Flex, naive, cuDNN, FA2
    no_flex = BenchFile(prefill.meta, tuple(r for r in prefill.records if r.impl != Impl.FLEX))
    with pytest.raises(LookupError, match="flex"):
        ch05_prefill.prefill_table(no_flex)
    with pytest.raises(LookupError, match="sparseattn-atomic"):
        ch06_backward.backward_figure(BenchFile(load("backward").meta, tuple(
            r for r in load("backward").records if r.impl != Impl.OURS_ATOMIC)), prefill)
    decode = load("decode", sweep=True)  # the sweep run's own file
    assert len(ch07_decode.decode_sweep_figure(decode).data) > 0
    without_sweep = BenchFile(decode.meta, tuple(r for r in decode.records if r.pass_ != Pass.SWEEP))
    with pytest.raises(LookupError, match="sweep"):
        ch07_decode.decode_sweep_figure(without_sweep)


def test_wheel_ships_the_subpackages_and_the_tuned_table(tmp_path):
    """A non-editable install (Colab's ``pip install git+...``) gets bench/, viz/ and the defaults table."""
    pytest.importorskip("setuptools")
    import shutil
    import subprocess
    import zipfile
    src = tmp_path / "src"  # a copy, so the build leaves nothing in the checkout
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(".git", "_build", "_vendor", "*.egg-info", "build",
                                                             "__pycache__", ".pytest_cache", ".hypothesis"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w",
                    str(tmp_path / "dist"), str(src)], check=True, capture_output=True)
    names = zipfile.ZipFile(next((tmp_path / "dist").glob("*.whl"))).namelist()
    for want in ("sparseattn/data/tuned_configs.json", "sparseattn/bench/record.py", "sparseattn/bench/__main__.py",
                 "sparseattn/viz/ch07_decode.py", "sparseattn/ops/config.py", "sparseattn/kernels/_common.py"):
        assert want in names, want


def test_main_wiring_with_a_stand_in_suite(monkeypatch, tmp_path, capsys):
    """main() on a 'GPU': default lengths, the suite's records written where --out says, the table last."""
    from sparseattn.bench import __main__ as M
    from sparseattn.bench import prefill
    from sparseattn.ops import config
    recs, _, _ = _sweep_records()
    seen = {}

    def run(args):
        seen.update(n=args.n, device=args.device, sweep=args.sweep)
        return recs, [{"pattern": "causal", "N": 1024, "ours_ms": 1.0}], ["pattern", "N", "ours_ms"]
    fake = types.SimpleNamespace(NAME="prefill", DEFAULT_N=prefill.DEFAULT_N, CONFIG_KIND="fwd", run=run,
                                 sweep_rows=prefill.sweep_rows)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(M, "suite_module", lambda name: fake)
    monkeypatch.setattr(C, "environment", lambda: dict(ENV))
    monkeypatch.setattr(config, "gpu_family", lambda device, interpreter: "sm90")
    assert M.main(["prefill", "--out", str(tmp_path), "--sweep"]) == 0
    assert seen == {"n": prefill.DEFAULT_N, "device": "cuda", "sweep": True}
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-2:] == ["pattern     N  ours_ms", " causal  1024      1.0"]  # the table comes last
    assert f"wrote {tmp_path / 'prefill-defaults-h200.json'}" in out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prefill-defaults-h200.json", "prefill-sweep-h200.json"]


def test_environment_and_backend_context_on_cpu():
    env = C.environment()
    assert {"date", "torch", "triton", "python", "sparseattn", "device"} <= set(env)
    for name in ("cudnn", "fa2"):
        with C.sdpa_backend(name):
            pass
    with pytest.raises(KeyError):
        C.sdpa_backend("flash3")


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_layout_suite_measures_flex_eager_and_compiled(cpu_stand_ins):
    """Chapter 3's table shows create_block_mask both ways: one Flex row per mode, labelled, the compiled
    one really compiled (``_compile=True`` reaches torch.compile; one small pattern keeps it quick)."""
    from sparseattn.bench import layout_build
    from sparseattn.viz.ch03_layout import layout_build_table
    cpu_stand_ins.setattr(layout_build, "LAYOUT_PATTERNS", ["causal"])
    records, table, cols = layout_build.run(_args())
    flex = [r for r in records if r.impl == Impl.FLEX]
    assert [r.get("compiled") for r in flex] == [False, True]
    assert all(r.ms is not None and "_compile=" in r.get("call") for r in flex), [r.extra for r in flex]
    assert {"flex_eager_ms", "flex_compiled_ms"} <= set(table[0])
    bf = BenchFile.from_json({"suite": "layout", **ENV, "results": [r.to_json() for r in records]})
    row = layout_build_table(bf).rows[0]
    assert row[:2] == ["causal", 256] and all(c not in ("not measured", "failed") for c in row[2:])


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_routing_suite_on_cpu(cpu_stand_ins, tmp_path):
    from sparseattn.bench import routing as R
    for name, value in (("HQ", 2), ("HKV", 2), ("REUSE_HKV", 1), ("D", 16), ("DTYPE", torch.float32),
                        ("BLOCK", 16), ("TOPK", 1), ("TOPKS", [1, 2]), ("MAIN_N", 64), ("RECALL_ROWS", 16),
                        ("DRIFTS", [0.5])):
        cpu_stand_ins.setattr(R, name, value)
    cpu_stand_ins.setattr(R, "_compile", lambda fn: fn)
    records, table, cols = R.run(_args(n="64", out=str(tmp_path)))
    partial = load_path(tmp_path / "routing-partial-cpu.json")  # the checkpoint a stopped run leaves
    assert [r.to_json() for r in partial.records] == [r.to_json() for r in records]
    bf = _check_run(R, records, table, cols, *((impl, p) for impl in (Impl.OURS, Impl.FLEX)
                                               for p in (Pass.ROUTE, Pass.INDEX, Pass.FWD, Pass.STEP, Pass.FWD_BWD,
                                                         Pass.TRAIN_STEP)),
                    (Impl.OURS, Pass.STEP_GRAPH), (Impl.OURS, Pass.TRAIN_STEP_GRAPH), (Impl.CUDNN, Pass.FWD),
                    (Impl.OURS, Pass.TRANSPOSE))
    # what chapter 8 reads: every term at the main shape, the N sweep, recall per top-k, reuse per share
    main = dict(N=64, topk=1, share="kv_head", Hkv=2)
    for impl, p in ((Impl.OURS, Pass.ROUTE), (Impl.OURS, Pass.INDEX), (Impl.OURS, Pass.FWD),
                    (Impl.OURS, Pass.STEP_GRAPH), (Impl.OURS, Pass.TRAIN_STEP_GRAPH), (Impl.FLEX, Pass.ROUTE),
                    (Impl.FLEX, Pass.INDEX), (Impl.FLEX, Pass.FWD), (Impl.FLEX, Pass.STEP)):
        assert bf.ms(impl, p, **main) > 0, (impl, p)
    route_main = bf.one(Impl.OURS, Pass.ROUTE, **main)
    assert 0 < route_main.get("recall") <= 1 and set(route_main.get("recall_drifted")) == {"0.5"}
    # issue 14's A/B: the main case twice, the first version's kernels in the same process, each term alone,
    # the pooling choices, and a profile of both versions split by kernel
    assert route_main.get("ms_again") > 0 and route_main.get("ms_first_kernels") > 0
    assert bf.one(Impl.OURS, Pass.INDEX, **main).get("ms_first_kernels") > 0
    assert bf.one(Impl.OURS, Pass.INDEX, **main).get("ms_again") > 0
    assert route_main.get("kernels")["scores_split"] is True
    for name in ("current", "first"):
        assert all(route_main.get(f"terms_{name}")[t] > 0 for t in ("pool", "scores", "select"))
    # the fused scores + select (routing.FUSED) beside them: route, its terms, its profile, the same lists
    assert route_main.get("ms_fused_kernels") > 0 and route_main.get("fused_fits") is True
    assert route_main.get("fused_equals_current") is True
    assert all(route_main.get("terms_fused")[t] > 0 for t in ("pool", "fused_select"))
    for name in ("current", "first", "fused"):
        prof = route_main.get(f"profile_{name}")
        assert set(prof["buckets"]) == {"route", "index", "kernel", "launch"} and prof["wall_ms"] > 0
    assert len(route_main.get("pool_choices")) == len(R.POOL_CHOICES)
    assert all(c["ms"] > 0 and c["tbps"] > 0 for c in route_main.get("pool_choices"))
    assert all(r.get("ms_first_kernels") > 0 and r.get("ms_fused_kernels") > 0
               for r in bf.select(Impl.OURS, Pass.ROUTE, Hkv=1))
    assert bf.one(Impl.OURS, Pass.STEP_GRAPH, **main).get("graph_equals_eager") is True
    paired = bf.one(Impl.OURS, Pass.STEP_GRAPH, **main).get("paired")  # the step's graph against the fwd's
    assert paired["rounds"] == R.PAIRED_ROUNDS and paired["base_ms"] > 0 and paired["step_ms"] > 0
    assert paired["spread"][0] <= paired["added_ms"] <= paired["spread"][1]
    assert paired["share"] == pytest.approx(paired["added_ms"] / paired["step_ms"])
    assert bf.one(Impl.OURS, Pass.TRAIN_STEP_GRAPH, **main).get("graph_equals_eager") is True
    assert bf.distinct("N", impl=Impl.FLEX, pass_=Pass.STEP) == [64]
    assert bf.ms(Impl.CUDNN, Pass.FWD, N=64, pattern="causal") > 0
    assert [r.case["topk"] for r in bf.select(Impl.OURS, Pass.ROUTE, N=64, Hkv=2)] == [1, 2]
    assert [r.case["share"] for r in bf.select(Impl.OURS, Pass.ROUTE, Hkv=1)] == ["none", "kv_head", "all"]
    assert [r.get("layout_heads") for r in bf.select(Impl.OURS, Pass.ROUTE, Hkv=1)] == [2, 1, 1]


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_routing_pool_sweep_on_cpu(cpu_stand_ins, tmp_path):
    """``routing --pool-sweep`` at a tiny shape through the interpreter: one row per pool variant (each pooling
    equal to the eager reference, each selection equal to CURRENT's) beside the read ceiling, written to
    ``routing-pool-<gpu>.json`` by the CLI's own writer, the table fastest first with the ceiling last."""
    from sparseattn.bench import routing as R
    from sparseattn.bench.__main__ import write_outputs
    for name, value in (("HQ", 2), ("HKV", 2), ("D", 16), ("DTYPE", torch.float32), ("BLOCK", 16), ("TOPK", 1),
                        ("MAIN_N", 72)):
        cpu_stand_ins.setattr(R, name, value)
    args = _args(n="72", pool_sweep=True, meta={})
    records, table, cols = R.run(args)
    assert cols == R.POOL_COLUMNS and args.variant == "pool"
    bf = _check_run(R, records, table, cols, (Impl.OURS, Pass.POOL), (Impl.READ_CEILING, Pass.READ))
    rows = bf.select(Impl.OURS, Pass.POOL)
    assert [r.case["variant"] for r in rows] == list(R.POOL_VARIANTS)
    for r in rows:
        assert "error" not in r.extra, r.extra
        assert r.ms > 0 and r.get("tbps") > 0 and 0 < r.get("of_read")
        assert r.get("same_selection") is True and r.get("max_diff_vs_ref") < 1e-5, r.case["variant"]
    assert any(r.get("kernels")["pool_tma"] for r in rows) and any(r.get("kernels")["pool_persistent"] for r in rows)
    read = bf.one(Impl.READ_CEILING, Pass.READ)
    assert read.ms > 0 and read.get("bytes") == 2 * 2 * 72 * 16 * 4 and read.get("method")
    assert table[-1]["variant"] == "read ceiling" and len(table) == len(R.POOL_VARIANTS) + 1
    ms = [row["ms"] for row in table[:-1]]
    assert ms == sorted(ms)
    paths = write_outputs(R, records, str(tmp_path), ENV, False, None, meta=args.meta, variant=args.variant)
    assert [pathlib.Path(p).name for p in paths] == ["routing-pool-h200.json"]
    assert load_path(paths[0]).meta.get("read_bytes") == read.get("bytes")


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_balance_suite_on_cpu(cpu_stand_ins):
    from sparseattn.bench import balance as BB
    cpu_stand_ins.setattr(BB, "CASES", {"documents lognormal": (2, 1), "routed skewed (synthetic)": (2, 1),
                                        "causal H=1 N/4": (1, 0.25)})
    cpu_stand_ins.setattr(BB, "SPLITS", ("auto", 1))
    cpu_stand_ins.setattr(BB, "bucket_lengths", lambda N: [(128, 128), (384, 256)])
    records, table, cols = BB.run(_args(n="256"))
    bf = _check_run(BB, records, table, cols, (Impl.OURS, Pass.FWD), (Impl.OURS_SPLIT, Pass.FWD),
                    (Impl.FLEX, Pass.FWD), (Impl.CUDNN, Pass.FWD), (Impl.OURS_SPLIT, Pass.FWD_GRAPH))
    assert [r["case"] for r in table] == list(BB.CASES)
    for name in BB.CASES:
        plain = bf.one(Impl.OURS, Pass.FWD, case=name)
        assert plain.ms > 0 and plain.get("ideal_ms") > 0 and plain.get("balance")["total_tiles"] > 0
        for split in ("auto", 1):
            r = bf.one(Impl.OURS_SPLIT, Pass.FWD, case=name, split=split, persistent=False)
            assert r.ms > 0 and r.get("max_abs_diff_vs_plain") < 1e-4 and r.get("tasks") <= r.get("capacity")
            assert r.get("predicted_ms") > 0  # the roofline prices the split plan too
        if name != "causal H=1 N/4":  # 128 tokens: one tile, nothing to split
            assert bf.one(Impl.OURS_SPLIT, Pass.FWD, case=name, split=1, persistent=False).get("merged_rows") > 0
        # the persistent grid over the "auto" plan: the split row's tasks, the same output bits
        p = bf.one(Impl.OURS_SPLIT, Pass.FWD, case=name, persistent=True)
        auto = bf.one(Impl.OURS_SPLIT, Pass.FWD, case=name, split="auto", persistent=False)
        assert p.ms > 0 and p.case["split"] == "auto" and p.get("config")["persistent"] is True
        assert p.get("max_abs_diff_vs_plain") == auto.get("max_abs_diff_vs_plain")
        assert (p.get("chunk"), p.get("tasks")) == (auto.get("chunk"), auto.get("tasks")) and p.get("programs") >= 1
    row = {r["case"]: r for r in table}
    assert all(row[name]["persist_ms"] > 0 for name in BB.CASES)
    g = bf.one(Impl.OURS_SPLIT, Pass.FWD_GRAPH, case="routed skewed (synthetic)")
    assert g.ms > 0 and g.get("graph_equals_eager") is True and g.get("host_sync_free") is True
    # the CUDA-graph buckets: one row per bucket, the layout padded into it, its waste and the exact-length graph
    rows = bf.select(Impl.OURS_SPLIT, Pass.FWD_GRAPH, case=BB.BUCKETS_CASE)
    assert [(r.case["bucket"], r.case["N"]) for r in rows] == [(128, 128), (384, 256)]
    for r in rows:
        assert "error" not in r.extra, r.extra
        assert r.ms > 0 and r.get("graph_equals_eager") is True and r.get("host_sync_free") is True
        assert r.get("max_abs_vs_unpadded") < 1e-4 and min(r.get(k) for k in ("load_ms", "eager_ms",
                                                                                "exact_graph_ms")) > 0
        w = r.get("waste")
        assert w["bucket"] == r.case["bucket"] and w["tasks_used"] <= w["tasks_allotted"]
        assert w["tokens_waste"] == 1 - r.case["N"] / r.case["bucket"]
    assert rows[1].get("waste")["rows_allotted"] == 3 and rows[1].get("waste")["rows_used"] == 2
    from sparseattn.viz import ch10_load_balance as V  # what chapter 10 shows once the suite is recorded
    t = V.recorded_table(bf)
    assert t.column("case") == list(BB.CASES) and "failed" not in str(t.rows)
    # this run's persistent grid pulled its items (split.PERSISTENT_PULL), and the record says so
    assert all(r.get("pull") is True for r in bf.select(Impl.OURS_SPLIT, Pass.FWD, persistent=True))
    assert t.column("persistent, pulled (ms)") == [
        f"{bf.ms(Impl.OURS_SPLIT, Pass.FWD, case=n, persistent=True):.3f}" for n in BB.CASES]
    cases = V.recorded_cases(bf)
    assert list(cases) == list(BB.CASES)
    assert all(set(c["split"]) == {r.case["split"] for r in bf.select(Impl.OURS_SPLIT, Pass.FWD, case=n,
                                                                      persistent=False)} for n, c in cases.items())
    assert cases["routed skewed (synthetic)"]["graph"] == g.ms
    assert all(c["graph"] is None for n, c in cases.items() if n != "routed skewed (synthetic)")
    fig = V.recorded_figure(bf)
    # plain, auto, fixed chunk, persistent, FlexAttention (this run measured it), ideal
    assert [len(t.y) for t in fig.data] == [len(BB.CASES)] * 6 and fig.layout.yaxis.title.text == "ms per call (median)"
    assert fig.data[4].name.startswith("FlexAttention")
    # the ideal's calibration: equal rows, one record per (N, H)
    assert {(r.case["N"], r.case["for_heads"]) for r in bf.select(Impl.OURS, Pass.FWD, case="equal rows")} == \
        {(256, 2), (128, 1)}
    # a calibration with fewer than four programs per SM runs more heads (CPU stand-in: 4 SMs)
    assert all(r.case["H"] * 256 // 128 >= 4 * 4 or r.case["H"] == r.case["for_heads"]
               for r in bf.select(Impl.OURS, Pass.FWD, case="equal rows"))


def test_balance_cases_are_skewed():
    from sparseattn import balance
    from sparseattn.bench import balance as BB
    lens = BB.doc_lengths(65536)
    assert int(lens.sum()) == 65536 and lens.max() > 8 * lens.median()  # heavy-tailed
    layout = BB.case_layout("routed skewed (synthetic)", 4096, 2)
    rows = (layout.kv_count + layout.full_count).flatten()
    assert layout.H == 2 and rows.max() >= 4 * rows.float().median()
    eq = BB.equal_rows_layout(65536)  # the ideal's calibration at the suite's length
    assert set((eq.kv_count + eq.full_count).flatten().tolist()) == {BB.EQUAL_ROW_TILES}
    r = balance.report(eq, 1, 16, split="auto")
    # equal rows: the only tail is the last wave's quantisation (8192 programs on 132 SMs), nothing is split
    assert r.makespan_plain == math.ceil(8192 / 132) * BB.EQUAL_ROW_TILES and r.merged_rows == 0
    with pytest.raises(ValueError, match="case"):
        BB.case_layout("nope", 256, 1)


def test_ch10_recorded_balance_figure_reads_the_record():
    """Chapter 10's recorded figure and per-case rows come from the file: every bar is a record's time, the
    "faster fixed chunk" bar is the faster of chunks 16 and 64, and the log axis stays within a fifth of a
    decade of the data. A file without the persistent rows still draws (those bars are empty)."""
    from sparseattn import book
    from sparseattn.viz import ch10_load_balance as V
    bf = book.load_bench("balance")
    from sparseattn.bench import balance as BB
    cases = V.recorded_cases(bf)
    names = {r.case["case"] for r in bf.records}
    assert "equal rows" not in cases and len(cases) == len(names - {"equal rows", BB.BUCKETS_CASE})
    fig = V.recorded_figure(bf)
    # plain, auto, fixed chunk, persistent, (FlexAttention where the run measured it), the ideal last
    plain, auto, fixed, persist = (list(t.y) for t in fig.data[:4])
    ideal = list(fig.data[-1].y)
    assert len(fig.data) == 5 + bool(bf.select(Impl.FLEX, Pass.FWD))
    for i, (name, c) in enumerate(cases.items()):
        assert plain[i] == bf.ms(Impl.OURS, Pass.FWD, case=name) and ideal[i] == c["ideal_ms"]
        assert auto[i] == bf.ms(Impl.OURS_SPLIT, Pass.FWD, case=name, split="auto", persistent=False)
        assert fixed[i] == min(c["split"][16].ms, c["split"][64].ms)
        assert persist[i] == bf.ms(Impl.OURS_SPLIT, Pass.FWD, case=name, persistent=True)
    lo, hi = fig.layout.yaxis.range
    vals = [v for t in fig.data for v in t.y if v]
    assert 0 < math.log10(min(vals)) - lo <= 0.2 and 0 < hi - math.log10(max(vals)) <= 0.2
    doc = bf.to_json()
    doc["results"] = [r for r in doc["results"] if not r["case"].get("persistent")]
    thin = BenchFile.from_json(doc)
    assert all(c["persistent"] is None for c in V.recorded_cases(thin).values())
    assert list(V.recorded_figure(thin).data[3].y) == [None] * len(cases)
    # a series no case measured is left out of the table and named in its caption
    table = V.recorded_table(bf)
    flex_rows = bf.select(Impl.FLEX, Pass.FWD)
    assert ("FlexAttention (ms)" in table.columns) == bool(flex_rows)
    assert ("not in this run: FlexAttention" in table.caption) == (not flex_rows)
    assert not any(c.startswith("persistent") for c in V.recorded_table(thin).columns)


def _synthetic_balance_files(tmp_path):
    """A ``balance`` file that HAS FlexAttention rows and bucket rows (the recorded file plus made-up rows) and a
    ``balance_bwd`` file, written to ``tmp_path`` only (never to book/data/bench): what chapter 10 must read
    once the GPU runs with FlexAttention and the backward suite land."""
    from sparseattn import book
    from sparseattn.viz import ch10_load_balance as V
    doc = book.load_bench("balance").to_json()
    doc["results"] = [r for r in doc["results"] if r["impl"] != Impl.FLEX]  # the made-up Flex rows replace them
    cases = V.recorded_cases(BenchFile.from_json(doc))
    flex = {name: round(V.best_ours(c)[0] * f, 4) for (name, c), f in zip(cases.items(), (1.3, 1.1, 2.0, 1.25, 0.9,
                                                                                         0.5))}
    for name, ms in flex.items():
        doc["results"].append(Record({"case": name, "N": cases[name]["N"], "H": cases[name]["H"], "B": 1, "D": 128,
                                      "dtype": "bf16"}, Impl.FLEX, Pass.FWD, ms, {}).to_json())
    doc["results"].append(Record({"case": "routed buckets", "N": 6144, "bucket": 8192, "H": 16, "B": 1, "D": 128,
                                  "dtype": "bf16", "block": 128}, Impl.OURS_SPLIT, Pass.FWD_GRAPH, 0.5,
                                 {"exact_graph_ms": 0.45, "eager_ms": 0.6, "load_ms": 0.02,
                                  "graph_equals_eager": True, "waste": {"tokens_waste": 0.25, "slots_waste": 0.9,
                                                                        "tasks_waste": 0.3}}).to_json())
    bwd = {"suite": "balance_bwd", **ENV, "results": []}
    for i, (name, c) in enumerate(cases.items()):
        case = {"case": name, "N": c["N"], "H": c["H"], "B": 1, "D": 128, "dtype": "bf16"}
        ideal = 1.0 + i
        bwd["results"] += [Record({**case, "dq_split": None}, Impl.OURS, Pass.BWD, ideal * 1.1, {"ideal_ms": ideal}),
                           Record({**case, "dq_split": "auto"}, Impl.OURS_SPLIT, Pass.BWD, ideal * (1.3 - 0.1 * (i % 2)),
                                  {"ideal_ms": ideal}),
                           Record(case, Impl.FLEX, Pass.BWD, ideal * 1.5, {"ideal_ms": ideal})]
    bwd["results"] = [r.to_json() for r in bwd["results"]]
    (tmp_path / "balance-h200.json").write_text(json.dumps(doc))
    (tmp_path / "balance_bwd-h200.json").write_text(json.dumps(bwd))
    return flex


def test_ch10_reads_a_file_with_flex_rows_and_a_backward_record(tmp_path, monkeypatch):
    """Chapter 10 with a run that measured FlexAttention and recorded balance_bwd (synthetic files in a tmpdir):
    the Flex column and the ratio against our fastest variant appear, the 1.2x target on the skewed cases is
    stated met or missed from the data, the bucket table shows, and the backward's table and figure appear
    beside its ideal. The notebook's own cells for these are executed against the same files."""
    from sparseattn import book
    from sparseattn.viz import ch10_load_balance as V
    flex = _synthetic_balance_files(tmp_path)
    bf = load_path(tmp_path / "balance-h200.json")
    t = V.recorded_table(bf)
    assert "FlexAttention (ms)" in t.columns and "FlexAttention / our fastest" in t.columns
    assert "not in this run" not in t.caption
    rec = V.recorded_cases(bf)
    assert t.column("FlexAttention / our fastest") == [f"{flex[n] / V.best_ours(c)[0]:.2f}" for n, c in rec.items()]
    target = V.flex_target(bf)
    assert list(target) == list(V.SKEWED)
    assert [target[n]["met"] for n in V.SKEWED] == [True, False, True]  # 1.3x, 1.1x, 1.25x
    assert "missed (2 of 3 met" in V.flex_verdict(target)
    assert "met (3 of 3" in V.flex_verdict({n: {**x, "met": True} for n, x in target.items()})
    assert V.recorded_figure(bf).data[4].name.startswith("FlexAttention")  # a Flex bar beside ours
    assert V.bucket_table(bf).column("tokens padded")[-1] == "25%"  # the made-up bucket row, after the recorded
    no_flex = book.load_bench("balance").to_json()
    no_flex["results"] = [r for r in no_flex["results"] if r["impl"] != Impl.FLEX]
    assert V.flex_target(BenchFile.from_json(no_flex)) is None  # a --no-flex run
    bwd = load_path(tmp_path / "balance_bwd-h200.json")
    bt = V.recorded_bwd_table(bwd)
    assert bt.columns[-2:] == ["our fastest / ideal", "FlexAttention / our fastest"] and len(bt.rows) == len(rec)
    assert bt.column("our fastest / ideal") == ["1.10", "1.10"] * 3
    near = V.bwd_near_ideal(bwd)
    assert all(x["met"] for x in near.values())
    fig = V.recorded_bwd_figure(bwd)
    assert [d.name for d in fig.data][:3] == ["plain dQ pass", "split dQ pass", "FlexAttention backward"]
    assert fig.layout.yaxis.title.text == "ms per call (median)"
    # the notebook's cells that depend on what the files hold, run against the synthetic files
    monkeypatch.setattr(book, "BENCH_DIR", tmp_path)
    nb = json.loads((pathlib.Path(__file__).resolve().parents[1] / "notebooks" / "10_load_balance.ipynb").read_text())
    sources = ["".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code"]
    wanted = [s for s in sources if s.startswith(('bf = book.load_bench("balance")', "target = viz.flex_target",
                                                   "buckets = viz.bucket_table", "from sparseattn.ops import BwdConfig"))]
    assert len(wanted) == 4
    import io
    from contextlib import redirect_stdout
    from sparseattn.ops import FwdConfig
    ns = {"book": book, "viz": V, "display": lambda x: None, "FwdConfig": FwdConfig}
    out = io.StringIO()
    with redirect_stdout(out):
        for s in wanted:
            exec(s, ns)  # noqa: S102 - the notebook's own cells
    text = out.getvalue()
    assert "FlexAttention rows: 6" in text and ">= 1.2x FlexAttention on the skewed cases: missed" in text
    assert "balance_bwd recorded: True" in text and "within 1.15x of its ideal balanced time in 6 of the 6 cases" in text
    assert "every replay equals the eager call on its bucket: True" in text


@STAND_IN_WARNINGS[0]
@STAND_IN_WARNINGS[1]
def test_balance_suite_splits_over_two_runs_with_cases_and_merge(cpu_stand_ins, tmp_path):
    """``--cases`` measures a subset; ``--merge`` keeps an earlier file's rows of the other cases (and their
    equal-rows calibrations), so two 10-minute runs make one file."""
    from sparseattn.bench import balance as BB
    cpu_stand_ins.setattr(BB, "CASES", {"causal H=1 N/4": (1, 0.25), "causal": (2, 1)})
    cpu_stand_ins.setattr(BB, "SPLITS", ("auto",))
    first, table, _ = BB.run(_args(n="256", cases="0", no_flex=True))
    assert [r["case"] for r in table] == ["causal H=1 N/4"]
    assert {r.case["case"] for r in first} == {"causal H=1 N/4", "equal rows"}
    path = tmp_path / "balance-cpu.json"
    path.write_text(json.dumps({"suite": "balance", **ENV, "results": [r.to_json() for r in first]}))
    second, table, _ = BB.run(_args(n="256", cases="causal", merge=str(path), no_flex=True))
    assert [r["case"] for r in table] == ["causal"]
    assert [r.to_json() for r in second[:len(first)]] == [r.to_json() for r in first]  # kept, first
    assert {r.case["case"] for r in second[len(first):]} == {"causal", "equal rows"}
    bf = BenchFile.from_json({"suite": "balance", **ENV, "results": [r.to_json() for r in second]})
    assert {(r.case["N"], r.case["for_heads"]) for r in bf.select(Impl.OURS, Pass.FWD, case="equal rows")} == \
        {(128, 1), (256, 2)}
    from sparseattn.viz import ch10_load_balance as V
    assert list(V.recorded_cases(bf)) == ["causal H=1 N/4", "causal"]
    # re-measuring a case replaces its old rows
    third, _, _ = BB.run(_args(n="256", cases="0", merge=str(path), no_flex=True))
    assert len(third) == len(first)
    with pytest.raises(ValueError, match="--cases"):
        BB.selected_cases(_args(cases="7"))
    path.write_text(json.dumps({"suite": "routing", **ENV, "results": []}))
    with pytest.raises(ValueError, match="--merge expects a 'balance' file"):
        BB.run(_args(n="256", cases="0", merge=str(path), no_flex=True))


def test_rotated_rounds_warm_up_then_rotate():
    """The check scripts' A/B helper: one warm-up round not kept, then each round starts one name later."""
    from sparseattn.bench.host import rotated_rounds
    calls = []
    got = rotated_rounds(lambda n: calls.append(n) or float(len(calls)), ["a", "b", "c"], 3)
    assert calls == ["a", "b", "c", "a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert got == {"a": [4.0, 9.0, 11.0], "b": [5.0, 7.0, 12.0], "c": [6.0, 8.0, 10.0]}


def test_launches_stubbed_restores_the_launcher():
    from sparseattn.bench.host import launches_stubbed
    from sparseattn.ops import _launch as L
    real = L.launch
    with launches_stubbed():
        assert L.launch is not real and L.launch(None, (1,), num_stages=1) is None
    assert L.launch is real


def test_rep_timeline_splits_a_flushed_loop():
    """``eager_timeline``'s arithmetic on a hand-made trace: per repetition, the device idle after the flush
    (lead), between the call's kernels (gaps), their durations (busy), the total the events time, and the
    host's delay to the first launch and between launches; a flush with no kernel after it is left out."""
    from sparseattn.bench.host import Span, rep_timeline
    flushes = [Span("fill", 0, 90), Span("fill", 400, 480), Span("fill", 900, 950)]
    kernels = [Span("delta", 100, 150), Span("bwd", 160, 300), Span("bwd", 500, 520)]
    calls = [Span("call", 5, 60), Span("call", 390, 470), Span("call", 880, 890)]
    launches = [Span("cuLaunchKernelEx", 20, 21), Span("cuLaunchKernelEx", 40, 41),
                Span("cuLaunchKernelEx", 410, 411)]
    got = rep_timeline(kernels, flushes, calls, launches)
    assert got == [{"lead_us": 10, "gaps_us": 10, "busy_us": 190, "total_us": 210, "kernels": 2,
                    "host_first_us": 15, "host_span_us": 20},
                   {"lead_us": 20, "gaps_us": 0, "busy_us": 20, "total_us": 40, "kernels": 1,
                    "host_first_us": 20, "host_span_us": 0}]
