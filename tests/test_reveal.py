"""Reveal policies of masked diffusion (docs/spec.md 3.5-3.7) on hand-made inputs."""
import math

import pytest
import torch

from model.sampling import reveal as rv

NEG = -torch.inf


def t(x, dtype=torch.float32):
    return torch.tensor(x, dtype=dtype)


def lg(probs):
    """log of probabilities, the confidence the runner passes."""
    return torch.log(torch.tensor(probs, dtype=torch.float32))


def call(policy, masked, confidence=None, entropy=None, n=0, N=8, tau=0.9, gamma=0.1):
    masked = torch.tensor(masked, dtype=torch.bool)
    R = masked.shape[0]
    if confidence is None:
        confidence = torch.zeros(masked.shape)
    if entropy is None:
        entropy = torch.zeros(masked.shape)
    return rv.POLICIES[policy](masked=masked, confidence=confidence, entropy=entropy,
                               n=torch.full((R,), n), N=torch.full((R,), N),
                               tau=torch.full((R,), tau), gamma=torch.full((R,), gamma))


def on(mask_row):
    return mask_row.nonzero().flatten().tolist()


# ---- threshold -----------------------------------------------------------------------------------

def test_threshold_reveals_confident_masked_positions():
    masked = [[1, 1, 1, 0, 1, 1, 0, 1]]
    #           .95  .6   .4   .99 .5  .2   .97 .55
    conf = lg([[0.95, 0.6, 0.4, 0.99, 0.5, 0.2, 0.97, 0.55]])
    got = call("threshold", masked, conf, tau=0.55)
    assert on(got[0]) == [0, 1, 7]           # p >= tau, masked only (3 and 6 are not masked)


def test_threshold_boundary_is_inclusive():
    conf = torch.log(t([[0.5, 0.4999, 0.2]]))
    got = call("threshold", [[1, 1, 1]], conf, tau=0.5)
    assert on(got[0]) == [0]


def test_threshold_always_reveals_the_single_most_confident():
    masked = [[1, 0, 1, 1, 1]]
    conf = lg([[0.3, 0.99, 0.5, 0.1, 0.45]])   # nothing masked reaches tau
    got = call("threshold", masked, conf, tau=0.9)
    assert on(got[0]) == [2]
    # ties: exactly one, the leftmost
    conf = lg([[0.3, 0.99, 0.5, 0.5, 0.45]])
    assert on(call("threshold", masked, conf, tau=0.9)[0]) == [2]


def test_threshold_rows_use_their_own_tau():
    masked = torch.ones(2, 4, dtype=torch.bool)
    conf = lg([[0.95, 0.85, 0.7, 0.1], [0.95, 0.85, 0.7, 0.1]])
    got = rv.threshold(masked=masked, confidence=conf, n=t([0, 0]), N=t([8, 8]), tau=t([0.9, 0.6]))
    assert on(got[0]) == [0] and on(got[1]) == [0, 1, 2]


def test_threshold_with_runner_style_confidence():
    """The runner passes -inf at unmasked positions."""
    masked = torch.tensor([[0, 1, 1, 0]], dtype=torch.bool)
    conf = torch.where(masked, lg([[0.99, 0.2, 0.3, 0.99]]), NEG)
    assert on(call("threshold", masked.int().tolist(), conf)[0]) == [2]


# ---- low_confidence / leftmost -------------------------------------------------------------------

@pytest.mark.parametrize("n_masked,N,n", [(7, 4, 0), (7, 4, 2), (10, 8, 0), (10, 8, 5), (3, 8, 0), (32, 32, 0),
                                          (31, 16, 0), (12, 4, 3), (12, 4, 9)])
def test_low_confidence_reveals_ceil_k_most_confident(n_masked, N, n):
    C = 32
    gen = torch.Generator().manual_seed(n_masked * 100 + N * 10 + n)
    positions = torch.randperm(C, generator=gen)[:n_masked]
    masked = torch.zeros(1, C, dtype=torch.bool)
    masked[0, positions] = True
    conf = -torch.rand(1, C, generator=gen) * 5            # distinct log-probabilities
    conf[~masked] = 0.0                                    # unmasked: more confident than any mask
    got = call("low_confidence", masked.int().tolist(), conf, n=n, N=N)
    k = min(n_masked, math.ceil(n_masked / max(N - n, 1)))
    assert int(got.sum()) == k
    assert not (got & ~masked).any()
    expected = sorted(positions.tolist(), key=lambda p: -conf[0, p].item())[:k]
    assert sorted(on(got[0])) == sorted(expected)


