"""Contract types: the plain data that crosses layers.

The scheduler hands the runner a `SchedulerOutput`; the runner answers with a
`RunnerOutput`; drafters propose `DraftTree`s that ride in it. Every layer imports these
downward from here, and they carry ids, counts, token ids and block ids only: no tensors,
no request objects (vLLM v1's `sched/output.py` and `outputs.py` play this part).

Draft trees: two parallel lists in topological order (a parent always comes before its
children), so any prefix of the lists is again a tree: the scheduler cuts a draft to its
token budget by slicing. Node i holds `tokens[i]`; `parents[i]` is the index of its parent
node, or -1 for a child of the root (the sequence's last committed token). A chain is the
tree with parents [-1, 0, 1, ...].

    root (last committed token, position P)
     |-- 0 "the" (P+1) -- 2 "cat" (P+2) -- 4 "sat" (P+3)
     |-- 1 "a"   (P+1) -- 3 "dog" (P+2)

    tokens  [the, a, cat, dog, sat]     parents [-1, -1, 0, 1, 2]     depths [1, 1, 2, 2, 3]

Siblings hold distinct tokens: the recursive rejection sampler tries them one after the
other and needs every candidate to be a different token. A tree may name its `source` (what
it was drafted from, e.g. "prompt_lookup:4", a 4-gram match): the speculation controller
keeps an acceptance rate per source.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from collections.abc import Sequence
from typing import Any, Callable, Protocol

from loom.outputs import CompletionOutput
from loom.sampling_params import SamplingParams


# vLLM's buckets of vllm:iteration_tokens_total: the scheduler counts its steps' tokens into
# them, the server's /metrics exports them (without importing the engine)
ITERATION_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)


def iteration_buckets(per_bucket: Sequence[int]) -> list[tuple[str, int]]:
    """Steps per bucket of ITERATION_BUCKETS (and one above) as Prometheus' cumulative buckets:
    (upper bound as its exposition writes it, "+Inf" last; steps up to it)."""
    running, out = 0, []
    for bound, n in zip([*(str(float(b)) for b in ITERATION_BUCKETS), "+Inf"], per_bucket):
        running += n
        out.append((bound, running))
    return out


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]
    source: str | None = None

    def __post_init__(self):
        if len(self.tokens) != len(self.parents):
            raise ValueError(f"a draft tree has {len(self.tokens)} tokens but {len(self.parents)} parents")
        seen: set[tuple[int, int]] = set()
        for i, (tok, parent) in enumerate(zip(self.tokens, self.parents)):
            if not -1 <= parent < i:
                raise ValueError(f"draft node {i} has parent {parent}: parents must come first")
            if (parent, tok) in seen:
                raise ValueError(f"draft node {i} repeats token {tok} among its siblings")
            seen.add((parent, tok))

    @classmethod
    def chain(cls, tokens, source: str | None = None) -> "DraftTree":
        tokens = tuple(tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)), source)

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> "DraftTree":
        """The first n nodes (a tree again: parents come first)."""
        return self if n >= len(self) else DraftTree(self.tokens[:n], self.parents[:n], self.source)

    @property
    def depths(self) -> list[int]:
        """Depth of each node: 1 for children of the root."""
        out: list[int] = []
        for p in self.parents:
            out.append(1 if p < 0 else out[p] + 1)
        return out

    def path(self, node: int) -> list[int]:
        """Node indices from depth 1 down to `node`."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.parents[node]
        return out[::-1]



@dataclass(frozen=True)
class NewRequestData:
    """Sent to the runner the first time it sees a request."""

    req_id: str
    prompt_token_ids: list[int]
    params: SamplingParams


@dataclass(frozen=True)
class ScheduledSeq:
    req_id: str
    token_ids: list[int]     # tokens to compute this step, at positions start_pos...
    start_pos: int           # = num_computed_tokens before the step
    block_table: list[int]
    sample: bool             # sample a token from the logits of the last one
    draft_parents: tuple[int, ...] = ()  # a draft tree's parents; its tokens end token_ids
    # KV eviction: the KV index of the first new token (None: start_pos, nothing evicted); the
    # slot list the attention reads is the block table's first kv_start + len(token_ids) slots
    kv_start: int | None = None
    # KV eviction: where the runs of consecutive positions start in the slot list, as (KV index,
    # position) pairs (loom/kv/eviction/positions.py); () when nothing was evicted
    kv_runs: tuple[tuple[int, int], ...] = ()
    # SnapKV: record the queries of new tokens at positions >= observe_from (the observation
    # window), and after the step, with `select`, choose the KV entries to keep
    observe_from: int | None = None
    select: bool = False


