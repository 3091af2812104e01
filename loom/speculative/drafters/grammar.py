"""`method: grammar`: jump-forward. Text the grammar forces is proposed as a draft chain.

Where a constrained request's grammar admits one continuation only, the model has nothing
to choose there:

    schema {"name": string, "unit": "celsius" | "fahrenheit"}, no free whitespace
    output so far   {"name": "Bob
    the model       "               (string ends: a choice)
    forced          ,"unit":"       (one continuation)  -> draft  ,"  unit  ":"
    the model       c
    forced          elsius"}        (the enum's tail)   -> draft  elsius  "}

The forced text (`GrammarMatcher.jump_forward`) is spelt with the target's tokenizer and
verified like any draft, against rows the verifier masks by the grammar along the chain, so
the output is what plain constrained decoding gives: where the model would split the text
into other tokens, the chain is cut at the first difference. One forward pass then emits
the whole forced run instead of one token per pass. Unconstrained requests get no drafts.
"""

from __future__ import annotations

from loom.contracts import DraftTree
from loom.errors import InvalidRequestError
from loom.speculative.drafters.base import Drafter, DraftRequest, register


@register("grammar")
class GrammarDrafter(Drafter):
    def __init__(self, config, env):
        if env.tokenizer is None:
            raise InvalidRequestError("speculative method 'grammar' needs the target's tokenizer")
        self.tokenizer = env.tokenizer

    def propose(self, requests: list[DraftRequest]) -> list[DraftTree | None]:
        return [self._forced(r) for r in requests]

    def _forced(self, r: DraftRequest) -> DraftTree | None:
        if r.grammar is None:
            return None
        text = r.grammar.jump_forward()
        if not text:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False)[:r.budget]
        return DraftTree.chain(ids) if ids else None
