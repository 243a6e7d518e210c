"""Figures for the book. Each function computes for one configuration and returns a ``plotly`` Figure; live
notebooks wrap them in widgets, the static book sweeps them with ``book.static_explorer``.
Imported only by notebooks (it imports plotly)."""
from __future__ import annotations

import math
from typing import Optional

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from . import patterns as P
from .layout import BlockLayout
from .reference import merge_states, reference_attention

COLORS = {"sparseattn": "#d62728", "flex": "#1f77b4", "cudnn": "#2ca02c", "fa2": "#9467bd", "naive": "#7f7f7f"}


# ---------------------------------------------------------------------------------------------------------
# chapter 2: the merge law
# ---------------------------------------------------------------------------------------------------------
def _row(n: int, seed: int, dtype=torch.float32, d: int = 16):
    g = torch.Generator().manual_seed(seed)
    s = (torch.randn(n, generator=g, dtype=torch.float64) * 3).to(dtype)
    v = torch.randn(n, d, generator=g, dtype=torch.float64).to(dtype)
    return s, v


def _state(s: torch.Tensor, v: torch.Tensor):
    """(o, lse) of one chunk; an empty chunk is (0, -inf)."""
    if s.numel() == 0:
        return torch.zeros(v.shape[-1], dtype=v.dtype), torch.tensor(float("-inf"), dtype=s.dtype)
    return torch.softmax(s, 0) @ v, torch.logsumexp(s, 0)


def split_and_merge(s: torch.Tensor, v: torch.Tensor, chunks: int, seed: int):
    """Cut a row into ``chunks`` random pieces, merge their states in a random order; return (o, lse)."""
    g = torch.Generator().manual_seed(seed)
    n = s.numel()
    cuts = sorted(torch.randint(0, n + 1, (chunks - 1,), generator=g).tolist())
    bounds = [0, *cuts, n]
    states = [_state(s[a:b], v[a:b]) for a, b in zip(bounds[:-1], bounds[1:])]
    order = torch.randperm(len(states), generator=g).tolist()
    o, lse = states[order[0]]
    for i in order[1:]:
        o, lse = merge_states(o, lse, *states[i])
    return o, lse


def merge_error_figure(chunks: int = 8, n: int = 4096, trials: int = 40) -> go.Figure:
    """Error of split-and-merge against the one-pass softmax, fp32 vs fp64, over random splits and orders."""
    fig = go.Figure()
    for dtype, name in ((torch.float32, "fp32"), (torch.float64, "fp64")):
        errs = []
        for t in range(trials):
            s, v = _row(n, seed=t, dtype=dtype)
            o_full = torch.softmax(s.double(), 0) @ v.double()
            o, _ = split_and_merge(s, v, chunks, seed=1000 + t)
            errs.append(float((o.double() - o_full).abs().max()))
        fig.add_trace(go.Scatter(x=list(range(trials)), y=errs, mode="markers", name=f"{name} merged"))
        eps = torch.finfo(dtype).eps
        fig.add_trace(go.Scatter(x=[0, trials - 1], y=[eps, eps], mode="lines", line=dict(dash="dot"),
                                 name=f"{name} machine epsilon"))
    fig.update_layout(title=f"Any split, any order: {chunks} random chunks of a {n}-key row, merged",
                      xaxis_title="trial (random cut points and merge order)",
                      yaxis_title="max |merged - one-pass softmax|", yaxis_type="log", height=420)
    return fig


