"""The sampler statistics (model/sampling/stats.py, docs/spec.md 3-4, 7): one pass's partials, combined over
pieces of the vocabulary, equal dense references. The triton passes (model/kernels/vocab_stats.py,
model/kernels/filters.py) under triton's CPU interpreter, against these and at TP = 2, are tests/interpreted's
(run by tests/test_interpreted_kernels.py)."""
import pytest
import torch

from model.parallel.group import TPGroup
from model.sampling import noise
from model.sampling import stats as S

TP1 = TPGroup()


def case(R=3, P=4, V=300, seed=0, dtype=torch.float32):
    gen = torch.Generator().manual_seed(seed)
    x = (torch.randn(R, P, V, generator=gen) * 4).to(dtype)
    x[0, 0, :7] = -torch.inf            # the mask token and filtered entries are -inf
    x[1, 2, 10] = x[1, 2, 20] = x[1, 2].max() + 1   # a tie for the maximum: the lower id wins
    temp = torch.tensor([0.7, 0.0, 1.5][:R])
    return x, temp, torch.tensor([5, 2**40 + 3, 9][:R]), torch.tensor([3, 1, 0][:R])


def dense(x, temp, seed, counter, softcap=None, soft_dtype=None, vocab_start=0):
    u = x.float() if softcap is None else torch.tanh(x.float() / softcap) * softcap
    T = torch.where(temp > 0, temp, 1.0).view(-1, 1, 1)
    s = u / T
    g = noise.gumbel(seed, counter, x.shape[1], vocab_start, x.shape[-1])
    sample = torch.where(temp.view(-1, 1) > 0, torch.argmax(torch.where(torch.isfinite(s), s + g, s), -1),
                         torch.argmax(u, -1))
    soft = s if soft_dtype is None else s.to(soft_dtype).float()
    return dict(greedy=torch.argmax(u, -1) + vocab_start, sample=sample + vocab_start,
                lse_u=torch.logsumexp(u, -1), lse_s=torch.logsumexp(s, -1),
                entropy_u=torch.distributions.Categorical(logits=u).entropy(),
                entropy_s=torch.distributions.Categorical(logits=s).entropy(),
                lse_soft=torch.logsumexp(soft, -1))


@pytest.mark.parametrize("softcap,soft_dtype", [(None, None), (30.0, torch.bfloat16)])
def test_statistics_equal_dense_references(softcap, soft_dtype):
    x, temp, seed, counter = case()
    st = S.vocab_stats(x, temp, seed, counter, 0, TP1, softcap=softcap, soft_dtype=soft_dtype)
    ref = dense(x, temp, seed, counter, softcap, soft_dtype)
    assert torch.equal(st.greedy, ref["greedy"]) and torch.equal(st.sample, ref["sample"])
    assert st.greedy[1, 2] == 10                       # ties: the lowest id
    for key in ("lse_u", "lse_s", "entropy_u", "entropy_s", "lse_soft"):
        assert torch.allclose(getattr(st, key), ref[key], atol=1e-5), key
    assert torch.equal(st.x_sample, torch.gather(x, -1, st.sample[..., None])[..., 0])


def test_pieces_combine_like_the_whole_slice():
    """Partials of vocabulary pieces (a kernel's splits, or TP ranks) combine to the whole's statistics."""
    x, temp, seed, counter = case(V=1000)
    whole = S.vocab_stats(x, temp, seed, counter, 0, TP1, soft_dtype=torch.bfloat16)
    bounds = [0, 137, 512, 513, 1000]   # uneven, one a single entry wide
    parts = [S.torch_partials(x[..., a:b], temp, seed, counter, a, soft_dtype=torch.bfloat16)
             for a, b in zip(bounds, bounds[1:])]
    keys, sums = torch.cat([k for k, _ in parts], -1), torch.cat([s for _, s in parts], -1)
    combined = S.combine(keys, sums, x, temp, 0, TP1, torch.bfloat16)
    assert torch.equal(combined.greedy, whole.greedy) and torch.equal(combined.sample, whole.sample)
    for key in ("lse_u", "lse_s", "entropy_u", "entropy_s", "lse_soft", "max_u"):
        assert torch.allclose(getattr(combined, key), getattr(whole, key), atol=1e-5), key


def test_pieces_that_keep_nothing_combine_at_low_temperatures():
    """A piece whose every entry a filter dropped adds nothing, also where the row's max / T is below
    -88 (its scale exp(0 - max / T) used to overflow: inf * 0 = NaN)."""
    x = torch.randn(2, 3, 1000, generator=torch.Generator().manual_seed(0)) - 12.0
    temp, seed, counter = torch.tensor([0.1, 1.0]), torch.tensor([1, 2]), torch.tensor([0, 0])
    thr = x.amax(-1) / temp[:, None]   # top_k 1
    whole = S.vocab_stats(x, temp, seed, counter, 0, TP1, threshold=thr)
    bounds = [0, 300, 600, 1000]
    parts = [S.torch_partials(x[..., a:b], temp, seed, counter, a, threshold=thr) for a, b in zip(bounds, bounds[1:])]
    combined = S.combine(torch.cat([k for k, _ in parts], -1), torch.cat([s for _, s in parts], -1), x, temp, 0, TP1)
    assert (whole.lse_s < -88).any()
    for key in ("lse_u", "lse_s", "entropy_u", "entropy_s"):
        assert torch.isfinite(getattr(combined, key)).all(), key
        assert torch.allclose(getattr(combined, key), getattr(whole, key), atol=1e-5), key


