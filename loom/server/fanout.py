"""One API call -> several engine requests (prompts x n choices), merged into one stream.

`fan_out` is the single place that decides how choices become engine requests: today one
independent child request per (prompt, choice), the choice's seed derived from the request
seed. Everything downstream only sees `ChoiceGroup`, so a shared-prefix fan-out can replace
the body of `fan_out` without touching the endpoints.

Lifecycle rules of a group:

* `admitted()` returns once every child has produced its first output, or raises the first
  child's error (bad prompt, queue full) after aborting the others, so the endpoint can still
  answer with a 4xx before any byte of a 200 is sent;
* iterating yields ``(choice index, RequestOutput)`` until every child has finished;
* `close()` is synchronous and idempotent: it cancels the children still running, and each
  child's engine request is aborted (its KV blocks freed) as its task unwinds. It is safe to
  call from a `finally` inside a cancelled scope;
* `watch(request)` closes the group when the HTTP client disconnects; waiting code then
  raises `ClientDisconnected`.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from loom.engine.async_engine import AsyncEngine
from loom.outputs import RequestOutput
from loom.sampling_params import SamplingParams
from loom.server.errors import ClientDisconnected
from loom.server.metrics import RequestTracker

# Seconds between checks of whether the HTTP client is still connected.
DISCONNECT_POLL_SECONDS = 0.25
# Seeds wrap into this range when derived (SamplingParams accepts [-(2**63), 2**64 - 1]).
_SEED_SPAN = 2**64

_GONE = object()


def derive_seed(seed: int | None, choice: int) -> int | None:
    """The seed of choice `choice`: choice 0 keeps the request seed (so n=1 and the first of n
    agree); the others get distinct seeds derived from it."""
    if seed is None or choice == 0:
        return seed
    return (seed + choice) % _SEED_SPAN


@dataclass
class _Child:
    index: int
    prompt: str | list[int] | dict
    params: SamplingParams
    request_id: str
    admitted: asyncio.Future | None = None  # resolves to None or the child's error
    task: asyncio.Task | None = None


class ChoiceGroup:
    """The engine requests behind one API call; see the module docstring for the rules."""

    def __init__(self, ae: AsyncEngine, children: list[_Child], priority: int,
                 tracker: Callable[[], RequestTracker] | None):
        self._ae = ae
        self._children = children
        self._priority = priority
        self._tracker = tracker
        self._queue: asyncio.Queue = asyncio.Queue()
        self._watcher: asyncio.Task | None = None
        self._closed = False
        loop = asyncio.get_running_loop()
        for child in children:
            child.admitted = loop.create_future()
            child.task = asyncio.create_task(self._pump(child), name=f"loom-{child.request_id}")

    @property
    def size(self) -> int:
        return len(self._children)

    async def _pump(self, child: _Child) -> None:
        tracker = self._tracker() if self._tracker is not None else None
        start = time.monotonic()
        arrival: float | None = None
        gen = self._ae.generate(child.prompt, child.params, child.request_id, self._priority)
        finished = False
        try:
            async for out in gen:
                if arrival is None and out.metrics is not None:
                    arrival = out.metrics.arrival_time
                if tracker is not None:
                    tracker.on_output(out)
                if not child.admitted.done():
                    child.admitted.set_result(None)
                finished = out.finished
                self._queue.put_nowait((child.index, out))
        except asyncio.CancelledError:
            # add_request runs before the generator's first wait, so a cancelled child was queued
            if tracker is not None and not finished:
                tracker.on_abandoned(arrival if arrival is not None else start, time.monotonic())
            raise
        except Exception as e:  # noqa: BLE001 - handed to whoever waits on the group
            if not child.admitted.done():
                child.admitted.set_result(e)
            else:
                self._queue.put_nowait((child.index, e))
                if tracker is not None and not finished:
                    tracker.on_abandoned(arrival, time.monotonic())
        finally:
            await gen.aclose()

    def watch(self, request: Request) -> None:
        """Closes the group as soon as `request`'s client disconnects."""
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(request), name="loom-disconnect-watch")

    async def _watch(self, request: Request) -> None:
        while not await request.is_disconnected():
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)
        self._queue.put_nowait(_GONE)
        for child in self._children:
            if not child.admitted.done():
                child.admitted.set_result(ClientDisconnected())
        self.close()

    async def admitted(self) -> None:
        """Waits until every child produced a first output; raises the first child error."""
        for fut in asyncio.as_completed([c.admitted for c in self._children]):
            error = await fut
            if error is not None:
                self.close()
                raise error

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = len(self._children)
        while remaining:
            item = await self._queue.get()
            if item is _GONE:
                raise ClientDisconnected()
            index, out = item
            if isinstance(out, BaseException):
                raise out
            yield index, out
            if out.finished:
                remaining -= 1

    async def final_outputs(self) -> list[RequestOutput]:
        """Every child's last output, in choice order."""
        final: dict[int, RequestOutput] = {}
        async for index, out in self:
            if out.finished:
                final[index] = out
        return [final[c.index] for c in self._children]

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for child in self._children:
            if child.task is not None and not child.task.done():
                child.task.cancel()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()


def fan_out(ae: AsyncEngine, prompts: list[str | list[int] | dict], params: SamplingParams, n: int,
            request_id: str, priority: int = 0,
            tracker: Callable[[], RequestTracker] | None = None) -> ChoiceGroup:
    """Submits ``len(prompts) * n`` child requests; choice ``p * n + i`` is choice i of prompt p.

    Children are independent requests with ``n=1``; when `params` is seeded, each choice
    gets its own seed (`derive_seed`), so seeded choices differ but stay reproducible.
    """
    children = []
    for p, prompt in enumerate(prompts):
        for i in range(n):
            child_params = params.clone(n=1, seed=derive_seed(params.seed, i))
            children.append(_Child(p * n + i, prompt, child_params, f"{request_id}-{p}-{i}"))
    return ChoiceGroup(ae, children, priority, tracker)
