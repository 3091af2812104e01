"""Request and response bodies of the OpenAI-compatible API, as pydantic models.

Requests are validated strictly: a JSON value of the wrong type (``"16"`` for an integer,
``1.5`` for an integer, ``1`` for a boolean) is a 400, never silently converted; only an
integral float (``2.0``) counts as an integer, as in JSON Schema. Ranges
declared here appear in ``/openapi.json``; `SamplingParams` validates the same values
again when the request is turned into sampling parameters.

A field loom does not implement is a 400 naming it, never silently dropped (a client must not
believe an option was honoured when it was not). The fields of `IGNORED_FIELDS` are accepted
and ignored: they cannot change what is generated. Fields marked "extension" are vLLM / loom
additions.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union, get_args

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, NonNegativeInt, field_validator, model_validator

from loom.sampling_params import MAX_LOGIT_BIAS, MAX_LOGPROBS

# The most completions one request may ask for with `n`, and the most prompts in one batch.
MAX_N = 16
MAX_PROMPTS = 64
# The range of seeds `SamplingParams` accepts.
SEED_MIN, SEED_MAX = -(2**63), 2**64 - 1


def _integral(value: object) -> object:
    """JSON Schema counts 2.0 as an integer, so an integral float is accepted as the int it is."""
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return value


# Integer fields: an integer, or a float with no fractional part (never a string or bool).
# The bounds sit inside the Annotated so the JSON schema states them as minimum / maximum.
TokenId = Annotated[int, Field(ge=0, le=2**63 - 1), BeforeValidator(_integral)]
# bad words a request may name: each is matched against every row's output at every step
MAX_BAD_WORDS = 256
Count = Annotated[int, Field(ge=0), BeforeValidator(_integral)]
PositiveCount = Annotated[int, Field(ge=1), BeforeValidator(_integral)]
ChoiceCount = Annotated[int, Field(ge=1, le=MAX_N), BeforeValidator(_integral)]
LogprobCount = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]
TopK = Annotated[int, Field(ge=-1), BeforeValidator(_integral)]
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX), BeforeValidator(_integral)]
Priority = Annotated[int, Field(ge=-(2**31), le=2**31 - 1), BeforeValidator(_integral)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
FinishReason = Literal["stop", "length", "abort", "tool_calls"]


# Accepted and ignored: bookkeeping fields of the OpenAI API that cannot change the output.
IGNORED_FIELDS = ("user", "metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier")
# vLLM's and llama-server's fields completions and chat take at the values that change nothing.
NO_OP_FIELDS = ("cache_prompt", "spaces_between_special_tokens", "use_beam_search: false")


class _Request(BaseModel):
    model_config = ConfigDict(strict=True, extra="forbid")

    @model_validator(mode="before")
    @classmethod
    def _null_is_omitted(cls, data: Any) -> Any:
        """An explicit null asks for nothing: an optional field that does not take null gets its
        default, and an unknown field sent as null is dropped rather than refused. The OpenAI
        client sends null for an argument given as None (`n=None`, `stream=None`), and vLLM
        reads it as omitted."""
        if isinstance(data, dict) and any(v is None for v in data.values()):
            keep = _null_keys(cls)
            return {k: v for k, v in data.items() if v is not None or k in keep}
        return data


_NULL_KEYS: dict[type, frozenset[str]] = {}


def _null_keys(cls: type[BaseModel]) -> frozenset[str]:
    """The keys of `cls` whose null is validated as given: fields that take null, and required
    fields (whose null is an error naming them)."""
    keys = _NULL_KEYS.get(cls)
    if keys is None:
        keys = frozenset(info.alias or name for name, info in cls.model_fields.items()
                         if info.is_required() or _takes_null(info.annotation))
        _NULL_KEYS[cls] = keys
    return keys


def _takes_null(annotation: Any) -> bool:
    return annotation is None or annotation is type(None) or type(None) in get_args(annotation)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _unset(value: object) -> bool:
    return value is None


# -- errors ------------------------------------------------------------------------------------


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    """The body of every 4xx/5xx answer: ``{"error": {message, type, param, code}}``."""

    error: ErrorInfo


# -- shared request fields -----------------------------------------------------------------------


class PredictionPart(_Request):
    type: Literal["text"]
    text: str


class Prediction(_Request):
    """OpenAI's predicted output: text the answer will mostly repeat."""

    type: Literal["content"]
    content: Annotated[str, Field(min_length=1)] | Annotated[list[PredictionPart], Field(min_length=1)]

    @property
    def text(self) -> str:
        return self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)


