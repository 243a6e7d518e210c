"""Whether a mask with a tile rule should skip its rule and go to the classification kernel whole, as a plain
lambda does (``_tiles.RULE_MASKS_WHOLE_GRID_BELOW``). The layout suite of 2026-12-01 16:57 UTC timed the
builds of the rule patterns at N = 32k at 0.68-2.2 ms against 0.45 ms for the plain lambda through the
whole-grid kernel: the rule's torch ops over the tile grid, a ``nonzero`` with its host sync, the kernel over
the listed undecided tiles and the scatter back cost more on the host than the kernel over every tile, whose
compiled interval bounds decide in O(1) most tiles the rule decides. At N = 131k (1M tiles) the whole grid may
cost more than the rule. This times both paths for the layout suite's patterns at three lengths, checks
they build the same table, and prints the table last. One command on a GPU box (about two minutes):

    python book/data/bench/checks/layout-rule-vs-kernel.py   # writes $OUT/layout-rule-vs-kernel-<gpu>.json

Host wall time of one build followed by a device sync (the layout suite's timer), median of 15."""
import os

import torch

from sparseattn import _tiles
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.layout import BlockLayout
from sparseattn.roofline.cases import LAYOUT_PATTERNS, layout_mask_mod
from sparseattn.roofline.timing import time_host

DEV = "cuda" if torch.cuda.is_available() else "cpu"
LENGTHS = (8192, 32768, 131072) if DEV == "cuda" else (1024,)
VARIANTS = (("rule_ms", None), ("whole_grid_ms", 1 << 40))


def _same(a: BlockLayout, b: BlockLayout) -> bool:
    return all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("kv_count", "kv_index", "full_count", "full_index"))


def main(out_dir: str) -> str:
    records, table = [], []
    default = _tiles.RULE_MASKS_WHOLE_GRID_BELOW
    for N in LENGTHS:
        for pattern in LAYOUT_PATTERNS:
            mm = layout_mask_mod(pattern, N, device=DEV)
            case = {"pattern": pattern, "N": N, "B": 1, "H": 1, "block": 128}
            row, built = {"pattern": pattern, "N": N, "tiles": (N // 128) ** 2}, {}
            build = lambda: BlockLayout.from_mask_mod(mm, N, N, 128, 128, device=DEV)  # noqa: E731
            for label, below in VARIANTS:
                _tiles.RULE_MASKS_WHOLE_GRID_BELOW = below
                built[label] = build()  # warm-up: compile, trace
                ms = time_host(build, device=DEV)
                records.append(Record(case, Impl.OURS, Pass.LAYOUT, ms, {"rule_masks_whole_grid_below": below,
                                                                          "variant": label[:-3]}))
                row[label] = round(ms, 3)
            _tiles.RULE_MASKS_WHOLE_GRID_BELOW = default
            row["whole/rule"] = round(row["whole_grid_ms"] / row["rule_ms"], 2)
            row["same_table"] = _same(built["rule_ms"], built["whole_grid_ms"])
            table.append(row)
            print(row, flush=True)
    path = C.write_json("layout-rule-vs-kernel", records, out_dir, C.environment())
    C.print_table(table, list(table[0]))
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
