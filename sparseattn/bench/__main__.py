"""Benchmarks: ``python -m sparseattn.bench <suite> [--out DIR] [options]``.

Each suite fits in one 10-minute GPU run, measures our kernels and the strongest baselines on the same
work in the same process, shows its progress over cases on stderr, writes ``<suite>-<gpu>.json`` into
``--out`` (default ``book/data/bench/``) and prints a short table last. Suites: ``prefill`` (forward kernel
vs FlexAttention, cuDNN, FA2, naive), ``backward`` (deterministic and atomic backward vs FlexAttention,
cuDNN, FA2; determinism; column splitting), ``layout`` (building the block table vs FlexAttention's
``create_block_mask``), ``decode`` (paged-cache decode, dense and Quest-selected, vs SDPA and FlexAttention
decode, and a streaming-read ceiling), ``decode_keep`` (decode and the CUDA-graph step vs the fraction of
pages kept), ``crossover`` (where sparse starts to beat cuDNN on the pattern's envelope, per family and pass,
every row with the cost model's ``predicted_ms``; ``--part fwd,decode`` and ``--part bwd`` each fit one
10-minute run, ``--merge`` joins them), ``errors`` (error distributions against a float64 reference vs
length and dtype, for ours, FlexAttention and cuDNN; bitwise repeatability and the atomic backward's spread), ``routing`` (content routing + attention, each term and the whole step
eager and in one CUDA graph, against the FlexAttention pipeline: compiled pooling/scores/top-k, ``BlockMask.from_kv_blocks``,
compiled ``flex_attention``; overhead share vs N, recall vs top-k, reuse), ``host`` (where one eager call's
time goes at N <= 4k: event-timed, CUDA-graph device time, host time per call, kernels per call, host syncs,
and a function-level profile of our call, for ours, FlexAttention and cuDNN, forward and backward),
``balance`` (the forward on skewed layouts: plain grid vs split rows vs FlexAttention and cuDNN, beside the
ideal balanced time and the roofline's prediction; the split forward in a CUDA graph), ``balance_bwd`` (the
backward on the same layouts, in its own run: plain dQ pass vs split dQ pass vs FlexAttention's backward,
beside the backward's ideal balanced time), ``versus`` (issue 13's table against FlexAttention in one run: the
backward on five patterns, the compiled-mask forwards, the layout build vs ``create_block_mask``, short
sequences with cuDNN, and D = 64, GQA and fp16; fixed rows, ``--rows`` picks some, ``--budget-s`` bounds it).

``--sweep`` (prefill, backward, decode) also times a set of kernel configs and writes
``<suite>-sweep-<gpu>.json`` (every row, the sweep's included) and ``<suite>-defaults-<gpu>.json`` (the best
config per dtype and head dim, in the row format of ``sparseattn/data/tuned_configs.json``) instead of
``<suite>-<gpu>.json``, so a sweep never overwrites the recorded suite.
"""
from __future__ import annotations

import argparse
import importlib
import sys
from typing import List, Optional

import torch

from . import _common as C

#: suite name -> module (imported when the suite runs)
SUITES = {"prefill": "prefill", "layout": "layout_build", "backward": "backward", "decode": "decode",
          "decode_keep": "decode_keep", "crossover": "crossover", "errors": "errors", "routing": "routing",
          "host": "host", "balance": "balance", "balance_bwd": "balance_bwd", "versus": "versus"}


def suite_module(name: str):
    """The module of suite ``name`` (``run(args)``, ``NAME``, ``DEFAULT_N``, ``CONFIG_KIND``, ``sweep_rows``)."""
    if name not in SUITES:
        raise ValueError(f"suite must be one of {sorted(SUITES)}, got {name!r}")
    return importlib.import_module(f"{__package__}.{SUITES[name]}")


