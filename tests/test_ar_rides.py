"""AR rows riding in the canvas forward (model/steps/masked.py, Runner.ar_rides): a batch of canvas
and AR rows reads the weights once a step, and an AR request's tokens and scores are those it gets in
its own AR forward."""
import pytest

from model.loader import load_model
from model.protocol import Command, NewSlot
from model.runner import AR_RIDE_TOKENS, Runner
from model.sampling.params import DecodeParams

C = 32
AR_PARAMS = [DecodeParams(mode="ar", max_tokens=20, temperature=1.0, seed=3, logprobs=2, top_k=40, ignore_eos=True),
             DecodeParams(mode="ar", max_tokens=26, temperature=0.0, seed=4, logprobs=0),   # may stop at an EOS
             DecodeParams(mode="ar", max_tokens=7, temperature=0.8, seed=8, top_p=0.9, ignore_eos=True)]
CANVAS_PARAMS = [DecodeParams(max_tokens=64, temperature=0.7, seed=5, logprobs=1, ignore_eos=True,
                              max_denoising_steps=8),
                 DecodeParams(mode="linear_spec", max_tokens=40, seed=6, ignore_eos=True)]


@pytest.fixture(scope="module")
def model(tiny_nemotron):
    return load_model(tiny_nemotron, show_progress=False)


def run(model, params: list[DecodeParams], ar_ride_tokens: int, steps: int = 30):
    """One command of `steps` steps over a slot per request (its prompt's length from its seed); returns the
    model forwards it ran (checked against the command's `passes` counter) and each slot's emitted tokens
    and scores."""
    runner = Runner(model, num_slots=len(params), max_model_len=256, ar_ride_tokens=ar_ride_tokens)
    forwards = 0
    forward = runner.env.forward

    def counted(*args, **kwargs):
        nonlocal forwards
        forwards += 1
        return forward(*args, **kwargs)

    runner.env.forward = counted
    admit = tuple(NewSlot(s, tuple(range(1, 4 + p.seed)), p, p.seed) for s, p in enumerate(params))
    events = runner.execute(Command(admit=admit, max_steps=steps))
    assert events.counters.passes == forwards
    out = {}
    for b in events.blocks:
        got = out.setdefault(b.slot, dict(tokens=[], logprobs=[], ranks=[], top_ids=[], top_logprobs=[]))
        got["tokens"] += b.tokens
        for name in ("logprobs", "ranks", "top_ids", "top_logprobs"):
            got[name] += getattr(b, name) or []
    return forwards, out


def test_ar_rows_ride_in_the_canvas_forward_with_the_tokens_and_scores_of_their_own(model):
    params = AR_PARAMS + CANVAS_PARAMS
    apart_forwards, apart = run(model, params, ar_ride_tokens=-1)
    riding_forwards, riding = run(model, params, ar_ride_tokens=AR_RIDE_TOKENS)
    steps = 30
    assert apart_forwards == 1 + 2 * steps        # the prefill, then a canvas and an AR forward a step
    assert riding_forwards == 1 + steps           # the prefill, then one forward a step
    assert set(riding) == set(apart) and len(apart[0]["tokens"]) == 20 and len(apart[2]["tokens"]) == 7
    for slot in apart:
        a, r = apart[slot], riding[slot]
        assert r["tokens"] == a["tokens"], slot
        assert r["ranks"] == a["ranks"] and r["top_ids"] == a["top_ids"], slot
        assert r["logprobs"] == pytest.approx(a["logprobs"], abs=1e-4), slot
        for ra, aa in zip(r["top_logprobs"], a["top_logprobs"]):
            assert ra == pytest.approx(aa, abs=1e-4)


def test_an_ar_request_riding_gets_what_it_gets_alone(model):
    """Alone an AR request runs AR forwards of width 1; beside canvas rows it rides in theirs."""
    for p in AR_PARAMS:
        _, alone = run(model, [p], AR_RIDE_TOKENS)
        _, beside = run(model, [CANVAS_PARAMS[0], p], AR_RIDE_TOKENS)
        assert beside[1]["tokens"] == alone[0]["tokens"]
        assert beside[1]["logprobs"] == pytest.approx(alone[0]["logprobs"], abs=1e-4)


def test_ar_rows_ride_only_while_the_width_they_add_costs_less_than_a_forward(model):
    runner = Runner(model, num_slots=16, max_model_len=256)
    # unpadded rows (no graphs): each AR row adds C - 1 tokens
    assert runner.ar_rides(1, AR_RIDE_TOKENS // (C - 1))
    assert not runner.ar_rides(1, AR_RIDE_TOKENS // (C - 1) + 1)
    # with graphs, rows are padded to capture sizes: 7 canvas rows already pay for an 8th
    runner.sizes, runner.graphs = (1, 2, 4, 8, 16), object()
    assert runner.ar_rides(7, 1) and runner.ar_rides(5, 3)
    assert not runner.ar_rides(8, 8)             # 8 more rows of C: 256 tokens
    assert runner.ar_rides(12, 4)                # padded to 16 either way
    # each added token also attends to the keys: at keys_per_token keys it weighs two
    assert runner.ar_rides(4, 4, kv_len=0) and not runner.ar_rides(4, 4, kv_len=int(runner.keys_per_token))
    runner.ar_ride_tokens = -1
    assert not runner.ar_rides(7, 1)


def test_a_key_weighs_the_attention_against_the_linear_layers(model):
    """keys_per_token: 2 x the linear layers' parameters over 4 x heads x head_dim x layers."""
    from model.runner import keys_per_token

    cfg = model.config
    linear = sum(p.numel() for n, p in model.named_parameters() if p.dim() >= 2 and "embed" not in n
                 and "head" not in n)
    per_key = 4 * cfg.num_attention_heads * cfg.head_size * cfg.num_hidden_layers
    assert keys_per_token(model) == pytest.approx(2 * linear / per_key)
