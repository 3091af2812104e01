"""An HTTP request as the ingress forwards it to a replica, and its replay through an ASGI app.

The ingress does not parse the OpenAI API: it reads the request, marks the text the router
matches prefixes on (`routing_text`), and hands the whole request to a replica, which runs it
through loom's own app (`loom.server.openai_api.build_app`) with `run_asgi`, so validation,
errors, streaming and n > 1 behave exactly as with `loom serve` on one machine. The replica
answers with a stream:

    ResponseStart(status, headers, replica)   # first: the status line and headers
    bytes, bytes, ...                         # the body as the app sends it (SSE events)
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field, replace
from typing import Any

ROUTING_TEXT_CHARS = 64 * 256   # what the prefix router looks at (prefix_index.DEFAULT_MAX_BLOCKS blocks)


@dataclass(frozen=True)
class ForwardedRequest:
    method: str
    path: str
    query_string: bytes
    headers: tuple[tuple[bytes, bytes], ...]
    body: bytes
    routing_text: str = ""                        # the prompt's leading text ('' = no prefix routing)
    stream: bool = False                          # an SSE answer is expected
    avoid_replicas: tuple[str, ...] = field(default=())   # replicas that failed or refused it

    def avoiding(self, replica: str | None) -> "ForwardedRequest":
        if replica is None or replica in self.avoid_replicas:
            return self
        return replace(self, avoid_replicas=self.avoid_replicas + (replica,))


@dataclass(frozen=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]
    replica: str


def _text_of(content: Any) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(part.get("text", "") if isinstance(part, dict) else str(part) for part in content)
    return ""


def routing_text(body: bytes) -> tuple[str, bool]:
    """(the leading text of a completions/chat/responses/messages request's prompt (llama-server's
    /completion's too), whether it asks for a stream);
    ('', False) for anything else (the replica answers what it is)."""
    try:
        data = json.loads(body)
    except ValueError:
        return "", False
    if not isinstance(data, dict):
        return "", False
    stream = data.get("stream") is True
    prompt, messages = data.get("prompt"), data.get("messages")
    if prompt is None and messages is None and "input" in data:   # the Responses API: instructions first
        given = data["input"] if isinstance(data["input"], list) else [{"role": "user", "content": data["input"]}]
        instructions = data.get("instructions")
        system = [{"role": "system", "content": instructions}] if isinstance(instructions, str) else []
        messages = system + given
    if isinstance(messages, list) and data.get("system") is not None:   # Anthropic's Messages API
        messages = [{"role": "system", "content": data["system"]}, *messages]
    if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
        prompt = prompt[0]                         # a batch: route by its first prompt
    if isinstance(prompt, str):
        text = prompt
    elif isinstance(prompt, list):
        text = " ".join(str(t) for t in prompt[:ROUTING_TEXT_CHARS // 4])
    elif isinstance(messages, list):
        text = "".join(f"<{m.get('role', '')}>{_text_of(m.get('content'))}" for m in messages
                       if isinstance(m, dict))
    else:
        text = ""
    return text[:ROUTING_TEXT_CHARS], stream


async def run_asgi(app, req: ForwardedRequest, replica: str) -> AsyncIterator[ResponseStart | bytes]:
    """Runs `req` through the ASGI `app`; yields its ResponseStart, then its body chunks. Closing
    the iterator early is the client disconnecting: the app sees `http.disconnect` (loom aborts
    the request's engine work), then its task is cancelled if it still runs."""
    messages: asyncio.Queue = asyncio.Queue()
    gone = asyncio.Event()
    pending_body = [{"type": "http.request", "body": req.body, "more_body": False}]

    async def receive() -> dict:
        if pending_body:
            return pending_body.pop()
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        messages.put_nowait(message)

    path, _, _ = req.path.partition("?")
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.3"}, "http_version": "1.1",
             "method": req.method, "scheme": "http", "path": path, "raw_path": path.encode(),
             "query_string": req.query_string, "root_path": "", "headers": list(req.headers),
             "client": ("127.0.0.1", 0), "server": ("127.0.0.1", 80), "state": {}}
    task = asyncio.ensure_future(app(scope, receive, send))
    task.add_done_callback(lambda _: messages.put_nowait(None))
    try:
        while True:
            message = await messages.get()
            if message is None:
                task.result()    # raises the app's error, if any
                return
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v)) for k, v in message["headers"]),
                                    replica)
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    return
    finally:
        gone.set()
        if not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), 1.0)
            except (asyncio.TimeoutError, asyncio.CancelledError, Exception):  # noqa: BLE001 - ending it anyway
                task.cancel()
