"""The OpenAI-compatible HTTP API over an engine client: `build_app(client, ...)`.

Endpoints:

* ``POST /v1/completions``, ``POST /v1/chat/completions``: JSON answers, or server-sent
  events with ``"stream": true`` (ending in ``data: [DONE]``);
* ``POST /v1/responses``, ``GET`` / ``DELETE /v1/responses/{id}``: OpenAI's Responses API over
  the chat completions (responses.py);
* ``GET /v1/models``, ``GET /v1/models/{id}``: the served model;
* ``GET /v1/loom/stats``: running/waiting requests and KV usage as JSON (the playground's feed);
* ``GET /health``, ``GET /version``, ``GET /metrics`` (Prometheus), ``GET /`` (playground).

Rules:

* with an API key, every ``/v1/*`` endpoint needs ``Authorization: Bearer <key>`` (else 401);
* a request for another model than the served one is a 404 ``model_not_found``;
* a request is answered with an error (never a half-sent 200) when any of its engine requests
  is refused; for a stream that means its headers wait for every choice's first output;
* a client that disconnects, streaming or not, has its engine requests aborted.
"""

from __future__ import annotations

import asyncio
import difflib
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from prometheus_client import CONTENT_TYPE_LATEST

import loom
from loom.errors import EngineRestartingError, TokenizerError
from loom.loader.chat_messages import message_dicts, with_tools
from loom.outputs import CompletionOutput, RequestOutput
from loom.sampling_params import SamplingParams, StructuredOutputsParams
from loom.server.anthropic import AnthropicServing, anthropic_router
from loom.server.anthropic_protocol import MessageStreamEvent
from loom.server.choices import ChoiceGroup, fan_out, plan_loom
from loom.server.engine_client import EngineClient, off_loop
from loom.server.errors import (
    INVALID_REQUEST,
    ApiError,
    ClientDisconnected,
    install_error_handlers,
    retry_headers,
    stream_error,
)
from loom.server.llamacpp import LlamaCppServing, llama_tokenize, llamacpp_router
from loom.server.llamacpp_protocol import LlamaTokenizeRequest, LlamaTokenizeResponse, TokenizeBody
from loom.server.limits import BearerKey, BodySizeLimit, Cors, HeadAsGet, RequestIds
from loom.server.logprobs import Spelling, TextCursor, chat_logprobs, completion_logprobs, finite, token_name
from loom.server.metrics import ServerMetrics, sample_engine
from loom.server.protocol import (
    DetokenizeRequest,
    ModelPermission,
    DetokenizeResponse,
    TokenizeRequest,
    TokenizeResponse,
    TokenizerInfoResponse,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobs,
    ChatMessage,
    ChatResponseMessage,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    CompletionStreamResponse,
    CompletionTokensDetails,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    ErrorResponse,
    HealthResponse,
    ModelCard,
    ModelList,
    PromptLogprob,
    PromptTokensDetails,
    SamplingFields,
    StatsResponse,
    StreamOptions,
    UsageInfo,
    VersionResponse,
)
from loom.server.responses import ResponsesServing, responses_router
from loom.server.responses_protocol import ResponseStreamEvent
from loom.server.sse import DONE, EventStreamResponse, PlainChunks, event
from loom.server.tools import AutoStream, CallStream, ToolPlan, tool_dicts

log = logging.getLogger("loom.server")

DEFAULT_MAX_BODY_BYTES = 2 << 20
STATIC_DIR = Path(__file__).resolve().parent / "static"

_ERRORS = {"model": ErrorResponse}
_V1_ERRORS: dict[int | str, dict[str, Any]] = {400: _ERRORS, 413: _ERRORS}
_GENERATE_ERRORS: dict[int | str, dict[str, Any]] = {
    400: {**_ERRORS, "description": "Invalid parameters, malformed JSON, or a prompt longer than the context."},
    404: {**_ERRORS, "description": "The model named is not served here."},
    413: {**_ERRORS, "description": "The request body is larger than the server's limit."},
    429: {**_ERRORS, "description": "The waiting queue is full; retry after the Retry-After header's seconds."},
}


def _sse_doc(chunk_model: str) -> dict[int | str, dict[str, Any]]:
    """The 200 entry of a streaming endpoint: JSON, or (OpenAPI 3.1 style) the schema of one
    server-sent event, whose data is a chunk, an in-band error, or the final ``[DONE]``."""
    payload = {"anyOf": [{"$ref": f"#/components/schemas/{chunk_model}"},
                         {"$ref": "#/components/schemas/ErrorResponse"}]}
    event_schema = {
        "type": "object",
        "required": ["data"],
        "properties": {
            "event": {"type": "string"},
            "data": {"type": "string",
                     "anyOf": [{"const": "[DONE]"},
                               {"contentMediaType": "application/json", "contentSchema": payload}]},
        },
    }
    return {200: {"description": f"The answer as JSON, or with `stream: true` as server-sent events: one "
                                 f"`{chunk_model}` per `data:` line, ending with `data: [DONE]`.",
                  "content": {"text/event-stream": {"schema": event_schema}}}}


def default_served_name(model: str) -> str:
    """The name a model is served under: a registry name as is, a .gguf path by its file stem."""
    path = Path(model)
    return path.stem if path.suffix.lower() == ".gguf" else model


FINAL_USAGE, CONTINUOUS_USAGE = "final", "continuous"


def _usage_mode(options: StreamOptions | None) -> str | None:
    """What a stream reports of its usage: nothing (None), one last chunk (`include_usage`), or
    also each choice's usage so far in every chunk (vLLM's `continuous_usage_stats`, which
    takes effect with `include_usage`, as in vLLM)."""
    if options is None or not options.include_usage:
        return None
    return CONTINUOUS_USAGE if options.continuous_usage_stats else FINAL_USAGE