def test_low_confidence_and_leftmost_k_values():
    masked = [[1] * 7 + [0]]
    conf = lg([[0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.99]])
    # k = ceil(7 / (4 - 0)) = 2
    assert on(call("low_confidence", masked, conf, n=0, N=4)[0]) == [5, 6]
    assert on(call("leftmost", masked, conf, n=0, N=4)[0]) == [0, 1]
    # k = ceil(7 / (4 - 2)) = 4
    assert on(call("low_confidence", masked, conf, n=2, N=4)[0]) == [3, 4, 5, 6]
    assert on(call("leftmost", masked, conf, n=2, N=4)[0]) == [0, 1, 2, 3]
    # k = ceil(7 / 8) = 1
    assert on(call("low_confidence", masked, conf, n=0, N=8)[0]) == [6]
    assert on(call("leftmost", masked, conf, n=0, N=8)[0]) == [0]
    # n past N: k = masked (max(N - n, 1) = 1)
    assert on(call("leftmost", masked, conf, n=9, N=8)[0]) == list(range(7))


def test_leftmost_reveals_first_k_masked_ignoring_confidence():
    masked = [[0, 1, 0, 1, 1, 0, 1, 1]]
    conf = lg([[0.9, 0.01, 0.9, 0.02, 0.99, 0.9, 0.99, 0.99]])
    # 5 masked, N - n = 2 -> k = 3
    assert on(call("leftmost", masked, conf, n=6, N=8)[0]) == [1, 3, 4]
    assert on(call("leftmost", masked, conf, n=0, N=8)[0]) == [1]


# ---- entropy_bound -------------------------------------------------------------------------------

def test_entropy_bound_longest_prefix_within_gamma():
    masked = [[1, 1, 1, 1, 1, 0]]
    H = t([[0.05, 0.01, 0.3, 0.02, 0.5, 0.0]])
    # ascending 0.01, 0.02, 0.05, 0.3, 0.5: sum - max of prefixes = 0, 0.01, 0.03, 0.08, 0.38
    got = call("entropy_bound", masked, entropy=H, gamma=0.1)
    assert on(got[0]) == [0, 1, 2, 3]
    got = call("entropy_bound", masked, entropy=H, gamma=0.02)
    assert on(got[0]) == [1, 3]          # 0.01 + 0.02 - 0.02 = 0.01 <= 0.02; + 0.05: 0.03 > 0.02
    got = call("entropy_bound", masked, entropy=H, gamma=0.5)
    assert on(got[0]) == [0, 1, 2, 3, 4]


def test_entropy_bound_reveals_at_least_one():
    masked = [[1, 1, 1, 0]]
    H = t([[2.0, 1.5, 3.0, 0.0]])
    got = call("entropy_bound", masked, entropy=H, gamma=1e-6)
    assert on(got[0]) == [1]
    got = call("entropy_bound", masked, entropy=H, gamma=1.5)
    assert on(got[0]) == [0, 1]          # 1.5 + 2.0 - 2.0 = 1.5 <= 1.5


def test_entropy_bound_ignores_unmasked_low_entropy_positions():
    masked = [[0, 0, 1, 1, 1]]
    # unmasked positions must not count: ascending masked 0.04, 0.07, 0.2 -> 0, 0.04, 0.11
    for unmasked_h in (0.0, 0.06):
        H = t([[unmasked_h, unmasked_h, 0.04, 0.2, 0.07]])
        got = call("entropy_bound", masked, entropy=H, gamma=0.1)
        assert on(got[0]) == [2, 4]


# ---- unmasked never revealed; last step; mixed rows ----------------------------------------------

