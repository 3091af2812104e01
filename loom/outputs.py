"""What generation returns, in the shape of vLLM's offline API.

`RequestOutput.outputs[i]` is one completion; text and token_ids are cumulative, and
`delta_text` / `delta_token_ids` hold what is new since the previous output of the same
request (what a stream sends).

An n > 1 request streams per choice: each engine output holds the one choice that changed
(`CompletionOutput.index` says which), and `RequestOutput.finished` marks the request's last
output. `FinalOutputs` gathers such a stream into one output per request with every choice,
which is what the offline API returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass, field


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None          # 1 = most probable
    decoded_token: str | None = None


# one dict per generated token: token id -> Logprob (the sampled token plus top alternatives)
SampleLogprobs = list[dict[int, Logprob]]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: SampleLogprobs | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it
    delta_text: str = ""
    delta_token_ids: list[int] = field(default_factory=list)

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_draft_tokens: int = 0            # speculative draft tokens verified for the request
    num_accepted_draft_tokens: int = 0   # ... of which the target accepted


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics | None = None
    num_cached_tokens: int = 0
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then {id: Logprob}
    # per prompt token (the actual token always present); filled as the prompt is computed
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None


class FinalOutputs:
    """Each request's final `RequestOutput`, all of its choices in index order, gathered from
    the stream of engine outputs (see the module docstring)."""

    def __init__(self) -> None:
        self._choices: dict[str, dict[int, CompletionOutput]] = {}

    def add(self, out: RequestOutput) -> RequestOutput | None:
        """Takes one engine output; returns the request's final output once `out` ends it."""
        choices = self._choices.setdefault(out.request_id, {})
        for c in out.outputs:
            choices[c.index] = c
        if not out.finished:
            return None
        del self._choices[out.request_id]
        return dataclasses.replace(out, outputs=[choices[i] for i in sorted(choices)])

    def add_all(self, outs: Iterable[RequestOutput]) -> list[RequestOutput]:
        """The final outputs among `outs` (see `add`)."""
        return [f for out in outs if (f := self.add(out)) is not None]


def as_delta(out: RequestOutput, first: bool) -> RequestOutput:
    """`out` with each completion's text, token ids and logprobs cut to what this output added
    (vLLM's DELTA outputs); prompt logprobs only on the request's first output."""
    def cut(c: CompletionOutput) -> CompletionOutput:
        new = len(c.delta_token_ids)
        logprobs = None if c.logprobs is None else (c.logprobs[len(c.logprobs) - new:] if new else [])
        return dataclasses.replace(c, text=c.delta_text, token_ids=list(c.delta_token_ids), logprobs=logprobs)
    return dataclasses.replace(out, outputs=[cut(c) for c in out.outputs],
                               prompt_logprobs=out.prompt_logprobs if first else None)


async def shaped(outs: AsyncIterator[RequestOutput], delta: bool, final_only: bool) -> AsyncIterator[RequestOutput]:
    """A request's stream of outputs as its `output_kind` asks (SamplingParams): every output as
    it is (cumulative), only what each added (`delta`), or only the final one with every choice
    (`final_only`)."""
    final, first = FinalOutputs(), True
    async for out in outs:
        if final_only:
            if (done := final.add(out)) is not None:
                yield done
        else:
            yield as_delta(out, first) if delta else out
        first = False


async def stream_outputs(queue: asyncio.Queue, stopped_early: Callable[[], None]) -> AsyncIterator[RequestOutput]:
    """A request's outputs as they arrive on `queue`, until the one that has `finished`. An
    exception put on the queue is raised (the request is over: nothing to abort); if the
    consumer stops before the end, `stopped_early()` runs (it aborts the request). Close it
    with `contextlib.aclosing` so that happens at once."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            yield item
            if item.finished:
                finished = True
                return
    finally:
        if not finished:
            stopped_early()
