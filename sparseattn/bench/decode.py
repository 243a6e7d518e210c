"""Suite ``decode``: decode over the paged cache, dense and with Quest page selection, against SDPA's cuDNN
and FA2 dense decode and FlexAttention decode on contiguous K/V holding the same keys and values; the
selection kernels against their eager reference; the whole selected step eager and in one CUDA graph; and
a streaming read of the cache's bytes (the bandwidth ceiling of any decode that reads them all).
``--sweep`` also times the decode tile/split configs on the page-size-16 cases."""
from __future__ import annotations

from typing import Iterator, List

import torch

from ..ops import DecodeConfig, sparse_decode
from ..reference import select_pages_reference
from ..routing import page_bounds, select_pages
from . import _common as C
from .cases import decode_setup
from .record import Impl, Pass, Record

NAME = "decode"
DEFAULT_N = ""  # the cases below; --n keeps the cases of these lengths
CONFIG_KIND = "decode"
COLUMNS = ["case", "ours", "TB_s", "read_TB_s", "select", "step", "graph", "cudnn_dense", "fa2_dense", "flex",
           "flex_err", "sweep_best", "best_cfg"]
HQ, HKV, D, DTYPE = 32, 8, 128, torch.bfloat16
#: (batch, tokens per sequence, page size, fraction of pages kept or None for dense)
CASES = [(8, 131072, 16, None), (8, 131072, 16, 0.13), (8, 131072, 64, 0.13), (8, 131072, 128, 0.13),
         (32, 32768, 16, 0.16), (1, 131072, 16, None), (8, 131072, 64, None)]


def sweep_configs() -> Iterator[DecodeConfig]:
    """The decode configs ``--sweep`` times: tile, warps, stages, split target, head order."""
    for block_n in (64, 128):
        for warps in (4, 8):
            for stages in (2, 3):
                for pps in (4, 8, 16, 32):
                    for head_fastest in (False, True):
                        yield DecodeConfig(block_n=block_n, num_warps=warps, num_stages=stages,
                                           programs_per_sm=pps, head_fastest=head_fastest)


