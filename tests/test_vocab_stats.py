"""The sampler statistics (model/sampling/stats.py, docs/spec.md 3-4, 7): one pass's partials, combined over
pieces of the vocabulary, equal dense references; the triton pass (model/kernels/vocab_stats.py),
run by triton's CPU interpreter, equals the torch pass token for token."""
import pytest
import torch

from model.parallel.group import TPGroup
from model.sampling import noise
from model.sampling import stats as S
from tests.interpreter import run_marked

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


TRITON_CHECK = r"""
import torch
from model.kernels.vocab_stats import TRITON_PASSES
from model.parallel.group import TPGroup
from model.sampling import stats as S
torch.manual_seed(0)
for R, P, V, softcap, soft, vs, dtype in [(2, 3, 997, None, None, 0, torch.float32),
                                           (2, 2, 5000, 30.0, torch.bfloat16, 100, torch.bfloat16),
                                           (3, 1, 40000, None, None, 7, torch.float32)]:
    x = (torch.randn(R, P, V) * 4).to(dtype)
    x[0, 0, 5] = float("-inf")
    # ties for a row's maximum, 2048 apart (one lane of two of the kernel's tiles) and in different lanes:
    # the lower id wins
    x[1, 0, 10] = x[1, 0, 10 + min(2048, V // 2)] = x[1, 0].max() + 1
    x[0, P - 1, min(4000, V - 1)] = x[0, P - 1, 100] = x[0, P - 1].max() + 1
    temp = torch.tensor([0.7, 0.0, 1.3][:R])
    seed, counter = torch.tensor([5, 2**40 + 3, 9][:R]), torch.tensor([3, 1, 0][:R])
    thr = torch.full((R, P), -float("inf")); thr[0] = 2.0
    for threshold in (None, thr):
        kw = dict(softcap=softcap, threshold=threshold, soft_dtype=soft)
        a = S.vocab_stats(x, temp, seed, counter, vs, TPGroup(), **kw)
        b = S.vocab_stats(x, temp, seed, counter, vs, TPGroup(), passes=TRITON_PASSES, **kw)
        assert torch.equal(a.greedy, b.greedy) and torch.equal(a.sample, b.sample), (R, P, V)
        assert b.greedy[1, 0] == vs + 10 and b.greedy[0, P - 1] == vs + 100, (R, P, V)
        for f in ("max_u", "lse_u", "lse_s", "entropy_u", "entropy_s", "lse_soft", "x_sample"):
            d = (getattr(a, f) - getattr(b, f)).abs().max().item()
            assert d < 1e-5 * max(1.0, getattr(a, f).abs().max().item()), (f, d)
        kw = dict(softcap=softcap, threshold=threshold, soft_dtype=soft)
        pa = S.torch_probabilities(x, temp, a.lse_soft, **kw)
        pb = TRITON_PASSES.probabilities(x, temp, a.lse_soft, **kw)
        assert (pa - pb).abs().max().item() < 1e-6 and torch.equal(pa > 0, pb > 0), (pa - pb).abs().max()
        assert abs(pa.sum(-1) - 1).max() < 1e-3   # softmax(round(s)) normalised by lse_soft
# logits far below 0 at low temperatures (max / T < -88: exp(-max / T) overflows fp32), filtered to
# their maximum, so that most splits of a row keep nothing
x = torch.randn(2, 2, 40000) * 2 - 20
temp = torch.tensor([0.1, 0.2])
seed, counter = torch.tensor([5, 9]), torch.tensor([3, 0])
thr = x.amax(-1) / temp[:, None]
for threshold in (None, thr):
    a = S.vocab_stats(x, temp, seed, counter, 0, TPGroup(), threshold=threshold)
    b = S.vocab_stats(x, temp, seed, counter, 0, TPGroup(), threshold=threshold, passes=TRITON_PASSES)
    assert torch.equal(a.greedy, b.greedy) and torch.equal(a.sample, b.sample)
    for f in ("lse_u", "lse_s", "entropy_u", "entropy_s"):
        assert torch.isfinite(getattr(b, f)).all(), f
        assert torch.allclose(getattr(a, f), getattr(b, f), rtol=1e-5, atol=1e-5), f
print("triton == torch")
"""


@pytest.mark.interpreted(TRITON_CHECK, "triton == torch")
def test_triton_pass_equals_torch_pass_in_the_interpreter(request):
    run_marked(request)


