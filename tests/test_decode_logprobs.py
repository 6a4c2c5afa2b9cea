"""Logprobs semantics of masked diffusion on the tiny checkpoint (docs/spec.md 3, 6): every emitted token's
score comes from the distribution of the step that revealed it (`log_softmax(filtered logits / T)`,
greedy T = 1), is captured at reveal time and never rewritten."""
import pytest
import torch

from model.attention import PagedKVCache, StepContext, step_context
from model.loader import load_model
from model.phases import COMMIT, DENOISE
from model.protocol import Command, NewSlot
from model.runner import Runner
from model.sampling import noise
from model.sampling import reveal as rv
from model.sampling.params import DecodeParams
from tests import served
from workers.engine import Engine

MASK, C, V = 100, 32, 997
PROMPT = (1, 5, 6, 7, 8)
SPEC_PROMPTS = ([159] * 8, [1, 547, 258, 547, 258])


class StepRecorder:
    """A runner's observer that keeps, per step, the logits and canvas of every denoise and causal
    (prefill / commit) row, and the canvas scores before and after each denoise step, in the shape
    of one trace entry per step kind: denoise rows {slots, logits [R, C, V], before, after, scores_before,
    scores, n, draws, seeds, lengths}; causal rows {slots, logits [R, V] of the predicting position,
    seed_token, scores}."""

    def __init__(self, runner):
        self.runner = runner
        self.trace: list[dict] = []
        self.admitted: dict[int, int] = {}   # request seed -> slot
        self._before = None
        runner.observer = self

    def _score_state(self, idx):
        b = self.runner.slots.canvas_scores
        return dict(lp=b.logprob[idx].clone(), rank=b.rank[idx].clone(), tv=b.top_values[idx].clone(),
                    ti=b.top_ids[idx].clone())

    def __call__(self, event, kind, idx, logits=None):
        t = self.runner.slots
        if event == "before":
            for s, seed in zip(idx.tolist(), t.seed[idx].tolist()):
                self.admitted.setdefault(seed, s)
            self._before = dict(phase=t.phase[idx].clone(), canvas=t.canvas[idx].clone(), n=t.n[idx].tolist(),
                                draws=t.draws[idx].tolist(), seeds=t.seed[idx].tolist(),
                                lengths=t.length[idx].tolist(), scores=self._score_state(idx),
                                logits=logits.float().clone())
            return
        b, slots = self._before, idx.tolist()
        after, scores = t.canvas[idx].clone(), self._score_state(idx)
        pick = lambda d, rows: {k: v[rows] for k, v in d.items()}  # noqa: E731
        if kind == "canvas":
            rows = [i for i, p in enumerate(b["phase"].tolist()) if p == DENOISE]
            if rows:
                self.trace.append(dict(kind="denoise", slots=[slots[i] for i in rows], logits=b["logits"][rows],
                                       before=b["canvas"][rows], after=after[rows],
                                       scores_before=pick(b["scores"], rows), scores=pick(scores, rows),
                                       n=[b["n"][i] for i in rows], draws=[b["draws"][i] for i in rows],
                                       seeds=[b["seeds"][i] for i in rows], lengths=[b["lengths"][i] for i in rows]))
            rows = [i for i, p in enumerate(b["phase"].tolist()) if p == COMMIT]
            position = C - 1
        else:
            rows = list(range(len(slots))) if kind == "prefill" else []
            position = 0
        if rows:
            self.trace.append(dict(kind="causal", slots=[slots[i] for i in rows],
                                   logits=b["logits"][rows, position], seed_token=after[rows, 0],
                                   scores=pick(scores, rows)))


def recording_runner(model, **kw):
    runner = Runner(model, **kw)
    StepRecorder(runner)
    return runner


def reference_scaled(logits, params: DecodeParams):
    """Dense reference of SPEC 3.2 on full-vocabulary logits [..., V]: logits / T (greedy: T = 1), then
    top-k and top-p (ties kept); filtered entries -inf."""
    T = params.effective_temperature or 1.0
    s = logits / T
    if params.top_k:
        kth = torch.sort(s, -1, descending=True).values[..., params.top_k - 1: params.top_k]
        s = torch.where(s >= kth, s, -torch.inf)
    if params.top_p < 1:
        probs = torch.softmax(s, -1)
        order = torch.sort(s, -1, descending=True)
        cum = torch.cumsum(torch.gather(probs, -1, order.indices).double(), -1)
        m = (cum < params.top_p).sum(-1, keepdim=True).clamp(max=s.shape[-1] - 1)
        s = torch.where(s >= torch.gather(order.values, -1, m), s, -torch.inf)
    return s


