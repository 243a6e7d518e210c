"""Benchmarks: ``python -m sparseattn.bench <suite> [--out DIR] [options]`` (see :mod:`sparseattn.bench.__main__`).

* :mod:`~sparseattn.bench.record` — the typed :class:`Record` of one measurement, the implementation and
  pass names, and :func:`load`, the reader the book's figures use;
* :mod:`~sparseattn.bench.cases` — the named patterns and setups the suites measure and the book draws;
* one module per suite: :mod:`~sparseattn.bench.prefill`, :mod:`~sparseattn.bench.layout_build` (suite
  ``layout``), :mod:`~sparseattn.bench.backward`, :mod:`~sparseattn.bench.decode`,
  :mod:`~sparseattn.bench.decode_keep`; :mod:`~sparseattn.bench.defaults` turns a sweep into tuned defaults.

Importing this package or a suite module loads neither Triton nor plotly (the ops import their kernels on
first use), so ``python -m sparseattn.bench --help`` and the record loader work on any machine.
"""
from ._common import (compiled_flex, flex_fn, gpu_slug, graph_step, grad_fn, naive_fn, read_fn, sdpa_fn,
                      tile_flops, time_gpu, time_host)
from .cases import BOOK_PATTERNS, PREFILL_PATTERNS, book_layout, prefill_layout
from .record import BenchFile, Impl, Pass, Record, load, load_path

__all__ = ["Record", "Impl", "Pass", "BenchFile", "load", "load_path", "time_gpu", "time_host", "graph_step",
           "grad_fn", "flex_fn", "compiled_flex", "sdpa_fn", "naive_fn", "read_fn", "tile_flops", "gpu_slug",
           "prefill_layout", "PREFILL_PATTERNS", "BOOK_PATTERNS", "book_layout"]
