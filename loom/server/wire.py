"""The messages between the HTTP front end and the engine-core process (msgspec, msgpack).

Front end -> engine core (one PUSH/PULL pipe): `AddRequest`, `AbortRequests`, `Shutdown`.
Engine core -> front end (another): `Ready` once the model is loaded (or `Failed`), then one
`StepOutputs` per engine step: every request's new output of that step, the requests refused
at admission, and the engine's counters for /metrics. `Dead` is the last word of an engine
step that raised.

Outputs (the per-step traffic) are loom's own dataclasses, which msgspec encodes and decodes
by their annotations. A request's `SamplingParams` and fan-out options travel pickled: they may
hold objects msgspec cannot describe (a stop policy, a grammar), and the engine validates the
parameters again when it adds the request.
"""

from __future__ import annotations

from typing import Any, Union

import msgspec

from loom.outputs import RequestOutput
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


class Failed(msgspec.Struct, tag="failed", array_like=True):
    """The engine could not start (a bad model path, ...): the message says why."""

    kind: str
    message: str


class StepOutputs(msgspec.Struct, tag="step", array_like=True):
    outputs: list[RequestOutput]
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
