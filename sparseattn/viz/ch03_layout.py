"""Chapter 3, from pattern to block table: the token mask over the tile grid, the tile classes, the block
table itself, tile amplification against tile size, block- vs token-level selection, and the recorded
build times of the ``layout`` suite."""
from __future__ import annotations

import math

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from ..bench.cases import BOOK_PATTERNS, book_layout, token_topk_mask
from ..bench.record import BenchFile, Impl, Pass
from ..layout import BlockLayout
from ..reference import reference_attention

__all__ = ["BOOK_PATTERNS", "book_layout", "token_topk_mask", "layout_figure", "block_table_figure",
           "amplification_figure", "selection_contrast", "selection_contrast_figure", "layout_build_table"]


def _pool(mask: torch.Tensor, max_px: int = 128) -> torch.Tensor:
    """Fraction of allowed cells per pixel when the mask is larger than ``max_px``."""
    L = max(mask.shape)
    f = max(1, math.ceil(L / max_px))
    m = mask.float()[None, None]
    return torch.nn.functional.avg_pool2d(m, f, ceil_mode=True)[0, 0] if f > 1 else m[0, 0]


def layout_figure(pattern: str = "sinks + window", L: int = 512, block_q: int = 64, block_k: int = 64) -> go.Figure:
    """Token mask with the tile grid, and the tile classes (empty / partial / full) with the layout's stats."""
    layout = book_layout(pattern, L, block_q, block_k)
    dense = layout.to_dense()[0, 0]
    st = layout.stats()
    partial, full = layout.block_classes()
    cls = partial[0, 0].int() + 2 * full[0, 0].int()
    fig = make_subplots(rows=1, cols=2, subplot_titles=("token mask (allowed = dark)",
                                                         "tiles: empty / partial / full"),
                        horizontal_spacing=0.08)
    pooled = _pool(dense)
    scale = L / pooled.shape[0]
    fig.add_trace(go.Heatmap(z=pooled.tolist(), x0=0, dx=scale, y0=0, dy=scale, colorscale="Greys",
                             showscale=False, zmin=0, zmax=1, hovertemplate="q %{y}, kv %{x}: %{z:.2f}<extra></extra>"),
                  1, 1)
    for i in range(1, layout.nq):
        fig.add_shape(type="line", x0=0, x1=L, y0=i * block_q, y1=i * block_q, line=dict(color="#4a90d9", width=0.6),
                      row=1, col=1)
    for j in range(1, layout.nk):
        fig.add_shape(type="line", y0=0, y1=L, x0=j * block_k, x1=j * block_k, line=dict(color="#4a90d9", width=0.6),
                      row=1, col=1)
    fig.add_trace(go.Heatmap(z=cls.tolist(), colorscale=[[0, "#ffffff"], [0.5, "#f4a259"], [1, "#2a6f97"]],
                             zmin=0, zmax=2, showscale=False, xgap=1, ygap=1,
                             hovertemplate="q tile %{y}, kv tile %{x}: %{z} (0 empty, 1 partial, 2 full)<extra></extra>"),
                  1, 2)
    for c in (1, 2):
        fig.update_yaxes(autorange="reversed", scaleanchor=f"x{c if c > 1 else ''}", row=1, col=c)
    fig.update_layout(
        title=(f"{pattern}, L={L}, tiles {block_q}x{block_k}: rho = {st['tile_amplification']:.2f}<br>"
               f"logical density {st['logical_density']:.3f}, physical {st['physical_density']:.3f}, "
               f"{st['partial_tiles']} partial + {st['full_tiles']} full tiles, index {st['index_bytes']} B"),
        height=500, title_font_size=13, margin=dict(t=90))
    return fig


