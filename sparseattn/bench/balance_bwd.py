"""Suite ``balance_bwd``: the deterministic backward on the ``balance`` suite's skewed layouts, in its own
10-minute run and its own file (the forward suite already fills one): our plain dQ pass (one program per
query sub-tile) vs the split dQ pass (``BwdConfig(dq_split="auto")``: the balance planner's tasks, partial dQ
summed in a fixed order) vs FlexAttention's backward on the same block mask, each beside the backward's
*ideal* balanced time. Both of ours run the same dK/dV pass (columns already split, ``BwdConfig.chunk``), so
their difference is the dQ pass's.

``ideal_ms``: the backward's time per listed tile on the equal-rows layout of the same length (every program
busy to the end; at least four programs per SM, :func:`~sparseattn.bench.balance.calibration_heads`) times
the case's listed tiles. Each split row records the dQ plan (chunk, tasks, split rows) and its dQ against the
plain pass's (``max_abs_dq_vs_plain``; dK/dV must be equal bit for bit).
"""
from __future__ import annotations

import dataclasses

import torch

from .. import _runtime
from .. import balance as BAL
from ..ops import sparse_attention
from ..ops._launch import num_sms
from ..ops.config import layout_default
from . import _common as C
from .balance import (BLOCK, _listed, _r, _ratio, case_layout, case_shapes, merged_records, selected_cases,
                      tile_ms_on_equal_rows)
from .record import Impl, Pass, Record

NAME = "balance_bwd"
DEFAULT_N = "65536"  # as the balance suite: the documents case also runs at 2N
CONFIG_KIND = None
DQ_SPLIT = "auto"  #: the split dQ variant timed (the CPU test sets 1: its tiny layouts have no long rows)
COLUMNS = ["case", "N", "H", "plain_bwd_ms", "dqsplit_bwd_ms", "dq_chunk", "flex_bwd_ms", "ideal_bwd_ms",
           "plain/ideal", "dqsplit/ideal", "flex/dqsplit"]


def run(args) -> tuple:
    """Measure every case's backward; return (records, table rows, table columns)."""
    D = args.head_dim
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    records, table = merged_records(args, NAME, selected_cases(args)), []
    tile_ms = {}  # (N, H) -> measured backward ms per listed tile on equal rows
    sms = num_sms(torch.device(dev))
    for name, H, N in case_shapes(args, NAME):
        q, k, v, do = (torch.randn(1, H, N, D, device=dev, dtype=dtype) for _ in range(4))
        q, k, v = (t.requires_grad_() for t in (q, k, v))
        def timed(eq, heads, q=q, k=k, v=v, do=do):
            if heads != H:  # the calibration's own inputs (more heads than the case, see calibration_heads)
                q, k, v, do = (torch.randn(1, heads, N, D, device=dev, dtype=dtype) for _ in range(4))
                q, k, v = (t.requires_grad_() for t in (q, k, v))
            return C.grad_fn(lambda: sparse_attention(q, k, v, eq), (q, k, v), do)
        unit = tile_ms_on_equal_rows(timed, N, H, D, dev, Pass.BWD, tile_ms, records)
        _case(args, name, N, H, D, q, k, v, do, case_layout(name, N, H, dev), unit, sms, records, table)
        del q, k, v, do
    return records, table, COLUMNS


def _time_bwd(fwd, inputs, do):
    """The backward alone from a kept forward (:func:`_common.grad_fn`); a failure (out of memory, a refused
    shape) is recorded and the suite goes on."""
    try:
        return C.time_gpu(C.grad_fn(fwd, inputs, do)), None
    except Exception as e:  # noqa: BLE001
        return None, f"{type(e).__name__}: {str(e)[:200]}"


def _case(args, name, N, H, D, q, k, v, do, layout, tile_ms, sms, records, table) -> None:
    listed = _listed(layout, H)
    ideal = tile_ms * listed
    case = {"case": name, "N": N, "H": H, "B": 1, "D": D, "dtype": "bf16", "block": BLOCK, "listed_tiles": listed,
            "logical_density": layout.stats()["logical_density"]}
    base = layout_default("bwd", q.device, _runtime.is_interpreter(), q.dtype, D, BLOCK, BLOCK)
    plain_cfg = dataclasses.replace(base, dq_split=None)
    split_cfg = dataclasses.replace(base, dq_split=DQ_SPLIT)

    def fwd(cfg):
        return lambda: sparse_attention(q, k, v, layout, bwd_config=cfg)
    g_plain = torch.autograd.grad(fwd(plain_cfg)(), (q, k, v), do)
    ms_plain, err = _time_bwd(fwd(plain_cfg), (q, k, v), do)
    records.append(Record({**case, "dq_split": None}, Impl.OURS, Pass.BWD, ms_plain,
                          {"ideal_ms": ideal, "config": C.config_dict(plain_cfg), **({"error": err} if err else {})}))
    row = {"case": name, "N": N, "H": H, "plain_bwd_ms": _r(ms_plain), "ideal_bwd_ms": _r(ideal),
           "plain/ideal": _ratio(ms_plain, ideal)}

    g_split = torch.autograd.grad(fwd(split_cfg)(), (q, k, v), do)
    again = torch.autograd.grad(fwd(split_cfg)(), (q, k, v), do)
    ms_split, err = _time_bwd(fwd(split_cfg), (q, k, v), do)
    plan = BAL.plan(layout, split_cfg.dq_block_m, DQ_SPLIT, H, sms, D)
    rep = BAL.report(layout.to("cpu"), 1, H, block_m=split_cfg.dq_block_m, split=DQ_SPLIT, sms=sms, head_dim=D)
    records.append(Record({**case, "dq_split": DQ_SPLIT}, Impl.OURS_SPLIT, Pass.BWD, ms_split, {
        "ideal_ms": ideal, "config": C.config_dict(split_cfg), "dq_chunk": int(plan.chunk),
        "dq_tasks": int(plan.n_tasks[0]), "dq_capacity": plan.capacity, "dq_split_rows": int(plan.n_merge[0]),
        "dq_tail_plain": rep.tail_plain, "dq_tail_split": rep.tail_split,
        "max_abs_dq_vs_plain": float((g_split[0].float() - g_plain[0].float()).abs().max()),
        "dkdv_equal_plain": all(torch.equal(a, b) for a, b in zip(g_split[1:], g_plain[1:])),
        "bitwise_repeatable": all(torch.equal(a, b) for a, b in zip(g_split, again)),
        **({"error": err} if err else {})}))
    row.update({"dqsplit_bwd_ms": _r(ms_split), "dq_chunk": int(plan.chunk), "dqsplit/ideal": _ratio(ms_split, ideal)})
    if not args.no_flex:
        ms_flex, err = _time_bwd(C.flex_fn(q, k, v, layout.to_flex()), (q, k, v), do)
        records.append(Record(case, Impl.FLEX, Pass.BWD, ms_flex,
                              {"ideal_ms": ideal, **({"error": err} if err else {})}))
        row.update({"flex_bwd_ms": _r(ms_flex), "flex/dqsplit": _ratio(ms_flex, ms_split)})
    table.append(row)
