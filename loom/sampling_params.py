"""Per-request sampling parameters, with vLLM's field names, defaults and meaning.

`SamplingParams` is validated on construction: every out-of-range value raises
`InvalidRequestError` with a message naming the field, the value given and the range
allowed, so the server can hand it back to the client as a 400.

After construction the fields are normalised:

* `stop`, `stop_token_ids`, `allowed_token_ids` and `bad_words` are tuples (`stop` and
  `stop_token_ids` empty when not given), `logit_bias` a dict of int ids to floats;
* integral floats are stored as `float`, so `temperature=1` reads back as `1.0`.

The dataclass is not frozen, but assigning to a field bypasses validation; derive a
changed copy with `clone(field=value)`, which validates again.
"""

from __future__ import annotations

import dataclasses
import enum
import json as _json
import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from loom.errors import InvalidRequestError
from loom.eviction_params import KVEvictionParams

# A temperature below this is treated as 0: the request decodes greedily.
GREEDY_TEMPERATURE_EPS = 1e-5
# The most top alternatives a request may ask logprobs for.
MAX_LOGPROBS = 20
# A top_k past every vocabulary's size keeps every token; larger ones are read as this one.
TOP_K_ALL = 2**31 - 1
# The range of a logit bias (OpenAI's).
MAX_LOGIT_BIAS = 100.0
# The range `torch.Generator.manual_seed` accepts.
_SEED_MIN, _SEED_MAX = -(2**63), 2**64 - 1


class SamplingType(enum.Enum):
    """How a request's next token is chosen."""

    GREEDY = "greedy"            # argmax of the (penalised) logits
    RANDOM = "random"            # drawn from the shared generator
    RANDOM_SEED = "random_seed"  # drawn from the request's own seeded generator


def _fail(name: str, value: Any, allowed: str) -> InvalidRequestError:
    return InvalidRequestError(f"{name} must be {allowed}, got {value!r}")


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _real(name: str, value: Any, allowed: str) -> float:
    """`value` as a finite float; anything else is a request error naming `name`."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise _fail(name, value, allowed)
    return float(value)


def _int(name: str, value: Any, allowed: str) -> int:
    if not _is_int(value):
        raise _fail(name, value, allowed)
    return value


def _flag(name: str, value: Any) -> bool:
    """A boolean; numpy's boolean scalar (what a comparison of numpy values gives) taken as one."""
    if getattr(getattr(value, "dtype", None), "kind", None) == "b" and getattr(value, "ndim", None) == 0:
        return bool(value)
    if not isinstance(value, bool):
        raise _fail(name, value, "a boolean")
    return value


class RequestOutputKind(enum.Enum):
    """What a request's stream of outputs carries (vLLM's): every output the whole text so far
    (CUMULATIVE), only what each step added (DELTA), or only the finished request (FINAL_ONLY).
    `AsyncEngine.generate` and `loom serve`'s engine clients honour it; `LLM.generate` returns
    finished requests whatever it is."""

    CUMULATIVE = 0
    DELTA = 1
    FINAL_ONLY = 2


