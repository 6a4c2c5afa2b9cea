"""From the engine's streamed token blocks to OpenAI text and logprobs.

`OutputAssembler` detokenizes incrementally (text is only released once its characters are complete),
applies stop strings (found across block boundaries; the stop string and every token from it on are
dropped), and records each token's character offset in the text. `completion_logprobs` and
`chat_logprobs` format the scores; -inf (and anything below it) is reported as -9999.0.
"""
from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from functools import lru_cache

from deployments.protocol import ChatLogprobs, ChatLogprobToken, ChatTopLogprob, CompletionLogprobs
from workers.request import RequestOutput

NEG_INF_LOGPROB = -9999.0
_REPLACEMENT = "\ufffd"


@dataclass
class Delta:
    """What one `OutputAssembler.add` yields to the client."""

    text: str = ""                                     # new text to send
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] | None = None               # per token, when the request asked for scores
    ranks: list[int] | None = None
    top: list[list[tuple[int, float]]] | None = None  # per token: (token id, logprob), best first
    text_offsets: list[int] = field(default_factory=list)  # per token: its start in prompt + output text
    stopped: bool = False                             # a stop string ended the output
    finish_reason: str | None = None                  # "stop" | "length" | "abort" | None (more to come)


class OutputAssembler:
    """One request's output. `add` each RequestOutput as it arrives; `finish` when the stream ends early.

    Text is released once its characters are complete and it cannot be the start of a stop string; a
    token is released with the text it starts in (a special token, which has no text, with the next
    text or at the end), so a stop string never takes back tokens already sent.

    Token offsets (`Delta.text_offsets`) count characters of the detokenized output from `prompt_text_len`
    (OpenAI counts from the start of the prompt); a token that only completes a character started by the
    previous one shares that character's offset.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), prompt_text_len: int = 0):
        self.tokenizer = tokenizer
        self.stop = [s for s in stop if s]
        self.prompt_text_len = prompt_text_len
        self.token_ids: list[int] = []   # every output token kept so far
        self.text = ""                   # their text, complete characters only
        self.sent = 0                    # how much of `text` was released
        self.done = False
        self.scored = False              # the request asked for scores
        self._pending: list[tuple] = []  # (id, offset in text, logprob, rank, top) not yet released
        # the tokens that can add text: all but those the decode skips (special tokens). A run of skipped
        # tokens (a model emitting padding under ignore_eos) would otherwise sit in the decode window,
        # which only moves on when text grows, and every later token would decode the whole run again
        self._silent = silent_ids(tokenizer)
        self._texted: list[int] = []
        self._prefix = self._read = 0    # decode window: _texted[prefix:read] gave `_prefix_text`
        self._prefix_text = ""

    def _decode(self, ids: list[int]) -> str:
        return _decode_skipping(self.tokenizer, ids)

    def _push(self, token_id: int) -> int:
        """Appends one token and returns its offset in `text`. Text grows only once the window decodes to
        more than before and ends in a complete character (no trailing U+FFFD)."""
        offset = len(self.text)
        self.token_ids.append(token_id)
        if token_id in self._silent:   # the decode drops it wherever it stands
            return offset
        ids = self._texted
        ids.append(token_id)
        full = self._decode(ids[self._prefix:])
        # A character is at most 4 bytes: a window still incomplete after 4 tokens holds invalid UTF-8,
        # which no later token can complete; let it out (as U+FFFD) rather than hold the stream.
        stuck = len(ids) - self._read >= 4
        if len(full) > len(self._prefix_text) and (stuck or not full.endswith(_REPLACEMENT)):
            self.text += full[len(self._prefix_text):]
            self._prefix, self._read = self._read, len(ids)
            self._prefix_text = self._decode(ids[self._prefix:self._read])
        return offset

    def _flush_partial(self) -> None:
        """At the end: whatever the window still holds (an incomplete character becomes U+FFFD)."""
        full = self._decode(self._texted[self._prefix:])
        self.text += full[len(self._prefix_text):]
        self._prefix = self._read = len(self._texted)
        self._prefix_text = ""

    def _held_back(self) -> int:
        """Length of the longest unsent suffix of `text` that could still grow into a stop string."""
        tail = self.text[self.sent:]
        for n in range(min(len(tail), max(map(len, self.stop), default=1) - 1), 0, -1):
            if any(s.startswith(tail[-n:]) for s in self.stop):
                return n
        return 0

    def add(self, out: RequestOutput) -> Delta:
        if self.done:
            return Delta()
        self.scored = self.scored or out.new_logprobs is not None
        n = len(out.new_tokens)
        lps, ranks = out.new_logprobs or [None] * n, out.new_ranks or [None] * n
        tops = ([list(zip(i, lp)) for i, lp in zip(out.new_top_ids, out.new_top_logprobs)]
                if out.new_top_ids is not None else [[] for _ in range(n)])
        self._pending += [(t, self._push(t), lp, r, top) for t, lp, r, top in zip(out.new_tokens, lps, ranks, tops)]
        finish_reason = out.finish_reason if out.finished else None
        cut = min((i for s in self.stop if (i := self.text.find(s, self.sent)) >= 0), default=-1)
        if cut >= 0:
            self.text, finish_reason = self.text[:cut], "stop"
            dropped = sum(p[1] >= cut for p in self._pending)
            del self.token_ids[len(self.token_ids) - dropped:]
            del self._pending[len(self._pending) - dropped:]
        elif finish_reason is not None:
            self._flush_partial()
        end = len(self.text) if finish_reason is not None else len(self.text) - self._held_back()
        self.done = finish_reason is not None
        return self._release(end, stopped=cut >= 0, finish_reason=finish_reason)

    def _release(self, end: int, stopped: bool = False, finish_reason: str | None = None) -> Delta:
        """Text up to `end`, with the tokens that start in it (all of them once done)."""
        text, self.sent = self.text[self.sent:end], end
        n = len(self._pending) if self.done else self._releasable(end)
        out, self._pending = self._pending[:n], self._pending[n:]
        return Delta(text=text, token_ids=[p[0] for p in out],
                     logprobs=[p[2] for p in out] if self.scored else None,
                     ranks=[p[3] for p in out] if self.scored else None,
                     top=[p[4] for p in out] if self.scored else None,
                     text_offsets=[self.prompt_text_len + p[1] for p in out],
                     stopped=stopped, finish_reason=finish_reason)

    def _releasable(self, end: int) -> int:
        """Leading pending tokens that start before `end`, and tokens without text (`silent_ids`) at `end`:
        so a block of special tokens still makes its own stream chunk."""
        n = 0
        for token_id, offset, *_ in self._pending:
            if not (offset < end or (offset == end and token_id in self._silent)):
                break
            n += 1
        return n

    def finish(self) -> Delta:
        """Ends the output early (e.g. the stream broke off): whatever text and tokens were held back."""
        if self.done:
            return Delta()
        self.done = True
        self._flush_partial()
        return self._release(len(self.text))


@lru_cache(maxsize=16)
def silent_ids(tokenizer) -> frozenset[int]:
    """The tokens that decode to nothing with skip_special_tokens: the special tokens, and every added
    token the tokenizer flags special, which `all_special_ids` leaves out (Gemma's thousands of reserved
    `<unused...>` tokens; the `<SPECIAL_n>` fillers of our full-size shapes' tokenizers, which are most of
    their vocabulary, so a dummy-weight server's random tokens are mostly these). A special token the
    tokenizer does not flag keeps its text. One decode of them all checks them at once; should it give
    text, each is checked alone."""
    flagged = (i for i, t in tokenizer.added_tokens_decoder.items() if t.special)
    candidates = sorted(set(tokenizer.all_special_ids).union(flagged))
    if _decode_skipping(tokenizer, candidates) == "":
        return frozenset(candidates)
    return frozenset(i for i in candidates if _decode_skipping(tokenizer, [i]) == "")


def _decode_skipping(tokenizer, ids: list[int]) -> str:
    return tokenizer.decode(ids, skip_special_tokens=True, clean_up_tokenization_spaces=False)


# --------------------------------------------------------------------------------------- formatting

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted (byte-level BPE token strings -> bytes)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


@lru_cache(maxsize=1 << 18)
def token_piece(tokenizer, token_id: int) -> tuple[str, bytes]:
    """(display string, raw bytes) of one token. A token that is not whole UTF-8 characters (part of a
    multi-byte character) is shown as OpenAI does, "bytes:\\xe6\\x97", with its real bytes."""
    text = tokenizer.decode([token_id], clean_up_tokenization_spaces=False)
    if _REPLACEMENT not in text:
        return text, text.encode("utf-8")
    raw = tokenizer.convert_ids_to_tokens(token_id)
    table = _byte_level_decoder()
    if isinstance(raw, str) and (m := _BYTE_TOKEN.fullmatch(raw)):    # sentencepiece byte fallback
        data = bytes([int(m.group(1), 16)])
    elif isinstance(raw, str) and raw and all(c in table for c in raw):  # byte-level BPE
        data = bytes(table[c] for c in raw)
    else:
        return text, text.encode("utf-8")
    try:
        return data.decode("utf-8"), data
    except UnicodeDecodeError:
        return "bytes:" + "".join(f"\\x{b:02x}" for b in data), data


def _score(x: float) -> float:
    return NEG_INF_LOGPROB if x < NEG_INF_LOGPROB else float(x)


def completion_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                        top: Sequence[Sequence[tuple[int, float]]] | None,
                        text_offset_start: int | Sequence[int] = 0) -> CompletionLogprobs:
    """Legacy completions logprobs. `top_logprobs[i]` maps token strings to logprobs: the top-k
    alternatives plus the sampled token (OpenAI: up to logprobs + 1 entries). `text_offset_start` is
    either the offsets themselves (`Delta.text_offsets`, exact) or the first token's offset, the rest
    following cumulatively by token string length."""
    tokens = [token_piece(tokenizer, t)[0] for t in token_ids]
    if isinstance(text_offset_start, int):
        offsets, pos = [], text_offset_start
        for s in tokens:
            offsets.append(pos)
            pos += len(s)
    else:
        offsets = list(text_offset_start)
    tops = []
    for i, (t, lp) in enumerate(zip(token_ids, logprobs)):
        d: dict[str, float] = {}
        for alt, alt_lp in (top[i] if top is not None else ()):
            d.setdefault(token_piece(tokenizer, alt)[0], _score(alt_lp))
        d.setdefault(tokens[i], _score(lp))
        tops.append(d)
    return CompletionLogprobs(tokens=tokens, token_logprobs=[_score(x) for x in logprobs],
                              top_logprobs=tops, text_offset=offsets)


def chat_logprobs(tokenizer, token_ids: Sequence[int], logprobs: Sequence[float],
                  top: Sequence[Sequence[tuple[int, float]]] | None) -> ChatLogprobs:
    """Chat logprobs: per token its string, logprob, UTF-8 bytes and the top-k alternatives."""
    def entry(t: int, lp: float) -> dict:
        s, data = token_piece(tokenizer, t)
        return {"token": s, "logprob": _score(lp), "bytes": list(data)}

    return ChatLogprobs(content=[
        ChatLogprobToken(**entry(t, lp),
                         top_logprobs=[ChatTopLogprob(**entry(a, alp)) for a, alp in (top[i] if top else ())])
        for i, (t, lp) in enumerate(zip(token_ids, logprobs))])