class StreamOptions(_Request):
    include_usage: bool = False
    # vLLM's extension: with include_usage, every chunk also carries its choice's usage so far
    continuous_usage_stats: bool = False


class LoomEarlyStop(_Request):
    """Extension: end a request's choices early; the unfinished ones are aborted."""

    policy: Literal["first_finish", "short_m_at_k"]
    m: PositiveCount | None = Field(None, description="short_m_at_k: stop once this many choices finished "
                                                      "(default 3).")


class LoomOptions(_Request):
    """Extension object ``"loom"``: test-time scaling over the request's n choices."""

    aggregate: Literal["best_of", "majority", "weighted_majority", "first_finish", "short_m_at_k"] | None = Field(
        None, description="Merge each prompt's n choices into one answer, returned as its single choice.")
    extract: Literal["regex", "gsm8k", "last_number", "choice"] | None = Field(
        None, description="How voting aggregators read an answer from a choice's text (default last_number).")
    pattern: str | None = Field(None, description="The regex of extract=regex (its group 1, or the match).")
    score: Literal["mean", "total"] | None = Field(None, description="best_of: rank by mean or total logprob.")
    prune_ratio: float | None = Field(None, ge=0, le=1, description="weighted_majority: drop paths weighing "
                                                                    "less than this share of the best.")
    early_stop: LoomEarlyStop | None = None
    return_children: bool = Field(False, description="With aggregate: also return every choice.")


class JsonSchemaFormat(_Request):
    name: Annotated[str, Field(min_length=1, max_length=64)] = "response"
    description: str | None = None
    schema_: dict | None = Field(None, alias="schema", description="The JSON Schema; omitted means any JSON object.")
    strict: bool | None = Field(None, description="Accepted: loom always constrains the output to the schema.")


class ResponseFormat(_Request):
    """`text` (no constraint), `json_object` (any JSON object), `json_schema`, or vLLM's
    `structural_tag` (an xgrammar structural tag: its `format`, or the older `structures` and
    `triggers`)."""

    type: Literal["text", "json_object", "json_schema", "structural_tag"]
    json_schema: JsonSchemaFormat | None = None
    format: dict | None = Field(None, description="structural_tag: the tag's format (xgrammar's structural tag).")
    structures: list[dict] | None = Field(None, description="structural_tag, older form: {begin, schema, end} items.")
    triggers: list[str] | None = Field(None, description="structural_tag, older form: texts that open a structure.")


class StructuredOutputsRequest(_Request):
    """Extension (vLLM's `structured_outputs`): exactly one constraint on the output."""

    json_: dict | str | None = Field(None, alias="json", description="A JSON Schema.")
    regex: NonEmptyStr | None = None
    choice: Annotated[list[NonEmptyStr], Field(min_length=1)] | None = None
    grammar: NonEmptyStr | None = Field(None, description="An EBNF (GBNF) grammar; `root` is the start rule.")
    json_object: bool | None = None
    structural_tag: dict | str | None = Field(None, description="An xgrammar structural tag.")


class KVEvictionRequest(_Request):
    """Extension: evict this request's KV entries under a token budget (loom's `kv_eviction`)."""

    policy: Literal["streaming", "snapkv", "none"] = Field(description="streaming: attention sinks + a recent "
                                                           "window (may run past the context); snapkv: keep "
                                                           "the prompt tokens the last ones attend to; none: "
                                                           "opt out of the server's default.")
    budget: PositiveCount | None = Field(None, description="Most tokens of the sequence kept in the KV cache.")
    sinks: Count | None = Field(None, description="First tokens always kept (default 4).")
    window: PositiveCount | None = Field(None, description="Recent tokens always kept (snapkv: the observation "
                                                           "window, default 32).")
    pool: PositiveCount | None = Field(None, description="snapkv: width of the score pooling (odd, default 7).")