def expected_scores(logits, token, params, k):
    """(logprob, rank, top-k logprobs, top-k ids) of `token` under Categorical(logits=scaled)."""
    s = reference_scaled(logits, params)
    dist = torch.distributions.Categorical(logits=s)
    lp = dist.log_prob(torch.tensor(token)).item()
    rank = 1 + int((s > s[token]).sum())
    top = torch.topk(torch.log_softmax(s, -1), k) if k else None
    return lp, rank, top


@pytest.fixture(scope="module")
def model(tiny_nemotron):
    return load_model(tiny_nemotron, show_progress=False)


def drive(runner, admits, budget):
    """Runs one step per command until every admitted slot emitted `budget` tokens (a slot that has is
    released, as the scheduler would); returns the blocks per slot."""
    emitted = {a.slot: [] for a in admits}
    cmd = Command(admit=tuple(admits), max_steps=1)
    for _ in range(400):
        events = runner.execute(cmd)
        done = []
        for block in events.blocks:
            emitted[block.slot].append(block)
            if sum(len(b.tokens) for b in emitted[block.slot]) >= budget:
                done.append(block.slot)
        cmd = Command(release=tuple(done), max_steps=1)
        if all(sum(len(b.tokens) for b in emitted[s]) >= budget for s in emitted):
            return emitted
    raise AssertionError("did not finish")


# ---- (a) captured at reveal, never rewritten -----------------------------------------------------

@pytest.fixture(scope="module")
def stepped(model):
    runner = recording_runner(model, num_slots=3, max_model_len=256)
    p0 = DecodeParams(max_tokens=64, temperature=0.8, seed=11, logprobs=3, policy="low_confidence",
                      max_denoising_steps=8, ignore_eos=True)
    p1 = DecodeParams(max_tokens=64, temperature=1.0, seed=12, policy="threshold", threshold=0.5,
                      max_denoising_steps=8, ignore_eos=True)          # a neighbour that asks for nothing
    p2 = DecodeParams(max_tokens=64, temperature=1.0, seed=13, logprobs=5, top_k=30, top_p=0.9,
                      policy="leftmost", max_denoising_steps=8, ignore_eos=True, seed_first_position=False)
    admits = [NewSlot(0, PROMPT, p0, 11), NewSlot(1, PROMPT[:3], p1, 12), NewSlot(2, PROMPT + (9,), p2, 13)]
    blocks = drive(runner, admits, 64)
    return runner.observer, admits, blocks


def test_scores_written_at_reveal_from_that_steps_distribution(stepped):
    runner, admits, _ = stepped
    params = {a.slot: a.params for a in admits}
    checked = 0
    for step in runner.trace:
        if step["kind"] != "denoise":
            continue
        for i, s in enumerate(step["slots"]):
            p = params[s]
            before, after = step["before"][i], step["after"][i]
            new = (before == MASK) & (after != MASK)
            assert new.any(), "every denoise step reveals at least one position"
            assert torch.equal(after[before != MASK], before[before != MASK]), "revealed tokens are absorbing"
            if p.logprobs is None:
                continue
            for pos in new.nonzero().flatten().tolist():
                tok = int(after[pos])
                lp, rank, top = expected_scores(step["logits"][i, pos], tok, p, p.logprobs)
                sc = step["scores"]
                assert sc["lp"][i, pos].item() == pytest.approx(lp, abs=1e-5)
                assert sc["rank"][i, pos].item() == rank
                assert torch.allclose(sc["tv"][i, pos, :p.logprobs], top.values, atol=1e-5)
                assert sc["ti"][i, pos, :p.logprobs].tolist() == top.indices.tolist()
                checked += 1
    assert checked >= 60