def chat_chunk_dict(chunk: ChatCompletionChunk) -> dict[str, Any]:
    """A chat chunk as its event's JSON object: a delta's fields that are not sent are absent (as
    OpenAI's), in the delta and in each of its tool calls."""
    data = chunk.model_dump()
    for choice in data["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
        for call in choice["delta"].get("tool_calls", ()):
            for k in [k for k, v in call.items() if v is None]:
                del call[k]
            call["function"] = {k: v for k, v in call["function"].items() if v is not None}
    return data


def _choice_usage(out: RequestOutput, score_only: bool = False) -> UsageInfo:
    """One choice's usage so far: its prompt and the tokens it has generated (none returned where
    the prompt is only scored)."""
    prompt, completion = len(out.prompt_token_ids), 0 if score_only else len(out.outputs[0].token_ids)
    return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


def _opening_usage(group: ChoiceGroup, choices: list) -> UsageInfo | None:
    """An opening chunk's usage: its choice's prompt and no completion tokens yet."""
    prompt = group.prompt_tokens(choices[0].index) if choices else None
    return None if prompt is None else UsageInfo(prompt_tokens=prompt, completion_tokens=0, total_tokens=prompt)


def _answer_id(prefix: str, body: SamplingFields, request: Request) -> str:
    """The answer's id, as vLLM names it: `prefix`-, then the request's X-Request-Id header, else
    its `request_id` field, else a random one."""
    given = (request.headers.get("x-request-id") or "")[:128] or body.request_id   # as RequestIds echoes it
    return f"{prefix}-{given or uuid.uuid4().hex}"


def _engine_id(answer_id: str) -> str:
    """The engine's request id of an answer: unique even where clients reuse their own ids."""
    return f"{answer_id}-{uuid.uuid4().hex[:12]}"


def _check_stream_options(body: SamplingFields) -> None:
    if body.stream_options is not None and not body.stream:
        raise ApiError(400, "stream_options needs stream: true", param="stream_options", code="invalid_value")


def _prompt_list(prompt: Any) -> list[str | list[int]]:
    """The prompts of a completions request: its `prompt` is one prompt or a batch of them."""
    if isinstance(prompt, str):
        return [prompt]
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]
    return [p if isinstance(p, str) else list(p) for p in prompt]


def _constraint(body: SamplingFields) -> StructuredOutputsParams | None:
    """The request's output constraint: `response_format` (json_object, json_schema) or vLLM's
    `structured_outputs`; both at once is a 400."""
    fmt, so = body.response_format, body.structured_outputs
    if fmt is not None and fmt.type != "text" and so is not None:
        raise ApiError(400, "give response_format or structured_outputs, not both", param="structured_outputs",
                       code="invalid_value")
    if so is not None:
        given = {"json": so.json_, "regex": so.regex, "choice": so.choice, "grammar": so.grammar,
                 "json_object": so.json_object, "structural_tag": so.structural_tag}
        return StructuredOutputsParams(**{k: v for k, v in given.items() if v is not None})
    if fmt is None or fmt.type == "text":
        if fmt is not None and fmt.json_schema is not None:
            raise ApiError(400, "response_format.json_schema needs type 'json_schema'",
                           param="response_format.json_schema", code="invalid_value")
        return None
    if fmt.type == "json_object":
        return StructuredOutputsParams(json_object=True, source="response_format")
    if fmt.type == "structural_tag":
        if (fmt.format is None) == (fmt.structures is None):
            raise ApiError(400, "response_format of type 'structural_tag' needs a format, or structures and triggers",
                           param="response_format.format", code="invalid_value")
        tag = ({"type": "structural_tag", "format": fmt.format} if fmt.format is not None
               else {"structures": fmt.structures, "triggers": fmt.triggers or []})
        return StructuredOutputsParams(structural_tag=tag, source="response_format")
    if fmt.json_schema is None:
        raise ApiError(400, "response_format of type 'json_schema' needs a json_schema object",
                       param="response_format.json_schema", code="invalid_value")
    schema = fmt.json_schema.schema_
    if schema is None:
        return StructuredOutputsParams(json_object=True, source="response_format")
    return StructuredOutputsParams(json=schema, source="response_format.json_schema.schema")


def _template_variables(kwargs: dict[str, Any] | None) -> dict[str, Any]:
    """A request's chat_template_kwargs, which may not set what the request's own fields set."""
    extra = dict(kwargs or {})
    reserved = sorted(set(extra) & {"messages", "add_generation_prompt", "continue_final_message", "tools"})
    if reserved:
        raise ApiError(400, f"chat_template_kwargs cannot set {', '.join(reserved)}: give "
                            f"{'them' if len(reserved) > 1 else 'it'} as the request's own field",
                       param="chat_template_kwargs", code="invalid_value")
    if "tokenize" in extra:   # the endpoint decides: ids for a chat request, text for /apply-template
        raise ApiError(400, "chat_template_kwargs cannot set tokenize", param="chat_template_kwargs",
                       code="invalid_value")
    return extra


def _logit_bias(bias: dict[str, float] | None) -> dict[int, float] | None:
    """OpenAI's logit_bias, whose keys are token ids written as strings, with int keys."""
    if bias is None:
        return None
    out = {}
    for key, value in bias.items():
        token = int(key) if key.isascii() and key.isdigit() and len(key) <= 19 else None   # 19 digits: int64
        if token is None:
            raise ApiError(400, f"logit_bias keys must be token ids (non-negative integers as strings), got {key!r}",
                           param="logit_bias", code="invalid_value")
        out[token] = value
    return out


def _with_prompt_logprobs(out: RequestOutput, k: int, completion: CompletionLogprobs, echo: str,
                          spelling: Spelling, as_ids: bool = False) -> CompletionLogprobs:
    """The legacy layout of an echoed prompt's tokens (the first one's logprob and top null: nothing
    precedes it), followed by `completion`'s (whose offsets already count the echoed text). The
    offsets are places in the returned text: a BOS the tokenizer added to a text prompt is not
    in the echoed text, so it takes no characters there (a special token spelled in the prompt's
    text does)."""
    ids = out.prompt_token_ids
    entries = out.prompt_logprobs or [None]
    spelling = spelling.skipping(False)
    cursor, first = TextCursor(), spelling.bytes_of(ids[0])
    if echo.encode("utf-8").startswith(first):
        cursor.advance(first)
    rest = completion_logprobs(entries[1:], ids[1:len(entries)], k, spelling, cursor, as_ids)
    tokens = [spelling.name(ids[0], as_ids)] + rest.tokens
    offsets = [0] + rest.text_offset
    return CompletionLogprobs(tokens=tokens + completion.tokens,
                              token_logprobs=[None] + rest.token_logprobs + completion.token_logprobs,
                              top_logprobs=[None] + rest.top_logprobs + completion.top_logprobs,
                              text_offset=offsets + completion.text_offset)


def _echo(echoes: list[str] | None, prompt: int, out: RequestOutput, body: CompletionRequest) -> str:
    """The echoed prompt: as sent, or where truncate_prompt_tokens cut it, the text of the
    tokens kept (which the returned logprobs and usage count)."""
    if not echoes:
        return ""
    if body.truncate_prompt_tokens is not None and isinstance(out.prompt, str):
        return out.prompt
    return echoes[prompt]


def _prediction(body) -> str | None:
    return None if body.prediction is None else body.prediction.text


def _matched(predicted: Sequence[int], output: Sequence[int]) -> int:
    """How many of the prediction's tokens appear in the output, in order (the matching blocks
    of the two sequences: what OpenAI counts as accepted prediction tokens)."""
    if not predicted or not output:
        return 0
    blocks = difflib.SequenceMatcher(None, list(predicted), list(output), autojunk=False).get_matching_blocks()
    return sum(b.size for b in blocks)


