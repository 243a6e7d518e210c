"""Compile every Triton kernel variant of sparseattn for sm_90 (Hopper) on a machine without a GPU.

The Triton interpreter runs kernels on the CPU but skips the compiler's checks (e.g. a global that is not a
``tl.constexpr``, a type clash between branches); this script runs the real compiler down to a cubin (Triton
ships ptxas), so CI catches what would otherwise fail first on the GPU. Run in a fresh process:
``python tests/tools/compile_sm90.py`` prints one line per variant and exits 1 if any failed;
``--ptxas`` adds each variant's registers per thread and spill bytes as Triton's ``ptxas -v`` reports them for
sm_90a (a register-pressure check that needs no GPU: the dK/dV pass at 64 x 128, 8 warps, 3 stages spills
184 bytes with tensor descriptors, see the performance notes).
"""
import os
import re
import subprocess
import sys
import tempfile

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

import sparseattn._runtime as runtime  # noqa: E402

runtime._BACKEND = "cuda"  # define the kernels as compiled JIT functions, not interpreted ones
from sparseattn.kernels import (decode, mask_tiles, merge, prefill_bwd, prefill_fwd, route, row_lists,  # noqa: E402
                                select, transpose)

TARGET = GPUTarget("cuda", 90, 32)
PTXAS = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
PTXAS_INFO = "--ptxas" in sys.argv[1:]  # main(): report registers and spills of every variant
I32, BF16, F32, U8 = "*i32", "*bf16", "*fp32", "*u8"


class _Arg:  # what a @triton.heuristics lambda may look at: a tensor's dtype, or a scalar's value
    def __init__(self, dtype):
        self.dtype = dtype


class TensorDescriptor(_Arg):  # a host-side descriptor argument, as a heuristic sees its type's name
    pass


def compile_variant(kernel, ptrs: dict, floats=(), consts=None, options=None) -> str:
    """Compile ``kernel`` with pointer args ``ptrs`` (name -> type), fp32 scalars ``floats``, constexprs
    ``consts`` (None = an absent optional tensor), launch ``options`` (num_warps, num_stages); every other
    argument is an i32 scalar."""
    jit = kernel.fn if isinstance(kernel, triton.runtime.autotuner.Heuristics) else kernel
    consts = dict(consts or {})
    if jit is not kernel:  # evaluate the heuristics the way a launch would
        seen = {n: (TensorDescriptor if t.startswith("tensordesc") else _Arg)(
            torch.bfloat16 if t in (BF16,) or "bf16" in t else torch.float32) for n, t in ptrs.items()}
        seen.update({n: 1 for n in jit.arg_names if n not in ptrs and n not in consts})
        seen.update(consts)
        for name, rule in kernel.values.items():
            consts[name] = rule(seen)
    sig = {n: "constexpr" if n in consts else ptrs.get(n, "fp32" if n in floats else "i32") for n in jit.arg_names}
    src = ASTSource(jit, sig, {(jit.arg_names.index(k),): v for k, v in consts.items()})
    flags = ",".join(f"{k}={getattr(v, '__module__', v) if k in ('MASK_FN', 'BOUNDS_FN') else v}" for k, v in consts.items()
                     if k.isupper() and not isinstance(v, int))
    try:
        compiled = triton.compile(src, target=TARGET, options=options)
        opts = "".join(f" {k}={v}" for k, v in (options or {}).items())
        regs = f" {ptxas_info(compiled.asm['ptx'])}" if PTXAS_INFO else ""
        return f"ok    {jit.fn.__name__} {flags}{opts} shared={compiled.metadata.shared}{regs}"
    except Exception as e:  # noqa: BLE001 - report every failure, keep going
        return f"FAIL  {jit.fn.__name__} {flags}: {type(e).__name__}: {str(e)[:2000]}"


