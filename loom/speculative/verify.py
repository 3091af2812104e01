"""Lossless verification of a draft tree against the target model's next-token rows.

Row 0 is the target's distribution after the root (the last committed token), row i + 1
the distribution after draft node i. Walking down from the root, the verifier takes the
next token exactly as plain decoding would and follows the child that holds it:

  * greedy: the next token is the argmax;
  * sampling: the next token is drawn as a plain step draws it, from the same processed
    distribution with one uniform of the request's random stream (inversion). A child c is
    then taken with probability p(c), and with probability p(c1) + p(c2) + ... one of
    several children: what recursive rejection sampling gives the point-mass drafts here,
    for chains and trees alike, so every step samples exactly the target's distribution.
    The draws are plain decoding's one for one (one per token committed), so a seeded
    request's output is the same with speculation on or off, however many tokens the
    controller drafts.

The walk stops at the first step where no child is taken; the token chosen there (the
"bonus" token) is appended too, so a step always yields accepted + 1 tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


def verify_path(tree: DraftTree, pick: Callable[[int], int]) -> Verdict:
    """pick(r): the token plain decoding takes at row r (len(tree) + 1 rows), asked once per
    row walked, in order."""
    kids = _children(tree)
    node, path = -1, []
    while True:
        want = pick(node + 1)
        nxt = next((c for c in kids.get(node, ()) if tree.tokens[c] == want), None)
        if nxt is None:
            return Verdict(path, [tree.tokens[i] for i in path] + [want])
        path.append(nxt)
        node = nxt


def verify_greedy(tree: DraftTree, argmax: list[int]) -> Verdict:
    """argmax[r]: the target's greedy token of row r (len(tree) + 1 rows)."""
    return verify_path(tree, argmax.__getitem__)
