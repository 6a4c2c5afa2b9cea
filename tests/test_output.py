"""Token blocks -> OpenAI text and logprobs: incremental detokenization, stop strings, offsets, -inf."""
import math
import random

import pytest
from transformers import AutoTokenizer

from deployments.output import Delta, OutputAssembler, chat_logprobs, completion_logprobs, silent_ids, token_piece
from model.tiny import write_nemotron_ld
from workers.request import RequestOutput

TEXT = "Hello wörld — 日本語 😀! The answer is 42.\nThe quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok(tmp_path_factory):
    return AutoTokenizer.from_pretrained(write_nemotron_ld(tmp_path_factory.mktemp("output-tok")))


def blocks(ids, sizes, scores=False, last_reason="length"):
    """RequestOutputs carrying `ids` in blocks of the given sizes (the last one finished)."""
    outs, i = [], 0
    for n in sizes:
        chunk = ids[i:i + n]
        i += n
        s = dict(new_logprobs=[-0.1 * (j + 1) for j in range(len(chunk))], new_ranks=[1] * len(chunk),
                 new_top_ids=[[t, 0] for t in chunk], new_top_logprobs=[[-0.1, -2.0]] * len(chunk)) if scores else {}
        outs.append(RequestOutput("r", list(chunk), **s))
    outs[-1].finished, outs[-1].finish_reason = True, last_reason
    return outs


def split(n, rng):
    sizes = []
    while n > 0:
        sizes.append(min(n, rng.randint(1, 6)))
        n -= sizes[-1]
    return sizes


def test_incremental_detokenization_equals_full_decode(tok):
    ids = tok.encode(TEXT, add_special_tokens=False) + [tok.eos_token_id]
    rng = random.Random(0)
    for _ in range(20):
        asm = OutputAssembler(tok, [])
        deltas = [asm.add(o) for o in blocks(ids, split(len(ids), rng))]
        assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=True) == TEXT
        assert all("\ufffd" not in d.text for d in deltas)
        assert [t for d in deltas for t in d.token_ids] == ids and deltas[-1].finish_reason == "length"
        assert all(d.finish_reason is None for d in deltas[:-1]) and asm.finish() == Delta()


def test_multi_token_character_is_held_until_complete(tok):
    ids = tok.encode("日", add_special_tokens=False)
    assert len(ids) == 3
    asm = OutputAssembler(tok, [])
    deltas = [asm.add(RequestOutput("r", [t])) for t in ids]
    assert [d.text for d in deltas] == ["", "", "日"]
    assert [d.token_ids for d in deltas] == [[], [], ids]  # tokens go out with their text
    asm = OutputAssembler(tok, [], prompt_text_len=3)
    assert asm.add(RequestOutput("r", ids[:2])) == Delta()
    tail = asm.finish()  # the stream broke off: flushed as is
    assert (tail.text, tail.token_ids, tail.text_offsets, tail.finish_reason) == ("\ufffd", ids[:2], [3, 3], None)


def test_stop_string_across_blocks(tok):
    ids = tok.encode("The answer is 42. Hello", add_special_tokens=False)
    n_is = next(i for i in range(len(ids)) if tok.decode(ids[:i + 1]).endswith(" is")) + 1
    outs = blocks(ids, [n_is, len(ids) - n_is], scores=True)
    asm = OutputAssembler(tok, ["is 4", "zzz"], prompt_text_len=10)
    first = asm.add(outs[0])
    assert first.text == "The answer " and not first.stopped  # "is" could start the stop string: held
    second = asm.add(outs[1])
    assert (second.text, second.stopped, second.finish_reason) == ("", True, "stop")
    assert second.token_ids == [] and second.logprobs == [] and second.top == []  # " 42" onwards dropped
    assert first.token_ids == ids[:n_is] and first.text_offsets[0] == 10
    assert asm.add(RequestOutput("r", [5])).text == "" and asm.finish() == Delta()  # after the stop: nothing


