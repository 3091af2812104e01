"""Request and response bodies of OpenAI's Responses API (``POST /v1/responses``), as pydantic
models, validated as strictly as the chat completions' (`protocol`): a field loom cannot honour
is a 400 naming it. What the server takes: text input (a string, or message / function_call /
function_call_output items, including the output items of an earlier response sent back),
`instructions`, function tools, `text.format` (text, json_object, json_schema),
`previous_response_id` over the responses this server stored, and the logprobs of the output
text. Images, files, audio, built-in tools (web search, file search, ...), reasoning options
and background runs are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from loom.server.protocol import (
    IGNORED_FIELDS,
    LogprobCount,
    NonEmptyStr,
    PositiveCount,
    Priority,
    Seed,
    ToolName,
    TopK,
    _Request,
    _Response,
    only_type,
)

LOGPROBS_INCLUDE = "message.output_text.logprobs"
ITEM_STATUS = Literal["in_progress", "completed", "incomplete"]

# -- request -------------------------------------------------------------------------------------


class InputText(_Request):
    """A text part of an input message: the user's `input_text`, or an assistant's `output_text`
    sent back (with the annotations and logprobs it came with, which do not change the prompt)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list | None = None
    logprobs: list | None = None

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        kind = data.get("type") if isinstance(data, dict) else None
        if isinstance(kind, str) and kind not in ("input_text", "output_text"):
            raise ValueError(f"content part type {kind!r} is not supported: this server takes text only "
                             "(input_text, output_text)")
        return data


class InputMessage(_Request):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputText]
    id: str | None = None
    status: ITEM_STATUS | None = None

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class FunctionCallItem(_Request):
    """A call the model made (an earlier response's output item, sent back)."""

    type: Literal["function_call"]
    call_id: NonEmptyStr
    name: ToolName
    arguments: str
    id: str | None = None
    status: ITEM_STATUS | None = None


class FunctionCallOutputItem(_Request):
    """The result of a call, for the model to read."""

    type: Literal["function_call_output"]
    call_id: NonEmptyStr
    output: str | list[InputText]
    id: str | None = None
    status: ITEM_STATUS | None = None

    @property
    def text(self) -> str:
        return self.output if isinstance(self.output, str) else "".join(p.text for p in self.output)


_ITEM_TYPES = ("message", "function_call", "function_call_output")


def _item_type(item: Any) -> str:
    kind = item.get("type", "message") if isinstance(item, dict) else getattr(item, "type", None)
    return f"{kind if kind in _ITEM_TYPES else 'message'} item"


# an item's type chooses its model (a message may leave it out), so an error names that model's
# field (the tags, not being field names, stay out of an error's param)
InputItem = Annotated[Annotated[InputMessage, Tag("message item")]
                      | Annotated[FunctionCallItem, Tag("function_call item")]
                      | Annotated[FunctionCallOutputItem, Tag("function_call_output item")], Discriminator(_item_type)]


class FunctionTool(_Request):
    type: Literal["function"]
    name: ToolName
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted: forced calls always follow `parameters`.")

    @model_validator(mode="before")
    @classmethod
    def _function_tools_only(cls, data: Any) -> Any:
        return only_type(data, "function", "tool type {kind} is not available on this server: only function "
                         "tools (type 'function') are")


class NamedTool(_Request):
    type: Literal["function"]
    name: ToolName


class TextFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    name: Annotated[str, Field(min_length=1, max_length=64)] | None = None
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="json_schema: the JSON Schema.")
    strict: bool | None = Field(None, description="Accepted: loom always constrains the output to the schema.")


class TextConfig(_Request):
    format: TextFormat | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: Literal[False] | None = Field(None, description="No obfuscation padding is added.")


