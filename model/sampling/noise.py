"""Counter-based random numbers: every value is a hash of (request seed, draw counter, stream,
position, global vocabulary id).

Because nothing is drawn from a shared generator, a request's randomness never depends on its batch
neighbours, and because the vocabulary id is part of the key, a rank holding ids [v0, v1) draws
exactly the numbers that a single rank holding the whole vocabulary draws for those ids: TP=N
samples the same tokens as TP=1. Every rank computes the same values with no communication.
"""
from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
STREAM_GUMBEL = 1
STREAM_RENOISE = 2


def _fmix32(h: torch.Tensor) -> torch.Tensor:
    """murmur3's finaliser on 32-bit values held in int64 (products wrap; the mask keeps 32 bits)."""
    h = h ^ (h >> 16)
    h = (h * 0x85EBCA6B) & _M32
    h = h ^ (h >> 13)
    h = (h * 0xC2B2AE35) & _M32
    return h ^ (h >> 16)


def _row_keys(seed: torch.Tensor, counter: torch.Tensor, stream: int) -> torch.Tensor:
    k = _fmix32((seed & _M32) ^ ((stream * 0x9E3779B9) & _M32))
    k = _fmix32(k ^ ((seed >> 32) & _M32))
    return _fmix32(k ^ (counter & _M32))


def uniform(seed: torch.Tensor, counter: torch.Tensor, stream: int, positions: int, vocab_start: int,
            vocab_width: int) -> torch.Tensor:
    """[R, positions, vocab_width] float32 in (0, 1) with 23 random bits, for R rows of (seed, counter).
    (23, not 24: (2^24 - 1) + 0.5 rounds to 2^24 in float32, which would give u = 1 and G = inf.)"""
    dev = seed.device
    pos = torch.arange(positions, device=dev, dtype=torch.int64)
    ids = _fmix32(torch.arange(vocab_start, vocab_start + vocab_width, device=dev, dtype=torch.int64))
    row = _row_keys(seed, counter, stream)
    h = _fmix32(row[:, None] ^ pos[None, :])
    h = _fmix32(h[:, :, None] ^ ids[None, None, :])
    return ((h >> 9).to(torch.float32) + 0.5) * (1.0 / 2**23)


def gumbel(seed: torch.Tensor, counter: torch.Tensor, positions: int, vocab_start: int,
           vocab_width: int) -> torch.Tensor:
    """Gumbel(0, 1) noise: argmax(logits / T + G) is a sample of softmax(logits / T)."""
    u = uniform(seed, counter, STREAM_GUMBEL, positions, vocab_start, vocab_width)
    return -torch.log(-torch.log(u))
