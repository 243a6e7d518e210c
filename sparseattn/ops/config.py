"""Public tuning objects and the table of tuned defaults.

``FwdConfig``, ``BwdConfig`` and ``DecodeConfig`` are frozen dataclasses a caller may pass as ``config=`` /
``bwd_config=``. Without one, the op takes the first matching row of its GPU family in
``sparseattn/data/tuned_configs.json`` (rows are matched on dtype and head dim; tile sizes are clipped to the
layout's tiles). The sweep suites (``python -m sparseattn.bench <suite> --sweep``) write their best configs in
the same format, so a retune is a copy of one file.
"""
from __future__ import annotations

import functools
import json
import pathlib
from dataclasses import dataclass, replace
from typing import Optional, Union

import torch

__all__ = ["FwdConfig", "BwdConfig", "DecodeConfig", "default_config", "gpu_family"]

_TABLE = pathlib.Path(__file__).resolve().parent.parent / "data" / "tuned_configs.json"


@dataclass(frozen=True)
class FwdConfig:
    """Forward kernel: ``block_m`` queries per program, ``block_n`` keys per step (both divide the layout's
    tiles), Triton's ``num_warps``/``num_stages``. ``tma=None`` uses tensor descriptors (TMA) where the GPU and
    the strides allow, except in eager calls too small to pay their host cost (fewer visited tile pairs than
    :data:`sparseattn.ops._launch.TMA_MIN_PAIRS`; a CUDA-graph capture always takes them); ``True`` always,
    ``False`` never. ``warp_specialize`` passes Triton's producer/consumer flag to the tile loops. With Triton
    3.6 on Hopper it changes nothing at 8 warps (the pass partitions only 4-warp kernels) and aborts the
    compile at 4 (the kernel has two loops); a one-loop forward built for it never returned on the H200, and
    the pass's output for a minimal attention loop was wrong there (``book/data/bench/checks/ws-probe.py``).

    ``split``: ``None`` (default) runs one program per query sub-tile over its whole row, longest row first;
    an int runs tasks of at most that many listed tiles (longer rows are split, their chunks' partial states
    merged in a fixed order: deterministic); ``"auto"`` lets :mod:`sparseattn.balance` pick the chunk on the
    device (FlashInfer's fill rule and a tail bound). The default stays the plain grid: in the balance suite's
    H200 record (chapter 10) "auto" pays only where heads are skewed differently and loses on the small grid
    of one head. The backward's dK/dV pass cuts long columns by itself (``BwdConfig.chunk``); its dQ pass
    splits rows with the same planner when ``BwdConfig.dq_split`` asks.

    ``persistent`` (needs ``split``): instead of one program per (task, head), a fixed grid of about two
    programs per SM loops over the split plan's (task, head) items, longest task first; the output is the
    split grid's, bit for bit, but it was slower than both grids in every case of the H200 record, so it is
    off by default. Warp specialisation is off on this path (its loop is inside the task loop)."""
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    tma: Optional[bool] = None
    warp_specialize: bool = False
    split: Union[int, str, None] = None
    persistent: bool = False


@dataclass(frozen=True)
class BwdConfig:
    """Backward kernels. As in Triton's fused-attention tutorial, the dK/dV pass keeps a tall key tile
    (``block_n``) resident and streams thin query tiles (``block_m``) past it; the dQ pass does the opposite
    (``dq_block_m`` queries resident, ``dq_block_n`` keys per step). ``chunk``: at most this many listed query
    tiles per dK/dV program (longer columns are split and summed in a fixed order); None derives it from the
    layout. ``dq_split``: the dQ pass's rows, as ``FwdConfig.split`` for the forward: ``None`` (default) one
    program per query sub-tile over its whole row; an int or ``"auto"`` runs the tasks of
    :func:`sparseattn.balance.plan` for ``dq_block_m`` rows, long rows' chunks writing float32 partial dQ that
    are summed in chunk order (deterministic). Only the deterministic path has a dQ pass; the atomic path
    (``deterministic=False``) forms dQ inside the dK/dV pass and ignores ``dq_split``.

    ``num_warps``/``num_stages`` launch the dK/dV pass; ``dq_num_warps``/``dq_num_stages`` the dQ pass (None:
    the dK/dV pass's values). The two passes hold different tiles resident, so their best launch configs differ
    (``python -m sparseattn.bench backward --sweep`` times each pass's configs separately). ``tma`` as
    ``FwdConfig.tma``: None loads tiles through tensor descriptors (TMA) in both passes on a GPU that has them
    (Hopper and later) when the strides allow, as ``FwdConfig.tma`` does, False never, True always, also in
    the Triton interpreter (tests).

    ``overlap`` (deterministic path): the dQ programs run in the dK/dV pass's launch -- one grid whose first
    programs of each KV head are its dK/dV work items and the rest its group's dQ rows (FlexAttention's layout
    of the work), so dQ programs take the SMs the dK/dV pass's last programs leave idle, with one launch's host
    work. It needs one warp count for both passes (``dq_num_warps`` None or equal to ``num_warps``) and
    ``dq_split`` None; otherwise, and with False, the passes are two launches back to back. In one launch each
    kind of program still pipelines its loop ``num_stages`` / ``dq_num_stages`` deep (H200, D = 128: the dK/dV
    loop at 2 stages and the dQ loop at 3 moved five patterns by -3% to +2% against 3 and 3,
    ``book/data/bench/checks/bwd-loop-stages-h200.json``). Outputs are the same bits either way."""
    block_m: int
    block_n: int
    dq_block_m: int
    dq_block_n: int
    num_warps: int
    num_stages: int
    chunk: Optional[int] = None
    dq_split: Union[int, str, None] = None
    dq_num_warps: Optional[int] = None
    dq_num_stages: Optional[int] = None
    tma: Optional[bool] = None
    overlap: bool = True

    @property
    def dq_warps(self) -> int:
        """The dQ pass's ``num_warps`` (``dq_num_warps``, else the dK/dV pass's)."""
        return self.num_warps if self.dq_num_warps is None else self.dq_num_warps

    @property
    def dq_stages(self) -> int:
        """The dQ pass's ``num_stages`` (``dq_num_stages``, else the dK/dV pass's)."""
        return self.num_stages if self.dq_num_stages is None else self.dq_num_stages