def test_scores_never_rewritten_after_reveal(stepped):
    runner, admits, _ = stepped
    for step in runner.trace:
        if step["kind"] != "denoise":
            continue
        for i, s in enumerate(step["slots"]):
            if s == 1:          # asked for no scores: nothing to preserve
                continue
            old = step["before"][i] != MASK
            for key in ("lp", "rank", "tv", "ti"):
                assert torch.equal(step["scores"][key][i][old], step["scores_before"][key][i][old]), key


def test_emitted_block_scores_are_the_reveal_time_scores(stepped):
    """Replays the trace: per slot and canvas, the score each position got when it was revealed (or, for
    a seeded position 0, when the causal pass predicted it), compared with the emitted blocks."""
    runner, admits, blocks = stepped
    params = {a.slot: a.params for a in admits}
    canvases = {s: [] for s in params}       # finished canvases: list of (tokens, logprobs)
    current = {}
    for step in runner.trace:
        for i, s in enumerate(step["slots"]):
            if step["kind"] == "causal":
                if s in current:
                    canvases[s].append(current[s])
                tok = [None] * C
                lp = [None] * C
                if params[s].seed_first_position:
                    tok[0] = int(step["seed_token"][i])
                    if params[s].logprobs is not None:
                        lp[0] = expected_scores(step["logits"][i], tok[0], params[s], 0)[0]
                current[s] = (tok, lp)
            else:
                tok, lp = current[s]
                new = (step["before"][i] == MASK) & (step["after"][i] != MASK)
                for pos in new.nonzero().flatten().tolist():
                    assert tok[pos] is None, "a position is revealed once"
                    tok[pos] = int(step["after"][i, pos])
                    if params[s].logprobs is not None:
                        lp[pos] = expected_scores(step["logits"][i, pos], tok[pos], params[s], 0)[0]
    for s, bl in blocks.items():
        assert len(bl) == 2 and [len(b.tokens) for b in bl] == [C, C]
        for b, (tok, lp) in zip(bl, canvases[s]):
            assert b.tokens == tok
            assert MASK not in b.tokens
            if params[s].logprobs is None:
                assert b.logprobs is None and b.ranks is None and b.top_ids is None
            else:
                assert b.logprobs == pytest.approx(lp, abs=1e-5)
                assert len(b.ranks) == len(b.top_ids) == len(b.top_logprobs) == C
                assert all(len(t) == params[s].logprobs for t in b.top_ids)


