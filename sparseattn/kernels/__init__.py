"""Triton kernels only (``@triton.jit``). Import them through :func:`sparseattn._runtime.load_kernels`,
which selects the interpreter first when there is no GPU."""
