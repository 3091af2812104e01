"""Token Recycling: reuse the candidates the target already ranked.

Every scored row tells which tokens the target ranks highest after a token; the drafter
keeps the latest top-k per token in an adjacency matrix shared by all requests:

    adj[t] = top-k next tokens the target predicted the last time it read t     [V, k]

A draft grows best-first from the last committed token: the children of a node holding
t are adj[t][0], adj[t][1], ..., a child of rank r scoring its parent's score times
RANK_DECAY**r * DEPTH_DECAY. The highest-scoring `budget` nodes form the tree, so it is
wide near the root and follows rank-0 chains deeper down:

    root -- a0 -- b0 -- c0
         |     `- b1
         `- a1 -- b'0
"""

from __future__ import annotations

import heapq
from functools import lru_cache

import numpy as np

from loom.contracts import DraftTree
from loom.speculative.drafters.base import Drafter, DraftRequest, Observation, register

RANK_DECAY = 0.35
DEPTH_DECAY = 0.8


@lru_cache(maxsize=None)
def _template(k: int, size: int) -> tuple[tuple[int, int], ...]:
    """(parent index, rank) of the `size` best nodes of the full k-ary tree, in pop order."""
    out: list[tuple[int, int]] = []
    heap = [(-DEPTH_DECAY * RANK_DECAY ** r, -1, r) for r in range(k)]
    while heap and len(out) < size:
        neg, parent, rank = heapq.heappop(heap)
        out.append((parent, rank))
        me = len(out) - 1
        for r in range(k):
            heapq.heappush(heap, (neg * DEPTH_DECAY * RANK_DECAY ** r, me, r))
    return tuple(out)


@register("token_recycling")
class TokenRecyclingDrafter(Drafter):
    steady_sources = ("token_recycling",)    # its table has a guess after nearly every token
    def __init__(self, config, env):
        self.k = config.recycling_top_k
        self.observe_topk = self.k
        vocab = env.target.cfg.vocab_size
        # numpy, not torch: every step writes a row or a few and a draft reads single entries,
        # and a torch index operation costs ~10x a numpy one at that size
        self.adj = np.full((vocab, self.k), -1, dtype=np.int64)

    def observe(self, obs: Observation) -> None:
        k = self.k
        if len(obs.row_tokens) == 1:
            self.adj[obs.row_tokens[0]] = obs.row_topk[0][:k]
        else:
            self.adj[obs.row_tokens] = np.asarray(obs.row_topk)[:, :k]

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        return [self._grow(r.token_ids[-1], r.budget) for r in requests]

    def _grow(self, root: int, budget: int) -> DraftTree | None:
        tokens: list[int] = []
        parents: list[int] = []
        index: dict[int, int] = {}  # template node -> tree node (absent: its parent had no row)
        for t, (parent, rank) in enumerate(_template(self.k, budget)):
            if parent >= 0 and parent not in index:
                continue
            src = root if parent < 0 else tokens[index[parent]]
            tok = int(self.adj[src, rank])
            if tok < 0:
                continue
            index[t] = len(tokens)
            tokens.append(tok)
            parents.append(-1 if parent < 0 else index[parent])
        return DraftTree(tuple(tokens), tuple(parents), "token_recycling") if tokens else None

    def depth(self, size: int) -> int:
        depths: list[int] = []
        for parent, _ in _template(self.k, size):
            depths.append(1 if parent < 0 else depths[parent] + 1)
        return max(depths, default=0)