def test_recorded_logits_are_those_of_the_canvas_before_the_step(stepped, model):
    """The distribution a position is scored with is the model's output for the canvas state *before*
    the step (prefix KV + bidirectional canvas), recomputed here with an independent forward."""
    runner, admits, blocks = stepped
    prompt = {a.slot: list(a.prompt) for a in admits}
    denoise = [st for st in runner.trace if st["kind"] == "denoise"]
    picks = [denoise[1], denoise[len(denoise) // 2 + 1]]     # one step in each canvas
    layers, hkv, d = model.kv_shape
    for step in picks:
        for i, s in enumerate(step["slots"]):
            length = step["lengths"][i]
            committed = [t for b in blocks[s] for t in b.tokens]
            prefix = (prompt[s] + committed)[:length]
            assert len(prefix) == length
            kv = PagedKVCache.per_slot([(hkv, d)] * layers, 1, 256, torch.float32, "cpu")
            with torch.inference_mode():
                ctx = StepContext.build(kv, [0], [0], [length], [True], length, "cpu")
                with step_context(ctx):
                    model(torch.tensor([prefix]), torch.arange(length)[None])
                ctx = StepContext.build(kv, [0], [length], [C], [False], C, "cpu")
                with step_context(ctx):
                    h = model(step["before"][i][None], torch.arange(length, length + C)[None])
                logits = model.head_logits(h).float()[0].clone()
                logits[:, MASK] = -torch.inf
            assert torch.allclose(logits, step["logits"][i], atol=1e-4)


def check_reveals_follow_spec(runner, params_of_slot):
    """SPEC 3.2-3.5 recomputed from each recorded step's logits: x0 = argmax(filtered logits / T + Gumbel
    of the request's own (seed, draw counter)) (greedy: argmax), confidence = logp(x0) under the unscaled
    filtered distribution, the request's policy on it; the runner's canvas after the step must agree."""
    checked = 0
    for step in runner.trace:
        if step["kind"] != "denoise":
            continue
        for i, s in enumerate(step["slots"]):
            p = params_of_slot[s]
            logits = step["logits"][i]
            scaled = reference_scaled(logits, p)
            unscaled = torch.where(torch.isfinite(scaled), logits, -torch.inf)
            if p.effective_temperature > 0:
                g = noise.gumbel(torch.tensor([step["seeds"][i]]), torch.tensor([step["draws"][i]]), C, 0, V)[0]
                x0 = torch.argmax(scaled + g, -1)
            else:
                x0 = torch.argmax(scaled, -1)
            logp = torch.log_softmax(unscaled, -1)
            masked = step["before"][i] == MASK
            confidence = torch.where(masked, logp.gather(-1, x0[:, None])[:, 0], -torch.inf)
            probs = logp.exp()
            entropy = -torch.where(probs > 0, probs * logp, 0).sum(-1)
            N = p.steps_for(C)
            chosen = rv.reveal(torch.tensor([rv.POLICY_IDS[p.policy]]), [p.policy], masked[None],
                               torch.tensor([step["n"][i]]), torch.tensor([N]), confidence=confidence[None],
                               entropy=entropy[None], tau=torch.tensor([p.threshold]),
                               gamma=torch.tensor([p.reveal_entropy_bound]))[0]
            expected = torch.where(chosen, x0, step["before"][i])
            assert torch.equal(step["after"][i], expected), (s, step["n"][i])
            checked += 1
    return checked


def test_runner_reveals_follow_spec_3(stepped):
    runner, admits, _ = stepped
    assert check_reveals_follow_spec(runner, {a.slot: a.params for a in admits}) >= 40


# ---- (b) temperatures in one batch ---------------------------------------------------------------

TEMPS = [0.0, 0.5, 2.0]


@pytest.fixture(scope="module")
def engine_run(tiny_nemotron, model):
    engine = Engine(tiny_nemotron, num_slots=4, max_model_len=256)
    runner = recording_runner(model, num_slots=4, max_model_len=256)
    engine.shards.runner = runner
    ps = [DecodeParams(max_tokens=32, temperature=T, seed=100 + i, logprobs=4, ignore_eos=True)
          for i, T in enumerate(TEMPS)]
    # (no top_p < 1 here: see test_top_p_neighbour_does_not_change_a_request)
    ps.append(DecodeParams(max_tokens=32, temperature=1.0, seed=200, logprobs=2, ignore_eos=True, top_k=12,
                           policy="entropy_bound", entropy_bound=0.5))
    requests = served.generate(engine, [PROMPT, PROMPT[:2], PROMPT + (11, 12), PROMPT], ps)
    return engine, runner.observer, requests


def replay(runner, slot, params, n_tokens):
    """Expected (tokens, logprobs, ranks) of one slot's emitted tokens from the recorded trace."""
    toks, lps, ranks, cur = [], [], [], None
    for step in runner.trace:
        if slot not in step["slots"]:
            continue
        i = step["slots"].index(slot)
        if step["kind"] == "causal":
            if cur is not None:
                for t, lp, r in cur:
                    toks.append(t), lps.append(lp), ranks.append(r)
            cur = [None] * C
            if params.seed_first_position:
                t0 = int(step["seed_token"][i])
                cur[0] = (t0, *expected_scores(step["logits"][i], t0, params, 0)[:2])
        else:
            new = (step["before"][i] == MASK) & (step["after"][i] != MASK)
            for pos in new.nonzero().flatten().tolist():
                t = int(step["after"][i, pos])
                cur[pos] = (t, *expected_scores(step["logits"][i, pos], t, params, 0)[:2])
    for t, lp, r in filter(None, cur or []):   # the last canvas: emitted as it converged, no commit after it
        toks.append(t), lps.append(lp), ranks.append(r)
    return toks[:n_tokens], lps[:n_tokens], ranks[:n_tokens]


def test_logprobs_follow_each_rows_temperature(engine_run):
    engine, runner, requests = engine_run
    for r in requests:
        slot = runner.admitted[r.seed]
        assert len(r.output) == 32 and r.finish_reason == "length"
        toks, lps, ranks = replay(runner, slot, r.params, 32)
        assert r.output == toks
        assert r.logprobs == pytest.approx(lps, abs=1e-4)
        assert r.ranks == ranks
        if r.params.temperature == 0:
            assert all(k == 1 for k in r.ranks), "greedy tokens are the argmax"
    # the temperatures really matter: the same tokens would score differently at T = 1
    by_t = {r.params.temperature: r for r in requests}
    hot = by_t[2.0]
    _, lps_t1, _ = replay(runner, runner.admitted[hot.seed], DecodeParams(temperature=1.0), 32)
    assert max(abs(a - b) for a, b in zip(hot.logprobs, lps_t1)) > 0.1
    assert sum(by_t[2.0].logprobs) < sum(by_t[0.5].logprobs)


def test_engine_reveals_follow_spec_3(engine_run):
    _, runner, requests = engine_run
    params = {runner.admitted[r.seed]: r.params for r in requests}
    assert check_reveals_follow_spec(runner, params) >= 40


def test_filtered_row_scores_use_the_filtered_distribution(engine_run):
    _, runner, requests = engine_run
    r = requests[-1]
    assert r.params.top_k == 12
    assert all(1 <= k <= 12 for k in r.ranks)       # sampled from the top-12
    # renormalised over the top 12: the two alternatives carry more than they would unfiltered
    slot = runner.admitted[r.seed]
    step = next(st for st in runner.trace if st["kind"] == "denoise" and slot in st["slots"])
    i = step["slots"].index(slot)
    full = torch.log_softmax(step["logits"][i], -1).topk(2).values
    filtered = torch.log_softmax(reference_scaled(step["logits"][i], r.params), -1).topk(2).values
    assert (filtered > full + 1e-3).all()
    assert torch.allclose(step["scores"]["tv"][i, :, :2][step["after"][i] != step["before"][i]],
                          filtered[step["after"][i] != step["before"][i]], atol=1e-5)


# ---- isolation (SPEC 6) --------------------------------------------------------------------------

def test_request_is_isolated_from_its_neighbours(tiny_nemotron):
    """Same tokens and scores alone or next to requests with other temperatures, logprobs, top-k,
    policies, modes and lengths."""
    engine = Engine(tiny_nemotron, num_slots=6, max_model_len=256)
    target = DecodeParams(max_tokens=40, temperature=0.7, seed=77, logprobs=3, ignore_eos=True,
                          policy="low_confidence", max_denoising_steps=8)
    (alone,) = served.generate(engine, [PROMPT], target)
    neighbours = [DecodeParams(max_tokens=9, temperature=0.0, seed=1, logprobs=20, top_k=3),
                  DecodeParams(max_tokens=64, temperature=2.0, seed=2, ignore_eos=True, max_denoising_steps=4),
                  DecodeParams(mode="ar", max_tokens=20, temperature=1.0, seed=3, logprobs=1, ignore_eos=True),
                  DecodeParams(mode="linear_spec", max_tokens=30, seed=4, ignore_eos=True),
                  DecodeParams(max_tokens=33, temperature=1.0, seed=5, policy="entropy_bound", logprobs=0)]
    rs = served.generate(engine, [PROMPT[:2], PROMPT + (9,) * 30, PROMPT, PROMPT, PROMPT + (3,), PROMPT],
                         neighbours[:3] + [target] + neighbours[3:])
    batched = rs[3]
    assert batched.output == alone.output
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)
    assert batched.ranks == alone.ranks and batched.top_ids == alone.top_ids
    assert batched.denoising_steps == alone.denoising_steps


def test_top_p_neighbour_does_not_change_a_request(tiny_nemotron):
    engine = Engine(tiny_nemotron, num_slots=2, max_model_len=256)
    target = DecodeParams(max_tokens=64, temperature=0.5, seed=0, logprobs=2, ignore_eos=True)
    (alone,) = served.generate(engine, [PROMPT], target)
    batched = served.generate(engine, [PROMPT, [1, 9]], [target, DecodeParams(max_tokens=64, seed=99, top_p=0.8,
                                                                              ignore_eos=True)])[0]
    assert batched.output == alone.output
    assert batched.logprobs == pytest.approx(alone.logprobs, abs=1e-4)


# ---- (c) structure of what is returned -----------------------------------------------------------

@pytest.fixture(scope="module")
def structure_run(tiny_nemotron):
    engine = Engine(tiny_nemotron, num_slots=8, max_model_len=256)
    specs = [
        dict(logprobs=5, temperature=1.0, seed=1, max_tokens=40),
        dict(logprobs=1, temperature=0.0, seed=2, max_tokens=20, policy="low_confidence", max_denoising_steps=8),
        dict(logprobs=0, temperature=0.7, seed=3, max_tokens=33, policy="leftmost", max_denoising_steps=4),
        dict(logprobs=20, temperature=1.5, seed=4, max_tokens=17, top_k=50, policy="entropy_bound"),
        dict(logprobs=None, temperature=1.0, seed=5, max_tokens=24),
        dict(logprobs=3, mode="ar", temperature=0.8, seed=6, max_tokens=12),
        dict(logprobs=3, mode="linear_spec", seed=7, max_tokens=40),
        dict(logprobs=3, mode="ar", temperature=0.0, seed=8, max_tokens=40),
        dict(logprobs=3, mode="linear_spec", seed=9, max_tokens=40),
        dict(logprobs=3, mode="ar", temperature=0.0, seed=10, max_tokens=40),
    ]
    ps = [DecodeParams(ignore_eos=True, **s) for s in specs]
    # the last four: prompts on which the tiny model's drafts get a 2-token block accepted now and then
    prompts = [PROMPT] * (len(ps) - 4) + [SPEC_PROMPTS[0]] * 2 + [SPEC_PROMPTS[1]] * 2
    return served.generate(engine, prompts, ps)


def test_one_score_per_token_ranks_and_top_logprobs(structure_run):
    for r in structure_run:
        k = r.params.logprobs
        assert len(r.output) == r.params.max_tokens
        if k is None:
            assert r.logprobs is None and r.ranks is None and r.top_ids is None and r.top_logprobs is None
            continue
        n = len(r.output)
        assert len(r.logprobs) == len(r.ranks) == len(r.top_ids) == len(r.top_logprobs) == n
        for tok, lp, rank, ids, tops in zip(r.output, r.logprobs, r.ranks, r.top_ids, r.top_logprobs):
            assert rank >= 1 and lp <= 0
            assert len(ids) == len(tops) == k
            if k:
                assert tops == sorted(tops, reverse=True)
                assert lp <= tops[0] + 1e-6
                assert len(set(ids)) == k and MASK not in ids
                if rank <= k:                       # the token is among the alternatives, at its rank
                    assert ids[rank - 1] == tok and tops[rank - 1] == pytest.approx(lp, abs=1e-5)
                else:
                    assert tok not in ids and lp <= tops[-1] + 1e-6
            if rank == 1 and k:
                assert lp == pytest.approx(tops[0], abs=1e-5)
        if r.params.effective_temperature == 0:
            assert all(x == 1 for x in r.ranks)


def test_top_logprob_is_the_max_of_the_distribution(structure_run):
    """top_logprobs[0] is the max: no token has a higher logprob (so exp(top) sums stay <= 1)."""
    for r in structure_run:
        if not r.params.logprobs:
            continue
        for tops in r.top_logprobs:
            assert sum(torch.tensor(tops).exp().tolist()) <= 1 + 1e-5
            assert tops[0] >= torch.log(torch.tensor(1.0 / V)).item() - 1e-6   # the max is >= the mean


def test_linear_spec_scores_equal_ar_greedy_scores(structure_run):
    """SPEC 5/6: linear speculation is token-exact with AR greedy and reports the causal distribution,
    also for tokens accepted after the first of a block (scored from the verify pass)."""
    rs = structure_run[-4:]
    multi = 0
    for spec, ar in (rs[0:2], rs[2:4]):
        assert spec.params.mode == "linear_spec" and ar.params.mode == "ar"
        assert spec.output == ar.output
        assert spec.logprobs == pytest.approx(ar.logprobs, abs=1e-4)
        assert spec.ranks == ar.ranks
        assert spec.top_ids == ar.top_ids
        multi += len(spec.output) - spec.canvases      # tokens beyond the first of their block
    assert multi >= 1, "no verify accepted more than one token: the check above is weaker than intended"
