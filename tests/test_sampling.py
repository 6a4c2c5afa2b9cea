"""Unit tests of the sampling primitives (docs/spec.md 3.2-3.3, 6, 7): counter-based noise, temperature and
top-k / top-p filters at TP=1, and Gumbel-max sampling frequencies. No model is loaded."""
import math

import pytest
import torch

from model.parallel.group import TPGroup, shard_range
from model.sampling import noise
from model.sampling.filters import mask_token, scale_and_filter

V = 997


def _u(seeds, counters, stream=noise.STREAM_GUMBEL, positions=3, v0=0, width=V):
    return noise.uniform(torch.tensor(seeds, dtype=torch.int64), torch.tensor(counters, dtype=torch.int64),
                         stream, positions, v0, width)


# ---- noise ---------------------------------------------------------------------------------------

def test_uniform_shape_dtype_and_open_interval():
    u = _u(list(range(64)), [0] * 32 + [1] * 32, positions=8)
    assert u.shape == (64, 8, V) and u.dtype == torch.float32
    assert u.min() > 0 and u.max() < 1
    # 24 random bits: every value is (k + 0.5) / 2**24 for an integer k (rounded to float32: a multiple
    # of 2**-25), and they are spread over the whole interval
    k = u.double() * 2**25
    assert torch.equal(k, k.round())
    assert u.min() < 1e-4 and u.max() > 1 - 1e-4
    assert torch.unique(u).numel() > 0.95 * u.numel()


# Keys whose 24 random bits are all ones: (2**24 - 1 + 0.5) / 2**24 rounds to 1.0 in float32.
ALL_ONES_KEYS = [(4274713, 2, 0, 100), (133149, 9, 0, 100), (545223, 1, 17, 100)]   # seed, counter, pos, id


@pytest.mark.parametrize("seed,counter,pos,vid", ALL_ONES_KEYS)
def test_uniform_is_strictly_below_one_for_every_key(seed, counter, pos, vid):
    u = noise.uniform(torch.tensor([seed]), torch.tensor([counter]), noise.STREAM_GUMBEL, pos + 1, vid, 1)
    assert u[0, pos, 0] < 1.0
    g = noise.gumbel(torch.tensor([seed]), torch.tensor([counter]), pos + 1, vid, 1)
    assert torch.isfinite(g).all()


@pytest.mark.parametrize("world", [2, 3, 7])
def test_uniform_vocab_slices_equal_full_vocab_columns(world):
    """Sharding invariance: a rank holding ids [v0, v1) draws exactly those columns of the TP=1 draw."""
    seeds, counters = [3, 2**40 + 5, 17], [0, 9, 123456]
    full = _u(seeds, counters)
    for rank in range(world):
        v0, v1 = shard_range(V, rank, world)
        part = _u(seeds, counters, v0=v0, width=v1 - v0)
        assert torch.equal(part, full[..., v0:v1])
    # an arbitrary slice too
    assert torch.equal(_u(seeds, counters, v0=411, width=5), full[..., 411:416])


def test_uniform_rows_do_not_depend_on_batch_neighbours():
    seeds, counters = [11, 12, 13, 2**62 + 1], [5, 0, 7, 3]
    batch = _u(seeds, counters)
    for i, (s, c) in enumerate(zip(seeds, counters)):
        assert torch.equal(_u([s], [c])[0], batch[i])
    order = [2, 0, 3, 1]
    permuted = _u([seeds[i] for i in order], [counters[i] for i in order])
    assert torch.equal(permuted, batch[order])


def test_uniform_depends_on_every_key_component():
    base = _u([7], [4])[0]

    def frac_equal(other):
        return (other == base).float().mean().item()

    assert frac_equal(_u([8], [4])[0]) < 0.01                          # seed
    assert frac_equal(_u([7 + 2**32], [4])[0]) < 0.01                  # high bits of the seed
    assert frac_equal(_u([7], [5])[0]) < 0.01                          # counter
    assert frac_equal(_u([7], [4], stream=noise.STREAM_RENOISE)[0]) < 0.01   # stream
    # positions and vocabulary ids get different numbers
    assert (base[0] == base[1]).float().mean() < 0.01
    assert (base[:, :-1] == base[:, 1:]).float().mean() < 0.01
    # deterministic
    assert torch.equal(_u([7], [4])[0], base)


def test_uniform_distribution_is_uniform():
    u = _u(list(range(250)), [3] * 250, positions=4).flatten().double()   # ~1M values
    n = u.numel()
    assert abs(u.mean().item() - 0.5) < 2e-3
    assert abs(u.var().item() - 1 / 12) < 1e-3
    counts = torch.histc(u, bins=20, min=0, max=1)
    expected = n / 20
    assert ((counts - expected).abs() / expected).max() < 0.02
    # Kolmogorov-Smirnov statistic on a subsample, well below the 1% critical value
    s = torch.sort(u[:: 7]).values
    m = s.numel()
    ecdf = torch.arange(1, m + 1, dtype=torch.float64) / m
    d = torch.maximum((ecdf - s).abs(), (ecdf - 1 / m - s).abs()).max().item()
    assert d < 1.63 / math.sqrt(m)
    # neighbouring vocabulary ids are uncorrelated
    w = _u(list(range(100)), [0] * 100, positions=1)[:, 0].double()
    c = torch.corrcoef(torch.stack([w[:, :-1].flatten(), w[:, 1:].flatten()]))[0, 1]
    assert abs(c.item()) < 0.01


