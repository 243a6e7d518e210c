"""When do the traced interval bounds pay before the classification kernel (``_tiles.TRACED_BOUNDS_MIN_TILES``)?
Issue 13's layout row (stripes from a plain lambda, N = 32k) took 1.646 ms before the bounds and the kernel's
early exit, 2.822 ms with both (versus, 2026-12-01 12:23 UTC). This A/B times the build of the two
compiled-mask patterns at three lengths without the bounds before the kernel, with them always, and with the
default gate (the kernel's early exit in all three), checks the tables are the same, and times
``maskc.tile_bounds`` alone. One command on a GPU box (under a minute):

    python book/data/bench/checks/layout-traced-bounds.py   # writes $OUT/layout-traced-bounds-<gpu>.json

Host wall time of one build followed by a device sync (the ``versus`` layout row's timer), median of 15."""
import os

import torch

from sparseattn import _tiles, maskc
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.layout import BlockLayout
from sparseattn.patterns import TileGrid
from sparseattn.roofline.cases import MASKC_PATTERNS, prefill_mask_mod
from sparseattn.roofline.timing import time_host

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 128
LENGTHS = (8192, 32768, 131072)
DEFAULT_GATE = _tiles.TRACED_BOUNDS_MIN_TILES


def _same(a: BlockLayout, b: BlockLayout) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("kv_count", "kv_index", "full_count", "full_index"))


def main(out_dir: str) -> str:
    records, table = [], []
    for pattern in MASKC_PATTERNS:
        for N in LENGTHS:
            mm = prefill_mask_mod(pattern, N, DEV)  # made once, as a user would
            case = {"pattern": pattern, "N": N, "B": 1, "H": 1, "block": BLOCK}
            row, built = {"pattern": pattern, "N": N}, {}
            for label, least in (("kernel_only_ms", None), ("bounds_ms", 0), ("gated_ms", DEFAULT_GATE)):
                _tiles.TRACED_BOUNDS_MIN_TILES = least
                build = lambda: BlockLayout.from_mask_mod(mm, N, N, BLOCK, BLOCK, device=DEV)  # noqa: E731
                built[label] = build()
                ms = time_host(build, device=DEV)
                records.append(Record(case, Impl.OURS, Pass.LAYOUT, ms, {"traced_bounds_min_tiles": least,
                                                                          "variant": label[:-3]}))
                row[label] = round(ms, 3)
            _tiles.TRACED_BOUNDS_MIN_TILES = DEFAULT_GATE
            grid = TileGrid(0, N, N, BLOCK, BLOCK, 1, 1, torch.device(DEV))
            row["tile_bounds_alone_ms"] = round(time_host(lambda: maskc.tile_bounds(mm, grid), device=DEV), 3)
            row["same_table"] = all(_same(built["kernel_only_ms"], x) for x in built.values())
            records[-1] = Record(case, Impl.OURS, Pass.LAYOUT, records[-1].ms,
                                 {**records[-1].extra, "tile_bounds_alone_ms": row["tile_bounds_alone_ms"],
                                  "same_table": row["same_table"]})
            table.append(row)
            print(row, flush=True)
    path = C.write_json("layout-traced-bounds", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", "kernel_only_ms", "bounds_ms", "gated_ms", "tile_bounds_alone_ms",
                          "same_table"])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
