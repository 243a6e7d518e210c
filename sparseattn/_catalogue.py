"""The bad-input catalogue: every public function, every kind of bad argument, the exact exception.

Each :class:`BadInput` says which function is called, which argument is bad and how, which exception type
must come out and a pattern its message must match (it names the argument and the rule). The test suite runs
every row and asserts it (``tests/test_catalogue.py``); chapter 11 runs the same rows and prints the messages
they produce, so the table in the book is the behaviour of the code, never a copy of it.

Calls are built lazily (small CPU tensors, a few pages of cache) and raise before any kernel runs. The device
rows pretend that a GPU runs the kernels (:func:`gpu_present`) to show what a CPU tensor then gets.
"""
from __future__ import annotations

import contextlib
import re
from dataclasses import dataclass
from typing import Callable, List, Optional, Tuple

import torch

from . import _runtime
from . import patterns as P
from .layout import BlockLayout
from .ops import BwdConfig, DecodeConfig, FwdConfig, sparse_attention, sparse_decode
from .paged import PagedKVCache, PageSelection
from .reference import decode_reference, merge_states, reference_attention, select_pages_reference
from .ops import routed_attention
from .routing import page_bounds, route, select_pages, selection_recall

__all__ = ["BadInput", "Outcome", "catalogue", "run", "check", "gpu_present"]


@dataclass(frozen=True)
class BadInput:
    """One row: ``function(...)`` with ``argument`` bad in the way ``kind`` says raises ``exception`` with a
    message matching ``match`` (a regular expression)."""
    function: str
    argument: str
    kind: str
    exception: type
    match: str
    call: Callable[[], object]


@dataclass(frozen=True)
class Outcome:
    raised: Optional[type]  # None: nothing was raised
    message: str


@contextlib.contextmanager
def _backend(name: str):
    """Run as if the kernels ran on ``name`` ("cuda" or "interpreter"), then restore the real choice."""
    before = _runtime._BACKEND
    _runtime._BACKEND = name
    try:
        yield
    finally:
        _runtime._BACKEND = before


def gpu_present():
    """Run as if a GPU ran the kernels (the backend choice says "cuda"), then restore the real choice."""
    return _backend("cuda")


def run(entry: BadInput) -> Outcome:
    """Call ``entry`` and report what it raised. The rows' inputs are small CPU tensors, so the call runs as
    on a CPU-only machine (the interpreter backend) even where a GPU is present -- otherwise, live on a GPU,
    every row would stop at the device check before reaching the argument it spoils; the rows about the
    device switch to "cuda" themselves (:func:`gpu_present`)."""
    try:
        with _backend("interpreter"):
            entry.call()
    except Exception as e:  # noqa: BLE001 (the point is to see which)
        return Outcome(type(e), str(e))
    return Outcome(None, "")


def check(entry: BadInput) -> Outcome:
    """Run ``entry``; raise AssertionError unless it raised exactly ``entry.exception`` with a matching message."""
    out = run(entry)
    where = f"{entry.function}({entry.argument}: {entry.kind})"
    if out.raised is not entry.exception:
        got = "nothing" if out.raised is None else f"{out.raised.__name__}: {out.message}"
        raise AssertionError(f"{where} should raise {entry.exception.__name__}, raised {got}")
    if not re.search(entry.match, out.message):
        raise AssertionError(f"{where}: message {out.message!r} does not match {entry.match!r}")
    return out


# ---------------------------------------------------------------------------------------------------------
# small valid inputs the rows spoil one argument of
# ---------------------------------------------------------------------------------------------------------
def _qkv(B=1, Hq=2, Hkv=1, L=32, D=16, dtype=torch.float32):
    return (torch.randn(B, Hq, L, D, dtype=dtype), torch.randn(B, Hkv, L, D, dtype=dtype),
            torch.randn(B, Hkv, L, D, dtype=dtype))


def _layout(L=32, B=1, H=1) -> BlockLayout:
    return BlockLayout.from_mask_mod(P.causal(), L, L, 16, 16, B=B, H=H, device="cpu")


