import os
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def brute_classes(dense: torch.Tensor, bq: int, bk: int):
    """Block classes from a token mask by looping over tiles: the slow, obvious definition."""
    B, H, Lq, Lk = dense.shape
    nq, nk = -(-Lq // bq), -(-Lk // bk)
    partial = torch.zeros(B, H, nq, nk, dtype=torch.bool)
    full = torch.zeros(B, H, nq, nk, dtype=torch.bool)
    for i in range(nq):
        for j in range(nk):
            tile = dense[:, :, i * bq:(i + 1) * bq, j * bk:(j + 1) * bk]
            a = tile.flatten(2).any(-1)
            f = tile.flatten(2).all(-1)
            full[:, :, i, j] = f
            partial[:, :, i, j] = a & ~f
    return partial, full


def dense_of(mask_mod, Lq, Lk, B=1, H=1):
    """Token mask of a mask_mod at absolute query positions (queries are the last Lq positions)."""
    off = max(Lk - Lq, 0)
    b = torch.arange(B).view(B, 1, 1, 1)
    h = torch.arange(H).view(1, H, 1, 1)
    q = (torch.arange(Lq) + off).view(1, 1, Lq, 1)
    k = torch.arange(Lk).view(1, 1, 1, Lk)
    return torch.broadcast_to(mask_mod(b, h, q, k), (B, H, Lq, Lk))


def run_fresh_python(code: str) -> None:
    """Run ``code`` in a new interpreter without TRITON_INTERPRET, as a user's fresh process would start."""
    import subprocess
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    subprocess.run([sys.executable, "-c", code], check=True, env=env)
