"""The messages between the HTTP front end and the engine-core process (msgspec, msgpack).

Front end -> engine core (one PUSH/PULL pipe): `AddRequest`, `AbortRequests`, `Shutdown`.
Engine core -> front end (another): `Ready` once the model is loaded (or `Failed`), then one
`StepOutputs` per engine step: every request's new output of that step, the requests refused
at admission, and the engine's counters for /metrics. `Dead` is the last word of an engine
step that raised.

Outputs travel as deltas. A `RequestOutput`'s text, token ids and logprobs are cumulative and
it repeats the prompt: sent whole, a step's message would grow with every prompt and every
output of the batch (32 streams of 4k-token prompts: 128k integers encoded and decoded per
step, in the engine's loop). `DeltaEncoder` (engine side) sends each request's prompt with its
first output only, and of each cumulative field the part past what it sent before:

    field (cumulative)     sent            `at`: where the part starts
    text, token_ids        the new part    the length already sent (less if the engine cut it)
    logprobs, prompt_lp    the new entries

`DeltaDecoder` (front end) keeps what arrived per request and rebuilds each step's
`RequestOutput`, equal to the engine's. Both forget a request at its finished output (and the
decoder when its stream ends). A request's `SamplingParams` and fan-out options travel
pickled: they may hold objects msgspec cannot describe (a stop policy, a grammar), and the
engine validates the parameters again when it adds the request.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from loom.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from loom.server.metrics import EngineSample


class AddRequest(msgspec.Struct, tag="add", array_like=True):
    request_id: str
    prompt: Union[str, list[int], dict[str, Any], None]
    params: bytes               # pickled SamplingParams
    priority: int = 0
    fanout: bytes | None = None  # pickled FanOutOptions


class AbortRequests(msgspec.Struct, tag="abort", array_like=True):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown", array_like=True):
    pass


EngineInput = Union[AddRequest, AbortRequests, Shutdown]


class RequestError(msgspec.Struct, array_like=True):
    """A request the engine refused: the LoomError class name and its message."""

    request_id: str
    kind: str
    message: str


class Ready(msgspec.Struct, tag="ready", array_like=True):
    model_name: str
    max_model_len: int
    vocab_size: int
    stats: EngineSample
    cache_info: dict[str, str]     # vLLM's cache_config_info labels (Engine.cache_info)


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The engine could not start (a bad model path, ...): the message says why."""

    kind: str
    message: str


class ChoiceDelta(msgspec.Struct, array_like=True):
    """One `CompletionOutput`: its deltas, and its cumulative fields as (start, new part)."""

    index: int
    delta_text: str
    delta_token_ids: list[int]
    text_at: int
    text: str | None                    # None: the new part is delta_text
    tokens_at: int
    token_ids: list[int] | None         # None: the new part is delta_token_ids
    logprobs_at: int
    logprobs: list[dict[int, Logprob]] | None   # None: the choice has no logprobs
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


class RequestHead(msgspec.Struct, array_like=True):
    """What a request's outputs repeat: sent with its first one."""

    prompt: str | None
    prompt_token_ids: list[int]


class RequestDelta(msgspec.Struct, array_like=True):
    request_id: str
    head: RequestHead | None
    choices: list[ChoiceDelta]
    finished: bool
    metrics: RequestMetrics | None
    num_cached_tokens: int
    prompt_logprobs_at: int
    prompt_logprobs: list[dict[int, Logprob] | None] | None   # None: none asked for (or none new)


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[RequestDelta]
    errors: list[RequestError]
    stats: EngineSample


class Dead(msgspec.Struct, tag="dead", array_like=True):
    message: str


EngineMessage = Union[Ready, Failed, StepOutputs, Dead]


def input_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineInput)


def output_encoder() -> msgspec.msgpack.Encoder:
    return msgspec.msgpack.Encoder()


def output_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineMessage)