#: the options of one suite or a few: (help group, flag, argparse keywords)
SUITE_OPTIONS = [
    ("crossover", "--part", dict(default="all", help="fwd, bwd, decode, or a comma-separated list (default: all)")),
    ("crossover", "--families", dict(
        default=None, help="comma-separated: window, sinks_window, block_random, documents, routing (default: all)")),
    ("crossover", "--keep-n", dict(default=None, help="comma-separated lengths of the kept-fraction families")),
    ("crossover", "--merge", dict(
        default=None, help="an earlier file of the same suite and GPU (crossover, balance, balance_bwd, versus): its "
                           "rows of the parts, cases or table rows not measured now are kept")),
    ("backward --sweep", "--sweep-shapes", dict(
        default=None, help="comma-separated HEADSxHEAD_DIM shapes to sweep (default: 16x128,32x64; one shape gets "
                           "the whole --budget-s)")),
    ("balance, balance_bwd", "--cases", dict(
        default=None, help="comma-separated case numbers (0-based, in the suite's order) or names: measure only "
                           "these (split a suite over two runs: the second with --merge the first's file)")),
    ("routing", "--pool-sweep", dict(
        action="store_true", help="routing only: time every pool kernel variant (bench.routing.POOL_VARIANTS) "
                                  "beside a streaming read of the same bytes, into routing-pool-<gpu>.json (a minute "
                                  "or two)")),
    ("versus", "--rows", dict(
        default=None, help="comma-separated row keys of issue 13's table (default: all, in the issue's order; "
                           "--n and --patterns do not apply)")),
]


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m sparseattn.bench", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("suite", choices=sorted(SUITES))
    ap.add_argument("--out", default=C.DEFAULT_OUT, help="directory for <suite>-<gpu>.json (default: %(default)s)")
    ap.add_argument("--n", default=None, help="comma-separated sequence lengths")
    ap.add_argument("--patterns", default=None, help="comma-separated prefill patterns")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--no-flex", action="store_true")
    ap.add_argument("--sweep", action="store_true",
                    help="also time a set of kernel configs (prefill, backward, decode); writes "
                         "<suite>-sweep-<gpu>.json and <suite>-defaults-<gpu>.json instead of <suite>-<gpu>.json")
    ap.add_argument("--naive-max-bytes", type=float, default=24e9)
    ap.add_argument("--budget-s", type=float, default=500.0,
                    help="crossover, versus, backward --sweep: stop starting FlexAttention compiles, new points, rows "
                         "or configs when this "
                         "many seconds have passed (default: %(default)s)")
    groups = {}
    for group, flag, kw in SUITE_OPTIONS:
        if group not in groups:
            groups[group] = ap.add_argument_group(group)
        groups[group].add_argument(flag, **kw)
    return ap


def write_outputs(module, records, out_dir: str, env: dict, sweep: bool, family: Optional[str],
                  meta: Optional[dict] = None, variant: Optional[str] = None) -> List[str]:
    """Write the suite's files; return their paths. Without ``sweep``: ``<suite>-<gpu>.json`` (with the
    suite's extra ``meta`` keys). With it: ``<suite>-sweep-<gpu>.json`` and ``<suite>-defaults-<gpu>.json``
    (defaults for GPU ``family``). ``variant``: ``<suite>-<variant>-<gpu>.json`` instead (a suite's side run,
    e.g. routing's ``--pool-sweep``)."""
    if not sweep:
        return [C.write_json(module.NAME, records, out_dir, env, variant=variant, meta=meta)]
    from .defaults import defaults_doc
    from .record import bench_filename
    paths = [C.write_json(module.NAME, records, out_dir, env, variant="sweep")]
    doc = defaults_doc(module.NAME, module.CONFIG_KIND, family, module.sweep_rows(records), env)
    paths.append(C.write_doc(doc, out_dir, bench_filename(module.NAME, C.gpu_slug(env["device"]), "defaults")))
    return paths


def main(argv=None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    module = suite_module(args.suite)
    if args.sweep and module.CONFIG_KIND is None:
        ap.error(f"--sweep applies to the suites with configs to tune (prefill, backward, decode), not {args.suite}")
    if args.pool_sweep and args.suite != "routing":
        ap.error(f"--pool-sweep applies to the routing suite, not {args.suite}")
    if args.sweep_shapes is not None:
        if args.suite != "backward" or not args.sweep:
            ap.error("--sweep-shapes applies to backward --sweep")
        from .backward import parse_sweep_shapes
        try:
            args.sweep_shapes = parse_sweep_shapes(args.sweep_shapes)
        except ValueError as e:
            ap.error(str(e))
    if not torch.cuda.is_available():
        print("the benchmarks need a CUDA GPU", file=sys.stderr)
        return 2
    args.device = "cuda"
    if args.n is None:
        args.n = module.DEFAULT_N
    args.meta = {}  # a suite may add keys to its file's meta block
    args.variant = None  # and name its file's variant (routing --pool-sweep: routing-pool-<gpu>.json)
    records, table, cols = module.run(args)
    from ..ops.config import gpu_family
    paths = write_outputs(module, records, args.out, C.environment(), args.sweep,
                          gpu_family(torch.device("cuda"), interpreter=False), meta=args.meta,
                          variant=args.variant)
    print()
    for p in paths:
        print(f"wrote {p}")
    C.print_table(table, cols)
    return 0


if __name__ == "__main__":
    sys.exit(main())
