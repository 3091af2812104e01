"""Request and response bodies of llama-server's native endpoints (`llamacpp.py`), as pydantic
models, with llama.cpp's field names and defaults.

Requests are validated as the OpenAI ones are (protocol.py): strict types, and an unknown field
is a 400 naming it. Some llama.cpp sampling knobs have no sampler in loom; they are declared
here so that a request may send them at the value that turns them off (what llama.cpp's own
clients send by default), and `llamacpp.py` refuses any other value by name. Their companion
settings (`mirostat_tau` without `mirostat`, `dry_base` without `dry_multiplier`, ...) cannot
change the output while their sampler is off, so any value is accepted.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BeforeValidator, Discriminator, Field, Tag, model_validator

from loom.sampling_params import MAX_LOGPROBS
from loom.server.protocol import (ChatMessage, Seed, TokenId, TokenizeRequest, Tool, _integral, _Request,
                                  _Response)

Int = Annotated[int, BeforeValidator(_integral)]
NPredict = Annotated[int, Field(ge=-1), BeforeValidator(_integral)]
NProbs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS), BeforeValidator(_integral)]
# one prompt: text, token ids, or both mixed; a list of lists (or of strings only) is a batch
PromptPart = Annotated[TokenId | str, Field(union_mode="left_to_right")]
Prompt = str | list[PromptPart | list[PromptPart]]

# llama.cpp's sampler names, as `samplers` takes them (in any case): each canonical name, and for
# one with an underscore its kebab-case and undashed forms (top-k, topk), and a few more aliases
_CANONICAL = ("penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc", "temperature",
              "infill", "adaptive_p")
SAMPLER_NAMES = {**{alias: name for name in _CANONICAL
                    for alias in (name, name.replace("_", "-"), name.replace("_", ""))},
                 "typical_p": "typ_p", "typical": "typ_p", "typ": "typ_p", "nucleus": "top_p", "temp": "temperature"}
# llama.cpp's one-letter names, for `samplers` given as a string ("edkypmxt")
SAMPLER_CHARS = {"e": "penalties", "d": "dry", "s": "top_n_sigma", "k": "top_k", "y": "typ_p", "p": "top_p",
                 "m": "min_p", "x": "xtc", "t": "temperature", "i": "infill", "a": "adaptive_p"}
# the order loom's sampler applies the ones it has (loom/sample/sampler.py)
LOOM_CHAIN = ["penalties", "temperature", "top_k", "min_p", "top_p"]
# llama-server's other names of /completion fields: alias -> the field
ALIASES = {"max_tokens": "n_predict", "max_completion_tokens": "n_predict", "logprobs": "n_probs"}


def _sampler_chars(value: Any) -> Any:
    """`samplers` given as llama.cpp's letters: the names they stand for (an unknown letter kept
    as itself, to be refused by name)."""
    return [SAMPLER_CHARS.get(c, c) for c in value] if isinstance(value, str) else value


class LlamaCompletionRequest(_Request):
    """llama-server's ``POST /completion``. Defaults are llama-server's, except `samplers`: the
    chain loom runs (see llamacpp.py for which orders it honours)."""

    @model_validator(mode="before")
    @classmethod
    def _aliases(cls, data: Any) -> Any:
        """llama-server's aliases (max_tokens and max_completion_tokens for n_predict, logprobs for
        n_probs) are read as the field; two names of one field with different values are a 400."""
        if not isinstance(data, dict) or not any(a in data for a in ALIASES):
            return data
        data, given = dict(data), {}
        for name in ("n_predict", "n_probs"):
            if data.get(name) is not None:
                given[name] = name
        for alias, name in ALIASES.items():
            value = data.pop(alias, None)
            if value is None:
                continue
            if data.get(name) is not None and data[name] != value:
                raise ValueError(f"{alias} is llama-server's other name of {name}: {given[name]} gives "
                                 f"{data[name]!r}, {alias} {value!r}; give one")
            data[name], given[name] = value, alias
        return data

    prompt: Prompt = Field(description="Text, token ids, or text and ids mixed (text parts tokenized in place; "
                                       "a BOS only where the first part is text).")
    model: str | None = None
    n_predict: NPredict = Field(-1, description="Tokens to generate; -1 runs to a stop or the context's end, "
                                                "0 only evaluates the prompt.")
    temperature: float = Field(0.8, description="<= 0 decodes greedily.")
    top_k: Int = Field(40, description="<= 0 keeps every token.")
    top_p: float = 0.95
    min_p: float = 0.05
    typical_p: float = Field(1.0, description="1 only: loom has no locally typical sampling.")
    repeat_penalty: float = Field(1.0, description="loom's repetition_penalty: over the prompt and the output.")
    repeat_last_n: Int = Field(-1, ge=-1, description="The penalties' window: -1 (the whole context, loom's), "
                                                       "or 0 (penalties off); others only where no penalty is on.")
    presence_penalty: float = Field(0.0, description="Over the output tokens (OpenAI's).")
    frequency_penalty: float = Field(0.0, description="Over the output tokens (OpenAI's).")
    seed: Seed = Field(-1, description="-1 (or 4294967295): a random seed.")
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = False
    n_probs: NProbs = Field(0, description="Return the top n_probs tokens' logprobs for each generated token.")
    post_sampling_probs: bool = Field(False, description="false only: the returned logprobs are the model's own.")
    stream: bool = False
    cache_prompt: bool = Field(True, description="Accepted: loom always reuses cached prefixes, with the same "
                                                 "output as without them.")
    return_tokens: bool = False
    grammar: str | None = Field(None, description="A GBNF grammar the output follows.")
    json_schema: dict | None = Field(None, description="A JSON Schema the output follows ({} for any JSON value).")
    logit_bias: list[list[Any]] | dict[str, float] | None = Field(
        None, description="[[token id, bias], ...] or {\"token id\": bias}; biases in [-100, 100].")
    samplers: Annotated[list[str], BeforeValidator(_sampler_chars)] = Field(
        default_factory=lambda: list(LOOM_CHAIN),
        description="The samplers on, in order: names, or llama.cpp's letters as one string (\"ekmpt\").")
    response_fields: list[str] = Field(
        default_factory=list, description="Answer with these fields only (the last event, streamed); a/b names b "
                                          "of the object a, moved to the top as \"a/b\"; a path that is not there "
                                          "is left out.")
    n_keep: Int = Field(0, ge=-1, description="Accepted: loom never shifts the context (it stops at its end).")
    # llama.cpp samplers loom does not have: their off values only (checked in llamacpp.py)
    dynatemp_range: float = 0.0
    mirostat: Int = 0
    dry_multiplier: float = 0.0
    xtc_probability: float = 0.0
    top_n_sigma: float = -1.0
    adaptive_target: float = Field(-1.0, description="Negative only: loom has no adaptive-p sampling.")
    min_keep: Int = 0
    n_indent: Int = 0
    t_max_predict_ms: Int = 0
    id_slot: Int = -1
    timings_per_token: bool = False
    return_progress: bool = False
    lora: list[dict[str, Any]] = Field(default_factory=list)
    # settings of those samplers: no effect while they are off
    dynatemp_exponent: float = 1.0
    mirostat_tau: float = 5.0
    mirostat_eta: float = 0.1
    dry_base: float = 1.75
    dry_allowed_length: Int = 2
    dry_penalty_last_n: Int = -1
    dry_sequence_breakers: list[str] = Field(default_factory=lambda: ["\n", ":", "\"", "*"])
    xtc_threshold: float = 0.1
    adaptive_decay: float = 0.9


# What generation_settings echoes: the request's settings, less the prompt and the per-call fields.
NOT_SETTINGS = frozenset({"prompt", "model", "json_schema", "logit_bias", "return_tokens", "cache_prompt", "lora",
                          "id_slot", "return_progress", "response_fields"})


def generation_settings(body: LlamaCompletionRequest) -> dict[str, Any]:
    """The request's settings as llama-server echoes them (no grammar: "")."""
    settings = body.model_dump(exclude=NOT_SETTINGS)
    settings["grammar"] = settings["grammar"] or ""
    return settings