def flex_decode_mask(block_keep: torch.Tensor, Hq: int, Hkv: int):
    """A FlexAttention BlockMask for one query per row from kept 128-token blocks ``[B, Hkv, nb]`` (bool)."""
    from torch.nn.attention.flex_attention import BlockMask
    keep = block_keep.repeat_interleave(Hq // Hkv, dim=1)  # [B, Hq, nb]: the group shares the blocks
    count = keep.sum(-1, dtype=torch.int32)[..., None]  # [B, Hq, 1]
    order = torch.argsort((~keep).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # kept blocks first
    order = order[:, :, None, :].contiguous()  # [B, Hq, 1, nb]
    # every kept block is full (no mask_mod call inside it); no partial blocks
    return BlockMask.from_kv_blocks(torch.zeros_like(count), order, count, order, BLOCK_SIZE=128,
                                    seq_lengths=(1, keep.shape[-1] * 128))


def run(args) -> tuple:
    """Measure every case; return (records, table rows, table columns)."""
    cases = CASES
    if args.n:
        cases = [c for c in cases if c[1] in {int(x) for x in args.n.split(",")}]
    records, table = [], []
    with C.progress(len(cases), NAME) as bar:
        for B, L, ps, keep in cases:
            bar.set_postfix_str(f"B={B} L={L} ps={ps} keep={keep}")
            table.append(_case(args, B, L, ps, keep, records))
            bar.update()
            C.empty_cache()
    return records, table, COLUMNS


def _case(args, B, L, ps, keep, records) -> dict:
    dev = args.device
    n_pages_seq = L // ps
    kd, vd, cache, q = decode_setup(B, L, ps, HQ, HKV, D, DTYPE, device=dev)
    q4 = q.view(B, HQ, 1, D)
    case = {"pattern": "dense" if keep is None else f"keep{keep:.2f}", "N": L, "B": B, "Hq": HQ, "Hkv": HKV,
            "D": D, "dtype": "bf16", "page_size": ps}
    full_bytes = 2 * B * HKV * L * D * 2
    row = {"case": f"B={B} L={L // 1024}k ps={ps} " + case["pattern"]}

    def record(impl, pass_, ms, nbytes=None, **extra):
        if nbytes is not None and ms:
            extra.update(bytes=nbytes, tbps=nbytes / ms / 1e9)
        records.append(Record(case, impl, pass_, ms, extra))

    # SDPA dense decode on contiguous KV (same bytes as the full cache)
    for impl in (Impl.CUDNN, Impl.FA2):
        try:
            ms_b = C.time_gpu(C.sdpa_fn(q4, kd, vd, impl, enable_gqa=True))
        except RuntimeError as e:
            record(impl, Pass.DECODE_DENSE, None, error=str(e)[:200])
            continue
        record(impl, Pass.DECODE_DENSE, ms_b, full_bytes)
        row[f"{impl}_dense"] = round(ms_b, 4)
    # the ceiling: one streaming read of the cache's K and V pages (the bytes a dense decode reads)
    ms_read, how = C.best_read((cache.k_pages, cache.v_pages), C.time_gpu)
    record(Impl.READ_CEILING, Pass.READ, ms_read, full_bytes, method=how)
    row["read_TB_s"] = round(full_bytes / ms_read / 1e9, 2)
    ref_dense = torch.nn.functional.scaled_dot_product_attention(q4, kd, vd, enable_gqa=True)[:, :, 0]
    if keep is None:
        ms = C.time_gpu(lambda: sparse_decode(q, cache))
        err = C.rel_err(sparse_decode(q, cache), ref_dense)  # same keys and values, paged vs contiguous
        record(Impl.OURS, Pass.DECODE, ms, full_bytes, rel_err_vs_sdpa=err)
        row.update(ours=round(ms, 4), TB_s=round(full_bytes / ms / 1e9, 2))
        if not args.no_flex:
            ms_f = C.time_gpu(C.flex_fn(q4, kd, vd, None, enable_gqa=True))
            record(Impl.FLEX, Pass.DECODE_DENSE, ms_f, full_bytes)
            row["flex"] = round(ms_f, 4)
        sel = None
    else:
        topk = max(1, round(keep * n_pages_seq))
        sel = select_pages(q, cache, topk)
        sel_bytes = int(sel.count.sum()) * ps * D * 2 * 2
        ms = C.time_gpu(lambda: sparse_decode(q, cache, pages=sel))
        ms_sel = C.time_gpu(lambda: select_pages(q, cache, topk))
        ms_sel_eager = C.time_gpu(lambda: select_pages_reference(q, cache, topk))
        ms_step = C.time_gpu(lambda: sparse_decode(q, cache, pages=select_pages(q, cache, topk)))
        # the same step captured once in a CUDA graph (fixed capacity: one graph for every step)
        graph_out = []
        graph = C.graph_step(lambda: graph_out.append(sparse_decode(q, cache, pages=select_pages(q, cache, topk))))
        o_graph = graph_out[-1]  # the captured call's output buffer, rewritten by every replay
        ms_graph = C.time_gpu(graph.replay)
        record(Impl.OURS, Pass.DECODE, ms, sel_bytes, keep_fraction=sel_bytes / full_bytes)
        record(Impl.OURS, Pass.SELECT, ms_sel)
        record(Impl.TORCH_EAGER, Pass.SELECT, ms_sel_eager)
        record(Impl.OURS, Pass.SELECT_DECODE, ms_step)
        record(Impl.OURS, Pass.SELECT_DECODE_GRAPH, ms_graph,
               graph_equals_eager=bool(torch.equal(o_graph, sparse_decode(q, cache, pages=sel))))
        row.update(ours=round(ms, 4), TB_s=round(sel_bytes / ms / 1e9, 2), select=round(ms_sel, 4),
                   step=round(ms_step, 4), graph=round(ms_graph, 4))
        if not args.no_flex:
            _flex_selected(q, q4, kd, vd, cache, sel, keep, L, ps, dev, record, row)
    if args.sweep and ps == 16:  # the tile configs, on the page size of the targets
        _sweep(q, cache, sel, case, records, row)
    return row


def _flex_selected(q, q4, kd, vd, cache, sel, keep, L, ps, dev, record, row) -> None:
    """FlexAttention keeps the same fraction of 128-token blocks: the blocks with the best Quest bound (max of
    their pages' bounds), first and last forced. With ps=128 these are exactly our pages, and the outputs
    are compared."""
    B = q.shape[0]
    nb = L // 128
    block_keep = torch.zeros(B, HKV, nb, dtype=torch.bool, device=dev)
    if ps == 128:
        valid = torch.arange(sel.capacity, device=dev) < sel.count[..., None]
        block_keep.scatter_(2, sel.index.long(), valid)
    else:
        bb = page_bounds(q, cache).view(B, HKV, nb, 128 // ps).amax(-1)  # [B, Hkv, nb]
        bb[..., 0] = bb[..., -1] = float("inf")
        block_keep.scatter_(2, bb.topk(max(1, round(keep * nb)), dim=-1).indices, True)
    bm = flex_decode_mask(block_keep, HQ, HKV)
    flex_bytes = int(block_keep.sum()) * 128 * D * 2 * 2
    fn = C.flex_fn(q4, kd, vd, bm, enable_gqa=True)
    ms_f = C.time_gpu(fn)
    extra = {}
    if ps == 128:  # the same pages: the outputs must agree
        extra["rel_err_vs_ours"] = C.rel_err(fn()[:, :, 0], sparse_decode(q, cache, pages=sel))
        row["flex_err"] = f"{extra['rel_err_vs_ours']:.1e}"
    record(Impl.FLEX, Pass.DECODE_BLOCK_MASK, ms_f, flex_bytes, **extra)
    row["flex"] = round(ms_f, 4)


def _sweep(q, cache, sel, case, records, row) -> None:
    times = {}
    for cfg in sweep_configs():
        fn = (lambda cfg=cfg: sparse_decode(q, cache, config=cfg)) if sel is None else \
            (lambda cfg=cfg: sparse_decode(q, cache, pages=sel, config=cfg))
        try:
            times[cfg] = C.time_gpu(fn, warmup_ms=10, rep_ms=40)
        except Exception as e:  # a config the GPU cannot compile is recorded, not fatal
            records.append(Record(case, Impl.OURS, Pass.SWEEP, None, {"config": C.config_dict(cfg),
                                                                      "error": str(e)[:120]}))
            continue
        records.append(Record(case, Impl.OURS, Pass.SWEEP, times[cfg], {"config": C.config_dict(cfg)}))
    if times:
        best = min(times, key=times.get)
        row["sweep_best"] = round(times[best], 4)
        row["best_cfg"] = f"{best.block_n}/{best.num_warps}w/{best.num_stages}s/{best.programs_per_sm}pps" \
                          f"{'/hf' if best.head_fastest else ''}"


def sweep_rows(records: List[Record]) -> List[Record]:
    """The rows of the config sweep (each with its ``config``)."""
    return [r for r in records if r.pass_ == Pass.SWEEP]