# vLLM's older names of structured_outputs' kinds (its guided decoding fields), read as them
GUIDED_FIELDS = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


class SamplingFields(_Request):
    """Fields shared by completions and chat completions."""

    @model_validator(mode="before")
    @classmethod
    def _guided_is_structured_outputs(cls, data: Any) -> Any:
        """vLLM's `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` (and
        `guided_decoding_backend` "auto" or "xgrammar", which compiles them here) are its
        `structured_outputs` under their older names."""
        if not isinstance(data, dict) or not any(k in data for k in (*GUIDED_FIELDS, "guided_decoding_backend")):
            return data
        data = dict(data)
        backend = data.pop("guided_decoding_backend", None)
        if backend not in (None, "auto", "xgrammar"):
            raise ValueError(f"guided_decoding_backend {backend!r}: loom compiles constraints with xgrammar "
                             f"(give 'auto', 'xgrammar' or nothing)")
        guided = {kind: data.pop(name) for name, kind in GUIDED_FIELDS.items() if data.get(name) is not None}
        for name in GUIDED_FIELDS:
            data.pop(name, None)   # null: nothing asked
        if len(guided) > 1 or (guided and data.get("structured_outputs") is not None):
            raise ValueError("give one of structured_outputs and the guided_* fields (vLLM's older names of "
                             "its kinds), not several")
        if guided:
            data["structured_outputs"] = guided
        return data

    model: str | None = Field(None, description="The served model name; omitted means the served model.")
    temperature: float | None = Field(None, ge=0, le=2, description="0 decodes greedily; default 1.")
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: TopK | None = Field(None, description="Extension: keep the k most probable tokens; 0 or -1 keeps all.")
    min_p: float | None = Field(None, ge=0, le=1, description="Extension.")
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, description="Extension: 1 disables.")
    seed: Seed | None = None
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=16)] | None = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=16)] | None = Field(None, description="Extension.")
    n: ChoiceCount = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = Field(None, description="Accepted and ignored.")
    metadata: dict[str, str] | None = Field(None, description="Accepted and ignored.")
    store: bool | None = Field(None, description="Accepted and ignored (loom stores nothing).")
    service_tier: str | None = Field(None, description="Accepted and ignored.")
    prompt_cache_key: str | None = Field(None, description="Accepted and ignored (loom's prefix cache is automatic).")
    safety_identifier: str | None = Field(None, description="Accepted and ignored.")
    cache_prompt: bool | None = Field(None, description="llama-server's; accepted and ignored (loom's prefix "
                                                        "cache is automatic).")
    request_id: Annotated[str, Field(min_length=1, max_length=128)] | None = Field(
        None, description="Extension (vLLM): the answer's id is cmpl-<request_id> / chatcmpl-<request_id> (an "
                          "X-Request-Id header takes precedence, as in vLLM).")
    cache_salt: NonEmptyStr | None = Field(None, description="Extension (vLLM): mixed into the prefix cache's "
                                                              "hashes; requests share cached KV only with the same salt.")
    use_beam_search: Literal[False] | None = Field(None, description="Extension (vLLM): false only; beam search "
                                                                     "is offline (LLM.beam_search).")
    spaces_between_special_tokens: bool | None = Field(
        None, description="Extension (vLLM): accepted; loom's byte-level detokenizer writes special tokens as "
                          "they are, as vLLM's fast tokenizers do either way.")
    response_format: ResponseFormat | None = Field(None, description="json_object or json_schema constrain the "
                                                                    "output to JSON.")
    structured_outputs: StructuredOutputsRequest | None = Field(None, description="Extension: json, regex, "
                                                                "choice, grammar, json_object or structural_tag.")
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_LOGIT_BIAS, le=MAX_LOGIT_BIAS)]] | None = Field(
        None, description="Token id (as a string) -> bias in [-100, 100] added to its logit before sampling; "
                          "the returned logprobs stay the model's own.")
    allowed_token_ids: Annotated[list[TokenId], Field(min_length=1)] | None = Field(
        None, description="Extension (vLLM): only these token ids may be sampled.")
    bad_words: Annotated[list[NonEmptyStr], Field(max_length=MAX_BAD_WORDS)] | None = Field(
        None, description="Extension (vLLM): words never generated (alone or after a space); each is checked "
                          "at every step, so a request names at most 256.")
    prediction: Prediction | None = Field(None, description="Text the output will mostly repeat (code to edit): "
                                                           "drafted from where the server runs speculative "
                                                           "decoding; the output is the same without it.")
    truncate_prompt_tokens: Annotated[int, Field(ge=-1), BeforeValidator(_integral)] | None = Field(
        None, description="Extension (vLLM): keep only the prompt's last k tokens; -1: as many as the context "
                          "holds.")
    return_tokens_as_token_ids: bool = Field(False, description="Extension (vLLM): logprobs name each token "
                                                                 "'token_id:<id>' instead of its text.")
    return_token_ids: bool = Field(False, description="Extension (vLLM): the answer carries `prompt_token_ids` and "
                                                      "each choice its `token_ids` (streamed: the prompt's in the "
                                                      "first chunk, each chunk's new tokens).")
    priority: Priority = Field(0, description="Extension: lower values are scheduled first.")
    ignore_eos: bool = Field(False, description="Extension: keep generating past end-of-sequence.")
    min_tokens: Count = Field(0, description="Extension: no stop before this many tokens.")
    include_stop_str_in_output: bool = Field(False, description="Extension.")
    skip_special_tokens: bool = Field(True, description="Extension.")
    loom: LoomOptions | None = Field(None, description="Extension: aggregation and early stopping over n.")
    kv_eviction: KVEvictionRequest | None = Field(None, description="Extension: KV eviction policy and budget "
                                                  "(StreamingLLM or SnapKV); omitted takes the server's default.")


