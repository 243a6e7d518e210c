"""Where Triton kernels run: on the GPU, or in the Triton interpreter when there is none.

The choice is made once, when :mod:`sparseattn.kernels` is first imported (ops import it lazily, inside
the call, so ``import sparseattn`` loads no Triton). With no CUDA device and ``TRITON_INTERPRET`` unset, the
interpreter is selected by setting that variable before Triton reads it, so a notebook on a CPU-only machine
never sets it by hand.
"""
from __future__ import annotations

import os
import sys

import torch

_BACKEND = None  # "cuda" or "interpreter", once chosen


def select_backend() -> str:
    """Return ``"cuda"`` or ``"interpreter"``; choose the interpreter when there is no GPU. Idempotent: the
    first call decides, later calls return that answer."""
    global _BACKEND
    if _BACKEND is None:
        if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
            _BACKEND = "interpreter"
        elif torch.cuda.is_available():
            _BACKEND = "cuda"
        else:
            os.environ["TRITON_INTERPRET"] = "1"
            _BACKEND = "interpreter"
        if _BACKEND == "interpreter":
            _interpret_triton_stdlib()
            patch_interpreter_scalars()
    return _BACKEND


def is_interpreter() -> bool:
    return select_backend() == "interpreter"


def _interpret_triton_stdlib() -> None:
    """Triton decides at *its own* import whether its jit functions (``tl.zeros``, ``tl.cdiv``, ...) are
    interpreted. Only when something imported Triton before the interpreter was chosen (torch's
    FlexAttention does, on a CPU) are those compiled-only; then re-wrap them, once, so interpreted kernels
    can call them whatever the import order."""
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


def patch_interpreter_scalars() -> None:
    """Let Triton 3.6's interpreter run with NumPy >= 2.4. A scalar in the interpreter is a one-element array,
    and the interpreter turns it into a Python int (``for i in range(0, n)`` with a loaded ``n``) with
    ``int(array)``, which NumPy 2.4 turned from a deprecation into a ``TypeError`` ("only 0-dimensional arrays
    can be converted to Python scalars"). Wrap the interpreter's per-launch patch of ``tl.tensor`` so that the
    conversion reads the one element. Idempotent; it changes only interpreted launches (the GPU image ships
    NumPy 2.5, where the book's interpreter exercises failed live without it)."""
    from triton.runtime import interpreter
    original = interpreter._patch_lang_tensor
    if getattr(original, "_sparseattn_scalars", False):
        return

    def patched(tensor, scope):
        original(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0])
                       if self.handle.data.size == 1 else int(self.handle.data))

    patched._sparseattn_scalars = True
    interpreter._patch_lang_tensor = patched


def graph_step(fn, stream=None, warmup: int = 2):
    """Capture ``fn`` (fixed shapes, no host sync) in a CUDA graph after ``warmup`` calls on a side stream
    (``stream``, or a new one: compiles kernels, fills caches); return the graph (``graph.replay()`` reruns
    it). The capture runs on that same stream, so a caller can run a backward's kept forward there too:
    autograd runs a node's backward on the stream its forward used, and a wait on a stream outside the capture
    invalidates it. The benches and :class:`sparseattn.balance.GraphBuckets` capture through here."""
    graph = torch.cuda.CUDAGraph()
    stream = stream if stream is not None else torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    with torch.cuda.graph(graph, stream=stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    return graph
