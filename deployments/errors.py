"""HTTP errors in OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`, and the ingress's
exception handlers (`add_handlers(app)`), which count every error answer for /metrics.

`param` is the request's dotted field name: pydantic's `loc` of a validation error
(`validation_error_param`), or the engine's own naming of the field it rejects (a ParamError,
passed along by the coordinator as data: `ERROR_STATUS` maps its error kinds to statuses).
"""
from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

# Serve ships the app to its replica pickled, and the exception handlers' module globals arrive as copies (a
# handler counting into `REQUESTS` counted into a copy). Looked up through the module, every path counts
# into the process's one.
from deployments import metrics as prom

# coordinator error kind -> (HTTP status, OpenAI error type)
ERROR_STATUS = {"invalid": (400, "invalid_request_error"), "queue_full": (429, "rate_limit_exceeded"),
                "shard_failure": (503, "service_unavailable"), "timeout": (503, "timeout")}


class APIError(Exception):
    def __init__(self, status: int, message: str, type: str = "invalid_request_error", param: str | None = None,
                 headers: dict | None = None, code: str | None = None):
        self.status, self.message, self.type, self.param, self.headers = status, message, type, param, headers
        self.code = code


class ErrorDetail(BaseModel):
    message: str
    type: str = "invalid_request_error"
    param: str | None = None
    code: str | None = None


class ErrorResponse(BaseModel):
    error: ErrorDetail


def error_body(message: str, type: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error JSON: {"error": {"message", "type", "param", "code"}}."""
    return ErrorResponse(error=ErrorDetail(message=message, type=type, param=param, code=code)).model_dump()


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(error_body(err.message, err.type, err.param, err.code), status_code=err.status,
                        headers=err.headers)


# ------------------------------------------------------------------------- naming a validation error

_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "tuple", "none"}
_BODY_ERRORS = {"json_invalid": "the body is not valid JSON: {error} at character {at}",
                "missing": "the request has no JSON body",
                "model_attributes_type": "the body must be a JSON object",
                "dict_type": "the body must be a JSON object"}


def _param(loc: tuple, rename: dict[str, str] | None = None, unknown: bool = False) -> str | None:
    """('body', 'diffusion', 'threshold') -> 'diffusion.threshold'; ('messages', 0, 'content') ->
    'messages[0].content'. Union-member tags (e.g. 'list[int]') are dropped; `unknown`: the last part
    is a field the client sent that does not exist, kept as spelt (e.g. 'diffusion.Mode'; a key that is
    the empty string as '""', so it is still named)."""
    parts = list(loc[1:] if loc and loc[0] == "body" else loc)
    if not parts or isinstance(parts[0], int):  # a model-level error, or a JSON decode position
        return None
    key = (str(parts.pop()) or '""') if unknown else None
    out = ""
    for p in parts:
        if isinstance(p, int):
            out += f"[{p}]"
        elif p.isidentifier() and p.islower() and p not in _TYPE_TAGS:
            out += f".{p}" if out else p
    if key is not None:
        out = f"{out}.{key}" if out else key
    if rename:
        head, dot, rest = out.partition(".")
        out = rename.get(head, head) + dot + rest
    return out or None


def validation_error_param(err: ValidationError | list[dict], rename: dict[str, str] | None = None
                           ) -> tuple[str, str | None]:
    """A pydantic ValidationError (or FastAPI's `RequestValidationError.errors()`) -> (a readable message
    naming every bad field, the first bad field's dotted name without the leading "body"). `rename` maps
    a field's first part to the request's name for it (e.g. the engine's "threshold" is the request's
    "diffusion.threshold")."""
    messages, params, seen = [], [], set()
    for e in err.errors() if isinstance(err, ValidationError) else list(err):
        param = _param(tuple(e.get("loc", ())), rename, unknown=e.get("type") == "extra_forbidden")
        if param in seen and param is not None:
            continue  # several union members failing on one field: the first says enough
        seen.add(param)
        params.append(param)
        msg = str(e.get("msg", "invalid value"))
        for prefix in ("Value error, ", "Assertion failed, "):
            msg = msg.removeprefix(prefix)
        kind = e.get("type")
        if kind == "extra_forbidden":
            msg = "unknown field"
        elif param is None and kind in _BODY_ERRORS:  # the body as a whole
            loc, ctx = e.get("loc") or ("?",), e.get("ctx") or {}
            msg = _BODY_ERRORS[kind].format(error=ctx.get("error", msg), at=loc[-1])
        messages.append(f"{param}: {msg}" if param else msg)
    return "; ".join(messages) or "invalid request", next((p for p in params if p), None)


# ------------------------------------------------------------------------------------------ handlers


async def _api_error(request: Request, err: APIError) -> JSONResponse:
    prom.REQUESTS.add(prom.endpoint_of(request.url.path), err.status)
    return error_response(err)


async def _invalid(request: Request, err: RequestValidationError) -> JSONResponse:
    message, param = validation_error_param(err.errors())
    prom.REQUESTS.add(prom.endpoint_of(request.url.path), 400)
    return error_response(APIError(400, message, param=param))


async def _http(request: Request, err: StarletteHTTPException) -> JSONResponse:
    prom.REQUESTS.add(prom.endpoint_of(request.url.path), err.status_code)
    message = str(err.detail)
    if message == "There was an error parsing the body":  # FastAPI's json.loads raised, not with a JSON error
        message = "the body could not be parsed as JSON: not UTF-8, nested too deeply, or an integer too long"
    return error_response(APIError(err.status_code, message, "invalid_request_error"))


async def _internal(request: Request, err: Exception) -> JSONResponse:
    prom.REQUESTS.add(prom.endpoint_of(request.url.path), 500)
    return error_response(APIError(500, f"internal error: {type(err).__name__}", "internal_error"))


def add_handlers(app: FastAPI) -> None:
    """Every error answer of `app` in OpenAI's shape, counted by endpoint and status."""
    app.add_exception_handler(APIError, _api_error)
    app.add_exception_handler(RequestValidationError, _invalid)
    app.add_exception_handler(StarletteHTTPException, _http)
    app.add_exception_handler(Exception, _internal)
