"""Retrieval drafting (REST / RASD style): continuations of the context's tail from a datastore.

The datastore (loom.speculative.datastore) holds a corpus the user points at
(`speculative_config datastore`, e.g. the documents a RAG service answers from) and the
token sequences (prompt + output) of finished requests, across requests. Its continuations
of the longest matching tail n-gram merge into a trie; the `budget` nodes that the most
continuations pass through form the tree (a node never counts more than its parent, so the
chosen set is closed under parents):

    continuations   D E F | D E G | D X     ->   root --D(3)--E(2)--F(1)
                                                              |      `-G(1)
                                                              `-X(1)
"""

from __future__ import annotations

from loom.contracts import DraftTree
from loom.errors import InvalidRequestError
from loom.speculative.datastore import Datastore
from loom.speculative.drafters.base import Drafter, DraftRequest, register


def merge(continuations: list[list[int]], budget: int) -> DraftTree | None:
    """The `budget` most shared nodes of the continuations' trie (ties: shallower, then earlier)."""
    nodes: dict[tuple[int, int], list] = {}          # (parent key index, token) -> [count, depth, order]
    keys: list[tuple[int, int]] = []
    for cont in continuations:
        parent = -1
        for depth, tok in enumerate(cont, 1):
            key = (parent, tok)
            if key not in nodes:
                nodes[key] = [0, depth, len(keys)]
                keys.append(key)
            nodes[key][0] += 1
            parent = nodes[key][2]
    chosen = sorted(range(len(keys)), key=lambda i: (-nodes[keys[i]][0], nodes[keys[i]][1], i))[:budget]
    chosen.sort(key=lambda i: (nodes[keys[i]][1], i))  # parents before children
    where = {i: j for j, i in enumerate(chosen)}
    tokens = tuple(keys[i][1] for i in chosen)
    parents = tuple(-1 if keys[i][0] < 0 else where[keys[i][0]] for i in chosen)
    return DraftTree(tokens, parents, "retrieval") if tokens else None


@register("retrieval")
class RetrievalDrafter(Drafter):
    steady_sources = ("retrieval",)    # whether the datastore holds a continuation is not told: assumed
    def __init__(self, config, env):
        self.store = Datastore(config.retrieval_min, config.retrieval_max, config.datastore_max_mb,
                               config.datastore_recent_tokens)
        if config.datastore is not None:
            if env.tokenizer is None:
                raise InvalidRequestError("speculative_config datastore needs the model's tokenizer")
            self.store.load(config.datastore, lambda text: env.tokenizer.encode(text, add_special_tokens=False))
        self.seen: dict[str, list[int]] = {}         # request -> its tokens (the decoder's list, grown in place)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        out = []
        for r in requests:
            self.seen[r.req_id] = r.token_ids
            out.append(merge(self.store.continuations(r.token_ids, r.budget), r.budget))
        return out

    def finish(self, req_id: str) -> None:
        tokens = self.seen.pop(req_id, None)
        if tokens is not None:
            self.store.add(tokens)
