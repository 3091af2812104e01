"""OpenAI's Responses API over the chat completions path: ``POST /v1/responses``,
``GET`` / ``DELETE /v1/responses/{id}``, ``GET /v1/responses/{id}/input_items``,
``POST /v1/responses/{id}/cancel`` (a 400: nothing runs in the background).

A request becomes a chat completion request (its input items as messages, after the stored
conversation of `previous_response_id` and its `instructions` as a system message; function
tools, `tool_choice`, `text.format` as `response_format`), which runs as any other: the same
chat template, tool prompt, grammars, tool-call parsing, errors and stream handling. The chat
answer (or its stream of chunks) is then written as a response: a `message` item with the text,
one `function_call` item per call, `incomplete` where the token budget ended it; streamed as
the Responses API's typed events (``event: <type>`` and ``data: <json>``, numbered, without a
final ``[DONE]``).

Stored responses (`store`, the default, as OpenAI's) are kept in memory as compact JSON, the
latest `STORE_SIZE` of them within `STORE_BYTES`, with the conversation they end; with
`--replicas`, each replica keeps its own.
"""

from __future__ import annotations

import json
import time
import uuid
from collections import OrderedDict
from typing import Any, Literal

from fastapi import APIRouter, Query, Request
from pydantic import TypeAdapter, ValidationError

from loom.server.errors import ApiError
from loom.server.protocol import ChatCompletionRequest, ChatCompletionResponse
from loom.server.responses_protocol import (
    FunctionCallItem,
    FunctionCallOut,
    FunctionCallOutputItem,
    FunctionCallOutputOut,
    IncompleteDetails,
    InputItemList,
    InputMessage,
    InputMessageOut,
    LogprobOut,
    OutputMessage,
    OutputText,
    ResponseDeleted,
    ResponseError,
    ResponseObject,
    ResponsesRequest,
    ResponseStreamEvent,
    ResponseUsage,
    StoredItem,
)
from loom.server.sse import ChatStreamRewriter

STORE_SIZE = 1000   # responses kept for GET and previous_response_id, the latest first to stay
STORE_BYTES = 256 << 20   # and at most this much of them (compact JSON): one with top-20 logprobs is ~1.5 KB a token

# chat request fields named differently here (for the param of an error)
_PARAMS = {"max_completion_tokens": "max_output_tokens", "messages": "input", "response_format": "text.format",
           "logprobs": "include"}


_ITEMS = TypeAdapter(list[StoredItem])   # a stored response's input items, as JSON


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's input items as chat messages: consecutive function calls are one assistant
    turn's tool calls, a call's output is a tool message."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    messages: list[dict[str, Any]] = []
    for item in body.input:
        if isinstance(item, InputMessage):
            messages.append({"role": item.role, "content": item.text})
        elif isinstance(item, FunctionCallItem):
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text})
    return messages


def _response_format(body: ResponsesRequest) -> dict[str, Any] | None:
    fmt = body.text.format if body.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    schema = {"name": fmt.name or "response", "description": fmt.description, "schema": fmt.schema_,
              "strict": fmt.strict}
    return {"type": "json_schema", "json_schema": {k: v for k, v in schema.items() if v is not None}}


def _tool_choice(body: ResponsesRequest) -> Any:
    choice = body.tool_choice
    if choice is None or isinstance(choice, str):
        return choice
    return {"type": "function", "function": {"name": choice.name}}


def _invalid(e: ValidationError) -> ApiError:
    first = e.errors()[0]
    loc = [str(part) for part in first["loc"]]
    param = ".".join([_PARAMS.get(loc[0], loc[0]), *loc[1:]]) if loc else None
    return ApiError(400, f"{param}: {first['msg']}" if param else first["msg"], param=param, code="invalid_value")


