"""Suite ``layout``: building the block table from a mask_mod (host wall time, peak device memory) and
transposing it on the device, against FlexAttention's ``create_block_mask`` on the same mask_mod, called both
ways: eagerly (``_compile=False``, its default, which evaluates the mask_mod on all N x N cells at once) and
compiled (``_compile=True``). Each Flex row says which: ``"compiled"`` (bool) and ``"call"``.

Our build reduces the tiles a pattern's tile rule leaves undecided with the compiled mask_mod on the device
(:mod:`sparseattn.maskc`); for the patterns in ``EAGER_MASK_AB`` it is also timed with those tiles evaluated
by eager torch instead (``sparseattn-eager-mask``), the path it replaces."""
from __future__ import annotations

import torch

from .. import _tiles
from ..layout import BlockLayout
from . import _common as C
from .cases import LAYOUT_PATTERNS, layout_mask_mod
from .record import Impl, Pass, Record

NAME = "layout"
DEFAULT_N = "32768,131072"
CONFIG_KIND = None  # no config sweep
COLUMNS = ["pattern", "N", "build_ms", "transpose_ms", "peak_MB", "tiles", "flex_eager_ms", "flex_compiled_ms",
           "compiled_flex/ours", "eager_mask_ms"]
#: FlexAttention's create_block_mask is measured eagerly and compiled (``_compile``), in this order.
FLEX_MASK_MODES = (False, True)
#: Patterns whose undecided tiles are many (no tile rule): also built with eager torch classification.
EAGER_MASK_AB = ("arbitrary(no rule)",)


def flex_block_mask_call(create_block_mask, compiled: bool):
    """``create_block_mask`` as the suite calls it: 128-token blocks, ``_compile=compiled``."""
    if compiled:
        C.raise_recompile_limits()  # one compile per (mask_mod, N): more than dynamo's default limit

    def call(mm, N, device):
        return create_block_mask(mm, None, None, N, N, device=device, BLOCK_SIZE=128, _compile=compiled)
    return call


def run(args) -> tuple:
    """Measure every (N, pattern); return (records, table rows, table columns)."""
    dev = args.device
    records, table = [], []
    Ns = [int(x) for x in args.n.split(",")]
    try:
        from torch.nn.attention.flex_attention import create_block_mask
    except ImportError:
        create_block_mask = None
    with C.progress(len(Ns) * len(LAYOUT_PATTERNS), NAME) as bar:
        for N in Ns:
            for name in LAYOUT_PATTERNS:
                bar.set_postfix_str(f"{name} N={N}")
                mm = layout_mask_mod(name, N, device=dev)
                case = {"pattern": name, "N": N, "block": 128}
                def build(kernel=True):  # undecided tiles: compiled predicate on the device, or eager torch
                    with _tiles.classify_kernel(kernel):
                        return BlockLayout.from_mask_mod(mm, N, N, 128, 128, device=dev)
                with C.peak_memory(dev) as peak:
                    ms = C.time_host(build, device=dev)
                peak_mb = peak["mb"]
                layout = build()
                ms_t = C.time_gpu(lambda: layout.transpose(width=layout.nq))  # fixed capacity: no host sync
                st = layout.stats()
                records.append(Record(case, Impl.OURS, Pass.LAYOUT, ms, {"peak_mb": peak_mb,
                                                                         "tiles": st["listed_tiles"]}))
                records.append(Record(case, Impl.OURS, Pass.TRANSPOSE, ms_t))
                row = {"pattern": name, "N": N, "build_ms": round(ms, 3), "transpose_ms": round(ms_t, 3),
                       "peak_MB": round(peak_mb, 1), "tiles": st["listed_tiles"]}
                if name in EAGER_MASK_AB:
                    with C.peak_memory(dev) as peak:
                        ms_e = C.time_host(lambda: build(kernel=False), device=dev)
                    same = _same_tiles(build(kernel=False), layout)
                    records.append(Record(case, Impl.OURS_EAGER_MASK, Pass.LAYOUT, ms_e, {
                        "peak_mb": peak["mb"], "same_tiles_as_compiled": same}))
                    row["eager_mask_ms"] = round(ms_e, 3)
                for compiled in (FLEX_MASK_MODES if create_block_mask is not None else ()):
                    call = flex_block_mask_call(create_block_mask, compiled)
                    label = {"compiled": compiled,
                             "call": f"create_block_mask(..., BLOCK_SIZE=128, _compile={compiled})"}
                    key = "flex_compiled_ms" if compiled else "flex_eager_ms"
                    try:
                        flex_ms = C.time_host(lambda: call(mm, N, dev), device=dev)
                    except torch.OutOfMemoryError:  # eager: it materialises the N x N mask
                        C.empty_cache()
                        records.append(Record(case, Impl.FLEX, Pass.LAYOUT, None, {
                            **label, "error": f"out of memory (N x N = {N * N / 2**30:.0f} Gi cells)"}))
                        row[key] = "OOM"
                    except Exception as e:  # noqa: BLE001 - a compile failure is a result, not a crash
                        if not compiled:
                            raise
                        records.append(Record(case, Impl.FLEX, Pass.LAYOUT, None, {
                            **label, "error": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}))
                        row[key] = "failed"
                    else:
                        records.append(Record(case, Impl.FLEX, Pass.LAYOUT, flex_ms, label))
                        row[key] = round(flex_ms, 3)
                        if compiled:
                            row["compiled_flex/ours"] = round(flex_ms / ms, 1)
                table.append(row)
                bar.update()
    return records, table, COLUMNS


def _same_tiles(a: BlockLayout, b: BlockLayout) -> bool:
    """The two builds list the same tiles with the same full/partial split."""
    pa, fa = a.block_classes()
    pb, fb = b.block_classes()
    return bool(torch.equal(pa, pb) and torch.equal(fa, fb))