@dataclass(frozen=True)
class StructuredOutputsParams:
    """A constraint on the output (vLLM's shape): exactly one of

    json: a JSON Schema (a dict or its JSON text): the output is one JSON value it validates;
    regex: the output matches this regular expression;
    choice: the output is one of these strings;
    grammar: an EBNF grammar (GBNF, as llama.cpp writes it; `root` is the start rule);
    json_object: True: the output is any JSON object;
    structural_tag: an xgrammar structural tag (a dict or its JSON text): free text with
        constrained regions between begin/end tags.

    The constraint is compiled when the request is added (an error names the field and the
    compiler's message) and applied as a token mask at every sampling step. `source`: the field
    an error names (default ``structured_outputs.<kind>``), where the constraint came from
    another field of a request (the server's `response_format`, a forced tool call's `tools`).
    """

    json: str | dict | None = None
    regex: str | None = None
    choice: Sequence[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | dict | None = None
    source: str | None = dataclasses.field(default=None, compare=False)

    KINDS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")

    def __post_init__(self) -> None:
        given = [k for k in self.KINDS if getattr(self, k) not in (None, False)]
        if len(given) != 1:
            raise _fail("structured_outputs", {k: getattr(self, k) for k in given},
                        f"exactly one of {', '.join(self.KINDS)}")
        if self.json is not None and not isinstance(self.json, (str, dict)):
            raise _fail("structured_outputs.json", self.json, "a JSON Schema (an object or its JSON text)")
        if self.structural_tag is not None and not isinstance(self.structural_tag, (str, dict)):
            raise _fail("structured_outputs.structural_tag", self.structural_tag, "an object or its JSON text")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise _fail(f"structured_outputs.{name}", value, "a non-empty string")
        if self.choice is not None:
            if (not isinstance(self.choice, (list, tuple)) or not self.choice
                    or not all(isinstance(c, str) and c for c in self.choice)):
                raise _fail("structured_outputs.choice", self.choice, "a non-empty list of non-empty strings")
            object.__setattr__(self, "choice", tuple(self.choice))
        if self.json_object is not None:
            _flag("structured_outputs.json_object", self.json_object)

    @property
    def kind(self) -> str:
        return next(k for k in self.KINDS if getattr(self, k) not in (None, False))

    @property
    def field_name(self) -> str:
        """The request field an error about this constraint names."""
        return self.source or f"structured_outputs.{self.kind}"

    def key(self) -> tuple[str, str]:
        """(kind, canonical text): equal constraints share one compiled grammar."""
        value = getattr(self, self.kind)
        if isinstance(value, dict):
            value = _json.dumps(value, sort_keys=True)
        elif isinstance(value, tuple):
            value = _json.dumps(list(value))
        return self.kind, str(value)

    @classmethod
    def create(cls, value: "StructuredOutputsParams | dict | None") -> "StructuredOutputsParams | None":
        if value is None or isinstance(value, cls):
            return value
        if not isinstance(value, dict):
            raise _fail("structured_outputs", value, "a StructuredOutputsParams or a dict")
        unknown = sorted(set(value) - set(cls.KINDS))
        if unknown:
            raise InvalidRequestError(f"unknown structured_outputs key(s) {', '.join(map(repr, unknown))} "
                                      f"(known: {', '.join(cls.KINDS)})")
        return cls(**value)


# vLLM's earlier name of the class (its `guided_decoding` field took one)
GuidedDecodingParams = StructuredOutputsParams


@dataclass
class SamplingParams:
    """How to sample the completion of one request (vLLM-compatible subset).

    n: completions to return for the prompt, >= 1.
    best_of: completions to generate and rank (None: n), >= n.
    temperature: logits are divided by it; 0 (anything below 1e-5) decodes greedily.
    top_p: keep the most probable tokens whose total probability reaches top_p, in (0, 1].
    top_k: keep the k most probable tokens; 0 or -1 keeps all (as does one past the vocabulary's
        size: larger than 2**31 - 1 reads as that).
    min_p: drop tokens less probable than min_p times the most probable one, in [0, 1].
    presence_penalty: subtracted from the logit of every token already generated, in [-2, 2].
    frequency_penalty: subtracted once per earlier occurrence in the output, in [-2, 2].
    repetition_penalty: > 0; logits of tokens in the prompt or output are divided by it
        when positive and multiplied by it when negative (1 disables).
    seed: seeds the request's own generator, making its samples reproducible whatever
        else shares the batch.
    stop: strings that end the completion when generated.
    stop_token_ids: token ids that end the completion when generated.
    include_stop_str_in_output: keep the matched stop string in the returned text.
    ignore_eos: keep generating past the end-of-sequence token.
    max_tokens: most tokens to generate, >= 1; None runs to the context limit.
    min_tokens: stop ids and EOS are not sampled, and stop strings end nothing, before this many tokens.
    logprobs: None returns no logprobs; k >= 0 returns the chosen token's logprob and
        the k most probable alternatives (at most 20).
    skip_special_tokens: leave special tokens out of the detokenized text.
    structured_outputs: a constraint on the output (`StructuredOutputsParams`, or a dict of it).
    logit_bias: {token id: bias in [-100, 100]} added to those logits before sampling (after
        the logprobs, which stay the model's own), -100 all but bans a token.
    allowed_token_ids: only these ids may be sampled (a non-empty list).
    bad_words: strings never generated: the last token of a word is banned wherever the output
        ends with the tokens before it (each word as it tokenizes alone and after a space, as
        vLLM does; the engine tokenizes them into `bad_words_token_ids`).
    bad_words_token_ids: the token sequences `bad_words` ban; set by the engine from `bad_words`
        (given directly, these sequences are banned as well).
    prompt_logprobs: None, or k >= 0: the logprob of every prompt token after the first (given
        the tokens before it) and its k most probable alternatives (at most 20). The prompt is
        then computed in full (no prefix-cache hit), chunk by chunk; with n > 1 or best_of once,
        and every output carries it.
    prediction: text the output is expected to mostly repeat (OpenAI's predicted outputs: code to
        edit, a document to revise); with speculative decoding on, drafts come from it and the
        output stays what it would be without it. Not with logprobs, penalties, token controls
        or n > 1 / best_of, whose requests are not drafted for.
    prediction_token_ids: the prediction's tokens; set by the engine from `prediction` (given
        directly: drafted from as they are).
    truncate_prompt_tokens: keep only the last k >= 1 tokens of the prompt (left truncation); -1:
        as many as the context holds with max_tokens (at least one) left to generate; None: the
        whole prompt.
    kv_eviction: evict KV entries of this request under a token budget (`KVEvictionParams`, or a
        dict of it: {"policy": "streaming" | "snapkv" | "none", "budget", "sinks", "window",
        "pool"}); None takes the engine's default (`--kv-eviction`), policy "none" opts out of it.
        Not with prompt_logprobs (their context would be cut) or n > 1 / best_of.
    detokenize: False leaves the outputs' text empty and their logprobs' decoded tokens None
        (token ids only, as vLLM's); not with stop strings, which are matched in the text.
    cache_salt: a string mixed into the prefix cache's block hashes (vLLM's): the request shares
        cached KV only with requests of the same salt, so users of a shared server cannot learn
        from its timing whether another one sent a prompt (use a long random salt per tenant).
    strict_max_tokens: True refuses a max_tokens larger than the room the prompt leaves in the
        context (ContextLengthError, as vLLM's server refuses it); False (the default, as vLLM's
        offline engine) cuts it to that room, and the output ends with finish_reason "length".
    output_kind: a `RequestOutputKind` (or its name): what `AsyncEngine.generate` streams.
    guided_decoding: vLLM's earlier name of `structured_outputs` (read as it; not both).
    logits_processors: refused unless empty: per-request Python callables over the logits are
        not taken (nor by vLLM's V1 engine); `logit_bias`, `allowed_token_ids`, `bad_words` and
        `structured_outputs` cover their uses.
    extra_args: refused unless empty: vLLM hands it to sampling plugins, and loom loads none.
    """

    n: int = 1
    best_of: int | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    stop: str | Sequence[str] | None = None
    stop_token_ids: Sequence[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    structured_outputs: StructuredOutputsParams | None = None
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: Sequence[int] | None = None
    bad_words: Sequence[str] | None = None
    bad_words_token_ids: Sequence[Sequence[int]] | None = None
    prediction: str | None = None
    prediction_token_ids: Sequence[int] | None = None
    truncate_prompt_tokens: int | None = None
    kv_eviction: KVEvictionParams | None = None
    detokenize: bool = True
    cache_salt: str | None = None
    strict_max_tokens: bool = False
    output_kind: RequestOutputKind | str = RequestOutputKind.CUMULATIVE
    guided_decoding: StructuredOutputsParams | dict | None = None
    logits_processors: Sequence[Any] | None = None
    extra_args: dict[str, Any] | None = None

    def __post_init__(self) -> None:
        self._plain_numbers()
        self.n = _int("n", self.n, "an integer >= 1")
        if self.n < 1:
            raise _fail("n", self.n, "an integer >= 1")
        if self.best_of is not None:
            allowed = f"None or an integer >= n ({self.n})"
            if _int("best_of", self.best_of, allowed) < self.n:
                raise _fail("best_of", self.best_of, allowed)

        self.temperature = _real("temperature", self.temperature, "a number >= 0")
        if self.temperature < 0:
            raise _fail("temperature", self.temperature, "a number >= 0")
        self.top_p = _real("top_p", self.top_p, "a number in (0, 1]")
        if not 0.0 < self.top_p <= 1.0:
            raise _fail("top_p", self.top_p, "a number in (0, 1]")
        if _int("top_k", self.top_k, "an integer >= -1 (0 or -1 disables)") < -1:
            raise _fail("top_k", self.top_k, "an integer >= -1 (0 or -1 disables)")
        self.top_k = min(self.top_k, TOP_K_ALL)   # past any vocabulary: every token, as a 64-bit tensor holds it
        self.min_p = _real("min_p", self.min_p, "a number in [0, 1]")
        if not 0.0 <= self.min_p <= 1.0:
            raise _fail("min_p", self.min_p, "a number in [0, 1]")

        for name in ("presence_penalty", "frequency_penalty"):
            value = _real(name, getattr(self, name), "a number in [-2, 2]")
            if not -2.0 <= value <= 2.0:
                raise _fail(name, value, "a number in [-2, 2]")
            setattr(self, name, value)
        self.repetition_penalty = _real("repetition_penalty", self.repetition_penalty, "a number > 0")
        if self.repetition_penalty <= 0:
            raise _fail("repetition_penalty", self.repetition_penalty, "a number > 0")

        if self.seed is not None:
            allowed = f"None or an integer in [{_SEED_MIN}, {_SEED_MAX}]"
            if not _SEED_MIN <= _int("seed", self.seed, allowed) <= _SEED_MAX:
                raise _fail("seed", self.seed, allowed)

        self.stop = self._normalise_stop(self.stop)
        self.stop_token_ids = self._normalise_stop_ids(self.stop_token_ids)

        if self.max_tokens is not None:
            if _int("max_tokens", self.max_tokens, "None or an integer >= 1") < 1:
                raise _fail("max_tokens", self.max_tokens, "None or an integer >= 1")
        upper = "" if self.max_tokens is None else f" and <= max_tokens ({self.max_tokens})"
        allowed = f"an integer >= 0{upper}"
        min_tokens = _int("min_tokens", self.min_tokens, allowed)
        if min_tokens < 0 or (self.max_tokens is not None and min_tokens > self.max_tokens):
            raise _fail("min_tokens", self.min_tokens, allowed)

        if self.logprobs is not None:
            allowed = f"None or an integer in [0, {MAX_LOGPROBS}]"
            if not 0 <= _int("logprobs", self.logprobs, allowed) <= MAX_LOGPROBS:
                raise _fail("logprobs", self.logprobs, allowed)

        self._check_flags_and_salt()
        self._check_vllm_extras()
        if not self.detokenize and self.stop:
            raise InvalidRequestError("stop strings need detokenize=True: they are matched in the output's text")
        self.structured_outputs = StructuredOutputsParams.create(self.structured_outputs)
        self._check_token_controls()
        self._check_prediction()
        if self.truncate_prompt_tokens is not None:
            allowed = "None, -1 or an integer >= 1"
            k = _int("truncate_prompt_tokens", self.truncate_prompt_tokens, allowed)
            if k < 1 and k != -1:
                raise _fail("truncate_prompt_tokens", k, allowed)
        if self.prompt_logprobs is not None:
            allowed = f"None or an integer in [0, {MAX_LOGPROBS}]"
            if not 0 <= _int("prompt_logprobs", self.prompt_logprobs, allowed) <= MAX_LOGPROBS:
                raise _fail("prompt_logprobs", self.prompt_logprobs, allowed)
        self._check_eviction()
        if self.structured_outputs is not None and (self.ignore_eos or self.min_tokens):
            # a grammar ends where it ends: past its end only a stop token is allowed
            so = self.structured_outputs
            name = "tool_choice" if so.source == "tools" else so.field_name.split(".")[0]   # forced calls' grammar
            raise InvalidRequestError(f"{name} cannot be combined with ignore_eos or min_tokens > 0")

    def _check_eviction(self) -> None:
        self.kv_eviction = KVEvictionParams.create(self.kv_eviction)
        if self.kv_eviction is not None and self.kv_eviction.enabled:
            if self.prompt_logprobs is not None:
                raise InvalidRequestError("kv_eviction cannot be combined with prompt_logprobs: "
                                          "the prompt's context would be evicted while it is scored")
            if self.n > 1 or (self.best_of or 1) > 1:
                raise InvalidRequestError("kv_eviction cannot be combined with n > 1 or best_of: "
                                          "evicting sequences do not share KV blocks")

    def _check_flags_and_salt(self) -> None:
        for name in ("include_stop_str_in_output", "ignore_eos", "skip_special_tokens", "detokenize",
                     "strict_max_tokens"):
            setattr(self, name, _flag(name, getattr(self, name)))
        if self.cache_salt is not None and (not isinstance(self.cache_salt, str) or not self.cache_salt):
            raise _fail("cache_salt", self.cache_salt, "a non-empty string")

    def _check_vllm_extras(self) -> None:
        """output_kind normalised; guided_decoding moved to structured_outputs; the fields loom has
        no hook for refused by name unless empty."""
        kind = self.output_kind
        if isinstance(kind, str) and kind.upper() in RequestOutputKind.__members__:
            kind = RequestOutputKind[kind.upper()]
        if not isinstance(kind, RequestOutputKind):
            raise _fail("output_kind", self.output_kind,
                        f"a RequestOutputKind ({', '.join(RequestOutputKind.__members__)})")
        self.output_kind = kind
        if self.guided_decoding is not None:
            if self.structured_outputs is not None:
                raise InvalidRequestError("give structured_outputs or guided_decoding (its earlier name), not both")
            self.structured_outputs, self.guided_decoding = self.guided_decoding, None
        if self.logits_processors:
            raise InvalidRequestError("logits_processors are not supported: loom takes no per-request Python "
                                      "callables over the logits (nor does vLLM's V1 engine); use logit_bias, "
                                      "allowed_token_ids, bad_words or structured_outputs")
        if self.extra_args:
            raise InvalidRequestError(f"extra_args is for sampling plugins and loom loads none: "
                                      f"got keys {sorted(map(str, self.extra_args))}")

    _INTS = ("n", "best_of", "top_k", "seed", "max_tokens", "min_tokens", "logprobs", "prompt_logprobs",
             "truncate_prompt_tokens")
    _FLOATS = ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty", "repetition_penalty")

    def _plain_numbers(self) -> None:
        """numpy's (or any) integer and real scalars, as a sweep over np.arange gives them, taken
        as the int and float they are (vLLM takes them)."""
        for name in self._INTS:
            value = getattr(self, name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                setattr(self, name, int(value))
        for name in self._FLOATS:
            value = getattr(self, name)
            if isinstance(value, numbers.Real) and not isinstance(value, (bool, int, float)):
                setattr(self, name, float(value))

    def _check_token_controls(self) -> None:
        """logit_bias, allowed_token_ids, bad_words and their token ids, normalised."""
        if self.logit_bias is not None:
            allowed = (f"None or a dict of token ids (integers >= 0) to numbers in "
                       f"[-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]")
            if not isinstance(self.logit_bias, dict):
                raise _fail("logit_bias", self.logit_bias, allowed)
            bias = {}
            for token, value in self.logit_bias.items():
                if not _is_int(token) or token < 0:
                    raise _fail("logit_bias", self.logit_bias, allowed)
                if isinstance(value, bool) or not isinstance(value, (int, float)) or not abs(value) <= MAX_LOGIT_BIAS:
                    raise _fail("logit_bias", self.logit_bias, allowed)
                bias[token] = float(value)
            self.logit_bias = bias or None
        if self.allowed_token_ids is not None:
            ids = self.allowed_token_ids
            allowed = "None or a non-empty list of integers >= 0"
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise _fail("allowed_token_ids", ids, allowed)
            self.allowed_token_ids = tuple(sorted(set(ids)))
        if self.bad_words is not None:
            allowed = "None or a list of non-empty strings"
            words = self.bad_words
            if not isinstance(words, (list, tuple)) or not all(isinstance(w, str) and w.strip() for w in words):
                raise _fail("bad_words", words, allowed)
            self.bad_words = tuple(words) or None
        if self.bad_words_token_ids is not None:
            allowed = "None or a list of non-empty lists of integers >= 0"
            seqs = self.bad_words_token_ids
            if not isinstance(seqs, (list, tuple)) or not all(
                    isinstance(q, (list, tuple)) and q and all(_is_int(t) and t >= 0 for t in q) for q in seqs):
                raise _fail("bad_words_token_ids", seqs, allowed)
            self.bad_words_token_ids = tuple(tuple(q) for q in seqs) or None

    def _check_prediction(self) -> None:
        if self.prediction is not None and (not isinstance(self.prediction, str) or not self.prediction):
            raise _fail("prediction", self.prediction, "None or a non-empty string")
        ids = self.prediction_token_ids
        if ids is not None:
            if not isinstance(ids, (list, tuple)) or not ids or not all(_is_int(t) and t >= 0 for t in ids):
                raise _fail("prediction_token_ids", ids, "None or a non-empty list of integers >= 0")
            self.prediction_token_ids = tuple(ids)
        if self.prediction is None and ids is None:
            return
        conflicts = [name for name, on in (
            ("logprobs", self.logprobs is not None), ("n", self.n > 1), ("best_of", (self.best_of or 1) > 1),
            ("presence_penalty", self.presence_penalty != 0), ("frequency_penalty", self.frequency_penalty != 0),
            ("repetition_penalty", self.repetition_penalty != 1), ("logit_bias", bool(self.logit_bias)),
            ("allowed_token_ids", bool(self.allowed_token_ids)),
            ("bad_words", bool(self.bad_words or self.bad_words_token_ids))) if on]
        if conflicts:
            raise InvalidRequestError(f"prediction cannot be combined with {', '.join(conflicts)}: such requests "
                                      f"are not drafted for")

    @property
    def restricts_tokens(self) -> bool:
        """True when logit_bias, allowed_token_ids or bad words change what may be sampled."""
        return bool(self.logit_bias or self.allowed_token_ids or self.bad_words or self.bad_words_token_ids)

    @staticmethod
    def _normalise_stop(stop: Any) -> tuple[str, ...]:
        allowed = "None, a non-empty string or a list of non-empty strings"
        if stop is None:
            return ()
        items = (stop,) if isinstance(stop, str) else stop
        if not isinstance(items, (list, tuple)):
            raise _fail("stop", stop, allowed)
        for item in items:
            if not isinstance(item, str) or not item:
                raise _fail("stop", stop, allowed)
        return tuple(items)

    @staticmethod
    def _normalise_stop_ids(ids: Any) -> tuple[int, ...]:
        allowed = "None or a list of integers >= 0"
        if ids is None:
            return ()
        if not isinstance(ids, (list, tuple)):
            raise _fail("stop_token_ids", ids, allowed)
        for token in ids:
            if not _is_int(token) or token < 0:
                raise _fail("stop_token_ids", ids, allowed)
        return tuple(ids)

    @property
    def is_greedy(self) -> bool:
        """True when the request takes the argmax instead of sampling."""
        return self.temperature < GREEDY_TEMPERATURE_EPS

    @property
    def sampling_type(self) -> SamplingType:
        if self.is_greedy:
            return SamplingType.GREEDY
        return SamplingType.RANDOM if self.seed is None else SamplingType.RANDOM_SEED

    @property
    def effective_best_of(self) -> int:
        """Completions to generate: `best_of` when given, else `n`."""
        return self.n if self.best_of is None else self.best_of

    def prompt_keep(self, max_model_len: int) -> int | None:
        """How many of a prompt's last tokens `truncate_prompt_tokens` keeps in a context of
        `max_model_len` (None: all): -1 leaves room for max_tokens, as many as it asks."""
        keep = self.truncate_prompt_tokens
        if keep != -1:
            return keep
        return max(1, max_model_len - max(1, self.max_tokens or 1))

    def clone(self, **changes: Any) -> SamplingParams:
        """A validated copy, with `changes` applied to the named fields."""
        return dataclasses.replace(self, **changes)


@dataclass(frozen=True)
class BeamSearchParams:
    """`LLM.beam_search`'s settings (loom/parallel/beam.py), vLLM's fields and more.

    beam_width: beams kept (all groups together); max_tokens: most new tokens per sequence;
    the rest by keyword only: length_penalty: finished scores are divided by length **
    length_penalty; early_stopping: True, False or "never" (see loom/parallel/beam.py);
    num_groups / diversity_penalty: diverse beam search (beam_width must divide into the
    groups); ignore_eos: the model's EOS ids end nothing; stop_token_ids: more ids that end a
    sequence like EOS does; include_stop_str_in_output: the EOS's text ends the returned text;
    temperature: 0 only (the beams rank by the model's own log-probabilities, as vLLM's do)."""

    beam_width: int
    max_tokens: int
    _: dataclasses.KW_ONLY
    length_penalty: float = 1.0
    early_stopping: bool | str = False
    num_groups: int = 1
    diversity_penalty: float = 0.0
    ignore_eos: bool = False
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    temperature: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        for name in ("beam_width", "max_tokens", "num_groups"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise InvalidRequestError(f"{name} must be an integer >= 1, got {value!r}")
        if self.beam_width % self.num_groups:
            raise InvalidRequestError(f"beam_width ({self.beam_width}) must be a multiple of num_groups "
                                      f"({self.num_groups})")
        if self.early_stopping not in (True, False, "never"):
            raise InvalidRequestError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")
        if self.diversity_penalty < 0:
            raise InvalidRequestError(f"diversity_penalty must be >= 0, got {self.diversity_penalty!r}")
        if self.temperature != 0:
            raise InvalidRequestError(f"temperature must be 0 in beam search (beams rank by the model's own "
                                      f"log-probabilities), got {self.temperature!r}")

    @property
    def group_size(self) -> int:
        return self.beam_width // self.num_groups

    def num_logprobs(self, num_eos: int) -> int:
        """Top logprobs each beam needs: its group's K, plus room for the tokens earlier groups
        may push down with the diversity penalty."""
        k = max(2, 1 + num_eos) * self.group_size
        if self.num_groups > 1 and self.diversity_penalty > 0:
            k += (self.num_groups - 1) * self.group_size
        return k
