"""A streaming read: every element of a flat tensor loaded once and summed into one float32 partial per
program. It does no other work, so its rate on a tensor is the read bandwidth a kernel that must read
those bytes can reach (the ceiling the decode chapter measures against); ``torch.sum`` reaches less on
the H200 than our own decode does (4.22 vs 4.43 TB/s on the same 1 GiB of cache), so it is not a ceiling."""
import triton
import triton.language as tl


@triton.jit
def stream_read_kernel(X, PARTIAL, n, BLOCK: tl.constexpr):
    """Program ``p`` of ``P`` reads elements ``[i, i + BLOCK)`` for ``i = p * BLOCK, (p + P) * BLOCK, ...``
    (grid-stride: consecutive programs read neighbouring blocks at every step) and stores their sum."""
    pid = tl.program_id(0)
    step = tl.num_programs(0) * BLOCK
    acc = tl.zeros([BLOCK], tl.float32)
    for start in range(pid * BLOCK, n, step):
        offs = start + tl.arange(0, BLOCK)  # [BLOCK]
        acc += tl.load(X + offs, mask=offs < n, other=0.0).to(tl.float32)
    tl.store(PARTIAL + pid, tl.sum(acc, axis=0))
