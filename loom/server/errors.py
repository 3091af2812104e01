"""Every failure the API reports, as an OpenAI-style error body.

Rules:

* a client mistake is a 4xx with ``{"error": {"message", "type", "param", "code"}}`` and is
  never logged with a traceback;
* `QueueFullError` (the bounded waiting queue is full) is a 429 with ``Retry-After``;
* `EngineDeadError` (the engine process is gone) is a 503 with ``Retry-After``: the time a new
  engine process took to load while one restarts (`EngineRestartingError`), else 10 s;
* any other `LoomError` raised while handling a request is the client's input (a prompt the
  chat template rejects, a prompt longer than the context, ...) and is a 400;
* only a bug is a 500; its traceback is logged by the server, its body stays generic.
"""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from loom.errors import (
    ContextLengthError,
    EngineDeadError,
    EngineGoneError,
    EngineRestartingError,
    LoomError,
    QueueFullError,
)
from loom.server.protocol import IGNORED_FIELDS, NO_OP_FIELDS, ErrorInfo, ErrorResponse

log = logging.getLogger("loom.server")

# Seconds a client told "queue full" should wait before retrying.
RETRY_AFTER_SECONDS = 1
# ... and one told "the engine is gone" for good (a supervisor restarts the server).
ENGINE_RETRY_AFTER_SECONDS = 10

INVALID_REQUEST = "invalid_request_error"
AUTHENTICATION = "authentication_error"
NOT_FOUND = "not_found_error"
OVERLOADED = "server_overloaded"
SERVER_ERROR = "server_error"

_STATUS_TYPES = {401: AUTHENTICATION, 404: NOT_FOUND, 429: OVERLOADED}
# FastAPI's detail for a body that fails to decode before JSON parsing (e.g. bad UTF-8).
_FASTAPI_BODY_PARSE_ERROR = "There was an error parsing the body"

# Location parts pydantic adds for union members or wrappers; they are not field names.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "none", "bytes", "list", "dict"})
_FIELD = re.compile(r"^[a-z_][a-z0-9_]*$")
# SamplingParams and the engine start their messages with the field's name ("max_tokens must be
# ...", "structured_outputs.json does not compile: ...", "prompt is 9000 tokens, ...").
# An option of an object field may follow it after a space ("kv_eviction budget must be ...").
_LEADING_FIELD = re.compile(r"^([a-z_][a-z0-9_]*(?:\.[a-z_][a-z0-9_]*)*(?: (?:policy|budget|sinks|window|pool))?) "
                            r"(?:must |does not |is \d|is empty|token ids must |holds |leaves |cannot |is smaller |applies )")