@pytest.mark.parametrize("policy", list(rv.POLICIES))
@pytest.mark.parametrize("last", [False, True])
def test_unmasked_positions_never_revealed(policy, last):
    gen = torch.Generator().manual_seed(7)
    masked = torch.rand(4, 32, generator=gen) < 0.5
    masked[3] = False                                            # a row with nothing masked
    conf = torch.zeros(4, 32)                                    # confident everywhere, even unmasked
    conf[masked] = -torch.rand(int(masked.sum()), generator=gen)
    H = torch.rand(4, 32, generator=gen)
    H[~masked] = 0.0
    n = torch.full((4,), 31 if last else 0)
    got = rv.reveal(torch.full((4,), rv.POLICY_IDS[policy]), [policy], masked, n, torch.full((4,), 32),
                    confidence=conf, entropy=H, tau=torch.full((4,), 0.5), gamma=torch.full((4,), 0.1))
    assert not (got & ~masked).any()
    assert (got.sum(-1)[:3] >= 1).all()                           # every row with a mask makes progress
    if last:
        assert torch.equal(got, masked)


@pytest.mark.parametrize("policy", list(rv.POLICIES))
@pytest.mark.parametrize("n,N", [(7, 8), (3, 4), (0, 1), (12, 8)])
def test_last_step_reveals_everything_masked(policy, n, N):
    masked = torch.tensor([[1, 0, 1, 1, 1, 1, 0, 1]], dtype=torch.bool)
    conf = torch.where(masked, lg([[0.1, 0.9, 0.2, 0.05, 0.3, 0.01, 0.9, 0.2]]), NEG)
    H = t([[3.0, 0.0, 2.0, 4.0, 2.5, 5.0, 0.0, 1.0]])            # entropy_bound alone would reveal one
    got = rv.reveal(t([rv.POLICY_IDS[policy]], torch.int64), [policy], masked, t([n], torch.int64),
                    t([N], torch.int64), confidence=conf, entropy=H, tau=t([0.99]), gamma=t([0.01]))
    assert torch.equal(got, masked)
    # one step earlier (when there is one), the policy's own choice: fewer than all
    if n >= 1 and n - 1 + 1 < N:
        before = rv.reveal(t([rv.POLICY_IDS[policy]], torch.int64), [policy], masked, t([n - 1], torch.int64),
                           t([N], torch.int64), confidence=conf, entropy=H, tau=t([0.99]), gamma=t([0.01]))
        assert before.sum() < masked.sum()


def test_reveal_mixed_policies_apply_each_rows_own_policy():
    gen = torch.Generator().manual_seed(11)
    R, C = 8, 32
    masked = torch.rand(R, C, generator=gen) < 0.7
    conf = torch.where(masked, -torch.rand(R, C, generator=gen) * 3, NEG)
    conf[:, 5] = torch.where(masked[:, 5], -0.01, NEG)           # a few confident enough for threshold
    H = torch.rand(R, C, generator=gen) * 0.2
    names = list(rv.POLICIES)
    policy = torch.tensor([rv.POLICY_IDS[names[r % 4]] for r in range(R)])
    n = torch.tensor([0, 1, 2, 3, 0, 5, 2, 7])
    N = torch.tensor([8, 8, 4, 16, 2, 8, 3, 8])                  # the last row is on its last step
    tau = torch.full((R,), 0.9)
    gamma = torch.full((R,), 0.15)
    got = rv.reveal(policy, names, masked, n, N, confidence=conf, entropy=H, tau=tau, gamma=gamma)
    for r in range(R):
        own = rv.POLICIES[names[r % 4]](masked=masked[r:r + 1], confidence=conf[r:r + 1], entropy=H[r:r + 1],
                                        n=n[r:r + 1], N=N[r:r + 1], tau=tau[r:r + 1], gamma=gamma[r:r + 1])[0]
        if n[r] + 1 >= N[r]:
            own = masked[r]
        assert torch.equal(got[r], own), (r, names[r % 4])
        # and the same row alone gives the same answer
        alone = rv.reveal(policy[r:r + 1], [names[r % 4]], masked[r:r + 1], n[r:r + 1], N[r:r + 1],
                          confidence=conf[r:r + 1], entropy=H[r:r + 1], tau=tau[r:r + 1], gamma=gamma[r:r + 1])
        assert torch.equal(alone[0], got[r])
    # the policies really disagree on these inputs (otherwise the test above proves nothing)
    choices = {name: rv.POLICIES[name](masked=masked, confidence=conf, entropy=H, n=n, N=N, tau=tau, gamma=gamma)
               for name in names}
    for a in names:
        for b in names:
            if a < b:
                assert not torch.equal(choices[a], choices[b]), (a, b)
