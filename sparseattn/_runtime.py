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
        _interpret_triton_stdlib()
        return "interpreter"
    if torch.cuda.is_available():
        return "cuda"
    os.environ["TRITON_INTERPRET"] = "1"
    _interpret_triton_stdlib()
    return "interpreter"


def _interpret_triton_stdlib() -> None:
    """Triton decides at *its own* import whether its jit functions (``tl.zeros``, ``tl.cdiv``, ...) are
    interpreted. When something imported triton before the interpreter was chosen (torch's FlexAttention
    does, on a CPU), those stay compiled-only and any interpreted kernel that calls them fails. Re-wrap them
    so the interpreter works whatever the import order."""
    import sys
    if "triton" not in sys.modules:
        return  # triton will read TRITON_INTERPRET when it is imported
    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    modules = [m for name, m in list(sys.modules.items())
               if name.startswith("triton.language") and m is not None]
    for mod in modules + [tl]:
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and not isinstance(obj, InterpretedFunction):
                setattr(mod, name, InterpretedFunction(obj.fn))


def load_kernels(name: str):
    """Import ``sparseattn.kernels.<name>`` after choosing the backend."""
    select_backend()
    return importlib.import_module(f"sparseattn.kernels.{name}")
