"""Prompt lookup: copy what followed the latest earlier occurrence of the context's tail.

    tokens  ... A B C D E ... X A B C | <- tail "A B C" (n = 3) matched earlier
                      ^^^^^ proposed: D E ...

The longest n-gram in [min_n, max_n] that occurred before wins; ties go to the most
recent occurrence. Summaries, RAG answers and edits copy long spans of their prompt.

A tree's source names the match length ("prompt_lookup:4"): a 4-gram match is accepted
far more often than a 1-gram one (SmolLM2 over Spec-Bench: 0.85 against 0.41 per depth),
and the controller keeps a rate per source. Each request keeps an index of its n-grams,
extended by the tokens it committed since its last proposal, so a look-up costs a few
dict probes, not a scan of the context.
"""

from __future__ import annotations

from loom.contracts import DraftTree
from loom.speculative.drafters.base import Drafter, DraftRequest, register


BULK = 8       # new n-gram starts past which an index extends by zipped slices, not a loop


class NgramIndex:
    """The latest start of every n-gram (min_n <= n <= max_n) of a growing token list that
    some token follows, extended as the list grows: a look-up answers what a backwards scan of
    the list for its tail would, in a few dict probes."""

    def __init__(self, min_n: int, max_n: int):
        self.min_n, self.max_n = min_n, max_n
        self._clear()

    def _clear(self) -> None:
        self.at: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(self.min_n, self.max_n + 1)}
        self.size = 0          # tokens indexed: n-grams ending before token size - 1
        self.last = -1         # tokens[size - 1], to tell a list that is not this one grown

    def _extend(self, tokens: list[int]) -> None:
        if len(tokens) < self.size or (self.size and tokens[self.size - 1] != self.last):
            self._clear()      # not the list indexed: start over
        N = len(tokens)
        for n, grams in self.at.items():
            # starts s with s + n <= N - 1, past those indexed at the previous size, in order (a
            # later start overwrites an earlier one); many at once (a prompt, a batch's tokens
            # since its last plan) zipped from n shifted slices, half the time of the loop
            lo, hi = max(0, self.size - n), N - n
            if hi - lo > BULK:
                grams.update(zip(zip(*[tokens[lo + j:hi + j] for j in range(n)]), range(lo, hi)))
            else:
                for s in range(lo, hi):
                    grams[tuple(tokens[s:s + n])] = s
        self.size, self.last = N, tokens[-1] if tokens else -1

    def find(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """(up to k tokens that followed the latest earlier match of the longest tail n-gram,
        that n); ([], 0) without a match."""
        N = len(tokens)
        if N == self.size + 1 > 1 and tokens[N - 2] == self.last:
            return self._step(tokens, k)
        self._extend(tokens)
        for n in range(min(self.max_n, N - 1), self.min_n - 1, -1):
            s = self.at[n].get(tuple(tokens[N - n:]))
            if s is not None:
                return tokens[s + n:s + n + k], n
        return [], 0

    def _step(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """`find` where the list grew by one token since the last look (a lone sequence's every
        idle step): each n's one new start, then the tail's probe, in one pass. It runs just
        after a forward pass has streamed the weights through the caches, where Python costs
        about what it touches; this path touches less than `_extend` and the probes apart."""
        N, found = len(tokens), None
        for n in range(self.max_n, self.min_n - 1, -1):
            grams = self.at[n]
            if n < N:       # the n-gram ending before the new token, at its latest start
                grams[tuple(tokens[N - 1 - n:N - 1])] = N - 1 - n
                if found is None:
                    s = grams.get(tuple(tokens[N - n:]))
                    if s is not None:
                        found = (s, n)
        self.size, self.last = N, tokens[-1]
        if found is None:
            return [], 0
        s, n = found
        return tokens[s + n:s + n + k], n


@register("prompt_lookup")
class PromptLookupDrafter(Drafter):
    steady_sources = ()    # a match comes and goes: `hints` names it
    def __init__(self, config, env):
        self.min_n, self.max_n = config.prompt_lookup_min, config.prompt_lookup_max
        self.indexes: dict[str, NgramIndex] = {}
        self.hint_sources = tuple(f"prompt_lookup:{n}" for n in range(self.min_n, self.max_n + 1))

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        out = []
        for r in requests:
            found, n = self._index(r.req_id).find(r.token_ids, r.budget)
            out.append(DraftTree.chain(found, f"prompt_lookup:{n}") if found else None)
        return out

    def hints(self, requests: list[DraftRequest]) -> list[str | None]:
        out = []
        for r in requests:
            n = self._index(r.req_id).find(r.token_ids, 1)[1]
            out.append(f"prompt_lookup:{n}" if n else None)
        return out

    def _index(self, req_id: str) -> NgramIndex:
        index = self.indexes.get(req_id)
        if index is None:
            index = self.indexes[req_id] = NgramIndex(self.min_n, self.max_n)
        return index

    def finish(self, req_id: str) -> None:
        self.indexes.pop(req_id, None)
