"""Does Triton 3.6's Hopper warp specialisation run correctly on this GPU? Each step in its own process with a
time limit. Triton 3.6 partitions a ``tl.range(..., warp_specialize=True)`` loop on sm_90 only in a kernel
launched with 4 warps (it then runs 12: a producer warp group and two consumers), and its pass aborts on a
kernel with two such loops, so commit 0469c1b gave the forward one loop over partial and full tiles; on the
H200 (2026-12-01, 19:38 UTC, log ``ws-probe-h200.log``) that forward never returned, on a one-head causal
layout at N = 1024 as on 16 heads at 8k (60 s limit each; reverted in the next commit). This script keeps
the minimal kernels that tell the toolchain from our code: step 0, an attention-like loop over consecutive
tiles (TMA loads, two dots, online softmax) without the flag, 4 warps, checked against softmax in float32;
step 1, the same loop warp-specialised; step 2, specialised with the key tile read from an index list.

    python book/data/bench/checks/ws-probe.py [seconds per step]   # one line per step: ok / FAIL / TIMEOUT
"""
import os
import subprocess
import sys
import tempfile
import time

STEP = r'''
import sys, time, torch, triton, triton.language as tl
step = int(sys.argv[1])
triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))

@triton.jit
def k(a_ptr, b_ptr, v_ptr, c_ptr, INDEX, N, scale, BM: tl.constexpr, BN: tl.constexpr, D: tl.constexpr,
      INDIRECT: tl.constexpr, WS: tl.constexpr):
    pid = tl.program_id(0)
    da = tl.make_tensor_descriptor(a_ptr, shape=[N, D], strides=[D, 1], block_shape=[BM, D])
    dk = tl.make_tensor_descriptor(b_ptr, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
    dv = tl.make_tensor_descriptor(v_ptr, shape=[N, D], strides=[D, 1], block_shape=[BN, D])
    q = da.load([pid * BM, 0])
    acc = tl.zeros([BM, D], tl.float32)
    m_i = tl.full([BM], float("-inf"), tl.float32)
    l_i = tl.zeros([BM], tl.float32)
    for it in tl.range(0, N // BN, warp_specialize=WS):
        kb = it
        if INDIRECT:
            kb = tl.load(INDEX + it)
        kt = dk.load([kb * BN, 0])
        vt = dv.load([kb * BN, 0])
        s = tl.dot(q, kt.T) * scale
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(vt.dtype), vt, acc * alpha[:, None])
        m_i = m_new
    offs = pid * BM + tl.arange(0, BM)
    tl.store(c_ptr + offs[:, None] * D + tl.arange(0, D)[None, :], (acc / l_i[:, None]).to(tl.bfloat16))

N, D = 2048, 128
q, kk, v = (torch.randn(N, D, device="cuda", dtype=torch.bfloat16) for _ in range(3))
o = torch.empty_like(q)
idx = torch.arange(N // 128, device="cuda", dtype=torch.int32)
c = k[(N // 128,)](q, kk, v, o, idx, N, 1.4427 / D ** 0.5, BM=128, BN=128, D=D, INDIRECT=step == 2, WS=step > 0,
                   num_warps=4, num_stages=2)
torch.cuda.synchronize()
ref = torch.softmax((q.float() @ kk.float().T) / D ** 0.5, -1) @ v.float()
print("warps", c.metadata.num_warps, "err", float((o.float() - ref).abs().max()))
'''

if __name__ == "__main__":
    limit = float(sys.argv[1]) if len(sys.argv) > 1 else 60
    script = os.path.join(tempfile.mkdtemp(), "ws_step.py")  # Triton reads a jit function's source from its file
    with open(script, "w") as f:
        f.write(STEP)
    for step in (0, 1, 2):
        t = time.time()
        try:
            r = subprocess.run([sys.executable, script, str(step)], capture_output=True, text=True, timeout=limit)
            tail = (r.stdout.strip().splitlines() or [""])[-1] if r.returncode == 0 else \
                (r.stderr.strip().splitlines() or ["?"])[-1][:300]
            print(f"step {step}: {'ok' if r.returncode == 0 else 'FAIL'} {time.time() - t:.1f}s {tail}", flush=True)
        except subprocess.TimeoutExpired:
            print(f"step {step}: TIMEOUT after {limit:.0f}s", flush=True)
