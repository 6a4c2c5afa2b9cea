"""The sampler's triton passes (model/kernels/vocab_stats.py, model/kernels/filters.py) under triton's
CPU interpreter against the torch passes they replace on CUDA, token for token: the statistics, the rank
and top-k scores, the filters' thresholds and their top-k bound. Run under TRITON_INTERPRET=1 only
(tests/test_interpreted_kernels.py); the torch passes are tests/test_vocab_stats.py's, TP = 2 test_interpreted_filters_tp.py's."""
import pytest
import torch

pytest.importorskip("triton")

import model.kernels.filters as F
from model.kernels.filters import top_k_bound, triton_threshold
from model.kernels.vocab_stats import TRITON_PASSES, triton_rank_top_k
from model.parallel.group import TPGroup
from model.sampling import stats as S
from model.sampling.filters import torch_threshold


def test_triton_pass_equals_torch_pass_in_the_interpreter():
    torch.manual_seed(0)
    for R, P, V, softcap, soft, vs, dtype in [(2, 3, 997, None, None, 0, torch.float32),
                                               (2, 2, 5000, 30.0, torch.bfloat16, 100, torch.bfloat16),
                                               (3, 1, 40000, None, None, 7, torch.float32)]:
        x = (torch.randn(R, P, V) * 4).to(dtype)
        x[0, 0, 5] = float("-inf")
        # ties for a row's maximum, 2048 apart (one lane of two of the kernel's tiles) and in different
        # lanes: the lower id wins
        x[1, 0, 10] = x[1, 0, 10 + min(2048, V // 2)] = x[1, 0].max() + 1
        x[0, P - 1, min(4000, V - 1)] = x[0, P - 1, 100] = x[0, P - 1].max() + 1
        temp = torch.tensor([0.7, 0.0, 1.3][:R])
        seed, counter = torch.tensor([5, 2**40 + 3, 9][:R]), torch.tensor([3, 1, 0][:R])
        thr = torch.full((R, P), -float("inf"))
        thr[0] = 2.0
        for threshold in (None, thr):
            kw = dict(softcap=softcap, threshold=threshold, soft_dtype=soft)
            a = S.vocab_stats(x, temp, seed, counter, vs, TPGroup(), **kw)
            b = S.vocab_stats(x, temp, seed, counter, vs, TPGroup(), passes=TRITON_PASSES, **kw)
            assert torch.equal(a.greedy, b.greedy) and torch.equal(a.sample, b.sample), (R, P, V)
            assert b.greedy[1, 0] == vs + 10 and b.greedy[0, P - 1] == vs + 100, (R, P, V)
            for f in ("max_u", "lse_u", "lse_s", "entropy_u", "entropy_s", "lse_soft", "x_sample"):
                d = (getattr(a, f) - getattr(b, f)).abs().max().item()
                assert d < 1e-5 * max(1.0, getattr(a, f).abs().max().item()), (f, d)
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


def test_triton_rank_top_k_equals_torch_in_the_interpreter():
    """The scored rows' second read (rank counts and top-k keys by per-tile sort and merge) equals the
    torch reference exactly, over several tiles and splits, ties and a slice narrower than k."""
    torch.manual_seed(0)
    # the interpreter's time goes by tiles (each k > 0 sorts and merges every one): tiles of 64 in
    # splits of 128 make 300 entries 3 splits (the last a ragged 44: a tile and a wholly masked one) and
    # 200 entries 2 (the last a ragged 72), several tiles a split as in the served splits of 16384
    for V, vs, dtype, ks in [(300, 0, torch.float32, (0, 1, 20)), (200, 100, torch.bfloat16, (0, 5))]:
        x = (torch.randn(2, 2, V) * 4).to(dtype)
        x[0, 0, 5] = float("-inf")
        x[1, 0, 50] = x[1, 0, V - 20] = x[1, 0].max()          # a tie across splits: the lower id first
        tok = x[..., 11]
        for k in ks:
            ca, ka = S.torch_rank_top_k(x, tok, k, vs)
            cb, kb = triton_rank_top_k(x, tok, k, vs, block=64, split=128)   # several tiles and splits
            assert torch.equal(ca, cb) and (k == 0 or torch.equal(ka, kb)), (V, k)
        narrow = x[..., :12]                                     # a slice narrower than k: padded alike
        ca, ka = S.torch_rank_top_k(narrow, tok, 20, vs)
        cb, kb = triton_rank_top_k(narrow, tok, 20, vs)
        assert torch.equal(ca, cb) and torch.equal(ka, kb)


def test_triton_thresholds_equal_torch_in_the_interpreter(monkeypatch):
    """The filters' radix select over the raw logits' keys (model/kernels/filters.py) finds the thresholds
    torch's select over the decided values finds: top-k, top-p, both and neither, fp32 logits divided by
    T and bf16 logits softcapped, a tie, -inf entries, a vocabulary offset, a saturated softcap,
    several splits and tiles a row, negative bf16 thresholds and a k-th largest logit of -inf."""
    torch.manual_seed(0)
    # rows: top-k only, top-p only, both, neither, k past the vocabulary; a tie at a row's 3rd largest;
    # -inf entries; a vocabulary offset; logits large enough that the softcap's tanh rounds to 1 (equal
    # values of distinct logits); the kernel's own tiling (one split of 6, 5 and 4 tiles, the last
    # ragged: k = 3 within a row's tiles, k = 5 within and past them), and small splits and tiles (2 a
    # row, the last ragged). The interpreter's time goes by programs (row positions x splits): one
    # position a row, each row's case in it (the negative thresholds below take 2: a position's row is
    # n // P), and 2 small splits, not 3
    cases = [(0, torch.float32, None, True, 4), (64, torch.bfloat16, 30.0, False, 4),
             (0, torch.float32, 30.0, True, 200)]
    for split, count_block, mass_block, sizes in [(F.SPLIT, F.COUNT_BLOCK, F.MASS_BLOCK, (3000, 2500, 1800)),
                                                  (1024, 512, 256, (2000, 1500, 1800))]:
        monkeypatch.setattr(F, "SPLIT", split)
        monkeypatch.setattr(F, "COUNT_BLOCK", count_block)
        monkeypatch.setattr(F, "MASS_BLOCK", mass_block)
        for V, (vs, dtype, softcap, on_scaled, scale) in zip(sizes, cases):
            x = (torch.randn(5, 1, V) * scale).to(dtype)
            x[0, 0, 5] = float("-inf")
            x[1, 0, :100] = float("-inf")
            top = x[2, 0].topk(3).values
            x[2, 0, :2] = top[2]
            temp = torch.tensor([0.7, 0.0, 1.3, 1.0, 2.0])
            top_k, top_p = torch.tensor([5, 0, 3, 0, 4000]), torch.tensor([1.0, 0.6, 0.9, 1.0, 0.3])
            a = torch_threshold(x, temp, top_k, top_p, vs, TPGroup(), softcap=softcap, on_scaled=on_scaled)
            b = triton_threshold(x, temp, top_k, top_p, vs, TPGroup(), softcap=softcap, on_scaled=on_scaled)
            assert (torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a[3]).all()
                    and torch.isfinite(a[:3]).all())
            tol = 0 if softcap is None else 1e-5   # the interpreter's tanh is not torch's to the last bit
            assert torch.allclose(a, b, rtol=tol, atol=0), (split, V, dtype, a, b)
    # bf16 logits below 0, so the thresholds are negative (a negative key's dropped low bits must decode
    # back as zeros: the last mass pass weighs each key by its value), and, undivided, a k-th largest that
    # is -inf (at the small tiles still: 2 splits, the second all -inf in that row)
    for softcap, on_scaled in [(None, True), (30.0, False)]:
        x = (torch.randn(4, 2, 2000) * 1.5 - 8).to(torch.bfloat16)
        if softcap is None:
            x[0, 1, 3:] = float("-inf")   # 3 finite entries and k = 5
        temp = torch.tensor([1.0, 0.7, 1.0, 0.0])
        top_k, top_p = torch.tensor([5, 0, 40, 3]), torch.tensor([1.0, 0.9, 0.8, 0.5])
        a = torch_threshold(x, temp, top_k, top_p, 0, TPGroup(), softcap=softcap, on_scaled=on_scaled)
        b = triton_threshold(x, temp, top_k, top_p, 0, TPGroup(), softcap=softcap, on_scaled=on_scaled)
        assert torch.equal(torch.isinf(a), torch.isinf(b)) and not b.isnan().any() and (a[a.isfinite()] < 0).all()
        assert torch.allclose(a, b, rtol=0 if softcap is None else 1e-5, atol=0), (softcap, a, b)


def test_triton_thresholds_from_cached_tile_maxima_in_the_interpreter(monkeypatch):
    """Passes decide a tile from its cached maximum (read first for every row asking a filter): rows
    asking top-k only, top-p only, both and neither in one batch, the survivors clustered in one tile
    (later passes skip the rest), several splits, a ragged last split and tile, a split narrower than
    SPLIT."""
    torch.manual_seed(2)
    # count tiles of 4 cached tiles, 8 a split; V=1850: 2 splits, the last one partial (a ragged tile of
    # 58, a tile past the vocabulary); V=700: one split narrower than SPLIT (a count tile half past its
    # end). (2 splits, not 3: the interpreter's time goes by programs, row positions x splits)
    monkeypatch.setattr(F, "SPLIT", 1024)
    monkeypatch.setattr(F, "COUNT_BLOCK", 512)
    monkeypatch.setattr(F, "MASS_BLOCK", 128)
    temp = torch.tensor([0.7, 1.0, 1.3, 1.0, 0.0, 2.0])
    top_k = torch.tensor([5, 0, 7, 0, 3, 0])           # k only, p only, both, neither, both, p only
    top_p = torch.tensor([1.0, 0.8, 0.7, 1.0, 0.95, 0.5])
    cases = [(1850, torch.bfloat16, 30.0, False), (1850, torch.float32, None, True), (700, torch.float32, None, True)]
    for V, dtype, softcap, on_scaled in cases:
        x = torch.randn(6, 2, V)
        for r in range(6):
            for q in range(2):   # the top-k survivors and the top-p mass in one cluster: at position 0 in the
                # first tile, the middle (a tile of its own) or the ragged last tile, each placement for 2
                # rows of different asks; at position 1 anywhere
                at = [0, V // 2, V - 12][r % 3] if q == 0 else torch.randint(0, V - 12, ()).item()
                x[r, q, at:at + 12] = 12 + torch.randn(12)
        x[1, 0, 128:256] = float("-inf")   # a whole tile of -inf
        x = x.to(dtype)
        a = torch_threshold(x, temp, top_k, top_p, 17, TPGroup(), softcap=softcap, on_scaled=on_scaled)
        b = triton_threshold(x, temp, top_k, top_p, 17, TPGroup(), softcap=softcap, on_scaled=on_scaled)
        assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.isinf(a[3]).all()
        assert torch.isfinite(a[[0, 1, 2, 4, 5]]).all()
        tol = 0 if softcap is None else 1e-5
        assert torch.allclose(a, b, rtol=tol, atol=0), (V, dtype, a, b)


def test_triton_scores_skip_rows_that_asked_none_in_the_interpreter():
    """A graph's plan scores every row; the kernel computes only what each row's request asked for."""
    torch.manual_seed(1)
    x = torch.randn(3, 2, 600) * 4
    tok = x[..., 7]
    asked = torch.tensor([4, -1, 0])   # top 4; no scores; the rank only
    ca, ka = S.torch_rank_top_k(x, tok, 4, 0)
    cb, kb = triton_rank_top_k(x, tok, 4, 0, asked=asked, block=64, split=256)
    assert torch.equal(ca[0], cb[0]) and torch.equal(ka[0], kb[0]) and torch.equal(ca[2], cb[2])
    assert (cb[1] == 0).all() and not torch.equal(ka[2], kb[2])   # skipped work leaves nothing computed


def test_top_k_bound_is_the_kth_largest_tile_maximum():
    """L, the bound the top-k passes skip tiles by (a bisection over the tile maxima's keys in triton,
    no sort): the k-th largest of a row position's tile maxima over all its splits, equal to the sorted
    maxima's k-th, ties counted, -inf maxima and both signs, -inf for rows asking no top-k or a k past
    the tiles; never above the k-th largest logit of the position (a tile's maximum is an entry)."""
    torch.manual_seed(0)
    x = torch.randn(6, 2, 4, 8)   # [R * P: 3 rows of 2 positions, splits, tiles, entries]
    x[1, 0, 0, 3] = x[1, 0, 1, 5] = x[1].max() + 1   # a tie at the top, in two tiles
    x[0, 1] = -torch.inf                              # a split of -inf (a slice's padding)
    x[3, :, :, :4] = -x[3, :, :, :4].abs()            # maxima of both signs
    tile_max = x.amax(-1)
    ranked = tile_max.flatten(1).sort(dim=1, descending=True).values   # the reference: sorted maxima
    for top_k in (torch.tensor([3, 0, 9]), torch.tensor([2, 0, 0]), torch.tensor([1, 8, 5]),
                  torch.tensor([6, 7, 0])):
        bound = top_k_bound(tile_max, top_k, 2)
        k = top_k.repeat_interleave(2)
        for n in range(6):
            want = ranked[n, k[n] - 1] if 0 < k[n] <= 8 else -torch.inf
            assert bound[n] == want, (top_k, n, bound[n], want)
            if 0 < k[n] <= 8:   # never above the k-th largest logit of the position (a maximum is an entry)
                assert bound[n] <= x[n].flatten().topk(int(k[n])).values[-1]
    assert top_k_bound(tile_max, torch.tensor([2, 0, 0]), 2)[1] == x[1].max()   # the tie counted twice
