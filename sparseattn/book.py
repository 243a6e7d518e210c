"""Shared setup for the book's notebooks: ``from sparseattn import book; env = book.setup()``.

One import gives every chapter the same plotting mode, seeds, recorded benchmark data (as
:class:`~sparseattn.bench.record.BenchFile`, the typed records the suites write) and widget helper:

* in the **static book build** (``SPARSEATTN_BOOK_BUILD=1``, set by ``book/_ext/offline_assets.py``) figures
  are written as HTML that uses the page's single shared ``plotly.min.js`` (no CDN, no per-figure copy) and
  live widgets are skipped (their cells are tagged ``remove-cell``; each figure also has a kernel-free
  version with sliders, built by :func:`static_explorer` from the same ``viz`` function);
* in a **live notebook** (Jupyter, Colab) figures use the front end's own renderer and :func:`interact`
  builds ipywidgets that recompute (and, on a GPU, re-measure).

This module imports plotly; ``import sparseattn`` does not import it.
"""
from __future__ import annotations

import itertools
import json
import os
import pathlib
import urllib.request
from dataclasses import dataclass
from typing import Callable

import torch

import sparseattn

from .bench.record import DEFAULT_DIR, BenchFile, bench_filename, load

# Must equal `repository.url` in _config.yml (tests/test_book.py checks it): Colab installs from here.
REPOSITORY = "https://github.com/sparseattn/sparseattn"
BRANCH = "main"
ROOT = pathlib.Path(__file__).resolve().parent.parent
BENCH_DIR = DEFAULT_DIR


def is_static_build() -> bool:
    return os.environ.get("SPARSEATTN_BOOK_BUILD", "0") not in ("", "0")


@dataclass
class Env:
    device: str  # "cuda" or "cpu"
    gpu: str  # GPU name or "none"
    backend: str  # "cuda" or "interpreter": where Triton kernels run
    static: bool  # a static book build (no widgets)

    @property
    def live_gpu(self) -> bool:
        return self.device == "cuda"


def _register_static_renderer():
    import plotly.io as pio
    from plotly.io._base_renderers import HtmlRenderer

    class BookRenderer(HtmlRenderer):
        """HTML that relies on the page's shared plotly.min.js: no inline bundle, no MathJax CDN."""

        def __init__(self):
            super().__init__(connected=False, full_html=False, global_init=False, include_plotlyjs=False)

        def to_mimebundle(self, fig_dict):
            html = pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False, full_html=False,
                               default_width="100%", default_height=480, validate=False)
            return {"text/html": html}

    pio.renderers["sparseattn_book"] = BookRenderer()
    pio.renderers.default = "sparseattn_book"


def setup(seed: int = 0) -> Env:
    """Configure plotting, seed the RNGs and say where this notebook runs."""
    from . import _runtime
    torch.manual_seed(seed)
    static = is_static_build()
    if static:
        _register_static_renderer()
    import plotly.io as pio
    pio.templates.default = "plotly_white"
    cuda = torch.cuda.is_available()
    env = Env(device="cuda" if cuda else "cpu", gpu=torch.cuda.get_device_name(0) if cuda else "none",
              backend=_runtime.select_backend(), static=static)
    import triton
    print(f"sparseattn {sparseattn.__version__} | torch {torch.__version__} | triton {triton.__version__} | "
          f"{'GPU: ' + env.gpu if cuda else 'no GPU: kernels run in the Triton interpreter'}")
    return env


def load_bench(suite: str, gpu: str = "h200", *, sweep: bool = False) -> BenchFile:
    """A recorded benchmark file ``<suite>-<gpu>.json`` (``sweep=True``: ``<suite>-sweep-<gpu>.json``) as a
    :class:`~sparseattn.bench.record.BenchFile`, from book/data/bench or, when the package was installed
    without the book (as on Colab), from the repository."""
    name = bench_filename(suite, gpu, "sweep" if sweep else None)
    if (BENCH_DIR / name).exists():
        return load(suite, gpu, sweep=sweep, directory=BENCH_DIR)
    url = f"{REPOSITORY.replace('github.com', 'raw.githubusercontent.com')}/{BRANCH}/book/data/bench/{name}"
    with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 (fixed https URL)
        return BenchFile.from_json(json.loads(r.read().decode()))


def caption(doc: BenchFile) -> str:
    """Where and when a recorded file was measured, for figure titles."""
    return doc.caption()


def interact(fn: Callable, **grid):
    """Controls plus a *Run* button in a live notebook (``ipywidgets.interact_manual``): recomputing, and on a
    GPU re-measuring, happens when the reader asks, not on every slider tick. Nothing in the static build
    (its figures come from static_explorer)."""
    if is_static_build():
        return None
    import ipywidgets
    from IPython.display import display
    widget = ipywidgets.interactive(fn, {"manual": True, "manual_name": "Run"}, **grid)
    display(widget)
    return None


def static_explorer(make_figure: Callable, grid: dict, title: str = ""):
    """One kernel-free figure over a precomputed grid: ``make_figure(**params)`` is called for every
    combination of ``grid`` values and a slider shows one combination at a time. Layout (axes, shapes,
    annotations) follows the figure of the first combination; traces switch with the slider."""
    import plotly.graph_objects as go
    names = list(grid)
    combos = list(itertools.product(*(grid[n] for n in names)))
    figs = [make_figure(**dict(zip(names, c))) for c in combos]
    out = go.Figure(layout=figs[0].layout)
    spans, start = [], 0
    for f in figs:
        for tr in f.data:
            out.add_trace(tr)
        spans.append((start, start + len(f.data)))
        start += len(f.data)
    n_traces = start
    steps = []
    for (a, b), c, f in zip(spans, combos, figs):
        visible = [a <= i < b for i in range(n_traces)]
        label = ", ".join(f"{n}={v}" for n, v in zip(names, c))
        steps.append(dict(method="update", label=label,
                          args=[{"visible": visible},
                                {"title.text": f.layout.title.text or title,
                                 "annotations": f.layout.annotations, "shapes": f.layout.shapes}]))
    for i, tr in enumerate(out.data):
        tr.visible = spans[0][0] <= i < spans[0][1]
    out.update_layout(sliders=[dict(active=0, steps=steps, pad={"t": 50},
                                    currentvalue={"prefix": ", ".join(names) + ": "})])
    return out