def _cache(dtype=torch.float32) -> PagedKVCache:
    c = PagedKVCache(8, 16, 1, 16, dtype=dtype, device="cpu", max_seqs=2, max_pages_per_seq=4)
    c.append(0, torch.randn(40, 1, 16, dtype=dtype), torch.randn(40, 1, 16, dtype=dtype))
    return c


def _dq(dtype=torch.float32):
    return torch.randn(1, 2, 16, dtype=dtype)


def _lists(mutate):
    """The explicit lists of a valid layout, one of them spoiled by ``mutate(dict)``, passed to BlockLayout."""
    ok = _layout(48)
    f = dict(kv_count=ok.kv_count.clone(), kv_index=ok.kv_index.clone(), full_count=ok.full_count.clone(),
             full_index=ok.full_index.clone(), mask_mod=ok.mask_mod)
    mutate(f)
    return BlockLayout(f["kv_count"], f["kv_index"], f["full_count"], f["full_index"], q_len=48, kv_len=48,
                       block_q=16, block_k=16, mask_mod=f["mask_mod"])


def _set(field, fn):
    def mutate(f):
        f[field] = fn(f[field])
    return mutate


def _at(t, idx, value):
    t = t.clone()
    t[idx] = value
    return t


def _sel(index, count, **kw):
    return PageSelection(torch.tensor(index, dtype=torch.int32), torch.tensor(count, dtype=torch.int32), **kw)


def _flex_block_mask(block):
    from torch.nn.attention.flex_attention import create_block_mask
    return create_block_mask(P.causal(), None, None, 48, 48, device="cpu", BLOCK_SIZE=block)


def _bwd(**kw) -> BwdConfig:
    return BwdConfig(**{**dict(block_m=16, block_n=16, dq_block_m=16, dq_block_n=16, num_warps=4, num_stages=1), **kw})


def _non_contiguous_out():
    return torch.empty(1, 2, 16, 32)[..., ::2]