class TokenProb(_Response):
    id: int
    token: str
    logprob: float
    bytes: list[int]


class TokenProbs(_Response):
    """One generated token of `completion_probabilities`: it, and the n_probs most probable."""

    id: int
    token: str
    logprob: float
    bytes: list[int]
    top_logprobs: list[TokenProb]


class Timings(_Response):
    cache_n: int = Field(description="Prompt tokens served from the prefix cache.")
    prompt_n: int = Field(description="Prompt tokens computed.")
    prompt_ms: float
    prompt_per_token_ms: float
    prompt_per_second: float
    predicted_n: int
    predicted_ms: float
    predicted_per_token_ms: float
    predicted_per_second: float


class LlamaCompletionResponse(_Response):
    """The answer of ``/completion``; streamed, every event but the last has only index,
    content, tokens, stop (false), tokens_predicted, tokens_evaluated (and
    completion_probabilities with n_probs)."""

    index: int = 0
    content: str
    tokens: list[int]
    stop: bool
    model: str | None = None
    tokens_predicted: int
    tokens_evaluated: int
    generation_settings: dict[str, Any] | None = None
    prompt: str | None = None
    has_new_line: bool | None = None
    truncated: bool | None = None
    stop_type: str | None = Field(None, description="eos, limit (n_predict or the context's end), word, or none.")
    stopping_word: str | None = None
    tokens_cached: int | None = Field(None, description="Prompt tokens read from the prefix cache (timings' "
                                                        "cache_n), as llama.cpp's README defines it.")
    timings: Timings | None = None
    completion_probabilities: list[TokenProbs] | None = None


