"""`method: auto`: per sequence, the drafter that has been accepted most.

Prompt lookup (free, exact copies) and Token Recycling (always has a guess) both run, and
retrieval from the datastore (loom.speculative.datastore) where one is given; each
sequence takes, per step, the proposal of the one whose accepted tokens per step (an
average over this sequence's recent steps, optimistic at first) is higher. Prompt lookup
proposes nothing when the context has no match; recycling then serves. The controller
still decides how many nodes either may use, zero included.
"""

from __future__ import annotations

from loom.contracts import DraftTree
from loom.speculative.drafters.base import Drafter, DraftRequest, Observation, register
from loom.speculative.drafters.prompt_lookup import PromptLookupDrafter
from loom.speculative.drafters.retrieval import RetrievalDrafter
from loom.speculative.drafters.token_recycling import TokenRecyclingDrafter

EMA = 0.3
OPTIMISM = 4.0   # assumed accepted tokens per step before a drafter was tried


@register("auto")
class AutoDrafter(Drafter):
    def __init__(self, config, env):
        self.subs: list[Drafter] = [PromptLookupDrafter(config, env), TokenRecyclingDrafter(config, env)]
        if config.datastore is not None:
            self.subs.insert(1, RetrievalDrafter(config, env))
        self.observe_topk = max(d.observe_topk for d in self.subs)
        self.score: dict[tuple[str, int], float] = {}
        self.last: dict[str, int] = {}       # request -> which drafter made its pending tree

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        per_sub = [d.propose(requests) for d in self.subs]
        out: list[DraftTree | None] = []
        for i, r in enumerate(requests):
            ranked = sorted(range(len(self.subs)), key=lambda s: -self.score.get((r.req_id, s), OPTIMISM))
            pick = next((s for s in ranked if per_sub[s][i] is not None), None)
            if pick is not None:
                self.last[r.req_id] = pick
            out.append(None if pick is None else per_sub[pick][i])
        return out

    def observe(self, obs: Observation) -> None:
        for d in self.subs:
            if d.observe_topk:
                d.observe(obs)
        pick = self.last.pop(obs.req_id, None)
        if pick is not None and len(obs.row_tokens) > 1:
            key = (obs.req_id, pick)
            self.score[key] = (1 - EMA) * self.score.get(key, OPTIMISM) + EMA * obs.accepted

    def finish(self, req_id: str) -> None:
        for d in self.subs:
            d.finish(req_id)
        self.last.pop(req_id, None)
        for s in range(len(self.subs)):
            self.score.pop((req_id, s), None)

    def depth(self, size: int) -> int:
        return max(d.depth(size) for d in self.subs)
