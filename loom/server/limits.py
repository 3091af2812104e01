"""The server's HTTP edge: `BodySizeLimit`, ASGI middleware that refuses request bodies larger
than a limit with a 413, `RequestIds`, which names every answer with an ``x-request-id``,
`HeadAsGet`, which answers HEAD on every GET route, and `Cors`, which lets browser pages on
other origins call the API.

A declared ``Content-Length`` above the limit is refused before anything is read. Otherwise
the body is read up to the limit: if it goes over, the request is refused; if not, the
buffered body is replayed to the app, and later ``receive`` calls (the disconnect
notification) go to the server as usual.
"""

from __future__ import annotations

import secrets
import uuid
from dataclasses import dataclass

from starlette.middleware.cors import CORSMiddleware
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loom.server.errors import anthropic_error_response, error_response, is_anthropic_path


@dataclass(frozen=True)
class Cors:
    """Cross-origin access, as vLLM's server offers it (`--allowed-origins`, default every origin,
    `--allow-credentials`): answers to browser pages on these origins carry the CORS headers,
    and their preflight requests are answered before authentication. No origins: none."""

    origins: tuple[str, ...] = ("*",)
    credentials: bool = False

    def install(self, app) -> None:
        """Adds the middleware outermost (call it last): errors from the inner layers (413, 401)
        then carry the headers too, and a browser can read them."""
        if self.origins:
            app.add_middleware(CORSMiddleware, allow_origins=list(self.origins), allow_credentials=self.credentials,
                               allow_methods=["*"], allow_headers=["*"])


class RequestIds:
    """Every answer carries an ``x-request-id`` header, as OpenAI's do (its client shows it as
    `_request_id`, for logs): the client's own X-Request-Id where it sent one, else a new id."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        rid = given[:128] if given else f"req_{uuid.uuid4().hex}".encode()

        async def named(message: Message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid)]}
            await send(message)

        await self.app(scope, receive, named)


KEY_MESSAGE = "invalid or missing API key: send the header 'Authorization: Bearer <key>' or 'x-api-key: <key>'"


def has_key(authorization: bytes, x_api_key: bytes, key: bytes) -> bool:
    """Whether a request's headers carry the server's key: ``Authorization: Bearer <key>`` (the
    OpenAI clients') or ``x-api-key: <key>`` (Anthropic's)."""
    scheme, _, given = authorization.partition(b" ")
    return ((scheme.lower() == b"bearer" and secrets.compare_digest(given.strip(), key))
            or secrets.compare_digest(x_api_key.strip(), key))


class BearerKey:
    """--api-key: a request to the API (``/v1/...``, vLLM's tokenizer routes, llama-server's
    ``/completion`` and ``/props``) without the key is a 401 before its body is read, as vLLM's
    middleware answers it (FastAPI reads the body before the routes' own check, so a malformed
    body got a 400 first). The key comes as
    ``Authorization: Bearer <key>`` or, as Anthropic's clients send it, ``x-api-key: <key>``;
    the 401 of an Anthropic route has Anthropic's error shape. /health, /metrics, /version and
    the playground stay open; CORS preflights pass."""

    PATHS = ("/v1/", "/tokenize", "/detokenize", "/tokenizer_info", "/completion", "/props",
             "/apply-template")   # llama-server's too

    def __init__(self, app: ASGIApp, api_key: str):
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if (scope["type"] != "http" or scope["method"] == "OPTIONS"
                or not (scope["path"] + "/").startswith(self.PATHS)):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        if has_key(headers.get(b"authorization", b""), headers.get(b"x-api-key", b""), self.key):
            await self.app(scope, receive, send)
            return
        if is_anthropic_path(scope["path"]):
            response = anthropic_error_response(401, KEY_MESSAGE, headers={"WWW-Authenticate": "Bearer"})
        else:
            response = error_response(401, KEY_MESSAGE, type="authentication_error", code="invalid_api_key",
                                      headers={"WWW-Authenticate": "Bearer"})
        await response(scope, receive, send)


class HeadAsGet:
    """HEAD answered as the GET of the same path without its body (status and headers, the
    length included), as llama-server and most HTTP servers do: uptime probes that send HEAD to
    /health or /v1/models see what a GET sees. A path without GET answers 405 as before."""

    def __init__(self, app: ASGIApp):
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def headers_only(message: Message) -> None:
            if message["type"] == "http.response.body":
                if message.get("more_body", False):
                    return
                message = {"type": "http.response.body", "body": b"", "more_body": False}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, headers_only)


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            await self._refuse(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # the client left before sending its body; let the app see the disconnect
                await self.app(scope, _replay([message], receive), send)
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_body_bytes:
                await self._refuse(scope, receive, send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        whole: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay([whole], receive), send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        message = f"request body is larger than the limit of {self.max_body_bytes} bytes"
        headers = {"Connection": "close"}
        if is_anthropic_path(scope["path"]):
            response = anthropic_error_response(413, message, headers=headers)
        else:
            response = error_response(413, message, code="request_too_large", headers=headers)
        await response(scope, receive, send)


def _replay(messages: list[Message], receive: Receive) -> Receive:
    pending = list(messages)

    async def replayed() -> Message:
        if pending:
            return pending.pop(0)
        return await receive()

    return replayed
