"""What the prefill ops share between argument checks and a kernel launch: the layout checks, the mask
arguments every prefill kernel takes, cached launch plans, the TMA test and the shared-memory fallbacks.
No ``@triton.jit`` code here."""
from __future__ import annotations

import contextlib
import math
from typing import NamedTuple, Optional

import torch

from .. import _runtime, maskc
from .. import _fast_launch
from .._tiles import tma_bases_ok, tma_ok, tma_strides_ok  # noqa: F401 - home: _tiles (routing uses tma_ok)
from ..layout import BlockLayout
from ..predicates import Predicate, kernel_predicate


def check_layout_for(layout: BlockLayout, B: int, Hq: int, Hkv: int, Lq: int, Lk: int, device) -> None:
    if not isinstance(layout, BlockLayout):
        raise TypeError(f"layout must be a BlockLayout, got {type(layout).__name__}")
    if (layout.q_len, layout.kv_len) != (Lq, Lk):
        raise ValueError(f"layout is for q_len={layout.q_len}, kv_len={layout.kv_len} but q/k have Lq={Lq}, Lk={Lk}")
    if layout.B not in (1, B):
        raise ValueError(f"layout has B={layout.B}; it must be 1 or the batch size {B}")
    if layout.H not in (1, Hkv, Hq):
        raise ValueError(f"layout has H={layout.H}; it must be 1, the KV heads ({Hkv}) or the query heads ({Hq})")
    if layout.device != device:
        raise ValueError(f"layout is on {layout.device} but q is on {device}; use layout.to(q.device)")


def check_kernel_tiles(name: str, layout: BlockLayout, **tiles) -> None:
    """A config's kernel tiles (``block_m=...``: query rows, divide ``block_q``; ``block_n=...``: keys, divide
    ``block_k``) must be powers of two >= 16 that divide the layout's tiles: a kernel tile that straddles two
    layout tiles would read the wrong tile's list and mask (silently wrong gradients, not an error)."""
    for field, value in tiles.items():
        limit = layout.block_q if field.endswith("_m") else layout.block_k
        if not isinstance(value, int) or isinstance(value, bool) or value < 16 or value & (value - 1) \
                or limit % value:
            raise ValueError(f"{name}: kernel tiles must be powers of two >= 16 that divide the layout's "
                             f"{layout.block_q}x{layout.block_k} tiles, got {field}={value!r}")


def check_launch_options(name: str, cfg, **optional) -> None:
    """A config's launch options: ``num_warps`` a power of two from 1 to 32, ``num_stages`` an int >= 1, ``tma``
    None or a bool; ``optional`` names more fields of those two kinds (``dq_num_warps=...``) that may also be
    None (None: the pass takes the dK/dV pass's value)."""
    fields = {"num_warps": cfg.num_warps, "num_stages": cfg.num_stages, **optional}
    for field, value in fields.items():
        if value is None and field in optional:
            continue
        is_int = isinstance(value, int) and not isinstance(value, bool)
        if field.endswith("num_warps") and not (is_int and value in (1, 2, 4, 8, 16, 32)):
            raise ValueError(f"{name}: {field} must be a power of two from 1 to 32"
                             f"{' or None' if field in optional else ''}, got {value!r}")
        if field.endswith("num_stages") and not (is_int and value >= 1):
            raise ValueError(f"{name}: {field} must be an int >= 1{' or None' if field in optional else ''}, "
                             f"got {value!r}")
    tma = getattr(cfg, "tma", None)
    if tma is not None and not isinstance(tma, bool):
        raise ValueError(f"{name}: tma must be None (where the GPU has it), True or False, got {tma!r}")


def last_dim_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


#: How many SMs the split planning assumes off the GPU (the interpreter has none). Tests raise it to reach
#: launch shapes a real GPU produces, e.g. more decode splits per row than one merge step holds.
CPU_SM_COUNT = 4


def num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return CPU_SM_COUNT


CPU_L2_BYTES = 50 * 2**20  #: the L2 size assumed off a GPU (the interpreter) or when torch cannot tell: an H200's


def l2_bytes(device: torch.device) -> int:
    """The GPU's L2 cache in bytes (:data:`CPU_L2_BYTES` off a GPU)."""
    if device.type == "cuda":
        return getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 0) or CPU_L2_BYTES
    return CPU_L2_BYTES


