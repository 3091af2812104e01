"""Anthropic's Messages API over the chat completions path: ``POST /v1/messages`` (answered
as JSON, or with ``stream: true`` as Anthropic's server-sent events) and
``POST /v1/messages/count_tokens``, as vLLM and llama-server offer them, so that Anthropic's
SDKs and clients built on them (Claude Code) run against loom.

A request becomes a chat completion request, which runs as any other (the same chat template,
tool prompt, grammars, tool-call parsing, prefix cache and disconnect handling):

* `system` is a system message first; a user message's tool_result blocks are tool messages
  (`is_error` puts "Error: " before the result), its text blocks user messages, in their
  order; an assistant message's tool_use blocks are its tool calls; a system message among
  the messages stays a system message where it stands. A final assistant message is continued
  (Anthropic's prefill: the chat request's `continue_final_message`).
* `max_tokens` is the chat's `max_completion_tokens`, `stop_sequences` its `stop`; tools become
  function tools; tool_choice auto / any / tool / none is auto / required / the named function /
  none, `disable_parallel_tool_use` is `parallel_tool_calls: false`; `thinking` is the chat
  template's `enable_thinking` (true for enabled and adaptive), as llama-server passes it (a
  model that writes no thinking gets no thinking blocks: loom returns what the model writes as
  text); `output_config.format` is a json_schema `response_format`.
* The query string Anthropic's SDKs add for beta features (``?beta=true``) and the
  ``anthropic-beta`` / ``anthropic-version`` headers select nothing here: the fields a request
  holds are what it asks for, each taken or refused by name.
* The answer is a message: its text as a text block, each call as a tool_use block (id
  ``toolu_...``, `input` the arguments object); stop_reason end_turn, max_tokens,
  stop_sequence (with `stop_sequence` set) or tool_use. Usage follows Anthropic's split: the
  prompt tokens read from the prefix cache are `cache_read_input_tokens`, the rest
  `input_tokens` (their sum is what count_tokens says of the same request).
* Streamed: message_start (its usage counts the whole prompt as input, the split is not known
  yet), a ping, per block content_block_start, its deltas (text_delta, or input_json_delta
  fragments that join into the input's JSON) and content_block_stop, then message_delta
  (stop_reason and the final usage, the split included) and message_stop. Calls under
  tool_choice auto are sent once the answer has ended as calls (until then the text may still
  turn out to be content); forced calls stream as the model writes them.
* Errors have Anthropic's shape, ``{"type": "error", "error": {"type", "message"}}``: 400
  invalid_request_error (a prompt or max_tokens past the context in Anthropic's words, "prompt
  is too long: P tokens > M maximum" and "input length and `max_tokens` exceed context limit:
  P + N > C", which clients such as Claude Code parse to retry with less), 401
  authentication_error, 404 not_found_error, 413 request_too_large, 529 overloaded_error (a
  full waiting queue, or an engine restarting; with Retry-After), 500 api_error; in a stream
  that has begun, an ``error`` event ends it. An unknown model's 404 says "model: NAME", as
  Anthropic's does (Claude Code reads it to switch to its --fallback-model).
"""

from __future__ import annotations

import json
import logging
import re
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import pydantic_core
from fastapi import APIRouter, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from fastapi.routing import APIRoute
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

from loom.errors import LoomError
from loom.server.anthropic_protocol import (
    AnthropicError,
    CountTokensRequest,
    CountTokensResponse,
    ErrorDetail,
    MessageObject,
    MessagesRequest,
    TextOut,
    ThinkingDisabled,
    ToolResultBlock,
    ToolUseBlock,
    ToolUseOut,
    MessageUsage,
    PromptFields,
)
from loom.server.errors import (ApiError, ClientDisconnected, anthropic_error_response,
                                api_error_from_loom, validation_message)
from loom.server.protocol import ChatCompletionRequest, TokenizeRequest
from loom.server.sse import ChatStreamRewriter

log = logging.getLogger("loom.server")

# chat request fields (and parts of their paths) named differently here, for error messages
_NAMES = {"max_completion_tokens": "max_tokens", "stop": "stop_sequences", "parameters": "input_schema",
          "chat_template_kwargs": "thinking", "parallel_tool_calls": "tool_choice.disable_parallel_tool_use",
          "response_format": "output_config.format"}
_SKIPPED = ("function", "json_schema")   # levels of the chat request a path here does not have
_STOP_REASONS = {"length": "max_tokens", "tool_calls": "tool_use"}
_IGNORED = "metadata, service_tier, cache_control"


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _renamed(path: str) -> str:
    """A chat request's field path in this API's names ("tools.0.function.parameters" ->
    "tools.0.input_schema")."""
    parts = [_NAMES.get(p, p) for p in path.split(".") if p not in _SKIPPED]
    return ".".join(parts)


