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


def _bf16_cache(B, L, page_size, Hkv=8, D=128, max_pages=None):
    n_pages = -(-L // page_size)
    max_pages = max_pages or n_pages
    cache = sa.PagedKVCache(B * max_pages, page_size, Hkv, D, dtype=torch.bfloat16, device="cuda", max_seqs=B,
                            max_pages_per_seq=max_pages)
    for b in range(B):
        cache.append(b, torch.randn(L - 5 * b, Hkv, D, device="cuda", dtype=torch.bfloat16),
                     torch.randn(L - 5 * b, Hkv, D, device="cuda", dtype=torch.bfloat16))
    return cache


@pytest.mark.parametrize("chunked", [False, True])
def test_bf16_select_pages_is_the_top_k_of_its_bound(chunked, monkeypatch):
    from sparseattn import reference, routing
    if chunked:
        monkeypatch.setattr(routing, "_TOPK_BLOCK", 512)
    torch.manual_seed(1)
    B, L, ps, topk = 3, 40000, 16, 300
    cache = _bf16_cache(B, L, ps)
    q = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)
    bound = routing.page_bounds(q, cache)
    ref = reference.page_bounds_reference(q, cache)
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isfinite(bound), fin)
    torch.testing.assert_close(bound[fin], ref[fin], atol=2e-2, rtol=1e-3)
    sel = sa.select_pages(q, cache, topk)
    sel.validate(cache)
    for b in range(B):
        n = -(-(L - 5 * b) // ps)
        for h in range(8):
            c = int(sel.count[b, h])
            assert c == topk
            chosen = sel.index[b, h, :c].long()
            assert chosen[0] == 0 and chosen[-1] == n - 1
            mask = torch.zeros(n, dtype=torch.bool, device="cuda")
            mask[chosen] = True
            mask[0] = mask[n - 1] = False  # forced pages
            rest = torch.ones(n, dtype=torch.bool, device="cuda")
            rest[chosen] = False
            assert bound[b, h, :n][mask].min() >= bound[b, h, :n][rest].max()


def test_cuda_graph_serves_every_decode_step():
    """Capture select + decode once; append tokens (new pages too) and replay: equal to eager every step."""
    torch.manual_seed(2)
    B, ps, topk = 4, 16, 24
    cache = _bf16_cache(B, 1000, ps, max_pages=128)
    q_static = torch.randn(B, 32, 128, device="cuda", dtype=torch.bfloat16)

    def step():
        sel = sa.select_pages(q_static, cache, topk)
        return sa.sparse_decode(q_static, cache, pages=sel, return_lse=True), sel

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        (o_g, lse_g), sel_g = step()
    for t in range(40):  # 40 tokens: every sequence crosses at least two page boundaries
        for b in range(B):
            kv = torch.randn(1, 8, 128, device="cuda", dtype=torch.bfloat16)
            cache.append(b, kv, -kv)
        q_static.copy_(torch.randn_like(q_static))
        graph.replay()
        (o_e, lse_e), sel_e = step()
        assert torch.equal(sel_g.count, sel_e.count) and torch.equal(sel_g.index, sel_e.index)
        assert torch.equal(o_g, o_e) and torch.equal(lse_g, lse_e)
    # and the last step against the fp64 reference over the selected pages
    for b in range(B):
        k, v = cache.gather_dense(b)
        page_of = torch.arange(k.shape[1], device="cuda") // ps
        mask = torch.stack([torch.isin(page_of, sel_g.index[b, h, :sel_g.count[b, h]].long())
                            for h in range(8)])[None, :, None, :]
        ref = sa.reference_attention(q_static[b][None, :, None], k[None], v[None], mask=mask)[0, :, 0]
        assert ((o_g[b].double() - ref).norm() / ref.norm()).item() < 2e-2