# ---- mask path: in-register predicate, compiled mask_mod, or per-tile bits -------------------------------------
class MaskPath(NamedTuple):
    """How the kernels mask a layout's partial tiles: at most one of the three is set (none: no partial
    tiles)."""
    pred: Optional[Predicate]  # hand-written in-register predicate (bands, sinks, documents)
    bits: Optional[torch.Tensor]  # per-tile packed bits
    compiled: Optional[maskc.CompiledMask]  # the mask_mod's generated predicate


MASK_PATHS = ("predicate", "compiled", "bits")
_FORCED: Optional[str] = None


@contextlib.contextmanager
def forced_mask_path(kind: Optional[str]):
    """Within the block, layouts take mask path ``kind`` (``"bits"``: per-tile bits even where a predicate
    exists; ``"compiled"``: the generated predicate even where the hand-written one exists; None: the
    default choice). For A/B measurements in one run; each choice is cached on the layout separately."""
    global _FORCED
    if kind is not None and kind not in ("bits", "compiled"):
        raise ValueError(f"kind must be None, 'bits' or 'compiled', got {kind!r}")
    before, _FORCED = _FORCED, kind
    try:
        yield
    finally:
        _FORCED = before


def forced_kind() -> Optional[str]:
    """The mask path forced by the enclosing :func:`forced_mask_path` block (None: the default choice);
    part of every cached launch plan's key."""
    return _FORCED


def _compiled(layout: BlockLayout) -> Optional[maskc.CompiledMask]:
    if max(layout.B, layout.H) >= maskc.HEAD_BOUND:  # outside the index ranges the predicate is exact for
        return None
    bound = maskc.pos_bound_for(max(layout.q_offset + layout.nq * layout.block_q, layout.nk * layout.block_k))
    return maskc.compiled_for(layout.mask_mod, pos_bound=bound, device=layout.device)


def mask_path(layout: BlockLayout) -> MaskPath:
    """The mask path of ``layout`` (cached on it). Default order: the hand-written predicate where the pattern
    has one (measured fastest); else the compiled mask_mod (:mod:`sparseattn.maskc`) when it traces; else
    per-tile bits, which keep any mask exact (layouts from dense masks or ``tile_bits`` always take them).
    A dynamic layout's path is fixed by construction (its predicate, else its own tile_bits): nothing is
    read from its contents, which may change."""
    forced = _FORCED

    def build():
        has_mask = layout.mask_mod is not None and layout.tile_bits is None
        pred = kernel_predicate(layout.mask_mod) if forced is None and layout.mask_mod is not None else None
        if pred is not None:
            return MaskPath(pred, None, None)
        if layout.dynamic:
            if forced is None:
                return MaskPath(None, layout.tile_bits, None)
            raise ValueError("a dynamic layout's mask path is fixed by construction; it cannot be forced")
        if not bool((layout.kv_count > 0).any()):
            return MaskPath(None, None, None)
        compiled = _compiled(layout) if has_mask and forced != "bits" else None
        if forced == "compiled" and compiled is None:
            raise ValueError("forced_mask_path('compiled'): this layout's mask does not compile "
                             "(no mask_mod, tile_bits, or an operation the tracer cannot follow)")
        if compiled is not None:
            return MaskPath(None, None, compiled)
        return MaskPath(None, layout.partial_tile_bits(), None)
    return layout.plan(("mask_path", forced), build)


def mask_path_name(layout: BlockLayout) -> str:
    """``"predicate: ..."``, ``"compiled: <traced expression>"`` or ``"bits"``: how the kernels mask this
    layout's partial tiles."""
    path = mask_path(layout)
    if path.pred is not None:
        return "predicate: " + path.pred.describe()
    if path.compiled is not None:
        return "compiled: " + path.compiled.summary()
    return "bits" if path.bits is not None else "none (no partial tiles)"


