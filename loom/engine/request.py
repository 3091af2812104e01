"""A request's state inside the engine (never crosses into the runner)."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field

from loom.contracts import DraftTree
from loom.errors import ContextLengthError, InvalidRequestError
from loom.kv.eviction import EvictionPolicy, KVRuns
from loom.outputs import RequestMetrics, SampleLogprobs
from loom.sampling_params import SamplingParams

_arrival = itertools.count()


def check_token_ids(ids: list[int], vocab_size: int, max_model_len: int | None, what: str) -> None:
    """The one check of token ids entering the engine (prompts, forks, forced tokens): every id
    in [0, vocab_size), and at least one position left to generate within the context (unless
    max_model_len is None: a request whose KV is evicted may run past the context window)."""
    if not ids:
        raise InvalidRequestError(f"{what} is empty: give at least one token")
    if max(ids) >= vocab_size or min(ids) < 0:
        raise InvalidRequestError(f"{what} token ids must be in [0, {vocab_size})")
    if max_model_len is not None and len(ids) >= max_model_len:
        raise ContextLengthError(f"{what} is {len(ids)} tokens, the context limit is {max_model_len} "
                                 f"(this model's maximum context length here; at least one token must be left "
                                 f"to generate)")


def bad_words_token_ids(words, tokenizer) -> list[tuple[int, ...]]:
    """The token sequences `bad_words` ban, as vLLM derives them: each word as it tokenizes
    alone, and after a space where that spells the word with another first token and as many
    tokens (so a word is banned at the start of the text and in its middle)."""
    seqs: list[tuple[int, ...]] = []
    for word in words:
        alone = tuple(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = tuple(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if alone:
            seqs.append(alone)
        if spaced and (not alone or (spaced[0] != alone[0] and len(spaced) == len(alone))):
            seqs.append(spaced)
    return seqs


def token_controls(params: SamplingParams, tokenizer, vocab_size: int) -> SamplingParams:
    """`params` with its bad words tokenized, its logit_bias, allowed_token_ids and bad-word ids
    checked against the vocabulary, and refused where they leave no token to sample at the
    first step (every allowed id banned by min_tokens or by a one-token bad word)."""
    def check(what: str, ids) -> None:
        out = sorted(t for t in ids if t >= vocab_size)
        if out:
            raise InvalidRequestError(f"{what} holds token ids outside the vocabulary of {vocab_size}: "
                                      f"{', '.join(map(str, out[:8]))}")
    if params.logit_bias:
        check("logit_bias", params.logit_bias)
    if params.allowed_token_ids:
        check("allowed_token_ids", params.allowed_token_ids)
    seqs = list(params.bad_words_token_ids or ())
    if params.bad_words:
        seqs += [q for q in bad_words_token_ids(params.bad_words, tokenizer) if q not in seqs]
    if seqs:
        check("bad_words", {t for q in seqs for t in q})
        params = params.clone(bad_words_token_ids=seqs)
    if params.allowed_token_ids:
        left = set(params.allowed_token_ids) - {q[0] for q in seqs if len(q) == 1}
        if params.min_tokens:
            left -= set(params.stop_token_ids) | (set() if params.ignore_eos else set(tokenizer.stop_token_ids))
        if not left:
            raise InvalidRequestError("allowed_token_ids leaves no token to sample: every id it allows is banned "
                                      "(by bad_words, or as a stop token before min_tokens)")
    return params


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH,
                        RequestStatus.FINISHED_ABORTED)


@dataclass(eq=False)
class Request:
    """Token bookkeeping of one sequence.

        all_token_ids: | prompt ............ | output ....... |
                       0                     num_prompt       num_tokens
        computed:      |<-- num_computed_tokens -->|  (KV in the cache)
        KV entries:    |<- kv_len ->|                    (fewer when KV was evicted)

    With KV eviction (`eviction`), `num_evicted` computed tokens have no KV entry any more:
    positions (RoPE) count all computed tokens, the block table holds kv_len entries, and
    `kv_runs` says which position each of them has.

    Each step the scheduler grants `num_tokens - num_computed_tokens` (or a chunk of it)
    new tokens; a token is sampled when the grant reaches `num_tokens`.

    `compute_limit` (None: no limit) pauses a request: the scheduler never computes past that
    many tokens, so it samples nothing until the limit is lifted or passed. Fan-out parents
    stop one token short of their prompt's end; beams stop after each sampled token.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    max_tokens: int                      # resolved against the context limit
    prompt: str | None = None
    priority: int = 0
    eos_token_ids: frozenset[int] = frozenset()
    arrival_seq: int = field(default_factory=lambda: next(_arrival))
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0           # prompt tokens served by the prefix cache at admission
    num_preemptions: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    logprobs: SampleLogprobs | None = None
    cumulative_logprob: float = 0.0
    stop_reason: int | str | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    compute_limit: int | None = None
    draft: DraftTree | None = None       # speculative tokens proposed for the next step (not committed)
    output_limit: int | None = None      # drafts never take the output past this many tokens in a step
    eviction: EvictionPolicy | None = None
    num_evicted: int = 0                 # computed tokens whose KV entries were evicted
    kv_runs: KVRuns = ()                 # positions of the kept entries (loom/kv/eviction/positions.py)
    kv_keep: list[int] | None = None     # a selection (KV indices) waiting to be applied next step
    kv_selected: bool = False            # the prompt-end selection (SnapKV) is done

    def __post_init__(self):
        self.all_token_ids = list(self.prompt_token_ids)
        if self.params.logprobs is not None:
            self.logprobs = []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def compute_end(self) -> int:
        """Where the scheduler's grants stop: `num_tokens`, or `compute_limit` when lower."""
        return self.num_tokens if self.compute_limit is None else min(self.num_tokens, self.compute_limit)

    @property
    def kv_len(self) -> int:
        """KV entries the request's block table holds."""
        return self.num_computed_tokens - self.num_evicted

    @property
    def runs_past_context(self) -> bool:
        """Its KV stays within a budget however long it runs (StreamingLLM)."""
        return self.eviction is not None and not self.eviction.observes

    @property
    def is_prefill(self) -> bool:
        """More than one token left to compute (a prompt, or a recompute after preemption)."""
        return self.num_tokens - self.num_computed_tokens > 1

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def sort_key(self) -> tuple[int, int]:
        """Lower runs first: priority (lower value = more urgent, as in vLLM), then arrival."""
        return (self.priority, self.arrival_seq)
