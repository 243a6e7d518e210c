"""Where Triton kernels run.

Kernels are imported lazily, on first use, through :func:`load_kernels`. Before that import, when no CUDA
device is present and the user has not set ``TRITON_INTERPRET``, the interpreter is selected, so notebooks
and tests on a CPU-only machine never set it by hand. Nothing here runs at ``import sparseattn``.
"""
from __future__ import annotations

import importlib
import os

import torch


def select_backend() -> str:
    """Return ``"cuda"`` or ``"interpreter"``; pick the interpreter when there is no GPU (idempotent)."""
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "interpreter"
    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    return "interpreter"


def load_kernels(name: str):
    """Import ``sparseattn.kernels.<name>`` after choosing the backend."""
    select_backend()
    return importlib.import_module(f"sparseattn.kernels.{name}")
