"""The drafter interface and its registry.

A drafter proposes, for each sequence about to decode, a `DraftTree` of at most `budget`
nodes continuing its committed tokens; the runner scores the tree in the next step. A
drafter never sees a request object, only ids and token lists, and may keep state per
request (dropped by `finish`) or across requests.

    runner step k:   forward(batch) -> verify -> observe(rows) -> propose(next budgets)
                                                                     |
    runner step k+1: forward(batch incl. the trees)  <---------------+

`observe` hands the drafter the target's top-k next tokens of every row the step scored
(the root and each draft node), which drafters that learn from the target use
(Token Recycling, Lookahead). Adding a drafter = one module with a `@register`ed class.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

from loom.contracts import DraftTree


@dataclass(frozen=True)
class DraftEnv:
    """What a drafter may build on: the target model and its cache geometry."""

    target: Any             # the target model (cfg, forward, compute_logits)
    linear_mode: str        # linear backend the target was loaded with
    num_blocks: int
    block_size: int
    tokenizer: Any = None   # the target's tokenizer: retrieval reads text with it, the grammar drafter spells forced text


@dataclass(frozen=True)
class DraftRequest:
    req_id: str
    token_ids: list[int]    # committed tokens: prompt + output (the decoder's list, grown in place: never modify)
    budget: int             # most nodes the tree may have (>= 1)
    grammar: Any = None     # its GrammarMatcher (structured output), to read, never to advance
    prompt_len: int = 0     # token_ids[:prompt_len] is the prompt, the rest the output so far
    prediction: tuple[int, ...] | None = None   # the request's predicted output (drafters/prediction.py)


@dataclass(frozen=True)
class Observation:
    """The target's view of one sequence's scored rows this step."""

    req_id: str
    row_tokens: list[int]         # token at each scored row: the root, then the draft nodes
    row_parents: list[int]        # parent row of each row (-1 for the root row)
    row_topk: Any                 # int64 [rows, k]: the target's top-k next tokens after each row, best first
    accepted: int                 # draft nodes accepted along the path


class Drafter(ABC):
    """Constructed as `cls(config: SpeculativeConfig, env: DraftEnv)`."""

    name: str
    observe_topk: int = 0         # top-k the drafter wants in `observe` (0: no observations)
    # Proposing is a look-up that runs no model and changes nothing a later `observe` reads,
    # and a tree's first n nodes are a good tree of n nodes (chains, best-first trees): the
    # decoder then asks for every candidate's tree at its cap before the controller plans, so
    # the plan sees each tree's source and shape, and cuts the trees to the nodes it grants.
    proposes_before_plan: bool = True
    # The sources a tree may come from at any step, whatever the context (Token Recycling's
    # table always has a guess); with `hints`, what a plan could draft from, told without
    # proposing. None: not known (the decoder then proposes to find out).
    steady_sources: tuple[str, ...] | None = None
    # Every source `hints` may name (prompt lookup's match lengths): where none of them would
    # pay at its rate, the decoder need not ask for the hints at all.
    hint_sources: tuple[str, ...] = ()

    @abstractmethod
    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        """One tree (or None: nothing worth proposing) per request, each within its budget."""

    def observe(self, obs: Observation) -> None:
        """Learn from the target's predictions (default: nothing)."""

    def hints(self, requests: list[DraftRequest]) -> list[str | None]:
        """Per request, the source its next tree would come from where that is cheap to tell
        and changes from step to step (a prompt-lookup match), else None; no proposal made."""
        return [None] * len(requests)

    def use_rates(self, rate: Callable[[str, str | None], float]) -> None:
        """The controller's acceptance rate of a request's trees from a source, for a drafter
        that chooses among sources (default: not used)."""

    def finish(self, req_id: str) -> None:
        """Forget a finished request (default: nothing kept)."""

    def depth(self, size: int) -> int:
        """Depth of a tree of `size` nodes (chains: size); used by the controller."""
        return size

    def cost_per_token(self) -> float:
        """Measured seconds of drafting per proposed node (0 for table look-ups)."""
        return 0.0


DRAFTERS: dict[str, Callable[..., Drafter]] = {}


def register(name: str):
    def wrap(cls):
        cls.name = name
        DRAFTERS[name] = cls
        return cls

    return wrap
