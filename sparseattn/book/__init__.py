"""Shared setup for the book's notebooks: ``from sparseattn import book; env = book.setup()``.

One import gives every chapter the same plotting mode, seeds, recorded benchmark data (as
:class:`~sparseattn.bench.record.BenchFile`, the typed records the suites write) and widget helpers:

* in the **static book build** (``SPARSEATTN_BOOK_BUILD=1``, set by ``book/_ext/offline_assets.py``) figures
  are written as HTML that uses the page's single shared ``plotly.min.js`` (no CDN, no per-figure copy) and
  live widgets are skipped (their cells are tagged ``remove-cell``; each figure also has a kernel-free
  version, one control per parameter, built by :func:`static_explorer` from the same ``viz`` function);
* in a **live notebook** (Jupyter, Colab, a GPU box) figures use the front end's own renderer and
  :func:`interact` builds ipywidgets with a *Run* button that recompute (and, on a GPU, re-measure). Every
  widget is also registered in :data:`WIDGETS`, so a test can press its Run button for several settings
  (:func:`press_widgets`) without a browser.

Demo cells state what they print with :func:`claim` (print *and* assert), and show package code with
:func:`source` (the real function, never a copy). Importing this package loads neither plotly nor
ipywidgets; the functions that need them import them.
"""
from __future__ import annotations

import inspect
import json
import os
import pathlib
import urllib.request
from dataclasses import dataclass
from typing import Callable, Dict, List

import torch

import sparseattn

from ..bench.record import DEFAULT_DIR, BenchFile, bench_filename, load, load_path
from ._explorer import static_explorer
from ._source import Source, source

__all__ = ["setup", "Env", "load_bench", "load_check", "caption", "interact", "WIDGETS", "widget_settings", "press_widgets",
           "static_explorer", "source", "Source", "claim", "is_static_build", "REPOSITORY", "BRANCH"]

# Must equal `repository.url` in _config.yml (tests/test_book.py checks it): Colab installs from here.
REPOSITORY = "https://github.com/sparseattn/sparseattn"
BRANCH = "main"
ROOT = pathlib.Path(__file__).resolve().parents[2]
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

    @property
    def dtype(self) -> torch.dtype:
        """What live cells compute in: bf16 on a GPU with bf16 tensor cores (sm_80+), fp16 on older ones
        (Colab's T4), fp32 in the interpreter (its bf16 arithmetic is wrong)."""
        if not self.live_gpu:
            return torch.float32
        return torch.bfloat16 if torch.cuda.get_device_capability()[0] >= 8 else torch.float16


def _register_static_renderer():
    import plotly.io as pio
    from plotly.io._base_renderers import HtmlRenderer

    class BookRenderer(HtmlRenderer):
        """HTML that relies on the page's shared plotly.min.js: no inline bundle, no MathJax CDN."""

        def __init__(self):
            super().__init__(connected=False, full_html=False, global_init=False, include_plotlyjs=False)

        def to_mimebundle(self, fig_dict):
            height = (fig_dict.get("layout") or {}).get("height") or 480
            html = pio.to_html(fig_dict, include_plotlyjs=False, include_mathjax=False, full_html=False,
                               default_width="100%", default_height=height, validate=False,
                               auto_play=False, config={"responsive": True})
            return {"text/html": html}

    pio.renderers["sparseattn_book"] = BookRenderer()
    pio.renderers.default = "sparseattn_book"


def setup(seed: int = 0) -> Env:
    """Configure plotting, seed the RNGs and say where this notebook runs."""
    from .. import _runtime
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
    return _fetch(name)


def load_check(name: str) -> BenchFile:
    """A record kept under ``book/data/bench/checks/`` (an A/B run, a sweep of one pass, a superseded run), by
    file name, from the checkout or, as :func:`load_bench`, from the repository."""
    if "/" in name or not name.endswith(".json"):
        raise ValueError(f"name must be a file name ending in .json (no directory), got {name!r}")
    path = BENCH_DIR / "checks" / name
    return load_path(path) if path.exists() else _fetch(f"checks/{name}")