def block_table_figure(pattern: str = "sinks + window", L: int = 512, block: int = 64, rows: int = 8) -> go.Figure:
    """The first ``rows`` rows of the block table: kv_count / kv_index (partial) and full_count / full_index."""
    layout = book_layout(pattern, L, block, block)
    n = min(rows, layout.nq)

    def fmt(count, index, i):
        c = int(count[0, 0, i])
        return f"{c}: " + ", ".join(str(x) for x in index[0, 0, i, :c].tolist())

    cells = [list(range(n)),
             [fmt(layout.kv_count, layout.kv_index, i) for i in range(n)],
             [fmt(layout.full_count, layout.full_index, i) for i in range(n)]]
    fig = go.Figure(go.Table(header=dict(values=["query tile", "partial: count: kv_index", "full: count: full_index"]),
                             cells=dict(values=cells, align="left")))
    fig.update_layout(title=f"block table of {pattern}, L={L}, tiles {block}x{block}", height=80 + 28 * n)
    return fig


def amplification_figure(L: int = 1024, blocks=(16, 32, 64, 128, 256), patterns=None) -> go.Figure:
    """Tile amplification rho = physical / logical edges against the (square) tile size, per pattern."""
    patterns = patterns or BOOK_PATTERNS
    fig = go.Figure()
    for pat in patterns:
        rhos = [book_layout(pat, L, b, b, window=L // 8).stats()["tile_amplification"] for b in blocks]
        fig.add_trace(go.Scatter(x=list(blocks), y=rhos, mode="lines+markers", name=pat))
    fig.update_layout(title=f"Tile amplification vs tile size (L={L})", xaxis_title="tile size (block_q = block_k)",
                      yaxis_title="rho = physical / logical edges", xaxis_type="log", yaxis_type="log", height=420)
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
    lay_b, lay_t, o_b, o_t = selection_contrast(member_keep=member_keep)
    sb, stt = lay_b.stats(), lay_t.stats()
    diff = (o_b - o_t).norm(dim=-1)[0, 0]
    fig = make_subplots(rows=1, cols=2, subplot_titles=("tiles read and cells used", "output difference per query"))
    names = ["tiles read", "logical edges (x1000)"]
    fig.add_trace(go.Bar(x=names, y=[sb["listed_tiles"], sb["logical_edges"] / 1000], name="block-level"), 1, 1)
    fig.add_trace(go.Bar(x=names, y=[stt["listed_tiles"], stt["logical_edges"] / 1000], name="token-level"), 1, 1)
    fig.add_trace(go.Scatter(y=diff.tolist(), mode="lines", name="||o_block - o_token||"), 1, 2)
    fig.update_layout(title=(f"Same tiles read ({sb['listed_tiles']} vs {stt['listed_tiles']}), different outputs: "
                             f"token-level keeps {member_keep:.0%} of each tile, rho {stt['tile_amplification']:.1f} "
                             f"vs {sb['tile_amplification']:.1f}"), height=420, title_font_size=13)
    return fig


def layout_build_table(doc: BenchFile) -> go.Figure:
    """The ``layout`` suite's build times per (pattern, N): ours against FlexAttention's create_block_mask
    (``out of memory`` where it failed)."""
    rows = doc.select(pass_=Pass.LAYOUT)
    cases = sorted({(r.case["pattern"], r.case["N"]) for r in rows}, key=lambda c: (c[1], c[0]))

    def ms(impl, case):
        r = next((r for r in rows if r.impl == impl and (r.case["pattern"], r.case["N"]) == case), None)
        return "" if r is None else ("out of memory" if r.ms is None else f"{r.ms:.2f}")
    fig = go.Figure(go.Table(header=dict(values=["pattern", "N", "sparseattn build (ms)",
                                                 "FlexAttention create_block_mask (ms)"]),
                             cells=dict(values=[[c[0] for c in cases], [c[1] for c in cases],
                                                [ms(Impl.OURS, c) for c in cases], [ms(Impl.FLEX, c) for c in cases]])))
    fig.update_layout(title=f"Block-table build time, block 128 ({doc.caption()})", height=520, title_font_size=12)
    return fig