# loom's context-limit messages (loom.engine), and Anthropic's words for each
_MAX_TOKENS_PAST_CONTEXT = re.compile(r"is too large: (\d+)\. This model's maximum context length is (\d+) tokens "
                                      r"and your request has (\d+) input tokens")
_PROMPT_PAST_CONTEXT = re.compile(r"^prompt is (\d+) tokens, the context limit is (\d+)")


def _anthropic_wording(message: str) -> str:
    """A context-limit error in the words of Anthropic's API; any other message as it is."""
    if m := _MAX_TOKENS_PAST_CONTEXT.search(message):
        wanted, context, prompt = m.groups()
        return (f"input length and `max_tokens` exceed context limit: {prompt} + {wanted} > {context}, decrease "
                "input length or `max_tokens` and try again")
    if m := _PROMPT_PAST_CONTEXT.match(message):
        prompt, context = m.groups()   # one token of the context is left to generate
        return f"prompt is too long: {prompt} tokens > {int(context) - 1} maximum"
    return message


def _in_our_names(e: ApiError) -> ApiError:
    """An error of the chat completions path, naming this request's fields (and a context limit
    in Anthropic's words)."""
    if e.code == "context_length_exceeded":
        e.message = _anthropic_wording(e.message)
    elif e.param is not None and _renamed(e.param) != e.param:
        e.message = e.message.replace(e.param, _renamed(e.param), 1)
    if e.param is not None:
        e.param = _renamed(e.param)
    return e


def _invalid_chat(e: ValidationError) -> ApiError:
    """The chat request made from a valid Anthropic request did not validate (a tool's
    input_schema that is no object schema): a 400 naming the Anthropic field."""
    message, param = validation_message([{**err, "loc": ("body", *err["loc"])} for err in e.errors()])
    if param is not None:
        message = message.replace(param, _renamed(param), 1)
    return ApiError(400, message.replace("Value error, ", ""), param=param)


def _validation_answer(e: RequestValidationError) -> JSONResponse:
    errors = list(e.errors())
    message, param = validation_message(errors)
    if any(err.get("type") == "extra_forbidden" for err in errors):
        message = (f"unknown field '{param}': loom does not implement it (accepted and ignored because they cannot "
                   f"change the output: {_IGNORED})")
    return anthropic_error_response(400, message.replace("Value error, ", ""))


class AnthropicRoute(APIRoute):
    """A route whose every failure is answered in Anthropic's error shape (the app's handlers
    answer in OpenAI's); a bug is a logged 500 api_error."""

    def get_route_handler(self) -> Callable[[Request], Awaitable[Response]]:
        handler = super().get_route_handler()

        async def answer(request: Request) -> Response:
            try:
                return await handler(request)
            except ClientDisconnected:
                raise
            except RequestValidationError as e:
                return _validation_answer(e)
            except ApiError as e:
                return anthropic_error_response(e.status, e.message, e.headers)
            except LoomError as e:
                err = _in_our_names(api_error_from_loom(e, request.url.path))
                return anthropic_error_response(err.status, err.message, err.headers)
            except StarletteHTTPException as e:
                return anthropic_error_response(e.status_code, str(e.detail), dict(e.headers or {}) or None)
            except Exception:
                log.exception("%s failed", request.url.path)
                return anthropic_error_response(500, "internal server error")

        return answer


# -- requests -------------------------------------------------------------------------------------


def _user_turn(blocks: list, out: list[dict[str, Any]]) -> None:
    """A user message's blocks as chat messages, in order: text runs as user messages, each
    tool result as a tool message."""
    texts: list[dict[str, str]] = []
    for block in blocks:
        if isinstance(block, ToolResultBlock):
            if texts:
                out.append({"role": "user", "content": texts})
                texts = []
            out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": block.text})
        else:
            texts.append({"type": "text", "text": block.text})
    if texts:
        out.append({"role": "user", "content": texts})


def _assistant_turn(blocks: list) -> dict[str, Any]:
    texts = [{"type": "text", "text": b.text} for b in blocks if not isinstance(b, ToolUseBlock)]
    calls = [{"id": b.id, "type": "function", "function": {"name": b.name, "arguments": json.dumps(b.input)}}
             for b in blocks if isinstance(b, ToolUseBlock)]
    return {"role": "assistant", "content": texts or None, **({"tool_calls": calls} if calls else {})}


