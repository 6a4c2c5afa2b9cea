"""A request's answer in OpenAI's shapes, from its choices' engine streams: the whole JSON response, or
server-sent events (one chunk per committed block of each choice, drafts as SSE comments between them
when asked, the usage of all choices, then `data: [DONE]`; an error after the stream began as one
`{"error": ...}` event). Text is detokenized and stop strings applied by each choice's OutputAssembler
(deployments/output.py); a choice that ends early cancels its engine request.
"""
from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable

from fastapi.responses import StreamingResponse

# Counted through the module (`prom.REQUESTS`), never a name imported from it: deployments/errors.py says why.
from deployments import metrics as prom
from deployments.choices import Choice, gathered, merged
from deployments.drafts import draft_event, draft_payload
from deployments.errors import APIError, error_body
from deployments.output import Delta, chat_logprobs, completion_logprobs
from deployments.tools import ToolCall, ToolFormat
from deployments.protocol import (ChatChoice, ChatCompletionResponse, ChatCompletionStreamResponse, ChatDelta,
                                  ChatResponseMessage, ChatStreamChoice, CompletionChoice, CompletionResponse,
                                  CompletionStreamResponse, Usage)

log = logging.getLogger("dllm.ingress")
ENDPOINT = {"completion": "completions", "chat": "chat_completions"}   # request kind -> metrics label


def sse(payload) -> str:
    data = payload if isinstance(payload, str) else payload.model_dump_json(exclude_none=False)
    return f"data: {data}\n\n"


def cancel_all(choices: list[Choice]) -> None:
    """Each choice's engine request ends (a no-op for one that finished); its slot is freed."""
    for c in choices:
        if c.stream is not None:
            c.stream.cancel()


class ChoicesStream(StreamingResponse):
    """A stream of choices that ends their engine requests however the response ends (the one place a
    stream ends them): also when the client leaves before the stream's generator first runs, whose own
    `finally` then never runs (the choices would hold their slots until request_timeout_s)."""

    def __init__(self, content, choices: list[Choice]):
        super().__init__(content, media_type="text/event-stream")
        self.choices = choices

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            cancel_all(self.choices)


