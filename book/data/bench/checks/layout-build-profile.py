"""Where the layout build from a plain lambda spends its time on the device box (issue 13's layout row:
stripes at N = 32k, 1.163 ms on 2026-12-01 14:52, 0.992 ms at 16:33 with the in-kernel tile bounds, against
compiled ``create_block_mask`` at 3.1-3.4 ms; the target is 4x). Stage by stage, each followed by a device
sync (host wall ms, median of 25): the tile classification (``_tiles.classify``), the class lists
(``_tiles.class_lists``), the layout's constructor, and the whole build; then ``torch.profiler`` over ten
whole builds: the host ops and device kernels that take the most time. One command on a GPU box (under a
minute):

    python book/data/bench/checks/layout-build-profile.py   # writes $OUT/layout-build-profile-<gpu>.json
"""
import os

import torch
from torch.profiler import ProfilerActivity, profile

from sparseattn import _tiles as T
from sparseattn.bench import _common as C
from sparseattn.bench.record import Impl, Pass, Record
from sparseattn.layout import BlockLayout
from sparseattn.patterns import TileGrid
from sparseattn.roofline.cases import prefill_mask_mod
from sparseattn.roofline.timing import time_host

DEV = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK = 128
PATTERN = "stripes(plain lambda)"


def main(out_dir: str) -> str:
    records, table = [], []
    for N in (8192, 32768):
        mm = prefill_mask_mod(PATTERN, N, DEV)
        grid = TileGrid(0, N, N, BLOCK, BLOCK, 1, 1, torch.device(DEV))
        build = lambda: BlockLayout.from_mask_mod(mm, N, N, BLOCK, BLOCK, device=DEV)  # noqa: E731
        build()
        partial, full = T.classify(mm, grid, listed=None)
        lists = T.class_lists(partial, full)
        (kc, ki), (fc, fi) = lists
        stages = {
            "classify": lambda: T.classify(mm, grid, listed=None),
            "class_lists": lambda: T.class_lists(partial, full),
            "constructor": lambda: BlockLayout(kc, ki, fc, fi, q_len=N, kv_len=N, block_q=BLOCK, block_k=BLOCK,
                                               mask_mod=mm, validate=False, q_offset=0),
            "whole": build,
        }
        row = {"N": N}
        for name, fn in stages.items():
            ms = time_host(fn, repeat=25, device=DEV)
            row[name + "_ms"] = round(ms, 3)
            records.append(Record({"pattern": PATTERN, "N": N, "block": BLOCK, "stage": name}, Impl.OURS,
                                  Pass.LAYOUT, ms, {"timing": "host wall + sync, median of 25"}))
        table.append(row)
        print(row, flush=True)
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if DEV == "cuda" else [])
        with profile(activities=acts) as prof:
            for _ in range(10):
                build()
            torch.cuda.synchronize() if DEV == "cuda" else None
        print(f"--- profile N={N}, 10 builds: host ops by self CPU time")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
        if DEV == "cuda":
            print(f"--- profile N={N}, 10 builds: device kernels")
            print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=10,
                                            max_name_column_width=60))
    path = C.write_json("layout-build-profile", records, out_dir, C.environment())
    C.print_table(table, ["N", *(k for k in table[0] if k != "N")])
    return path


if __name__ == "__main__":
    print(main(os.environ.get("OUT", ".")))