# ---------------------------------------------------------------------------------------------------------
# the catalogue
# ---------------------------------------------------------------------------------------------------------
def catalogue() -> List[BadInput]:
    """Every row, grouped by function."""
    E: List[BadInput] = []

    def row(function, argument, kind, exception, match, call):
        E.append(BadInput(function, argument, kind, exception, match, call))

    def attn(**kw):
        q, k, v = kw.pop("qkv", None) or _qkv()
        layout = kw.pop("layout", None) or _layout()
        return lambda: sparse_attention(q, k, v, layout, **kw)

    # ---- sparse_attention ------------------------------------------------------------------------------
    sa = "sparse_attention"
    row(sa, "q", "not a tensor", TypeError, r"q must be a torch\.Tensor",
        lambda: sparse_attention([[0.0]], *_qkv()[1:], _layout()))
    row(sa, "q", "integer dtype", TypeError, r"q must be a floating-point tensor",
        attn(qkv=(torch.ones(1, 2, 32, 16, dtype=torch.long), *_qkv()[1:])))
    row(sa, "q", "float64", TypeError, r"q must be float16, bfloat16 or float32", attn(qkv=_qkv(dtype=torch.float64)))
    row(sa, "q", "3 dimensions", ValueError, r"q must have 4 dimensions",
        attn(qkv=(torch.randn(2, 32, 16), *_qkv()[1:])))
    row(sa, "k", "dtype differs from q", TypeError, r"q, k, v must share a dtype",
        attn(qkv=(_qkv()[0], _qkv()[1].half(), _qkv()[2])))
    row(sa, "v", "length differs from k", ValueError, r"v must match k",
        attn(qkv=(*_qkv()[:2], torch.randn(1, 1, 31, 16))))
    row(sa, "k", "batch differs from q", ValueError, r"same batch size",
        attn(qkv=(torch.randn(2, 2, 32, 16), *_qkv()[1:])))
    row(sa, "q", "heads not a multiple of k's", ValueError,
        r"q's query heads \(3\) must be a multiple of k's and v's KV heads \(2\)", attn(qkv=_qkv(Hq=3, Hkv=2)))
    row(sa, "q", "head dim 24", ValueError, r"q's head dim must be one of", attn(qkv=_qkv(D=24)))
    row(sa, "q", "on the CPU while a GPU runs the kernels", ValueError, r"q is on the CPU but a GPU is present",
        lambda: _with_gpu(attn()))
    row(sa, "layout", "not a BlockLayout", TypeError, r"layout must be a BlockLayout",
        lambda: sparse_attention(*_qkv(), "causal"))
    row(sa, "layout", "built for other lengths", ValueError, r"layout is for q_len=48",
        attn(layout=_layout(48)))
    row(sa, "layout", "B neither 1 nor the batch", ValueError, r"layout has B=3", attn(layout=_layout(B=3)))
    row(sa, "layout", "H neither 1, Hkv nor Hq", ValueError, r"layout has H=3", attn(layout=_layout(H=3)))
    row(sa, "scale", "zero", ValueError, r"scale must be a positive finite float", attn(scale=0.0))
    row(sa, "scale", "negative", ValueError, r"scale must be a positive finite float", attn(scale=-0.5))
    row(sa, "scale", "NaN", ValueError, r"scale must be a positive finite float", attn(scale=float("nan")))
    row(sa, "scale", "a string", TypeError, r"scale must be a positive finite float or None", attn(scale="0.1"))
    row(sa, "out", "wrong shape", ValueError, r"out must be a torch\.float32 tensor of shape",
        attn(out=torch.empty(1, 2, 32, 8)))
    row(sa, "out", "strided last dim", ValueError, r"out must have a contiguous last dimension",
        attn(qkv=_qkv(L=16), layout=_layout(16), out=_non_contiguous_out()))
    row(sa, "deterministic", "not a bool", TypeError, r"deterministic must be a bool", attn(deterministic="yes"))
    row(sa, "config", "not a FwdConfig", TypeError, r"config must be a FwdConfig",
        attn(config=_bwd()))
    row(sa, "config", "tiles that are not powers of two", ValueError,
        r"config: kernel tiles must be powers of two >= 16 .* got block_m=24",
        attn(config=FwdConfig(block_m=24, block_n=16, num_warps=4, num_stages=1)))
    row(sa, "bwd_config", "tiles larger than the layout's", ValueError,
        r"bwd_config: kernel tiles .* divide the layout's 16x16 tiles, got dq_block_m=32",
        attn(bwd_config=_bwd(dq_block_m=32)))
    row(sa, "bwd_config", "chunk zero", ValueError, r"bwd_config: chunk must be None or an int >= 1",
        attn(bwd_config=_bwd(chunk=0)))
    row(sa, "bwd_config", "not a BwdConfig", TypeError, r"bwd_config must be a BwdConfig",
        attn(bwd_config=FwdConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)))

    # ---- sparse_decode ---------------------------------------------------------------------------------
    sd = "sparse_decode"
    row(sd, "cache", "not a PagedKVCache", TypeError, r"cache must be a PagedKVCache",
        lambda: sparse_decode(_dq(), None))
    row(sd, "q", "4 dimensions", ValueError, r"q must be a \[B, Hq, D\] tensor",
        lambda: sparse_decode(torch.randn(1, 2, 1, 16), _cache()))
    row(sd, "q", "dtype differs from the cache", TypeError, r"q is torch\.float16 but the cache holds torch\.float32",
        lambda: sparse_decode(_dq(torch.float16), _cache()))
    row(sd, "q", "head dim differs from the cache", ValueError, r"q's head dim \(32\) must equal the cache's \(16\)",
        lambda: sparse_decode(torch.randn(1, 2, 32), _cache()))
    row(sd, "q", "requires grad", ValueError, r"q\.requires_grad is True",
        lambda: sparse_decode(_dq().requires_grad_(), _cache()))
    row(sd, "q", "on the CPU while a GPU runs the kernels", ValueError, r"q \(and the cache\) is on the CPU",
        lambda: _with_gpu(lambda: sparse_decode(_dq(), _cache())))
    row(sd, "scale", "negative", ValueError, r"scale must be a positive finite float",
        lambda: sparse_decode(_dq(), _cache(), scale=-1.0))
    row(sd, "scale", "a string", TypeError, r"scale must be a positive finite float or None",
        lambda: sparse_decode(_dq(), _cache(), scale="1"))
    row(sd, "pages", "not a PageSelection", TypeError, r"pages must be a PageSelection",
        lambda: sparse_decode(_dq(), _cache(), pages=[0, 1]))
    row(sd, "pages", "rows for another batch", ValueError, r"pages must be \[B=1, Hkv=1, P\]",
        lambda: sparse_decode(_dq(), _cache(), pages=_sel([[[0]], [[0]]], [[1], [1]])))
    row(sd, "seqs", "out of range", ValueError, r"seqs must be in \[0, max_seqs=2\)",
        lambda: sparse_decode(_dq(), _cache(), seqs=[5]))
    row(sd, "seqs", "floating point", TypeError, r"seqs must hold integers",
        lambda: sparse_decode(_dq(), _cache(), seqs=torch.tensor([0.0])))
    row(sd, "seqs", "wrong length", ValueError, r"seqs must have shape \[1\]",
        lambda: sparse_decode(_dq(), _cache(), seqs=[0, 1]))
    row(sd, "config", "not a DecodeConfig", TypeError, r"config must be a DecodeConfig",
        lambda: sparse_decode(_dq(), _cache(), config=FwdConfig(block_m=16, block_n=16, num_warps=4,
                                                                num_stages=1)))
    row(sd, "config", "block_n not a power of two", ValueError, r"config: block_n must be a power of two >= 16",
        lambda: sparse_decode(_dq(), _cache(), config=DecodeConfig(block_n=48)))
    row(sd, "config", "programs_per_sm zero", ValueError, r"config: programs_per_sm must be None or an int >= 1",
        lambda: sparse_decode(_dq(), _cache(), config=DecodeConfig(programs_per_sm=0)))

    # ---- select_pages, page_bounds and their references --------------------------------------------------
    sp = "select_pages"
    row(sp, "topk", "zero", ValueError, r"topk must be >= 1", lambda: select_pages(_dq(), _cache(), 0))
    row(sp, "topk", "a float", TypeError, r"topk must be an int", lambda: select_pages(_dq(), _cache(), 2.0))
    row(sp, "always_first", "negative", ValueError, r"always_first must be >= 0",
        lambda: select_pages(_dq(), _cache(), 2, always_first=-1))
    row(sp, "always_last", "a bool", TypeError, r"always_last must be an int",
        lambda: select_pages(_dq(), _cache(), 2, always_last=True))
    row(sp, "q", "heads not a multiple of the cache's", ValueError, r"query heads \(3\) must be a multiple",
        lambda: select_pages(torch.randn(1, 3, 16), _cache_heads(2), 2))
    row(sp, "q", "on the CPU while a GPU runs the kernels", ValueError, r"q \(and the cache\) is on the CPU",
        lambda: _with_gpu(lambda: select_pages(_dq(), _cache(), 2)))
    row("page_bounds", "cache", "not a PagedKVCache", TypeError, r"cache must be a PagedKVCache",
        lambda: page_bounds(_dq(), {"pages": 1}))
    row("page_bounds", "q", "on the CPU while a GPU runs the kernels", ValueError, r"q \(and the cache\) is on the CPU",
        lambda: _with_gpu(lambda: page_bounds(_dq(), _cache())))
    row("select_pages_reference", "topk", "negative", ValueError, r"topk must be >= 1",
        lambda: select_pages_reference(_dq(), _cache(), -3))
    row("decode_reference", "seqs", "out of range", ValueError, r"seqs must be in",
        lambda: decode_reference(_dq(), _cache(), [7]))

    # ---- route, routed_attention, selection_recall ---------------------------------------------------------
    rt = "route"
    q2, k2 = _qkv()[:2]
    row(rt, "topk", "neither topk nor threshold", ValueError, r"give topk .*, threshold .*, or both",
        lambda: route(q2, k2, 16, 16))
    row(rt, "topk", "a float", TypeError, r"topk must be an int", lambda: route(q2, k2, 16, 16, topk=2.0))
    row(rt, "threshold", "above 1", ValueError, r"threshold must be in \(0, 1\]",
        lambda: route(q2, k2, 16, 16, threshold=1.5))
    row(rt, "block_k", "not a power of two", ValueError, r"block_k must be a power of two >= 16, got 24",
        lambda: route(q2, k2, 16, 24, topk=1))
    row(rt, "share", "unknown", ValueError, r"share must be one of", lambda: route(q2, k2, 16, 16, topk=1,
                                                                                  share="group"))
    row(rt, "member_topk", "missing for member semantics", ValueError, r"semantics='member' needs member_topk",
        lambda: route(q2, k2, 16, 16, topk=1, semantics="member"))
    row(rt, "capacity", "below the forced blocks", ValueError, r"capacity \(1\) must hold the forced blocks",
        lambda: route(q2, k2, 16, 16, topk=1, sinks=1, local=1, capacity=1))
    row(rt, "q", "on the CPU while a GPU runs the kernels", ValueError, r"q \(and k\) is on the CPU",
        lambda: _with_gpu(lambda: route(q2, k2, 16, 16, topk=1)))
    row("routed_attention", "layout", "not a BlockLayout", TypeError, r"layout must be a BlockLayout or None",
        lambda: routed_attention(*_qkv(), layout="causal"))
    row("routed_attention", "topk", "neither topk nor threshold", ValueError, r"give topk",
        lambda: routed_attention(*_qkv(), 16, 16))
    row("selection_recall", "layout", "not a BlockLayout", TypeError, r"layout must be a BlockLayout",
        lambda: selection_recall(q2, k2, "causal"))
    row("selection_recall", "layout", "built for other lengths", ValueError, r"layout .* does not fit q",
        lambda: selection_recall(q2, k2, _layout(48)))
    row("selection_recall", "sample", "zero", ValueError, r"sample must be >= 1",
        lambda: selection_recall(q2, k2, _layout(), sample=0))

    # ---- reference_attention and merge_states ---------------------------------------------------------------
    ra = "reference_attention"
    row(ra, "mask", "not bool", TypeError, r"mask must be a bool tensor",
        lambda: reference_attention(*_qkv(), mask=torch.ones(1, 1, 32, 32)))
    row(ra, "mask", "wrong shape", ValueError, r"mask must have shape \[1\|1, 1\|1\|2, 32, 32\]",
        lambda: reference_attention(*_qkv(), mask=torch.ones(1, 1, 32, 31, dtype=torch.bool)))
    row(ra, "scale", "NaN", ValueError, r"scale must be a finite float",
        lambda: reference_attention(*_qkv(), scale=float("nan")))
    row(ra, "dtype", "not a floating dtype", TypeError, r"dtype must be a floating torch\.dtype",
        lambda: reference_attention(*_qkv(), dtype=torch.int32))
    row(ra, "q", "heads not a multiple of k's", ValueError, r"must be a multiple of k's and v's KV heads",
        lambda: reference_attention(*_qkv(Hq=3, Hkv=2)))
    ms = "merge_states"
    o, lse = torch.randn(2, 4), torch.zeros(2)
    row(ms, "o_a", "not a tensor", TypeError, r"o_a must be a torch\.Tensor", lambda: merge_states(1.0, lse, o, lse))
    row(ms, "lse_b", "integer dtype", TypeError, r"lse_b must be floating point",
        lambda: merge_states(o, lse, o, torch.zeros(2, dtype=torch.long)))
    row(ms, "o_b", "shape differs from o_a", ValueError, r"o_a and o_b must have the same shape",
        lambda: merge_states(o, lse, torch.randn(2, 5), lse))
    row(ms, "lse_a", "shape is not o's without its last dim", ValueError, r"lse_a and lse_b must have shape \(2,\)",
        lambda: merge_states(o, torch.zeros(4), o, torch.zeros(4)))
    row(ms, "lse_a", "+inf", ValueError, r"lse_a holds \+inf",
        lambda: merge_states(o, torch.tensor([0.0, float("inf")]), o, lse))

    # ---- BlockLayout constructors ------------------------------------------------------------------------
    fm = "BlockLayout.from_mask_mod"
    row(fm, "mask_mod", "not callable", TypeError, r"mask_mod must be callable",
        lambda: BlockLayout.from_mask_mod("causal", 32, 32, device="cpu"))
    row(fm, "q_len", "zero", ValueError, r"q_len must be >= 1",
        lambda: BlockLayout.from_mask_mod(P.causal(), 0, 32, device="cpu"))
    row(fm, "kv_len", "a float", TypeError, r"kv_len must be an int",
        lambda: BlockLayout.from_mask_mod(P.causal(), 32, 32.0, device="cpu"))
    row(fm, "block_q", "not a power of two", ValueError, r"block_q must be a power of two >= 16, got 24",
        lambda: BlockLayout.from_mask_mod(P.causal(), 32, 32, 24, 16, device="cpu"))
    row(fm, "block_k", "below 16", ValueError, r"block_k must be a power of two >= 16, got 8",
        lambda: BlockLayout.from_mask_mod(P.causal(), 32, 32, 16, 8, device="cpu"))
    row(fm, "H", "zero", ValueError, r"H must be >= 1",
        lambda: BlockLayout.from_mask_mod(P.causal(), 32, 32, H=0, device="cpu"))
    row(fm, "q_offset", "negative", ValueError, r"q_offset must be >= 0",
        lambda: BlockLayout.from_mask_mod(P.causal(), 32, 32, q_offset=-1, device="cpu"))
    row(fm, "mask_mod", "returns integers", TypeError, r"must return a bool tensor, got torch\.int64",
        lambda: BlockLayout.from_mask_mod(lambda b, h, q, k: q - k, 32, 32, 16, 16, device="cpu"))
    row(fm, "mask_mod", "fails on tiles and under vmap", ValueError,
        r"fails on broadcasting index tensors .* and under torch\.vmap",
        lambda: BlockLayout.from_mask_mod(_raises, 32, 32, 16, 16, device="cpu"))
    row(fm, "doc_ids", "document ids shorter than the layout", ValueError, r"doc_ids covers 20 positions",
        lambda: BlockLayout.from_mask_mod(P.document(torch.zeros(20, dtype=torch.long)), 32, 32, 16, 16,
                                          device="cpu"))
    fb = "BlockLayout.from_block_mask"
    row(fb, "block_mask", "not bool", TypeError, r"block_mask must be a bool tensor",
        lambda: BlockLayout.from_block_mask(torch.ones(1, 1, 2, 2), 32, 32, 16, 16))
    row(fb, "block_mask", "wrong tile grid", ValueError, r"block_mask must have shape \[B, H, 2, 2\]",
        lambda: BlockLayout.from_block_mask(torch.ones(1, 1, 2, 3, dtype=torch.bool), 32, 32, 16, 16))
    row(fb, "mask_mod", "not callable", TypeError, r"mask_mod must be callable",
        lambda: BlockLayout.from_block_mask(torch.ones(1, 1, 2, 2, dtype=torch.bool), 32, 32, 16, 16, mask_mod=3))
    fd = "BlockLayout.from_dense"
    row(fd, "mask", "not bool", TypeError, r"mask must be a bool tensor",
        lambda: BlockLayout.from_dense(torch.ones(1, 1, 32, 32), 16, 16))
    row(fd, "mask", "3 dimensions", ValueError, r"mask must have shape \[B, H, Lq, Lk\]",
        lambda: BlockLayout.from_dense(torch.ones(1, 32, 32, dtype=torch.bool), 16, 16))
    row(fd, "mask", "no keys", ValueError, r"Lk \(mask\.shape\[3\]\) must be >= 1",
        lambda: BlockLayout.from_dense(torch.ones(1, 1, 32, 0, dtype=torch.bool), 16, 16))
    ff = "BlockLayout.from_flex"
    row(ff, "block_mask", "not a BlockMask", TypeError, r"block_mask must be a FlexAttention BlockMask",
        lambda: BlockLayout.from_flex(torch.ones(1, 1, 2, 2, dtype=torch.bool)))
    row(ff, "block_mask", "BLOCK_SIZE not a power of two", ValueError,
        r"block_mask\.BLOCK_SIZE must be powers of two >= 16 .* got \(24, 24\)",
        lambda: BlockLayout.from_flex(_flex_block_mask(24)))
    bl = "BlockLayout (explicit lists)"
    row(bl, "kv_index", "int64", TypeError, r"kv_index must be int32",
        lambda: _lists(_set("kv_index", torch.Tensor.long)))
    row(bl, "full_index", "a duplicate tile", ValueError, r"full_index: row \[0, 0, 2\] is not strictly ascending",
        lambda: _lists(_set("full_index", lambda t: _at(t, (0, 0, 2, 1), 0))))
    row(bl, "kv_index", "a tile out of range", ValueError, r"kv_index\[0, 0, 0, 0\] = 3 is out of range \[0, nk=3\)",
        lambda: _lists(_set("kv_index", lambda t: _at(t, (0, 0, 0, 0), 3))))
    row(bl, "kv_count", "above the width", ValueError, r"kv_count\[0, 0, 0\] = 9 is outside \[0, width 1\]",
        lambda: _lists(_set("kv_count", lambda t: _at(t, (0, 0, 0), 9))))
    row(bl, "mask_mod", "partial tiles without mask_mod or bits", ValueError, r"neither mask_mod nor tile_bits",
        lambda: _lists(_set("mask_mod", lambda m: None)))
    row(bl, "full_index", "a tile listed partial and full", ValueError, r"listed both as partial \(kv_index\) and full",
        lambda: _lists(_overlap))
    row("BlockLayout.to_flex", "num_heads", "not a multiple of H", ValueError, r"num_heads=3 is not a multiple",
        lambda: _layout(H=2).to_flex(num_heads=3))

    # ---- the paged cache and page selections -------------------------------------------------------------
    pc = "PagedKVCache"
    row(pc, "page_size", "not a power of two", ValueError, r"page_size must be a power of two",
        lambda: PagedKVCache(4, 12, 1, 16, dtype=torch.float32, device="cpu"))
    row(pc, "num_pages", "zero", ValueError, r"num_pages must be >= 1",
        lambda: PagedKVCache(0, 16, 1, 16, dtype=torch.float32, device="cpu"))
    row(pc, "dtype", "an integer dtype", TypeError, r"dtype must be a floating torch\.dtype",
        lambda: PagedKVCache(4, 16, 1, 16, dtype=torch.int8, device="cpu"))
    ap = "PagedKVCache.append"
    row(ap, "k", "wrong shape", ValueError, r"k must have shape \[L, 1, 16\]",
        lambda: _cache().append(1, torch.randn(4, 2, 16), torch.randn(4, 2, 16)))
    row(ap, "v", "length differs from k", ValueError, r"k and v must have the same length",
        lambda: _cache().append(1, torch.randn(4, 1, 16), torch.randn(5, 1, 16)))
    row(ap, "seq", "out of range", ValueError, r"seq must be in \[0, max_seqs=2\)",
        lambda: _cache().append(2, torch.randn(4, 1, 16), torch.randn(4, 1, 16)))
    row(ap, "k", "more tokens than a sequence's pages hold", ValueError,
        r"k, v: appending 40 tokens to sequence 0 would need 5 pages, more than max_pages",
        lambda: _cache().append(0, torch.randn(40, 1, 16), torch.randn(40, 1, 16)))
    row(ap, "k", "more tokens than the pool holds", ValueError, r"KV pool is full",
        lambda: _full_pool().append(1, torch.randn(64, 1, 16), torch.randn(64, 1, 16)))
    row("PagedKVCache.fork", "dst", "the source itself", ValueError, r"fork needs two different sequences",
        lambda: _cache().fork(0, 0))
    row("PagedKVCache.fork", "dst", "not empty", ValueError, r"sequence 0 is not empty",
        lambda: _cache().fork(1, 0))
    ps = "PageSelection"
    row(ps, "index", "int64", TypeError, r"PageSelection\.index must be int32",
        lambda: PageSelection(torch.zeros(1, 1, 2, dtype=torch.long), torch.ones(1, 1, dtype=torch.int32)))
    row(ps, "index", "a duplicate page", ValueError, r"strictly ascending \(duplicate or unsorted page\)",
        lambda: _sel([[[1, 1]]], [[2]]))
    row(ps, "index", "a negative page", ValueError, r"PageSelection\.index has a negative page",
        lambda: _sel([[[-1, 1]]], [[2]]))
    row(ps, "count", "above the capacity", ValueError, r"PageSelection\.count must be in \[0, 2\]",
        lambda: _sel([[[0, 1]]], [[3]]))
    row(ps, "index", "a page past the sequence's end", ValueError, r"selects a page past the end of its sequence",
        lambda: _sel([[[0, 3]]], [[2]], cache=_cache()))

    # ---- patterns ---------------------------------------------------------------------------------------------
    pt = "patterns"
    row(pt + ".sliding_window", "window", "zero", ValueError, r"window must be >= 1", lambda: P.sliding_window(0))
    row(pt + ".sliding_window", "window", "a float", TypeError, r"window must be an int",
        lambda: P.sliding_window(2.5))
    row(pt + ".sinks", "num_sinks", "negative", ValueError, r"num_sinks must be >= 0", lambda: P.sinks(-1))
    row(pt + ".dilated", "stride", "zero", ValueError, r"stride must be >= 1", lambda: P.dilated(0))
    row(pt + ".block_random", "density", "above 1", ValueError, r"density must be in \[0, 1\]",
        lambda: P.block_random(1.5))
    row(pt + ".block_random", "density", "a string", TypeError, r"density must be a float",
        lambda: P.block_random("0.1"))
    row(pt + ".document", "doc_ids", "floating point", TypeError, r"doc_ids must be an integer tensor",
        lambda: P.document(torch.zeros(8)))
    row(pt + ".document", "doc_ids", "3 dimensions", ValueError, r"doc_ids must have shape \[L\] or \[B, L\]",
        lambda: P.document(torch.zeros(1, 1, 8, dtype=torch.long)))
    row(pt + ".prefix_lm", "prefix", "negative", ValueError, r"prefix must be >= 0", lambda: P.prefix_lm(-2))
    row(pt + ".sinks_window", "window", "zero", ValueError, r"window must be >= 1", lambda: P.sinks_window(4, 0))
    row(pt + ".and_masks", "masks", "none", ValueError, r"at least one mask_mod is required", lambda: P.and_masks())
    row(pt + ".or_masks", "masks", "not callable", TypeError, r"mask_mod #1 is not callable",
        lambda: P.or_masks(P.causal(), 3))
    return E