def duplicate_tile_figure(duplicated: Optional[int] = 3, n: int = 512, tile: int = 64) -> go.Figure:
    """Attention weights of one row when tile ``duplicated`` is merged twice (None = no duplicate)."""
    s, v = _row(n, seed=7, dtype=torch.float64)
    p_true = torch.softmax(s, 0)
    tiles = [(a, min(a + tile, n)) for a in range(0, n, tile)]
    order = list(range(len(tiles))) + ([duplicated] if duplicated is not None else [])
    # the weight each key ends up with: exp(s) / (sum of exp over every *visited* tile, duplicates included)
    z = sum(float(torch.exp(s[a:b]).sum()) for a, b in (tiles[i] for i in order))
    w = torch.exp(s) / z
    if duplicated is not None:
        a, b = tiles[duplicated]
        w[a:b] *= 2
    o_true = p_true @ v
    states = [_state(s[a:b], v[a:b]) for a, b in (tiles[i] for i in order)]
    o_dup, _ = states[0]
    lse = states[0][1]
    for st in states[1:]:
        o_dup, lse = merge_states(o_dup, lse, *st)
    err = float((o_dup - o_true).abs().max())
    fig = go.Figure()
    fig.add_trace(go.Scatter(y=p_true.tolist(), name="exact softmax", mode="lines"))
    fig.add_trace(go.Scatter(y=w.tolist(), name="weights after merging", mode="lines"))
    label = "no duplicate" if duplicated is None else f"tile {duplicated} merged twice"
    fig.update_layout(title=f"{label}: weights sum to {float(w.sum()):.3f}, max output error {err:.1e}",
                      xaxis_title="key position", yaxis_title="attention weight", height=400)
    return fig


