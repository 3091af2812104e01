"""One API call -> one engine request per prompt (its n choices share the prompt's KV), read as one stream of choices.

`fan_out` is the single place that decides how choices become engine requests: one request per
prompt with ``n`` (and ``best_of``) set, which the engine fans out into children that prefill
the prompt once and share its KV blocks (`loom.engine.groups`); choice i of a seeded request
samples with `derive_seed(seed, i)`. The engine streams each prompt's outputs per choice (one
completion each), so each maps to its choice as it comes: ``(choice index, RequestOutput)``,
`finished` when that choice has finished.

Lifecycle rules of a group:

* `admitted()` returns once every prompt has produced its first output, or raises the first
  prompt's error (bad prompt, queue full) after aborting the others, so the endpoint can still
  answer with a 4xx before any byte of a 200 is sent;
* iterating yields ``(choice index, RequestOutput)`` until every choice has finished;
* `close()` is synchronous and idempotent: it cancels the prompts still running, and each
  prompt's engine request (all its choices) is aborted, its KV blocks freed, as its task
  unwinds. It is safe to call from a `finally` inside a cancelled scope;
* `watch(request)` closes the group when the HTTP client disconnects; waiting code then
  raises `ClientDisconnected`.

The ``loom`` extension (`LoomPlan`): ``early_stop`` ends a prompt's choices early (the rest
are aborted); ``aggregate`` merges each prompt's choices into one answer (`aggregate`).
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from starlette.requests import Request

from loom.contracts import FanOutOptions, derive_seed
from loom.errors import EngineDeadError
from loom.outputs import CompletionOutput, RequestOutput
from loom.parallel.aggregators import Aggregator, create_aggregator
from loom.sampling_params import SamplingParams
from loom.server.engine_client import EngineClient
from loom.server.errors import ApiError, ClientDisconnected
from loom.server.metrics import RequestTracker
from loom.server.protocol import LoomChild, LoomOptions, LoomResponse, LoomResult

__all__ = ["ChoiceGroup", "LoomPlan", "derive_seed", "fan_out", "plan_loom"]

# Seconds before the disconnect watch asks again, where the server answered its wait for the
# client's next message with something other than a disconnect (see ChoiceGroup._watch).
DISCONNECT_POLL_SECONDS = 0.25
# short_m_at_k's m when the request does not give one.
DEFAULT_M = 3

_GONE = object()
_STOPPING = object()


class ServerStopping(EngineDeadError):
    """The server is shutting down: open streams end with this error event."""


@dataclass
class _Prompt:
    index: int
    prompt: str | list[int] | dict
    request_id: str
    admitted: asyncio.Future | None = None  # resolves to None or the prompt's error
    task: asyncio.Task | None = None


class ChoiceGroup:
    """The engine requests behind one API call; see the module docstring for the rules."""

    def __init__(self, ae: EngineClient, prompts: list[_Prompt], params: SamplingParams, n: int, priority: int,
                 tracker: Callable[[], RequestTracker] | None, fanout: FanOutOptions | None = None):
        self._ae = ae
        self._prompts = prompts
        self._params, self._n = params, n
        self._priority = priority
        self._tracker = tracker
        self._fanout = fanout
        self._queue: asyncio.Queue = asyncio.Queue()
        self._watcher: asyncio.Task | None = None
        self._closed = False
        self._finals: dict[int, RequestOutput] = {}  # choice index -> its final output
        loop = asyncio.get_running_loop()
        for p in prompts:
            p.admitted = loop.create_future()
            p.task = asyncio.create_task(self._pump(p), name=f"loom-{p.request_id}")

    @property
    def size(self) -> int:
        return len(self._prompts) * self._n

    def prompt_tokens(self, index: int) -> int | None:
        """The token count of choice `index`'s prompt where it was given as ids (chat's always
        is), else None."""
        prompt = self._prompts[index // self._n].prompt
        ids = prompt.get("prompt_token_ids") if isinstance(prompt, dict) else prompt
        return len(ids) if isinstance(ids, list) else None

    async def _pump(self, p: _Prompt) -> None:
        trackers = [self._tracker() if self._tracker is not None else None for _ in range(self._n)]
        start = time.monotonic()
        arrival: float | None = None
        ended = [False] * self._n
        gen = self._ae.generate(p.prompt, self._params, p.request_id, self._priority, fanout=self._fanout)
        try:
            async for out in gen:
                if arrival is None and out.metrics is not None:
                    arrival = out.metrics.arrival_time
                if not p.admitted.done():
                    p.admitted.set_result(None)
                for c in out.outputs:
                    if ended[c.index] or not (c.delta_token_ids or c.delta_text or c.finish_reason):
                        continue
                    ended[c.index] = c.finish_reason is not None
                    choice = _choice_output(out, c)
                    index = p.index * self._n + c.index
                    if choice.finished:
                        self._finals[index] = choice
                    if trackers[c.index] is not None:
                        trackers[c.index].on_output(choice)
                    self._queue.put_nowait((index, choice))
            if all(ended) and trackers[0] is not None:
                finals = [self._finals[p.index * self._n + i] for i in range(self._n)]
                trackers[0].m.on_prompt_finished(self._n, self._params.max_tokens,
                                                 max(len(f.outputs[0].token_ids) for f in finals))
        except asyncio.CancelledError:
            # add_request runs before the generator's first wait, so a cancelled prompt was queued
            self._abandon(trackers, ended, arrival if arrival is not None else start)
            raise
        except Exception as e:  # noqa: BLE001 - handed to whoever waits on the group
            if not p.admitted.done():
                p.admitted.set_result(e)
            else:
                self._queue.put_nowait((p.index * self._n, e))
                self._abandon(trackers, ended, arrival, "error")
        finally:
            await gen.aclose()

    @staticmethod
    def _abandon(trackers: list[RequestTracker | None], ended: list[bool], arrival: float | None,
                 reason: str = "abort") -> None:
        """The choices not finished end as `reason`: "abort" (the client left, the call was
        cancelled) or "error" (the engine failed them)."""
        for tracker, done in zip(trackers, ended):
            if tracker is not None and not done:
                tracker.on_abandoned(arrival, time.monotonic(), reason)

    def watch(self, request: Request) -> None:
        """Closes the group as soon as `request`'s client disconnects (its body already read)."""
        if self._watcher is None:
            self._watcher = asyncio.create_task(self._watch(request), name="loom-disconnect-watch")

    async def _watch(self, request: Request) -> None:
        """Waits for the client's next ASGI message: with the body read, the server sends only
        http.disconnect, when the client goes (or the response is complete, by which time the
        group is closed and this task cancelled). One wait per request, where asking
        `request.is_disconnected()` every DISCONNECT_POLL_SECONDS (a cancelled receive each
        time) took a quarter of the front end's CPU at 32 streams (py-spy, SmolLM2)."""
        while (await request.receive())["type"] != "http.disconnect":
            await asyncio.sleep(DISCONNECT_POLL_SECONDS)   # a server that does not block here
        self._queue.put_nowait(_GONE)
        for p in self._prompts:
            if not p.admitted.done():
                p.admitted.set_result(ClientDisconnected())
        self.close()

    async def admitted(self) -> None:
        """Waits until every prompt produced a first output; raises the first prompt error."""
        for fut in asyncio.as_completed([p.admitted for p in self._prompts]):
            error = await fut
            if error is not None:
                self.close()
                raise error

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        remaining = self.size
        while remaining:
            item = await self._queue.get()
            if item is _GONE:
                raise ClientDisconnected()
            if item is _STOPPING:
                raise ServerStopping("the server is shutting down; the request was stopped")
            index, out = item
            if isinstance(out, BaseException):
                raise out
            yield index, out
            if out.finished:
                remaining -= 1

    async def final_outputs(self) -> list[RequestOutput]:
        """Every choice's last output, in choice order."""
        final: dict[int, RequestOutput] = {}
        async for index, out in self:
            if out.finished:
                final[index] = out
        return [final[i] for i in range(self.size)]

    def prompt_choices(self) -> list[list[RequestOutput]]:
        """Each prompt's final choice outputs, in choice order (after `final_outputs`)."""
        return [[self._finals[p.index * self._n + i] for i in range(self._n)] for p in self._prompts]

    def stop(self) -> None:
        """Ends the group because the server stops: whoever iterates it gets `ServerStopping`,
        and whoever waits for a prompt still queued in the engine (`admitted`) too."""
        self._queue.put_nowait(_STOPPING)
        for p in self._prompts:
            if p.admitted is not None and not p.admitted.done():
                p.admitted.set_result(ServerStopping("the server is shutting down; the request was stopped"))
        self.close()

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for p in self._prompts:
            if p.task is not None and not p.task.done():
                p.task.cancel()
        if self._watcher is not None and self._watcher is not asyncio.current_task():
            self._watcher.cancel()


