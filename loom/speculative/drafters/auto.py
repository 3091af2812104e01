"""`method: auto`: per sequence, the proposal of the source rated highest.

Prompt lookup (free, exact copies) and Token Recycling (always has a guess) both run, and
retrieval from the datastore (loom.speculative.datastore) where one is given; each
sequence takes, per step, the proposal whose source (`DraftTree.source`: prompt lookup's
names its match length) the speculation controller rates highest for it: its acceptance
rate per depth from that source, which starts from the source's average over all
sequences. So a fresh 4-gram match is copied while a 1-gram one loses to Token Recycling
where that has done better. Without a controller's rates, the first that proposes (prompt
lookup, retrieval, recycling). Prompt lookup proposes nothing when the context has no
match; recycling then serves. The controller still decides how many nodes the pick may
use, zero included.
"""

from __future__ import annotations

import weakref

from loom.contracts import DraftTree
from loom.speculative.drafters.base import Drafter, DraftRequest, Observation, register
from loom.speculative.drafters.prompt_lookup import PromptLookupDrafter
from loom.speculative.drafters.retrieval import RetrievalDrafter
from loom.speculative.drafters.token_recycling import TokenRecyclingDrafter


@register("auto")
class AutoDrafter(Drafter):
    def __init__(self, config, env):
        self.subs: list[Drafter] = [PromptLookupDrafter(config, env), TokenRecyclingDrafter(config, env)]
        if config.datastore is not None:
            self.subs.insert(1, RetrievalDrafter(config, env))
        self.observe_topk = max(d.observe_topk for d in self.subs)
        self.proposes_before_plan = all(d.proposes_before_plan for d in self.subs)
        steady = [d.steady_sources for d in self.subs]
        self.steady_sources = None if None in steady else sum(steady, ())
        self.hint_sources = self.subs[0].hint_sources
        self.rate = lambda req_id, source: 0.0   # the controller's rate(request, source) once given

    def use_rates(self, rate) -> None:
        """Takes the controller's bound `rate` weakly: the controller holds this drafter's `depth`,
        and a cycle between them would leave both (and the drafters' tables) to the garbage
        collector."""
        if not hasattr(rate, "__self__"):   # a plain function holds no controller
            self.rate = rate
            return
        ref = weakref.WeakMethod(rate)
        self.rate = lambda req_id, source: ref()(req_id, source)

    def hints(self, requests: list[DraftRequest]) -> list[str | None]:
        return self.subs[0].hints(requests)     # prompt lookup's match, the source that comes and goes

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        per_sub = [d.propose(requests) for d in self.subs]
        out: list[DraftTree | None] = []
        for i, r in enumerate(requests):
            offered = [t for t in (trees[i] for trees in per_sub) if t is not None]
            out.append(max(offered, key=lambda t: self.rate(r.req_id, t.source), default=None))
        return out

    def observe(self, obs: Observation) -> None:
        for d in self.subs:
            if d.observe_topk:
                d.observe(obs)

    def finish(self, req_id: str) -> None:
        for d in self.subs:
            d.finish(req_id)

    def depth(self, size: int) -> int:
        return max(d.depth(size) for d in self.subs)
