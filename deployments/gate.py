"""What every HTTP request passes before FastAPI reads and validates its body: its id, its key, its size.

`RequestGate` is a pure ASGI middleware (FastAPI validates a body before any endpoint or dependency of
it runs, and reads it whole first), in this order:

1. the request's id: `X-Request-Id` as it arrives, in `request.state.request_id` (a fresh one if none).
   Ray Serve's proxy reads that header or makes one (a UUID), passes it on, and echoes it in the
   answer's `X-Request-Id` header, errors included (ray.serve's RequestIdMiddleware): so the gate
   does not echo it too (a second header value);
2. the API key, on `/v1/...`, `/tokenize` and `/detokenize` when the server has one: a 401 before anything
   about the body is said;
3. a malformed `X-Request-Id` (not 1 to 256 visible ASCII characters): a 400 naming it;
4. the body's size: a 413 at once when `Content-Length` is over `max_body_bytes`, else the body is read
   here, stopping with a 413 as soon as more than `max_body_bytes` has arrived (chunked uploads carry no
   length), within `body_timeout_s`; the app then gets the body as it came.

Every refusal is OpenAI-shaped (deployments/errors.py) and counted for /metrics.
"""
from __future__ import annotations

import asyncio
import hmac
import re
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Callable

from ray.exceptions import TaskCancelledError
from starlette.datastructures import Headers
from starlette.types import ASGIApp, Message, Receive, Scope, Send

# Through the module, as deployments/errors.py says.
from deployments import metrics as prom
from deployments.errors import APIError, error_response

KEYED_PATHS = ("/tokenize", "/detokenize")   # besides /v1/...: what api_key guards
REQUEST_ID_HEADER = "X-Request-Id"
REQUEST_ID_MAX = 256
_REQUEST_ID = re.compile(rf"[\x21-\x7e]{{1,{REQUEST_ID_MAX}}}")
# the header as the served OpenAPI schema documents it (so schemathesis sends it, valid and not)
REQUEST_ID_PARAMETER = {
    "name": REQUEST_ID_HEADER, "in": "header", "required": False,
    "description": "the request's id, echoed in the X-Request-Id response header and used in the response id; "
                   "default: a fresh UUID",
    "schema": {"type": "string", "pattern": rf"^[\x21-\x7e]{{1,{REQUEST_ID_MAX}}}$"},
}


@dataclass(frozen=True)
class GateSettings:
    api_key: str | None
    max_body_bytes: int
    body_timeout_s: float


def new_request_id() -> str:
    return uuid.uuid4().hex


def _route_path(scope: Scope) -> str:
    """The path below the app's mount point (Serve's route prefix arrives as `root_path`)."""
    path, root = scope["path"], scope.get("root_path", "")
    return path[len(root):] if root and path.startswith(root) else path


class _TooLarge(Exception):
    pass


class RequestGate:
    """`settings` is called per request: the ingress replica's settings are known only once it is built,
    after the app (and its middleware) was frozen by `@serve.ingress`."""

    def __init__(self, app: ASGIApp, settings: Callable[[], GateSettings]):
        self.app, self.settings = app, settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        settings = self.settings()
        headers = Headers(scope=scope)
        given = headers.get(REQUEST_ID_HEADER) or None
        well_formed = given is None or _REQUEST_ID.fullmatch(given) is not None
        scope.setdefault("state", {})["request_id"] = given if given is not None and well_formed else new_request_id()
        path = _route_path(scope)

        refusal = self._refusal(settings, headers, path, well_formed)
        if refusal is not None:
            await self._refuse(refusal, scope, receive, send, path)
            return
        try:
            body = await asyncio.wait_for(_read_body(receive, settings.max_body_bytes), settings.body_timeout_s)
        except _TooLarge:
            await self._refuse(_too_large(settings.max_body_bytes), scope, receive, send, path)
            return
        except asyncio.TimeoutError:
            err = APIError(408, f"the request body did not arrive within {settings.body_timeout_s:g} s",
                           code="request_timeout")
            await self._refuse(err, scope, receive, send, path)
            return
        await self.app(scope, _replaying(body, receive), send)

    @staticmethod
    def _refusal(settings: GateSettings, headers: Headers, path: str, well_formed: bool) -> APIError | None:
        if settings.api_key is not None and _needs_key(path):
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {settings.api_key}".encode()):
                return APIError(401, "invalid or missing API key", "authentication_error")
        if not well_formed:
            return APIError(400, f"{REQUEST_ID_HEADER} must be 1 to {REQUEST_ID_MAX} visible ASCII characters "
                                 "(no spaces)", param=REQUEST_ID_HEADER)
        length = headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > settings.max_body_bytes:
            return _too_large(settings.max_body_bytes)
        return None

    @staticmethod
    async def _refuse(err: APIError, scope: Scope, receive: Receive, send: Send, path: str) -> None:
        prom.REQUESTS.add(prom.endpoint_of(path), err.status)
        await error_response(err)(scope, receive, send)


def _needs_key(path: str) -> bool:
    """The API: /v1/..., and vLLM's /tokenize and /detokenize (not /health, /metrics or the playground)."""
    return path == "/v1" or path.startswith("/v1/") or path in KEYED_PATHS


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes (max_body_bytes)",
                    code="request_too_large")


async def _read_body(receive: Receive, limit: int) -> list[Message]:
    """The body's messages as they came (a disconnect included), raising _TooLarge past `limit` bytes."""
    messages, size = [], 0
    while True:
        message = await receive()
        messages.append(message)
        if message["type"] != "http.request":
            return messages
        size += len(message.get("body", b""))
        if size > limit:
            raise _TooLarge
        if not message.get("more_body", False):
            return messages


def _replaying(messages: list[Message], receive: Receive) -> Receive:
    """The body read here first, then the live channel (a streaming answer listens there for a disconnect).
    Where the client leaves and Serve's proxy cancels the request before the disconnect message reaches
    the replica, Serve's channel raises TaskCancelledError instead: that is the disconnect too (else it
    escapes the stream as an unretrieved task exception, a traceback in the log for a client hanging up)."""
    pending = deque(messages)

    async def replay() -> Message:
        if pending:
            return pending.popleft()
        try:
            return await receive()
        except TaskCancelledError:
            return {"type": "http.disconnect"}
    return replay