def _choice_output(out: RequestOutput, c: CompletionOutput) -> RequestOutput:
    """Choice `c` of engine output `out` as that choice's own output: finished when it is."""
    if len(out.outputs) == 1 and out.outputs[0] is c and out.finished == (c.finish_reason is not None):
        return out
    return RequestOutput(out.request_id, out.prompt, out.prompt_token_ids, [c], c.finish_reason is not None,
                         out.metrics, out.num_cached_tokens, out.prompt_logprobs)


def fan_out(ae: EngineClient, prompts: list[str | list[int] | dict], params: SamplingParams, n: int,
            request_id: str, priority: int = 0, tracker: Callable[[], RequestTracker] | None = None, *,
            best_of: int | None = None, fanout: FanOutOptions | None = None) -> ChoiceGroup:
    """Submits one engine request per prompt, each with n choices (best_of generated);
    choice ``p * n + i`` is choice i of prompt p."""
    params = params.clone(n=n, best_of=best_of)
    items = [_Prompt(p, prompt, f"{request_id}-{p}") for p, prompt in enumerate(prompts)]
    return ChoiceGroup(ae, items, params, n, priority, tracker, fanout)


# -- the "loom" extension ---------------------------------------------------------------------------


@dataclass(frozen=True)
class LoomPlan:
    """What a request's ``loom`` object asks for: engine-side early stopping and an aggregator."""

    fanout: FanOutOptions | None
    aggregator: Aggregator | None
    return_children: bool

    def aggregate(self, prompt_choices: list[list[RequestOutput]]) -> tuple[list[RequestOutput], LoomResponse]:
        """One chosen choice per prompt (index 0; an empty aborted one when none qualified)
        and the extension's results."""
        assert self.aggregator is not None
        chosen, results = [], []
        for p, choices in enumerate(prompt_choices):
            out, completions = choices[0], [c.outputs[0] for c in choices]
            result = self.aggregator.aggregate(completions)
            pick = completions[result.index] if result.index is not None else CompletionOutput(0, "", [],
                                                                                               finish_reason="abort")
            chosen.append(_choice_output(out, CompletionOutput(0, pick.text, pick.token_ids, pick.cumulative_logprob,
                                                               pick.logprobs, pick.finish_reason, pick.stop_reason)))
            children = None
            if self.return_children:
                extract = getattr(self.aggregator, "extract", None)
                children = [LoomChild(index=c.index, text=c.text, finish_reason=c.finish_reason,
                                      cumulative_logprob=c.cumulative_logprob,
                                      answer=extract(c.text) if extract is not None else None) for c in completions]
            results.append(LoomResult(prompt_index=p, answer=result.answer, chosen_index=result.index,
                                      votes=result.votes, scores=result.scores, children=children))
        return chosen, LoomResponse(results=results)


