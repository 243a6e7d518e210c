"""Replay recorded launches through the cached launch path (sparseattn/_fast_launch.py) with the kernels
defined as compiled JIT functions, on a machine without a GPU, and check the argument list it hands to the
compiled kernel's launcher: one value per kernel parameter, in parameter order, the caller's values where the
caller gave them (static or per call) and the ``@triton.heuristics`` flags Triton would compute elsewhere.

The compiled kernel is a stand-in that records its ``run`` arguments (nothing is compiled or launched); the
first call of a key binds (through ``slow()``), the second must hit the cache. Usage (a fresh process):
``python tests/tools/fast_launch_replay.py CAPTURES.pt`` prints one line per launch, exits 1 on a mismatch.
"""
import os
import sys

os.environ.pop("TRITON_INTERPRET", None)
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from triton.runtime.autotuner import Heuristics  # noqa: E402

import sparseattn._runtime as runtime  # noqa: E402

runtime._BACKEND = "cuda"  # define the kernels as compiled JIT functions, not interpreted ones
from sparseattn.kernels import decode, merge, prefill_bwd, prefill_fwd  # noqa: E402
from sparseattn import _fast_launch as F  # noqa: E402

torch.cuda.current_device = lambda: 0  # no GPU here: the cache asks for the device and its stream
torch._C._cuda_getCurrentRawStream = lambda device: 0


class StandIn:
    """What the cache needs of a CompiledKernel: its handles and a ``run`` that records the launch."""
    packed_metadata, function = "packed", "function"

    def __init__(self):
        self.calls = []

    def run(self, *args):
        self.calls.append(args)


def main(path: str) -> int:
    kernels = {}
    for mod in (decode, merge, prefill_bwd, prefill_fwd):
        for name in dir(mod):
            if name.endswith("_kernel"):
                kernels[name] = getattr(mod, name)
    failures = 0
    for name, grid, num_stages, static, per_call in torch.load(path, weights_only=False):
        kernel = kernels[name]
        st = F.Static(static) if static is not None else None
        kw = {**per_call, "num_stages": num_stages}
        compiled = StandIn()
        F.launch(kernel, grid, st, dict(kw), lambda kw: compiled)  # binds

        def must_not_bind(kw):
            raise AssertionError("the second launch of the same key went through Triton's binding")
        F.launch(kernel, grid, st, dict(kw), must_not_bind)  # hits
        got = compiled.calls[-1]
        jit = kernel.fn if isinstance(kernel, Heuristics) else kernel
        given = F.materialised({**(static or {}), **kw})  # a Desc stands for the descriptor Triton gets
        grid3 = tuple(grid) + (1,) * (3 - len(grid))
        problems = []
        if got[:4] != (*grid3, 0):
            problems.append(f"grid/stream {got[:4]} != {(*grid3, 0)}")
        args = got[9:]
        if len(args) != len(jit.arg_names):
            problems.append(f"{len(args)} arguments for {len(jit.arg_names)} parameters")
        heuristics = kernel.values if isinstance(kernel, Heuristics) else {}
        for param, value in zip(jit.arg_names, args):
            if param in given:
                want = given[param]
            elif param in heuristics:
                want = heuristics[param](dict(given))
            else:
                problems.append(f"{param} is neither given nor a heuristic")
                continue
            if value is not want and value != want:
                problems.append(f"{param}: {value!r} != {want!r}")
        print(("FAIL  " if problems else "ok    ") + name + ("" if not problems else ": " + "; ".join(problems)))
        failures += bool(problems)
    print(f"cache: {F.stats}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