def chat_messages(body: PromptFields) -> list[dict[str, Any]]:
    """The request's system prompt and messages as chat messages."""
    out: list[dict[str, Any]] = []
    if body.system_text is not None:
        out.append({"role": "system", "content": body.system_text})
    for m in body.messages:
        if isinstance(m.content, str):
            out.append({"role": m.role, "content": m.content})
        elif m.role == "user":
            _user_turn(m.content, out)
        elif m.role == "system":
            out.append({"role": "system", "content": "\n".join(b.text for b in m.content)})
        else:
            out.append(_assistant_turn(m.content))
    return out


def _prefill(body: PromptFields) -> bool:
    """A final assistant message is continued (Anthropic's prefill); it cannot hold calls."""
    last = body.messages[-1]
    if last.role != "assistant":
        return False
    if not isinstance(last.content, str) and any(isinstance(b, ToolUseBlock) for b in last.content):
        raise ApiError(400, "the final message is the assistant's, which the answer continues (a prefill): it "
                            "cannot hold tool_use blocks (send their tool_result blocks in a user message after it)",
                       param="messages")
    return True


def _tool_fields(body: PromptFields) -> dict[str, Any]:
    """tools, tool_choice and parallel_tool_calls of the chat request (no tools under none)."""
    choice = body.tool_choice
    if not body.tools:
        if choice is not None and choice.type != "none":
            raise ApiError(400, f"tool_choice of type {choice.type!r} needs tools", param="tool_choice")
        return {}
    tools = [{"type": "function", "function": {"name": t.name, "description": t.description,
                                               "parameters": t.input_schema}} for t in body.tools]
    if choice is None or choice.type == "auto":
        kind: Any = "auto"
    elif choice.type == "none":
        return {"tool_choice": "none", "tools": tools}
    else:
        kind = "required" if choice.type == "any" else {"type": "function", "function": {"name": choice.name}}
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return {"tools": tools, "tool_choice": kind, "parallel_tool_calls": parallel}


def _prompt_fields(body: PromptFields) -> dict[str, Any]:
    """What renders the prompt, as chat request (and tokenize request) fields."""
    prefill = _prefill(body)
    fields = {"model": body.model, "messages": chat_messages(body), **_tool_fields(body),
              "add_generation_prompt": not prefill, "continue_final_message": prefill}
    if body.thinking is not None:
        fields["chat_template_kwargs"] = {"enable_thinking": not isinstance(body.thinking, ThinkingDisabled)}
    return fields


def _response_format(body: MessagesRequest) -> dict[str, Any] | None:
    """output_config.format as the chat request's json_schema response_format."""
    wanted = body.output_config.format if body.output_config is not None else None
    if wanted is None:
        return None
    return {"type": "json_schema", "json_schema": {"name": "output", "schema": wanted.schema_}}


def chat_request(body: MessagesRequest) -> ChatCompletionRequest:
    """The chat completion request that answers `body`."""
    forced = body.tools and body.tool_choice is not None and body.tool_choice.type in ("any", "tool")
    if forced and _response_format(body) is not None:   # a forced call's grammar is the tool's schema
        raise ApiError(400, f"tool_choice {body.tool_choice.type!r} (a forced tool call) cannot be combined with "
                       "output_config.format: the call follows its tool's input_schema", param="tool_choice")
    fields = {**_prompt_fields(body), "max_completion_tokens": body.max_tokens, "stop": body.stop_sequences,
              "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "stream": body.stream,
              "response_format": _response_format(body),
              "stream_options": {"include_usage": True, "continuous_usage_stats": True} if body.stream else None}
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise _invalid_chat(e) from None


def tokenize_request(body: CountTokensRequest) -> TokenizeRequest:
    """The tokenize request of the prompt a messages request with these fields gets."""
    fields = _prompt_fields(body)
    if fields.pop("tool_choice", None) == "none":
        fields.pop("tools")
    fields.pop("parallel_tool_calls", None)
    try:
        return TokenizeRequest.model_validate(fields)
    except ValidationError as e:
        raise _invalid_chat(e) from None


# -- answers --------------------------------------------------------------------------------------


def tool_use_id(call_id: str) -> str:
    return "toolu_" + call_id.removeprefix("call_")


def _input(arguments: str) -> dict[str, Any]:
    """A call's input object. Arguments cut short (by max_tokens or a stop sequence: stop_reason
    says so) give the fields they hold whole, as Anthropic's SDKs read a stream's
    input_json_delta fragments, so the streamed and the whole answer agree."""
    try:
        value = pydantic_core.from_json(arguments, allow_partial=True)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def stop_reason(finish: str | None, stopped_by: int | str | None, body: MessagesRequest) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) of a chat choice's finish_reason and stop_reason."""
    if finish == "stop" and isinstance(stopped_by, str) and stopped_by in (body.stop_sequences or ()):
        return "stop_sequence", stopped_by
    return _STOP_REASONS.get(finish or "", "end_turn"), None


