"""Triton kernels only (``@triton.jit``). Importing this package chooses the backend first (the Triton
interpreter when there is no GPU), so the kernels below are defined for the right one; ops import it lazily,
inside their calls, and ``import sparseattn`` never loads Triton."""
from .. import _runtime

BACKEND = _runtime.select_backend()
