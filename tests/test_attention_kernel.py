"""model.kernels.attention on CUDA against cached_attention's SDPA path, at serving shapes. The same
kernel under triton's CPU interpreter, against SDPA on random and hand-picked steps, is
tests/interpreted/test_interpreted_attention.py's (run by tests/test_interpreted_kernels.py)."""
from __future__ import annotations

import pytest
import torch


def _gpu_step(kv, B, width, starts_from, window, gen):
    import random

    rng = random.Random(gen.initial_seed())
    slots = rng.sample(range(kv.num_slots), B)
    causal = [rng.random() < 0.5 for _ in range(B)]
    starts = [rng.randint(starts_from, kv.max_len - width) for _ in range(B)]
    lengths = [rng.randint(1, width) if c else width for c in causal]
    from model.attention import StepContext

    return StepContext.build(kv, slots, starts, lengths, causal, width, "cuda", window=window)


@pytest.mark.gpu
@pytest.mark.parametrize("hq,hkv,D,sliding,shuffled", [(32, 8, 128, False, False), (16, 8, 256, True, False),
                                                        (16, 8, 256, True, True), (16, 2, 512, False, True)])
@pytest.mark.parametrize("B", [1, 16])
@pytest.mark.parametrize("invariant", [False, True])
def test_cuda_kernel_equals_sdpa(hq, hkv, D, sliding, shuffled, B, invariant):
    """On CUDA in bf16 at serving shapes (B x 32 queries over up to ~1100 keys: batch 1 splits its keys,
    batch 16 does not; batch-invariant mode's fixed tiles), pages in order or shuffled, cached_attention's
    kernel against its SDPA path, on every query within its row's length."""
    from model import batch_invariant
    from model.attention import PagedKVCache, cached_attention, step_context, triton_attention

    gen = torch.Generator().manual_seed(D + hkv + shuffled + B)
    W = 512
    kv = PagedKVCache.per_slot([(hkv, D)], 16, 1088, torch.bfloat16, "cuda", sliding=[sliding], window=W)
    kv.k[0].copy_(torch.randn(kv.k[0].shape, generator=gen))
    kv.v[0].copy_(torch.randn(kv.v[0].shape, generator=gen))
    if shuffled:
        n = kv.num_slots * kv.max_pages
        kv.write_pages(0, torch.arange(n, device="cuda"), torch.randperm(n, generator=gen).cuda())
    ctx = _gpu_step(kv, B, 32, 0, W, gen)
    q = (torch.randn(B, 32, hq, D, generator=gen) * 2).to(torch.bfloat16).cuda()
    k, v = (torch.randn(B, 32, hkv, D, generator=gen).to(torch.bfloat16).cuda() for _ in range(2))
    with step_context(ctx), torch.no_grad(), batch_invariant.batch_invariant(invariant):
        with triton_attention(False):
            expected = cached_attention(q, k, v, 0, D ** -0.5, sliding=sliding)
        with triton_attention(True):
            got = cached_attention(q, k, v, 0, D ** -0.5, sliding=sliding)
    vmax = max(kv.v[0].abs().max().item(), v.abs().max().item())
    # a causal row's queries past its length are padding, whose outputs nothing reads: the kernel lets them
    # see every earlier key, the SDPA path only its gathered window's
    real = torch.arange(32, device="cuda")[None, :] < ctx.lengths[:, None]
    assert ((got.float() - expected.float()).abs() * real[:, :, None, None]).max().item() <= 2 ** -7 * vmax