_VOTING = ("majority", "weighted_majority", "short_m_at_k")


def _refuse_unused(o: LoomOptions, n: int) -> None:
    """A ``loom`` field that the chosen aggregate or policy does not read is a 400 naming it,
    never silently dropped."""
    def refuse(field: str, message: str) -> None:
        raise ApiError(400, f"loom.{field} {message}", param=f"loom.{field}", code="invalid_value")

    if o.extract is not None and o.aggregate not in _VOTING:
        refuse("extract", f"applies to aggregate {', '.join(_VOTING)}, got aggregate {o.aggregate!r}")
    if o.pattern is not None and o.extract != "regex":
        refuse("pattern", f"applies to extract 'regex', got extract {o.extract!r}")
    if o.score is not None and o.aggregate != "best_of":
        refuse("score", f"applies to aggregate 'best_of', got aggregate {o.aggregate!r}")
    if o.prune_ratio is not None and o.aggregate != "weighted_majority":
        refuse("prune_ratio", f"applies to aggregate 'weighted_majority', got aggregate {o.aggregate!r}")
    if o.return_children and o.aggregate is None:
        refuse("return_children", "applies with loom.aggregate (without it every choice is returned anyway)")
    m = o.early_stop.m if o.early_stop is not None else None
    if m is not None and o.early_stop.policy != "short_m_at_k":
        refuse("early_stop.m", f"applies to policy 'short_m_at_k', got policy {o.early_stop.policy!r}")
    if m is not None and m > n:
        refuse("early_stop.m", f"must be at most n ({n}): stop once m of the n choices finished, got {m}")