def _prompt_logprobs_field(out: RequestOutput, k: int | None,
                           as_ids: bool = False) -> list[dict[str, PromptLogprob] | None] | None:
    """vLLM's `prompt_logprobs` of a choice: None first, then per prompt token {token id: logprob}."""
    if k is None or out.prompt_logprobs is None:
        return None
    return [None if d is None else {str(tid): PromptLogprob(logprob=finite(lp.logprob), rank=lp.rank,
                                                            decoded_token=token_name(tid, lp, as_ids))
                                    for tid, lp in d.items()}
            for d in out.prompt_logprobs]


def _tool_plan(body: ChatCompletionRequest) -> ToolPlan:
    tools = tool_dicts(body.tools or [])
    choice = body.tool_choice if body.tool_choice is not None else "auto"
    named = None
    if not isinstance(choice, str):
        named, choice = choice.function.name, "named"
        if named not in {t["function"]["name"] for t in tools}:
            raise ApiError(400, f"tool_choice names function {named!r}, which is not in tools",
                           param="tool_choice", code="invalid_value")
    elif choice != "auto" and not tools:
        raise ApiError(400, f"tool_choice {choice!r} needs tools", param="tool_choice", code="invalid_value")
    # a named function is called once (as vLLM forces it), unless parallel calls are asked for
    parallel = body.parallel_tool_calls is True if named is not None else body.parallel_tool_calls is not False
    return ToolPlan(tools, choice, named, parallel)


def _delta_calls(deltas: list[dict[str, Any]]) -> list[DeltaToolCall] | None:
    return [DeltaToolCall(index=d["index"], id=d.get("id"), type=d.get("type"),
                          function=DeltaFunctionCall(**d["function"])) for d in deltas] or None


def _call_chunk(index: int, out: RequestOutput, tools: ToolPlan, stream: CallStream,
                logprobs: Callable[[], ChatLogprobs | None]) -> ChatChunkChoice | None:
    """A streamed choice whose output the grammar forces to be calls: the deltas its new text
    adds, and the logprobs of its tokens since the last chunk (`logprobs()`); at its end
    finish_reason `tool_calls`, or `length` (and the fragments so far) when max_tokens cut the
    calls short."""
    c = out.outputs[0]
    new = _delta_calls(stream.deltas(c.text))
    lp = logprobs()
    if not new and lp is None and not out.finished:
        return None
    finish = tools.message(c.text, c.finish_reason)[2] if out.finished else None
    return ChatChunkChoice(index=index, delta=DeltaMessage(tool_calls=new), logprobs=lp, finish_reason=finish,
                           stop_reason=c.stop_reason if out.finished else None)


def _auto_chunk(index: int, out: RequestOutput, stream: AutoStream,
                logprobs: Callable[[], ChatLogprobs | None]) -> ChatChunkChoice | None:
    """A streamed choice under tool_choice "auto": content once the text cannot open a calls
    object, call deltas once it has (`AutoStream`); logprobs (`logprobs()`: the tokens' since
    the last chunk) ride with either once the text has decided, every token's once."""
    c = out.outputs[0]
    content, deltas, finish = stream.step(c.text, c.finish_reason if out.finished else None)
    lp = logprobs() if stream.mode != "held" else None
    if not content and not deltas and lp is None and not out.finished:
        return None
    return ChatChunkChoice(index=index, delta=DeltaMessage(content=content or None, tool_calls=_delta_calls(deltas)),
                           logprobs=lp, finish_reason=finish, stop_reason=c.stop_reason if out.finished else None)


def _text_size(messages: list[dict[str, Any]]) -> int:
    """The characters of a conversation's text contents (what tokenizing it mostly costs)."""
    return sum(len(m["content"]) for m in messages if isinstance(m.get("content"), str))


def _message_dicts(messages: list[ChatMessage], template: str | None) -> list[dict[str, Any]]:
    return message_dicts([m.model_dump(exclude_none=True) for m in messages], template)