RANK_TOP_CHECK = r"""
import torch
from model.kernels.vocab_stats import triton_rank_top_k
from model.sampling import stats as S
torch.manual_seed(0)
# (the interpreter takes ~4 s per row and k: each k > 0 runs once per dtype, on 4 rows)
for V, vs, dtype, ks in [(997, 0, torch.float32, (0, 1, 20)), (700, 100, torch.bfloat16, (0, 5))]:
    x = (torch.randn(2, 2, V) * 4).to(dtype)
    x[0, 0, 5] = float("-inf")
    x[1, 0, 50] = x[1, 0, 600] = x[1, 0].max()             # a tie: the lower id first
    tok = x[..., 11]
    for k in ks:
        ca, ka = S.torch_rank_top_k(x, tok, k, vs)
        cb, kb = triton_rank_top_k(x, tok, k, vs, block=64, split=256)   # several tiles and splits
        assert torch.equal(ca, cb) and (k == 0 or torch.equal(ka, kb)), (V, k)
    narrow = x[..., :12]                                     # a slice narrower than k: padded alike
    ca, ka = S.torch_rank_top_k(narrow, tok, 20, vs)
    cb, kb = triton_rank_top_k(narrow, tok, 20, vs)
    assert torch.equal(ca, cb) and torch.equal(ka, kb)
print("rank and top-k: triton == torch")
"""


@pytest.mark.interpreted(RANK_TOP_CHECK, "rank and top-k: triton == torch", timeout=200)
def test_triton_rank_top_k_equals_torch_in_the_interpreter(request):
    """The scored rows' second read (rank counts and top-k keys by per-tile sort and merge) equals the
    torch reference exactly, over several tiles and splits, ties and a slice narrower than k."""
    run_marked(request)


THRESHOLD_CHECK = r"""
import torch
import model.kernels.filters as F
from model.kernels.filters import triton_threshold
from model.parallel.group import TPGroup
from model.sampling.filters import torch_threshold
torch.manual_seed(0)
# rows: top-k only, top-p only, both, neither, k past the vocabulary; a tie at a row's 3rd largest; -inf
# entries; a vocabulary offset; logits large enough that the softcap's tanh rounds to 1 (equal values of
# distinct logits); the kernel's own tiling, and small splits and tiles (several a row, a ragged last one)
cases = [(3000, 0, torch.float32, None, True, 4), (2500, 64, torch.bfloat16, 30.0, False, 4),
         (1800, 0, torch.float32, 30.0, True, 200)]
for split, count_block, mass_block in [(F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK), (1024, 512, 256)]:
    F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK = split, count_block, mass_block
    for V, vs, dtype, softcap, on_scaled, scale in cases:
        x = (torch.randn(5, 2, V) * scale).to(dtype)
        x[0, 0, 5] = float("-inf")
        x[1, 1, :100] = float("-inf")
        top = x[2, 1].topk(3).values
        x[2, 1, :2] = top[2]
        temp = torch.tensor([0.7, 0.0, 1.3, 1.0, 2.0])
        top_k, top_p = torch.tensor([5, 0, 3, 0, 4000]), torch.tensor([1.0, 0.6, 0.9, 1.0, 0.3])
        a = torch_threshold(x, temp, top_k, top_p, vs, TPGroup(), softcap=softcap, on_scaled=on_scaled)
        b = triton_threshold(x, temp, top_k, top_p, vs, TPGroup(), softcap=softcap, on_scaled=on_scaled)
        assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a[3]).all() and torch.isfinite(a[:3]).all()
        tol = 0 if softcap is None else 1e-5   # the interpreter's tanh is not torch's to the last bit
        assert torch.allclose(a, b, rtol=tol, atol=0), (split, V, dtype, a, b)
# bf16 logits below 0, so the thresholds are negative (a negative key's dropped low bits must decode back
# as zeros: the last mass pass weighs each key by its value), and, undivided, a k-th largest that is -inf
for softcap, on_scaled in [(None, True), (30.0, False)]:
    x = (torch.randn(4, 3, 2000) * 1.5 - 8).to(torch.bfloat16)
    if softcap is None:
        x[0, 1, 3:] = float("-inf")   # 3 finite entries and k = 5
    temp = torch.tensor([1.0, 0.7, 1.0, 0.0])
    top_k, top_p = torch.tensor([5, 0, 40, 3]), torch.tensor([1.0, 0.9, 0.8, 0.5])
    a = torch_threshold(x, temp, top_k, top_p, 0, TPGroup(), softcap=softcap, on_scaled=on_scaled)
    b = triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), softcap=softcap, on_scaled=on_scaled)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and not b.isnan().any() and (a[a.isfinite()] < 0).all()
    assert torch.allclose(a, b, rtol=0 if softcap is None else 1e-5, atol=0), (softcap, a, b)
print("thresholds: triton == torch")
"""