# -- completions -------------------------------------------------------------------------------

# A text prompt may be empty, as OpenAI's and llama-server's: a model that starts with BOS then
# continues from BOS alone (one without: a 400, "prompt is empty").
PromptInput = Union[
    str,
    Annotated[list[str], Field(min_length=1, max_length=MAX_PROMPTS)],
    Annotated[list[TokenId], Field(min_length=1)],
    Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)],
]


class CompletionRequest(SamplingFields):
    prompt: PromptInput = Field(description="A string, a list of strings, a list of token ids, "
                                            "or a list of token-id lists.")
    max_tokens: Count | None = Field(16, description="Tokens to generate per choice; null runs to the context "
                                                    "limit; 0 (with echo) scores the prompt only.")
    logprobs: LogprobCount | None = Field(None, description="Return the chosen token's logprob and this many "
                                                            "alternatives.")
    echo: bool = Field(False, description="Put the prompt in front of the completion text (with logprobs: "
                                          "the prompt tokens' logprobs too, the first one null).")
    prompt_logprobs: LogprobCount | None = Field(None, description="Extension (vLLM): each choice's "
                                                 "`prompt_logprobs`: per prompt token {token id: logprob}.")
    best_of: ChoiceCount | None = Field(None, description="Generate this many choices (>= n) and return the n "
                                                          "with the highest cumulative logprob; not streamed.")
    add_special_tokens: bool = Field(True, description="Extension (vLLM): false tokenizes a text prompt without "
                                                       "the special tokens the model adds (its BOS).")


class CompletionLogprobs(_Response):
    tokens: list[str]
    token_logprobs: list[float | None]
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class PromptLogprob(_Response):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = Field(None, exclude_if=_unset)
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(None, description="Extension: the stop string or token id that ended it.")
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_unset, description="Extension (vLLM): with "
                                                                                  "return_token_ids.")
    token_ids: list[int] | None = Field(None, exclude_if=_unset, description="Extension (vLLM): with return_token_ids.")


class PromptTokensDetails(_Response):
    cached_tokens: int = 0


