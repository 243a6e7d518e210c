"""mask_mod -> Triton predicate compiler: trace a ``mask_mod(b, h, q_idx, kv_idx)``, emit a ``@triton.jit``
predicate the kernels evaluate on registers, cache it by the traced graph.

Tracing
-------
The mask_mod is called once with *symbolic* index objects (:class:`Sym`) instead of tensors. Every operation
on them (``+ - * // %``, comparisons, ``& | ^ ~ << >>``, ``torch.where``, ``torch.minimum``/``maximum``,
``torch.remainder``, ``torch.div(..., rounding_mode=...)``, ``zeros_like``, ``.to(int dtype)``) records a node
of a small expression graph instead of computing. Indexing a *captured* integer or bool tensor of one or two
dimensions by index expressions (``doc_ids[q_idx]``, ``table[h, kv_idx]``) records a load; the tensor becomes
a runtime argument of the predicate (one of :data:`MAX_CAPTURES` slots), not part of the compiled code.

What cannot be traced raises :class:`Unsupported` naming the operation: Python control flow on a traced value
(``if q_idx > 3``, ``bool(...)``, Python ``min``/``max``, ``and``/``or``), true division, float arithmetic,
a captured float tensor, more than :data:`MAX_CAPTURES` captured tensors. :func:`compile_or_none` turns that
into one warning line and ``None``; the caller keeps its exact fallback (per-tile bits). A mask is never
compiled to something that might differ from its eager meaning.

Exactness
---------
Eager mask_mods run on int64 index tensors. Every integer node carries an interval (from the index bounds
``0 <= b, h < 2**16`` and ``0 <= q, kv < pos_bound``); a node is computed in int32 only when its interval and
its operands fit, otherwise in int64 with int64's wrap-around, as torch computes. Values of narrower dtypes
(loads from int8/uint8/int16/int32 tables, ``.to(...)``) follow torch's type promotion and wrap around where
torch's would. ``//`` and ``%`` keep torch's floor semantics (Triton's are C's truncation): by a power of two
they are a shift and a mask, otherwise a helper unless both operands are non-negative. Loads clamp their index
into the tensor (negative indices wrap first, as torch's do), so padding rows past the sequence, which the
kernels mask anyway, never read outside a capture.

Code generation
---------------
:func:`compile_mask` writes the predicate as a real module file (Triton reads a jit function's source with
``inspect``) under :func:`cache_dir`, named by a hash of its source (which encodes the graph: structure,
constants, capture dtypes and ranks, the position bound), imports it once per process and returns a
:class:`CompiledMask`. The predicate's signature is fixed,
``pred(b, h, q, kv, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE)``: ``q``/``kv`` broadcast index tensors of any
orientation (``[M, 1]``/``[1, N]`` or ``[1, M]``/``[N, 1]``), ``CAPi`` the captures (None when unused),
``CAP_SHAPE`` int32 ``[MAX_CAPTURES, 2]`` their sizes; it returns a bool tile of the broadcast shape.
Kernels take it as a ``tl.constexpr`` argument and call it.
"""
from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import tempfile
import threading
import warnings
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

from . import _runtime

MAX_CAPTURES = 4  # capture slots of the predicate's signature; a mask capturing more falls back
I32 = (-(1 << 31), (1 << 31) - 1)
I64 = (-(1 << 63), (1 << 63) - 1)
HEAD_BOUND = 1 << 16  # b and h range the predicate assumes (layouts have far fewer batch rows and heads)
DEFAULT_POS_BOUND = 1 << 24  # positions below 16M: a longer layout compiles with pos_bound = 2**31

_INT_DTYPES = {torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int16: (-(1 << 15), (1 << 15) - 1),
               torch.int32: I32, torch.int64: I64}
_ARGS = ("b", "h", "q", "kv")


class Unsupported(Exception):
    """The mask_mod uses something the tracer cannot turn into a predicate; the message names it."""


class MaskTypeError(TypeError):
    """The mask_mod is wrong whatever evaluates it (e.g. a float tensor used as an index)."""


# ---- the graph -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Node:
    op: str  # arg, const, bin, neg, inv, not, where, load, bool2int
    args: tuple  # child node ids, then op-specific constants
    kind: str  # "int" or "bool"
    lo: int = 0
    hi: int = 0
    dt: str = "int64"  # torch dtype of an int value; "weak": a Python scalar, "bool": a promoted bool

    @property
    def wide(self) -> bool:
        return self.kind == "int" and not (I32[0] <= self.lo and self.hi <= I32[1])


class Graph:
    """Hash-consed expression graph: structurally equal subexpressions share one node, so two traces of
    equal masks produce equal graphs (and equal source)."""

    def __init__(self, pos_bound: int, device):
        self.nodes: list[Node] = []
        self._ids: dict = {}
        self.captures: list[torch.Tensor] = []
        self.pos_bound = pos_bound
        self.device = device

    def add(self, node: Node) -> "Sym":
        key = (node.op, node.args, node.kind, node.lo, node.hi, node.dt)
        i = self._ids.get(key)
        if i is None:
            i = self._ids[key] = len(self.nodes)
            self.nodes.append(node)
        return Sym(self, i)

    def node(self, s: "Sym") -> Node:
        return self.nodes[s.i]

    def capture(self, t: torch.Tensor) -> int:
        for i, c in enumerate(self.captures):
            if c is t:
                return i
        if len(self.captures) == MAX_CAPTURES:
            raise Unsupported(f"more than {MAX_CAPTURES} captured tensors")
        self.captures.append(t)
        return len(self.captures) - 1


def _clip(lo: int, hi: int) -> tuple:
    """An int64 result interval; anything past int64 wraps, so it may be anywhere."""
    return (lo, hi) if I64[0] <= lo and hi <= I64[1] else I64


def _bits_range(a: Node, b: Node) -> tuple:
    if a.lo >= 0 and b.lo >= 0:
        return 0, (1 << max(a.hi.bit_length(), b.hi.bit_length())) - 1
    if not (a.wide or b.wide):
        return I32
    return I64