def test_stop_strings_with_any_block_split(tok):
    ids = tok.encode(TEXT, add_special_tokens=False)
    rng = random.Random(1)
    for stop in (["brown f"], ["日本", "zz"], [" 42.\nThe"], ["ö"]):
        for _ in range(10):
            asm = OutputAssembler(tok, stop)
            deltas = [asm.add(o) for o in blocks(ids, split(len(ids), rng), scores=True)]
            deltas = deltas[:next(i for i, d in enumerate(deltas) if d.finish_reason) + 1]
            assert "".join(d.text for d in deltas) == TEXT[:TEXT.index(stop[0])]
            assert deltas[-1].stopped and deltas[-1].finish_reason == "stop"
            cut = TEXT.index(stop[0])  # kept: the tokens that start before the stop string
            starts = [len(tok.decode(ids[:i]).rstrip("\ufffd")) for i in range(len(ids))]
            assert [t for d in deltas for t in d.token_ids] == [t for t, o in zip(ids, starts) if o < cut]


def test_stop_string_inside_one_token_keeps_that_token(tok):
    ids = tok.encode("The answer is 42.", add_special_tokens=False)
    d = OutputAssembler(tok, ["swer"]).add(blocks(ids, [len(ids)], scores=True)[0])
    assert d.text == "The an" and d.stopped and d.finish_reason == "stop"
    kept = [i for i in range(len(ids)) if len(tok.decode(ids[:i])) < len("The an")]
    assert d.token_ids == [ids[i] for i in kept] and len(d.logprobs) == len(d.ranks) == len(d.top) == len(kept)


def test_earliest_stop_wins_and_unfinished_prefix_is_flushed(tok):
    ids = tok.encode("Hello world. The quick brown fox", add_special_tokens=False)
    d = OutputAssembler(tok, ["fox", "."]).add(blocks(ids, [len(ids)])[0])
    assert d.text == "Hello world" and d.stopped
    asm = OutputAssembler(tok, ["fox!"])
    deltas = [asm.add(o) for o in blocks(ids, [len(ids) - 1, 1], last_reason="stop")]
    assert "".join(x.text for x in deltas) == "Hello world. The quick brown fox"  # a mere prefix: all of it
    assert not deltas[-1].stopped and deltas[-1].finish_reason == "stop"  # EOS-style stop from the engine
    asm = OutputAssembler(tok, ["fox!"])
    held = asm.add(RequestOutput("r", ids))
    assert held.text.endswith("brown ")  # "fox" could begin "fox!": held back, with its tokens
    tail = asm.finish()
    assert tail.text == "fox" and tail.token_ids and held.token_ids + tail.token_ids == ids


def test_text_offsets_and_completion_logprobs(tok):
    text = "The answer is 42. Hello world!"
    ids = tok.encode(text, add_special_tokens=False)
    asm, prompt_len = OutputAssembler(tok, [], prompt_text_len=7), 7
    deltas = [asm.add(o) for o in blocks(ids, [3, 4, len(ids) - 7], scores=True)]
    offsets = [o for d in deltas for o in d.text_offsets]
    pieces = [tok.decode([t]) for t in ids]
    assert offsets == [prompt_len + len("".join(pieces[:i])) for i in range(len(ids))]
    for d in deltas:
        exact = completion_logprobs(tok, d.token_ids, d.logprobs, d.top, d.text_offsets)
        cumulative = completion_logprobs(tok, d.token_ids, d.logprobs, d.top, d.text_offsets[0])
        assert exact == cumulative
        for tok_str, off in zip(exact.tokens, exact.text_offset):
            assert text[off - prompt_len:].startswith(tok_str)
    lp = completion_logprobs(tok, ids[:2], [-0.5, -math.inf], [[(ids[0], -0.5), (0, -math.inf)], []], 0)
    assert lp.token_logprobs == [-0.5, -9999.0]
    first, second = tok.decode(ids[:1]), tok.decode(ids[1:2])
    assert lp.top_logprobs == [{first: -0.5, "<unk>": -9999.0}, {second: -9999.0}]  # + the sampled token