class CompletionTokensDetails(_Response):
    accepted_prediction_tokens: int = 0   # draft tokens from the prediction the model accepted
    rejected_prediction_tokens: int = 0   # ... and rejected (computed, then discarded)


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = Field(None, exclude_if=_unset)


class LoomChild(_Response):
    index: int
    text: str
    finish_reason: FinishReason | None = None
    cumulative_logprob: float | None = None
    answer: str | None = None


class LoomResult(_Response):
    """What the aggregator chose for one prompt."""

    prompt_index: int
    answer: str | None = Field(description="The chosen answer (extracted), or the chosen choice's text.")
    chosen_index: int | None = Field(description="The child the answer came from; null if none qualified.")
    votes: dict[str, float] = Field(default_factory=dict)
    scores: list[float | None] = Field(default_factory=list)
    children: list[LoomChild] | None = None


class LoomResponse(_Response):
    """Extension (with ``loom.aggregate``): one result per prompt."""

    results: list[LoomResult]


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo
    loom: LoomResponse | None = Field(None, exclude_if=_unset, description="Extension: aggregation results.")


class CompletionStreamResponse(_Response):
    """One ``data:`` event of a streamed completion."""

    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


# -- chat completions --------------------------------------------------------------------------


def only_type(data: Any, allowed: str, refusal: str) -> Any:
    """A model validator's body (mode "before") for a tagged object: one whose ``type`` is a
    string other than `allowed` is refused with `refusal`, formatted with ``{kind}`` (pydantic's
    own message would list the one allowed literal, not why the others are not taken)."""
    kind = data.get("type") if isinstance(data, dict) else None
    if isinstance(kind, str) and kind != allowed:
        raise ValueError(refusal.format(kind=repr(kind)))
    return data


class TextContentPart(_Request):
    type: Literal["text"]
    text: str

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data: Any) -> Any:
        return only_type(data, "text", "content part type {kind} is not supported: this server's model takes "
                         "text only (type 'text')")


class FunctionCallIn(_Request):
    name: NonEmptyStr
    arguments: str = Field(description="The arguments as JSON text.")


class ToolCallIn(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallIn] | None = Field(None, description="An assistant turn's calls, sent back.")
    tool_call_id: str | None = Field(None, description="A tool message: the call it answers.")


ToolName = Annotated[str, Field(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]


class FunctionDef(_Request):
    name: ToolName
    description: str | None = None
    parameters: dict | None = Field(None, description="A JSON Schema of the arguments object.")
    strict: bool | None = Field(None, description="Accepted: forced calls always follow `parameters`.")

    @field_validator("parameters")
    @classmethod
    def _an_object(cls, v: dict | None) -> dict | None:
        if v is not None and v.get("type", "object") != "object":
            raise ValueError(f"parameters must be a JSON Schema of an object (type 'object'), got type {v['type']!r}")
        return v


class Tool(_Request):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Request):
    name: ToolName


class NamedToolChoice(_Request):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(SamplingFields):
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    max_completion_tokens: PositiveCount | None = Field(None, description="Tokens to generate per choice; "
                                                                        "null runs to the context limit.")
    max_tokens: PositiveCount | None = Field(None, deprecated=True, description="Older name of max_completion_tokens.")
    logprobs: bool = False
    top_logprobs: LogprobCount | None = Field(None, description="Needs logprobs: true.")
    add_generation_prompt: bool = Field(True, description="Extension: end the prompt with the assistant header.")
    continue_final_message: bool = Field(False, description="Extension (vLLM): leave the final message open, so "
                                                             "that the model continues it; needs "
                                                             "add_generation_prompt false.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="Extension (vLLM): more variables for "
                                                                          "the chat template (e.g. enable_thinking).")
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = Field(
        None, description="Default: auto with tools. required / a named function force a call (by a grammar).")
    parallel_tool_calls: bool | None = Field(None, description="Default true (with a named tool_choice: false): a "
                                                            "turn may make several calls.")
    modalities: Annotated[list[Literal["text"]], Field(min_length=1)] | None = Field(
        None, description="Output modalities: text only (this server's models answer in text).")


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None
    top_logprobs: list[TopLogprob]