# ---------------------------------------------------------------------------------------------------------
# chapter 3: from pattern to block table
# ---------------------------------------------------------------------------------------------------------
def token_topk_mask(L: int, k: int, seed: int = 0) -> torch.Tensor:
    """Token-level routing: each query keeps its top-``k`` earlier keys by a random score ([1, 1, L, L])."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(L, L, generator=g)
    causal = torch.ones(L, L, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, -1.0)
    idx = scores.topk(min(k, L), dim=-1).indices
    mask = torch.zeros(L, L, dtype=torch.bool).scatter_(1, idx, True) & causal
    return mask.view(1, 1, L, L)


BOOK_PATTERNS = ["sliding window", "sinks + window", "dilated", "block-random", "documents", "token top-k"]


def book_layout(pattern: str, L: int, block_q: int, block_k: int, window: Optional[int] = None) -> BlockLayout:
    """The chapter's patterns at length ``L``, scaled with it (window L/8, 4 sinks, ...)."""
    w = window or max(L // 8, 1)
    if pattern == "sliding window":
        mm = P.sliding_window(w)
    elif pattern == "sinks + window":
        mm = P.sinks_window(4, w)
    elif pattern == "dilated":
        mm = P.and_masks(P.causal(), P.dilated(4), P.sliding_window(4 * w))
    elif pattern == "block-random":
        mm = P.or_masks(P.and_masks(P.causal(), P.block_random(0.15, 64, seed=1)), P.sliding_window(16))
    elif pattern == "documents":
        g = torch.Generator().manual_seed(2)
        lengths = torch.randint(L // 16, L // 3, (32,), generator=g)
        ids = torch.repeat_interleave(torch.arange(32), lengths)[:L]
        ids = torch.cat([ids, ids.new_full((max(L - ids.numel(), 0),), 32)])
        mm = P.and_masks(P.causal(), P.document(ids))
    elif pattern == "token top-k":
        return BlockLayout.from_dense(token_topk_mask(L, max(w // 4, 1)), block_q, block_k)
    else:
        raise ValueError(f"unknown pattern {pattern!r}; choose from {BOOK_PATTERNS}")
    return BlockLayout.from_mask_mod(mm, L, L, block_q, block_k, device="cpu")


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


# ---------------------------------------------------------------------------------------------------------
# chapter 5: the prefill kernel, measured
# ---------------------------------------------------------------------------------------------------------
def _rows(doc: dict, **match):
    out = []
    for r in doc["results"]:
        if r.get("sweep"):
            continue
        if all(r["case"].get(k) == v for k, v in match.items()):
            out.append(r)
    return out


def prefill_time_figure(doc: dict, pattern: str = "window1024") -> go.Figure:
    """Forward time vs N for one pattern: ours, FlexAttention on the same block mask, cuDNN dense/causal."""
    fig = go.Figure()
    for impl in ("sparseattn", "flex", "naive"):
        rs = sorted(_rows(doc, pattern=pattern), key=lambda r: r["case"]["N"])
        rs = [r for r in rs if r["impl"] == impl and r.get("ms")]
        if rs:
            fig.add_trace(go.Scatter(x=[r["case"]["N"] for r in rs], y=[r["ms"] for r in rs], mode="lines+markers",
                                     name=impl, line=dict(color=COLORS[impl])))
    dense_pat = "causal" if pattern == "causal" else "dense"
    for impl in ("cudnn", "fa2"):
        rs = sorted([r for r in _rows(doc, pattern=dense_pat) if r["impl"] == impl], key=lambda r: r["case"]["N"])
        if rs:
            fig.add_trace(go.Scatter(x=[r["case"]["N"] for r in rs], y=[r["ms"] for r in rs], mode="lines+markers",
                                     name=f"{impl} {dense_pat}", line=dict(color=COLORS[impl], dash="dash")))
    from .book import caption
    fig.update_layout(title=f"{pattern}: forward time, bf16, B=1, H=16, D=128 ({caption(doc)})",
                      xaxis_title="sequence length N", yaxis_title="ms (median)", xaxis_type="log",
                      yaxis_type="log", height=440, title_font_size=12)
    return fig


def prefill_speedup_figure(doc: dict) -> go.Figure:
    """Speedup over cuDNN (dense, or causal for the causal pattern) and over FlexAttention, every case."""
    fig = go.Figure()
    cudnn = {(r["case"]["pattern"], r["case"]["N"]): r["ms"] for r in doc["results"] if r["impl"] == "cudnn"}
    for base in ("cudnn", "flex"):
        xs, ys, text = [], [], []
        for r in _rows(doc):
            if r["impl"] != "sparseattn" or "logical_density" not in r["case"]:
                continue
            c = r["case"]
            if base == "cudnn":
                ref = cudnn.get(("causal" if c["pattern"] == "causal" else "dense", c["N"]))
            else:
                ref = next((x["ms"] for x in _rows(doc, pattern=c["pattern"], N=c["N"]) if x["impl"] == "flex"), None)
            if ref:
                xs.append(c["logical_density"])
                ys.append(ref / r["ms"])
                text.append(f"{c['pattern']} N={c['N']}")
        fig.add_trace(go.Scatter(x=xs, y=ys, text=text, mode="markers", name=f"vs {base}",
                                 marker=dict(size=9, color=COLORS[base])))
    fig.add_hline(y=1.0, line_dash="dot")
    from .book import caption
    fig.update_layout(title=f"Speedup of the sparse kernel vs logical density ({caption(doc)})",
                      xaxis_title="logical density (allowed cells / all cells)", yaxis_title="time(baseline) / time(ours)",
                      xaxis_type="log", yaxis_type="log", height=440, title_font_size=12)
    return fig


# ---------------------------------------------------------------------------------------------------------
# chapter 4: index formats and traversal direction
# ---------------------------------------------------------------------------------------------------------
def table_heatmaps(layout: BlockLayout, title: str = "") -> go.Figure:
    """Forward rows (which key tiles each query tile visits) next to the transposed columns (which query
    tiles visit each key tile), drawn as ``rank within the list`` so the traversal order shows."""
    import numpy as np
    nq, nk = layout.nq, layout.nk
    fwd = np.full((nq, nk), np.nan)
    for count, index, off in ((layout.kv_count, layout.kv_index, 0), (layout.full_count, layout.full_index, 0.5)):
        for i in range(nq):
            for r, j in enumerate(index[0, 0, i, : int(count[0, 0, i])].tolist()):
                fwd[i, j] = r + off
    bwd = np.full((nq, nk), np.nan)
    for count, index, off in ((layout.q_count, layout.q_index, 0), (layout.full_q_count, layout.full_q_index, 0.5)):
        for j in range(nk):
            for r, i in enumerate(index[0, 0, j, : int(count[0, 0, j])].tolist()):
                bwd[i, j] = r + off
    fig = make_subplots(rows=1, cols=2, subplot_titles=("forward: row i lists key tiles (dQ, O)",
                                                         "transposed: column j lists query tiles (dK, dV)"))
    fig.add_trace(go.Heatmap(z=fwd.tolist(), colorscale="Blues", showscale=False, xgap=1, ygap=1,
                             hovertemplate="q tile %{y}, kv tile %{x}: position %{z}<extra></extra>"), 1, 1)
    fig.add_trace(go.Heatmap(z=bwd.tolist(), colorscale="Oranges", showscale=False, xgap=1, ygap=1,
                             hovertemplate="q tile %{y}, kv tile %{x}: position %{z}<extra></extra>"), 1, 2)
    for c in (1, 2):
        fig.update_yaxes(autorange="reversed", title_text="query tile", row=1, col=c)
        fig.update_xaxes(title_text="key tile", row=1, col=c)
    fig.update_layout(title=title or "The same tiles, listed by rows and by columns (shade = position in the list; "
                      "full tiles +0.5)", height=430, title_font_size=12)
    return fig


def index_bytes_figure(Ns=(4096, 8192, 16384, 32768, 65536, 131072), H: int = 16, D: int = 128) -> go.Figure:
    """Bytes of the block tables (forward + transposed) against the bytes of K and V they index (bf16)."""
    from . import patterns as P
    pats = {"window 1024": P.sliding_window(1024),
            "sinks 64 + window 1024": P.sinks_window(64, 1024),
            "causal": P.causal()}
    fig = go.Figure()
    for name, mm in pats.items():
        ratios = []
        for N in Ns:
            st = BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cpu").stats()
            kv_bytes = 2 * N * H * D * 2  # K and V, bf16, one layout shared by H heads
            ratios.append((st["index_bytes"] + st["transposed_index_bytes"]) / kv_bytes)
        fig.add_trace(go.Scatter(x=list(Ns), y=ratios, mode="lines+markers", name=name))
    fig.update_layout(title=f"Index bytes / K+V bytes (block 128, H={H}, D={D}, bf16, one table shared by the heads)",
                      xaxis_title="N", yaxis_title="ratio", xaxis_type="log", yaxis_type="log", height=400,
                      title_font_size=12)
    return fig


def transpose_cost_figure(Ns=(2048, 4096, 8192, 16384, 32768), block: int = 64, repeat: int = 5) -> go.Figure:
    """Time of the on-device transpose (here: on this machine's device) against the number of listed tiles."""
    import time
    from . import patterns as P
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    fig = go.Figure()
    for name, mm in (("window 1024", P.sliding_window(1024)), ("causal", P.causal())):
        xs, ys = [], []
        for N in Ns:
            lay = BlockLayout.from_mask_mod(mm, N, N, block, block, device=dev)
            best = float("inf")
            for _ in range(repeat):
                if dev == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                lay.transpose(width=lay.nq)
                if dev == "cuda":
                    torch.cuda.synchronize()
                best = min(best, time.perf_counter() - t0)
            xs.append(int(lay.kv_count.sum() + lay.full_count.sum()))
            ys.append(best * 1e3)
        fig.add_trace(go.Scatter(x=xs, y=ys, mode="lines+markers", name=name))
    fig.update_layout(title=f"Transpose time vs listed tiles, block {block}, measured live on {dev} (best of {repeat})",
                      xaxis_title="listed tiles (nnz)", yaxis_title="ms", xaxis_type="log", yaxis_type="log",
                      height=400, title_font_size=12)
    return fig


# ---------------------------------------------------------------------------------------------------------
# chapter 6: backward, traversal direction and determinism
# ---------------------------------------------------------------------------------------------------------
def column_work_figure(N: int = 32768, chunk: Optional[int] = None) -> go.Figure:
    """Work per dK/dV program (listed query tiles) for sinks + window, without and with column splitting."""
    from . import patterns as P
    from .ops import column_work
    mm = P.sinks_window(64, 1024)
    lay = BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cpu")
    totals = (lay.q_count + lay.full_q_count)[0, 0].long()
    work, _, _, _, used_chunk = column_work(lay, 128, chunk)
    per_item = torch.clamp(totals[work[:, 0].long()] - work[:, 1].long() * used_chunk, min=0, max=used_chunk)
    fig = go.Figure()
    fig.add_trace(go.Histogram(x=totals.tolist(), name="one program per key tile", opacity=0.7, nbinsx=60))
    fig.add_trace(go.Histogram(x=per_item.tolist(), name=f"split into chunks of <= {used_chunk}", opacity=0.7,
                               nbinsx=60))
    fig.update_layout(barmode="overlay", yaxis_type="log", height=400, title_font_size=12,
                      title=(f"dK/dV work per program, sinks 64 + window 1024, N={N}: the sink column lists "
                             f"{int(totals.max())} query tiles, the median {int(totals.median())}"),
                      xaxis_title="query tiles walked by one program", yaxis_title="programs")
    return fig


def backward_figure(bwd: dict, fwd: dict) -> go.Figure:
    """Forward and backward times per pattern at N = 32k: ours (deterministic, atomic), FlexAttention, cuDNN."""
    N = 32768
    pats = ["causal", "window1024", "sinks64+window1024", "random10%+diag"]

    def ms(doc, pattern, impl, pass_):
        for r in doc["results"]:
            if (r["case"].get("pattern") == pattern and r["case"].get("N") == N and r["impl"] == impl
                    and r["pass"] == pass_ and not r.get("sweep")):
                return r["ms"]
        return None

    fig = go.Figure()
    for impl, label, color in (("sparseattn", "sparseattn deterministic", COLORS["sparseattn"]),
                               ("sparseattn-atomic", "sparseattn atomic dQ", "#ff9896"),
                               ("flex", "FlexAttention", COLORS["flex"])):
        fig.add_trace(go.Bar(x=pats, y=[ms(bwd, p, impl, "bwd") for p in pats], name=f"{label}: backward",
                             marker_color=color))
    fig.add_trace(go.Bar(x=pats, y=[ms(fwd, p, "sparseattn", "fwd") for p in pats], name="sparseattn: forward",
                         marker_color="#555555"))
    cud = [ms(bwd, "causal" if p == "causal" else "dense", "cudnn", "bwd") for p in pats]
    fig.add_trace(go.Scatter(x=pats, y=cud, mode="markers", marker=dict(symbol="line-ew-open", size=40,
                                                                         color=COLORS["cudnn"]),
                             name="cuDNN backward, same work (dense or causal)"))
    from .book import caption
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="ms (median)", height=460, title_font_size=12,
                      title=f"Backward and forward at N = 32k, bf16, H=16, D=128 ({caption(bwd)})")
    return fig


# ---------------------------------------------------------------------------------------------------------
# chapter 7: decode over a paged KV cache
# ---------------------------------------------------------------------------------------------------------
def splits_figure(Hkv: int = 8, L: int = 131072, page_size: int = 16, sms: int = 132) -> go.Figure:
    """Programs launched by split-KV decoding vs batch size, from shapes alone (the H200 has 132 SMs), with the
    default :class:`DecodeConfig`."""
    from .ops import DecodeConfig, decode_programs_per_sm, decode_splits
    cfg = DecodeConfig()
    Bs = [1, 2, 4, 8, 16, 32, 64]
    splits, progs = [], []
    for B in Bs:
        n, _ = decode_splits(B, Hkv, L, cfg.block_n, sms, decode_programs_per_sm(cfg, B, Hkv, sms))
        splits.append(n)
        progs.append(n * B * Hkv)
    fig = go.Figure()
    fig.add_trace(go.Bar(x=[str(b) for b in Bs], y=[B * Hkv for B in Bs], name="programs without splitting"))
    fig.add_trace(go.Bar(x=[str(b) for b in Bs], y=progs, name="programs with split-KV",
                         text=[f"{s} splits" for s in splits], textposition="outside"))
    fig.add_hline(y=sms, line_dash="dot", annotation_text=f"{sms} SMs")
    fig.update_layout(barmode="group", yaxis_type="log", xaxis_title="batch (sequences decoded together)",
                      yaxis_title="programs in the launch", height=400, title_font_size=12,
                      title=f"Split count from shapes only: Hkv={Hkv}, capacity {L} tokens")
    return fig


def bound_figure(page_size: int = 16, L: int = 2048, seed: int = 0) -> go.Figure:
    """Quest's per-page bound against the true best score of the page (every point must lie above y = x)."""
    from .paged import PagedKVCache
    from .routing import page_bounds
    g = torch.Generator().manual_seed(seed)
    cache = PagedKVCache(L // page_size + 1, page_size, 1, 64, dtype=torch.float32, device="cpu", max_seqs=1)
    drift = torch.cumsum(torch.randn(L, 1, 64, generator=g) * 0.1, 0)  # slowly varying keys, like real ones
    cache.append(0, drift + torch.randn(L, 1, 64, generator=g) * 0.5, torch.randn(L, 1, 64, generator=g))
    q = torch.randn(1, 1, 64, generator=g)
    bound = page_bounds(q, cache)[0, 0, : L // page_size]
    k, _ = cache.gather_dense(0)
    best = (k[0] @ q[0, 0]).view(-1, page_size).amax(1)
    fig = go.Figure()
    fig.add_trace(go.Scatter(x=best.tolist(), y=bound.tolist(), mode="markers", name="pages"))
    lo, hi = float(best.min()), float(bound.max())
    fig.add_trace(go.Scatter(x=[lo, hi], y=[lo, hi], mode="lines", line=dict(dash="dot"), name="bound = best"))
    fig.update_layout(title=f"Page bound vs the page's true best score (page size {page_size})",
                      xaxis_title="max over the page of q . k", yaxis_title="bound from per-page min/max of K",
                      height=420, title_font_size=12)
    return fig


_DECODE_SERIES = [  # (impl, pass, legend, color)
    ("sparseattn", "decode", "ours: decode through the paged cache", COLORS["sparseattn"]),
    ("sparseattn", "select+decode (CUDA graph)", "ours: select + decode, one CUDA graph", "#ff9896"),
    ("cudnn", "decode dense", "cuDNN dense, contiguous KV", COLORS["cudnn"]),
    ("fa2", "decode dense", "FlashAttention-2 dense, contiguous KV", COLORS["fa2"]),
    ("flex", "decode dense", "FlexAttention dense", COLORS["flex"]),
    ("flex", "decode block mask", "FlexAttention, same keep fraction in 128-token blocks", "#aec7e8"),
]


def decode_figure(doc: dict) -> go.Figure:
    """Decode time per case from the ``decode`` suite: ours through the paged cache (dense or selected) and
    the whole selected step, against SDPA dense decode and FlexAttention on contiguous KV."""
    cases, cells = [], {}
    for r in doc["results"]:
        if r["pass"] == "sweep" or r.get("ms") is None:
            continue
        c = r["case"]
        key = f"B={c['B']}, {c['N'] // 1024}k<br>ps {c['page_size']}<br>{c['pattern']}"
        if key not in cases:
            cases.append(key)
        cells[(key, r["impl"], r["pass"])] = r["ms"]
    fig = go.Figure()
    for impl, pass_, name, color in _DECODE_SERIES:
        ys = [cells.get((k, impl, pass_)) for k in cases]
        if any(y is not None for y in ys):
            fig.add_trace(go.Bar(x=cases, y=ys, name=name, marker_color=color))
    from .book import caption
    fig.update_layout(barmode="group", yaxis_type="log", yaxis_title="ms per decode step (median)", height=560,
                      title_font_size=12, legend=dict(orientation="h", y=-0.3), xaxis_tickangle=0,
                      title=f"Decode, bf16, 32 query / 8 KV heads, D=128<br><sup>{caption(doc)}</sup>")
    return fig


def decode_keep_figure(doc: dict) -> go.Figure:
    """From the ``decode_keep`` suite, per batch: decode and the whole step (select + decode), both in a
    CUDA graph, vs the fraction of K/V bytes kept, against dense decode through the cache and cuDNN."""
    batches = sorted({r["case"]["B"] for r in doc["results"]})
    fig = make_subplots(rows=1, cols=len(batches), subplot_titles=[
        next(f"B={b}, L={r['case']['N'] // 1024}k" for r in doc["results"] if r["case"]["B"] == b) for b in batches])
    for col, b in enumerate(batches, start=1):
        rows = [r for r in doc["results"] if r["case"]["B"] == b]
        for pass_, name, color in (("decode (CUDA graph)", "decode", COLORS["sparseattn"]),
                                   ("select+decode (CUDA graph)", "select + decode", "#ff9896")):
            pts = sorted((r["case"]["keep"], r["ms"]) for r in rows
                         if r["pass"] == pass_ and r["impl"] == "sparseattn" and "keep" in r["case"])
            fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name,
                                     line_color=color, legendgroup=name, showlegend=col == 1), row=1, col=col)
        for impl, name, color in (("sparseattn", "dense decode through the cache", COLORS["sparseattn"]),
                                  ("cudnn", "cuDNN dense, contiguous", COLORS["cudnn"])):
            ms = next(r["ms"] for r in rows if r["impl"] == impl and r["case"]["pattern"] == "dense")
            fig.add_trace(go.Scatter(x=[0, 1], y=[ms, ms], mode="lines", name=name, legendgroup=name,
                                     line=dict(color=color, dash="dot"), showlegend=col == 1), row=1, col=col)
        fig.update_xaxes(title_text="fraction of pages kept", row=1, col=col)
    fig.update_yaxes(title_text="ms (median)", type="log", row=1, col=1)
    for col in range(2, len(batches) + 1):
        fig.update_yaxes(type="log", row=1, col=col)
    from .book import caption
    fig.update_layout(height=430, title_font_size=12, legend=dict(orientation="h", y=-0.25),
                      title=f"Selected decode vs kept fraction, page size 16<br><sup>{caption(doc)}</sup>")
    return fig


def decode_bandwidth_figure(doc: dict) -> go.Figure:
    """Effective bandwidth (bytes of the selected K/V / time, decode in a CUDA graph) vs the kept fraction,
    one line per batch, from the ``decode_keep`` suite."""
    fig = go.Figure()
    for b in sorted({r["case"]["B"] for r in doc["results"]}):
        pts = sorted((r["keep_fraction"], r["tbps"]) for r in doc["results"]
                     if r["case"]["B"] == b and r["pass"] == "decode (CUDA graph)" and "keep_fraction" in r)
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers",
                                 name=f"B={b}"))
    cud = [r["tbps"] for r in doc["results"] if r["impl"] == "cudnn"]
    fig.add_hline(y=max(cud), line_dash="dot", annotation_text="cuDNN dense (best batch)")
    from .book import caption
    fig.update_layout(xaxis_title="fraction of K/V bytes selected", yaxis_title="effective TB/s", height=400,
                      title_font_size=12, xaxis_type="log",
                      title=f"Effective bandwidth of selected decode (in a CUDA graph)<br><sup>{caption(doc)}</sup>")
    return fig


def decode_sweep_figure(doc: dict) -> go.Figure:
    """The split-count sweep of the ``decode`` suite: time relative to the case's best config, vs programs per
    SM, for the default tile (64 tokens, 4 warps, 2 stages, heads adjacent)."""
    fig = go.Figure()
    by_case = {}
    for r in doc["results"]:
        if r["pass"] != "sweep" or r.get("ms") is None:
            continue
        c = r["case"]
        by_case.setdefault(f"B={c['B']} L={c['N'] // 1024}k {c['pattern']}", []).append(r)
    for name, rows in by_case.items():
        best = min(r["ms"] for r in rows)
        pts = sorted((r["config"]["programs_per_sm"], r["ms"] / best) for r in rows
                     if (r["config"]["block_n"], r["config"]["num_warps"], r["config"]["num_stages"],
                         r["config"]["head_fastest"]) == (64, 4, 2, True))
        fig.add_trace(go.Scatter(x=[p[0] for p in pts], y=[p[1] for p in pts], mode="lines+markers", name=name))
    from .book import caption
    fig.update_layout(xaxis_title="split target: programs per SM", xaxis_type="log", height=400,
                      yaxis_title="time / best config of the case", title_font_size=12,
                      title=f"How many splits? Default tile, other split targets<br><sup>{caption(doc)}</sup>")
    return fig
