"""What a client sees of dllm-serve over HTTP, and what it checks in it: the SSE payloads of a stream,
the OpenAI error shape, a whole answer; a burst of concurrent requests and a stream abandoned mid-way.
Shared by the HTTP tests (tests/test_http_*.py) and the GPU soak (scripts/soak_gpu.py). The checks
raise AssertionError saying what is wrong (a test fails on it; the soak counts it as an error)."""
from __future__ import annotations

import asyncio
import json
import time

import httpx

ERROR_KEYS = {"message", "type", "param", "code"}
CHAT = "/v1/chat/completions"


def sse_payloads(lines) -> list[str]:
    """The `data:` payloads of a server-sent event stream, in order."""
    return [line[len("data: "):] for line in lines if line.startswith("data: ")]


def assert_openai_error(body: dict, status: int, param: str | None = None) -> dict:
    """{"error": {"message", "type", "param", "code"}} with a message; `param` checked when given."""
    assert set(body) == {"error"} and set(body["error"]) == ERROR_KEYS, body
    error = body["error"]
    assert isinstance(error["message"], str) and error["message"], body
    if status == 400:
        assert error["type"] == "invalid_request_error", body
    if param is not None:
        assert error["param"] == param, body
    return error


def assert_refused(out: dict) -> dict:
    """A request turned away (429 queue full, 503): the error shape and `Retry-After: 1`; its error."""
    error = assert_openai_error(out["body"], out["status"])
    assert out["retry_after"] == "1", out
    return error


def check_answer(path: str, body: dict, status: int, text: str) -> int:
    """A whole, well-formed answer to `body` (sent with ignore_eos; a stream with include_usage): a 200,
    a stream ending in one usage chunk and [DONE] with no error event, the finish reason only on the
    last chunk, max_tokens tokens unless a stop string ended it, one logprob <= 0 per token when asked.
    Returns its completion tokens."""
    assert status == 200, f"HTTP {status}: {text[:300]}"
    stopped = bool(body.get("stop"))
    length = body.get("max_completion_tokens") or body.get("max_tokens")
    if body.get("stream"):
        payloads = sse_payloads(text.splitlines())
        assert payloads and payloads[-1] == "[DONE]", payloads[-2:]
        assert not any(p.startswith('{"error"') for p in payloads), payloads[-2:]
        chunks = [json.loads(p) for p in payloads[:-1]]
        finishes = [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]]
        assert finishes and finishes[-1] in ("length", "stop") and not any(finishes[:-1]), finishes
        usage = [c["usage"] for c in chunks if c.get("usage")]
        assert len(usage) == 1 and (stopped or usage[0]["completion_tokens"] == length), usage
        return usage[0]["completion_tokens"]
    answer = json.loads(text)
    choice, tokens = answer["choices"][0], answer["usage"]["completion_tokens"]
    assert choice["finish_reason"] in ("length", "stop"), choice["finish_reason"]
    assert stopped or tokens == length, f"{tokens} tokens, max_tokens {length}"
    if body.get("logprobs"):
        scored = choice["logprobs"]["content"] if path == CHAT else choice["logprobs"]["token_logprobs"]
        values = [t["logprob"] if path == CHAT else t for t in scored]
        assert len(values) == tokens, f"{len(values)} logprobs for {tokens} tokens"
        above = [(i, v) for i, v in enumerate(values) if not (isinstance(v, (int, float)) and v <= 0)]
        assert not above, f"logprobs not <= 0 (position, value): {above[:5]}"
    return tokens


async def outcome(http: httpx.AsyncClient, url: str, body: dict) -> dict:
    """What a client sees of one request: status, Retry-After, seconds, and the SSE payloads (a 200
    stream) or the JSON body; `raw` is the whole text (an answer for check_answer)."""
    t0 = time.monotonic()
    async with http.stream("POST", url, json=body) as r:
        raw = [line async for line in r.aiter_lines()]
    out = {"status": r.status_code, "retry_after": r.headers.get("retry-after"), "s": time.monotonic() - t0,
           "stream": bool(body.get("stream")), "raw": "\n".join(raw)}
    if r.status_code == 200 and out["stream"]:
        out["payloads"] = sse_payloads(raw)
    else:
        out["body"] = json.loads("".join(raw))
    return out


async def burst(url: str, bodies: list[dict], bound_s: float) -> list[dict]:
    """Every body at once, each on its own connection; every outcome within `bound_s` (+30 s for all)."""
    limits = httpx.Limits(max_connections=len(bodies), max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=bound_s, limits=limits) as http:
        return await asyncio.wait_for(asyncio.gather(*[outcome(http, url, b) for b in bodies]), bound_s + 30)


async def abandon_stream(http: httpx.AsyncClient, url: str, body: dict, chunks: int) -> int:
    """Streams `body` and hangs up after `chunks` data chunks or drafts (a stream with
    `diffusion.stream_drafts` can be left mid-canvas); how many it saw (fewer only if the stream ended
    first)."""
    seen = 0
    async with http.stream("POST", url, json=body) as r:
        assert r.status_code == 200, f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
        async for line in r.aiter_lines():
            if line.startswith(("data: {", ": draft ")):
                seen += 1
                if seen == chunks:
                    break
    return seen
