"""Tuned defaults from a config sweep, in the format of ``sparseattn/data/tuned_configs.json``.

A sweep times several configs on several cases of one (dtype, head dim). The default chosen for that
(dtype, head dim) is the config with the smallest geometric mean of ``ms / best ms of the case`` over the
cases where every candidate was measured: one config that is never far from the best, rather than the
winner of a single case. :func:`defaults_doc` writes the rows the way
:func:`sparseattn.ops.config.default_config` reads them, so a retune is a copy of those rows.
"""
from __future__ import annotations

import json
import math
from typing import Dict, List

from ..ops.config import BwdConfig, DecodeConfig, FwdConfig
from .record import Record

__all__ = ["DTYPE_NAMES", "best_rows", "defaults_doc"]

#: Case dtype labels of the suites -> torch dtype names (as tuned_configs.json lists them).
DTYPE_NAMES = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}
_KINDS = {"fwd": FwdConfig, "bwd": BwdConfig, "decode": DecodeConfig}


def _key(d: dict) -> str:
    return json.dumps(d, sort_keys=True)


def best_rows(sweep: List[Record], kind: str) -> tuple:
    """``(rows, evidence)``: one tuned_configs row per (dtype, head dim) of ``sweep`` (records carrying a
    ``config``), and for each the numbers behind the choice. Raises ValueError for an unknown ``kind`` or a
    config that the kind's class does not accept."""
    if kind not in _KINDS:
        raise ValueError(f"kind must be one of {sorted(_KINDS)}, got {kind!r}")
    groups: Dict[tuple, Dict[str, Dict[str, float]]] = {}
    configs: Dict[str, dict] = {}
    for r in sweep:
        if r.ms is None or "config" not in r.extra:
            continue
        dtype = DTYPE_NAMES.get(r.case["dtype"], r.case["dtype"])
        cfg = r.extra["config"]
        _KINDS[kind](**cfg)  # the row must build the kind's config (TypeError/ValueError otherwise)
        configs[_key(cfg)] = cfg
        cases = groups.setdefault((dtype, int(r.case["D"])), {})
        cell = cases.setdefault(_key(r.case), {})
        cell[_key(cfg)] = min(r.ms, cell.get(_key(cfg), math.inf))
    rows, evidence = [], []
    for (dtype, head_dim), cases in sorted(groups.items()):
        # candidates: configs measured on every case of the group (else those measured on the most cases)
        cover = {c: sum(c in cell for cell in cases.values()) for c in configs}
        most = max(cover.values())
        candidates = [c for c, n in cover.items() if n == most]
        scored = []
        for c in candidates:
            ratios = [cell[c] / min(cell.values()) for cell in cases.values() if c in cell]
            scored.append((math.exp(sum(map(math.log, ratios)) / len(ratios)), max(ratios), c))
        geo, worst, best = min(scored)
        rows.append({"dtypes": [dtype], "max_head_dim": head_dim, "config": configs[best]})
        evidence.append({"dtype": dtype, "head_dim": head_dim, "cases": most, "candidates": len(candidates),
                         "config": configs[best], "geomean_vs_case_best": geo, "worst_vs_case_best": worst})
    return rows, evidence


def defaults_doc(suite: str, kind: str, family: str, sweep: List[Record], env: dict) -> dict:
    """The ``<suite>-defaults-<gpu>.json`` document: ``{"about", meta..., "families": {family: {kind: rows}},
    "evidence"}``, readable by ``sparseattn.ops.config`` as its table."""
    rows, evidence = best_rows(sweep, kind)
    about = (f"Best {kind} config per (dtype, head dim) from `python -m sparseattn.bench {suite} --sweep`: the "
             f"smallest geometric mean of ms / (best ms of the case) over the swept cases. Copy the rows under "
             f"families.{family}.{kind} of sparseattn/data/tuned_configs.json to make them the defaults.")
    return {"about": about, "suite": suite, **env, "families": {family: {kind: rows}}, "evidence": evidence}
