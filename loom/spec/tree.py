"""Draft trees: what a drafter proposes and the verifier scores in one forward pass.

A tree is two parallel lists in topological order (a parent always comes before its
children), so any prefix of the lists is again a tree: the scheduler cuts a draft to its
token budget by slicing. Node i holds `tokens[i]`; `parents[i]` is the index of its parent
node, or -1 for a child of the root (the sequence's last committed token). A chain is the
tree with parents [-1, 0, 1, ...].

    root (last committed token, position P)
     |-- 0 "the" (P+1) -- 2 "cat" (P+2) -- 4 "sat" (P+3)
     |-- 1 "a"   (P+1) -- 3 "dog" (P+2)

    tokens  [the, a, cat, dog, sat]     parents [-1, -1, 0, 1, 2]     depths [1, 1, 2, 2, 3]

Siblings hold distinct tokens: the recursive rejection sampler tries them one after the
other and needs every candidate to be a different token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DraftTree:
    tokens: tuple[int, ...]
    parents: tuple[int, ...]

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
    def chain(cls, tokens) -> "DraftTree":
        tokens = tuple(tokens)
        return cls(tokens, tuple(range(-1, len(tokens) - 1)))

    def __len__(self) -> int:
        return len(self.tokens)

    def cut(self, n: int) -> "DraftTree":
        """The first n nodes (a tree again: parents come first)."""
        return self if n >= len(self) else DraftTree(self.tokens[:n], self.parents[:n])

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


def tree_attention_mask(num_committed: int, parents) -> torch.Tensor:
    """[n, n] bool mask among a sequence's new tokens: `num_committed` committed tokens
    (causal among themselves) followed by draft nodes; a node sees every committed token,
    its ancestors and itself.

        committed c0 c1 | nodes 0 1 2      (parents [-1, -1, 0])
        c0   1 . | . . .
        c1   1 1 | . . .
        0    1 1 | 1 . .
        1    1 1 | . 1 .
        2    1 1 | 1 . 1
    """
    c, d = num_committed, len(parents)
    mask = torch.zeros(c + d, c + d, dtype=torch.bool)
    mask[:c, :c] = torch.ones(c, c, dtype=torch.bool).tril()
    mask[c:, :c] = True
    for i, p in enumerate(parents):
        if p >= 0:
            mask[c + i, c:c + p + 1] = mask[c + p, c:c + p + 1]
        mask[c + i, c + i] = True
    return mask