def test_thresholds_filter_in_the_space_they_are_decided_in():
    x, temp, seed, counter = case()
    thr = torch.full(x.shape[:-1], -torch.inf)
    thr[2] = 1.0
    for on_scaled in (True, False):
        st = S.vocab_stats(x, temp, seed, counter, 0, TP1, threshold=thr, threshold_on_scaled=on_scaled)
        u = x.float()
        base = u / torch.where(temp > 0, temp, 1.0).view(-1, 1, 1) if on_scaled else u
        kept = base >= thr.unsqueeze(-1)
        ref = dense(torch.where(kept, u, -torch.inf), temp, seed, counter)
        assert torch.equal(st.sample, ref["sample"]) and torch.allclose(st.lse_s, ref["lse_s"], atol=1e-5)
        assert torch.gather(kept, -1, st.sample[..., None]).all()


def test_keys_order_by_value_then_lowest_id():
    values = torch.tensor([-torch.inf, -3.5, -0.0, 0.0, 1e-30, 2.0, 2.0, torch.inf])
    ids = torch.tensor([0, 1, 2, 3, 4, 6, 5, 7])
    keys = S.encode_keys(values, ids)
    v, i = S.decode_keys(keys)
    assert torch.equal(v, values) and torch.equal(i, ids)
    assert keys[6] > keys[5]                      # equal values: the lower id is the larger key
    assert torch.equal(torch.argsort(keys[[0, 1, 4, 5, 7]]), torch.arange(5))


def test_scores_are_log_probabilities_at_most_0():
    """A token's logprob and its alternatives' never exceed log 1, also when the statistics' normaliser
    rounds a little below the token's own s: on CUDA the passes' u (triton's tanh) and the token's
    (torch's) may differ by an ulp, and a distribution of one entry (top_k 1) then scored +1e-6. An excess
    beyond rounding is left to show."""
    from types import SimpleNamespace

    from model.sampling.filters import torch_threshold
    from model.slots import SlotTable
    from model.steps.sampler import RowSampler

    x, temp, seed, counter = case(R=2, P=4, V=300)
    slots = SlotTable(2, 4, 0, torch.device("cpu"))
    slots.temperature[:2], slots.logprobs[:2] = temp, 3
    sampler = RowSampler(SimpleNamespace(tp=TP1, vocab_start=0, logit_softcap=30.0), slots)
    top_k, top_p = torch.tensor([1, 1]), torch.tensor([1.0, 1.0])
    thr = torch_threshold(x, temp, top_k, top_p, 0, TP1, softcap=30.0, on_scaled=False)
    st = S.vocab_stats(x, temp, seed, counter, 0, TP1, softcap=30.0, threshold=thr, threshold_on_scaled=False)
    rows = torch.arange(2)
    exact = sampler.scores(x, st, st.x_sample, rows, 3, rows)
    assert exact.logprob.max() > -1e-6   # one entry kept (or ties): log 1
    lse = st.lse_s
    st.lse_s = lse - 4 * torch.finfo(torch.float32).eps * lse.abs()   # the kernels' rounding, a few ulps
    scores = sampler.scores(x, st, st.x_sample, rows, 3, rows)
    assert (scores.logprob <= 0).all() and (scores.top_values <= 0).all()
    st.lse_s = lse - 1e-2                # more than rounding: a wrong normaliser shows, not a certain token
    assert (sampler.scores(x, st, st.x_sample, rows, 3, rows).logprob > 0).any()


def test_first_mass_pass_normalises_like_logsumexp():
    """Mass pass 0 sums exp(v - ref) per split, ref the split's largest survivor (-inf where none
    survives); normalise_first_pass turns those sums into the normaliser logsumexp(v) over every survivor
    and the pass's totals into probabilities, without a NaN for a split or a row with no survivor."""
    from model.kernels.filters import normalise_first_pass

    torch.manual_seed(0)
    v = torch.randn(3, 4, 50) * 6   # [R * P, splits, entries]
    v[0, 1] = -torch.inf            # a split with no survivor
    v[2] = -torch.inf               # a row with none at all
    ref = v.amax(-1)
    rel = torch.exp(v - torch.where(torch.isfinite(ref), ref, 0.0)[..., None])
    member = torch.rand(16, 50) < torch.linspace(1, 0.05, 16)[:, None]   # candidate d's entries
    member[0] = True                # candidate 0 is every survivor
    first = torch.einsum("nse,de->nsd", rel, member.float())
    lognorm = normalise_first_pass(first, ref, TP1)
    assert torch.allclose(lognorm[:2], torch.logsumexp(v[:2].flatten(1), 1), rtol=1e-6)
    assert lognorm[2] == -torch.inf and not first.isnan().any() and (first[2] == 0).all()
    probs = torch.exp(v[:2] - lognorm[:2, None, None])
    assert torch.allclose(first[:2], torch.einsum("nse,de->nsd", probs, member.float()), rtol=1e-5, atol=1e-7)
    assert torch.allclose(first[:2, :, 0].sum(1), torch.ones(2), rtol=1e-5)
