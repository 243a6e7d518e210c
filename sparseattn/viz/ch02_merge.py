"""Chapter 2, the merge law: split a softmax row anywhere, merge the pieces in any order, get the same
result; merge a tile twice and its keys weigh double while every other key is diluted."""
from __future__ import annotations

import platform
from typing import Optional

import plotly.graph_objects as go
import torch

from ..reference import merge_states

__all__ = ["split_and_merge", "merge_errors", "merge_error_figure", "duplicate_tile_states", "duplicate_tile_figure"]


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


def merge_errors(chunks: int = 8, n: int = 4096, trials: int = 30) -> dict:
    """Max error of split-and-merge against the fp64 one-pass softmax, in units of each dtype's machine
    epsilon, per trial (random cut points and merge order); with the fp32 one-pass softmax beside it as the
    yardstick. Keys: ``"fp32 merged"``, ``"fp32 one pass"``, ``"fp64 merged"``."""
    out = {"fp32 merged": [], "fp32 one pass": [], "fp64 merged": []}
    e32, e64 = torch.finfo(torch.float32).eps, torch.finfo(torch.float64).eps
    for t in range(trials):
        s, v = _row(n, seed=t, dtype=torch.float32)
        exact = torch.softmax(s.double(), 0) @ v.double()
        o, _ = split_and_merge(s, v, chunks, seed=1000 + t)
        out["fp32 merged"].append(float((o.double() - exact).abs().max()) / e32)
        out["fp32 one pass"].append(float(((torch.softmax(s, 0) @ v).double() - exact).abs().max()) / e32)
        s64, v64 = _row(n, seed=t, dtype=torch.float64)
        o64, _ = split_and_merge(s64, v64, chunks, seed=1000 + t)
        out["fp64 merged"].append(float((o64 - torch.softmax(s64, 0) @ v64).abs().max()) / e64)
    return out


def merge_error_figure(chunks: int = 8, n: int = 4096, trials: int = 30) -> go.Figure:
    """:func:`merge_errors` per trial: split-and-merge against the one-pass softmax, in machine epsilons."""
    errs = merge_errors(chunks, n, trials)
    fig = go.Figure()
    styles = {"fp32 merged": dict(mode="markers", marker=dict(size=8)),
              "fp32 one pass": dict(mode="lines", line=dict(dash="dot")),
              "fp64 merged": dict(mode="markers", marker=dict(symbol="x", size=7))}
    for name, ys in errs.items():
        fig.add_trace(go.Scatter(x=list(range(trials)), y=ys, name=name, **styles[name]))
    what = (f"a {n}-key row left whole: 1 piece, nothing to merge" if chunks == 1
            else f"{chunks} random pieces of a {n}-key row, merged in random order")
    fig.update_layout(title=f"{what}"
                            "<br><sup>error vs the fp64 one-pass softmax, in machine epsilons of each dtype"
                            f"<br>computed on the CPU that ran this page ({platform.machine()}, torch "
                            f"{torch.__version__})</sup>",
                      xaxis_title="trial (random cut points and merge order)",
                      yaxis_title="max |error| / machine epsilon", height=440, title_font_size=14,
                      margin=dict(t=115))
    return fig


def duplicate_tile_states(duplicated: Optional[int] = 3, n: int = 512, tile: int = 64) -> dict:
    """One fp64 row merged tile by tile, with tile ``duplicated`` merged a second time (None: no duplicate).

    Returns ``exact`` (the softmax weights), ``merged`` (the weight each key ends up with after the merges),
    ``share_exact``/``share_merged`` (the duplicated tile's share of the weight, 0 without one),
    ``error`` (max |o_merged - o_exact|) and ``gap`` (max |o_tile - o_exact|, how far the duplicated tile's
    own output lies from the row's; 0 without one). Merging the tile twice moves the output by
    p/(1+p) * (o_tile - o_exact), so ``error`` is ``share_exact / (1 + share_exact) * gap``: the error
    depends on the tile's values as well as on its share."""
    s, v = _row(n, seed=7, dtype=torch.float64)
    p_true = torch.softmax(s, 0)
    tiles = [(a, min(a + tile, n)) for a in range(0, n, tile)]
    order = list(range(len(tiles))) + ([duplicated] if duplicated is not None else [])
    # the weight each key ends up with: exp(s) / (sum of exp over every *visited* tile, duplicates included)
    z = sum(float(torch.exp(s[a:b]).sum()) for a, b in (tiles[i] for i in order))
    w = torch.exp(s) / z
    share_exact = share_merged = gap = 0.0
    if duplicated is not None:
        a, b = tiles[duplicated]
        w[a:b] *= 2
        share_exact, share_merged = float(p_true[a:b].sum()), float(w[a:b].sum())
        gap = float((_state(s[a:b], v[a:b])[0] - p_true @ v).abs().max())
    states = [_state(s[a:b], v[a:b]) for a, b in (tiles[i] for i in order)]
    o_dup, lse = states[0]
    for st in states[1:]:
        o_dup, lse = merge_states(o_dup, lse, *st)
    return dict(exact=p_true, merged=w, share_exact=share_exact, share_merged=share_merged,
                error=float((o_dup - p_true @ v).abs().max()), gap=gap)


def duplicate_tile_figure(duplicated: Optional[int] = 3, n: int = 512, tile: int = 64) -> go.Figure:
    """Attention weights of one row when tile ``duplicated`` is merged twice (None = no duplicate)."""
    st = duplicate_tile_states(duplicated, n, tile)
    fig = go.Figure()
    keys = list(range(n))
    fig.add_trace(go.Scatter(x=keys, y=st["exact"].tolist(), name="exact softmax", mode="lines"))
    fig.add_trace(go.Scatter(x=keys, y=st["merged"].tolist(), name="weights after merging", mode="lines",
                             line=dict(dash="dot")))
    if duplicated is None:
        label = "every tile merged once: the merged weights are the softmax"
    else:
        label = (f"tile {duplicated} merged twice: its keys hold {st['share_merged']:.0%} of the weight, "
                 f"not {st['share_exact']:.0%}")
    fig.update_layout(title=f"{label}<br><sup>{n} keys in tiles of {tile}; max output error "
                            f"{st['error']:.1e}; computed in fp64 (shaded: the duplicated tile)</sup>",
                      xaxis_title="key position", yaxis_title="attention weight", height=400, title_font_size=14)
    if duplicated is not None:
        fig.add_vrect(x0=duplicated * tile, x1=min((duplicated + 1) * tile, n) - 1, fillcolor="gray",
                      opacity=0.15, line_width=0)
    return fig
