"""Where the interval bounds of a compiled mask should run in the layout build: on the host before the
classification kernel (``maskc.tile_bounds``, gated by ``_tiles.TRACED_BOUNDS_MIN_TILES``), inside the kernel
(``maskc.generate_bounds``, switched by ``_tiles.TILE_BOUNDS``), both, or neither. Issue 13's layout row
(stripes from a plain lambda, N = 32k) took 1.646 ms before either, 2.822 ms with the host bounds always
(versus, 2026-12-01 12:23 UTC), 1.163 ms with the gate and the every-tile launch (14:52). Runs of this script:
``checks/layout-traced-bounds-1-h200.json`` (12:29, host bounds only), ``-h200.json`` (14:53, with the every-tile
launch; its first variant carried the process's warm-up, so each pattern now builds once before timing;
chapter 3 reads that file, so this version writes ``layout-tile-bounds-<gpu>.json``: ``-1-h200.json``
16:33 with the gate at 2^17 as the default, ``-h200.json`` 17:11 with the host bounds off by default).
This version times the two compiled-mask patterns at three lengths in five variants, checks the tables are
the same, and times ``maskc.tile_bounds`` alone. One command on a GPU box (about a minute):

    python book/data/bench/checks/layout-traced-bounds.py   # writes $OUT/layout-tile-bounds-<gpu>.json

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
DEFAULT_TILE_BOUNDS = _tiles.TILE_BOUNDS
#: (label, host bounds from this many undecided tiles (None: never), bounds inside the kernel)
VARIANTS = (("kernel_only_ms", None, False), ("in_kernel_ms", None, True), ("host_ms", 0, False),
            ("both_ms", 0, True), ("default_ms", DEFAULT_GATE, DEFAULT_TILE_BOUNDS))


def _same(a: BlockLayout, b: BlockLayout) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("kv_count", "kv_index", "full_count", "full_index"))


def main(out_dir: str) -> str:
    records, table = [], []
    for pattern in MASKC_PATTERNS:
        for N in LENGTHS:
            mm = prefill_mask_mod(pattern, N, DEV)  # made once, as a user would
            case = {"pattern": pattern, "N": N, "B": 1, "H": 1, "block": BLOCK}
            row, built = {"pattern": pattern, "N": N}, {}
            build = lambda: BlockLayout.from_mask_mod(mm, N, N, BLOCK, BLOCK, device=DEV)  # noqa: E731
            build()  # warm-up: compile the kernels, trace the mask, before any variant is timed
            for label, least, in_kernel in VARIANTS:
                _tiles.TRACED_BOUNDS_MIN_TILES, _tiles.TILE_BOUNDS = least, in_kernel
                built[label] = build()
                ms = time_host(build, device=DEV)
                records.append(Record(case, Impl.OURS, Pass.LAYOUT, ms, {"traced_bounds_min_tiles": least,
                                                                          "tile_bounds": in_kernel,
                                                                          "variant": label[:-3]}))
                row[label] = round(ms, 3)
            _tiles.TRACED_BOUNDS_MIN_TILES, _tiles.TILE_BOUNDS = DEFAULT_GATE, DEFAULT_TILE_BOUNDS
            grid = TileGrid(0, N, N, BLOCK, BLOCK, 1, 1, torch.device(DEV))
            row["tile_bounds_alone_ms"] = round(time_host(lambda: maskc.tile_bounds(mm, grid), device=DEV), 3)
            row["same_table"] = all(_same(built["kernel_only_ms"], x) for x in built.values())
            records[-1] = Record(case, Impl.OURS, Pass.LAYOUT, records[-1].ms,
                                 {**records[-1].extra, "tile_bounds_alone_ms": row["tile_bounds_alone_ms"],
                                  "same_table": row["same_table"]})
            table.append(row)
            print(row, flush=True)
    path = C.write_json("layout-tile-bounds", records, out_dir, C.environment())
    C.print_table(table, ["pattern", "N", *(v[0] for v in VARIANTS), "tile_bounds_alone_ms", "same_table"])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
