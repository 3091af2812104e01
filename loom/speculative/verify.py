"""Lossless verification of a draft tree against the target model's next-token rows.

Row 0 is the target's distribution after the root (the last committed token), row i + 1
the distribution after draft node i. Walking down from the root, the verifier picks the
next token exactly as plain decoding would and follows the child that holds it:

  * greedy: the next token is the argmax; the child with that token (if any) is accepted.
  * sampling: recursive rejection sampling over the children c1, c2, ... (each a point
    mass: the drafters here are deterministic). With p the target distribution,

        try c1: accept with probability p(c1); else p <- p without c1, renormalised
        try c2: accept with probability p(c2); else drop it too ...
        none accepted: draw the token from what is left of p

    Candidate c_j comes out with probability prod_{i<j}(1 - p'(c_i)) * p'(c_j) = p(c_j) and
    any other token t with probability p(t), so every step samples exactly the target's
    distribution, for chains and trees alike.

The walk stops at the first step where no child is taken; the token chosen there (the
"bonus" token) is appended too, so a step always yields accepted + 1 tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loom.contracts import DraftTree


@dataclass(frozen=True)
class Verdict:
    accepted_nodes: list[int]   # draft node indices along the accepted path, depth 1 first
    tokens: list[int]           # their tokens, then the bonus token


def _children(tree: DraftTree) -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for i, p in enumerate(tree.parents):
        kids.setdefault(p, []).append(i)
    return kids


def verify_greedy(tree: DraftTree, argmax: list[int]) -> Verdict:
    """argmax[r]: the target's greedy token of row r (len(tree) + 1 rows)."""
    kids = _children(tree)
    node, path = -1, []
    while True:
        want = argmax[node + 1]
        nxt = next((c for c in kids.get(node, ()) if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path] + [want])
        path.append(nxt)
        node = nxt


def verify_sampled(tree: DraftTree, probs: torch.Tensor, generator: torch.Generator) -> Verdict:
    """probs [len(tree) + 1, V]: the target's (temperature, top-k/p, min-p processed)
    distributions; random draws come from `generator` only."""
    kids = _children(tree)
    node, path = -1, []
    while True:
        p = probs[node + 1].clone()
        nxt = None
        for c in kids.get(node, ()):
            tok = tree.tokens[c]
            total = float(p.sum())
            if total > 0 and float(torch.rand((), generator=generator)) * total < float(p[tok]):
                nxt = c
                break
            p[tok] = 0.0
        if nxt is None:
            bonus = int(torch.multinomial(p, 1, generator=generator))
            return Verdict(path, [tree.tokens[i] for i in path] + [bonus])
        path.append(nxt)
        node = nxt
