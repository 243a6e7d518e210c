"""Chapter 3, from pattern to block table: the token mask over the tile grid, the tile classes, the block
table itself, tile amplification against tile size, block- vs token-level selection, and the recorded
build times of the ``layout`` suite."""
from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..bench.cases import BOOK_PATTERNS, book_layout, token_topk_mask
from ..bench.record import BenchFile, Impl, Pass
from ..layout import BlockLayout
from ..reference import reference_attention
from . import TILE_COLORS, Table

__all__ = ["BOOK_PATTERNS", "book_layout", "token_topk_mask", "mask_trace", "tile_trace", "layout_figure",
           "block_table", "amplification", "amplification_figure", "selection_contrast",
           "selection_contrast_figure", "layout_build_table"]


def _pool(mask: torch.Tensor, max_px: int = 128) -> torch.Tensor:
    """Fraction of allowed cells per pixel when the mask is larger than ``max_px``."""
    L = max(mask.shape)
    f = max(1, math.ceil(L / max_px))
    m = mask.float()[None, None]
    return torch.nn.functional.avg_pool2d(m, f, ceil_mode=True)[0, 0] if f > 1 else m[0, 0]


def mask_trace(dense: torch.Tensor, colorbar_x: float = None) -> go.Heatmap:
    """The token mask ``[Lq, Lk]`` as a heatmap in token coordinates (pooled to at most 128 pixels)."""
    pooled = _pool(dense)
    f = dense.shape[-1] / pooled.shape[-1]
    return go.Heatmap(z=pooled.tolist(), x0=(f - 1) / 2, dx=f, y0=(f - 1) / 2, dy=f, colorscale="Greys",
                      zmin=0, zmax=1, showscale=False, name="token mask",
                      hovertemplate="q %{y}, kv %{x}: %{z:.2f} allowed<extra></extra>")


def tile_trace(layout: BlockLayout, colorbar_x: float = 1.02, showscale: bool = True) -> go.Heatmap:
    """The tile classes of a layout (b = h = 0) with a colour key: empty / partial / full."""
    partial, full = layout.block_classes()
    cls = partial[0, 0].int() + 2 * full[0, 0].int()
    c = TILE_COLORS
    scale = [[0, c["empty"]], [1 / 3, c["empty"]], [1 / 3, c["partial"]], [2 / 3, c["partial"]],
             [2 / 3, c["full"]], [1, c["full"]]]
    return go.Heatmap(z=cls.tolist(), colorscale=scale, zmin=-0.5, zmax=2.5, xgap=1, ygap=1, name="tiles",
                      showscale=showscale,
                      colorbar=dict(tickvals=[0, 1, 2], ticktext=["empty", "partial", "full"], x=colorbar_x,
                                    len=0.8, thickness=14, outlinewidth=1, outlinecolor="#999"),
                      hovertemplate="q tile %{y}, kv tile %{x}: %{z} (0 empty, 1 partial, 2 full)<extra></extra>")


def layout_figure(pattern: str = "sinks + window", L: int = 512, block: int = 64,
                  window: Optional[int] = None) -> go.Figure:
    """Token mask (left) and tile classes (right, with a colour key), with the layout's stats in the title."""
    layout = book_layout(pattern, L, block, block, window=window)
    st = layout.stats()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("token mask (allowed = dark)", "tiles"),
                        horizontal_spacing=0.1)
    fig.add_trace(mask_trace(layout.to_dense()[0, 0]), 1, 1)
    for i in range(1, layout.nq):  # the tile grid over the token mask
        fig.add_shape(type="line", x0=0, x1=L, y0=i * block, y1=i * block, line=dict(color="#4a90d9", width=0.6),
                      row=1, col=1)
    for j in range(1, layout.nk):
        fig.add_shape(type="line", y0=0, y1=L, x0=j * block, x1=j * block, line=dict(color="#4a90d9", width=0.6),
                      row=1, col=1)
    fig.add_trace(tile_trace(layout), 1, 2)
    for c, unit in ((1, "position"), (2, "tile")):  # square cells: shrink the domain, never widen the range
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{c if c > 1 else ''}", constrain="domain",
                         title_text=f"query {unit}", row=1, col=c)
        fig.update_xaxes(title_text=f"key {unit}", constrain="domain", row=1, col=c)
    fig.update_layout(
        title=(f"{pattern}, L={L}, tiles {block}x{block}: ρ = {st['tile_amplification']:.2f}<br><sup>"
               f"logical density {st['logical_density']:.3f}, physical {st['physical_density']:.3f}; "
               f"{st['partial_tiles']} partial + {st['full_tiles']} full tiles; index {st['index_bytes']} B</sup>"),
        height=470, title_font_size=14, margin=dict(t=90))
    return fig