@dataclass(frozen=True)
class DecodeConfig:
    """Split-KV decode. ``block_n`` tokens per step (a step may span several pages or part of one);
    ``programs_per_sm`` is the split target over the whole launch (None: 16, or 8 once the (sequence, KV head)
    rows alone cover every SM — then splits only trim the tail, and fewer, longer programs spend less on
    prologues and on the merge; H200 sweep: B=8 dense 0.98 ms at 16 vs 1.15 at 8); ``head_fastest`` launches
    the KV heads of one split next to each other (they read the same token rows)."""
    block_n: int = 64
    num_warps: int = 4
    num_stages: int = 2
    programs_per_sm: Optional[int] = None
    head_fastest: bool = True


_KINDS = {"fwd": FwdConfig, "bwd": BwdConfig, "decode": DecodeConfig}


@functools.lru_cache(maxsize=None)
def gpu_family(device: torch.device, interpreter: bool) -> str:
    """``"interpreter"``, ``"sm90"`` (Hopper), or ``"default"`` for any other GPU."""
    if interpreter:
        return "interpreter"
    major, _ = torch.cuda.get_device_capability(device)
    return "sm90" if major == 9 else "default"


@functools.lru_cache(maxsize=None)
def _table() -> dict:
    families = json.loads(_TABLE.read_text())["families"]
    return {name: families[fam.get("same_as", name)] if "same_as" in fam else fam
            for name, fam in families.items()}


@functools.lru_cache(maxsize=None)
def default_config(kind: str, family: str, dtype: torch.dtype, head_dim: int):
    """The tuned default of ``kind`` ("fwd", "bwd", "decode") for this family, dtype and head dim."""
    name = str(dtype).replace("torch.", "")
    for row in _table()[family][kind]:
        if name in row["dtypes"] and head_dim <= row["max_head_dim"]:
            return _KINDS[kind](**row["config"])
    raise LookupError(f"no {kind} config for {name}, head dim {head_dim} in family {family!r} of {_TABLE.name}")


@functools.lru_cache(maxsize=None)
def layout_default(kind: str, device: torch.device, interpreter: bool, dtype: torch.dtype, head_dim: int,
                   block_q: int, block_k: int):
    """The default config of ``kind`` for these inputs, clipped to a layout's tiles (cached: the per-call host
    path of an op is a dictionary lookup)."""
    return clip_tiles(default_config(kind, gpu_family(device, interpreter), dtype, head_dim), block_q, block_k)


@functools.lru_cache(maxsize=None)
def smaller_tiles(kind: str, block_q: int, block_k: int) -> tuple:
    """Configs to retry with when a GPU lacks the shared memory for the defaults (a T4 has 64 KiB)."""
    if kind == "fwd":
        return tuple(clip_tiles(FwdConfig(block_m=bm, block_n=bn, num_warps=4, num_stages=2), block_q, block_k)
                     for bm, bn in ((64, 64), (32, 32)))
    return tuple(clip_tiles(BwdConfig(block_m=m, block_n=n, dq_block_m=dm, dq_block_n=dn, num_warps=4, num_stages=2),
                            block_q, block_k) for m, n, dm, dn in ((32, 64, 64, 32), (16, 32, 32, 16)))


def clip_tiles(cfg, block_q: int, block_k: int):
    """The config with its tile sizes clipped to a layout's tiles (kernel tiles must divide them); decode
    configs have no layout tiles and pass through."""
    if isinstance(cfg, DecodeConfig):
        return cfg
    if isinstance(cfg, FwdConfig):
        return replace(cfg, block_m=min(cfg.block_m, block_q), block_n=min(cfg.block_n, block_k))
    return replace(cfg, block_m=min(cfg.block_m, block_q), block_n=min(cfg.block_n, block_k),
                   dq_block_m=min(cfg.dq_block_m, block_q), dq_block_n=min(cfg.dq_block_n, block_k))
