import torch, time, json, os, sparseattn as sa
from dataclasses import replace
from sparseattn.ops.backward import bwd_config
from sparseattn.bench import _common as C
from sparseattn.bench.host import host_us, kernel_launches
from torch.profiler import profile, ProfilerActivity
out = []
for pat, N in (("window1024", 2048), ("window1024", 4096), ("causal", 2048), ("window1024", 1024)):
    mm = sa.patterns.sliding_window(1024) if pat == "window1024" else sa.patterns.causal()
    lay = sa.BlockLayout.from_mask_mod(mm, N, N, 128, 128, device="cuda")
    q, k, v, do = (torch.randn(1, 16, N, 128, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    base = bwd_config(q, lay)
    for name, cfg in (("default", base), ("nosplit", replace(base, chunk=1 << 30)),
                      ("nooverlap", replace(base, overlap=False))):
        make = lambda a, b, c, cfg=cfg: sa.sparse_attention(a, b, c, lay, bwd_config=cfg)
        side = torch.cuda.Stream()
        fwd, bwd = C.fwd_bwd(make, q, k, v, do, side)
        dev = C.graph_ms(bwd, side)
        _, bwd2 = C.fwd_bwd(make, q, k, v, do)
        ms = C.time_gpu(bwd2)
        h = host_us(bwd2, "cuda")
        bwd2(); torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            bwd2(); torch.cuda.synchronize()
        names = [e.name[:40] for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        row = dict(pattern=pat, N=N, cfg=name, device_ms=dev, ms=ms, host_us=h, kernels=names)
        out.append(row); print(row, flush=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "bwdhost.json"), "w"), indent=1)
