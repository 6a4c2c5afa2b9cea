"""Cases of the layer kernels against the torch references they replace on CUDA, on any device: the
per-head q/k/v chains after the qkv projection (DiffusionGemma's norms and RoPE, Ministral-3's RoPE and
query scale: model/kernels/qk_norm_rope.py, which also store k and v into the KV cache rows of the
step's tokens), DiffusionGemma's routing (model/kernels/routing.py) and weighted combine of expert
outputs (model/kernels/expert_combine.py). `run` checks them all; tests/interpreted/
test_interpreted_layer_kernels.py runs it in triton's interpreter, tests/test_layer_kernels.py on CUDA."""
import torch

from model.attention import KVRows
from model.fused import _gemma_qkv, _rotary_qk
from model.kernels import routing
from model.kernels.expert_combine import combine
from model.kernels.invariant import make_tile_map
from model.kernels.qk_norm_rope import qk_rope, qkv_norm_rope
from model.moe import sort_pairs


def rope(b, n, d, gen, dtype):
    pos = torch.randint(0, 4000, (b, n), generator=gen).float()
    freqs = pos[..., None] / (10000 ** (torch.arange(0, d, 2) / d))
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype).unsqueeze(-2), emb.sin().to(dtype).unsqueeze(-2)


def qkv_case(b, n, hq, hkv, d, with_v, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    width = (hq + (2 if with_v else 1) * hkv) * d
    qkv = (torch.randn(b, n, width, generator=gen) * 3).to(dtype)
    q, k, *v = qkv.split([hq * d, hkv * d] + ([hkv * d] if with_v else []), -1)
    q, k = q.view(b, n, hq, d), k.view(b, n, hkv, d)
    v = v[0].view(b, n, hkv, d) if v else k
    wq, wk = (torch.rand(d, generator=gen) + 0.5).to(dtype), (torch.rand(d, generator=gen) + 0.5).to(dtype)
    cos, sin = rope(b, n, d, gen, dtype)
    ref = _gemma_qkv(*(t.float() for t in (q, k, v, wq, wk)), 1e-6, cos.float(), sin.float())
    args = [t.to(device) for t in (q, k, v, wq, wk)] + [1e-6, cos.to(device), sin.to(device)]
    cache = cache_rows(b * n, hkv, d, dtype, gen, device)
    ours = [o.cpu() for o in qkv_norm_rope(*args, cache)]
    check_stored(cache, ours[1], ours[2])
    assert all(torch.equal(a, o.cpu()) for a, o in zip(ours, qkv_norm_rope(*args))), "the same without a cache"
    return ref, ours


def cache_rows(tokens, hkv, d, dtype, gen, device):
    # a layer's cache rows, 3 more than the tokens, each token's row drawn at random
    index = torch.randperm(tokens + 3, generator=gen)[:tokens]
    k, v = (torch.zeros(tokens + 3, hkv, d, dtype=dtype, device=device) for _ in "kv")
    return KVRows(k, v, index.to(device))


def check_stored(cache, k, v):
    hkv, d = k.shape[-2:]
    index, others = cache.index.cpu(), torch.ones(len(cache.k), dtype=torch.bool)
    others[index] = False
    assert torch.equal(cache.k.cpu()[index], k.reshape(-1, hkv, d)), "k rows"
    assert torch.equal(cache.v.cpu()[index], v.reshape(-1, hkv, d)), "v rows"
    assert not cache.k.cpu()[others].any() and not cache.v.cpu()[others].any(), "rows of no token"


def rope_case(b, n, hq, hkv, d, scaled, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    qkv = (torch.randn(b, n + 2, (hq + 2 * hkv) * d, generator=gen) * 3).to(dtype)[:, 2:]  # rows of a longer step
    q, k, v = qkv.split([hq * d, hkv * d, hkv * d], -1)
    q, k, v = q.view(b, n, hq, d), k.view(b, n, hkv, d), v.view(b, n, hkv, d)
    cos, sin = rope(b, n, d, gen, dtype)
    scale = (1 + torch.rand(b, n, 1, 1, generator=gen)).to(dtype) if scaled else None
    ref = _rotary_qk(q.float(), k.float(), cos.float(), sin.float(), None if scale is None else scale.float())
    args = (q.to(device), k.to(device), cos.to(device), sin.to(device), None if scale is None else scale.to(device))
    cache = cache_rows(b * n, hkv, d, dtype, gen, device)
    ours = [o.cpu() for o in qk_rope(*args, v.to(device), cache)]
    check_stored(cache, ours[1], v)
    assert all(torch.equal(a, o.cpu()) for a, o in zip(ours, qk_rope(*args))), "the same without a cache"
    return ref, ours


def combine_case(t, k, e, h, dtype, seed, device):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    weights = torch.rand(t, k, generator=gen)
    pairs = sort_pairs(ids, e)
    y = (torch.randn(t * k, h, generator=gen)).to(dtype)
    grouped = y[pairs.slot].view(t, k, h).float()
    ref = sum((grouped[:, j] * weights[:, j, None] for j in range(1, k)), grouped[:, 0] * weights[:, 0, None])
    ours = combine(y.to(device), pairs.slot.to(device), weights.to(device)).cpu()
    return ref, ours


def routing_case(t, k, e, block_m, seed, device, routed=None):
    # route against softmax/top-k/renorm/scale (on the first `routed` tokens, default all); sort_pairs
    # against the stable argsort (exactly) and the tile map the grouped kernel makes itself
    # (model.kernels.invariant)
    gen = torch.Generator().manual_seed(seed)
    scores = torch.randn(t, e, generator=gen) * 2
    scores = scores[:routed]
    scale = torch.rand(e, generator=gen) + 0.5
    weights, ids = routing.route(scores.to(device), scale.to(device), k)
    probs = torch.softmax(scores, -1)
    top, top_ids = torch.topk(probs, k, -1)
    assert torch.equal(ids.cpu().long(), top_ids)
    expected = top / top.sum(-1, keepdim=True) * scale[top_ids]
    assert torch.allclose(weights.cpu(), expected, rtol=1e-5, atol=1e-7), (weights, expected)
    # skewed routing: some experts empty, one with many pairs (several tiles)
    ids = torch.where(torch.rand(t, k, generator=gen) < 0.4, 3, torch.randint(0, e // 2, (t, k), generator=gen))
    ids = torch.stack([torch.unique(torch.cat([r, torch.randperm(e, generator=gen)]), sorted=False)[:k]
                       if len(set(r.tolist())) < k else r for r in ids])
    ref = sort_pairs(ids, e)
    token, slot, ends, tile_expert, tile_row = routing.sort_pairs(ids.to(device).int(), e, block_m)
    assert torch.equal(token.cpu(), ref.token) and torch.equal(slot.cpu(), ref.slot)
    assert torch.equal(ends.cpu(), ref.ends)
    expert, row = make_tile_map(ref.ends, -(-t * k // block_m) + e, block_m)
    real = expert < e
    assert torch.equal(tile_expert.cpu().long(), expert)
    assert torch.equal(tile_row.cpu().long()[real], row[real])


def run(device, dtypes, routing=True, routed=None):
    """Every case on `device` in each (dtype, tolerance) of `dtypes`, and the routing's if `routing`
    (the route checked on each case's first `routed` tokens, default all)."""
    for dtype, tol in dtypes:
        for (b, n, hq, hkv, d, with_v) in ((1, 5, 4, 2, 32, True), (2, 3, 4, 1, 64, False)):
            ref, ours = qkv_case(b, n, hq, hkv, d, with_v, dtype, seed=d, device=device)
            for r, o, name in zip(ref, ours, "qkv"):
                assert o.dtype == dtype and o.is_contiguous(), name
                err = ((o.float() - r).abs() / (r.abs() + 1)).max().item()
                assert err <= tol, (name, dtype, d, err)
        for (b, n, hq, hkv, d, scaled) in ((1, 5, 4, 2, 32, True), (2, 3, 4, 1, 16, False), (3, 1, 2, 1, 16, True)):
            ref, ours = rope_case(b, n, hq, hkv, d, scaled, dtype, seed=d, device=device)
            for r, o, name in zip(ref, ours, "qk"):
                assert o.dtype == dtype and o.is_contiguous(), name
                err = ((o.float() - r).abs() / (r.abs() + 1)).max().item()
                assert err <= tol, ("rope " + name, dtype, d, err)
        for (t, k, e, h) in ((7, 3, 5, 40), (4, 8, 16, 1100)):
            ref, ours = combine_case(t, k, e, h, dtype, seed=h, device=device)
            assert ours.dtype == dtype
            err = ((ours.float() - ref).abs() / (ref.abs() + 1)).max().item()
            assert err <= tol, ("combine", dtype, h, err)
    # 1 and 2 SUBs a chunk; (3, 8, 128, 64): more programs than chunks (those write only the tile map)
    for (t, k, e, block_m) in ((5, 2, 8, 4), (3, 8, 128, 64), (300, 8, 128, 64), (1100, 8, 128, 64)) if routing else ():
        routing_case(t, k, e, block_m, seed=t, device=device, routed=routed)
