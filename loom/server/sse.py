"""Server-sent events: the framing of streamed answers, and a response that always cleans up.

Each event is ``data: <json>\\n\\n``; a stream ends with ``data: [DONE]\\n\\n``.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable
from typing import Any

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

DONE = "data: [DONE]\n\n"


def event(data: dict[str, Any]) -> str:
    return f"data: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


class PlainChunks:
    """The events of a stream's outputs that only add text, written from a template: the chunk's
    fixed part (id, object, created, model) rendered once, the choice's index and text per event.
    The same characters as `event` of the endpoint's chunk model (checked in the tests), without
    building, validating and dumping the model for every token (~30 us of the front end's ~200 us
    per streamed token, SmolLM2 at 8 streams). `field`: "text" (completions) or "delta" (chat:
    {"content": text}); `usage_null`: the chunk ends with "usage": null (a stream that reports
    its usage in a last chunk of its own)."""

    __slots__ = ("_head", "_tail", "_delta")

    def __init__(self, fixed: dict[str, Any], field: str, usage_null: bool = False):
        self._head = "data: " + json.dumps(fixed, ensure_ascii=False, separators=(",", ":"))[:-1] + ',"choices":[{"index":'
        self._tail = ',"logprobs":null,"finish_reason":null,"stop_reason":null}]' + (',"usage":null}' if usage_null else "}")
        self._delta = field == "delta"

    def event(self, index: int, text: str) -> str:
        t = json.dumps(text, ensure_ascii=False)
        if self._delta:
            return f'{self._head}{index},"delta":{{"content":{t}}}{self._tail}\n\n'
        return f'{self._head}{index},"text":{t}{self._tail}\n\n'


class EventStreamResponse(StreamingResponse):
    """A text/event-stream response that runs `on_close` however the stream ends: completed,
    failed, or cut short by the client disconnecting (when the stream's own cleanup might not
    run until the generator is garbage collected)."""

    media_type = "text/event-stream"

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]):
        super().__init__(events, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._on_close()


class ChatStreamRewriter:
    """The chat route's stream (``data:`` lines of chat completion chunks, with usage) rewritten
    as another API's events (the Responses API's, Anthropic's Messages'): `events` reads the
    chunks and hands each piece to the subclass, which says what it becomes.

    Order: `_prelude` before any chunk, `_opening` with the first one, then per choice of each
    chunk its text (`_text_delta`), its tool-call deltas (`_call_delta`) and, where it has its
    finish reason, `_finished`; `_final` after ``[DONE]``. An error chunk ends the stream with
    `_failed`; a stream cut short (the client went away) ends with nothing more."""

    def __init__(self) -> None:
        self.finish: str | None = None                 # the chat's finish_reason
        self.stopped_by: int | str | None = None        # its stop_reason (the stop string or id)
        self.usage: dict[str, Any] | None = None        # the latest chunk's usage

    def _prelude(self) -> list[str]:
        return []

    def _opening(self, data: dict[str, Any]) -> list[str]:
        return []

    def _text_delta(self, text: str, choice: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def _finished(self) -> list[str]:
        return []

    def _final(self) -> list[str]:
        raise NotImplementedError

    def _failed(self, error: dict[str, Any]) -> list[str]:
        raise NotImplementedError

    def _chunk(self, data: dict[str, Any]) -> list[str]:
        if data.get("usage"):
            self.usage = data["usage"]
        out: list[str] = []
        for choice in data.get("choices") or []:
            delta = choice.get("delta") or {}
            if delta.get("content"):
                out += self._text_delta(delta["content"], choice)
            for call in delta.get("tool_calls") or []:
                out += self._call_delta(call)
            if choice.get("finish_reason"):
                self.finish, self.stopped_by = choice["finish_reason"], choice.get("stop_reason")
                out += self._finished()
        return out

    async def events(self, chunks: AsyncIterator[str]) -> AsyncIterator[str]:
        """The rewritten events of the chat stream's SSE lines (closed however this ends)."""
        for e in self._prelude():
            yield e
        opened = False
        try:
            async for line in chunks:
                if line == DONE:
                    break
                data = json.loads(line[len("data: "):])
                if "error" in data:
                    for e in self._failed(data["error"]):
                        yield e
                    return
                for e in ([] if opened else self._opening(data)) + self._chunk(data):
                    yield e
                opened = True
            else:
                return   # the client went away: nothing more to send
            for e in self._final():
                yield e
        finally:
            await chunks.aclose()