def _doc_table(pred: Optional[Predicate], layout: BlockLayout, B: int) -> Optional[torch.Tensor]:
    if pred is None or pred.doc_ids is None:
        return None

    def build():
        # the kernels compare int32 ids: replace every id by its rank among the distinct ids (equal ids stay
        # equal, different ones stay different), so ids beyond int32 cannot collide in their low 32 bits
        _, ranks = torch.unique(pred.doc_ids.to(layout.device), return_inverse=True)
        ids = ranks.to(torch.int32).view(pred.doc_ids.shape)
        need = max(layout.q_offset + layout.q_len, layout.kv_len)
        if ids.shape[-1] < need:
            raise ValueError(f"doc_ids covers {ids.shape[-1]} positions but attention needs {need}")
        # padded with -1 to whole tiles, so kernels read the ids of a tile's padding rows without a mask
        whole = max(layout.q_offset + layout.nq * layout.block_q, layout.nk * layout.block_k)
        return torch.nn.functional.pad(ids, (0, max(0, whole - ids.shape[-1])), value=-1).contiguous()
    ids = layout.plan("doc_ids", build)
    if ids.dim() == 2 and ids.shape[0] != B:
        raise ValueError(f"doc_ids has batch {ids.shape[0]} but q has batch {B}")
    return ids


def mask_kwargs(layout: BlockLayout, B: int) -> dict:
    """The keyword arguments every prefill kernel takes to mask partial tiles: ``BITS`` (None on the
    predicate path), ``DOC`` (None without documents), the predicate's band/sink scalars, ``ROW_SLOT`` (the
    member bits of a routed layout, else None) and the compiled path's ``MASK_FN``, ``CAP0..CAP3``,
    ``CAP_SHAPE`` (all None elsewhere). The kernels' ``@triton.heuristics`` derive their flags from
    these (``BITS is not None``, ``sink_n > 0``, ...)."""
    pred, bits, compiled = mask_path(layout)
    doc = _doc_table(pred, layout, B)
    band = pred.band if pred is not None else (0, -1)
    sink_n = pred.sink_n if pred is not None and pred.has_sinks else 0
    sink_lo, sink_hi = pred.sink_band if sink_n else (0, -1)
    if compiled is not None:  # the captures on the layout's device, copied once per layout
        fn_args = layout.plan(("mask_fn_args", compiled.key), lambda: compiled.kernel_args(layout.device))
    else:
        fn_args = dict(MASK_FN=None, CAP0=None, CAP1=None, CAP2=None, CAP3=None, CAP_SHAPE=None)
    return dict(BITS=bits, DOC=doc, stride_doc_b=doc.stride(0) if doc is not None and doc.dim() == 2 else 0,
                band_lo=band[0], band_hi=band[1], sink_n=sink_n, sink_lo=sink_lo, sink_hi=sink_hi,
                ROW_SLOT=layout.row_slot, **fn_args)


def head_kwargs(layout: BlockLayout, Hq: int, Hkv: int) -> dict:
    """How a query head finds its KV head (``group``) and its layout head (``lh_div``); layout dims."""
    group = Hq // Hkv
    return dict(group=group, lh_div=1 if layout.H == Hq else group, LB=layout.B, LH=layout.H)


