"""Request and response bodies of Anthropic's Messages API (``POST /v1/messages``,
``POST /v1/messages/count_tokens``), as pydantic models, validated as strictly as the OpenAI
routes' (`protocol`): a field loom does not implement is a 400 naming it.

What the server takes: `system` (a string or text blocks), messages whose content is a string
or text, tool_use and tool_result blocks (a tool result's content a string or text blocks),
system messages among the messages (text only; the mid-conversation-system beta), custom tools
(`name`, `description`, `input_schema`) with `tool_choice`, `stop_sequences`, `temperature`,
`top_p`, `top_k`, `thinking` (enabled or adaptive: the chat template's `enable_thinking` true;
disabled: false), `output_config.format` (a JSON schema the answer follows), `stream`.
Accepted and ignored, since they cannot change the output: `metadata.user_id`,
`service_tier`, and `cache_control` (with its `ttl` and `scope`) on the request, its blocks and
tools (loom's prefix cache is automatic); `strict` on a tool, as the chat completions take it.
Accepted because applying them changes nothing here: `output_config.effort` "high" (the API's
default, the same as leaving it out), and `context_management` edits of type
clear_thinking_20251015 (they clear thinking blocks, which a request here never holds).
Other effort levels, other context edits (clear_tool_uses_20250919), image and document blocks
(loom's models read text only), server tools and every other block type are refused by name.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Discriminator, Field, Tag, field_validator, model_validator

from loom.server.protocol import Count, NonEmptyStr, PositiveCount, ToolName, _Request, _Response, _unset, only_type

# The least thinking budget Anthropic's API accepts.
MIN_THINKING_BUDGET = 1024
BLOCK_TYPES = ("text", "tool_use", "tool_result")
StopReason = Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]

# -- request -------------------------------------------------------------------------------------


class CacheControl(_Request):
    """A prompt-caching breakpoint: accepted and ignored (loom caches every prompt's prefix),
    with its lifetime (`ttl`) and sharing (`scope`) hints."""

    type: Literal["ephemeral"]
    ttl: Literal["5m", "1h"] | None = None
    scope: Literal["global"] | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: Annotated[str, Field(min_length=1, description="Not empty (as Anthropic's API requires).")]
    cache_control: CacheControl | None = None


class ToolUseBlock(_Request):
    """A call the model made (an earlier answer's block, sent back in an assistant message)."""

    type: Literal["tool_use"]
    id: NonEmptyStr
    name: NonEmptyStr
    input: dict[str, Any]
    cache_control: CacheControl | None = None


def _text_blocks_only(value: Any, where: str) -> Any:
    """Refuses, by its type, a block this server cannot read."""
    if isinstance(value, list):
        for i, block in enumerate(value):
            kind = block.get("type") if isinstance(block, dict) else None
            if isinstance(kind, str) and kind != "text":
                raise ValueError(f"{where} block {i} is of type {kind!r}, which this server does not take: "
                                 "its model reads text only (text blocks)")
    return value


class ToolResultBlock(_Request):
    """The result of a call, for the model to read; `is_error` true puts "Error: " before it."""

    type: Literal["tool_result"]
    tool_use_id: NonEmptyStr
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _text_content(cls, v: Any) -> Any:
        return _text_blocks_only(v, "tool_result content")

    @property
    def text(self) -> str:
        if self.content is None or isinstance(self.content, str):
            body = self.content or ""
        else:
            body = "\n".join(b.text for b in self.content)
        return f"Error: {body}" if self.is_error else body


def _block_type(block: Any) -> str | None:
    kind = block.get("type") if isinstance(block, dict) else getattr(block, "type", None)
    return f"{kind} block" if kind in BLOCK_TYPES else None


# a block's type chooses its model, so an error names that model's field (the tags, not being
# field names, stay out of an error's param)
ContentBlock = Annotated[Annotated[TextBlock, Tag("text block")] | Annotated[ToolUseBlock, Tag("tool_use block")]
                         | Annotated[ToolResultBlock, Tag("tool_result block")], Discriminator(_block_type)]


class MessageParam(_Request):
    """A turn: the user's (text, tool results), the assistant's (text, tool calls), or a system
    message among them (text only), which the chat template renders where it stands."""

    role: Literal["user", "assistant", "system"]
    content: str | Annotated[list[ContentBlock], Field(min_length=1)]

    @field_validator("content", mode="before")
    @classmethod
    def _known_blocks(cls, v: Any) -> Any:
        if isinstance(v, list):
            for i, block in enumerate(v):
                kind = block.get("type") if isinstance(block, dict) else None
                if isinstance(kind, str) and kind not in BLOCK_TYPES:
                    raise ValueError(f"content block {i} is of type {kind!r}, which this server does not take: "
                                     f"its model reads text only ({', '.join(BLOCK_TYPES)} blocks)")
        return v

    @model_validator(mode="after")
    def _blocks_fit_the_role(self) -> MessageParam:
        wrong = {"assistant": ("tool_result",), "user": ("tool_use",), "system": ("tool_use", "tool_result")}
        for block in [] if isinstance(self.content, str) else self.content:
            if block.type in wrong[self.role]:
                raise ValueError(f"{block.type} blocks cannot be in {self.role} messages")
        return self


class CustomTool(_Request):
    """A custom tool: the model calls it with an `input` that follows `input_schema`."""

    type: Literal["custom"] | None = None
    name: ToolName
    description: str | None = None
    input_schema: dict[str, Any] = Field(description="A JSON Schema of the input object.")
    strict: bool | None = Field(None, description="Accepted: forced calls (tool_choice any or tool) always follow "
                                                  "input_schema.")
    cache_control: CacheControl | None = None

    @field_validator("input_schema")
    @classmethod
    def _an_object(cls, v: dict[str, Any]) -> dict[str, Any]:
        if v.get("type") != "object":
            raise ValueError(f"input_schema must be a JSON Schema of an object (type 'object'), got type "
                             f"{v.get('type')!r}")
        return v

    @model_validator(mode="before")
    @classmethod
    def _custom_tools_only(cls, data: Any) -> Any:
        return only_type(data, "custom", "tool type {kind} is not available on this server: only custom tools "
                         "(name, description, input_schema)")


class ToolChoice(_Request):
    """auto (the model decides), any (some tool must be called), tool (the tool `name`), none."""

    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool | None = Field(None, description="true: at most one call (exactly one "
                                                                     "with any and tool).")

    @model_validator(mode="after")
    def _name_with_tool(self) -> ToolChoice:
        if (self.type == "tool") != (self.name is not None):
            raise ValueError("tool_choice of type 'tool' needs a name, and only that type takes one")
        if self.type == "none" and self.disable_parallel_tool_use is not None:
            raise ValueError("tool_choice of type 'none' takes no disable_parallel_tool_use")
        return self


class ThinkingEnabled(_Request):
    type: Literal["enabled"]
    budget_tokens: Annotated[int, Field(ge=MIN_THINKING_BUDGET)] = Field(
        description="Checked as Anthropic checks it (at least 1024, below max_tokens): a cap on thinking "
                    "tokens, which these models write none of (any thinking would count against max_tokens).")


class ThinkingAdaptive(_Request):
    """The model decides whether to think: the template's enable_thinking true, as with enabled."""

    type: Literal["adaptive"]


class ThinkingDisabled(_Request):
    type: Literal["disabled"]


Thinking = Annotated[ThinkingEnabled | ThinkingAdaptive | ThinkingDisabled, Field(discriminator="type")]


class ThinkingTurns(_Request):
    type: Literal["thinking_turns"]
    value: PositiveCount


class ClearThinkingEdit(_Request):
    """Clears thinking blocks of earlier turns but the last `keep`: a request here never holds
    thinking blocks (loom answers with text and tool_use blocks, and refuses thinking blocks), so
    the edit leaves its messages as they are."""

    type: Literal["clear_thinking_20251015"]
    keep: Literal["all"] | ThinkingTurns | None = None

    @model_validator(mode="before")
    @classmethod
    def _known_edits(cls, data: Any) -> Any:
        return only_type(data, "clear_thinking_20251015", "context edit type {kind} is not available on this "
                         "server: only clear_thinking_20251015")


class ContextManagement(_Request):
    edits: list[ClearThinkingEdit] | None = None


class OutputFormat(_Request):
    """The answer's text is JSON that follows `schema` (the chat request's json_schema response_format)."""

    type: Literal["json_schema"]
    schema_: dict[str, Any] = Field(alias="schema", description="A JSON Schema of the answer.")


class OutputConfig(_Request):
    effort: str | None = Field(None, description="'high' only: Anthropic's default, which leaves the request as "
                                                 "it is (loom's models have no effort setting).")
    format: OutputFormat | None = None

    @field_validator("effort")
    @classmethod
    def _default_effort(cls, v: str | None) -> str | None:
        if v is not None and v != "high":
            raise ValueError(f"effort {v!r} is not available on this server: its models have no effort setting, so "
                             "it takes only 'high' (the default, the same as leaving effort out)")
        return v


class MessageMetadata(_Request):
    user_id: Annotated[str, Field(max_length=256)] | None = Field(None, description="Accepted and ignored.")


class PromptFields(_Request):
    """What renders the prompt: shared by messages and count_tokens."""

    model: str = Field(description="The served model name.")
    messages: Annotated[list[MessageParam], Field(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[CustomTool], Field(max_length=128)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = Field(None, description="The chat template's enable_thinking (true or false).")
    context_management: ContextManagement | None = Field(None, description="clear_thinking_20251015 edits only, "
                                                                           "which change nothing here.")
    output_config: OutputConfig | None = None
    cache_control: CacheControl | None = Field(None, description="Accepted and ignored (loom's prefix cache is "
                                                                 "automatic).")

    @field_validator("system", mode="before")
    @classmethod
    def _text_system(cls, v: Any) -> Any:
        return _text_blocks_only(v, "system")

    @field_validator("tools")
    @classmethod
    def _unique_names(cls, v: list[CustomTool] | None) -> list[CustomTool] | None:
        names = [t.name for t in v or []]
        if twice := sorted({n for n in names if names.count(n) > 1}):
            raise ValueError(f"tool names must be unique: {', '.join(map(repr, twice))} given more than once")
        return v

    @property
    def system_text(self) -> str | None:
        if self.system is None or isinstance(self.system, str):
            return self.system or None
        return "\n".join(b.text for b in self.system) or None


class MessagesRequest(PromptFields):
    max_tokens: PositiveCount = Field(description="Tokens to generate at most.")
    stop_sequences: Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    temperature: float | None = Field(None, ge=0, le=1, description="0 decodes greedily; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: Count | None = Field(None, description="Keep the k most probable tokens; 0 keeps all.")
    stream: bool = False
    metadata: MessageMetadata | None = None
    service_tier: Literal["auto", "standard_only"] | None = Field(None, description="Accepted and ignored.")

    @model_validator(mode="after")
    def _budget_below_max_tokens(self) -> MessagesRequest:
        if isinstance(self.thinking, ThinkingEnabled) and self.thinking.budget_tokens >= self.max_tokens:
            raise ValueError(f"thinking.budget_tokens ({self.thinking.budget_tokens}) must be less than "
                             f"max_tokens ({self.max_tokens})")
        return self


class CountTokensRequest(PromptFields):
    """The prompt a messages request with these fields gets, counted."""


# -- response ------------------------------------------------------------------------------------


class TextOut(_Response):
    type: Literal["text"] = "text"
    text: str


class ToolUseOut(_Response):
    type: Literal["tool_use"] = "tool_use"
    id: str
    name: str
    input: dict[str, Any]


ContentOut = Annotated[TextOut | ToolUseOut, Field(discriminator="type")]


class MessageUsage(_Response):
    """Anthropic's usage: `input_tokens` are the prompt tokens computed, `cache_read_input_tokens`
    those read from the prefix cache (the prompt is their sum)."""

    input_tokens: int
    output_tokens: int
    cache_read_input_tokens: int | None = Field(None, exclude_if=_unset)


class MessageObject(_Response):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[ContentOut]
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None
    usage: MessageUsage


class CountTokensResponse(_Response):
    input_tokens: int


class ErrorDetail(_Response):
    type: str
    message: str


class AnthropicError(_Response):
    """The body of every error answer of these routes, and a stream's `error` event."""

    type: Literal["error"] = "error"
    error: ErrorDetail


class StreamDelta(_Response):
    type: Literal["text_delta", "input_json_delta"] | None = None
    text: str | None = None
    partial_json: str | None = None
    stop_reason: StopReason | None = None
    stop_sequence: str | None = None


class DeltaUsage(_Response):
    output_tokens: int
    input_tokens: int | None = None
    cache_read_input_tokens: int | None = None


class MessageStreamEvent(_Response):
    """One event of a streamed message (its ``event:`` line names the same type), sent with the
    fields its type has (dumped with exclude_unset)."""

    type: Literal["message_start", "content_block_start", "content_block_delta", "content_block_stop",
                  "message_delta", "message_stop", "ping"]
    message: MessageObject | None = None
    index: int | None = None
    content_block: ContentOut | None = None
    delta: StreamDelta | None = None
    usage: DeltaUsage | None = None
