"""GPU decode checks: bf16 at real sizes against the fp64 reference, dense and selected."""
import pytest
import torch

import sparseattn as sa

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.parametrize("page_size", [16, 64])
def test_bf16_decode_dense_and_selected(page_size):
    torch.manual_seed(0)
    B, Hq, Hkv, D, L = 4, 32, 8, 128, 5000
    cache = sa.PagedKVCache(B * (-(-L // page_size)), page_size, Hkv, D, dtype=torch.bfloat16, device="cuda",
                            max_seqs=B, max_pages_per_seq=-(-L // page_size))
    for b in range(B):
        n = L - 7 * b
        cache.append(b, torch.randn(n, Hkv, D, device="cuda", dtype=torch.bfloat16),
                     torch.randn(n, Hkv, D, device="cuda", dtype=torch.bfloat16))
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    sel = sa.select_pages(q, cache, topk=20)
    for pages in (None, sel):
        o = sa.sparse_decode(q, cache, pages=pages)
        for b in range(B):
            k, v = cache.gather_dense(b)
            mask = None
            if pages is not None:
                page_of = torch.arange(k.shape[1], device="cuda") // page_size
                mask = torch.stack([torch.isin(page_of, pages.index[b, h, :pages.count[b, h]].long())
                                    for h in range(Hkv)])[None, :, None, :]
            ref = sa.reference_attention(q[b][None, :, None], k[None], v[None], mask=mask)[0, :, 0]
            rel = ((o[b].double() - ref).norm() / ref.norm()).item()
            assert rel < 2e-2, rel