def _part(whole, sent: int, delta):
    """(start, new part) of a cumulative sequence of which `sent` items went before; None for
    the part where it equals `delta` (the usual step: what is new is the delta)."""
    at = min(sent, len(whole))
    part = whole[at:]
    return at, (None if part == delta else part)


class DeltaEncoder:
    """Engine side: `RequestOutput`s -> `RequestDelta`s (see the module docstring)."""

    def __init__(self) -> None:
        self._sent: dict[str, dict] = {}     # request -> {"plp": n, index: (chars, tokens, logprobs)}

    def encode(self, out: RequestOutput) -> RequestDelta:
        state = self._sent.get(out.request_id)
        head = None
        if state is None:
            state = self._sent[out.request_id] = {"plp": 0}
            head = RequestHead(out.prompt, list(out.prompt_token_ids))
        choices = []
        for c in out.outputs:
            chars, tokens, lps = state.get(c.index, (0, 0, 0))
            text_at, text = _part(c.text, chars, c.delta_text)
            tokens_at, token_ids = _part(c.token_ids, tokens, c.delta_token_ids)
            lps_at = min(lps, len(c.logprobs)) if c.logprobs is not None else 0
            choices.append(ChoiceDelta(c.index, c.delta_text, list(c.delta_token_ids), text_at, text, tokens_at,
                                       token_ids, lps_at, None if c.logprobs is None else c.logprobs[lps_at:],
                                       c.cumulative_logprob, c.finish_reason, c.stop_reason))
            state[c.index] = (len(c.text), len(c.token_ids), 0 if c.logprobs is None else len(c.logprobs))
        plp_at, plp = 0, None
        if out.prompt_logprobs is not None:
            plp_at = min(state["plp"], len(out.prompt_logprobs))
            plp = out.prompt_logprobs[plp_at:]
            state["plp"] = len(out.prompt_logprobs)
        if out.finished:
            del self._sent[out.request_id]
        return RequestDelta(out.request_id, head, choices, out.finished, out.metrics, out.num_cached_tokens,
                            plp_at, plp)


class DeltaDecoder:
    """Front end: `RequestDelta`s -> the engine's `RequestOutput`s. Each output's choices have
    lists of their own; the prompt's token ids are one list shared by a request's outputs."""

    def __init__(self) -> None:
        self._seen: dict[str, dict] = {}     # request -> {"head": RequestHead, "plp": list | None, index: CompletionOutput}

    def decode(self, d: RequestDelta) -> RequestOutput:
        state = self._seen.get(d.request_id)
        if state is None:
            state = self._seen[d.request_id] = {"head": d.head or RequestHead(None, []), "plp": None}
        choices = []
        for c in d.choices:
            old = state.get(c.index)
            text = (old.text[:c.text_at] if old is not None else "") + (c.delta_text if c.text is None else c.text)
            ids = (old.token_ids[:c.tokens_at] if old is not None else []) + (
                c.delta_token_ids if c.token_ids is None else c.token_ids)
            lps = None
            if c.logprobs is not None:
                lps = (old.logprobs[:c.logprobs_at] if old is not None and old.logprobs is not None else []) + c.logprobs
            choice = state[c.index] = CompletionOutput(c.index, text, ids, c.cumulative_logprob, lps, c.finish_reason,
                                                       c.stop_reason, c.delta_text, c.delta_token_ids)
            choices.append(choice)
        if d.prompt_logprobs is not None:
            state["plp"] = (state["plp"] or [])[:d.prompt_logprobs_at] + d.prompt_logprobs
        head = state["head"]
        if d.finished:
            self.forget(d.request_id)
        return RequestOutput(d.request_id, head.prompt, head.prompt_token_ids, choices, d.finished, d.metrics,
                             d.num_cached_tokens, None if state["plp"] is None else list(state["plp"]))

    def forget(self, request_id: str) -> None:
        self._seen.pop(request_id, None)