@dataclass(frozen=True)
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    new_requests: list[NewRequestData] = field(default_factory=list)
    finished_req_ids: list[str] = field(default_factory=list)  # runner drops their state
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write, before the step
    preempted_req_ids: list[str] = field(default_factory=list)
    kv_moves: list[tuple[int, int]] = field(default_factory=list)  # KV eviction: (src, dst) slots, first of all
    num_waiting: int = 0       # requests left waiting after this step's schedule (none: the batch is closed)

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass(frozen=True)
class TokenLogprobs:
    logprob: float                       # of the sampled (or, for a prompt, the actual next) token
    top: list[tuple[int, float]]         # (token id, logprob), most probable first
    rank: int | None = None              # the token's rank (1 = most probable), where computed


# Why a request ended with no token to sample (RunnerOutput.dead_ends: its stop_reason).
GRAMMAR_DEAD_END = "grammar admits no token"
NO_ALLOWED_TOKEN = "no allowed token is left to sample"


@dataclass(frozen=True)
class RunnerOutput:
    sampled: dict[str, list[int]]                        # req_id -> new tokens
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    drafts: dict[str, DraftTree] = field(default_factory=dict)  # req_id -> draft for its next step
    # req_id -> why it ends with no token to sample (its grammar admits none of the vocabulary, ...)
    dead_ends: dict[str, str] = field(default_factory=dict)
    # req_id -> logprobs of prompt tokens 1.. computed this step, in order (SamplingParams.prompt_logprobs)
    prompt_logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    kv_keep: dict[str, list[int]] = field(default_factory=dict)  # req_id -> KV indices to keep (SnapKV)


@dataclass(frozen=True)
class SpecHost:
    """What the runner lends speculative decoding for one step, and nothing more of itself.

    `sample` samples plain rows (one per request) and commits the tokens (its third argument:
    the rows' argmax where the output layer found it, else -1, or None; its fourth: which rows of
    the logits are those requests', None for all); `draw(logits, req_id)` gives the function
    that samples row r of one request's verification rows as a plain step would (its
    processing, one draw of its random stream per call); `request` is a
    read-only view of a request's state (`params`, `generator`, `prompt_token_ids`,
    `output_token_ids`); `commit` appends accepted tokens to its output; `move_kv` copies
    KV entries between cache slots (accepted draft nodes into place); `constrain` masks a constrained request's draft
    verification rows by its grammar along the tree, in place, and returns which rows admit
    no token (None: the request has no grammar).
    """

    sample: Callable[[Any, list[str], Any, Any], RunnerOutput]
    draw: Callable[[Any, str], Callable[[int], int]]
    request: Callable[[str], Any]
    commit: Callable[[str, list[int]], None]
    move_kv: Callable[[Any, Any], None]
    constrain: Callable[[str, DraftTree, Any], "list[bool] | None"] = lambda req_id, tree, logits: None


@dataclass
class SpecStats:
    """Cumulative speculative-decoding counts, vLLM's spec-decode metric semantics (the
    speculative decoder keeps them, the server's metrics read them)."""

    num_drafts: int = 0                 # trees verified
    num_draft_tokens: int = 0           # their nodes
    num_accepted_tokens: int = 0        # nodes accepted
    accepted_per_pos: list[int] = field(default_factory=list)  # [d]: trees whose node at depth d+1 was accepted


# -- fanned-out requests (the server asks, the engine's request groups obey) ----------------

# Seeds wrap into this range when derived (SamplingParams accepts [-(2**63), 2**64 - 1]).
_SEED_SPAN = 2**64


def derive_seed(seed: int | None, index: int) -> int | None:
    """The seed of child `index`: child 0 keeps the request seed (so n=1 and the first of n
    agree); child i gets seed + i, wrapped into [0, 2**64)."""
    if seed is None or index == 0:
        return seed
    return (seed + index) % _SEED_SPAN


class StopPolicy(Protocol):
    """Decides when a group may end before all of its children finish (`Aggregator`s are ones)."""

    def should_stop(self, children: Sequence[CompletionOutput]) -> bool:
        """True once the group has what it needs; `children` holds every child's latest
        output (finish_reason None while it runs)."""


@dataclass(frozen=True)
class FanOutOptions:
    """Options of one fanned-out request beyond `SamplingParams`."""

    stop_policy: StopPolicy | None = None  # None: wait for every child