class OpenAIServing:
    """Turns API requests into engine requests and engine outputs into API answers."""

    def __init__(self, ae: EngineClient, served_model_name: str, max_tokens_limit: int | None,
                 metrics: ServerMetrics):
        self.ae = ae
        self.model = served_model_name
        self.max_tokens_limit = max_tokens_limit
        self.metrics = metrics
        self.spelling = Spelling(ae.tokenizer)   # tokens' names and bytes in logprobs
        self.created = int(time.time())
        self.open_streams: set[ChoiceGroup] = set()   # ended by stop_streams when the server stops
        self.open_answers: set[ChoiceGroup] = set()   # non-streamed or not yet admitted: a 503 then, not a 500
        self.stopping = False                         # the server is stopping: stop_streams ran

    # -- request checks -------------------------------------------------------------------
    def check_model(self, name: str | None) -> None:
        if name is not None and name != self.model:
            raise ApiError(404, f"The model `{name}` does not exist; this server serves `{self.model}`.",
                           type=INVALID_REQUEST, param="model", code="model_not_found")

    def max_tokens(self, value: int | None, param: str, explicit: bool) -> int | None:
        """The per-choice token budget: the request's, checked against the server cap; an
        unset budget is the cap (a default larger than the cap is lowered to it)."""
        cap = self.max_tokens_limit
        if cap is not None and value is not None and value > cap:
            if explicit:
                raise ApiError(400, f"{param} must be <= {cap} (this server's limit), got {value}",
                               param=param, code="invalid_value")
            return cap
        return cap if value is None else value

    @staticmethod
    def sampling_params(body: SamplingFields, max_tokens: int | None, logprobs: int | None,
                        strict: bool = False) -> SamplingParams:
        """The request's SamplingParams; `strict`: a max_tokens the request gave itself, refused
        (as vLLM's server refuses it) where the prompt leaves less room in the context."""
        def given(value: Any, default: Any) -> Any:
            return default if value is None else value

        return SamplingParams(
            temperature=given(body.temperature, 1.0), top_p=given(body.top_p, 1.0), top_k=given(body.top_k, 0),
            min_p=given(body.min_p, 0.0), presence_penalty=given(body.presence_penalty, 0.0),
            frequency_penalty=given(body.frequency_penalty, 0.0),
            repetition_penalty=given(body.repetition_penalty, 1.0), seed=body.seed, stop=body.stop,
            stop_token_ids=body.stop_token_ids, include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, max_tokens=max_tokens, min_tokens=body.min_tokens, logprobs=logprobs,
            skip_special_tokens=body.skip_special_tokens, structured_outputs=_constraint(body),
            logit_bias=_logit_bias(body.logit_bias), allowed_token_ids=body.allowed_token_ids,
            bad_words=body.bad_words, truncate_prompt_tokens=body.truncate_prompt_tokens,
            prediction=None if body.prediction is None else body.prediction.text,
            kv_eviction=None if body.kv_eviction is None else body.kv_eviction.model_dump(exclude_none=True),
            cache_salt=body.cache_salt, strict_max_tokens=strict and max_tokens is not None)

    # -- running a group ---------------------------------------------------------------------
    async def collect(self, group: ChoiceGroup, request: Request) -> list[RequestOutput]:
        group.watch(request)
        self.open_answers.add(group)
        if self.stopping:
            group.stop()
        try:
            await group.admitted()
            return await group.final_outputs()
        finally:
            self.open_answers.discard(group)
            group.close()

    async def open_stream(self, group: ChoiceGroup, request: Request, events: AsyncIterator[str]) -> Response:
        """The stream's response once every prompt is admitted; until then (queued in the engine)
        a stop of the server answers it with a 503, as an answer without streaming."""
        group.watch(request)
        self.open_answers.add(group)
        if self.stopping:
            group.stop()
        try:
            await group.admitted()
        except BaseException:
            group.close()
            await events.aclose()
            raise
        finally:
            self.open_answers.discard(group)
        self.open_streams.add(group)
        if self.stopping:   # admitted as the stop came: its stream opens with the error event
            group.stop()

        def closed() -> None:
            self.open_streams.discard(group)
            group.close()

        return EventStreamResponse(events, on_close=closed)

    def stop_streams(self) -> None:
        """The server is stopping: every open stream ends now with an error event and [DONE], and
        every non-streamed answer under way is a 503 saying so, rather than holding the graceful
        shutdown until it is cancelled (a plain-text 500). Requests still queued in the engine get
        the 503 too, and so does any that comes later."""
        self.stopping = True
        for group in [*self.open_streams, *self.open_answers]:
            group.stop()

    def usage(self, finals: list[RequestOutput | None], n: int, prediction: str | None = None,
              score_only: bool = False) -> UsageInfo:
        """Prompt tokens count once per prompt (its first choice), completion tokens per choice
        (none where the prompt is only scored: the token generated then is not returned); with a
        prediction, OpenAI's details: its tokens that appear in the completion (accepted, in
        order: the matching blocks of the two token sequences) and those that do not (rejected)."""
        firsts = [finals[i] for i in range(0, len(finals), n)]
        prompt = sum(len(f.prompt_token_ids) for f in firsts if f is not None)
        cached = sum(f.num_cached_tokens for f in firsts if f is not None)
        completion = 0 if score_only else sum(len(f.outputs[0].token_ids) for f in finals if f is not None)
        details = None
        if prediction is not None:
            predicted = self.ae.tokenizer.encode(prediction, add_special_tokens=False)
            accepted = sum(_matched(predicted, f.outputs[0].token_ids) for f in finals if f is not None)
            rejected = sum(len(predicted) for f in finals if f is not None) - accepted
            details = CompletionTokensDetails(accepted_prediction_tokens=accepted, rejected_prediction_tokens=rejected)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
                         completion_tokens_details=details)

    # -- completions --------------------------------------------------------------------------
    async def completions(self, body: CompletionRequest, request: Request) -> CompletionResponse | Response:
        self.check_model(body.model)
        _check_stream_options(body)
        prompts = _prompt_list(body.prompt)
        limit = self.ae.max_waiting
        if limit is not None and len(prompts) > limit:   # a 429 would never clear: the batch waits at once
            raise ApiError(400, f"prompt is a batch of {len(prompts)} prompts; this server's waiting queue takes "
                           f"at most {limit} at once (--max-waiting): send smaller batches", param="prompt",
                           code="invalid_value")
        score_only = body.max_tokens == 0
        if score_only and not body.echo:
            raise ApiError(400, "max_tokens 0 returns nothing without echo", param="max_tokens", code="invalid_value")
        # max_tokens 0: the prompt is scored and one token generated, which is not returned
        max_tokens = self.max_tokens(1 if score_only else body.max_tokens, "max_tokens",
                                     "max_tokens" in body.model_fields_set)
        params = self.sampling_params(body, max_tokens, body.logprobs,
                                      strict=body.max_tokens is not None and not score_only)
        wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
        if wanted:
            params = params.clone(prompt_logprobs=max(wanted))
        echoes = [self._prompt_text(p) for p in prompts] if body.echo else None
        if not body.add_special_tokens:   # text prompts as ids, tokenized here without BOS
            prompts = [await off_loop(len(p), self.ae.tokenizer.encode, p, add_special_tokens=False)
                       if isinstance(p, str) else p
                       for p in prompts]
        rid, created = _answer_id("cmpl", body, request), int(time.time())
        plan = plan_loom(body.loom, body.stream, body.n)
        if body.stream and body.best_of is not None and body.best_of > body.n:
            raise ApiError(400, "best_of > n ranks finished choices: it cannot be streamed", param="best_of",
                           code="unsupported")
        group = fan_out(self.ae, prompts, params, body.n, _engine_id(rid), body.priority, self.metrics.tracker,
                        best_of=body.best_of, fanout=plan.fanout if plan else None)
        if body.stream:
            include_usage = _usage_mode(body.stream_options)
            events = self._completion_events(group, body, rid, created, echoes, include_usage, score_only)
            return await self.open_stream(group, request, events)
        finals = await self.collect(group, request)
        usage, per, extension = self.usage(finals, body.n, _prediction(body), score_only), body.n, None
        if plan is not None and plan.aggregator is not None:  # one chosen answer per prompt
            (finals, extension), per = plan.aggregate(group.prompt_choices()), 1
        choices, as_ids = [], body.return_tokens_as_token_ids
        spelling = self.spelling.skipping(body.skip_special_tokens)
        for index, out in enumerate(finals):
            c = out.outputs[0]
            echo = _echo(echoes, index // per, out, body)
            text, ids, lps = ("", [], []) if score_only else (c.text, c.token_ids, c.logprobs or [])
            lp = None
            if body.logprobs is not None:
                lp = completion_logprobs(lps, ids, body.logprobs, spelling, TextCursor(len(echo)), as_ids)
                if body.echo:
                    lp = _with_prompt_logprobs(out, body.logprobs, lp, echo, spelling, as_ids)
            rt = body.return_token_ids
            choices.append(CompletionChoice(index=index, text=echo + text, logprobs=lp,
                                            prompt_logprobs=_prompt_logprobs_field(out, body.prompt_logprobs, as_ids),
                                            finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                                            prompt_token_ids=list(out.prompt_token_ids) if rt else None,
                                            token_ids=list(ids) if rt else None))
        return CompletionResponse(id=rid, created=created, model=self.model, choices=choices, usage=usage,
                                  loom=extension)

    def _prompt_text(self, prompt: str | list[int]) -> str:
        return prompt if isinstance(prompt, str) else self.ae.tokenizer.decode(prompt)

    async def _stream(self, group: ChoiceGroup, n: int, include_usage: str | None,
                      dump: Callable[[list, UsageInfo | None], dict[str, Any]],
                      choice_of: Callable[[int, RequestOutput], Any],
                      opening: Sequence[list] = (), prediction: str | None = None,
                      plain: PlainChunks | None = None, score_only: bool = False) -> AsyncIterator[str]:
        """The one SSE loop of both endpoints: `opening` chunks first, then per output of the
        group the chunk choice `choice_of(index, output)` builds (None: nothing to send yet),
        the usage chunk when asked (`include_usage` from `_usage_mode`; "continuous": every
        choice chunk also carries that choice's usage so far), and [DONE]; `dump(choices, usage)`
        is the endpoint's chunk as a dict. An error after the status line is sent goes in-band.
        `plain`: where the request asks for nothing but text (see PlainChunks), the event of an
        output that only adds text, written directly; every other output takes choice_of."""
        finals: list[RequestOutput | None] = [None] * group.size
        if include_usage == CONTINUOUS_USAGE:   # each chunk carries its choice's usage
            plain = None

        def chunk(choices: list, usage: UsageInfo | None = None) -> str:
            data = dump(choices, usage)
            if not include_usage:
                data.pop("usage")
            return event(data)

        try:
            for choices in opening:   # continuous usage: the prompt's, nothing generated (as vLLM)
                yield chunk(choices, _opening_usage(group, choices) if include_usage == CONTINUOUS_USAGE else None)
            async for index, out in group:
                if plain is not None and not out.finished and out.outputs[0].delta_text:
                    yield plain.event(index, out.outputs[0].delta_text)
                    continue
                if out.finished:
                    finals[index] = out
                choice = choice_of(index, out)
                if choice is not None:
                    yield chunk([choice], _choice_usage(out, score_only) if include_usage == CONTINUOUS_USAGE else None)
            if include_usage:
                yield chunk([], self.usage(finals, n, prediction, score_only))
            yield DONE
        except ClientDisconnected:
            return
        except Exception as e:  # noqa: BLE001 - the status line is sent; report in-band
            yield event({"error": stream_error(e)})
            yield DONE
        finally:
            group.close()

    def _completion_events(self, group: ChoiceGroup, body: CompletionRequest, rid: str, created: int,
                           echoes: list[str] | None, include_usage: str | None,
                           score_only: bool) -> AsyncIterator[str]:
        tokens_sent = [0] * group.size
        # each choice's place in its text: its echo, then every token's characters (as the answer
        # without streaming counts them, not the text sent, which a stop string holds back)
        cursors = [TextCursor() for _ in range(group.size)]
        echo_pending = [bool(echoes)] * group.size
        unopened = [True] * group.size   # no chunk of the choice sent yet (return_token_ids: the prompt's ids)
        as_ids = body.return_tokens_as_token_ids
        spelling = self.spelling.skipping(body.skip_special_tokens)

        def dump(choices: list[CompletionChoice], usage: UsageInfo | None) -> dict[str, Any]:
            return CompletionStreamResponse(id=rid, created=created, model=self.model, choices=choices,
                                            usage=usage).model_dump()

        def choice_of(index: int, out: RequestOutput) -> CompletionChoice | None:
            c = out.outputs[0]
            first = echo_pending[index]
            prefix = _echo(echoes, index // body.n, out, body) if first else ""
            text = prefix + ("" if score_only else c.delta_text)
            new_ids = [] if score_only else c.token_ids[tokens_sent[index]:]
            lp = None
            if body.logprobs is not None and (new_ids or (first and body.echo)):
                cursors[index].offset += len(prefix)
                lp = completion_logprobs((c.logprobs or [])[tokens_sent[index]:], new_ids, body.logprobs, spelling,
                                         cursors[index], as_ids)
                if first and body.echo:
                    lp = _with_prompt_logprobs(out, body.logprobs, lp, prefix, spelling, as_ids)
            tokens_sent[index] = len(c.token_ids)
            rt, opening = body.return_token_ids, unopened[index]
            if not text and lp is None and not out.finished and not (rt and (new_ids or opening)):
                return None
            echo_pending[index] = unopened[index] = False
            return CompletionChoice(index=index, text=text, logprobs=lp,
                                    prompt_logprobs=_prompt_logprobs_field(out, body.prompt_logprobs, as_ids)
                                    if first else None,
                                    finish_reason=c.finish_reason if out.finished else None,
                                    stop_reason=c.stop_reason if out.finished else None,
                                    prompt_token_ids=list(out.prompt_token_ids) if rt and opening else None,
                                    token_ids=new_ids if rt else None)

        plain = None
        if (body.logprobs is None and body.prompt_logprobs is None and not echoes and not score_only
                and not body.return_token_ids):
            plain = PlainChunks({"id": rid, "object": "text_completion", "created": created, "model": self.model},
                                "text", usage_null=include_usage == FINAL_USAGE)
        return self._stream(group, body.n, include_usage, dump, choice_of, prediction=_prediction(body),
                            plain=plain, score_only=score_only)

    # -- chat completions ----------------------------------------------------------------------
    async def chat(self, body: ChatCompletionRequest, request: Request,
                   translate: Callable[[AsyncIterator[str]], AsyncIterator[str]] | None = None,
                   ) -> ChatCompletionResponse | Response:
        """A chat completion; streamed, `translate` may rewrite its events (the Responses API's)."""
        self.check_model(body.model)
        _check_stream_options(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if body.max_completion_tokens is not None:
            max_tokens = self.max_tokens(body.max_completion_tokens, "max_completion_tokens", True)
        else:
            max_tokens = self.max_tokens(body.max_tokens, "max_tokens", True)
        top_k = (body.top_logprobs or 0) if body.logprobs else None
        explicit = body.max_completion_tokens is not None or body.max_tokens is not None
        params = self.sampling_params(body, max_tokens, top_k, strict=explicit)
        tools = _tool_plan(body)
        if (schema := tools.forced_schema()) is not None:
            if params.structured_outputs is not None:
                raise ApiError(400, "a forced tool call (tool_choice required or named) cannot be combined with "
                               "response_format or structured_outputs", param="tool_choice", code="invalid_value")
            params = params.clone(structured_outputs=StructuredOutputsParams(json=schema, source="tools"))
        prompt = await self._chat_prompt(body, tools)
        keep = params.prompt_keep(self.ae.max_model_len)
        if keep is not None and len(prompt["prompt_token_ids"]) > keep:   # cut here as the engine cuts it:
            prompt = {"prompt_token_ids": prompt["prompt_token_ids"][-keep:]}   # usage, return_token_ids see it
        rid, created = _answer_id("chatcmpl", body, request), int(time.time())
        plan = plan_loom(body.loom, body.stream, body.n)
        group = fan_out(self.ae, [prompt], params, body.n, _engine_id(rid), body.priority, self.metrics.tracker,
                        fanout=plan.fanout if plan else None)
        if body.stream:
            include_usage = _usage_mode(body.stream_options)
            events = self._chat_events(group, body, rid, created, top_k, include_usage, tools,
                                       prompt["prompt_token_ids"] if body.return_token_ids else None)
            return await self.open_stream(group, request, events if translate is None else translate(events))
        finals = await self.collect(group, request)
        usage, extension = self.usage(finals, body.n, _prediction(body)), None
        if plan is not None and plan.aggregator is not None:  # one chosen answer
            finals, extension = plan.aggregate(group.prompt_choices())
        choices, as_ids = [], body.return_tokens_as_token_ids
        for index, out in enumerate(finals):
            c = out.outputs[0]
            lp = None if top_k is None else chat_logprobs(c.logprobs or [], c.token_ids, top_k, self.spelling, as_ids)
            content, calls, finish = tools.message(c.text, c.finish_reason)
            message = ChatResponseMessage(content=content, tool_calls=calls)
            choices.append(ChatChoice(index=index, message=message, logprobs=lp, finish_reason=finish,
                                      stop_reason=c.stop_reason,
                                      token_ids=list(c.token_ids) if body.return_token_ids else None))
        return ChatCompletionResponse(id=rid, created=created, model=self.model, choices=choices, usage=usage,
                                      prompt_token_ids=prompt["prompt_token_ids"] if body.return_token_ids else None,
                                      loom=extension)

    async def _chat_prompt(self, body: ChatCompletionRequest | TokenizeRequest, tools: ToolPlan,
                           tokenize: bool = True) -> dict[str, Any]:
        """{"prompt_token_ids": ...} of the conversation as the chat template renders it (with the
        tools' prompt); with `tokenize` False {"prompt": its text}."""
        extra = _template_variables(body.chat_template_kwargs)
        messages = _message_dicts(body.messages, self.ae.tokenizer.chat_template)
        if tools.active:   # the template's own tool prompt where it has one, else loom's generic one
            messages = with_tools(messages, tools.tools, self.ae.tokenizer.chat_template, extra)
        try:
            rendered = await off_loop(_text_size(messages), self.ae.tokenizer.apply_chat_template, messages,
                                      add_generation_prompt=body.add_generation_prompt,
                                      continue_final_message=body.continue_final_message, tokenize=tokenize, **extra)
        except TokenizerError as e:
            hint = " (POST /v1/completions takes a plain prompt)" if self.ae.tokenizer.chat_template is None else ""
            param = "continue_final_message" if str(e).startswith("continue_final_message") else "messages"
            raise ApiError(400, f"{e}{hint}", param=param, code="chat_template_error") from None
        return {"prompt_token_ids": rendered} if tokenize else {"prompt": rendered}

    def _chat_events(self, group: ChoiceGroup, body: ChatCompletionRequest, rid: str, created: int,
                     top_k: int | None, include_usage: str | None, tools: ToolPlan,
                     prompt_ids: list[int] | None = None) -> AsyncIterator[str]:
        """`prompt_ids`: with return_token_ids, the prompt's ids, sent in each choice's opening
        chunk (each chunk then carries its new token ids)."""
        tokens_sent = [0] * group.size
        ids_sent = [0] * group.size

        def dump(choices: list[ChatChunkChoice], usage: UsageInfo | None) -> dict[str, Any]:
            opening = prompt_ids is not None and choices and choices[0].delta.role is not None
            return chat_chunk_dict(ChatCompletionChunk(id=rid, created=created, model=self.model, choices=choices,
                                                       usage=usage, prompt_token_ids=prompt_ids if opening else None))

        calls = [CallStream() for _ in range(group.size)] if tools.streams_calls else None
        autos = [AutoStream(tools) for _ in range(group.size)] if tools.active and calls is None else None

        def logprobs_of(index: int, c: CompletionOutput) -> ChatLogprobs | None:
            """The logprobs of the choice's tokens since the last call (None without new tokens)."""
            start, tokens_sent[index] = tokens_sent[index], len(c.token_ids)
            new_ids = c.token_ids[start:]
            if top_k is None or not new_ids:
                return None
            return chat_logprobs((c.logprobs or [])[start:], new_ids, top_k, self.spelling,
                                 body.return_tokens_as_token_ids)

        def choice_of(index: int, out: RequestOutput) -> ChatChunkChoice | None:
            choice = chunk_of(index, out)
            if choice is not None and prompt_ids is not None:   # return_token_ids: the ids since the last chunk
                ids = out.outputs[0].token_ids
                choice.token_ids, ids_sent[index] = list(ids[ids_sent[index]:]), len(ids)
            return choice

        def chunk_of(index: int, out: RequestOutput) -> ChatChunkChoice | None:
            c = out.outputs[0]
            if calls is not None:   # forced calls: id and name, then the arguments' fragments
                return _call_chunk(index, out, tools, calls[index], lambda: logprobs_of(index, c))
            if autos is not None:   # auto: content, or the calls once the text opens them
                return _auto_chunk(index, out, autos[index], lambda: logprobs_of(index, c))
            lp = logprobs_of(index, c)
            if not c.delta_text and lp is None and not out.finished:
                return None
            delta = DeltaMessage(content=c.delta_text) if c.delta_text or not out.finished else DeltaMessage()
            return ChatChunkChoice(index=index, delta=delta, logprobs=lp,
                                   finish_reason=c.finish_reason if out.finished else None,
                                   stop_reason=c.stop_reason if out.finished else None)

        roles = [[ChatChunkChoice(index=i, delta=DeltaMessage(role="assistant", content=""))]
                 for i in range(group.size)]
        plain = None
        if calls is None and autos is None and top_k is None and prompt_ids is None:
            plain = PlainChunks({"id": rid, "object": "chat.completion.chunk", "created": created,
                                 "model": self.model}, "delta", usage_null=include_usage == FINAL_USAGE)
        return self._stream(group, body.n, include_usage, dump, choice_of, roles, _prediction(body),
                            plain=plain)

    # -- models and stats ------------------------------------------------------------------------
    # -- tokenizer endpoints (vLLM's; lm-eval's remote tokenizer uses them) ------------------------
    async def tokenize(self, body: TokenizeRequest) -> TokenizeResponse:
        self.check_model(body.model)
        tok = self.ae.tokenizer
        if (body.prompt is None) == (body.messages is None):
            raise ApiError(400, "give exactly one of prompt and messages", param="prompt", code="invalid_value")
        if body.tools is not None and body.prompt is not None:
            raise ApiError(400, "tools go with messages (a chat prompt), not with a plain prompt", param="tools",
                           code="invalid_value")
        if body.prompt is not None:
            try:
                ids = await off_loop(len(body.prompt), tok.encode, body.prompt,
                                     add_special_tokens=body.add_special_tokens)
            except TokenizerError as e:
                raise ApiError(400, str(e), param="prompt", code="invalid_value") from None
        else:   # the prompt a chat request with these messages and tools gets
            ids = (await self._chat_prompt(body, ToolPlan(tool_dicts(body.tools or []), "auto", None, True))
                   )["prompt_token_ids"]
        strs = [tok.id_to_token(i) for i in ids] if body.return_token_strs else None
        return TokenizeResponse(count=len(ids), max_model_len=self.ae.max_model_len, tokens=ids, token_strs=strs)

    def detokenize(self, body: DetokenizeRequest) -> DetokenizeResponse:
        self.check_model(body.model)
        bad = next((t for t in body.tokens if t >= self.ae.vocab_size), None)
        if bad is not None:
            raise ApiError(400, f"token id {bad} is outside the vocabulary (0 .. {self.ae.vocab_size - 1})",
                           param="tokens", code="invalid_value")
        text = self.ae.tokenizer.decode(body.tokens)
        return DetokenizeResponse(prompt=text, content=text)

    def tokenizer_info(self) -> TokenizerInfoResponse:
        tok = self.ae.tokenizer
        name = lambda i: None if i is None else tok.id_to_token(i)   # noqa: E731
        return TokenizerInfoResponse(tokenizer_class=f"loom.{type(tok).__name__}", vocab_size=self.ae.vocab_size,
                                     model_max_length=self.ae.max_model_len, bos_token=name(tok.bos_token_id),
                                     eos_token=name(tok.eos_token_id), pad_token=name(tok.pad_token_id),
                                     add_bos_token=bool(tok.add_bos), chat_template=tok.chat_template)

    def model_card(self) -> ModelCard:
        return ModelCard(id=self.model, created=self.created, root=self.ae.model_name,
                         max_model_len=self.ae.max_model_len,
                         permission=[ModelPermission(id=f"modelperm-{self.model}", created=self.created)])

    async def stats(self) -> StatsResponse:
        s = await asyncio.to_thread(sample_engine, self.ae)
        return StatsResponse(model=self.model, max_model_len=self.ae.max_model_len,
                             num_requests_running=s.num_running, num_requests_waiting=s.num_waiting,
                             kv_cache_usage=s.kv_usage, num_preemptions=s.num_preemptions,
                             prompt_tokens=s.prompt_tokens, prompt_tokens_computed=s.prompt_tokens_computed,
                             generation_tokens=s.generation_tokens, prefix_cache_queries=s.prefix_cache_queries,
                             prefix_cache_hits=s.prefix_cache_hits)


# --api-key in the OpenAPI schema (the lock /docs shows): the key itself is checked by the
# BearerKey middleware, before a request's body is read
_BEARER = HTTPBearer(auto_error=False, description="The server's --api-key.")


def _integer_branches(schema: dict[str, Any]) -> list[dict[str, Any]]:
    """The integer schemas inside a property schema (itself, or its anyOf members)."""
    if schema.get("type") == "integer":
        return [schema]
    return [s for s in schema.get("anyOf", []) if s.get("type") == "integer"]


def _state_server_limits(schema: dict[str, Any], *, model: str, vocab_size: int,
                         max_tokens_limit: int | None) -> None:
    """Writes this server's own limits into the request schemas, so the document describes
    what it accepts: the served model name, token ids below the vocabulary size, and the
    max_tokens cap."""
    components = schema["components"]["schemas"]
    for name in ("CompletionRequest", "ChatCompletionRequest"):
        props = components[name]["properties"]
        props["model"]["anyOf"] = [{"type": "string", "enum": [model]}, {"type": "null"}]
        for field in ("max_tokens", "max_completion_tokens"):
            if field in props and max_tokens_limit is not None:
                for branch in _integer_branches(props[field]):
                    branch["maximum"] = max_tokens_limit
        stop_ids = [s for s in props["stop_token_ids"].get("anyOf", []) if s.get("type") == "array"]
        for branch in stop_ids:
            branch["items"]["maximum"] = vocab_size - 1
    responses = components["ResponsesRequest"]["properties"]
    responses["model"]["anyOf"] = [{"type": "string", "enum": [model]}, {"type": "null"}]
    for branch in _integer_branches(responses["max_output_tokens"]) if max_tokens_limit is not None else ():
        branch["maximum"] = max_tokens_limit
    for form in components["CompletionRequest"]["properties"]["prompt"]["anyOf"]:
        items = form.get("items", {})
        for ids in (items, items.get("items", {})):
            if ids.get("type") == "integer":
                ids["maximum"] = vocab_size - 1
    for parameter in schema["paths"]["/v1/models/{model_id}"]["get"].get("parameters", []):
        if parameter["name"] == "model_id":
            parameter["schema"]["enum"] = [model]


def _finish_openapi(app: FastAPI, chunk_models: list[type], **limits: Any) -> None:
    """Post-processes FastAPI's document: validation failures are answered as 400, so its 422
    entries go; the stream chunk models join the components (the event-stream schemas point
    at them); the server's limits are stated (`_state_server_limits`)."""
    original = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = original()
        for path in schema.get("paths", {}).values():
            for operation in path.values():
                operation.get("responses", {}).pop("422", None)
        components = schema.setdefault("components", {}).setdefault("schemas", {})
        for name in ("HTTPValidationError", "ValidationError"):
            components.pop(name, None)
        for model in chunk_models:
            definition = model.model_json_schema(mode="serialization", ref_template="#/components/schemas/{model}")
            for name, sub in definition.pop("$defs", {}).items():
                components.setdefault(name, sub)
            components[model.__name__] = definition
        _state_server_limits(schema, **limits)
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]


def build_app(ae: EngineClient, *, api_key: str | None = None, served_model_name: str | None = None,
              max_tokens_limit: int | None = None, max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
              cors: Cors | None = Cors(), chat_template: str | None = None) -> FastAPI:
    """The FastAPI app serving the engine behind `ae` (an engine client: its own process, or
    `in_process.InProcessEngineClient` around an `AsyncEngine`); the engine starts and stops
    with the app.

    served_model_name: the name clients must send as `model` (default: the registry name, or
        the file stem of a .gguf path).
    max_tokens_limit: the largest max_tokens a request may ask for (default: the context).
    max_body_bytes: larger request bodies are refused with 413.
    cors: cross-origin access (default: every origin, as vLLM's); None leaves the headers to a
        proxy in front (a cluster's ingress).
    chat_template: a Jinja chat template in place of the model's (vLLM's --chat-template).
    """
    if chat_template is not None:
        ae.tokenizer.set_chat_template(chat_template)
    name = served_model_name or default_served_name(ae.model_name)
    metrics = ServerMetrics(ae, name)
    serving = OpenAIServing(ae, name, max_tokens_limit, metrics)

    @asynccontextmanager
    async def lifespan(app_: FastAPI):
        app_.state.loop = asyncio.get_running_loop()   # serve.py ends open streams on it at SIGINT/SIGTERM
        ae.start()
        try:
            yield
        finally:
            await asyncio.to_thread(ae.shutdown)

    app = FastAPI(title="loom", version=loom.__version__, lifespan=lifespan,
                  description="OpenAI-compatible completions and chat completions served by loom on CPUs.")
    app.state.serving = serving
    app.state.metrics = metrics
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)
    if api_key:   # before the body is read (the routes' own check documents it in the schema)
        app.add_middleware(BearerKey, api_key=api_key)
    app.add_middleware(RequestIds)
    app.add_middleware(HeadAsGet)

    @app.exception_handler(ClientDisconnected)
    async def _gone(_: Request, __: ClientDisconnected) -> Response:
        return Response(status_code=499)

    app.include_router(_v1_router(serving, api_key))
    app.include_router(_responses_router(serving, api_key))
    app.include_router(_tokenizer_router(serving, api_key))
    app.include_router(_llamacpp_router(serving, api_key))
    app.include_router(anthropic_router(AnthropicServing(serving), [Depends(_BEARER)] if api_key else [],
                                        bool(api_key)))
    _add_service_routes(app, ae, metrics)
    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
    if cors is not None:
        cors.install(app)
    _finish_openapi(app, [CompletionStreamResponse, ChatCompletionChunk, ResponseStreamEvent, MessageStreamEvent],
                    model=name, vocab_size=ae.vocab_size, max_tokens_limit=max_tokens_limit)
    return app


def _v1_router(serving: OpenAIServing, api_key: str | None) -> APIRouter:
    """The OpenAI routes under /v1 (behind the bearer check when an API key is set)."""
    auth = [Depends(_BEARER)] if api_key else []
    v1_errors = {**_V1_ERRORS, **({401: _ERRORS} if api_key else {})}
    gen_errors = {**_GENERATE_ERRORS, **({401: _ERRORS} if api_key else {})}
    v1 = APIRouter(prefix="/v1", dependencies=auth)

    @v1.post("/completions", response_model=CompletionResponse, responses={**_sse_doc("CompletionStreamResponse"),
                                                                          **gen_errors})
    async def create_completion(body: CompletionRequest, request: Request):
        """Completes one prompt or a batch of prompts."""
        return await serving.completions(body, request)

    @v1.post("/chat/completions", response_model=ChatCompletionResponse,
             responses={**_sse_doc("ChatCompletionChunk"), **gen_errors})
    async def create_chat_completion(body: ChatCompletionRequest, request: Request):
        """Answers a conversation rendered with the model's chat template."""
        return await serving.chat(body, request)

    @v1.get("/models", response_model=ModelList, responses=v1_errors)
    async def list_models() -> ModelList:
        return ModelList(data=[serving.model_card()])

    @v1.get("/models/{model_id:path}", response_model=ModelCard, responses={**v1_errors, 404: _ERRORS})
    async def get_model(model_id: str) -> ModelCard:
        serving.check_model(model_id)
        return serving.model_card()

    @v1.get("/loom/stats", response_model=StatsResponse, responses=v1_errors)
    async def stats() -> StatsResponse:
        """Extension: the engine's load now (the playground polls it)."""
        return await serving.stats()

    return v1


def _responses_router(serving: OpenAIServing, api_key: str | None) -> APIRouter:
    """OpenAI's Responses API under /v1 (see responses.py)."""
    auth = [Depends(_BEARER)] if api_key else []
    gen_errors = {**_GENERATE_ERRORS, **({401: _ERRORS} if api_key else {})}
    return responses_router(ResponsesServing(serving), auth, gen_errors, _sse_doc("ResponseStreamEvent"))


def _llamacpp_router(serving: OpenAIServing, api_key: str | None) -> APIRouter:
    """llama-server's /completion and /props at the root (see llamacpp.py)."""
    auth = [Depends(_BEARER)] if api_key else []
    gen_errors = {**_GENERATE_ERRORS, **({401: _ERRORS} if api_key else {})}
    return llamacpp_router(LlamaCppServing(serving), auth, {**_sse_doc("LlamaCompletionResponse"), **gen_errors})


def _tokenizer_router(serving: OpenAIServing, api_key: str | None) -> APIRouter:
    """vLLM's tokenizer routes at the root: /tokenize, /detokenize, /tokenizer_info."""
    auth = [Depends(_BEARER)] if api_key else []
    errors = {**_V1_ERRORS, 404: _ERRORS, **({401: _ERRORS} if api_key else {})}   # 404: another model named
    router = APIRouter(dependencies=auth)

    @router.post("/tokenize", response_model=TokenizeResponse | LlamaTokenizeResponse, responses=errors)
    async def tokenize(body: TokenizeBody) -> TokenizeResponse | LlamaTokenizeResponse:
        """Token ids of a prompt, or of a conversation as the chat template renders it; of a
        `content` text in llama-server's shape."""
        if isinstance(body, LlamaTokenizeRequest):
            return await llama_tokenize(serving.ae.tokenizer, body)
        return await serving.tokenize(body)

    @router.post("/detokenize", response_model=DetokenizeResponse, responses=errors)
    async def detokenize(body: DetokenizeRequest) -> DetokenizeResponse:
        """The text of token ids."""
        return serving.detokenize(body)

    @router.get("/tokenizer_info", response_model=TokenizerInfoResponse, responses=errors)
    async def tokenizer_info() -> TokenizerInfoResponse:
        """Special tokens and the chat template, for clients that tokenize through the server."""
        return serving.tokenizer_info()

    return router


def _add_service_routes(app: FastAPI, ae: EngineClient, metrics: ServerMetrics) -> None:
    """/health (and /ping), /version, /metrics and the playground."""

    @app.get("/health", response_model=HealthResponse, responses={503: _ERRORS})
    async def health():
        """200 while the engine is alive; 503 with Retry-After while a new engine process loads
        after one died, without it once the engine is gone for good."""
        error = ae.error
        if error is not None:
            what = "engine restarting" if isinstance(error, EngineRestartingError) else "engine failed"
            return JSONResponse(ErrorResponse.model_validate(
                {"error": {"message": f"{what}: {error}", "type": "server_error",
                           "code": "engine_unavailable"}}).model_dump(),
                status_code=503, headers=retry_headers(error))
        return HealthResponse()

    @app.api_route("/ping", methods=["GET", "POST"], response_model=HealthResponse, responses={503: _ERRORS},
                   include_in_schema=False)
    async def ping():
        """/health under vLLM's (and SageMaker's) other name."""
        return await health()

    @app.get("/version", response_model=VersionResponse)
    async def version() -> VersionResponse:
        return VersionResponse(version=loom.__version__)

    @app.get("/metrics", response_class=Response,
             responses={200: {"description": "Prometheus text exposition.",
                              "content": {"text/plain": {"schema": {"type": "string"}}}}})
    async def prometheus_metrics() -> Response:
        body = await asyncio.to_thread(metrics.exposition)
        return Response(body, media_type=CONTENT_TYPE_LATEST)

    @app.get("/", include_in_schema=False)
    async def playground() -> FileResponse:
        return FileResponse(STATIC_DIR / "index.html")