def usage_of(usage: dict[str, Any]) -> MessageUsage:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return MessageUsage(input_tokens=usage["prompt_tokens"] - cached, output_tokens=usage["completion_tokens"],
                 cache_read_input_tokens=cached)


def message_of(answer: dict[str, Any], body: MessagesRequest, mid: str, model: str) -> MessageObject:
    """The message of a chat answer (as a dict)."""
    choice = answer["choices"][0]
    message = choice["message"]
    content: list[TextOut | ToolUseOut] = [TextOut(text=message["content"])] if message.get("content") else []
    for call in message.get("tool_calls") or []:
        fn = call["function"]
        content.append(ToolUseOut(id=tool_use_id(call["id"]), name=fn["name"], input=_input(fn["arguments"])))
    reason, sequence = stop_reason(choice["finish_reason"], choice.get("stop_reason"), body)
    return MessageObject(id=mid, model=model, content=content, stop_reason=reason, stop_sequence=sequence,
                         usage=usage_of(answer["usage"]))


def _sse(kind: str, data: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump()


def _stream_error(error: dict[str, Any]) -> str:
    """An in-band error of the chat stream as Anthropic's error event."""
    kind = error.get("type")
    kind = ("overloaded_error" if error.get("code") == "engine_unavailable" else
            "invalid_request_error" if kind == "invalid_request_error" else "api_error")
    return _sse("error", AnthropicError(error=ErrorDetail(type=kind, message=error.get("message") or "")).model_dump())


class MessageEvents(ChatStreamRewriter):
    """A streamed message: the chat stream's chunks (SSE lines, with continuous usage) rewritten
    as Anthropic's events, in the order the module docstring gives. `forced`: the calls are
    certain (tool_choice any or tool), so they stream as they come; otherwise they are held
    until the answer ends as calls."""

    def __init__(self, model: str, body: MessagesRequest, mid: str, forced: bool):
        super().__init__()
        self.model, self.body, self.mid, self.forced = model, body, mid, forced
        self.blocks = 0                          # content blocks started
        self.open: str | None = None             # the open block's type
        self.held: dict[int, dict[str, Any]] = {}   # chat call index -> {id, name, arguments}

    def _start(self, block: TextOut | ToolUseOut) -> list[str]:
        out = self._close()
        self.open = block.type
        self.blocks += 1
        return out + [_sse("content_block_start", {"type": "content_block_start", "index": self.blocks - 1,
                                                   "content_block": _dump(block)})]

    def _close(self) -> list[str]:
        if self.open is None:
            return []
        self.open = None
        return [_sse("content_block_stop", {"type": "content_block_stop", "index": self.blocks - 1})]

    def _delta(self, delta: dict[str, str]) -> str:
        return _sse("content_block_delta", {"type": "content_block_delta", "index": self.blocks - 1, "delta": delta})

    def _text_delta(self, text: str, choice: dict[str, Any]) -> list[str]:
        out = [] if self.open == "text" else self._start(TextOut(text=""))
        return out + [self._delta({"type": "text_delta", "text": text})]

    def _call(self, call_id: str, name: str, arguments: str) -> list[str]:
        out = self._start(ToolUseOut(id=tool_use_id(call_id), name=name, input={}))
        return out + ([self._delta({"type": "input_json_delta", "partial_json": arguments})] if arguments else [])

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        fn = call.get("function") or {}
        if not self.forced:   # held: the text may still turn out to be content
            held = self.held.setdefault(call["index"], {"id": call.get("id") or "", "name": "", "arguments": ""})
            held["name"] += fn.get("name") or ""
            held["arguments"] += fn.get("arguments") or ""
            return []
        if call.get("id"):
            return self._call(call["id"], fn.get("name") or "", fn.get("arguments") or "")
        args = fn.get("arguments")
        return [self._delta({"type": "input_json_delta", "partial_json": args})] if args else []

    def _finished(self) -> list[str]:
        if self.finish != "tool_calls":
            return []
        return [e for call in self.held.values() for e in self._call(call["id"], call["name"], call["arguments"])]

    def _opening(self, data: dict[str, Any]) -> list[str]:
        """message_start (its usage the whole prompt, nothing generated yet) and a ping."""
        prompt = (data.get("usage") or {}).get("prompt_tokens", 0)
        shell = MessageObject(id=self.mid, model=self.model, content=[],
                              usage=MessageUsage(input_tokens=prompt, output_tokens=0))
        return [_sse("message_start", {"type": "message_start", "message": _dump(shell)}),
                _sse("ping", {"type": "ping"})]

    def _final(self) -> list[str]:
        reason, sequence = stop_reason(self.finish, self.stopped_by, self.body)
        usage = usage_of(self.usage) if self.usage else MessageUsage(input_tokens=0, output_tokens=0)
        delta = {"type": "message_delta", "delta": {"stop_reason": reason, "stop_sequence": sequence},
                 "usage": {"output_tokens": usage.output_tokens, "input_tokens": usage.input_tokens,
                           "cache_read_input_tokens": usage.cache_read_input_tokens}}
        return self._close() + [_sse("message_delta", delta), _sse("message_stop", {"type": "message_stop"})]

    def _failed(self, error: dict[str, Any]) -> list[str]:
        return [_stream_error(error)]


class AnthropicServing:
    """Answers the Messages API through the chat completions of `chat` (an `OpenAIServing`)."""

    def __init__(self, chat):
        self.chat = chat

    def check_model(self, name: str) -> None:
        """An unknown model is a 404 in Anthropic's words ("model: NAME"), which Claude Code reads
        to switch to its --fallback-model."""
        if name != self.chat.model:
            raise ApiError(404, f"model: {name} (this server serves `{self.chat.model}`)", param="model")

    async def create(self, body: MessagesRequest, request: Request) -> MessageObject | Response:
        self.check_model(body.model)
        chat = chat_request(body)
        mid = _new_id("msg")
        try:
            if body.stream:
                forced = body.tool_choice is not None and body.tool_choice.type in ("any", "tool")
                events = MessageEvents(self.chat.model, body, mid, forced and bool(body.tools))
                return await self.chat.chat(chat, request, translate=events.events)
            answer = await self.chat.chat(chat, request)
        except ApiError as e:
            raise _in_our_names(e) from None
        return message_of(answer.model_dump(), body, mid, self.chat.model)

    async def count_tokens(self, body: CountTokensRequest) -> CountTokensResponse:
        self.check_model(body.model)
        try:
            counted = await self.chat.tokenize(tokenize_request(body))
        except ApiError as e:
            raise _in_our_names(e) from None
        return CountTokensResponse(input_tokens=counted.count)


def _sse_doc() -> dict[int | str, dict[str, Any]]:
    """The 200 entry of /v1/messages: JSON, or the schema of one server-sent event (its
    ``event:`` line and its data, a MessageStreamEvent or an error)."""
    payload = {"anyOf": [{"$ref": "#/components/schemas/MessageStreamEvent"},
                         {"$ref": "#/components/schemas/AnthropicError"}]}
    event_schema = {"type": "object", "required": ["event", "data"],
                    "properties": {"event": {"type": "string"},
                                   "data": {"type": "string", "contentMediaType": "application/json",
                                            "contentSchema": payload}}}
    return {200: {"description": "The message as JSON, or with `stream: true` as Anthropic's server-sent events.",
                  "content": {"text/event-stream": {"schema": event_schema}}}}


def anthropic_router(serving: AnthropicServing, dependencies: list, api_key: bool) -> APIRouter:
    """/v1/messages and /v1/messages/count_tokens, answering errors in Anthropic's shape."""
    router = APIRouter(prefix="/v1", dependencies=dependencies, route_class=AnthropicRoute)
    error = {"model": AnthropicError}
    errors: dict[int | str, dict[str, Any]] = {
        400: {**error, "description": "Invalid parameters, malformed JSON, or a prompt longer than the context."},
        404: {**error, "description": "The model named is not served here."},
        413: {**error, "description": "The request body is larger than the server's limit."},
        **({401: {**error, "description": "A missing or wrong API key (x-api-key or Authorization: Bearer)."}}
           if api_key else {})}
    busy = {529: {**error, "description": "Overloaded: the waiting queue is full, or the engine is restarting; "
                                          "retry after the Retry-After header's seconds."},
            500: {**error, "description": "The engine has failed."}}

    @router.post("/messages", response_model=MessageObject, responses={**_sse_doc(), **errors, **busy})
    async def create_message(body: MessagesRequest, request: Request):
        """Anthropic's Messages API: a message answering a conversation, with custom tools."""
        return await serving.create(body, request)

    @router.post("/messages/count_tokens", response_model=CountTokensResponse, responses=errors)
    async def count_tokens(body: CountTokensRequest) -> CountTokensResponse:
        """The prompt tokens of a messages request with these fields."""
        return await serving.count_tokens(body)

    return router