def test_gumbel_is_transform_of_gumbel_stream():
    seed, counter = torch.tensor([5, 6]), torch.tensor([1, 2])
    g = noise.gumbel(seed, counter, 2, 100, 50)
    u = noise.uniform(seed, counter, noise.STREAM_GUMBEL, 2, 100, 50)
    assert torch.allclose(g, -torch.log(-torch.log(u)))
    assert torch.isfinite(g).all()


# ---- Gumbel-max sampling -------------------------------------------------------------------------

@pytest.mark.parametrize("T", [0.5, 1.0, 2.0])
def test_gumbel_max_frequencies_match_softmax(T):
    logits = torch.full((V,), -12.0)
    heavy = torch.tensor([7, 123, 500, 996, 42])
    logits[heavy] = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    probs = torch.softmax(logits / T, -1)
    n_seeds = 2500
    seeds = torch.arange(n_seeds, dtype=torch.int64).repeat(2) * 7919 + 3
    counters = torch.cat([torch.zeros(n_seeds), torch.ones(n_seeds) * 5]).long()
    g = noise.gumbel(seeds, counters, 1, 0, V)[:, 0]                    # [5000, V]
    picks = torch.argmax(logits / T + g, -1)
    freq = torch.bincount(picks, minlength=V).double() / picks.numel()
    for i in heavy.tolist():
        assert abs(freq[i] - probs[i]) < 0.03, (T, i, freq[i].item(), probs[i].item())
    tail = torch.ones(V, dtype=torch.bool)
    tail[heavy] = False
    assert abs(freq[tail].sum() - probs[tail].sum()) < 0.03
    # the tail is only negligible at low temperature: the check means something at T = 2
    if T == 2.0:
        assert probs[tail].sum() > 0.2


# ---- temperature and filters ---------------------------------------------------------------------

TP1 = TPGroup()


def dense_reference(logits, T, k, p):
    """Sort-based reference: scale by T (1 for greedy), top-k then top-p on the scaled logits (top-p on
    the distribution renormalised over the top-k survivors), ties at the boundary kept."""
    R = logits.shape[0]
    scaled = logits / torch.where(T > 0, T, 1.0).view(-1, *[1] * (logits.dim() - 1))
    keep = torch.ones_like(scaled, dtype=torch.bool)
    for r in range(R):
        s = scaled[r]
        if k[r] > 0:
            kth = torch.sort(s, -1, descending=True).values[..., k[r] - 1: k[r]]
            keep[r] &= s >= kth
        if p[r] < 1:
            kept = torch.where(keep[r], s, -torch.inf)
            probs = torch.exp(kept - torch.logsumexp(kept, -1, keepdim=True))
            order = torch.sort(kept, -1, descending=True)
            cum = torch.cumsum(torch.gather(probs, -1, order.indices).double(), -1)
            m = (cum < p[r].double()).sum(-1, keepdim=True).clamp(max=s.shape[-1] - 1)  # first index reaching p
            t = torch.gather(order.values, -1, m)
            keep[r] &= s >= t
    return torch.where(keep, logits, -torch.inf), torch.where(keep, scaled, -torch.inf)


def test_temperature_scaling_and_greedy_rows_use_t1():
    x = torch.randn(3, 4, V, generator=torch.Generator().manual_seed(0)) * 3
    T = torch.tensor([0.0, 0.5, 2.0])
    unscaled, scaled = scale_and_filter(x, T, 0, TP1)
    assert torch.equal(unscaled, x)
    assert torch.equal(scaled[0], x[0])
    assert torch.allclose(scaled[1], x[1] / 0.5)
    assert torch.allclose(scaled[2], x[2] / 2.0)


def test_top_k_keeps_exactly_the_k_largest():
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(4, 3, V, generator=gen) * 2
    T = torch.tensor([1.0, 0.5, 0.0, 2.0])
    k = torch.tensor([1, 5, 0, 50])
    unscaled, scaled = scale_and_filter(x, T, 0, TP1, top_k=k)
    for r in range(4):
        for pos in range(3):
            kept = torch.isfinite(scaled[r, pos]).nonzero().flatten()
            assert torch.equal(torch.isfinite(unscaled[r, pos]), torch.isfinite(scaled[r, pos]))
            if k[r] == 0:
                assert kept.numel() == V
            else:
                top = torch.topk(x[r, pos], int(k[r])).indices
                assert sorted(kept.tolist()) == sorted(top.tolist())
            assert torch.equal(unscaled[r, pos, kept], x[r, pos, kept])