def _range(op: str, a: Node, b: Node) -> tuple:
    """Interval of ``a <op> b`` for integer nodes (conservative)."""
    if op == "add":
        return _clip(a.lo + b.lo, a.hi + b.hi)
    if op == "sub":
        return _clip(a.lo - b.hi, a.hi - b.lo)
    if op == "mul":
        ends = [x * y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return _clip(min(ends), max(ends))
    if op in ("floordiv", "truncdiv"):
        if b.lo > 0:  # positive divisor: monotone in a
            div = (lambda x, y: x // y) if op == "floordiv" else (lambda x, y: -(-x // y) if x < 0 else x // y)
            ends = [div(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            return min(ends), max(ends)
        m = max(abs(a.lo), abs(a.hi))
        return _clip(-m, m)
    if op == "mod":  # floor semantics: the sign of the divisor
        if b.lo > 0:
            return (0, b.hi - 1) if not (a.lo >= 0 and a.hi < b.lo) else (a.lo, a.hi)
        if b.hi < 0:
            return b.lo + 1, 0
        m = max(abs(b.lo), abs(b.hi))
        return -m + 1, m - 1
    if op == "and":
        if a.lo >= 0 and b.lo >= 0:
            return 0, min(a.hi, b.hi)
        if a.lo >= 0 or b.lo >= 0:
            return 0, a.hi if a.lo >= 0 else b.hi
        return _bits_range(a, b)
    if op in ("or", "xor"):
        return _bits_range(a, b)
    if op == "shr":
        if b.lo >= 0 and b.hi < 64:
            return min(a.lo >> b.lo, a.lo >> b.hi), max(a.hi >> b.lo, a.hi >> b.hi)
        return I64
    if op == "shl":
        if b.lo >= 0 and b.hi < 64:
            ends = [x << y for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
            return _clip(min(ends), max(ends))
        return I64
    if op == "min":
        return min(a.lo, b.lo), min(a.hi, b.hi)
    if op == "max":
        return max(a.lo, b.lo), max(a.hi, b.hi)
    raise AssertionError(op)


_CMP = {"lt", "le", "gt", "ge", "eq", "ne"}
_BOOL_OK = {"and", "or", "xor", "eq", "ne"}  # ops that keep meaning on bools without promotion


# ---- symbolic index objects ------------------------------------------------------------------------------------
def _dtype_of(x) -> Optional[torch.dtype]:
    return x if isinstance(x, torch.dtype) else None


class Sym:
    """A traced value: a node of a :class:`Graph`. Behaves like an int64 (or bool) index tensor of unknown
    shape under the operations mask_mods use; anything else raises :class:`Unsupported`."""

    __slots__ = ("g", "i")

    def __init__(self, g: Graph, i: int):
        self.g, self.i = g, i

    # -- what code may read off an index tensor
    @property
    def device(self):
        return self.g.device

    @property
    def dtype(self):
        n = self.g.node(self)
        return torch.bool if n.kind == "bool" else getattr(torch, n.dt if n.dt not in ("weak", "bool") else "int64")

    def __repr__(self) -> str:
        return f"Sym({render(self.g, self.i)})"

    def __getattr__(self, name):
        raise Unsupported(f"attribute or method .{name} of an index tensor")

    # -- Python protocols that need a concrete value: data-dependent control flow
    def __bool__(self):
        raise Unsupported("bool() of a traced value (Python if/and/or/min/max on q_idx/kv_idx)")

    def __index__(self):
        raise Unsupported("int() / index of a traced value")

    __int__ = __index__

    def __float__(self):
        raise Unsupported("float() of a traced value")

    def __len__(self):
        raise Unsupported("len() of a traced value (torch.as_tensor / torch.tensor of an index, Python len)")

    def __iter__(self):
        raise Unsupported("iterating over a traced value")

    def __getitem__(self, item):
        raise Unsupported("indexing into an index tensor (q_idx[...])")

    def __hash__(self):
        return id(self)

    # -- operators
    def __add__(self, o): return _bin("add", self, o)
    def __radd__(self, o): return _bin("add", o, self)
    def __sub__(self, o): return _bin("sub", self, o)
    def __rsub__(self, o): return _bin("sub", o, self)
    def __mul__(self, o): return _bin("mul", self, o)
    def __rmul__(self, o): return _bin("mul", o, self)
    def __floordiv__(self, o): return _bin("floordiv", self, o)
    def __rfloordiv__(self, o): return _bin("floordiv", o, self)
    def __mod__(self, o): return _bin("mod", self, o)
    def __rmod__(self, o): return _bin("mod", o, self)
    def __and__(self, o): return _bin("and", self, o)
    def __rand__(self, o): return _bin("and", o, self)
    def __or__(self, o): return _bin("or", self, o)
    def __ror__(self, o): return _bin("or", o, self)
    def __xor__(self, o): return _bin("xor", self, o)
    def __rxor__(self, o): return _bin("xor", o, self)
    def __lshift__(self, o): return _bin("shl", self, o)
    def __rlshift__(self, o): return _bin("shl", o, self)
    def __rshift__(self, o): return _bin("shr", self, o)
    def __rrshift__(self, o): return _bin("shr", o, self)
    def __lt__(self, o): return _bin("lt", self, o)
    def __le__(self, o): return _bin("le", self, o)
    def __gt__(self, o): return _bin("gt", self, o)
    def __ge__(self, o): return _bin("ge", self, o)
    def __eq__(self, o): return _bin("eq", self, o)  # noqa: E704
    def __ne__(self, o): return _bin("ne", self, o)  # noqa: E704
    def __invert__(self): return _unary("invert", self)
    def __neg__(self): return _bin("sub", 0, self)
    def __pos__(self): return self
    def __abs__(self): return _abs(self)

    def __truediv__(self, o):
        raise Unsupported("/ (true division gives floats; use // or torch.div(..., rounding_mode='floor'))")

    __rtruediv__ = __truediv__

    def __pow__(self, o):
        raise Unsupported("** on a traced value")

    # -- tensor methods mask_mods call
    def to(self, *args, **kwargs):
        dtype = kwargs.get("dtype")
        for a in args:
            dtype = _dtype_of(a) or dtype
        return self if dtype is None else _cast(self, dtype)

    def long(self): return _cast(self, torch.int64)
    def int(self): return _cast(self, torch.int32)
    def bool(self): return _cast(self, torch.bool)
    def clone(self): return self
    def contiguous(self): return self
    def logical_not(self): return _logical_not(self)
    def logical_and(self, o): return _bin("and", _as_bool(self), _as_bool(_lift(self.g, o)))
    def logical_or(self, o): return _bin("or", _as_bool(self), _as_bool(_lift(self.g, o)))
    def remainder(self, o): return _bin("mod", self, o)
    def abs(self): return _abs(self)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        return _torch_function(func, args, kwargs or {})


def _graph_of(*xs) -> Graph:
    for x in xs:
        if isinstance(x, Sym):
            return x.g
    raise AssertionError("no traced operand")


def _lift(g: Graph, x) -> Sym:
    """A traced operand from a Python int/bool or a 0-d integer tensor (a constant baked into the code)."""
    if isinstance(x, Sym):
        return x
    if isinstance(x, torch.Tensor):
        if x.dim() != 0:
            raise Unsupported(f"a captured tensor of shape {tuple(x.shape)} used without indexing it by "
                              f"q_idx/kv_idx/b/h")
        if x.dtype.is_floating_point or x.is_complex():
            raise Unsupported(f"a {x.dtype} scalar tensor (float arithmetic)")
        x = x.item()
    if isinstance(x, bool):
        return g.add(Node("const", (int(x),), "bool"))
    if isinstance(x, int):
        if not I64[0] <= x <= I64[1]:
            raise Unsupported(f"integer constant {x} beyond int64")
        return g.add(Node("const", (x,), "int", x, x, "weak"))
    if isinstance(x, float):
        raise Unsupported(f"float constant {x!r} (float arithmetic)")
    raise Unsupported(f"an operand of type {type(x).__name__}")


def _as_int(s: Sym) -> Sym:
    n = s.g.node(s)
    return s.g.add(Node("bool2int", (s.i,), "int", 0, 1, "bool")) if n.kind == "bool" else s


def _as_bool(s: Sym) -> Sym:
    return s if s.g.node(s).kind == "bool" else _bin("ne", s, 0)


def _bin(op: str, x, y) -> Sym:
    g = _graph_of(x, y)
    a, b = _lift(g, x), _lift(g, y)
    na, nb = g.node(a), g.node(b)
    if na.kind == "bool" and nb.kind == "bool" and op in _BOOL_OK:
        if op == "eq":  # a == b on bools: not (a xor b)
            return _logical_not(g.add(Node("bin", ("xor", a.i, b.i), "bool")))
        return g.add(Node("bin", ("xor" if op == "ne" else op, a.i, b.i), "bool"))
    if na.kind == "bool" and nb.kind == "bool" and op not in _CMP:
        raise Unsupported(f"arithmetic ({op}) on two bool values")
    a, b = _as_int(a), _as_int(b)  # torch promotes bool to integer in arithmetic and mixed comparisons
    na, nb = g.node(a), g.node(b)
    if op in _CMP:
        return g.add(Node("bin", (op, a.i, b.i), "bool"))
    if op in ("floordiv", "mod", "truncdiv") and nb.lo <= 0 <= nb.hi:
        raise Unsupported(f"{'//' if op != 'mod' else '%'} by a value that may be zero")
    if op in ("shl", "shr") and not (0 <= nb.lo and nb.hi <= 63):
        raise Unsupported("a shift by an amount that may leave [0, 63]")
    lo, hi = _range(op, na, nb)
    return _wrap(g.add(Node("bin", (op, a.i, b.i), "int", lo, hi, _promote(na.dt, nb.dt))))


def _promote(da: str, db: str) -> str:
    """torch's result dtype of an integer op: a Python scalar (and a bool) takes the other side's dtype."""
    loose = ("weak", "bool")
    if da in loose:
        return db if db not in loose else "int64"
    if db in loose:
        return da
    return str(torch.promote_types(getattr(torch, da), getattr(torch, db))).replace("torch.", "")


def _wrap(s: Sym) -> Sym:
    """A value of a dtype narrower than int64 wraps around as torch's does when its exact range leaves it."""
    n = s.g.node(s)
    if n.dt in ("int64", "weak", "bool"):
        return s
    lo, hi = _INT_DTYPES[getattr(torch, n.dt)]
    if lo <= n.lo and n.hi <= hi:
        return s
    return s.g.add(Node("wrap", (s.i,), "int", lo, hi, n.dt))


def _unary(op: str, s: Sym) -> Sym:
    n = s.g.node(s)
    if op == "invert" and n.kind == "bool":
        return _logical_not(s)
    return _wrap(s.g.add(Node("inv", (s.i,), "int", ~n.hi, ~n.lo, n.dt)))


def _logical_not(s: Sym) -> Sym:
    s = _as_bool(s)
    n = s.g.node(s)
    if n.op == "not":  # ~~x
        return Sym(s.g, n.args[0])
    return s.g.add(Node("not", (s.i,), "bool"))


def _abs(s: Sym) -> Sym:
    return _where(_bin("lt", s, 0), _bin("sub", 0, s), s)


def _where(c, x, y) -> Sym:
    g = _graph_of(c, x, y)
    c, a, b = _as_bool(_lift(g, c)), _lift(g, x), _lift(g, y)
    na, nb = g.node(a), g.node(b)
    if na.kind != nb.kind:
        a, b = _as_int(a), _as_int(b)
        na, nb = g.node(a), g.node(b)
    if na.kind == "bool":
        return g.add(Node("where", (c.i, a.i, b.i), "bool"))
    return g.add(Node("where", (c.i, a.i, b.i), "int", min(na.lo, nb.lo), max(na.hi, nb.hi),
                      _promote(na.dt, nb.dt)))


def _cast(s: Sym, dtype) -> Sym:
    if dtype == torch.bool:
        return _as_bool(s)
    if dtype in _INT_DTYPES:
        s = _as_int(s)
        n = s.g.node(s)
        dt = str(dtype).replace("torch.", "")
        if n.dt == dt:
            return s
        if n.op == "const" and _INT_DTYPES[dtype][0] <= n.lo <= _INT_DTYPES[dtype][1]:
            return s.g.add(Node("const", n.args, "int", n.lo, n.hi, dt))
        # the same value under another dtype name (a cast node that emits nothing), wrapped if it must
        return _wrap(s.g.add(Node("retype", (s.i,), "int", n.lo, n.hi, dt)))
    raise Unsupported(f".to({dtype}) (only integer and bool index values)")


def _load(t: torch.Tensor, idx) -> Sym:
    items = idx if isinstance(idx, tuple) else (idx,)
    g = _graph_of(*items)
    if t.is_complex() or t.dtype.is_floating_point:
        raise Unsupported(f"indexing a captured {t.dtype} tensor (only integer and bool tables compile)")
    if t.dtype != torch.bool and t.dtype not in _INT_DTYPES:
        raise Unsupported(f"indexing a captured {t.dtype} tensor")
    if t.dim() not in (1, 2) or len(items) != t.dim():
        raise Unsupported(f"indexing a captured {t.dim()}-D tensor with {len(items)} indices "
                          f"(one index per dimension of a 1-D or 2-D table compiles)")
    ids = []
    for it in items:
        if isinstance(it, torch.Tensor) and (it.dtype.is_floating_point or it.is_complex()):
            raise MaskTypeError(f"mask_mod indexes a captured tensor of shape {tuple(t.shape)} with a {it.dtype} "
                            f"tensor; indices must be integers (as in eager torch)")
        if isinstance(it, (slice, type(None), type(Ellipsis))) or isinstance(it, torch.Tensor) and it.dim() > 0:
            raise Unsupported(f"indexing a captured tensor with {type(it).__name__}")
        s = _as_int(_lift(g, it))
        if g.node(s).kind != "int":
            raise Unsupported("indexing a captured tensor with a bool")
        ids.append(s.i)
    slot = g.capture(t)
    key = (slot, str(t.dtype).replace("torch.", ""), *ids)
    if t.dtype == torch.bool:
        return g.add(Node("load", key, "bool"))
    lo, hi = _INT_DTYPES[t.dtype]
    return g.add(Node("load", key, "int", lo, hi, str(t.dtype).replace("torch.", "")))


_TORCH_BIN = {"add": "add", "sub": "sub", "subtract": "sub", "mul": "mul", "multiply": "mul",
              "remainder": "mod", "floor_divide": "floordiv", "bitwise_and": "and", "bitwise_or": "or",
              "bitwise_xor": "xor", "bitwise_left_shift": "shl", "bitwise_right_shift": "shr",
              "eq": "eq", "ne": "ne", "lt": "lt", "le": "le", "gt": "gt", "ge": "ge", "less": "lt",
              "less_equal": "le", "greater": "gt", "greater_equal": "ge", "not_equal": "ne",
              "minimum": "min", "maximum": "max", "__and__": "and", "__or__": "or", "__xor__": "xor",
              "__lshift__": "shl", "__rshift__": "shr", "__eq__": "eq", "__ne__": "ne", "__lt__": "lt",
              "__le__": "le", "__gt__": "gt", "__ge__": "ge", "__add__": "add", "__sub__": "sub",
              "__mul__": "mul", "__mod__": "mod", "__floordiv__": "floordiv"}
_TORCH_RBIN = {"__radd__": "add", "__rsub__": "sub", "__rmul__": "mul", "__rand__": "and", "__ror__": "or",
               "__rxor__": "xor", "__rmod__": "mod", "__rfloordiv__": "floordiv"}


def _torch_function(func, args, kwargs):
    name = getattr(func, "__name__", str(func))
    if name == "__getitem__":
        t, idx = args
        if not isinstance(t, torch.Tensor):
            raise Unsupported(f"indexing a {type(t).__name__}")
        return _load(t, idx)
    if name in ("where",) and len(args) == 3 and not kwargs:
        return _where(*args)
    if name in ("min", "max") and len(args) == 2 and not kwargs:
        return _bin(name, *args)
    if name in ("zeros_like", "ones_like", "full_like"):
        src = args[0]
        value = {"zeros_like": 0, "ones_like": 1}.get(name, args[1] if len(args) > 1 else kwargs.get("fill_value"))
        dtype = kwargs.get("dtype") or src.dtype
        return _cast(_lift(src.g, value), dtype)
    if name in ("div", "divide"):
        mode = kwargs.get("rounding_mode")
        if mode not in ("floor", "trunc") or len(args) != 2:
            raise Unsupported("torch.div without rounding_mode='floor' or 'trunc' (true division gives floats)")
        if mode == "trunc":
            return _bin("truncdiv", *args)
        return _bin("floordiv", *args)
    if name in ("logical_and", "logical_or", "logical_xor") and len(args) == 2 and not kwargs:
        g = _graph_of(*args)
        a, b = (_as_bool(_lift(g, x)) for x in args)
        return _bin(name.split("_")[1], a, b)
    if name in ("logical_not", "bitwise_not", "__invert__") and len(args) == 1:
        return _logical_not(args[0]) if name == "logical_not" else _unary("invert", args[0])
    if name in ("abs", "absolute") and len(args) == 1:
        return _abs(args[0])
    if name in ("neg", "negative", "__neg__") and len(args) == 1:
        return _bin("sub", 0, args[0])
    if name in ("to", "long", "int", "bool", "clone", "contiguous") and isinstance(args[0], Sym):
        return getattr(args[0], name)(*args[1:], **kwargs)
    if name in _TORCH_BIN and len(args) == 2 and not kwargs:
        return _bin(_TORCH_BIN[name], *args)
    if name in _TORCH_RBIN and len(args) == 2 and not kwargs:
        return _bin(_TORCH_RBIN[name], args[1], args[0])
    raise Unsupported(f"torch.{name}" + (" with these arguments" if name in _TORCH_BIN else ""))


# ---- tracing ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Traced:
    graph: Graph
    out: int  # node id of the result (bool)

    def text(self) -> str:
        """The traced expression in one line (captured tensors as ``cap0[...]``; long shared subexpressions
        by their names in the generated source)."""
        return _render(self.graph, self.out, {})


def trace(mask_mod, *, pos_bound: int = DEFAULT_POS_BOUND, device=None) -> Traced:
    """Trace ``mask_mod`` into an expression graph. Raises :class:`Unsupported` naming the first operation the
    tracer cannot follow, TypeError when ``mask_mod`` is not callable."""
    if not callable(mask_mod):
        raise TypeError(f"mask_mod must be callable, got {type(mask_mod).__name__}")
    if not isinstance(pos_bound, int) or isinstance(pos_bound, bool) or not 1 <= pos_bound <= (1 << 31):
        raise ValueError(f"pos_bound must be an int in [1, 2**31], got {pos_bound!r}")
    g = Graph(pos_bound, torch.device("cpu") if device is None else torch.device(device))
    ranges = {"b": HEAD_BOUND, "h": HEAD_BOUND, "q": pos_bound, "kv": pos_bound}
    syms = [g.add(Node("arg", (name,), "int", 0, ranges[name] - 1)) for name in _ARGS]
    try:
        out = mask_mod(*syms)
    except (Unsupported, MaskTypeError):
        raise
    except (TypeError, RuntimeError, IndexError, ValueError, AttributeError, NotImplementedError) as e:
        # torch refusing a Sym somewhere the tracer does not reach (e.g. torch.as_tensor(q_idx))
        raise Unsupported(f"{type(e).__name__} inside the mask_mod under tracing: {str(e).splitlines()[0][:120]}")
    if not isinstance(out, Sym):
        raise Unsupported(f"the mask_mod returned {type(out).__name__}, not an expression of its arguments")
    if g.node(out).kind != "bool":
        raise Unsupported("the mask_mod returns an integer value, not a bool mask")
    return Traced(g, out.i)


# ---- tile bounds: the traced graph by interval arithmetic over each tile ----------------------------------------
def tile_bounds(mask_mod, grid):
    """What the traced ``mask_mod`` decides about whole tiles of ``grid`` (a :class:`~sparseattn.patterns.
    TileGrid`) without evaluating a cell: a :class:`~sparseattn.patterns.TileBounds` (on the grid's device,
    or the CPU where a node is constant), or None when the mask does not trace. A few elementwise tensor ops
    per node of the expression over the ``nq x nk`` tile grid, no host sync.

    Every integer node gets an interval per tile from the intervals of its operands (``q`` over the tile's
    rows, ``kv`` over its columns, ``b`` and ``h`` exact), every bool node two flags: *may be true somewhere
    in the tile*, *may be false somewhere*. A tile whose result may not be true is empty; one whose result
    may not be false is full. Interval arithmetic treats each occurrence of a variable on its own, so it
    over-approximates (``q - q`` spans the tile twice over): it may leave a tile undecided that is not, never
    decide one wrongly. The same rules bound each node as the tracer's own ranges do (:func:`_range`), and a
    node whose value may wrap around (its traced range is not exact) keeps that whole range. This is the tile
    rule of a mask without a hand-written one -- a plain lambda, or a composition around one: for
    ``causal & stripes`` it empties every tile above the diagonal, which the device classification would
    otherwise scan cell by cell."""
    from .patterns import TileBounds
    traced = _traced_for(mask_mod, pos_bound_for(max(grid.q_start + grid.q_len, grid.kv_len)))
    if traced is None:
        return None
    pos = {"b": (grid.b, grid.b), "h": (grid.h, grid.h), "q": (grid.q_lo, grid.q_hi), "kv": (grid.k_lo, grid.k_hi)}
    vals: dict = {}
    for i in _reachable(traced.graph, traced.out):
        vals[i] = _tile_value(traced.graph, traced.graph.nodes[i], vals, pos)
    may_true, may_false = (torch.broadcast_to(torch.as_tensor(x), (grid.B, grid.H, grid.nq, grid.nk))
                           for x in vals[traced.out])
    return TileBounds(~may_false, may_true, ~may_false, may_true)


_TRACED: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # mask_mod -> {pos_bound: Traced or None}


def _traced_for(mask_mod, pos_bound: int) -> Optional[Traced]:
    """:func:`trace` remembered per mask_mod object (weakly): a layout built again from the same mask traces it
    once. None on any failure while tracing -- the cell evaluation that follows reports the mask's errors."""
    try:
        memo = _TRACED.setdefault(mask_mod, {})
    except TypeError:  # not weakly referenceable: no memo
        memo = {}
    if pos_bound not in memo:
        try:
            memo[pos_bound] = trace(mask_mod, pos_bound=pos_bound)
        except Exception:  # noqa: BLE001
            memo[pos_bound] = None
    return memo[pos_bound]


def _tile_value(g: Graph, n: Node, vals: dict, pos: dict):
    """``(lo, hi)`` int64 tensors of an integer node, ``(may_true, may_false)`` bool tensors of a bool node,
    over each tile (broadcastable; see :func:`tile_bounds`)."""
    T = lambda x: torch.as_tensor(x, dtype=torch.int64)  # noqa: E731
    B = lambda x: torch.as_tensor(x, dtype=torch.bool)  # noqa: E731
    whole = (T(n.lo), T(n.hi))  # the traced range: always true of the node
    if n.op == "arg":
        return pos[n.args[0]]
    if n.op == "const":
        return (B(bool(n.args[0])), B(not n.args[0])) if n.kind == "bool" else (T(n.args[0]), T(n.args[0]))
    if n.op == "not":
        t, f = vals[n.args[0]]
        return f, t
    if n.op == "bool2int":
        t, f = vals[n.args[0]]
        return (~f).long(), t.long()
    if n.op == "retype":
        return vals[n.args[0]]
    if n.op == "inv":  # ~x = -x - 1 on the exact value; a narrow dtype's wrap is a node of its own
        lo, hi = vals[n.args[0]]
        return _within(-hi - 1, -lo - 1, n)
    if n.op == "where":
        (ct, cf), x, y = vals[n.args[0]], vals[n.args[1]], vals[n.args[2]]
        if n.kind == "bool":
            return (ct & x[0]) | (cf & y[0]), (ct & x[1]) | (cf & y[1])
        lo = torch.where(~cf, x[0], torch.where(~ct, y[0], torch.minimum(x[0], y[0])))
        hi = torch.where(~cf, x[1], torch.where(~ct, y[1], torch.maximum(x[1], y[1])))
        return lo, hi
    if n.op in ("wrap", "load"):
        return (B(True), B(True)) if n.kind == "bool" else whole
    op, a, b = n.args
    if n.kind == "bool" and g.nodes[a].kind == "bool":  # logic on two bools
        (at, af), (bt, bf) = vals[a], vals[b]
        if op == "and":
            return at & bt, af | bf
        if op == "or":
            return at | bt, af & bf
        return (at & bf) | (af & bt), (at & bt) | (af & bf)  # xor
    (alo, ahi), (blo, bhi) = vals[a], vals[b]
    if op in ("lt", "le", "gt", "ge"):  # (may be true, may be false) of a comparison of two intervals
        if op == "lt":
            return alo < bhi, ahi >= blo
        if op == "le":
            return alo <= bhi, ahi > blo
        if op == "gt":
            return ahi > blo, alo <= bhi
        return ahi >= blo, alo < bhi
    if op in ("eq", "ne"):
        may_eq = (alo <= bhi) & (blo <= ahi)  # the intervals meet
        may_ne = (alo != ahi) | (blo != bhi) | (alo != blo)  # not one and the same point
        return (may_eq, may_ne) if op == "eq" else (may_ne, may_eq)
    if (n.lo, n.hi) == I64:  # may wrap around int64: nothing narrower than its traced range holds
        return whole
    if op == "add":
        return _within(alo + blo, ahi + bhi, n)
    if op == "sub":
        return _within(alo - bhi, ahi - blo, n)
    if op == "mul":
        ends = [alo * blo, alo * bhi, ahi * blo, ahi * bhi]
        return _within(_min(ends), _max(ends), n)
    if op == "min":
        return _within(torch.minimum(alo, blo), torch.minimum(ahi, bhi), n)
    if op == "max":
        return _within(torch.maximum(alo, blo), torch.maximum(ahi, bhi), n)
    nb = g.nodes[b]
    if op == "floordiv" and nb.lo > 0:  # positive divisor: monotone in each operand, extremes at the corners
        ends = [torch.div(x, y, rounding_mode="floor") for x in (alo, ahi) for y in (blo, bhi)]
        return _within(_min(ends), _max(ends), n)
    if op == "mod" and nb.op == "const" and nb.lo > 0:  # floor modulo by a positive constant
        c = nb.lo
        k_lo, k_hi = torch.div(alo, c, rounding_mode="floor"), torch.div(ahi, c, rounding_mode="floor")
        same = k_lo == k_hi  # the tile's values lie in one period: the remainder is monotone there
        return _within(torch.where(same, alo - k_lo * c, 0), torch.where(same, ahi - k_hi * c, c - 1), n)
    return whole  # bit operations, shifts, truncating division, other divisors: the traced range


def _min(xs):
    out = xs[0]
    for x in xs[1:]:
        out = torch.minimum(out, x)
    return out


def _max(xs):
    out = xs[0]
    for x in xs[1:]:
        out = torch.maximum(out, x)
    return out


def _within(lo, hi, n: Node):
    """A tile interval intersected with the node's traced range (both hold, so both together do)."""
    return torch.clamp(torch.as_tensor(lo), min=n.lo), torch.clamp(torch.as_tensor(hi), max=n.hi)


_SYM = {"add": "+", "sub": "-", "mul": "*", "floordiv": "//", "truncdiv": "/trunc/", "mod": "%", "and": "&",
        "or": "|", "xor": "^", "shl": "<<", "shr": ">>", "lt": "<", "le": "<=", "gt": ">", "ge": ">=",
        "eq": "==", "ne": "!="}


#: A subexpression longer than this is shown by its name in the generated source (``v12``), so a mask whose
#: graph shares subexpressions many times (a hash) renders in linear, not exponential, length.
RENDER_LIMIT = 160


def render(g: Graph, i: int, memo: Optional[dict] = None) -> str:
    """A node as a Python-like expression (for messages, summaries and the book)."""
    memo = {} if memo is None else memo
    if i not in memo:
        text = _render(g, i, memo)
        memo[i] = text if len(text) <= RENDER_LIMIT else f"v{i}"
    return memo[i]


def _render(g: Graph, i: int, memo: dict) -> str:
    n = g.nodes[i]
    r = lambda j: render(g, j, memo)  # noqa: E731
    p = lambda j: _paren(g, j, memo)  # noqa: E731
    if n.op == "arg":
        return {"q": "q_idx", "kv": "kv_idx"}.get(n.args[0], n.args[0])
    if n.op == "const":
        return str(bool(n.args[0])) if n.kind == "bool" else str(n.args[0])
    if n.op == "bool2int":
        return f"int({r(n.args[0])})"
    if n.op in ("wrap", "retype"):
        return f"{p(n.args[0])}.to({n.dt})"
    if n.op in ("not", "inv"):
        return f"~{p(n.args[0])}"
    if n.op == "where":
        return f"where({', '.join(r(a) for a in n.args)})"
    if n.op == "load":
        return f"cap{n.args[0]}[{', '.join(r(a) for a in n.args[2:])}]"
    op, a, b = n.args
    if op in ("min", "max"):
        return f"{op}({r(a)}, {r(b)})"
    return f"{p(a)} {_SYM[op]} {p(b)}"


def _paren(g: Graph, i: int, memo: dict) -> str:
    s = render(g, i, memo)
    n = g.nodes[i]
    bare = n.op in ("arg", "const", "load", "where") or n.op == "bin" and n.args[0] in ("min", "max") or \
        s == f"v{i}"
    return s if bare else f"({s})"


# ---- code generation -------------------------------------------------------------------------------------------
_TL = {"add": "+", "sub": "-", "mul": "*", "and": "&", "or": "|", "xor": "^", "shl": "<<", "shr": ">>",
       "lt": "<", "le": "<=", "gt": ">", "ge": ">=", "eq": "==", "ne": "!="}


def _kids(n: Node) -> tuple:
    return n.args[2:] if n.op == "load" else n.args[1:] if n.op == "bin" else \
        () if n.op in ("arg", "const") else n.args


def _reachable(g: Graph, out: int) -> list:
    seen, order = set(), []

    def visit(i):
        if i in seen:
            return
        seen.add(i)
        n = g.nodes[i]
        kids = _kids(n)
        for k in kids:
            visit(k)
        order.append(i)
    visit(out)
    return order


def generate(traced: Traced) -> str:
    """Triton source of the predicate module for ``traced`` (deterministic: equal graphs, equal source)."""
    g = traced.graph
    order = _reachable(g, traced.out)
    wide = _widths(g, order)
    body, names = [], {}
    helpers = set()

    def val(i, as_wide=False):
        n = g.nodes[i]
        if n.op == "const":
            v = n.args[0]
            if n.kind == "bool":
                return "True" if v else "False"
            # a literal in [2**31, 2**32) is uint32 to Triton; in a wide context it meets an int64 operand
            return f"({v})" if v < 0 else str(v)
        name = names[i]
        return f"{name}.to(tl.int64)" if as_wide and not wide[i] and n.kind == "int" else name

    for i in order:
        n = g.nodes[i]
        if n.op == "const":
            continue
        name = names[i] = f"v{i}"
        if n.op == "arg":
            src = n.args[0]
        elif n.op == "bool2int":
            src = f"{val(n.args[0])}.to(tl.int32)"
        elif n.op == "retype":
            src = val(n.args[0])
        elif n.op == "wrap":  # truncate to the narrow dtype (two's complement), compute on in int32
            src = f"{val(n.args[0])}.to(tl.{n.dt})" + (".to(tl.int32)" if n.dt != "int32" else "")
        elif n.op == "not":
            src = f"{val(n.args[0])} == 0"
        elif n.op == "inv":
            src = f"~{val(n.args[0], wide[i])}"
        elif n.op == "where":
            c, a, b = n.args
            src = f"tl.where({val(c)}, {val(a, wide[i])}, {val(b, wide[i])})"
        elif n.op == "load":
            slot, dtype, *idx = n.args
            src = _load_src(g, slot, idx, val, body, name)
            if dtype in ("int8", "uint8", "int16"):
                src = f"{src}.to(tl.int32)"
        else:
            op, a, b = n.args
            na, nb = g.nodes[a], g.nodes[b]
            w = wide[i] or (na.kind == "int" and (wide[a] or wide[b]))
            x, y = val(a, w), val(b, w)
            if op in _TL:
                src = f"{x} {_TL[op]} {y}"
            elif op in ("min", "max"):
                src = f"tl.{op}imum({x}, {y})"
            elif op in ("floordiv", "mod", "truncdiv"):
                c = nb.lo if nb.op == "const" else None
                if op != "truncdiv" and c is not None and c > 0 and c & (c - 1) == 0:
                    # a power of two: an arithmetic shift floors and a two's complement mask is the floor
                    # modulo, for negative values too
                    src = f"{x} >> {c.bit_length() - 1}" if op == "floordiv" else f"{x} & {c - 1}"
                elif na.lo >= 0 and nb.lo > 0:  # C and floor semantics agree
                    src = f"{x} {'%' if op == 'mod' else '//'} {y}"
                else:
                    helpers.add(op)
                    src = f"_{op}({x}, {y})"
            else:
                raise AssertionError(op)
        body.append(f"    {name} = {src}")
    out = val(traced.out)
    used = {g.nodes[i].args[0] for i in order if g.nodes[i].op == "arg"}
    if {"q", "kv"} <= used:  # every node is elementwise: the result already has the tile's shape
        body.append(f"    return {out}")
    else:  # a mask of one position (only kv, say) or none is widened to the tile the caller expects
        body.append("    tile = (q + kv) == (q + kv)")
        body.append(f"    return tile & {out}")
    lines = ['"""Generated by sparseattn.maskc from the traced mask_mod:',
             f"    {traced.text()}",
             'Do not edit: the file name is a hash of this source."""',
             "import triton", "import triton.language as tl", ""]
    for h in sorted(helpers | {"floordiv"}):  # the tile bounds floor-divide too
        lines += _HELPERS[h]
    lines += ["", "@triton.jit",
              "def pred(b, h, q, kv, CAP0, CAP1, CAP2, CAP3, CAP_SHAPE):"] + body
    lines += generate_bounds(traced)
    return "\n".join(lines) + "\n"


def _lit(v: int) -> str:
    """An int64 literal Triton reads as int64 (``-2**63`` cannot be written as a negated literal)."""
    return "(-9223372036854775807 - 1)" if v == I64[0] else f"({v})" if v < 0 else str(v)


def generate_bounds(traced: Traced) -> list:
    """Source lines of ``bounds(b, h, q_lo, q_hi, k_lo, k_hi)``: what the traced mask decides about one whole
    tile -- ``(may_true, may_false)``, two scalar bools -- by the interval rules of :func:`tile_bounds`, one
    scalar int64 interval or bool pair per node. The device classification (``mask_tiles_kernel``) calls it
    before evaluating a tile's cells and skips the cells of a tile it decides (an empty tile above a causal
    diagonal is most of them), with no tensor work on the host. A wrapping node keeps its traced range, as
    in :func:`tile_bounds`; a captured table's entry is unknown here, and so is everything computed from it
    (any value; a comparison may go either way), so the source does not depend on the table's dtype --
    slightly looser than :func:`tile_bounds`, which bounds an entry by its dtype's range."""
    g = traced.graph
    body = ["    b = b.to(tl.int64)", "    h = h.to(tl.int64)", "    q_lo = q_lo.to(tl.int64)",
            "    q_hi = q_hi.to(tl.int64)", "    k_lo = k_lo.to(tl.int64)", "    k_hi = k_hi.to(tl.int64)"]
    pos = {"b": ("b", "b"), "h": ("h", "h"), "q": ("q_lo", "q_hi"), "kv": ("k_lo", "k_hi")}
    vals: dict = {}
    for i in _reachable(g, traced.out):
        n = g.nodes[i]
        x, y = f"lo{i}", f"hi{i}"  # (lo, hi) of an integer node, (may_true, may_false) of a bool node
        whole = (_lit(n.lo), _lit(n.hi))
        emit = None
        if n.op == "arg":
            vals[i] = pos[n.args[0]]
            continue
        if n.op == "const":
            v = n.args[0]
            vals[i] = (str(bool(v)), str(not v)) if n.kind == "bool" else (_lit(v), _lit(v))
            continue
        if n.op == "wrap":
            vals[i] = ("True", "True") if n.kind == "bool" else whole
            continue
        if n.op == "load":  # a table entry may be anything: an unknown (None) int, a bool that may be either
            vals[i] = ("True", "True") if n.kind == "bool" else None
            continue
        if any(vals[k] is None for k in _kids(n)):  # computed from an unknown int: unknown too
            vals[i] = ("True", "True") if n.kind == "bool" else None
            continue
        if n.op in ("not", "retype"):
            t, f = vals[n.args[0]]
            vals[i] = (f, t) if n.op == "not" else (t, f)
            continue
        if n.op == "bool2int":
            t, f = vals[n.args[0]]
            emit = (f"tl.where({f}, 0, 1).to(tl.int64)", f"tl.where({t}, 1, 0).to(tl.int64)")
        elif n.op == "inv":
            lo, hi = vals[n.args[0]]
            emit = _within_src(f"-{hi} - 1", f"-{lo} - 1", n)
        elif n.op == "where":
            (ct, cf), (alo, ahi), (blo, bhi) = (vals[a] for a in n.args)
            if n.kind == "bool":
                emit = (f"({ct} & {alo}) | ({cf} & {blo})", f"({ct} & {ahi}) | ({cf} & {bhi})")
            else:
                emit = (f"tl.where({cf} == 0, {alo}, tl.where({ct} == 0, {blo}, tl.minimum({alo}, {blo})))",
                        f"tl.where({cf} == 0, {ahi}, tl.where({ct} == 0, {bhi}, tl.maximum({ahi}, {bhi})))")
        else:
            op, a, b = n.args
            (alo, ahi), (blo, bhi) = vals[a], vals[b]
            nb = g.nodes[b]
            if n.kind == "bool" and g.nodes[a].kind == "bool":
                at, af, bt, bf = alo, ahi, blo, bhi
                emit = {"and": (f"{at} & {bt}", f"{af} | {bf}"), "or": (f"{at} | {bt}", f"{af} & {bf}")}.get(
                    op, (f"({at} & {bf}) | ({af} & {bt})", f"({at} & {bt}) | ({af} & {bf})"))
            elif op in ("lt", "le", "gt", "ge"):
                emit = {"lt": (f"{alo} < {bhi}", f"{ahi} >= {blo}"), "le": (f"{alo} <= {bhi}", f"{ahi} > {blo}"),
                        "gt": (f"{ahi} > {blo}", f"{alo} <= {bhi}"), "ge": (f"{ahi} >= {blo}", f"{alo} < {bhi}")}[op]
            elif op in ("eq", "ne"):
                meet = f"({alo} <= {bhi}) & ({blo} <= {ahi})"
                apart = f"({alo} != {ahi}) | ({blo} != {bhi}) | ({alo} != {blo})"
                emit = (meet, apart) if op == "eq" else (apart, meet)
            elif (n.lo, n.hi) == I64:
                vals[i] = whole
                continue
            elif op in ("add", "sub"):
                emit = _within_src(f"{alo} + {blo}", f"{ahi} + {bhi}", n) if op == "add" else \
                    _within_src(f"{alo} - {bhi}", f"{ahi} - {blo}", n)
            elif op == "mul":
                ends = list(dict.fromkeys(f"{u} * {v}" for u in (alo, ahi) for v in (blo, bhi)))
                emit = _within_src(_fold("minimum", ends), _fold("maximum", ends), n)
            elif op in ("min", "max"):
                emit = _within_src(f"tl.{op}imum({alo}, {blo})", f"tl.{op}imum({ahi}, {bhi})", n)
            elif op == "floordiv" and nb.lo > 0:
                ends = list(dict.fromkeys(f"_floordiv({u}, {v})" for u in (alo, ahi) for v in (blo, bhi)))
                emit = _within_src(_fold("minimum", ends), _fold("maximum", ends), n)
            elif op == "mod" and nb.op == "const" and nb.lo > 0:
                c = nb.lo
                body += [f"    klo{i} = _floordiv({alo}, {c})", f"    khi{i} = _floordiv({ahi}, {c})"]
                emit = _within_src(f"tl.where(klo{i} == khi{i}, {alo} - klo{i} * {c}, 0)",
                                   f"tl.where(klo{i} == khi{i}, {ahi} - khi{i} * {c}, {c - 1})", n)
            else:  # bit operations, shifts, truncating division, other divisors: the traced range
                vals[i] = whole
                continue
        body += [f"    {x} = {emit[0]}", f"    {y} = {emit[1]}"]
        vals[i] = (x, y)
    # a constant answer (a table of bools, say) is still returned as two scalar tensors the kernel can cast
    t, f = (f"tl.full([], {v}, tl.int1)" if v in ("True", "False") else v for v in vals[traced.out])
    body.append(f"    return {t}, {f}")
    return ["", "@triton.jit", "def bounds(b, h, q_lo, q_hi, k_lo, k_hi):"] + body


def _within_src(lo: str, hi: str, n: Node) -> tuple:
    """:func:`_within` as source: the tile interval clamped into the node's traced range."""
    return f"tl.maximum({lo}, {_lit(n.lo)})", f"tl.minimum({hi}, {_lit(n.hi)})"


def _fold(fn: str, xs: list) -> str:
    out = xs[0]
    for x in xs[1:]:
        out = f"tl.{fn}({out}, {x})"
    return out


def _widths(g: Graph, order: list) -> dict:
    """Which integer nodes are computed in int64: those whose interval leaves int32, int64 loads, and any
    arithmetic with an int64 operand (Triton would promote it anyway; saying so keeps literals typed)."""
    wide = {}
    for i in order:
        n = g.nodes[i]
        if n.kind != "int":
            wide[i] = False
        elif n.op == "load":
            wide[i] = n.args[1] == "int64"
        elif n.op in ("bin", "inv", "where", "retype"):
            wide[i] = n.wide or any(wide[k] for k in _kids(n) if g.nodes[k].kind == "int")
            if n.op == "bin" and n.args[0] in ("shl", "shr") and g.nodes[n.args[2]].hi >= 32:
                wide[i] = True  # a 32-bit shift by 32 or more is undefined
        else:  # arg, const, bool2int, wrap (int32 or narrower)
            wide[i] = n.wide
    return wide


_HELPERS = {
    # torch's floor semantics whatever Triton's // and % round to (both of them the same way)
    "floordiv": ["", "@triton.jit", "def _floordiv(a, b):", "    r = a % b",
                 "    return tl.where((r != 0) & ((r < 0) != (b < 0)), a // b - 1, a // b)"],
    "mod": ["", "@triton.jit", "def _mod(a, b):", "    r = a % b",
            "    return tl.where((r != 0) & ((r < 0) != (b < 0)), r + b, r)"],
    "truncdiv": ["", "@triton.jit", "def _truncdiv(a, b):", "    r = a % b",
                 "    q = a // b",
                 "    return tl.where((r != 0) & ((r < 0) != (a < 0)), q + 1, q)"],
}


def _load_src(g: Graph, slot: int, idx: list, val, body: list, name: str) -> str:
    """Emit the clamped index of a load into ``body``; return the load expression."""
    parts = []
    for d, i in enumerate(idx):
        n = g.nodes[i]
        size = f"{name}_n{d}"
        body.append(f"    {size} = tl.load(CAP_SHAPE + {2 * slot + d})")
        x = val(i)
        if n.lo < 0:  # torch wraps negative indices once
            x = f"tl.where({x} < 0, {x} + {size}, {x})"
        if n.lo < 0 or n.hi < 0:
            x = f"tl.maximum({x}, 0)"
        body.append(f"    {name}_i{d} = tl.minimum({x}, {size} - 1)")
        parts.append(f"{name}_i{d}")
    off = parts[0] if len(parts) == 1 else f"{parts[0]}.to(tl.int64) * {name}_n1 + {parts[1]}"
    return f"tl.load(CAP{slot} + {off})"


# ---- the cache -------------------------------------------------------------------------------------------------
def cache_dir() -> str:
    """Where generated predicates are written: ``$SPARSEATTN_CACHE_DIR``, else ``~/.cache/sparseattn/maskc``,
    else a per-user temporary directory when home is not writable."""
    env = os.environ.get("SPARSEATTN_CACHE_DIR")
    for base in ([env] if env else []) + [os.path.join(os.path.expanduser("~"), ".cache", "sparseattn", "maskc"),
                                          os.path.join(tempfile.gettempdir(), f"sparseattn-maskc-{os.getuid()}")]:
        try:
            os.makedirs(base, exist_ok=True)
            if os.access(base, os.W_OK):
                return base
        except OSError:
            continue
    raise OSError("no writable directory for generated mask predicates (set SPARSEATTN_CACHE_DIR)")


_MODULES: dict = {}  # source hash -> jit predicate, per process
_LOCK = threading.Lock()
STATS = {"generated": 0, "hits": 0}  # how often a predicate was built vs found (tests read it)


def _load_predicate(source: str):
    key = hashlib.sha256(source.encode()).hexdigest()[:20]
    with _LOCK:
        fn = _MODULES.get(key)
        if fn is not None:
            STATS["hits"] += 1
            return key, fn
        _runtime.select_backend()  # @triton.jit must build an interpreted function when there is no GPU
        path = os.path.join(cache_dir(), f"sa_mask_{key}.py")
        if not os.path.exists(path):
            fd, tmp = tempfile.mkstemp(dir=os.path.dirname(path), suffix=".py.tmp")
            with os.fdopen(fd, "w") as f:
                f.write(source)
            os.replace(tmp, path)  # atomic: a concurrent process sees the whole file or none
        name = f"sparseattn_maskc_{key}"
        spec = importlib.util.spec_from_file_location(name, path)
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
        fn = _MODULES[key] = (module.pred, module.bounds)
        STATS["generated"] += 1
        return key, fn


@dataclass(frozen=True, eq=False)
class CompiledMask:
    """A traced mask_mod and its generated predicate. ``captures`` are the tensors the mask indexes, in slot
    order; :meth:`kernel_args` gives what a kernel passes for them. ``bounds``: the same mask's interval
    bounds over a whole tile (:func:`generate_bounds`), which the layout build's classification kernel
    calls."""
    fn: object  # the @triton.jit predicate
    bounds: object  # the @triton.jit tile bounds
    captures: tuple
    source: str
    key: str
    expression: str
    pos_bound: int

    def summary(self, width: int = 80) -> str:
        e = self.expression
        return e if len(e) <= width else e[:width - 3] + "..."

    def kernel_args(self, device) -> dict:
        """The kernel arguments of the compiled path: ``MASK_FN`` (the predicate), ``CAP0..CAP3`` (the
        captures as contiguous tensors on ``device``, None when unused) and ``CAP_SHAPE`` (int32
        ``[MAX_CAPTURES, 2]``, each capture's sizes, ``[n, 1]`` for a 1-D table)."""
        caps = [c.to(device).contiguous() for c in self.captures]
        shape = torch.tensor([_shape_row(c) for c in caps] + [[1, 1]] * (MAX_CAPTURES - len(caps)),
                             dtype=torch.int32, device=device)
        out = {f"CAP{i}": caps[i] if i < len(caps) else None for i in range(MAX_CAPTURES)}
        return dict(MASK_FN=self.fn, CAP_SHAPE=shape, **out)


def _shape_row(t: torch.Tensor) -> list:
    """A capture's row of ``CAP_SHAPE``: its sizes, ``[n, 1]`` for a 1-D table (each load clamps an index
    into its own dimension)."""
    n = t.shape
    if any(s >= (1 << 31) for s in n):
        raise ValueError(f"a captured tensor of shape {tuple(n)} is too large to index with int32 sizes")
    return [n[0], 1] if t.dim() == 1 else [n[0], n[1]]


def compile_mask(mask_mod, *, pos_bound: int = DEFAULT_POS_BOUND, device=None) -> CompiledMask:
    """Trace and compile ``mask_mod`` (cached by its generated source). Raises :class:`Unsupported`."""
    traced = trace(mask_mod, pos_bound=pos_bound, device=device)
    source = generate(traced)
    key, (fn, bounds) = _load_predicate(source)
    return CompiledMask(fn, bounds, tuple(traced.graph.captures), source, key, traced.text(), pos_bound)


def pos_bound_for(max_position: int) -> int:
    """The position bound a layout whose positions stay below ``max_position`` compiles with."""
    return DEFAULT_POS_BOUND if max_position <= DEFAULT_POS_BOUND else 1 << 31


def compile_or_none(mask_mod, *, pos_bound: int = DEFAULT_POS_BOUND, device=None) -> Optional[CompiledMask]:
    """:func:`compile_mask`, or None with one warning line naming the unsupported operation (the caller then
    takes its exact fallback, per-tile bits)."""
    try:
        return compile_mask(mask_mod, pos_bound=pos_bound, device=device)
    except Unsupported as e:
        name = getattr(mask_mod, "__name__", type(mask_mod).__name__)
        warnings.warn(f"sparseattn: mask_mod {name!r} is not compiled ({e}); partial tiles use per-tile bits",
                      MaskCompileWarning, stacklevel=3)
        return None


class MaskCompileWarning(UserWarning):
    """A mask_mod fell back from the compiled predicate to per-tile bits."""


_PER_MASK: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()  # mask_mod -> {(bound, device): result}


def compiled_for(mask_mod, *, pos_bound: int = DEFAULT_POS_BOUND, device=None, warn: bool = True):
    """:func:`compile_or_none` remembered per mask_mod object (weakly), so a layout build and the kernels of
    the same mask trace it once and a mask that does not compile warns once."""
    key = (pos_bound, str(torch.device("cpu") if device is None else torch.device(device)))
    try:
        memo = _PER_MASK.setdefault(mask_mod, {})
    except TypeError:  # not weakly referenceable (a bound method, say): no memo
        memo = {}
    if key not in memo:
        if warn:
            memo[key] = compile_or_none(mask_mod, pos_bound=pos_bound, device=device)
        else:
            try:
                memo[key] = compile_mask(mask_mod, pos_bound=pos_bound, device=device)
            except Unsupported:
                return None
    return memo[key]