class ApiError(Exception):
    """An error answer decided by the API layer (unknown model, limit exceeded, ...)."""

    def __init__(self, status: int, message: str, *, type: str | None = None, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type or _STATUS_TYPES.get(status, INVALID_REQUEST if status < 500 else SERVER_ERROR)
        self.param = param
        self.code = code
        self.headers = headers


class ClientDisconnected(Exception):
    """The client went away before its answer was ready; nothing is sent back."""


def error_response(status: int, message: str, *, type: str | None = None, param: str | None = None,
                   code: str | None = None, headers: dict[str, str] | None = None) -> JSONResponse:
    kind = type or _STATUS_TYPES.get(status, INVALID_REQUEST if status < 500 else SERVER_ERROR)
    body = ErrorResponse(error=ErrorInfo(message=message, type=kind, param=param, code=code))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def api_error_from_loom(e: LoomError, path: str = "") -> ApiError:
    """The API error for a LoomError raised while serving a request (at `path`: a chat request's
    prompt is its messages)."""
    message = str(e)
    if isinstance(e, QueueFullError):
        return ApiError(429, f"{message}; retry later", code="queue_full",
                        headers={"Retry-After": str(RETRY_AFTER_SECONDS)})
    if isinstance(e, EngineDeadError):
        return ApiError(503, message, type=SERVER_ERROR, code="engine_unavailable", headers=retry_headers(e))
    match = _LEADING_FIELD.match(message)
    param = match.group(1).replace(" ", ".") if match else None
    if param == "prompt" and path.endswith(("/chat/completions", "/responses")):
        param = "messages" if path.endswith("/chat/completions") else "input"
    if isinstance(e, ContextLengthError):
        if message.startswith("'max_tokens'"):   # the budget past the prompt's room
            param = "max_output_tokens" if path.endswith("/responses") else "max_tokens"
        return ApiError(400, message, param=param, code="context_length_exceeded")
    return ApiError(400, message, param=param, code="invalid_value" if param else None)


def stream_error(e: Exception) -> dict[str, Any]:
    """The error object of a stream that failed after its status line went out (sent in-band):
    a LoomError as its answer would have said it (an engine that died: 503's), anything else an
    internal error, logged."""
    if isinstance(e, LoomError):
        err = api_error_from_loom(e)
        return {"message": err.message, "type": err.type, "param": err.param, "code": err.code}
    log.error("stream failed: %r", e)
    return {"message": "internal server error", "type": SERVER_ERROR, "param": None, "code": None}


def retry_headers(e: EngineDeadError) -> dict[str, str] | None:
    """Retry-After while the engine may come back; none once it will not (EngineGoneError)."""
    return None if isinstance(e, EngineGoneError) else {"Retry-After": str(engine_retry_after(e))}


def engine_retry_after(e: EngineDeadError) -> int:
    """Seconds a client should wait before retrying while the engine is unavailable."""
    return e.retry_after if isinstance(e, EngineRestartingError) else ENGINE_RETRY_AFTER_SECONDS


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [str(p) for p in loc[1:] if isinstance(p, int) or (isinstance(p, str) and _FIELD.match(p)
                                                                 and p not in _TYPE_TAGS)]
    return ".".join(parts) or None


def validation_message(errors: list[dict[str, Any]]) -> tuple[str, str | None]:
    """One readable message (and the offending parameter) for pydantic's error list."""
    first = errors[0]
    loc = tuple(first.get("loc", ()))
    kind = first.get("type", "")
    if kind == "json_invalid":
        detail = (first.get("ctx") or {}).get("error", "invalid JSON")
        where = f" at position {loc[1]}" if len(loc) > 1 else ""
        return f"malformed JSON body: {detail}{where}", None
    if loc == ("body",):
        if kind == "value_error":   # a whole-body check of a request model (its own words)
            return str(first.get("msg", "invalid request")).removeprefix("Value error, "), None
        if kind == "missing":
            return "the request needs a JSON object body (Content-Type: application/json)", None
        return "the request body must be a JSON object (sent with Content-Type: application/json)", None
    unknown = [e for e in errors if e.get("type") == "extra_forbidden"]
    if unknown:   # a field loom does not implement is refused, never silently ignored
        param = _param_of(tuple(unknown[0].get("loc", ())))
        return (f"unknown field '{param}': loom does not implement it (fields accepted but ignored because they "
                f"cannot change the output: {', '.join(IGNORED_FIELDS)}, and on completions and chat "
                f"{', '.join(NO_OP_FIELDS)})"), param
    if loc[1:2] == ("use_beam_search",):
        return "use_beam_search: beam search runs offline (LLM.beam_search); the server takes false only", \
            "use_beam_search"
    # A union reports one error per member. The members that got furthest into the value
    # say the most ("at least 1 character" beats "not a string"); if several got equally
    # far, say what each wanted.
    field = loc[1] if len(loc) > 1 else None
    same = [e for e in errors if len(e.get("loc", ())) > 1 and e["loc"][1] == field] or [first]
    depth = max(len(_param_of(tuple(e.get("loc", ()))) or "") for e in same)
    best = [e for e in same if len(_param_of(tuple(e.get("loc", ()))) or "") == depth]
    param = _param_of(tuple(best[0].get("loc", ())))
    wants = list(dict.fromkeys(e.get("msg", "invalid value") for e in best))[:4]
    shown = "" if best[0].get("type") == "missing" else f" (got {_short(best[0].get('input'))})"
    return f"{param or 'body'}: {'; or '.join(wants)}{shown}", param


def _short(value: Any, limit: int = 60) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def install_error_handlers(app: FastAPI) -> None:
    """Routes every error path of `app` to an OpenAI-style body."""

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, e: ApiError) -> JSONResponse:
        return error_response(e.status, e.message, type=e.type, param=e.param, code=e.code, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        message, param = validation_message(list(e.errors()))
        return error_response(400, message, param=param, code="invalid_value" if param else "invalid_body")

    @app.exception_handler(LoomError)
    async def _loom(request: Request, e: LoomError) -> JSONResponse:
        err = api_error_from_loom(e, request.url.path)
        return error_response(err.status, err.message, type=err.type, param=err.param, code=err.code,
                              headers=err.headers)

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, e: StarletteHTTPException) -> JSONResponse:
        message = e.detail if isinstance(e.detail, str) else str(e.detail)
        if e.status_code == 404 and message == "Not Found":
            message = (f"Invalid URL ({request.method} {request.url.path}): this server has no such endpoint "
                       "(it serves /v1/completions, /v1/chat/completions, /v1/responses, /v1/messages, /v1/models, "
                       "vLLM's /tokenize, /detokenize and llama-server's /completion, /props; see /docs)")
            return error_response(404, message, type=INVALID_REQUEST, code="unknown_url")
        elif e.status_code == 400 and message == _FASTAPI_BODY_PARSE_ERROR:   # not UTF-8, or too deep for the parser
            return error_response(400, "malformed JSON body: it is not UTF-8 JSON text, or it nests arrays and "
                                  "objects deeper than the parser allows", code="invalid_body")
        return error_response(e.status_code, message, headers=dict(e.headers or {}) or None)

    @app.exception_handler(Exception)
    async def _bug(_: Request, __: Exception) -> JSONResponse:
        # Starlette re-raises the exception after this answer, so the server logs its traceback.
        return error_response(500, "internal server error", type=SERVER_ERROR)


# Anthropic's Messages API (loom/server/anthropic.py) answers errors in its own shape, the
# middlewares' 401 and 413 too: the status loom's errors get there, and Anthropic's type of each
ANTHROPIC_PATH = "/v1/messages"
_OVERLOADED = 529
_ANTHROPIC_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                    404: "not_found_error", 413: "request_too_large", _OVERLOADED: "overloaded_error",
                    500: "api_error"}


def is_anthropic_path(path: str) -> bool:
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_response(status: int, message: str, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error answer in Anthropic's shape ({"type": "error", "error": {"type", "message"}}).
    loom's 429 (its waiting queue is full) and a 503 with Retry-After (an engine restarting) are
    Anthropic's 529 overloaded_error; a 503 without one (the engine gone for good) its 500
    api_error."""
    if status == 429 or (status == 503 and headers and "Retry-After" in headers):
        status = _OVERLOADED
    elif status > 500:
        status = 500
    kind = _ANTHROPIC_TYPES.get(status, "invalid_request_error" if status < 500 else "api_error")
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status_code=status,
                        headers=headers)
