"""Predicted outputs (OpenAI's `prediction`): a request brings text its answer will mostly
repeat (code to edit, a document to revise), and the drafts come from it.

    prediction   def area(r):\\n    return 3.14 * r * r\\n
    output       def area(r):\\n    return math.pi
                                           ^ the output left the prediction here
    tail         "* r" of the output is found again in the prediction -> draft " * r\\n"

Each step the output's longest tail n-gram (max_n down to min_n tokens; at the very start, the
prediction's first tokens) is looked up in an index of the prediction's n-grams built at the
request's first draft. Of its occurrences, the first at or after the place the last match
ended wins (an edit moves forward through the text it rewrites), else the last one before it;
the tokens that follow it are the draft. A request with a prediction drafts from it alone, so
its accepted and rejected draft tokens are its prediction's. Verification keeps the output
exactly what decoding without the prediction gives (greedy; sampled: the same distribution).
"""

from __future__ import annotations

from bisect import bisect_left

from loom.contracts import DraftTree
from loom.speculative.drafters.base import Drafter, DraftRequest, register


class _Index:
    """Where each n-gram (min_n <= n <= max_n) of one prediction starts, in order."""

    def __init__(self, tokens: tuple[int, ...], min_n: int, max_n: int):
        self.tokens = tokens
        self.at: dict[tuple[int, ...], list[int]] = {}
        for n in range(min_n, max_n + 1):
            for i in range(len(tokens) - n + 1):
                self.at.setdefault(tokens[i:i + n], []).append(i)
        self.cursor = 0   # where the last match ended: the output's place in the prediction

    def follow(self, output: list[int], k: int, min_n: int, max_n: int) -> list[int]:
        """Up to k prediction tokens to continue `output` with (none if no tail n-gram occurs)."""
        if not output:
            return list(self.tokens[:k])
        for n in range(min(max_n, len(output)), min_n - 1, -1):
            starts = self.at.get(tuple(output[-n:]))
            if not starts:
                continue
            i = bisect_left(starts, self.cursor - n)   # the first occurrence ending at or after the cursor
            start = starts[i] if i < len(starts) else starts[-1]
            self.cursor = start + n
            return list(self.tokens[self.cursor:self.cursor + k])
        return []


@register("prediction")
class PredictionDrafter(Drafter):
    """Drafts only for requests that bring a prediction (`DraftRequest.prediction`); as a method
    of its own, every other request decodes plainly."""

    def __init__(self, config, env):
        self.min_n, self.max_n = 1, max(1, config.prompt_lookup_max)
        self.indexes: dict[str, _Index] = {}

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        out: list[DraftTree | None] = []
        for r in requests:
            if not r.prediction:
                out.append(None)
                continue
            index = self.indexes.get(r.req_id)
            if index is None:
                index = self.indexes[r.req_id] = _Index(tuple(r.prediction), self.min_n, self.max_n)
            found = index.follow(r.token_ids[r.prompt_len:], r.budget, self.min_n, self.max_n)
            out.append(DraftTree.chain(found) if found else None)
        return out

    def finish(self, req_id: str) -> None:
        self.indexes.pop(req_id, None)