class DefaultSettings(_Response):
    n_ctx: int = Field(description="The context's length in tokens.")
    params: dict[str, Any] = Field(description="A /completion request's settings when it gives none.")


class PropsResponse(_Response):
    """``GET /props``."""

    default_generation_settings: DefaultSettings
    total_slots: int = Field(description="Sequences the engine runs at once (--max-num-seqs).")
    model_path: str
    model_alias: str
    chat_template: str
    modalities: dict[str, bool] = Field(description="vision, video, audio: false (loom's models read text).")
    bos_token: str = Field(description="The BOS token's text (\"\" where the model has none).")
    eos_token: str = Field(description="The EOS token's text (\"\" where the model has none).")
    build_info: str
    is_sleeping: bool = False


class LlamaTokenizeRequest(_Request):
    """llama-server's ``POST /tokenize`` (told from vLLM's by its `content`)."""

    content: str
    add_special: bool = Field(False, description="Add the model's BOS (as it adds it).")
    parse_special: bool = Field(True, description="false only: special tokens in the text are read as special.")
    with_pieces: bool = Field(False, description="Return {id, piece} per token.")


class TokenPiece(_Response):
    id: int
    piece: str | list[int] = Field(description="The token's text, or its bytes where they are not UTF-8.")


class LlamaTokenizeResponse(_Response):
    tokens: list[int] | list[TokenPiece]


def _tokenize_shape(data: Any) -> str | None:
    """llama.cpp's /tokenize request has `content`; vLLM's has `prompt` or `messages`."""
    if not isinstance(data, dict):
        return None
    return "llama.cpp" if "content" in data else "vLLM"


# /tokenize's body: vLLM's or llama-server's, told apart by their fields (the tags are not field
# names, so validation errors name the field alone)
TokenizeBody = Annotated[Annotated[TokenizeRequest, Tag("vLLM")] | Annotated[LlamaTokenizeRequest, Tag("llama.cpp")],
                         Discriminator(_tokenize_shape)]


class ApplyTemplateRequest(_Request):
    """llama-server's ``POST /apply-template``: a chat request's messages (and tools), rendered by
    the chat template as a chat completion renders them, not run."""

    model: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1)]
    tools: Annotated[list[Tool], Field(min_length=1, max_length=128)] | None = None
    add_generation_prompt: bool = Field(True, description="End with the assistant's turn opening.")
    continue_final_message: bool = Field(False, description="Leave the final message open.")
    chat_template_kwargs: dict[str, Any] | None = Field(None, description="More chat template variables.")


class ApplyTemplateResponse(_Response):
    prompt: str = Field(description="The rendered prompt's text (for POST /completion).")