def test_top_k_keeps_ties_at_the_kth_value():
    x = torch.full((2, 1, V), -5.0)
    x[:, 0, 10] = 3.0
    x[:, 0, [20, 30, 40]] = 2.0     # three-way tie at the 2nd largest value
    x[:, 0, 50] = 1.0
    _, scaled = scale_and_filter(x, torch.tensor([1.0, 1.0]), 0, TP1, top_k=torch.tensor([2, 4]))
    assert torch.isfinite(scaled[0, 0]).nonzero().flatten().tolist() == [10, 20, 30, 40]
    assert torch.isfinite(scaled[1, 0]).nonzero().flatten().tolist() == [10, 20, 30, 40]
    _, scaled = scale_and_filter(x, torch.tensor([1.0, 1.0]), 0, TP1, top_k=torch.tensor([5, 1]))
    assert torch.isfinite(scaled[0, 0]).nonzero().flatten().tolist() == [10, 20, 30, 40, 50]
    assert torch.isfinite(scaled[1, 0]).nonzero().flatten().tolist() == [10]


def test_top_k_larger_than_vocabulary_keeps_everything():
    x = torch.randn(1, 2, V)
    _, scaled = scale_and_filter(x, torch.tensor([1.0]), 0, TP1, top_k=torch.tensor([V + 5]))
    assert torch.isfinite(scaled).all()


@pytest.mark.parametrize("scale", [1.0, 3.0, 8.0])
def test_top_k_top_p_match_dense_reference(scale):
    gen = torch.Generator().manual_seed(int(scale * 10))
    x = torch.randn(6, 5, V, generator=gen) * scale
    T = torch.tensor([1.0, 0.5, 0.0, 2.0, 0.7, 1.3])
    p = torch.tensor([0.3, 0.9, 0.5, 0.95, 0.3, 0.05])
    k = torch.tensor([0, 0, 40, 7, 200, 0])
    unscaled, scaled = scale_and_filter(x, T, 0, TP1, top_k=k, top_p=p)
    ref_u, ref_s = dense_reference(x, T, k, p)
    assert torch.equal(torch.isfinite(scaled), torch.isfinite(ref_s))
    assert torch.equal(torch.isfinite(unscaled), torch.isfinite(scaled))   # -inf in both
    assert torch.equal(unscaled, ref_u)
    assert torch.allclose(scaled, ref_s)
    # the kept set is the smallest top set reaching p: without its smallest member the mass is < p
    for r in range(6):
        for pos in range(5):
            kept = torch.isfinite(scaled[r, pos])
            if p[r] < 1 and k[r] == 0:
                full = torch.softmax(x[r, pos] / (T[r] if T[r] > 0 else 1), -1).double()
                mass = full[kept].sum()
                assert mass >= p[r] - 1e-6 and mass - full[kept].min() < p[r] + 1e-6


def test_top_p_rows_with_p_one_are_unfiltered():
    x = torch.randn(2, 3, V) * 8
    _, scaled = scale_and_filter(x, torch.tensor([1.0, 0.5]), 0, TP1, top_p=torch.tensor([1.0, 1.0]))
    assert torch.isfinite(scaled).all()


def test_top_p_tiny_keeps_only_top_token_and_its_ties():
    x = torch.randn(2, 1, V) * 2
    x[1, 0, 5] = x[1, 0, 9] = x[1].max() + 1
    _, scaled = scale_and_filter(x, torch.tensor([1.0, 1.0]), 0, TP1, top_p=torch.tensor([1e-4, 1e-4]))
    assert torch.isfinite(scaled[0, 0]).nonzero().flatten().tolist() == [int(x[0, 0].argmax())]
    assert torch.isfinite(scaled[1, 0]).nonzero().flatten().tolist() == [5, 9]


def test_top_p_one_row_is_not_filtered_by_a_neighbours_top_p():
    """SPEC 6 isolation: a row with top_p = 1 keeps every token whatever its neighbours ask for."""
    x = torch.randn(2, 8, V, generator=torch.Generator().manual_seed(3)) * 6
    alone_u, alone_s = scale_and_filter(x[:1], torch.tensor([1.0]), 0, TP1)
    u, s = scale_and_filter(x, torch.tensor([1.0, 1.0]), 0, TP1, top_p=torch.tensor([1.0, 0.5]))
    assert torch.equal(s[0], alone_s[0]) and torch.equal(u[0], alone_u[0])


def test_mask_token_sets_only_the_owned_column():
    x = torch.zeros(2, 3, 50)
    mask_token(x, 100, vocab_start=80)            # owns ids [80, 130): local column 20
    assert torch.isneginf(x[..., 20]).all()
    assert torch.isfinite(x[..., :20]).all() and torch.isfinite(x[..., 21:]).all()
    y = torch.zeros(2, 3, 50)
    mask_token(y, 100, vocab_start=0)             # [0, 50): not owned
    mask_token(y, 100, vocab_start=101)           # [101, 151): not owned
    mask_token(y, 100, vocab_start=50)            # [50, 100): not owned (100 is one past the end)
    assert torch.isfinite(y).all()
    z = torch.zeros(1, 50)
    mask_token(z, 100, vocab_start=51)            # last column [51, 101)
    assert torch.isneginf(z[0, 49]) and torch.isfinite(z[0, :49]).all()