def row_order(layout: BlockLayout, block_m: int) -> torch.Tensor:
    """Kernel query sub-tiles in launch order, longest row first: sorted by their row's tile count (cached
    per layout). A dynamic layout's counts change from call to call, so it gets a shape-only order instead,
    last query tile first -- the longest-first order of a causal selection, whose rows can only hold the
    blocks at or before them (route's rows fill to capacity as soon as they can), and any order is as good as
    another for rows of equal length. No device work per call, and a captured graph keeps it."""
    n_m = math.ceil(layout.q_len / block_m)
    if layout.dynamic:
        return shape_plan(("reverse_order", n_m, layout.device),
                          lambda: torch.arange(n_m - 1, -1, -1, device=layout.device, dtype=torch.int32))

    def build():
        work = (layout.kv_count + layout.full_count).sum(dim=(0, 1))  # [nq]
        per_m = work.repeat_interleave(layout.block_q // block_m)[:n_m]
        return torch.argsort(per_m, descending=True, stable=True).to(torch.int32)
    return layout.plan(("row_order", block_m), build)


#: launch plans of dynamic layouts, keyed by the layout's shape (bounded like the launch cache: every new
#: sequence length is a new key)
_SHAPE_PLANS: dict = {}
_MAX_SHAPE_PLANS = 1024


def shape_plan(key, build):
    """``build()`` once per ``key`` (a plan that depends on shapes only, shared by every layout of them)."""
    plan = _SHAPE_PLANS.get(key)
    if plan is None:
        if len(_SHAPE_PLANS) >= _MAX_SHAPE_PLANS:
            _SHAPE_PLANS.clear()
        plan = _SHAPE_PLANS[key] = build()
    return plan


def layout_tables(layout: BlockLayout) -> dict:
    """The prefill launch arguments that hold a layout's own tables, as callables giving this layout's
    values (``BITS``: the bits its mask path reads -- None on the predicate path, even with tile bits)."""
    return {"KV_COUNT": lambda: layout.kv_count, "KV_INDEX": lambda: layout.kv_index,
            "FULL_COUNT": lambda: layout.full_count, "FULL_INDEX": lambda: layout.full_index,
            "ROW_SLOT": lambda: layout.row_slot, "BITS": lambda: mask_path(layout).bits}


def _table_shape(t: Optional[torch.Tensor]):
    return None if t is None else (t.dtype, tuple(t.shape))


def shape_key(layout: BlockLayout):
    """What a dynamic layout's launch arguments depend on besides its tables: its shape, its tables' shapes,
    its mask path (predicate or tile bits). None when the predicate carries data of its own (document ids)."""
    pred = mask_path(layout).pred
    if pred is not None and pred.doc_ids is not None:
        return None
    return (layout.B, layout.H, layout.q_len, layout.kv_len, layout.q_offset, layout.block_q, layout.block_k,
            layout.width, layout.full_width, layout.device, pred, _table_shape(layout.tile_bits),
            _table_shape(layout.row_slot))


def dynamic_plan(layout: BlockLayout, key, build, tables: dict) -> tuple:
    """``(plan, per_call)`` for a dynamic layout. ``build()`` makes a launch plan: a dict whose :class:`Static`
    values are launch arguments. It is cached by ``key`` and :func:`shape_key` with the arguments named in
    ``tables`` (name -> callable giving this call's value: the layout's own tables, content-derived plans)
    taken out of every Static; ``per_call[name of the Static]`` holds them for this call. :func:`route` makes
    a new layout at every step, so a plan per layout object rebuilt ~60 launch arguments and passed them all
    per call (H200, routed forward at N = 2k: 0.14 ms of host time per call, more than its kernel). A layout
    whose shape key is None gets its plan built per call, every argument passed per call."""
    shape = shape_key(layout)
    if shape is None:
        plan = build()
        return ({k: None if isinstance(v, Static) else v for k, v in plan.items()},
                {k: dict(v) for k, v in plan.items() if isinstance(v, Static)})

    def strip():
        plan = build()
        names = {k: tuple(a for a in v if a in tables) for k, v in plan.items() if isinstance(v, Static)}
        return {k: Static({a: x for a, x in v.items() if a not in tables}) if isinstance(v, Static) else v
                for k, v in plan.items()}, names, set().union(*names.values())
    plan, names, needed = shape_plan((key, shape), strip)
    values = {a: tables[a]() for a in needed}
    return plan, {k: {a: values[a] for a in ns} for k, ns in names.items()}


# ---- launching -----------------------------------------------------------------------------------------------
def tma_allowed(tma: Optional[bool], device, in_interpreter: bool) -> bool:
    """Whether a config's ``tma`` (None: where the GPU has it; True; False) lets a pass load through tensor
    descriptors here: on a GPU of compute capability 9 or more unless ``tma`` is False; in the interpreter
    when ``in_interpreter`` (the pass's default there) or ``tma`` is True. Each call still checks its tensors
    with :func:`tma_ok`."""
    if _runtime.is_interpreter():
        return tma is True or (tma is None and in_interpreter)
    return tma is not False and torch.cuda.get_device_capability(device)[0] >= 9


#: With ``tma=None`` in its config, an eager call loads through tensor descriptors only from this many visited
#: tile pairs (summed over batch x query heads) up; a CUDA-graph capture always does. Descriptors cost host
#: time at every eager call (made, checked, passed to the launch as tensor maps) and save device time in
#: proportion to the work; the host cost shows only where the call is host-bound. Both rules come from A/B
#: runs in one process on an H200 (16 heads, D = 128, bf16, eager ``do_bench`` medians, rule / descriptors
#: always; ``book/data/bench/checks/tma-rule.py``).
#: Forward (``checks/fwd-tma-rule-2-h200.json``, 2026-12-02 05:37 UTC, with launch plans keeping their hits and
#: the launcher given addresses): descriptors ahead at every size, 1.07-1.14x from 576 to 15 232 pairs, so the
#: forward has no rule (0). Its earlier rules: 20 000 pairs from the host cost alone, which made eager forwards
#: at 2k-8k 13-15% slower; then 1 024 from means of ``do_bench`` (``fwd-tma-rule-h200.json``: 576 pairs 0.50x).
#: Backward: the eight descriptors cost 15-34 us of host time per call (``checks/bwd-host-desc-h200.json``:
#: window 2048 at N = 3k 171 against 153 us through autograd) and save 7-8% of the kernel's time. A trace of
#: the ``do_bench`` loop (``checks/bwd-eager-timeline-h200.json``, 2026-12-02 07:53 UTC) showed the eager call
#: with descriptors timed at its CUDA-graph time from 4 352 pairs up (window 2048 at 3k 0.273 against 0.273
#: ms, pointers 0.296): the flush hides the host there, so only the device saving counts. The A/B in
#: medians of three rotated rounds (``bwd-tma-rule-5-h200.json``, 07:57 UTC): descriptors 1.04-1.08x ahead at
#: every case from 2 880 pairs up (to 15 232), and split below (0.71-1.11x from 576 to 2 480 pairs: host-bound
#: calls, where a run's host speed decides). The rule sits at 2 700, between the two. (It was 5 300 from
#: earlier A/Bs whose cases at 4 352-4 400 pairs moved by more than either side from run to run.)
TMA_MIN_PAIRS = {"fwd": 0, "bwd": 2_700}


def too_small_for_tma(pass_: str, tma: Optional[bool], layout: BlockLayout, q: torch.Tensor) -> bool:
    """Whether an eager call of ``pass_`` on ``layout`` should keep pointer loads (config ``tma=None``, on a
    GPU, fewer visited tile pairs than :data:`TMA_MIN_PAIRS`). Built once per launch plan: a static layout's
    listed tiles, a dynamic layout's capacity."""
    if tma is not None or not q.is_cuda:
        return False
    B, Hq = q.shape[0], q.shape[1]
    if layout.dynamic:
        pairs = B * Hq * layout.nq * (layout.width + layout.full_width)
    else:
        pairs = float((layout.kv_count + layout.full_count).sum()) * B * Hq / (layout.B * layout.H)
    return pairs < TMA_MIN_PAIRS[pass_]


def plan_tma(tma: Optional[bool], device, in_interpreter: bool, *tensors: torch.Tensor) -> bool:
    """A launch plan's ``"tma"``: :func:`tma_allowed`, and the strides of ``tensors`` fit tensor descriptors
    (:func:`tma_ok` less the base address). A plan is keyed by its tensors' strides and dtype, so a call need
    only check its base addresses (:func:`call_tma`)."""
    return tma_allowed(tma, device, in_interpreter) and tma_strides_ok(*tensors)


def call_tma(plan: dict, q: torch.Tensor, *tensors: torch.Tensor) -> bool:
    """Whether this call loads through tensor descriptors: its plan allows them (``plan["tma"]``, strides
    included) and is not too small for them (``plan["small"]``) unless a CUDA graph is being captured (a replay
    has no host work to pay), and its tensors' bases are 16-byte aligned (checked at every call)."""
    if not plan["tma"]:
        return False
    if plan["small"] and not (q.is_cuda and torch.cuda.is_current_stream_capturing()):
        return False
    return tma_bases_ok(q, *tensors)


def tensor_descriptors(head_dim: int, **tiles) -> dict:
    """``desc_<name>`` for each ``name=(tensor, rows)``: the tensor descriptor of the ``[B, H, L, head_dim]``
    tensor loading ``rows`` rows of one head at a time (the forward and both backward passes build theirs
    here), as a :class:`~sparseattn._fast_launch.Desc`: the launch makes the descriptor object only when Triton
    binds the call; a cached launch needs only the tensor's address. The caller has checked the tensors with
    :func:`tma_ok` (16-byte aligned base and strides, unit last stride)."""
    return {f"desc_{name}": _fast_launch.Desc(t, (1, 1, rows, head_dim)) for name, (t, rows) in tiles.items()}


def with_smaller_tiles(run, cfg, fallbacks):
    """Run ``run(cfg)``; if the GPU lacks the shared memory for its tiles even at one pipeline stage (a T4 on
    Colab has 64 KiB), retry with the smaller tile configs of ``fallbacks``."""
    import triton
    attempts = [cfg, *fallbacks]
    for i, attempt in enumerate(attempts):
        try:
            return run(attempt)
        except triton.runtime.errors.OutOfResources:
            if i == len(attempts) - 1:
                raise


Static = _fast_launch.Static


_TIMED: Optional[list] = None


@contextlib.contextmanager
def timed_launches():
    """Within the block, every :func:`launch` appends ``(kernel name, start, end)`` to the yielded list: CUDA
    events recorded around the launch on the current stream (device time; read with :func:`elapsed_ms` after
    a synchronize), or ``time.perf_counter()`` seconds in the interpreter. The backward sweep times each pass
    with it."""
    global _TIMED
    before, _TIMED = _TIMED, []
    try:
        yield _TIMED
    finally:
        _TIMED = before


def elapsed_ms(entry) -> float:
    """Milliseconds between the start and the end of a :func:`timed_launches` entry."""
    _, start, end = entry
    if isinstance(start, float):
        return (end - start) * 1e3
    return start.elapsed_time(end)


def launch(kernel, grid, *, num_stages: int, static: Optional[Static] = None, **kwargs):
    """Launch as :func:`_launch` does; inside :func:`timed_launches`, also record the launch's start and end."""
    if _TIMED is None:
        return _launch(kernel, grid, num_stages=num_stages, static=static, **kwargs)
    import time
    timed = _TIMED
    name = getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel))
    cuda = not _runtime.is_interpreter()
    start = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
    if cuda:
        start.record()
    out = _launch(kernel, grid, num_stages=num_stages, static=static, **kwargs)
    end = torch.cuda.Event(enable_timing=True) if cuda else time.perf_counter()
    if cuda:
        end.record()
    timed.append((name, start, end))
    return out


