"""Provisional canvases (`stream_drafts`) through the in-process engine, both families: drafts never change
committed tokens or scores, come every `draft_every` denoising steps, show what the canvas holds, and
cost requests that did not ask nothing."""
import pytest

from model.drafts import DraftBuffer
from model.protocol import Block, Draft
from model.sampling.params import DecodeParams
from model.tiny import write_diffusion_gemma
from tests.served import Served
from workers.engine import Engine
from workers.request import Request, RequestOutput

PROMPTS = [[1, 300, 301, 302], [1, 400, 401], [1, 500]]


@pytest.fixture(scope="module")
def nemotron(tiny_nemotron):
    with Engine(tiny_nemotron, num_slots=4, max_model_len=512) as e:
        yield e


@pytest.fixture(scope="module")
def gemma(tmp_path_factory):
    with Engine(write_diffusion_gemma(tmp_path_factory.mktemp("tiny-gemma-drafts"), seed=0), num_slots=4,
                max_model_len=256) as e:
        yield e


def run(engine, params: list[DecodeParams]) -> tuple[list[Served], list[list[RequestOutput]]]:
    """Each request as its outputs tell it, and every RequestOutput each received, in order."""
    requests = [engine.add(p, q) for p, q in zip(PROMPTS, params)]
    outputs = {r.request_id: [] for r in requests}
    while not all(r.finished for r in requests):
        for out in engine.step():
            outputs[out.request_id].append(out)
    return [Served.of(r, outputs[r.request_id]) for r in requests], [outputs[r.request_id] for r in requests]


def drafts_of(outs):
    return [d for out in outs for d in out.new_drafts]


def assert_same_output(a: list[Served], b: list[Served]):
    for ra, rb in zip(a, b):
        assert ra.output == rb.output
        assert ra.logprobs == rb.logprobs and ra.top_logprobs == rb.top_logprobs  # exactly: the same batch


def test_masked_drafts_change_nothing_and_show_the_canvas(nemotron):
    base = [DecodeParams(temperature=0, ignore_eos=True, max_tokens=64, logprobs=2, policy="low_confidence",
                         max_denoising_steps=12),
            DecodeParams(temperature=0.8, seed=5, ignore_eos=True, max_tokens=40, logprobs=0),
            DecodeParams(temperature=0, ignore_eos=True, max_tokens=32, policy="threshold", threshold=0.5)]
    plain, plain_outs = run(nemotron, base)
    asked = [base[0].model_copy(update=dict(stream_drafts=True, draft_every=3)), base[1],
             base[2].model_copy(update=dict(stream_drafts=True, draft_every=1))]
    drafted, outs = run(nemotron, asked)
    assert_same_output(plain, drafted)
    assert not drafts_of(outs[1]) and not any(drafts_of(o) for o in plain_outs)

    C = 32
    drafts = drafts_of(outs[0])
    # 12 denoising steps per canvas (low_confidence reveals on schedule): drafts after steps 3, 6, 9, 12
    assert [(d.offset, d.step) for d in drafts] == [(o, s) for o in (0, 32) for s in (3, 6, 9, 12)]
    for d in drafts:
        masked = [t == nemotron.config.mask_token_id for t in d.tokens]
        assert d.known == [not m for m in masked] and len(d.tokens) == C
        # revealed tokens are absorbing: each known position already holds the token the commit emits
        assert all(t == drafted[0].output[d.offset + j] for j, t in enumerate(d.tokens) if d.known[j])
    for prev, d in zip(drafts, drafts[1:]):
        if prev.offset == d.offset:
            assert sum(d.known) > sum(prev.known)
            assert d.revealed == [j for j in range(C) if d.known[j] and not prev.known[j]]
        else:
            assert d.revealed == [j for j in range(C) if d.known[j]]
    assert drafts[3].known == [True] * C   # the last step revealed everything
    # draft_every=1: a draft after every denoising step of the request's one canvas
    every = drafts_of(outs[2])
    assert [d.step for d in every] == list(range(1, drafted[2].denoising_steps + 1))


def test_requests_that_do_not_draft_pay_nothing(nemotron, monkeypatch):
    def no_drafts(*args, **kwargs):
        raise AssertionError("a draft was recorded for a batch where nobody asked")

    monkeypatch.setattr(DraftBuffer, "record", no_drafts)
    monkeypatch.setattr(DraftBuffer, "parts", no_drafts)
    requests, _ = run(nemotron, [DecodeParams(temperature=0, ignore_eos=True, max_tokens=33)] * 2)
    assert [len(r.output) for r in requests] == [33, 33]


def test_uniform_noise_drafts_show_the_argmax_canvas(gemma):
    # a fixed schedule: 6 steps per canvas, so the last draft of a canvas is its converged step
    base = [DecodeParams(ignore_eos=True, max_tokens=32, logprobs=1, seed=s, max_denoising_steps=6,
                         confidence_threshold=0) for s in (1, 2)]
    plain, _ = run(gemma, base)
    drafted, outs = run(gemma, [base[0].model_copy(update=dict(stream_drafts=True, draft_every=2)), base[1]])
    assert_same_output(plain, drafted)
    drafts = drafts_of(outs[0])
    C = gemma.config.canvas_length
    assert [(d.offset, d.step) for d in drafts] == [(o, s) for o in range(0, 32, C) for s in (2, 4, 6)]
    assert not drafts_of(outs[1])
    for d in drafts:
        assert len(d.tokens) == C and any(d.known)   # the entropy bound accepts at least one position
        if d.step == 6:  # the converged step's argmax canvas is what the commit emits
            assert d.tokens == drafted[0].output[d.offset:d.offset + C]
    for prev, d in zip(drafts, drafts[1:]):
        before = prev.known if prev.offset == d.offset else [False] * C
        assert d.revealed == [j for j in range(C) if d.known[j] and not before[j]]


def test_request_drops_drafts_past_a_host_side_stop():
    r = Request("r", (1, 2), DecodeParams(max_tokens=64, stop_token_ids=(7,)), seed=0, stop_ids=frozenset({7}))
    mask = 100
    canvas = [5, 6, mask, mask]
    first = r.extend(Block(slot=0, tokens=[], drafts=[Draft(2, 1, canvas, [True, True, False, False])]))
    assert [(d.offset, d.revealed) for d in first.new_drafts] == [(0, [0, 1])]
    # the commit stops at token 7 (a stop id only the host knows); a draft of the next canvas is dropped
    out = r.extend(Block(slot=0, tokens=[5, 6, 7, 8], drafts=[Draft(2, 2, [5, 6, 7, mask], [True, True, True, False]),
                                                               Draft(6, 1, [9, mask, mask, mask], [True] + [False] * 3)]))
    assert out.finished and out.new_tokens == [5, 6, 7]
    assert [(d.offset, d.revealed) for d in out.new_drafts] == [(0, [2])]