@pytest.mark.interpreted(THRESHOLD_CHECK, "thresholds: triton == torch", timeout=300)
def test_triton_thresholds_equal_torch_in_the_interpreter(request):
    """The filters' radix select over the raw logits' keys (model/kernels/filters.py) finds the thresholds
    torch's select over the decided values finds: top-k, top-p, both and neither, fp32 logits divided by
    T and bf16 logits softcapped, a tie, -inf entries, a vocabulary offset, a saturated softcap,
    several splits and tiles a row, negative bf16 thresholds and a k-th largest logit of -inf."""
    run_marked(request)


CACHED_CHECK = r"""
import torch
import model.kernels.filters as F
from model.kernels.filters import triton_threshold
from model.parallel.group import TPGroup
from model.sampling.filters import torch_threshold
torch.manual_seed(2)
# count tiles of 4 cached tiles, 8 a split; V=2900: 3 splits, the last one partial (a ragged tile, a tile
# past the vocabulary); V=700: one split narrower than SPLIT (a count tile half past its end)
F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK = 1024, 512, 128
temp = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.0, 2.0])
top_k = torch.tensor([5, 0, 7, 0, 3, 0])           # k only, p only, both, neither, both, p only
top_p = torch.tensor([1.0, 0.8, 0.7, 1.0, 0.95, 0.5])
cases = [(2900, torch.bfloat16, 30.0, False), (2900, torch.float32, None, True), (700, torch.float32, None, True)]
for V, dtype, softcap, on_scaled in cases:
    x = torch.randn(6, 3, V)
    for r in range(6):
        for q in range(3):   # the top-k survivors and the top-p mass in one cluster (first tile, ragged last, ...)
            at = torch.randint(0, V - 12, ()).item() if (r + q) % 3 else [0, V - 12, V // 2][q]
            x[r, q, at:at + 12] = 12 + torch.randn(12)
    x[1, 0, 128:256] = float("-inf")   # a whole tile of -inf
    x = x.to(dtype)
    a = torch_threshold(x, temp, top_k, top_p, 17, TPGroup(), softcap=softcap, on_scaled=on_scaled)
    b = triton_threshold(x, temp, top_k, top_p, 17, TPGroup(), softcap=softcap, on_scaled=on_scaled)
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a[3]).all()
    assert torch.isfinite(a[[0, 1, 2, 4, 5]]).all()
    tol = 0 if softcap is None else 1e-5
    assert torch.allclose(a, b, rtol=tol, atol=0), (V, dtype, a, b)
print("cached tile maxima: triton == torch")
"""


@pytest.mark.interpreted(CACHED_CHECK, "cached tile maxima: triton == torch", timeout=300)
def test_triton_thresholds_from_cached_tile_maxima_in_the_interpreter(request):
    """Passes decide a tile from its cached maximum (read first for every row asking a filter): rows
    asking top-k only, top-p only, both and neither in one batch, the survivors clustered in one tile
    (later passes skip the rest), several splits, a ragged last split and tile, a split narrower than
    SPLIT."""
    run_marked(request)


ASKED_CHECK = r"""
import torch
from model.kernels.vocab_stats import triton_rank_top_k
from model.sampling import stats as S
torch.manual_seed(1)
x = torch.randn(3, 2, 600) * 4
tok = x[..., 7]
asked = torch.tensor([4, -1, 0])   # top 4; no scores; the rank only
ca, ka = S.torch_rank_top_k(x, tok, 4, 0)
cb, kb = triton_rank_top_k(x, tok, 4, 0, asked=asked, block=64, split=256)
assert torch.equal(ca[0], cb[0]) and torch.equal(ka[0], kb[0]) and torch.equal(ca[2], cb[2])
assert (cb[1] == 0).all() and not torch.equal(ka[2], kb[2])   # skipped work leaves nothing computed
print("asked rows only")
"""


