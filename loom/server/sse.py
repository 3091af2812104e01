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