def test_chat_logprobs_bytes_and_inf(tok):
    ids = tok.encode("wörld 😀", add_special_tokens=False)
    lp = chat_logprobs(tok, ids, [-math.inf] * len(ids), [[(t, -1e9)] for t in ids])
    assert b"".join(bytes(e.bytes) for e in lp.content) == "wörld 😀".encode()
    assert all(e.logprob == -9999.0 and e.top_logprobs[0].logprob == -9999.0 for e in lp.content)
    partial = [e.token for e in lp.content if e.token.startswith("bytes:")]
    assert partial and partial[0] == "bytes:\\xc3"  # the first byte of "ö", spelt as OpenAI does
    assert token_piece(tok, tok.eos_token_id) == ("</s>", b"</s>")
    assert chat_logprobs(tok, ids[:1], [-1.0], None).content[0].top_logprobs == []


class CountingTokenizer:
    """A tokenizer whose decode calls are counted by the ids they decode (what a window costs)."""

    def __init__(self, tok):
        self.tok, self.decoded = tok, 0

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def decode(self, ids, **kw):
        self.decoded += len(ids)
        return self.tok.decode(ids, **kw)


def _reserved_token(tok) -> int:
    """An added token the tokenizer flags special that all_special_ids leaves out (a `<SPECIAL_n>` filler)."""
    return next(i for i, t in tok.added_tokens_decoder.items() if t.special and i not in tok.all_special_ids)


@pytest.mark.parametrize("silent", ["pad", "reserved"])
def test_a_run_of_special_tokens_costs_each_token_once(tok, silent):
    """A model padding out max_tokens under ignore_eos emits a long run of special tokens, which the decode
    drops: they must not pile up in the decode window (every later token would decode the whole run
    again, quadratic in its length; 1,024 of them took the ingress ~60 ms a request), and the text around
    them, a multi-byte character split by them included, is the full decode's. The same for reserved
    tokens the tokenizer flags special but all_special_ids leaves out (a dummy-weight server's random
    tokens over our full-size shapes' tokenizers are mostly these: 165 ms of the ingress a 1,024-token
    request before)."""
    text_ids = tok.encode(TEXT, add_special_tokens=False)
    cut = text_ids.index(tok.encode("日", add_special_tokens=False)[0]) + 1   # inside 日's three byte tokens
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    if silent == "reserved":
        pad = _reserved_token(tok)
        assert tok.decode([pad], skip_special_tokens=True) == "" and pad not in tok.all_special_ids
    ids = text_ids[:cut] + [pad] * 2000 + text_ids[cut:] + [pad] * 2000
    counting = CountingTokenizer(tok)
    silent_ids(counting)   # once a tokenizer, as the ingress does when it loads one
    counting.decoded = 0
    asm = OutputAssembler(counting, [])
    deltas = [asm.add(o) for o in blocks(ids, [256] * (len(ids) // 256) + [len(ids) % 256])]
    assert "".join(d.text for d in deltas) == tok.decode(ids, skip_special_tokens=True) == TEXT
    assert [t for d in deltas for t in d.token_ids] == ids
    assert counting.decoded < 10 * len(text_ids) + 100, counting.decoded   # not ~ 2,000 x 2,000
    # each pad takes the offset of the text after it
    offsets = [o for d in deltas for o in d.text_offsets]
    assert offsets[cut:cut + 2000] == [offsets[cut]] * 2000 and offsets[-1] == len(TEXT)


def test_silent_ids_are_the_tokens_each_decoding_to_nothing(tok):
    """silent_ids (checked in one decode) against a decode of every added token and special token alone."""
    candidates = set(tok.all_special_ids) | set(tok.added_tokens_decoder)
    expected = {i for i in candidates if tok.decode([i], skip_special_tokens=True, clean_up_tokenization_spaces=False) == ""}
    assert silent_ids(tok) == expected and _reserved_token(tok) in expected
