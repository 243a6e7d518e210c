"""Suite ``decode_keep``: decode time and effective bandwidth against the fraction of pages kept, per
batch; the whole step (select + decode, one CUDA graph) against dense decode through the cache and cuDNN
on contiguous K/V."""
from __future__ import annotations

import torch

from ..ops import sparse_decode
from ..routing import select_pages
from . import _common as C
from .cases import decode_setup
from .record import Impl, Pass, Record

NAME = "decode_keep"
DEFAULT_N = ""  # the shapes below
CONFIG_KIND = None  # no config sweep
COLUMNS = ["B", "L", "keep", "eager_ms", "graph_ms", "TB_s", "step_graph_ms", "dense_ms", "cudnn_ms"]
HQ, HKV, D, DTYPE, PAGE_SIZE = 32, 8, 128, torch.bfloat16, 16
KEEPS = [0.01, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0]
#: (batch, tokens per sequence)
SHAPES = [(1, 131072), (8, 131072), (32, 32768)]


def run(args) -> tuple:
    """Measure every (shape, kept fraction); return (records, table rows, table columns)."""
    dev, ps = args.device, PAGE_SIZE
    records, table = [], []
    with C.progress(len(SHAPES) * len(KEEPS), NAME) as bar:
        for B, L in SHAPES:
            n_pages_seq = L // ps
            kd, vd, cache, q = decode_setup(B, L, ps, HQ, HKV, D, DTYPE, device=dev)
            full_bytes = 2 * B * HKV * L * D * 2
            base = {"N": L, "B": B, "Hq": HQ, "Hkv": HKV, "D": D, "dtype": "bf16", "page_size": ps}
            bar.set_postfix_str(f"B={B} L={L} dense")
            ms_dense = C.time_gpu(C.graph_step(lambda: sparse_decode(q, cache)).replay)
            with C.sdpa_backend(Impl.CUDNN):
                q4 = q.view(B, HQ, 1, D)
                ms_cudnn = C.time_gpu(lambda: torch.nn.functional.scaled_dot_product_attention(q4, kd, vd,
                                                                                               enable_gqa=True))
            dense_case = {**base, "pattern": "dense"}
            records.append(Record(dense_case, Impl.OURS, Pass.DECODE_GRAPH, ms_dense,
                                  {"bytes": full_bytes, "tbps": full_bytes / ms_dense / 1e9}))
            records.append(Record(dense_case, Impl.CUDNN, Pass.DECODE_DENSE, ms_cudnn,
                                  {"bytes": full_bytes, "tbps": full_bytes / ms_cudnn / 1e9}))
            for keep in KEEPS:
                bar.set_postfix_str(f"B={B} L={L} keep={keep}")
                topk = max(1, round(keep * n_pages_seq))
                sel = select_pages(q, cache, topk)
                sel_bytes = int(sel.count.sum()) * ps * D * 2 * 2
                ms = C.time_gpu(lambda: sparse_decode(q, cache, pages=sel))  # eager: includes host launch time
                ms_graph = C.time_gpu(C.graph_step(lambda: sparse_decode(q, cache, pages=sel)).replay)
                graph = C.graph_step(lambda: sparse_decode(q, cache, pages=select_pages(q, cache, topk)))
                ms_step = C.time_gpu(graph.replay)
                case = {**base, "pattern": f"keep{keep:.2f}", "keep": keep}
                records.append(Record(case, Impl.OURS, Pass.DECODE, ms,
                                      {"bytes": sel_bytes, "tbps": sel_bytes / ms / 1e9,
                                       "keep_fraction": sel_bytes / full_bytes}))
                records.append(Record(case, Impl.OURS, Pass.DECODE_GRAPH, ms_graph,
                                      {"bytes": sel_bytes, "tbps": sel_bytes / ms_graph / 1e9,
                                       "keep_fraction": sel_bytes / full_bytes}))
                records.append(Record(case, Impl.OURS, Pass.SELECT_DECODE_GRAPH, ms_step))
                table.append({"B": B, "L": L, "keep": keep, "eager_ms": round(ms, 4), "graph_ms": round(ms_graph, 4),
                              "TB_s": round(sel_bytes / ms_graph / 1e9, 2), "step_graph_ms": round(ms_step, 4),
                              "dense_ms": round(ms_dense, 4), "cudnn_ms": round(ms_cudnn, 4)})
                bar.update()
            del cache, kd, vd
            C.empty_cache()
    return records, table, COLUMNS