class ChatLogprobs(_Response):
    content: list[ChatTokenLogprob] | None = None


class FunctionCall(_Response):
    name: str
    arguments: str


class ToolCall(_Response):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    tool_calls: list[ToolCall] | None = Field(None, exclude_if=_unset)


class ChatChoice(_Response):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = Field(None, description="Extension: the stop string or token id that ended it.")
    token_ids: list[int] | None = Field(None, exclude_if=_unset, description="Extension (vLLM): with return_token_ids.")


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_unset, description="Extension (vLLM): with "
                                                                                  "return_token_ids.")
    loom: LoomResponse | None = Field(None, exclude_if=_unset, description="Extension: aggregation results.")


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    """What a chunk adds; fields that are null are left out of the event."""

    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = Field(None, exclude_if=_unset, description="Extension (vLLM): the chunk's new "
                                                                           "tokens, with return_token_ids.")


class ChatCompletionChunk(_Response):
    """One ``data:`` event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: UsageInfo | None = None
    prompt_token_ids: list[int] | None = Field(None, exclude_if=_unset, description="Extension (vLLM): the first "
                                                                                  "chunk's, with return_token_ids.")


# -- models, health, stats ------------------------------------------------------------------------


class ModelPermission(_Response):
    """vLLM's permission entry of a model card (what this server lets a client do with it)."""

    id: str
    object: Literal["model_permission"] = "model_permission"
    created: int
    allow_create_engine: bool = False
    allow_sampling: bool = True
    allow_logprobs: bool = True
    allow_search_indices: bool = False
    allow_view: bool = True
    allow_fine_tuning: bool = False
    organization: str = "*"
    group: str | None = None
    is_blocking: bool = False


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "loom"
    root: str | None = Field(None, description="Extension (as vLLM's): the model file or registry name served.")
    parent: str | None = Field(None, description="Extension (as vLLM's): the base model of an adapter; none here.")
    max_model_len: int | None = Field(None, description="Extension (as vLLM's): the context limit in tokens.")
    permission: list[ModelPermission] = Field(default_factory=list, description="Extension (as vLLM's).")


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeRequest(_Request):
    """vLLM's ``POST /tokenize``: a prompt, or a conversation rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)] | None = None
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = Field(
        None, description="messages: the tools a chat request would offer (their prompt is rendered as it is there).")
    add_special_tokens: bool = Field(True, description="prompt: add BOS/EOS as the model's flags say.")
    add_generation_prompt: bool = Field(True, description="messages: end with the assistant's turn opening.")
    continue_final_message: bool = Field(False, description="messages: leave the final message open.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="messages: more chat template variables.")
    return_token_strs: bool = Field(False, description="Also return each token's text.")


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str | None] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[NonNegativeInt]


class DetokenizeResponse(_Response):
    """vLLM's ``prompt``; the same text as ``content``, the field llama-server's clients read
    (both send the same request: only the answer's field tells them apart)."""

    prompt: str
    content: str


class TokenizerInfoResponse(_Response):
    """vLLM's ``GET /tokenizer_info``: what a client needs to tokenize as the server does."""

    tokenizer_class: str
    vocab_size: int
    model_max_length: int
    bos_token: str | None
    eos_token: str | None
    pad_token: str | None
    add_bos_token: bool
    chat_template: str | None


class HealthResponse(_Response):
    status: Literal["ok"] = "ok"


class VersionResponse(_Response):
    version: str


class StatsResponse(_Response):
    """Extension (``GET /v1/loom/stats``): the engine's load at this moment, for dashboards."""

    model: str
    max_model_len: int
    num_requests_running: int
    num_requests_waiting: int
    kv_cache_usage: float = Field(description="Fraction of KV blocks in use, 0..1.")
    num_preemptions: int
    prompt_tokens: int = Field(description="Prompt tokens of the requests that produced a first token, "
                                           "each choice counting its prompt (vllm:prompt_tokens).")
    prompt_tokens_computed: int = Field(description="Prompt tokens computed (prefix-cache hits excluded).")
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
