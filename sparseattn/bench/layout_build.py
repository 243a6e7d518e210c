"""Suite ``layout``: building the block table from a mask_mod (host wall time, peak device memory) and
transposing it on the device, against FlexAttention's ``create_block_mask`` on the same mask_mod."""
from __future__ import annotations

import torch

from ..layout import BlockLayout
from . import _common as C
from .cases import LAYOUT_PATTERNS, layout_mask_mod
from .record import Impl, Pass, Record

NAME = "layout"
DEFAULT_N = "32768,131072"
CONFIG_KIND = None  # no config sweep
COLUMNS = ["pattern", "N", "build_ms", "transpose_ms", "peak_MB", "tiles", "flex_create_block_mask_ms", "flex/ours"]


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
                build = lambda: BlockLayout.from_mask_mod(mm, N, N, 128, 128, device=dev)  # noqa: E731
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
                if create_block_mask is not None:
                    try:
                        flex_ms = C.time_host(lambda: create_block_mask(mm, None, None, N, N, device=dev,
                                                                        BLOCK_SIZE=128), device=dev)
                    except torch.OutOfMemoryError:  # it materialises the N x N mask
                        C.empty_cache()
                        records.append(Record(case, Impl.FLEX, Pass.LAYOUT, None,
                                              {"error": f"out of memory (N x N = {N * N / 2**30:.0f} Gi cells)"}))
                        row["flex_create_block_mask_ms"] = "OOM"
                    else:
                        records.append(Record(case, Impl.FLEX, Pass.LAYOUT, flex_ms))
                        row["flex_create_block_mask_ms"] = round(flex_ms, 3)
                        row["flex/ours"] = round(flex_ms / ms, 1)
                table.append(row)
                bar.update()
    return records, table, COLUMNS