def _launch(kernel, grid, *, num_stages: int, static: Optional[Static] = None, **kwargs):
    """``kernel[grid](**static, **kwargs)``; if the tile config needs more shared memory than the GPU has (the
    bit-mask path adds a buffer), retry with fewer pipeline stages. On the GPU, a call whose arguments
    specialise as an earlier call's did skips Triton's argument binding (:mod:`sparseattn._fast_launch`; ``static``:
    the arguments that never change for this launch, kept by the caller, keyed by one token); the variant
    that launched (after any retry) is the one kept for the key of the stages asked for."""
    if _runtime.is_interpreter():
        return _launch_retrying(kernel, grid, num_stages, {**(static or {}), **_fast_launch.materialised(kwargs)})
    kwargs["num_stages"] = num_stages
    site, kept = None, ()
    if static is not None:  # the plan's kept hits for this call site (its kernel and argument names)
        site = (kernel, tuple(kwargs))
        kept = static.direct.get(site, ())
        for direct in kept:
            if _fast_launch.launch_direct(direct, grid, kwargs):
                return direct.bound.compiled
    out = _fast_launch.launch(kernel, grid, static, kwargs,
                              lambda kw: _launch_retrying(kernel, grid, num_stages, {**(static or {}), **kw}))
    if site is not None and len(kept) < KEPT_HITS_PER_SITE:
        made = _fast_launch.direct_for(kernel, static, kwargs)
        if made is not None:
            static.direct[site] = (*kept, made)
    return out


