"""sparseattn: block-sparse attention in Triton, and the book that measures it.

Importing the package touches no GPU and imports neither plotly nor ipywidgets; Triton kernels are
defined on first use (see :mod:`sparseattn._runtime`).
"""
from . import patterns
from .layout import BlockLayout, TransposedLists
from .ops import BwdConfig, DecodeConfig, FwdConfig, routed_attention, sparse_attention, sparse_decode
from .paged import PageSelection, PagedKVCache
from .routing import route, select_pages, selection_recall
from .reference import merge_states, reference_attention

__version__ = "0.1.0"

__all__ = ["patterns", "BlockLayout", "TransposedLists", "reference_attention", "merge_states", "sparse_attention",
           "sparse_decode", "PagedKVCache", "PageSelection", "select_pages", "FwdConfig", "BwdConfig",
           "DecodeConfig", "route", "selection_recall", "routed_attention",
           "__version__"]