@pytest.mark.interpreted(ASKED_CHECK, "asked rows only", timeout=200)
def test_triton_scores_skip_rows_that_asked_none_in_the_interpreter(request):
    """A graph's plan scores every row; the kernel computes only what each row's request asked for."""
    run_marked(request)


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


BOUND_CHECK = r"""
import torch
from model.kernels.filters import top_k_bound
torch.manual_seed(0)
x = torch.randn(6, 2, 4, 8)   # [R * P: 3 rows of 2 positions, splits, tiles, entries]
x[1, 0, 0, 3] = x[1, 0, 1, 5] = x[1].max() + 1   # a tie at the top, in two tiles
x[0, 1] = -torch.inf                              # a split of -inf (a slice's padding)
x[3, :, :, :4] = -x[3, :, :, :4].abs()            # maxima of both signs
tile_max = x.amax(-1)
ranked = tile_max.flatten(1).sort(dim=1, descending=True).values   # the reference: sorted maxima
for top_k in (torch.tensor([3, 0, 9]), torch.tensor([2, 0, 0]), torch.tensor([1, 8, 5]), torch.tensor([6, 7, 0])):
    bound = top_k_bound(tile_max, top_k, 2)
    k = top_k.repeat_interleave(2)
    for n in range(6):
        want = ranked[n, k[n] - 1] if 0 < k[n] <= 8 else -torch.inf
        assert bound[n] == want, (top_k, n, bound[n], want)
        if 0 < k[n] <= 8:   # never above the k-th largest logit of the position (a maximum is an entry)
            assert bound[n] <= x[n].flatten().topk(int(k[n])).values[-1]
assert top_k_bound(tile_max, torch.tensor([2, 0, 0]), 2)[1] == x[1].max()   # the tie counted twice
print("bound: the k-th largest maximum")
"""


@pytest.mark.interpreted(BOUND_CHECK, "bound: the k-th largest maximum", timeout=200)
def test_top_k_bound_is_the_kth_largest_tile_maximum(request):
    """L, the bound the top-k passes skip tiles by (a bisection over the tile maxima's keys in triton,
    no sort): the k-th largest of a row position's tile maxima over all its splits, equal to the sorted
    maxima's k-th, ties counted, -inf maxima and both signs, -inf for rows asking no top-k or a k past
    the tiles; never above the k-th largest logit of the position (a tile's maximum is an entry)."""
    run_marked(request)


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


def test_triton_thresholds_at_tp2_equal_tp1_in_the_interpreter(tmp_path, monkeypatch):
    """The filters' passes with tensor parallelism: each rank reads its own slice (its own tile maxima and
    top-k bound) and the counts and masses are all-reduced between passes over gloo; both ranks find the
    thresholds torch finds over the whole vocabulary at TP = 1: top-k alone (k = 5: past a rank's 3
    tiles at the kernel's tiling, within its 12 at the small one), top-p alone, both, neither,
    survivors on one rank only, fp32 / T and bf16 softcapped (tests/tp_harness.py filter_case)."""
    pytest.importorskip("triton")
    from model.sampling.filters import torch_threshold
    from tests.tp_harness import filter_case, spawn_tp, triton_filters_worker

    monkeypatch.setenv("TRITON_INTERPRET", "1")   # the spawned ranks' triton runs in its interpreter
    c = filter_case()
    for n, settings in enumerate([(16384, 2048, 512), (512, 256, 128)]):
        out_dir = tmp_path / f"s{n}"
        out_dir.mkdir()
        spawn_tp(triton_filters_worker, 2, tmp_path, str(out_dir), settings, timeout=240)
        ranks = [torch.load(out_dir / f"rank{r}.pt") for r in range(2)]
        for i, (dtype, softcap, on_scaled) in enumerate(c["kinds"]):
            ref = torch_threshold(c["x"].to(dtype), c["temperature"], c["top_k"], c["top_p"], 0, TP1,
                                  softcap=softcap, on_scaled=on_scaled)
            tol = 0 if softcap is None else 1e-5   # the interpreter's tanh is not torch's to the last bit
            for r in range(2):
                got = ranks[r][i]
                assert torch.equal(torch.isinf(ref), torch.isinf(got)), (settings, dtype, r, ref, got)
                assert torch.allclose(ref, got, rtol=tol, atol=0), (settings, dtype, r, ref, got)
            assert torch.isinf(ref[3]).all() and torch.isfinite(ref[[0, 1, 2, 4]]).all()