def _fetch(name: str) -> BenchFile:
    url = f"{REPOSITORY.replace('github.com', 'raw.githubusercontent.com')}/{BRANCH}/book/data/bench/{name}"
    with urllib.request.urlopen(url, timeout=30) as r:  # noqa: S310 (fixed https URL)
        return BenchFile.from_json(json.loads(r.read().decode()))


def caption(doc: BenchFile) -> str:
    """Where and when a recorded file was measured, for figure titles."""
    return doc.caption()


def claim(statement: str, holds: bool) -> None:
    """Print ``statement`` and assert it: a demo cell never shows a sentence its own numbers contradict.

    Raises AssertionError (carrying the statement) when ``holds`` is false, so a build that executes the
    notebook fails instead of publishing the contradiction."""
    if not isinstance(holds, bool):
        holds = bool(holds.item()) if isinstance(holds, torch.Tensor) else holds
    if holds is not True:
        raise AssertionError(f"the page claims: {statement!r}, but the data says otherwise")
    print(statement)


# ---------------------------------------------------------------------------------------------------------
# live widgets
# ---------------------------------------------------------------------------------------------------------
#: Every widget :func:`interact` built in this kernel, as (function, grid) in creation order. A test presses
#: their Run buttons by calling the functions (:func:`press_widgets`).
WIDGETS: List[tuple] = []


def interact(fn: Callable, **grid):
    """Controls plus a *Run* button in a live notebook (``ipywidgets.interact_manual``): recomputing, and on a
    GPU re-measuring, happens when the reader asks, not on every slider tick. Nothing in the static build
    (its figures come from :func:`static_explorer`). The widget is registered in :data:`WIDGETS`."""
    if is_static_build():
        return None
    params = inspect.signature(fn).parameters
    unknown = set(grid) - set(params)
    if unknown:
        raise ValueError(f"grid names {sorted(unknown)} that {fn.__name__}() does not take; "
                         f"its parameters: {list(params)}")
    WIDGETS.append((fn, dict(grid)))
    import ipywidgets
    from IPython.display import display
    widget = ipywidgets.interactive(fn, {"manual": True, "manual_name": "Run"}, **grid)
    display(widget)
    return None


def _options(spec) -> list:
    """The values a widget control offers: a list as is; a ``(lo, hi[, step])`` range as its two ends."""
    if isinstance(spec, (list, tuple)) and len(spec) in (2, 3) and all(isinstance(x, (int, float))
                                                                      for x in spec) and isinstance(spec, tuple):
        return [spec[0], spec[1]]
    if isinstance(spec, dict):
        return list(spec.values())
    return list(spec)


def widget_settings(fn: Callable, grid: dict, n: int = 3) -> List[Dict]:
    """``n`` argument sets a reader could choose: the defaults first, then one parameter at a time moved to
    the option farthest from its default (the last, or the first when the default is last)."""
    defaults = {k: p.default for k, p in inspect.signature(fn).parameters.items()
                if p.default is not inspect.Parameter.empty}
    out = [dict(defaults)]
    for name, spec in grid.items():
        if len(out) >= n:
            break
        opts = _options(spec)
        pick = opts[-1] if opts[-1] != defaults.get(name) else opts[0]
        if pick != defaults.get(name):
            out.append({**defaults, name: pick})
    return out[:n]


def press_widgets(n: int = 3) -> int:
    """Press the Run button of every registered widget for :func:`widget_settings` (``n`` each), as a reader
    would; exceptions propagate. Returns the number of presses."""
    presses = 0
    for fn, grid in WIDGETS:
        for kwargs in widget_settings(fn, grid, n):
            print(f"[press] {fn.__name__}({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})")
            result = fn(**kwargs)
            if hasattr(result, "to_plotly_json"):  # a figure: build its JSON as a front end would
                result.to_plotly_json()
            presses += 1
    return presses
