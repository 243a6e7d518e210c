"""The mask gallery: every generator of :data:`sparseattn.patterns.CATALOGUE`, and compositions of them, drawn
as a token mask and as tiles at two tile sizes, with the tile amplification ρ of each. Computed on the CPU
from the block tables alone."""
from __future__ import annotations

from typing import Callable, Dict, List, Tuple

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from .. import patterns as P
from ..layout import BlockLayout
from . import Table
from .ch03_layout import mask_trace, tile_trace

__all__ = ["gallery", "gallery_layout", "gallery_figure", "gallery_table", "TILE_SIZES"]

#: The two tile sizes every pattern is drawn at.
TILE_SIZES = (16, 64)


def _documents(L: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(3)
    lengths = torch.randint(L // 12, L // 3, (16,), generator=g)
    return torch.repeat_interleave(torch.arange(16), lengths)[:L]


def gallery(L: int = 256) -> Dict[str, Tuple[str, str, Callable]]:
    """``{label: (catalogue name of the outermost generator or combinator, code, mask_mod)}`` at length ``L``:
    every catalogue generator on its own, then compositions."""
    w, n = L // 8, L // 32
    docs = _documents(L)
    return {
        "full": ("full", "full()", P.full()),
        "causal": ("causal", "causal()", P.causal()),
        "sliding window": ("sliding_window", f"sliding_window({w})", P.sliding_window(w)),
        "sinks": ("sinks", f"sinks({n})", P.sinks(n)),
        "sinks + window": ("sinks_window", f"sinks_window({n}, {w})", P.sinks_window(n, w)),
        "dilated": ("dilated", "dilated(4)", P.dilated(4)),
        "block-random": ("block_random", "block_random(0.2, 32, seed=0)", P.block_random(0.2, 32, seed=0)),
        "documents": ("document", "document(doc_ids)  # 16 packed documents", P.document(docs)),
        "prefix-LM": ("prefix_lm", f"prefix_lm({L // 4})", P.prefix_lm(L // 4)),
        "causal dilated": ("and_masks", "and_masks(causal(), dilated(4))", P.and_masks(P.causal(), P.dilated(4))),
        "causal block-random": ("and_masks", "and_masks(causal(), block_random(0.2, 32))",
                                P.and_masks(P.causal(), P.block_random(0.2, 32, seed=0))),
        "causal documents": ("and_masks", "and_masks(causal(), document(doc_ids))",
                             P.and_masks(P.causal(), P.document(docs))),
        "window or dilated": ("or_masks", f"and_masks(causal(), or_masks(sliding_window({w}), dilated(8)))",
                              P.and_masks(P.causal(), P.or_masks(P.sliding_window(w), P.dilated(8)))),
        "causal outside the window": ("not_mask", f"and_masks(causal(), not_mask(sliding_window({w})))",
                                      P.and_masks(P.causal(), P.not_mask(P.sliding_window(w)))),
    }


def gallery_layout(label: str, L: int = 256, block: int = 16) -> BlockLayout:
    """The block table of a gallery entry at one tile size."""
    entries = gallery(L)
    if label not in entries:
        raise ValueError(f"label must be one of {list(entries)}, got {label!r}")
    return BlockLayout.from_mask_mod(entries[label][2], L, L, block, block, device="cpu")


def gallery_figure(label: str = "sinks + window", L: int = 256) -> go.Figure:
    """Token mask, and tiles at the two :data:`TILE_SIZES` with their ρ, of one gallery entry."""
    code = gallery(L)[label][1]
    lays = [gallery_layout(label, L, b) for b in TILE_SIZES]
    titles = ["token mask"] + [f"tiles {b}x{b}: ρ = {lay.stats()['tile_amplification']:.2f}"
                               for b, lay in zip(TILE_SIZES, lays)]
    fig = make_subplots(rows=1, cols=3, subplot_titles=titles, horizontal_spacing=0.07)
    fig.add_trace(mask_trace(lays[0].to_dense()[0, 0]), 1, 1)
    for c, lay in enumerate(lays, start=2):
        fig.add_trace(tile_trace(lay, showscale=c == 3), 1, c)
    for c in (1, 2, 3):
        unit = "position" if c == 1 else "tile"
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{c if c > 1 else ''}", constrain="domain",
                         title_text=f"query {unit}", row=1, col=c)
        fig.update_xaxes(title_text=f"key {unit}", constrain="domain", row=1, col=c)
    st = lays[0].stats()
    fig.update_layout(title=f"{label}: {code.split('  #')[0]}<br><sup>L = {L}, logical density "
                            f"{st['logical_density']:.3f}; computed on the CPU from the block tables</sup>",
                      height=400, title_font_size=14, margin=dict(t=100))
    return fig


def gallery_table(L: int = 256) -> Table:
    """Every gallery entry: its code, logical density, and tiles and ρ at both tile sizes."""
    rows: List[list] = []
    for label, (_, code, _) in gallery(L).items():
        cells = [label, code.split("  #")[0]]
        for b in TILE_SIZES:
            st = gallery_layout(label, L, b).stats()
            if b == TILE_SIZES[0]:
                cells.append(f"{st['logical_density']:.3f}")
            cells += [f"{st['partial_tiles']} / {st['full_tiles']}", f"{st['tile_amplification']:.2f}"]
        rows.append(cells)
    b0, b1 = TILE_SIZES
    return Table(["pattern", "code", "logical density", f"partial / full at {b0}", f"ρ at {b0}",
                  f"partial / full at {b1}", f"ρ at {b1}"], rows,
                 caption=f"every pattern at L = {L}, square tiles of {b0} and {b1}")
