"""Every kernel variant compiles for Hopper (sm_90) with the real Triton compiler, on a machine with no GPU:
the interpreter that runs the other CPU tests skips the compiler's checks (see tests/tools/compile_sm90.py)."""
import os
import re
import subprocess
import sys

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "tools", "compile_sm90.py")


def test_every_kernel_variant_compiles_for_sm90():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, SCRIPT], capture_output=True, text=True, env=env, timeout=600)
    assert res.returncode == 0, res.stdout[-6000:] + res.stderr[-3000:]
    assert res.stdout.count("\nok") + res.stdout.startswith("ok") >= 20, res.stdout


def test_ptxas_reports_registers_and_spills():
    """``--ptxas``: a variant's line carries its registers per thread and spill bytes from Triton's ptxas."""
    code = ("import re, sys; sys.path.insert(0, sys.argv[1]); import compile_sm90 as T; T.PTXAS_INFO = True; "
            "line = T.compile_variant(T.prefill_bwd.delta_kernel, dict(O=T.BF16, DO=T.BF16, DELTA=T.F32), (), "
            "dict(HEAD_DIM=64, BLOCK_M=64)); print(line)")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    res = subprocess.run([sys.executable, "-c", code, os.path.dirname(SCRIPT)], capture_output=True, text=True,
                         env=env, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    line = res.stdout.strip().splitlines()[-1]
    m = re.search(r"regs=(\d+) spill_stores=(\d+) spill_loads=(\d+)$", line)
    assert line.startswith("ok") and m and 0 < int(m.group(1)) <= 255, line
