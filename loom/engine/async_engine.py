"""AsyncEngine: the Engine stepped by a background thread, with per-request async streams.

torch releases the GIL inside its kernels, so one engine thread keeps the CPU busy
while the asyncio loop serves HTTP. A lock makes `add_request` / `abort` atomic with
respect to `step()`; a request's outputs reach its consumer through an asyncio.Queue.

Contract of `generate`: yields RequestOutputs (cumulative text plus deltas) until one
has `finished` (or, by the request's `output_kind`, only the deltas, or only the final output
with every choice); if the consumer stops early (client disconnect, cancellation), the
request is aborted and its KV blocks are freed.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator
from contextlib import aclosing

from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.errors import EngineGoneError
from loom.outputs import RequestOutput, shaped, stream_outputs
from loom.sampling_params import RequestOutputKind, SamplingParams


class AsyncEngine:
    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stop = False
        self._queues: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Queue]] = {}
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None

    @classmethod
    def from_config(cls, config: EngineConfig) -> "AsyncEngine":
        return cls(Engine(config))

    # -- lifecycle ---------------------------------------------------------------------
    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="loom-engine", daemon=True)
            self._thread.start()

    def shutdown(self) -> None:
        self._stop = True
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout=30)
            self._thread = None

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    # -- requests ----------------------------------------------------------------------
    async def generate(self, prompt, params: SamplingParams | None = None, request_id: str | None = None,
                       priority: int = 0, fanout=None) -> AsyncIterator[RequestOutput]:
        """Streams the request's outputs; raises InvalidRequestError at once for bad input.
        `fanout`: `loom.engine.groups.FanOutOptions` of an n > 1 request (early stopping)."""
        self.start()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            if self.error is not None:   # the engine thread is gone: nothing would step this request
                raise EngineGoneError(f"the engine failed and is not running ({self.error!r}); restart the server")
            rid = self.engine.add_request(prompt, params, request_id, priority, fanout=fanout)
            self._queues[rid] = (asyncio.get_running_loop(), queue)
        self._wake.set()
        kind = params.output_kind if params is not None else RequestOutputKind.CUMULATIVE
        async with aclosing(stream_outputs(queue, lambda: self._drop(rid))) as outs:
            async for out in shaped(outs, kind is RequestOutputKind.DELTA, kind is RequestOutputKind.FINAL_ONLY):
                yield out

    def _drop(self, rid: str) -> None:
        """The consumer stopped before the end: forget its queue and abort the request."""
        self._queues.pop(rid, None)
        self.abort(rid)

    def abort(self, request_id: str) -> None:
        """Ends the request and frees its blocks; its stream (if any) gets the 'abort' outputs."""
        with self._lock:
            outs = self.engine.abort(request_id)
        entry = self._queues.pop(request_id, None)
        if entry is not None:
            loop, queue = entry
            for out in outs:
                loop.call_soon_threadsafe(queue.put_nowait, out)

    def snapshot(self, fn):
        """Runs fn(engine) under the engine lock (consistent stats for metrics endpoints)."""
        with self._lock:
            return fn(self.engine)

    # -- the engine thread ---------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop:
            with self._lock:
                busy = self.engine.has_unfinished_requests()
                if busy:
                    try:
                        outs = self.engine.step()
                    except BaseException as e:  # a bug: fail every stream instead of hanging them
                        self.error = e
                        self._fail_all(e)
                        raise
            if not busy:
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            for out in outs:   # a finished request's queue gets its last output and is forgotten
                entry = self._queues.pop(out.request_id, None) if out.finished else self._queues.get(out.request_id)
                if entry is not None:
                    loop, queue = entry
                    loop.call_soon_threadsafe(queue.put_nowait, out)

    def _fail_all(self, e: BaseException) -> None:
        for loop, queue in list(self._queues.values()):
            failed = EngineGoneError(f"engine step failed: {e!r}; restart the server")
            loop.call_soon_threadsafe(queue.put_nowait, failed)