#: Kept hits per launch site of a plan: a site's calls differ in kind only where the plan allows it (tensor
#: descriptors or pointers: an eager call and a CUDA-graph capture of a small layout), so a few cover them.
KEPT_HITS_PER_SITE = 4


#: ``(kernel name, stages now tried)`` each time a launch retried with fewer pipeline stages for lack of shared
#: memory (the sweep reads it: a config that fell back did not run the stages it names).
STAGE_FALLBACKS: list = []


def _launch_retrying(kernel, grid, num_stages: int, kwargs: dict):
    import triton
    kwargs = {k: v for k, v in kwargs.items() if k != "num_stages"}
    while True:
        try:
            return kernel[grid](num_stages=num_stages, **kwargs)
        except triton.runtime.errors.OutOfResources:
            if num_stages <= 1:
                raise
            num_stages -= 1
            STAGE_FALLBACKS.append((getattr(getattr(kernel, "fn", kernel), "__name__", str(kernel)), num_stages))


def strides(prefix: str, t: Optional[torch.Tensor], row: str) -> dict:
    """Keyword strides of a ``[B, H, L, D]`` tensor as the kernels name them: ``stride_<prefix>b``,
    ``stride_<prefix>h`` and ``stride_<prefix><row>`` (0 for an absent tensor)."""
    return {f"stride_{prefix}{name}": (t.stride(i) if t is not None else 0) for i, name in enumerate(("b", "h", row))}