class ResponsesRequest(_Request):
    model: str | None = Field(None, description="The served model name; omitted means the served model.")
    input: NonEmptyStr | Annotated[list[InputItem], Field(min_length=1)] = Field(
        description="A user message as a string, or a list of message, function_call and function_call_output "
                    "items.")
    instructions: str | None = Field(None, description="A system message put first (not carried over by "
                                                       "previous_response_id).")
    previous_response_id: str | None = Field(None, description="Continue the conversation of a response this "
                                                               "server stored.")
    max_output_tokens: PositiveCount | None = Field(None, description="Tokens to generate; null runs to the "
                                                                      "context limit.")
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    tools: Annotated[list[FunctionTool], Field(max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedTool | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    include: list[str] | None = Field(None, description=f"Only {LOGPROBS_INCLUDE!r}.")
    top_logprobs: LogprobCount | None = None
    stream: bool = False
    stream_options: ResponsesStreamOptions | None = None
    store: bool = Field(True, description="Keep the response for GET and previous_response_id (in memory, the "
                                          "latest responses only).")
    truncation: Literal["disabled"] | None = None
    metadata: dict[str, str] | None = Field(None, description="Returned with the response.")
    max_tool_calls: PositiveCount | None = Field(None, description="Accepted: it bounds built-in tool calls, and "
                                                                   "this server has none.")
    background: bool | None = Field(None, description="Background responses are not supported: false only.")
    reasoning: dict | None = Field(None, description="Reasoning options are not supported: null (or nulls) only.")
    user: str | None = None
    service_tier: str | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None
    # extensions (vLLM's sampling fields)
    top_k: TopK | None = Field(None, description="Extension: keep the k most probable tokens.")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension.")
    presence_penalty: float | None = Field(None, ge=-2, le=2, description="Extension.")
    frequency_penalty: float | None = Field(None, ge=-2, le=2, description="Extension.")
    repetition_penalty: float | None = Field(None, gt=0, description="Extension: 1 disables.")
    seed: Seed | None = Field(None, description="Extension.")
    priority: Priority = Field(0, description="Extension: lower values are scheduled first.")

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, item in enumerate(v):
                kind = item.get("type", "message") if isinstance(item, dict) else None
                if isinstance(kind, str) and kind not in _ITEM_TYPES:
                    raise ValueError(f"item {i} is of type {kind!r}, which this server does not take: only "
                                     f"{', '.join(_ITEM_TYPES)} items")
        return v

    @field_validator("background")
    @classmethod
    def _foreground(cls, v: bool | None) -> bool | None:
        if v:
            raise ValueError("background responses are not supported on this server: send background false")
        return v

    @field_validator("reasoning")
    @classmethod
    def _no_reasoning(cls, v: dict | None) -> dict | None:
        if v and any(value is not None for value in v.values()):
            raise ValueError("reasoning options are not supported: this server's model does not reason")
        return v

    @field_validator("include")
    @classmethod
    def _known_includes(cls, v: list[str] | None) -> list[str] | None:
        for entry in v or []:
            if entry != LOGPROBS_INCLUDE:
                raise ValueError(f"include {entry!r} is not available on this server: only {LOGPROBS_INCLUDE!r}")
        return v

    @property
    def wants_logprobs(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or []) or self.top_logprobs is not None


assert set(IGNORED_FIELDS) <= set(ResponsesRequest.model_fields)

# -- response ------------------------------------------------------------------------------------


class TopLogprobOut(_Response):
    token: str
    logprob: float
    bytes: list[int]


class LogprobOut(_Response):
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TopLogprobOut]


class OutputText(_Response):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list = []
    logprobs: list[LogprobOut] = []


class OutputMessage(_Response):
    type: Literal["message"] = "message"
    id: str
    status: ITEM_STATUS
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class FunctionCallOut(_Response):
    type: Literal["function_call"] = "function_call"
    id: str
    call_id: str
    name: str
    arguments: str
    status: ITEM_STATUS


OutputItem = Annotated[OutputMessage | FunctionCallOut, Field(discriminator="type")]


class InputTokensDetails(_Response):
    cached_tokens: int


class OutputTokensDetails(_Response):
    reasoning_tokens: int = 0


class ResponseUsage(_Response):
    input_tokens: int
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails = OutputTokensDetails()
    total_tokens: int


class IncompleteDetails(_Response):
    reason: Literal["max_output_tokens"]


class ResponseError(_Response):
    code: str
    message: str


class ResponseObject(_Response):
    """A response: its output items, status and usage, with the request's settings echoed."""

    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    error: ResponseError | None = None
    incomplete_details: IncompleteDetails | None = None
    instructions: str | None = None
    max_output_tokens: int | None = None
    model: str
    output: list[OutputItem]
    parallel_tool_calls: bool
    previous_response_id: str | None = None
    store: bool
    temperature: float
    top_p: float
    top_logprobs: int | None = None
    tool_choice: str | dict[str, str]
    tools: list[dict[str, Any]]
    text: dict[str, Any]
    truncation: Literal["disabled"] = "disabled"
    background: bool = False
    metadata: dict[str, str]
    usage: ResponseUsage | None = None
    user: str | None = None


class ResponseStreamEvent(_Response):
    """One ``data:`` event of a streamed response (its ``event:`` line names the same type)."""

    type: str
    sequence_number: int
    response: ResponseObject | None = None
    output_index: int | None = None
    content_index: int | None = None
    item_id: str | None = None
    item: OutputItem | None = None
    part: OutputText | None = None
    delta: str | None = None
    text: str | None = None
    arguments: str | None = None
    name: str | None = None
    logprobs: list[dict[str, Any]] | None = None
    code: str | None = None
    message: str | None = None
    param: str | None = None


class InputMessageOut(_Response):
    type: Literal["message"] = "message"
    id: str
    role: Literal["user", "assistant", "system", "developer"]
    status: ITEM_STATUS = "completed"
    content: list[dict[str, Any]]


class FunctionCallOutputOut(_Response):
    type: Literal["function_call_output"] = "function_call_output"
    id: str
    call_id: str
    output: str
    status: ITEM_STATUS = "completed"


StoredItem = Annotated[InputMessageOut | FunctionCallOut | FunctionCallOutputOut, Field(discriminator="type")]


class InputItemList(_Response):
    """A page of a stored response's input items (GET /v1/responses/{id}/input_items)."""

    object: Literal["list"] = "list"
    data: list[StoredItem]
    first_id: str | None = None
    last_id: str | None = None
    has_more: bool


class ResponseDeleted(_Response):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