# ---------------------------------------------------------------------------------------------------------
# helpers of single rows
# ---------------------------------------------------------------------------------------------------------
def _with_gpu(call):
    with gpu_present():
        return call()


def _raises(b, h, q_idx, kv_idx):
    raise KeyError("this mask_mod looks up a table that does not exist")


def _overlap(f):
    # list tile (1, 0), which is full, as partial too
    f["kv_index"] = _at(f["kv_index"], (0, 0, 1, 0), 0)


def _cache_heads(Hkv: int) -> PagedKVCache:
    c = PagedKVCache(8, 16, Hkv, 16, dtype=torch.float32, device="cpu", max_seqs=2, max_pages_per_seq=4)
    c.append(0, torch.randn(20, Hkv, 16), torch.randn(20, Hkv, 16))
    return c


def _full_pool() -> PagedKVCache:
    c = PagedKVCache(4, 16, 1, 16, dtype=torch.float32, device="cpu", max_seqs=2, max_pages_per_seq=4)
    c.append(0, torch.randn(40, 1, 16), torch.randn(40, 1, 16))  # 3 of the 4 pages
    return c


def table(entries: Optional[List[BadInput]] = None) -> List[Tuple[str, str, str, str, str]]:
    """``(function, argument, bad value, exception, message)`` for every row, the message as the code
    produces it now (the rows are checked first: a row that no longer holds raises AssertionError)."""
    out = []
    for e in entries if entries is not None else catalogue():
        o = check(e)
        out.append((e.function, e.argument, e.kind, e.exception.__name__, o.message))
    return out