class Responder:
    """Writes the answers of one served model. `next_output(stream)`: a choice's next engine output, None at
    its end, its errors as APIError (deployments/readiness.py)."""

    def __init__(self, tokenizer, model_name: str, canvas_length: int, mask_id: int | None,
                 next_output: Callable[[object], Awaitable[object]], tool_format: ToolFormat | None = None):
        self.tokenizer = tokenizer
        self.tool_format = tool_format   # how this checkpoint's answers call tools (deployments/tools.py)
        self.model_name = model_name
        self.canvas_length = canvas_length   # for usage.diffusion.canvas_positions and drafts
        self.mask_id = mask_id               # a draft's masked positions (None: uniform-noise canvases)
        self.next_output = next_output

    async def outputs(self, choice: Choice) -> AsyncIterator[tuple[Delta, object]]:
        """Deltas of a choice's text until its request finishes or a stop string ends it (then upstream is
        cancelled); the choice keeps its token count and its last output (usage)."""
        try:
            while True:
                out = await self.next_output(choice.stream)
                if out is None:
                    yield choice.assembler.finish(), None
                    return
                delta = choice.assembler.add(out)
                choice.tokens += len(delta.token_ids)
                choice.last = out
                yield delta, out
                if delta.finish_reason is not None:
                    return
        finally:
            choice.stream.cancel()  # no-op once finished; frees the slot when we stop early

    async def collect(self, kind: str, body, response_id: str, choices: list[Choice], prompt_tokens: int):
        answers = await gathered([self._collect_choice(kind, body, c) for c in choices])
        usage = self.usage(prompt_tokens, choices)
        if kind == "completion":
            return CompletionResponse(id=response_id, model=self.model_name, choices=answers, usage=usage)
        return ChatCompletionResponse(id=response_id, model=self.model_name, choices=answers, usage=usage)

    async def _collect_choice(self, kind: str, body, choice: Choice):
        text, ids, lps, tops, offsets, reason = "", [], [], [], [], None
        async for delta, _ in self.outputs(choice):
            text += delta.text
            ids += delta.token_ids
            offsets += delta.text_offsets
            if delta.logprobs is not None:
                lps += delta.logprobs
                tops += delta.top
            reason = delta.finish_reason or reason
        scored = choice.last is not None and choice.last.new_logprobs is not None
        if kind == "completion":
            logprobs = completion_logprobs(self.tokenizer, ids, lps, tops, offsets) if scored else None
            return CompletionChoice(index=choice.index, text=text, logprobs=logprobs, finish_reason=reason)
        calls = self._calls(body, ids, text, reason)
        if calls is not None:
            return ChatChoice(index=choice.index, message=ChatResponseMessage(
                content=None, tool_calls=[c.openai() for c in calls]), finish_reason="tool_calls")
        logprobs = chat_logprobs(self.tokenizer, ids, lps, tops) if scored and body.logprobs else None
        return ChatChoice(index=choice.index, message=ChatResponseMessage(content=text), logprobs=logprobs,
                          finish_reason=reason)

    def _calls(self, body, ids: list[int], text: str, reason: str | None) -> list[ToolCall] | None:
        """The tool calls a chat answer that ended at its grammar's end (or EOS) makes; None: it is text."""
        if not getattr(body, "calls_tools", False) or reason != "stop" or self.tool_format is None:
            return None
        return self.tool_format.parse(ids, text, [t.model_dump() for t in body.tools])

    def _may_be_calls(self, body, ids: list[int], text: str) -> bool:
        """Whether an answer begun so far may still turn out to be tool calls (its text is held back)."""
        if not getattr(body, "calls_tools", False) or self.tool_format is None:
            return False
        if body.tool_mode != "auto":
            return True
        if self.tool_format.name == "json":
            return text.lstrip()[:1] in ("", "{", "[")
        return not ids or ids[0] == self.tool_format.calls_id

    async def sse_stream(self, kind: str, body, chunk_id: str, choices: list[Choice], prompt_tokens: int):
        """Every choice's chunks as they come (each carries its choice's index; each choice ends with its own
        finish chunk), then the usage of them all; a failing choice ends the stream (and every choice's
        request) with an error event."""
        status = 499   # until the stream ends: the client went away
        try:
            if kind == "chat":
                for c in choices:
                    yield sse(ChatCompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[
                        ChatStreamChoice(index=c.index, delta=ChatDelta(role="assistant", content=""))]))
            try:
                async for event in merged([self._choice_events(kind, body, chunk_id, c) for c in choices]):
                    yield event
            except Exception as err:  # after the stream began: report in band, then end it
                if not isinstance(err, APIError):
                    log.exception("a stream failed")
                    err = APIError(500, f"internal error: {type(err).__name__}", "internal_error")
                status = err.status
                yield sse(json.dumps(error_body(err.message, err.type, err.param, err.code)))
                yield sse("[DONE]")
                return
            if body.include_usage:
                cls = CompletionStreamResponse if kind == "completion" else ChatCompletionStreamResponse
                yield sse(cls(id=chunk_id, model=self.model_name, choices=[],
                              usage=self.usage(prompt_tokens, choices)))
            yield sse("[DONE]")
            status = 200
        finally:   # the choices' requests end in ChoicesStream, however the response ends
            prom.REQUESTS.add(ENDPOINT[kind], status)

    async def _choice_events(self, kind: str, body, chunk_id: str, choice: Choice) -> AsyncIterator[str]:
        """One choice's SSE events: its chunks, and its drafts when asked. An answer that may be tool calls
        is held back until it is known: then one chunk with the calls (OpenAI's deltas, each call whole), or
        the held text as one chunk."""
        assembler = choice.assembler
        held: list[Delta] = []
        deciding = kind == "chat"   # from the answer's start until it cannot be calls any more
        async for delta, out in self.outputs(choice):
            deciding = deciding and self._may_be_calls(body, assembler.token_ids,
                                                       "".join(d.text for d in held) + delta.text)
            if deciding:
                held.append(delta)
                if delta.finish_reason is None:
                    continue
                text = "".join(d.text for d in held)
                calls = self._calls(body, assembler.token_ids, text, delta.finish_reason)
                if calls is not None:
                    yield sse(ChatCompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[ChatStreamChoice(
                        index=choice.index, delta=ChatDelta(tool_calls=[c.openai(i) for i, c in enumerate(calls)]),
                        finish_reason="tool_calls")]))
                    return
                delta, held = _joined(held), []
            elif held:   # no longer possibly calls: the held text goes first
                delta, held = _joined(held + [delta]), []
            drafts = out.new_drafts if out is not None else []
            # drafts of the canvases this output committed go before its text, the next canvas's after
            early = sum(d.offset < len(assembler.token_ids) for d in drafts)
            for d in drafts[:early]:
                yield self._draft(chunk_id, d, choice.index)
            if delta.text or delta.token_ids or delta.finish_reason:
                yield sse(self._chunk(kind, body, chunk_id, delta, choice.index))
            for d in drafts[early:] if delta.finish_reason is None else ():
                yield self._draft(chunk_id, d, choice.index)

    def _draft(self, chunk_id: str, draft, index: int) -> str:
        return draft_event(draft_payload(self.tokenizer, draft, chunk_id, self.mask_id, self.canvas_length, index))

    def _chunk(self, kind: str, body, chunk_id: str, delta: Delta, index: int):
        scored = delta.logprobs is not None
        if kind == "completion":
            logprobs = completion_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top,
                                           delta.text_offsets) if scored else None
            return CompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[CompletionChoice(
                index=index, text=delta.text, logprobs=logprobs, finish_reason=delta.finish_reason)])
        logprobs = chat_logprobs(self.tokenizer, delta.token_ids, delta.logprobs, delta.top) \
            if scored and body.logprobs else None
        return ChatCompletionStreamResponse(id=chunk_id, model=self.model_name, choices=[ChatStreamChoice(
            index=index, delta=ChatDelta(content=delta.text), logprobs=logprobs, finish_reason=delta.finish_reason)])

    def usage(self, prompt_tokens: int, choices: list[Choice]) -> Usage:
        """Summed over the choices (the prompts' tokens once each, so a prompt's cached tokens are its
        choices' most)."""
        completion_tokens = sum(c.tokens for c in choices)
        steps = sum(c.last.denoising_steps for c in choices if c.last is not None)
        canvases = sum(c.last.canvases for c in choices if c.last is not None)
        cached: dict[str, int] = {}
        for c in choices:
            if c.last is not None:
                cached[c.prompt_param] = max(cached.get(c.prompt_param, 0), c.last.cached_tokens)
        if steps == 0 and canvases == 0:
            return Usage.of(prompt_tokens, completion_tokens, cached_tokens=sum(cached.values()))
        return Usage.of(prompt_tokens, completion_tokens, steps, canvases, self.canvas_length, sum(cached.values()))


def _joined(deltas: list[Delta]) -> Delta:
    """Consecutive deltas of one choice as one."""
    scored = deltas[0].logprobs is not None
    return Delta(text="".join(d.text for d in deltas), token_ids=[t for d in deltas for t in d.token_ids],
                 logprobs=[x for d in deltas for x in d.logprobs] if scored else None,
                 ranks=[x for d in deltas for x in d.ranks] if scored and deltas[0].ranks is not None else None,
                 top=[x for d in deltas for x in d.top] if scored and deltas[0].top is not None else None,
                 text_offsets=[x for d in deltas for x in d.text_offsets], stopped=deltas[-1].stopped,
                 finish_reason=deltas[-1].finish_reason)