def ptxas_info(ptx: str) -> str:
    """``regs=R spill_stores=S spill_loads=L`` of a kernel's PTX, from Triton's own ptxas for sm_90a."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "kernel.ptx")
        with open(path, "w") as f:
            f.write(ptx)
        out = subprocess.run([PTXAS, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                             capture_output=True, text=True)
    text = out.stdout + out.stderr
    found = {key: re.search(pat, text) for key, pat in (("regs", r"Used (\d+) registers"),
                                                         ("spill_stores", r"(\d+) bytes spill stores"),
                                                         ("spill_loads", r"(\d+) bytes spill loads"))}
    return " ".join(f"{key}={int(m.group(1)) if m else 0}" for key, m in found.items())


#: the launch options of the tuned sm90 bf16 backward (sparseattn/data/tuned_configs.json, head dim 128)
BWD_OPTIONS = dict(num_warps=8, num_stages=3)

NO_FN = dict(MASK_FN=None, CAP0=None, CAP1=None, CAP2=None, CAP3=None, CAP_SHAPE=None)


def compiled_masks():
    """Generated predicates (sparseattn.maskc) the kernels take as a constexpr: ``(name, fn, capture ptr types)``.
    One indexes a per-head int32 table and a bool table with floor ``//``/``%`` on negative values (the helper
    functions), one is block_random's int64 hash, one the stripes mask of the benchmarks, one a mask of the key
    position alone (widened to the tile) with narrow-dtype wrap-around and int64 loads."""
    from sparseattn import maskc, patterns as P
    from sparseattn.bench import cases
    tab = torch.zeros(4, 256, dtype=torch.int32)
    keep = torch.zeros(256, dtype=torch.bool)
    def tables(b, h, q, kv):
        return (((tab[h, q] - tab[h, kv]) // 3) % 2 == 0) & keep[kv] | ((q - kv) % -5 == 0)
    ids = torch.zeros(256, dtype=torch.int64)

    def narrow(b, h, q, kv):
        return ((kv.to(torch.uint8) + ids[kv].to(torch.int8)) * 3).to(torch.int16) > h

    out = []
    for name, mm in (("tables", tables), ("hash", P.block_random(0.3, 64, 1)), ("stripes", cases.stripes_mask()),
                     ("narrow", narrow)):
        c = maskc.compile_mask(mm)
        types = [{torch.int32: I32, torch.int64: "*i64", torch.bool: "*i1"}[t.dtype] for t in c.captures]
        out.append((name, c.fn, types, c.bounds))
    return out


def compiled_kind(fn, types):
    caps = {f"CAP{i}": None for i in range(len(types), 4)}
    return dict(sink_n=0, BITS=None, DOC=None, ROW_SLOT=None, MASK_FN=fn, **caps), \
        dict({f"CAP{i}": t for i, t in enumerate(types)}, CAP_SHAPE=I32)


NO_SPLIT = dict(TASKS=None, N_TASKS=None, WS_O=None, WS_LSE=None, COUNTER=None, PERSISTENT=False)
NO_DESC = dict(desc_q=None, desc_k=None, desc_v=None, desc_do=None)


def descriptors(rows_qdo: int, rows_kv: int, d: int = 128) -> dict:
    """Signature types of one backward pass's bf16 tensor descriptors (Q and dO in ``rows_qdo`` rows, K and V
    in ``rows_kv``), as Triton writes them for a host-side ``TensorDescriptor`` with that block shape."""
    return {f"desc_{n}": f"tensordesc<bf16[1,1,{rows_qdo if n in 'qdo' else rows_kv},{d}]>"
            for n in ("q", "k", "v", "do")}


def prefill_variants(mask, cap_ptrs, dims=(64, 128), backward=True, split=True, tma=False):
    """The forward (head dims ``dims``; with ``split``, also the split and the persistent split forward) and,
    with ``backward``, the dK/dV (both dQ modes) and dQ kernels (with ``tma``, also through tensor
    descriptors)."""
    extra = {k: v for k, v in (("BITS", U8), ("DOC", I32), ("ROW_SLOT", U8)) if k not in mask}
    extra.update(cap_ptrs)
    fwd = dict(Q=BF16, K=BF16, V=BF16, O=BF16, LSE=F32, KV_COUNT=I32, KV_INDEX=I32, FULL_COUNT=I32,
               FULL_INDEX=I32, ROW_ORDER=I32, **extra)
    for d in dims:
        yield prefill_fwd.sparse_fwd_kernel, fwd, ("scale_log2",), dict(
            HEAD_DIM=d, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=128, BLOCK_N=128 if d == 128 else 64,
            WARP_SPEC=False, desc_q=None, desc_k=None, desc_v=None, **NO_SPLIT, **mask)
    # the split forward (tasks of sparseattn.balance.plan, partial states to a float32 workspace), on its own
    # grid and on the persistent one (a loop over the tasks around the same body: dealt, or pulled from a counter)
    for persistent, pull in (((False, False), (True, False), (True, True)) if split else ()):
        ptrs = {**fwd, "TASKS": I32, "N_TASKS": I32, "WS_O": F32, "WS_LSE": F32, **({"COUNTER": I32} if pull else {})}
        yield prefill_fwd.sparse_fwd_kernel, ptrs, ("scale_log2",), dict(
            HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=128, BLOCK_N=128, WARP_SPEC=False, desc_q=None,
            desc_k=None, desc_v=None, PERSISTENT=persistent, **({} if pull else {"COUNTER": None}), **mask)
    for atomic in ((False, True) if backward else ()):
        bwd = dict(Q=BF16, K=BF16, V=BF16, DO=BF16, LSE=F32, DELTA=F32, DK=BF16, DV=BF16, WS_K=F32, WS_V=F32,
                   Q_COUNT=I32, Q_INDEX=I32, Q_SLOT=I32, FULL_Q_COUNT=I32, FULL_Q_INDEX=I32, WORK=I32, **extra,
                   **({"DQ_ACC": F32} if atomic else {}))
        yield prefill_bwd.dkdv_kernel, bwd, ("scale", "scale_log2"), dict(
            HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=64, BLOCK_N=128, **mask, **NO_DESC,
            **({} if atomic else {"DQ_ACC": None})), BWD_OPTIONS
        if tma:  # the same pass loading through tensor descriptors (BwdConfig.tma)
            yield prefill_bwd.dkdv_kernel, {**bwd, **descriptors(64, 128)}, ("scale", "scale_log2"), dict(
                HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=64, BLOCK_N=128, **mask,
                **({} if atomic else {"DQ_ACC": None})), BWD_OPTIONS
        if tma and atomic:  # dQ added by the copy engine: the float32 accumulator as a descriptor (DQ_TMA)
            yield prefill_bwd.dkdv_kernel, {**bwd, **descriptors(64, 128),
                                            "DQ_ACC": "tensordesc<fp32[1,1,64,128]>"}, ("scale", "scale_log2"), \
                dict(HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=64, BLOCK_N=128, **mask), BWD_OPTIONS
    if backward:
        dq = dict(Q=BF16, K=BF16, V=BF16, DO=BF16, LSE=F32, DELTA=F32, DQ=BF16, KV_COUNT=I32, KV_INDEX=I32,
                  FULL_COUNT=I32, FULL_INDEX=I32, **extra)
        yield prefill_bwd.dq_kernel, dq, ("scale", "scale_log2"), dict(
            HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=128, BLOCK_N=64, TASKS=None, N_TASKS=None, WS_DQ=None,
            **mask, **NO_DESC), BWD_OPTIONS
    if backward and tma:
        yield prefill_bwd.dq_kernel, {**dq, **descriptors(128, 64)}, ("scale", "scale_log2"), dict(
            HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=128, BLOCK_N=64, TASKS=None, N_TASKS=None, WS_DQ=None,
            **mask), BWD_OPTIONS
    if backward:  # both passes in one launch (BwdConfig.overlap), with and without tensor descriptors
        fused = dict(Q=BF16, K=BF16, V=BF16, DO=BF16, LSE=F32, DELTA=F32, DK=BF16, DV=BF16, DQ=BF16, WS_K=F32,
                     WS_V=F32, Q_COUNT=I32, Q_INDEX=I32, Q_SLOT=I32, FULL_Q_COUNT=I32, FULL_Q_INDEX=I32, WORK=I32,
                     KV_COUNT=I32, KV_INDEX=I32, FULL_COUNT=I32, FULL_INDEX=I32, **extra)
        shapes = dict(HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=64, BLOCK_N=128, DQ_BLOCK_M=128, DQ_BLOCK_N=64,
                      DKDV_STAGES=BWD_OPTIONS["num_stages"], DQ_STAGES=BWD_OPTIONS["num_stages"])
        for ordered in (False, True):  # a 2-D grid, or a 1-D grid through an ORDER table (ops.backward.DISPATCH)
            yield prefill_bwd.bwd_kernel, {**fused, **({"ORDER": I32} if ordered else {})}, ("scale", "scale_log2"), \
                dict(**shapes, **mask, **NO_DESC, dq_desc_q=None, dq_desc_k=None, dq_desc_v=None, dq_desc_do=None,
                     **({} if ordered else {"ORDER": None})), BWD_OPTIONS
        if tma:
            dq_descs = {"dq_" + n: t for n, t in descriptors(128, 64).items()}
            yield prefill_bwd.bwd_kernel, {**fused, **descriptors(64, 128), **dq_descs, "ORDER": I32}, \
                ("scale", "scale_log2"), dict(**shapes, **mask), BWD_OPTIONS
            # each kind of program its own loop depth: dK/dV at 2 stages (ptxas: 92 bytes of spills a thread on
            # the sinks predicate against 312 at 3), dQ at the launch's 3
            yield prefill_bwd.bwd_kernel, {**fused, **descriptors(64, 128), **dq_descs, "ORDER": I32}, \
                ("scale", "scale_log2"), dict(shapes, **mask, DKDV_STAGES=2), BWD_OPTIONS
    if backward and split:  # the split dQ pass (BwdConfig.dq_split): tasks of balance.plan, float32 partial dQ
        yield prefill_bwd.dq_kernel, {**dq, "TASKS": I32, "N_TASKS": I32, "WS_DQ": F32}, ("scale", "scale_log2"), \
            dict(HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=128, BLOCK_N=64, **mask, **NO_DESC), BWD_OPTIONS


def variants():
    # "member": a routed layout's row x slot bits on the causal predicate path (ROW_SLOT given)
    mask_kinds = [(k, dict(m, **NO_FN), {}) for k, m in {
        "predicate+sinks": dict(sink_n=64, BITS=None, DOC=None, ROW_SLOT=None),
        "bits": dict(sink_n=0, DOC=None, ROW_SLOT=None), "documents": dict(sink_n=0, BITS=None, ROW_SLOT=None),
        "member": dict(sink_n=0, BITS=None, DOC=None)}.items()]
    for kind, mask, cap_ptrs in mask_kinds:
        yield from prefill_variants(mask, cap_ptrs, tma=kind in ("predicate+sinks", "documents"))
    # compiled mask_mods: the one with captures through every prefill kernel, the others through the forward
    compiled = compiled_masks()
    for i, (name, fn, types, _) in enumerate(compiled):
        yield from prefill_variants(*compiled_kind(fn, types), dims=(64, 128) if i == 0 else (128,), backward=i == 0,
                                    split=i == 0)
    for i, (name, fn, types, bounds) in enumerate(compiled):
        caps = {f"CAP{j}": t for j, t in enumerate(types)}
        # every compiled mask's tile bounds (maskc.generate_bounds) in the classification kernel; cells written
        # (the tests' path) without them
        for cells in ((False, True) if i == 0 else (False,)):
            ptrs = dict(TB=I32, TH=I32, TQ=I32, TK=I32, ANY="*i8", ALL="*i8", CAP_SHAPE=I32, **caps,
                        **({"CELLS": "*i8"} if cells else {}))
            yield mask_tiles.mask_tiles_kernel, ptrs, (), dict(
                MASK_FN=fn, BOUNDS_FN=None if cells else bounds, BLOCK_Q=128, BLOCK_K=128, ROWS=32,
                **{f"CAP{j}": None for j in range(len(types), 4)}, **({} if cells else {"CELLS": None}))
        if i == 0:  # no tile list: every tile of the grid, in row-major order, with and without the bounds
            ptrs = dict(ANY="*i8", ALL="*i8", CAP_SHAPE=I32, **caps)
            for with_bounds in (True, False):
                yield mask_tiles.mask_tiles_kernel, ptrs, (), dict(
                    MASK_FN=fn, BOUNDS_FN=bounds if with_bounds else None, BLOCK_Q=128, BLOCK_K=128, ROWS=32,
                    TB=None, TH=None, TQ=None, TK=None, CELLS=None, **{f"CAP{j}": None for j in range(len(types), 4)})
    for sel in (False, True):
        ptrs = dict(Q=BF16, K_PAGES=BF16, V_PAGES=BF16, PAGE_TABLE=I32, SEQ_LENS=I32, SEQS=I32, O_PART=F32,
                    LSE_PART=F32, **({"SEL_INDEX": I32, "SEL_COUNT": I32} if sel else {}))
        yield decode.decode_split_kernel, ptrs, ("scale_log2",), dict(
            HEAD_DIM=128, PAGE_SIZE=16, BLOCK_G=16, BLOCK_N=64, HEAD_FASTEST=True,
            **({} if sel else {"SEL_INDEX": None, "SEL_COUNT": None}))
    yield decode.merge_splits_kernel, dict(O_PART=F32, LSE_PART=F32, O=BF16, LSE=F32), (), dict(
        HEAD_DIM=128, BLOCK_D=32, BLOCK_S=64)
    for d in (64, 128):  # the split forward's merge (one slice of D per program)
        yield merge.merge_rows_kernel, dict(WS_O=F32, WS_LSE=F32, MERGE=I32, N_MERGE=I32, O=BF16, LSE=F32), (), \
            dict(HEAD_DIM=d, BLOCK_M=128, BLOCK_D=64)
    for d in (64, 128):  # the split dQ pass's fixed-order sum of partial dQ
        yield prefill_bwd.dq_reduce_kernel, dict(WS_DQ=F32, MERGE=I32, N_MERGE=I32, DQ=BF16), ("scale",), \
            dict(HEAD_DIM=d, BLOCK_M=128, BLOCK_D=64)
    for d in (64, 128):  # the backward's Δ preprocess and the fixed-order sum of split dK/dV columns
        yield prefill_bwd.delta_kernel, dict(O=BF16, DO=BF16, DELTA=F32), (), dict(HEAD_DIM=d, BLOCK_M=64)
        yield prefill_bwd.column_reduce_kernel, dict(WS_K=F32, WS_V=F32, REDUCE=I32, DK=BF16, DV=BF16), (), \
            dict(HEAD_DIM=d, BLOCK_N=64, BLOCK_D=64)
    yield select.page_bound_kernel, dict(Q=BF16, K_MIN=BF16, K_MAX=BF16, PAGE_TABLE=I32, SEQ_LENS=I32, SEQS=I32,
                                         BOUND=F32), (), dict(HEAD_DIM=128, PAGE_SIZE=16, BLOCK_G=16, BLOCK_P=64)
    for block_p in (512, 8192):
        yield select.topk_pages_kernel, dict(BOUND=F32, SEQ_LENS=I32, SEQS=I32, INDEX=I32, COUNT=I32), (), dict(
            PAGE_SIZE=16, BLOCK_P=block_p, P_max=1000 if block_p == 512 else 8000)


def routing_variants():
    """The routing kernels (pool, block scores, top-k select, member bits), the fused transpose and the
    row lists of a layout build."""
    from sparseattn.bench.routing import POOL_VARIANTS
    for block, d in ((128, 128),):
        # every pool variant the routing suite's --pool-sweep times (FIRST and CURRENT among them), with the
        # options its launch passes; bound keys (min/max too) once each, plain means for CURRENT as well
        for name, kn in POOL_VARIANTS.items():
            sub = block if kn.pool_sub is None else kn.pool_sub
            for bound in (True, False) if name == "current" else (True,):
                ptrs = dict(Q=BF16, K=BF16, Q_MEAN=F32, K_MEAN=F32, **({"K_MIN": F32, "K_MAX": F32} if bound else {}))
                if kn.pool_tma:
                    ptrs.update({f"desc_{n}": f"tensordesc<bf16[1,1,{sub},{d}]>" for n in "qk"})
                yield route.pool_kernel, ptrs, (), dict(
                    HEAD_DIM=d, BLOCK_Q=block, BLOCK_K=block, SUB=sub, BLOCKS=kn.pool_blocks, ROW_ACC=kn.pool_row_acc,
                    JOINT=kn.pool_joint, PERSISTENT=kn.pool_persistent > 0, STAGES=kn.pool_stages,
                    PREFETCH=kn.pool_prefetch,
                    **({} if bound else {"K_MIN": None, "K_MAX": None}),
                    **({} if kn.pool_tma else {"desc_q": None, "desc_k": None})), dict(
                    num_warps=kn.pool_warps, **({"num_stages": kn.pool_stages} if kn.pool_persistent else {}))
        for bound in (False, True):
            ptrs = dict(Q_MEAN=F32, K_MEAN=F32, S=F32, **({"K_MIN": F32, "K_MAX": F32} if bound else {}))
            for causal, skip in ((True, True), (True, False), (False, False)):
                yield route.block_scores_kernel, ptrs, ("scale",), dict(
                    HEAD_DIM=d, BLOCK_Q=block, BLOCK_K=block, BLOCK_R=16, BLOCK_C=64, CAUSAL=causal,
                    SKIP_HIDDEN=skip, **({} if bound else {"K_MIN": None, "K_MAX": None}))
    lists = dict(S=F32, KV_COUNT=I32, KV_INDEX=I32, FULL_COUNT=I32, FULL_INDEX=I32)
    for block_nk, member, threshold, zero_pad in ((256, False, False, True), (256, False, False, False),
                                                  (256, True, True, True), (8192, False, True, True)):
        yield route.select_kernel, lists, ("threshold",) if threshold else (), dict(
            BLOCK_Q=128, BLOCK_K=128, BLOCK_NK=block_nk, ROWS=1, CAUSAL=True, MEMBER=member, ZERO_PAD=zero_pad,
            **({} if threshold else {"threshold": None}))
    # routing.FUSED: scores and select in one program, 16 query blocks a program, up to FUSED_MAX_NK key blocks
    fused = dict(Q_MEAN=F32, K_MEAN=F32, KV_COUNT=I32, KV_INDEX=I32, FULL_COUNT=I32, FULL_INDEX=I32)
    for block_nk, member, threshold, bound in ((256, False, False, False), (256, True, True, True),
                                               (512, False, True, False)):
        yield route.fused_select_kernel, {**fused, **({"K_MIN": F32, "K_MAX": F32} if bound else {})}, \
            ("scale",) + (("threshold",) if threshold else ()), dict(
                HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_NK=block_nk, ROWS=16, CAUSAL=True, MEMBER=member,
                ZERO_PAD=True, **({} if threshold else {"threshold": None}),
                **({} if bound else {"K_MIN": None, "K_MAX": None}))
    for bound in (False, True):
        ptrs = dict(Q=BF16, K_MEAN=F32, KV_COUNT=I32, KV_INDEX=I32, ROW_SLOT=U8,
                    **({"K_MIN": F32, "K_MAX": F32} if bound else {}))
        yield route.member_kernel, ptrs, (), dict(HEAD_DIM=128, BLOCK_Q=128, BLOCK_K=128, BLOCK_M=64, W_PAD=32,
                                                 CAUSAL=True, **({} if bound else {"K_MIN": None, "K_MAX": None}))
    ptrs = dict(COUNT=I32, INDEX=I32, FULL_COUNT=I32, FULL_INDEX=I32, OUT_COUNT=I32, OUT_INDEX=I32, OUT_SLOT=I32,
                OUT_FULL_COUNT=I32, OUT_FULL_INDEX=I32)
    for w_pow2, zero_pad in ((32, False), (2048, True)):
        yield transpose.transpose_kernel, ptrs, (), dict(ROWS=32, COLS=32, W_POW2=w_pow2, ZERO_PAD=zero_pad)
    ptrs = dict(PARTIAL=U8, FULL=U8, COUNT=I32, FULL_COUNT=I32, INDEX=I32, FULL_INDEX=I32, WIDTHS=I32)
    for cols, write in ((256, False), (256, True), (16, True)):
        yield row_lists.row_lists_kernel, ptrs, (), dict(ROWS=16, COLS=cols, WRITE=write)


def main() -> int:
    lines = [compile_variant(*v) for v in (*variants(), *routing_variants())]
    print("\n".join(lines))
    return int(any(line.startswith("FAIL") for line in lines))


if __name__ == "__main__":
    sys.exit(main())
