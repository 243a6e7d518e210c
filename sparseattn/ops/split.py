"""The split forward's launch pieces: the task plan and its float32 workspace, the extra keyword arguments of
the forward kernel, and the merge launch (:mod:`sparseattn.balance` plans; :mod:`sparseattn.kernels.merge`
merges). No host sync: the plan's counts stay on the device, its capacities are shape-only."""
from __future__ import annotations

from typing import NamedTuple

import torch

from .. import balance
from ..layout import BlockLayout
from . import _launch as L


class SplitLaunch(NamedTuple):
    plan: balance.Plan
    ws_o: torch.Tensor  # float32 [B * Hq, ws slots, block_m, D]: partial o of split rows' chunks
    ws_lse: torch.Tensor  # float32 [B * Hq, ws slots, block_m]: their natural-log LSE


#: the forward kernel's split arguments when it runs the plain grid
PLAIN = dict(TASKS=None, N_TASKS=None, WS_O=None, WS_LSE=None, ws_cap=0, n_bh=0, COUNTER=None, PERSISTENT=False)

#: How the persistent grid hands out its (task, head) items: True, each program takes the next one from a
#: counter when it is free (zeroed per call, inside a captured graph too); False, dealt round-robin in
#: advance. The dealt grid measured 9-67% slower than the plain grid in every balance case of 2026-11-30
#: (perf notes, "Load balance"), the hardware scheduler handing each program to the SM that frees first;
#: pulling does the same. Measured on the H200 (``balance-h200.json`` 2026-12-01 12:31 against the dealt
#: record ``checks/balance-dealt-h200.json``): 2-32% faster than dealing, still 5-22% slower than the split
#: grid over the same plan, so ``FwdConfig.persistent`` stays off by default.
PERSISTENT_PULL = True

#: programs per SM of the persistent grid: enough that one program's long task is hidden behind others on
#: its SM (more than one resident program per SM), few enough that each program loops over several tasks
PERSISTENT_PROGRAMS_PER_SM = 2


def prepare(layout: BlockLayout, block_m: int, split, B: int, Hq: int, D: int, device) -> SplitLaunch:
    """The plan for ``B * Hq`` heads on this device's SMs and an (uninitialised) workspace of its capacity."""
    plan = balance.plan(layout, block_m, split, B * Hq, L.num_sms(device), D)
    slots = max(plan.ws_capacity, 1)
    ws_o = torch.empty(B * Hq, slots, block_m, D, device=device, dtype=torch.float32)
    ws_lse = torch.empty(B * Hq, slots, block_m, device=device, dtype=torch.float32)
    return SplitLaunch(plan, ws_o, ws_lse)


def kernel_kwargs(s: SplitLaunch, persistent: bool = False) -> dict:
    """The forward kernel's split arguments (``SPLIT`` follows from ``TASKS``); ``persistent``: the programs
    loop over the (task, head) items instead of owning one each (pulling them from a fresh counter with
    :data:`PERSISTENT_PULL`)."""
    pull = persistent and PERSISTENT_PULL
    return dict(TASKS=s.plan.tasks, N_TASKS=s.plan.n_tasks, WS_O=s.ws_o, WS_LSE=s.ws_lse,
                ws_cap=s.ws_o.shape[1], n_bh=s.ws_o.shape[0], PERSISTENT=bool(persistent),
                COUNTER=torch.zeros(1, dtype=torch.int32, device=s.ws_o.device) if pull else None)


def grid(s: SplitLaunch, persistent: bool, sms: int) -> tuple:
    """The split launch's grid: ``(task capacity, B * Hq)``, or, persistent, one axis of
    ``PERSISTENT_PROGRAMS_PER_SM * sms`` programs (never more than the capacity's items; from shapes only, so
    a captured graph serves every layout of these shapes; programs past the live items loop zero times)."""
    if not persistent:
        return (s.plan.capacity, s.ws_o.shape[0])
    return (persistent_programs(s.plan.capacity, s.ws_o.shape[0], sms),)


def persistent_programs(capacity: int, heads: int, sms: int) -> int:
    """Programs of the persistent grid for a plan of ``capacity`` tasks on ``heads`` (B * Hq) heads."""
    return max(1, min(capacity * heads, PERSISTENT_PROGRAMS_PER_SM * sms))


def merge(s: SplitLaunch, o: torch.Tensor, lse: torch.Tensor, block_m: int) -> None:
    """Merge the split rows' chunks into ``o`` and ``lse`` (rows of unsplit sub-tiles were written directly).
    Skipped outright when the plan can have no split row (its workspace capacity is 0)."""
    if s.plan.ws_capacity == 0:
        return
    from ..kernels import merge as M
    B, Hq, Lq, D = o.shape
    block_d = min(D, 64)
    L.launch(  # Triton's default stages, as before the cached launch path
        M.merge_rows_kernel, (s.plan.merge_capacity, B * Hq, D // block_d),
        WS_O=s.ws_o, WS_LSE=s.ws_lse, MERGE=s.plan.merge, N_MERGE=s.plan.n_merge, O=o, LSE=lse,
        stride_ob=o.stride(0), stride_oh=o.stride(1), stride_om=o.stride(2), Hq=Hq, Lq=Lq, ws_cap=s.ws_o.shape[1],
        HEAD_DIM=D, BLOCK_M=block_m, BLOCK_D=block_d, num_warps=4, num_stages=3)


def check_split(name: str, split, persistent=False) -> None:
    """``split`` of a config: None (plain grid), ``"auto"`` or an int >= 1 (listed tiles per task);
    ``persistent``: a bool, True only with a split (the persistent grid loops over the split plan's tasks)."""
    if not isinstance(persistent, bool):
        raise ValueError(f"{name}: persistent must be a bool, got {persistent!r}")
    if persistent and split is None:
        raise ValueError(f"{name}: persistent=True needs split='auto' or an int (it loops over the split plan's "
                         f"tasks); got split=None")
    if split is None:
        return
    try:
        balance._check_split(split)
    except ValueError:
        raise ValueError(f"{name}: split must be None (one program per row), 'auto' or an int >= 1 (listed "
                         f"tiles per task), got {split!r}") from None
