"""Exercises of the book, one module per chapter (``chNN_<topic>.py``), checked in the Triton interpreter.

Each exercise is an :class:`Exercise`: a **scaffold** (a ``@triton.jit`` fragment or a plain function with
one or two lines replaced by :func:`blank`), its **solution**, a **check** that runs any candidate and raises
AssertionError with a helpful message when it is wrong, and the **mistakes** people make (wrong variants
the check must reject; the tests run them). A chapter module lists its exercises in ``EXERCISES``.

In a chapter: the page shows the scaffold (``show(ex.scaffold)``), the reader copies it into a new cell,
fills the blank and runs ``ex.check(my_fragment)``; the built book runs ``ex.check(ex.solution)`` so a
``-W`` build stays green; the solution is shown in a collapsed cell.

Triton fragments always run in the interpreter on CPU tensors, on any machine: :func:`interpreted` rebuilds
a candidate (``@triton.jit``-decorated or a plain function) as an interpreted function, and the harness
kernels in the chapter modules are interpreted too. So a check needs no GPU, and on a GPU box it does not
compile anything.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, List, Sequence

import torch

from ..book._source import Source, source

__all__ = ["Exercise", "Blank", "blank", "show", "interpreted", "run", "assert_close", "passed"]


class Blank(NotImplementedError):
    """Raised by a scaffold line that is still :func:`blank`."""


def blank(hint: str = ""):
    """The blank of a scaffold: replace this call with your code. Calling it raises :class:`Blank`."""
    raise Blank(f"fill in the blank: {hint}" if hint else "fill in the blank")


@dataclass(frozen=True)
class Exercise:
    """One fill-in exercise: ``check(candidate)`` returns None when the candidate is right and raises
    AssertionError otherwise. ``mistakes``: wrong variants the check must reject (tested)."""
    name: str
    scaffold: Callable
    solution: Callable
    check: Callable[[Callable], None]
    mistakes: Sequence[Callable] = field(default_factory=tuple)
    prompt: str = ""


def show(fn) -> Source:
    """The source of a scaffold or solution, for the page (``book.source``)."""
    return source(fn)


def _python_function(fn) -> Callable:
    seen = 0
    while hasattr(fn, "fn") and seen < 8:  # JITFunction / InterpretedFunction / heuristics wrappers
        fn = fn.fn
        seen += 1
    if not callable(fn):
        raise TypeError(f"a candidate must be a function or a @triton.jit function, got {type(fn).__name__}")
    return fn


def interpreted(fn):
    """``fn`` (a ``@triton.jit`` function or a plain Python function) as a Triton-interpreter function, so it
    runs on CPU tensors whatever backend ``triton.jit`` chose in this process."""
    from triton.runtime.interpreter import InterpretedFunction
    return InterpretedFunction(_python_function(fn))


@contextlib.contextmanager
def _interpreted_stdlib():
    """Triton's own ``@jit`` helpers (``tl.max``, ``tl.sum``, ``tl.zeros``, ...) are interpreted only when
    ``TRITON_INTERPRET`` was set before Triton was imported; on a GPU machine they are compiled-only, and an
    interpreted kernel that calls them fails. For the duration of a check, wrap them as interpreted functions,
    then put the compiled ones back (the GPU kernels of the package keep compiling against those).

    Afterwards every attribute of Triton's language modules and of ``tl.tensor`` is put back as it was: Triton
    3.6's interpreter patches those builtins (``tl.load``, ``tensor.__add__``, ...) again at each *nested*
    device-function call (``InterpretedFunction.__call__``) and never restores them, so without this a GPU
    kernel compiled later in the same process -- a live widget after an exercise -- fails to compile."""
    import sys

    import triton.language as tl
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction
    try:  # imported lazily by the interpreter's argument handling; it wants the compiled helpers at import
        import triton.experimental.gluon  # noqa: F401
    except ImportError:  # pragma: no cover - other Triton versions
        pass
    mods = {id(m): m for name, m in list(sys.modules.items())
            if m is not None and name.startswith("triton.language")}
    mods[id(tl)] = tl
    classes = [tl.core.tensor, getattr(tl.core, "tensor_descriptor_base", tl.core.tensor)]
    before = [(owner, dict(vars(owner))) for owner in list(mods.values()) + classes]
    for mod in mods.values():
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and not isinstance(obj, InterpretedFunction):
                setattr(mod, name, InterpretedFunction(obj.fn))
    try:
        yield
    finally:
        for owner, attrs in before:
            for name, value in list(vars(owner).items()):
                if name not in attrs:
                    if isinstance(owner, type):  # added by a patch (modules may gain lazily imported ones)
                        delattr(owner, name)
                elif value is not attrs[name]:
                    setattr(owner, name, attrs[name])


def _root_cause(e: BaseException) -> BaseException:
    seen = set()
    while e.__cause__ is not None and id(e) not in seen:
        seen.add(id(e))
        e = e.__cause__
    return e


def run(what: str, call: Callable):
    """Run ``call()``; turn a blank still in place, or any error inside the candidate, into an AssertionError
    that says which exercise failed and why."""
    import warnings

    import numpy as np

    from .._runtime import patch_interpreter_scalars
    patch_interpreter_scalars()  # a live GPU kernel may have NumPy >= 2.4, which the interpreter trips on
    try:
        # the interpreter computes with numpy: overflow/NaN of a wrong candidate is judged by the check itself
        with np.errstate(all="ignore"), warnings.catch_warnings(), _interpreted_stdlib():
            warnings.simplefilter("ignore", RuntimeWarning)
            return call()
    except AssertionError:
        raise
    except Exception as e:  # the interpreter wraps errors raised inside a kernel
        cause = _root_cause(e)
        if isinstance(cause, Blank) or "Blank(" in repr(e) or "fill in the blank" in str(e):
            msg = str(cause) if isinstance(cause, Blank) else "a blank is still in place"
            raise AssertionError(f"{what}: {msg}") from None
        raise AssertionError(f"{what}: the candidate raised {type(cause).__name__}: {cause}") from e


def assert_close(got: torch.Tensor, want: torch.Tensor, what: str, atol: float = 1e-5, rtol: float = 1e-5):
    """Equal within tolerance, and NaN nowhere; the message names the worst element."""
    got, want = got.double().cpu(), want.double().cpu()
    if got.shape != want.shape:
        raise AssertionError(f"{what}: shape {tuple(got.shape)}, expected {tuple(want.shape)}")
    nan = torch.isnan(got) & ~torch.isnan(want)
    if nan.any():
        idx = tuple(int(i) for i in nan.nonzero()[0])
        raise AssertionError(f"{what}: NaN at {idx} (expected {float(want[idx]):.4g})")
    same_inf = torch.isinf(got) & torch.isinf(want) & (torch.sign(got) == torch.sign(want))
    err = torch.where(same_inf, torch.zeros_like(got), (got - want).abs())
    err = torch.nan_to_num(err, nan=float("inf"), posinf=float("inf"))
    bad = err > atol + rtol * want.abs().nan_to_num(posinf=0.0, neginf=0.0)
    if bad.any():
        idx = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(f"{what}: {float(got[idx]):.6g} at {idx}, expected {float(want[idx]):.6g} "
                             f"(max |error| {float(err.max()):.3g})")


def passed(name: str, detail: str = "") -> None:
    """What a check prints when the candidate is right."""
    print(f"{name}: correct" + (f" ({detail})" if detail else ""))


def all_exercises() -> List[Exercise]:
    """Every exercise of every chapter module in this package, in chapter order."""
    import importlib
    import pkgutil
    out = []
    for info in sorted(pkgutil.iter_modules(__path__), key=lambda m: m.name):
        if info.name.startswith("ch"):
            out += list(getattr(importlib.import_module(f"{__name__}.{info.name}"), "EXERCISES", []))
    return out