def block_table(pattern: str = "sinks + window", L: int = 1024, block: int = 64,
                window: Optional[int] = None) -> Table:
    """Every row of the block table: the partial tiles (``kv_count: kv_index``) and the full tiles
    (``full_count: full_index``) of each query tile."""
    layout = book_layout(pattern, L, block, block, window=window)

    def fmt(count, index, i):
        c = int(count[0, 0, i])
        return f"{c}: " + ", ".join(str(x) for x in index[0, 0, i, :c].tolist()) if c else "0"

    rows = [[i, fmt(layout.kv_count, layout.kv_index, i), fmt(layout.full_count, layout.full_index, i)]
            for i in range(layout.nq)]
    w = window or L // 8
    return Table(["query tile", "partial tiles (count: kv_index)", "full tiles (count: full_index)"], rows,
                 caption=f"block table of {pattern} (window {w}), L={L}, tiles {block}x{block}")


def amplification(L: int = 1024, blocks=(16, 32, 64, 128, 256), patterns=None) -> dict:
    """ρ per pattern (``window = L/8``) at each square tile size: ``{pattern: [ρ, ...]}``."""
    return {pat: [book_layout(pat, L, b, b, window=L // 8).stats()["tile_amplification"] for b in blocks]
            for pat in (patterns or BOOK_PATTERNS)}


def amplification_figure(L: int = 1024, blocks=(16, 32, 64, 128, 256), patterns=None) -> go.Figure:
    """Tile amplification ρ = physical / logical edges against the (square) tile size, per pattern."""
    rhos = amplification(L, blocks, patterns)
    fig = go.Figure()
    for pat, ys in rhos.items():
        fig.add_trace(go.Scatter(x=list(blocks), y=ys, mode="lines+markers", name=pat))
    fig.update_layout(title=f"Tile amplification against tile size, L = {L}<br><sup>computed from the block "
                            "tables (no GPU); window = L/8</sup>",
                      xaxis_title="tile size (block_q = block_k)", yaxis_title="ρ = physical / logical edges",
                      xaxis_type="log", yaxis_type="log", height=430, title_font_size=14)
    fig.update_xaxes(tickvals=list(blocks), ticktext=[str(b) for b in blocks])
    return fig


def selection_contrast(L: int = 256, block: int = 32, keep_blocks: int = 3, member_keep: float = 0.25, seed: int = 0):
    """Block-level vs token-level selection over the same tiles.

    Each query tile selects ``keep_blocks`` key tiles (plus its diagonal). Block-level: every key of a
    selected tile attends. Token-level: the same tiles are loaded, but only a ``member_keep`` fraction of their
    keys (a member mask) attends. Returns the two layouts and the two outputs."""
    g = torch.Generator().manual_seed(seed)
    n = L // block
    blocks = torch.zeros(n, n, dtype=torch.bool)
    for i in range(n):
        blocks[i, torch.randperm(i + 1, generator=g)[:keep_blocks]] = True
        blocks[i, i] = True
    dense_block = blocks.repeat_interleave(block, 0).repeat_interleave(block, 1) & torch.ones(L, L).tril().bool()
    members = torch.rand(L, L, generator=g) < member_keep
    members |= torch.eye(L, dtype=torch.bool)
    dense_token = dense_block & members
    lay_b = BlockLayout.from_dense(dense_block.view(1, 1, L, L), block, block)
    lay_t = BlockLayout.from_dense(dense_token.view(1, 1, L, L), block, block)
    q, k, v = (torch.randn(1, 1, L, 32, generator=g) for _ in range(3))
    o_b = reference_attention(q, k, v, dense_block.view(1, 1, L, L))
    o_t = reference_attention(q, k, v, dense_token.view(1, 1, L, L))
    return lay_b, lay_t, o_b, o_t


def selection_contrast_figure(member_keep: float = 0.25) -> go.Figure:
    """Tiles read and cells used by block- and token-level selection over the same tiles, and how far the two
    outputs are apart per query."""
    lay_b, lay_t, o_b, o_t = selection_contrast(member_keep=member_keep)
    sb, stt = lay_b.stats(), lay_t.stats()
    diff = (o_b - o_t).norm(dim=-1)[0, 0]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("cost and cells used", "output difference"),
                        horizontal_spacing=0.15)
    names = ["tiles read", "allowed cells (x1000)"]
    fig.add_trace(go.Bar(x=names, y=[sb["listed_tiles"], sb["logical_edges"] / 1000], name="block-level"), 1, 1)
    fig.add_trace(go.Bar(x=names, y=[stt["listed_tiles"], stt["logical_edges"] / 1000], name="token-level"), 1, 1)
    fig.add_trace(go.Scatter(y=diff.tolist(), mode="lines", name="|o_block - o_token|"), 1, 2)
    fig.update_xaxes(title_text="quantity", row=1, col=1)
    fig.update_yaxes(title_text="count", row=1, col=1)
    fig.update_xaxes(title_text="query position", row=1, col=2)
    fig.update_yaxes(title_text="L2 norm of the difference", row=1, col=2)
    fig.update_layout(title=(f"Same {sb['listed_tiles']} tiles read, different outputs<br><sup>token-level "
                             f"keeps {member_keep:.0%} of each tile's keys: ρ {stt['tile_amplification']:.1f} vs "
                             f"{sb['tile_amplification']:.1f}; fp64 on the CPU</sup>"),
                      height=460, title_font_size=14, legend=dict(orientation="h", y=-0.25))
    return fig


def layout_build_table(doc: BenchFile) -> Table:
    """The ``layout`` suite's build times per (pattern, N): ours against FlexAttention's ``create_block_mask``
    called eagerly (``_compile=False``, its default, which materialises the N x N mask) and compiled
    (``_compile=True``; "not measured" for a file recorded before the suite measured it)."""
    rows = doc.select(pass_=Pass.LAYOUT)
    cases = sorted({(r.case["pattern"], r.case["N"]) for r in rows}, key=lambda c: (c[1], c[0]))

    def cell(impl, case, compiled=None):
        found = [r for r in rows if r.impl == impl and (r.case["pattern"], r.case["N"]) == case
                 and (compiled is None or bool(r.get("compiled", False)) == compiled)]
        if not found:
            return "not measured"
        if len(found) > 1:
            raise LookupError(f"{len(found)} {impl} layout rows for {case} (compiled={compiled}); expected one")
        r = found[0]
        return ("out of memory" if "memory" in str(r.get("error", "")) else "failed") if r.ms is None \
            else f"{r.ms:.2f}"
    table = [[p, N, cell(Impl.OURS, (p, N)), cell(Impl.FLEX, (p, N), False), cell(Impl.FLEX, (p, N), True)]
             for p, N in cases]
    return Table(["pattern", "N", "ours (ms)", "Flex eager (ms)", "Flex compiled (ms)"], table,
                 caption=f"Block-table build time, tiles 128x128, host wall time; Flex = create_block_mask "
                         f"with _compile=False (eager) or True (compiled) ({doc.caption()})")