def chat_request(body: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request that answers `body` over `messages` (history and input)."""
    if body.instructions is not None:
        messages = [{"role": "system", "content": body.instructions}, *messages]
    tools = [{"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"}, by_alias=True)}
             for t in body.tools or []]
    fields = {
        "model": body.model, "messages": messages, "max_completion_tokens": body.max_output_tokens,
        "temperature": body.temperature, "top_p": body.top_p, "top_k": body.top_k, "min_p": body.min_p,
        "presence_penalty": body.presence_penalty, "frequency_penalty": body.frequency_penalty,
        "repetition_penalty": body.repetition_penalty, "seed": body.seed, "priority": body.priority,
        "tools": tools or None, "tool_choice": _tool_choice(body), "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": _response_format(body), "logprobs": body.wants_logprobs or None,
        "top_logprobs": (body.top_logprobs or 0) if body.wants_logprobs else None,
        "stream": body.stream, "stream_options": {"include_usage": True} if body.stream else None,
    }
    try:
        return ChatCompletionRequest.model_validate({k: v for k, v in fields.items() if v is not None})
    except ValidationError as e:
        raise _invalid(e) from None


def _logprobs_out(content: list[dict[str, Any]] | None) -> list[LogprobOut]:
    return [LogprobOut.model_validate({k: entry[k] for k in ("token", "logprob", "bytes", "top_logprobs")})
            for entry in content or []]


def usage_of(usage: dict[str, Any]) -> ResponseUsage:
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return ResponseUsage(input_tokens=usage["prompt_tokens"], input_tokens_details={"cached_tokens": cached},
                         output_tokens=usage["completion_tokens"], total_tokens=usage["total_tokens"])


def stored_items(body: ResponsesRequest) -> list[InputMessageOut | FunctionCallOut | FunctionCallOutputOut]:
    """The request's input items as a stored response lists them, each with an id."""
    if isinstance(body.input, str):
        return [InputMessageOut(id=_new_id("msg"), role="user", content=[{"type": "input_text", "text": body.input}])]
    items: list[InputMessageOut | FunctionCallOut | FunctionCallOutputOut] = []
    for item in body.input:
        if isinstance(item, InputMessage):
            parts = ([{"type": "input_text", "text": item.content}] if isinstance(item.content, str) else
                     [{"type": p.type, "text": p.text} for p in item.content])
            items.append(InputMessageOut(id=item.id or _new_id("msg"), role=item.role, content=parts))
        elif isinstance(item, FunctionCallItem):
            items.append(FunctionCallOut(id=item.id or _new_id("fc"), call_id=item.call_id, name=item.name,
                                         arguments=item.arguments, status="completed"))
        else:
            items.append(FunctionCallOutputOut(id=item.id or _new_id("fco"), call_id=item.call_id, output=item.text))
    return items


class ResponseStore:
    """The latest stored responses, each with the conversation it ends (chat messages,
    instructions left out: a continuation gives its own) and its input items: at most `size` of
    them and `max_bytes` of their compact JSON (the newest always stays), the oldest evicted
    first. Kept as JSON, read back when asked for: as objects they took ~10x the memory, and a
    thousand answers with logprobs grew the server by gigabytes."""

    def __init__(self, size: int = STORE_SIZE, max_bytes: int = STORE_BYTES):
        self.size, self.max_bytes = size, max_bytes
        self._entries: OrderedDict[str, tuple[bytes, bytes, bytes]] = OrderedDict()
        self.bytes = 0

    def put(self, response: ResponseObject, conversation: list[dict[str, Any]], items: list) -> None:
        entry = (response.model_dump_json().encode(), json.dumps(conversation).encode(), _ITEMS.dump_json(items))
        self._forget(response.id)
        self._entries[response.id] = entry
        self.bytes += sum(map(len, entry))
        while len(self._entries) > self.size or (self.bytes > self.max_bytes and len(self._entries) > 1):
            self._forget(next(iter(self._entries)))

    def _forget(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self.bytes -= sum(map(len, entry))

    def _entry(self, response_id: str) -> tuple[bytes, bytes, bytes]:
        entry = self._entries.get(response_id)
        if entry is None:
            raise ApiError(404, f"No response with id {response_id!r} is stored on this server.",
                           param="response_id", code="not_found")
        return entry

    def get(self, response_id: str) -> ResponseObject:
        return ResponseObject.model_validate_json(self._entry(response_id)[0])

    def conversation(self, response_id: str | None) -> list[dict[str, Any]]:
        if response_id is None:
            return []
        entry = self._entries.get(response_id)
        if entry is None:
            raise ApiError(400, f"Previous response with id {response_id!r} not found: it was not stored on this "
                           f"server (store false, evicted past the latest {self.size} or {self.max_bytes >> 20} MB, "
                           "another replica's, or a restart since)", param="previous_response_id",
                           code="previous_response_not_found")
        return json.loads(entry[1])

    def delete(self, response_id: str) -> ResponseDeleted:
        self._entry(response_id)
        self._forget(response_id)
        return ResponseDeleted(id=response_id)

    def input_items(self, response_id: str, after: str | None, limit: int, order: str) -> InputItemList:
        """A page of the response's input items: `limit` of them after the item `after`, oldest
        first with order asc (newest first by default, as OpenAI lists them)."""
        items = _ITEMS.validate_json(self._entry(response_id)[2])
        if order == "desc":
            items.reverse()
        if after is not None:
            ids = [item.id for item in items]
            if after not in ids:
                raise ApiError(400, f"after {after!r} is not an input item of response {response_id!r}",
                               param="after", code="invalid_value")
            items = items[ids.index(after) + 1:]
        page = items[:limit]
        return InputItemList(data=page, first_id=page[0].id if page else None, last_id=page[-1].id if page else None,
                             has_more=len(items) > limit)

    def cancel(self, response_id: str) -> None:
        self._entry(response_id)
        raise ApiError(400, "Only responses created with background=true can be cancelled; this server runs none "
                       "in the background, so this one has finished.", param="response_id", code="invalid_value")


def _assistant_turn(output: list[OutputMessage | FunctionCallOut]) -> list[dict[str, Any]]:
    """A response's output items as the chat messages of its turn."""
    text = "".join(part.text for item in output if isinstance(item, OutputMessage) for part in item.content)
    calls = [{"id": c.call_id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
             for c in output if isinstance(c, FunctionCallOut)]
    return [{"role": "assistant", "content": text or None, **({"tool_calls": calls} if calls else {})}]


class ResponsesServing:
    """Answers the Responses API through the chat completions of `chat` (an `OpenAIServing`)."""

    def __init__(self, chat, store: ResponseStore | None = None):
        self.chat = chat
        self.store = store or ResponseStore()

    def _shell(self, body: ResponsesRequest, rid: str, status: str) -> ResponseObject:
        """The response before its output: the request's settings echoed."""
        given = body.text.format if body.text is not None else None
        fmt = given.model_dump(exclude_none=True, by_alias=True) if given is not None else None
        choice = body.tool_choice
        choice = choice.model_dump() if choice is not None and not isinstance(choice, str) else (choice or "auto")
        return ResponseObject(
            id=rid, created_at=int(time.time()), status=status, instructions=body.instructions,
            max_output_tokens=body.max_output_tokens, model=self.chat.model, output=[],
            parallel_tool_calls=body.parallel_tool_calls is not False, previous_response_id=body.previous_response_id,
            store=body.store, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_logprobs=body.top_logprobs,
            tool_choice=choice,
            tools=[t.model_dump(exclude_none=True, by_alias=True) for t in body.tools or []],
            text={"format": fmt or {"type": "text"}}, metadata=body.metadata or {}, user=body.user)

    async def create(self, body: ResponsesRequest, request: Request):
        self.chat.check_model(body.model)
        conversation = self.store.conversation(body.previous_response_id) + input_messages(body)
        chat = chat_request(body, conversation)
        rid = _new_id("resp")
        try:
            if body.stream:
                stream = ResponseEvents(self, body, rid, conversation)
                return await self.chat.chat(chat, request, translate=stream.events)
            answer: ChatCompletionResponse = await self.chat.chat(chat, request)
        except ApiError as e:   # named as this request names it
            if e.param in _PARAMS:
                e.message = e.message.replace(e.param, _PARAMS[e.param], 1)
                e.param = _PARAMS[e.param]
            raise
        return self.finish(body, rid, conversation, answer.model_dump())

    def finish(self, body: ResponsesRequest, rid: str, conversation: list[dict[str, Any]],
               answer: dict[str, Any]) -> ResponseObject:
        """The response of a chat answer (as a dict), stored where asked."""
        choice = answer["choices"][0]
        message, incomplete = choice["message"], choice["finish_reason"] == "length"
        status = "incomplete" if incomplete else "completed"
        output: list[OutputMessage | FunctionCallOut] = []
        calls = message.get("tool_calls") or []
        if message.get("content") or not calls:
            logprobs = _logprobs_out((choice.get("logprobs") or {}).get("content")) if body.wants_logprobs else []
            output.append(OutputMessage(id=_new_id("msg"), status=status,
                                        content=[OutputText(text=message.get("content") or "", logprobs=logprobs)]))
        output += [FunctionCallOut(id=_new_id("fc"), call_id=c["id"], name=c["function"]["name"],
                                   arguments=c["function"]["arguments"], status="completed") for c in calls]
        response = self._shell(body, rid, status).model_copy(update={
            "output": output, "usage": usage_of(answer["usage"]),
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None})
        response = ResponseObject.model_validate(response.model_dump())
        if body.store:
            self.store.put(response, conversation + _assistant_turn(output), stored_items(body))
        return response


class ResponseEvents(ChatStreamRewriter):
    """A streamed response: the chat stream's chunks (SSE lines) rewritten as the Responses
    API's events, in order: created, in_progress; per output item its added event, its deltas
    and done events; then completed (or incomplete, or an error and failed)."""

    def __init__(self, serving: ResponsesServing, body: ResponsesRequest, rid: str,
                 conversation: list[dict[str, Any]]):
        super().__init__()
        self.serving, self.body, self.rid, self.conversation = serving, body, rid, conversation
        self.seq = 0
        self.output: list[OutputMessage | FunctionCallOut] = []
        self.text: OutputMessage | None = None          # the message item open now
        self.logprobs: list[LogprobOut] = []            # the open message's
        self.calls: dict[int, FunctionCallOut] = {}     # chat tool-call index -> its open item
        self._deltas: list[str] = []                  # the open message's text so far

    def _event(self, kind: str, **fields: Any) -> str:
        data = ResponseStreamEvent(type=kind, sequence_number=self.seq, **fields).model_dump(exclude_none=True)
        self.seq += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def _index(self, item: OutputMessage | FunctionCallOut) -> int:
        return next(i for i, x in enumerate(self.output) if x is item)

    def _open_text(self) -> list[str]:
        self.text = OutputMessage(id=_new_id("msg"), status="in_progress", content=[])
        self.output.append(self.text)
        i = len(self.output) - 1
        return [self._event("response.output_item.added", output_index=i, item=self.text),
                self._event("response.content_part.added", output_index=i, item_id=self.text.id, content_index=0,
                            part=OutputText(text=""))]

    def _close_text(self, status: str) -> list[str]:
        item, self.text = self.text, None
        if item is None:
            return []
        i, text = self._index(item), "".join(self._deltas)
        part = OutputText(text=text, logprobs=self.logprobs)
        self._deltas, self.logprobs = [], []
        item.content.append(part)
        item.status = status
        logprobs = [lp.model_dump() for lp in part.logprobs]
        return [self._event("response.output_text.done", output_index=i, item_id=item.id, content_index=0,
                            text=text, logprobs=logprobs),
                self._event("response.content_part.done", output_index=i, item_id=item.id, content_index=0,
                            part=part),
                self._event("response.output_item.done", output_index=i, item=item)]

    def _prelude(self) -> list[str]:
        shell = self.serving._shell(self.body, self.rid, "in_progress")
        return [self._event("response.created", response=shell), self._event("response.in_progress", response=shell)]

    def _text_delta(self, delta: str, choice: dict[str, Any]) -> list[str]:
        out = [] if self.text is not None else self._open_text()
        self._deltas.append(delta)
        new = _logprobs_out((choice.get("logprobs") or {}).get("content"))
        self.logprobs += new
        out.append(self._event("response.output_text.delta", output_index=self._index(self.text),
                               item_id=self.text.id, content_index=0, delta=delta,
                               logprobs=[{"token": lp.token, "logprob": lp.logprob,
                                          "top_logprobs": [{"token": t.token, "logprob": t.logprob}
                                                           for t in lp.top_logprobs]} for lp in new]))
        return out

    def _call_delta(self, call: dict[str, Any]) -> list[str]:
        out = self._close_text("completed")
        item = self.calls.get(call["index"])
        fn = call.get("function") or {}
        if item is None:
            item = FunctionCallOut(id=_new_id("fc"), call_id=call.get("id") or _new_id("call"),
                                   name=fn.get("name") or "", arguments="", status="in_progress")
            self.calls[call["index"]] = item
            self.output.append(item)
            out.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                   item=item))
        if fn.get("arguments"):
            item.arguments += fn["arguments"]
            out.append(self._event("response.function_call_arguments.delta", output_index=self._index(item),
                                   item_id=item.id, delta=fn["arguments"]))
        return out

    def _close_calls(self) -> list[str]:
        out = []
        for item in self.calls.values():
            item.status = "completed"
            i = self._index(item)
            out += [self._event("response.function_call_arguments.done", output_index=i, item_id=item.id,
                                name=item.name, arguments=item.arguments),
                    self._event("response.output_item.done", output_index=i, item=item)]
        self.calls = {}
        return out

    def _final(self) -> list[str]:
        incomplete = self.finish == "length"
        status = "incomplete" if incomplete else "completed"
        out = []
        if not self.output:   # nothing generated: an empty message, as the answer without streaming has
            out += self._open_text()
        out += self._close_text(status) + self._close_calls()
        response = self.serving._shell(self.body, self.rid, status).model_copy(update={
            "output": self.output, "usage": usage_of(self.usage) if self.usage else None,
            "incomplete_details": IncompleteDetails(reason="max_output_tokens") if incomplete else None})
        response = ResponseObject.model_validate(response.model_dump())
        if self.body.store:
            self.serving.store.put(response, self.conversation + _assistant_turn(response.output),
                                   stored_items(self.body))
        return out + [self._event(f"response.{status}", response=response)]

    def _failed(self, error: dict[str, Any]) -> list[str]:
        response = self.serving._shell(self.body, self.rid, "failed").model_copy(update={
            "output": [], "error": ResponseError(code=error.get("type") or "server_error",
                                                 message=error.get("message") or "")})
        return [self._event("error", code=error.get("type"), message=error.get("message") or "",
                            param=error.get("param")),
                self._event("response.failed", response=ResponseObject.model_validate(response.model_dump()))]

def responses_router(serving: ResponsesServing, dependencies: list, errors: dict, sse_doc: dict) -> APIRouter:
    """/v1/responses: create, retrieve, delete, input items, cancel."""
    v1 = APIRouter(prefix="/v1", dependencies=dependencies)
    not_found = {**errors, 404: errors[400]}

    @v1.post("/responses", response_model=ResponseObject, responses={**sse_doc, **errors})
    async def create_response(body: ResponsesRequest, request: Request):
        """OpenAI's Responses API: a response to text input items, with function tools."""
        return await serving.create(body, request)

    @v1.get("/responses/{response_id}", response_model=ResponseObject, responses=not_found)
    async def get_response(response_id: str) -> ResponseObject:
        """A stored response."""
        return serving.store.get(response_id)

    @v1.delete("/responses/{response_id}", response_model=ResponseDeleted, responses=not_found)
    async def delete_response(response_id: str) -> ResponseDeleted:
        """Forgets a stored response."""
        return serving.store.delete(response_id)

    @v1.get("/responses/{response_id}/input_items", response_model=InputItemList, responses=not_found)
    async def list_input_items(response_id: str, after: str | None = None,
                               limit: int = Query(20, ge=1, le=100),
                               order: Literal["asc", "desc"] = "desc") -> InputItemList:
        """A stored response's input items."""
        return serving.store.input_items(response_id, after, limit, order)

    @v1.post("/responses/{response_id}/cancel", response_model=ResponseObject, responses=not_found)
    async def cancel_response(response_id: str) -> ResponseObject:
        """Cancels a background response: none run here, so a stored response is a 400."""
        serving.store.cancel(response_id)

    return v1
