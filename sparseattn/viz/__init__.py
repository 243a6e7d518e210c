"""Figures for the book, one module per chapter (``from sparseattn.viz import ch05_prefill as viz``).

Each function computes for one configuration, or reads recorded measurements through
:mod:`sparseattn.bench.record`, and returns a ``plotly`` Figure; live notebooks wrap them in widgets, the
static book sweeps them with ``book.static_explorer``. Imported only by notebooks (it imports plotly).

:data:`COLORS` gives every implementation one colour across the whole book, keyed by the
:class:`~sparseattn.bench.record.Impl` names the records carry. Tables are :class:`Table` (plain HTML: every
row is always visible), never plotly tables.
"""
from __future__ import annotations

from ..bench.record import Impl
from ._table import Table

#: One colour per implementation, everywhere in the book.
COLORS = {
    Impl.OURS: "#d62728",
    Impl.OURS_ATOMIC: "#ff9896",
    Impl.OURS_NOSPLIT: "#e377c2",
    Impl.OURS_SPLIT: "#8c0d0d",
    Impl.FLEX: "#1f77b4",
    Impl.CUDNN: "#2ca02c",
    Impl.FA2: "#9467bd",
    Impl.NAIVE: "#7f7f7f",
    Impl.TORCH_EAGER: "#8c564b",
    Impl.READ_CEILING: "#000000",
}
#: A lighter shade of an implementation's colour, for a second series of the same implementation
#: (our selected step beside our decode, FlexAttention's block mask beside its dense decode).
LIGHT = {Impl.OURS: "#ff9896", Impl.FLEX: "#aec7e8"}
#: The three tile classes, everywhere a tile grid is drawn.
TILE_COLORS = {"empty": "#ffffff", "partial": "#f4a259", "full": "#2a6f97"}

__all__ = ["COLORS", "LIGHT", "TILE_COLORS", "Table"]
