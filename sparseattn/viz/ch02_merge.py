"""Chapter 2, the merge law: split a softmax row anywhere, merge the pieces in any order, get the same
result; merge a tile twice and the weights no longer sum to one."""
from __future__ import annotations

from typing import Optional

import plotly.graph_objects as go
import torch

from ..reference import merge_states

__all__ = ["split_and_merge", "merge_error_figure", "duplicate_tile_figure"]


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
