"""deployments/gate.py in process (a bare FastAPI app behind the gate, over httpx's ASGI transport): the
order of its checks, the 413 before a body is read whole (by Content-Length, and by counting a chunked
upload), and the request id. tests/test_http.py checks the same through Ray Serve, whose proxy echoes
the id."""
import asyncio

import httpx
import pytest
from fastapi import FastAPI, Request
from pydantic import BaseModel

from deployments.errors import add_handlers
from deployments.gate import GateSettings, RequestGate
from tests.serve_harness import assert_openai_error

LIMIT = 1000


class Body(BaseModel):
    prompt: str


def gated_app(api_key: str | None = "k", limit: int = LIMIT, timeout_s: float = 5.0):
    """The app and the list of bodies its endpoint saw (a refused request must add none)."""
    app, seen = FastAPI(), []
    add_handlers(app)
    app.add_middleware(RequestGate, settings=lambda: GateSettings(api_key, limit, timeout_s))

    @app.post("/v1/echo")
    async def echo(body: Body, request: Request) -> dict:
        seen.append(body.prompt)
        return {"prompt": body.prompt, "id": request.state.request_id}

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}
    return app, seen


def call(app, method: str, path: str, **kw) -> httpx.Response:
    async def go():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
            return await client.request(method, path, **kw)
    return asyncio.run(go())


KEY = {"authorization": "Bearer k"}
JSON = {"content-type": "application/json"}


def test_the_key_is_checked_before_the_body():
    app, seen = gated_app()
    for content in (b"{not json", b'{"prompt": 5}', b"x" * (LIMIT + 1)):
        r = call(app, "POST", "/v1/echo", content=content, headers=JSON)
        assert r.status_code == 401, r.text
        assert_openai_error(r.json(), 401)
    r = call(app, "POST", "/v1/echo", content=b'{"prompt": 5}', headers=KEY | JSON)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    assert call(app, "GET", "/health").status_code == 200   # not under /v1: no key needed
    assert seen == []


def test_a_body_over_the_limit_is_refused_by_length_and_while_it_streams():
    app, seen = gated_app(api_key=None)
    body = b'{"prompt": "' + b"x" * 10 * LIMIT + b'"}'
    r = call(app, "POST", "/v1/echo", content=body)   # with Content-Length
    assert r.status_code == 413 and "1000 bytes" in assert_openai_error(r.json(), 413)["message"]

    pulled = []

    async def chunks():   # no Content-Length: the gate counts, and stops pulling past the limit
        for i in range(0, len(body), 100):
            pulled.append(i)
            yield body[i:i + 100]
    r = call(app, "POST", "/v1/echo", content=chunks())
    assert r.status_code == 413, r.text
    assert len(pulled) <= LIMIT // 100 + 1 < len(body) // 100
    assert seen == []
    small = b'{"prompt": "' + b"x" * 100 + b'"}'

    async def small_chunks():
        for i in range(0, len(small), 7):
            yield small[i:i + 7]
    r = call(app, "POST", "/v1/echo", content=small_chunks(), headers=JSON)
    assert r.status_code == 200 and r.json()["prompt"] == "x" * 100


def test_a_body_that_does_not_arrive_in_time_is_a_408():
    app, seen = gated_app(api_key=None, timeout_s=0.2)

    async def stalled():
        yield b'{"prompt": '
        await asyncio.sleep(5)
        yield b'"x"}'
    r = call(app, "POST", "/v1/echo", content=stalled())
    assert r.status_code == 408 and seen == []
    assert_openai_error(r.json(), 408)


def test_the_request_id_is_the_header_or_a_fresh_one():
    app, _ = gated_app()
    r = call(app, "POST", "/v1/echo", json={"prompt": "a"}, headers=KEY | {"x-request-id": "my-id.42"})
    assert r.status_code == 200 and r.json()["id"] == "my-id.42"
    made = {call(app, "POST", "/v1/echo", json={"prompt": "a"}, headers=KEY).json()["id"] for _ in range(2)}
    assert len(made) == 2 and all(len(m) == 32 for m in made)


@pytest.mark.parametrize("bad", ["a" * 257, "has space", "caf\xe9"])
def test_a_malformed_request_id_is_a_400_naming_it_after_the_key(bad):
    app, seen = gated_app()
    r = call(app, "POST", "/v1/echo", json={"prompt": "a"}, headers={"x-request-id": bad.encode("latin-1")})
    assert r.status_code == 401   # the key first
    r = call(app, "POST", "/v1/echo", json={"prompt": "a"}, headers=KEY | {"x-request-id": bad.encode("latin-1")})
    assert r.status_code == 400 and seen == []
    assert_openai_error(r.json(), 400, "X-Request-Id")


def test_a_request_serve_cancels_ends_its_stream_as_a_disconnect():
    """Where the client leaves and Serve's proxy cancels the request before the disconnect message
    arrives, Serve's receive channel raises TaskCancelledError: the stream must end as on a disconnect
    (its generator closed), not let the error escape the app (an unretrieved task exception and a
    traceback in the replica's log for every such hang-up, seen in the GPU soak)."""
    from ray.exceptions import TaskCancelledError
    from starlette.responses import StreamingResponse

    app, closed = FastAPI(), asyncio.Event()
    app.add_middleware(RequestGate, settings=lambda: GateSettings(None, LIMIT, 5.0))

    @app.post("/v1/stream")
    async def stream() -> StreamingResponse:
        async def chunks():
            try:
                while True:
                    yield "data: x\n\n"
                    await asyncio.sleep(0.01)
            finally:
                closed.set()
        return StreamingResponse(chunks(), media_type="text/event-stream")

    async def go():
        body = [{"type": "http.request", "body": b"{}", "more_body": False}]
        sent = []

        async def receive():
            if body:
                return body.pop()
            await asyncio.sleep(0.05)   # a few chunks go out, then Serve cancels the request
            raise TaskCancelledError()

        async def send(message):
            sent.append(message)
        scope = {"type": "http", "method": "POST", "path": "/v1/stream", "headers": [], "query_string": b"",
                 "http_version": "1.1", "scheme": "http", "server": ("t", 80), "client": ("c", 1), "root_path": ""}
        await asyncio.wait_for(app(scope, receive, send), 5)
        await asyncio.wait_for(closed.wait(), 5)
        return sent
    sent = asyncio.run(go())
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 200
    assert any(m.get("body") == b"data: x\n\n" for m in sent[1:])
