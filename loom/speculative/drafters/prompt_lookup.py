"""Prompt lookup: copy what followed the latest earlier occurrence of the context's tail.

    tokens  ... A B C D E ... X A B C | <- tail "A B C" (n = 3) matched earlier
                      ^^^^^ proposed: D E ...

The longest n-gram in [min_n, max_n] that occurred before wins; ties go to the most
recent occurrence. Summaries, RAG answers and edits copy long spans of their prompt.
"""

from __future__ import annotations

from loom.contracts import DraftTree
from loom.speculative.drafters.base import Drafter, DraftRequest, register


def lookup(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier match of the longest tail n-gram."""
    n_tok = len(tokens)
    for n in range(min(max_n, n_tok - 1), min_n - 1, -1):
        tail = tokens[n_tok - n:]
        first = tail[0]
        # scan backwards for the most recent earlier occurrence
        for start in range(n_tok - n - 1, -1, -1):
            if tokens[start] == first and tokens[start:start + n] == tail:
                return tokens[start + n:start + n + k]
    return []


@register("prompt_lookup")
class PromptLookupDrafter(Drafter):
    def __init__(self, config, env):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        out = []
        for r in requests:
            found = lookup(r.token_ids, r.budget, self.min_n, self.max_n)
            out.append(DraftTree.chain(found) if found else None)
        return out
