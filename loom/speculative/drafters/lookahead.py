"""Lookahead decoding: Jacobi iterations on a window of guesses, plus an n-gram pool.

Each sequence keeps W guesses for the positions after its last committed token. The draft
tree holds, under the root, the pool's n-grams that start with the root token (verification
branch) and the W guesses as one chain (lookahead branch):

    root --g1--g2--g3--g4          Jacobi window (guesses for positions P+1..P+4)
         |--x1--x2--x3             pool n-grams (root, x1, x2, x3), (root, y1, y2, y3)
         `--y1--y2--y3

Scoring the tree gives, at window node j, the target's next token y_j given the root and
g1..gj: one Jacobi iteration. The next window is y_{a+1}, y_{a+2}, ... (a = accepted tokens,
so the window stays aligned with the new root), and each (g_j, y_j, y_{j+1}, ...) goes into
the pool, as do the n-grams of committed text. Accepted tokens come from whichever branch
matches; the output is the target's either way.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from loom.contracts import DraftTree
from loom.speculative.drafters.base import Drafter, DraftRequest, Observation, register

POOL_PER_TOKEN = 8     # n-grams kept per first token, most recent first


@dataclass
class _Seq:
    window: list[int] = field(default_factory=list)
    window_nodes: list[int] = field(default_factory=list)   # tree node of each window guess, last draft
    pooled_upto: int = 0                                     # committed tokens already added to the pool


@register("lookahead")
class LookaheadDrafter(Drafter):
    observe_topk = 1
    proposes_before_plan = False   # a proposal sets the window its next observation updates

    def __init__(self, config, env):
        self.W, self.N, self.G = config.lookahead_window, config.lookahead_ngram, config.lookahead_guesses
        self.pool: dict[int, OrderedDict[tuple[int, ...], None]] = {}
        self.seqs: dict[str, _Seq] = {}

    def _add(self, gram: tuple[int, ...]) -> None:
        if len(gram) < 2:
            return
        grams = self.pool.setdefault(gram[0], OrderedDict())
        grams.pop(gram[1:], None)
        grams[gram[1:]] = None
        if len(grams) > POOL_PER_TOKEN:
            grams.popitem(last=False)

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        return [self._propose(r) for r in requests]

    def _propose(self, r: DraftRequest) -> DraftTree | None:
        seq = self.seqs.setdefault(r.req_id, _Seq())
        toks = r.token_ids
        for i in range(max(seq.pooled_upto - self.N + 1, 0), len(toks) - self.N + 1):
            self._add(tuple(toks[i:i + self.N]))
        seq.pooled_upto = len(toks)
        if len(seq.window) < self.W:  # initial or short window: pad with recent context
            seq.window += toks[-(self.W - len(seq.window)):]
        trie: dict[tuple[int, int], int] = {}
        tokens: list[int] = []
        parents: list[int] = []

        def insert(seqn) -> list[int]:
            node, nodes = -1, []
            for tok in seqn:
                if len(tokens) >= r.budget:
                    break
                key = (node, tok)
                if key not in trie:
                    trie[key] = len(tokens)
                    tokens.append(tok)
                    parents.append(node)
                node = trie[key]
                nodes.append(node)
            return nodes

        for gram in list(reversed(self.pool.get(toks[-1], {})))[:self.G]:
            insert(gram)
        seq.window_nodes = insert(seq.window[:self.W])
        return DraftTree(tuple(tokens), tuple(parents)) if tokens else None

    def observe(self, obs: Observation) -> None:
        seq = self.seqs.get(obs.req_id)
        if seq is None:
            return
        nodes = [n for n in seq.window_nodes if n + 1 < len(obs.row_tokens)]
        guesses = [obs.row_tokens[n + 1] for n in nodes]
        ys = [int(obs.row_topk[n + 1][0]) for n in nodes]            # Jacobi update of each guess
        for j in range(len(nodes)):
            self._add(tuple([guesses[j]] + ys[j:j + self.N - 1]))
        seq.window = ys[obs.accepted:]
        seq.window_nodes = []

    def finish(self, req_id: str) -> None:
        self.seqs.pop(req_id, None)

    def depth(self, size: int) -> int:
        return min(size, self.W)