def plan_loom(options: LoomOptions | None, stream: bool, n: int = 1) -> LoomPlan | None:
    """The plan of a request's ``loom`` object; ApiError (400) for combinations it cannot serve
    and for fields that would not be read."""
    if options is None:
        return None
    _refuse_unused(options, n)
    if options.aggregate is not None and stream:
        raise ApiError(400, "loom.aggregate needs the whole set of choices: it cannot be streamed",
                       param="loom.aggregate", code="unsupported")
    stop = None
    if options.early_stop is not None:
        es = options.early_stop
        stop = create_aggregator(es.policy, **({"m": es.m or DEFAULT_M} if es.policy == "short_m_at_k" else {}))
    aggregator = None
    if options.aggregate is not None:
        aggregator = create_aggregator(options.aggregate, **_aggregate_options(options))
    if stop is None and aggregator is not None and type(aggregator).should_stop is not Aggregator.should_stop:
        stop = aggregator  # first_finish / short_m_at_k stop early by themselves
    return LoomPlan(FanOutOptions(stop_policy=stop) if stop is not None else None, aggregator,
                    options.return_children)


def _aggregate_options(o: LoomOptions) -> dict:
    """The aggregator's own options out of the request's fields (those it takes)."""
    extract: dict = {}
    if o.aggregate in ("majority", "weighted_majority", "short_m_at_k"):
        extract["extract"] = o.extract or "last_number"
        if o.extract == "regex":
            try:
                re.compile(o.pattern or "")
            except re.error as e:
                raise ApiError(400, f"loom.pattern is not a valid regex: {e}", param="loom.pattern",
                               code="invalid_value") from None
            if not o.pattern:
                raise ApiError(400, "loom.extract=regex needs loom.pattern", param="loom.pattern",
                               code="invalid_value")
            extract["pattern"] = o.pattern
    if o.aggregate == "best_of" and o.score is not None:
        extract["score"] = o.score
    if o.aggregate == "weighted_majority" and o.prune_ratio is not None:
        extract["prune_ratio"] = o.prune_ratio
    if o.aggregate == "short_m_at_k" and o.early_stop is not None and o.early_stop.m is not None:
        extract["m"] = o.early_stop.m
    return extract
