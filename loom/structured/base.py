"""The interface a grammar backend implements, and its registry."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable

import torch

from loom.sampling_params import StructuredOutputsParams


@dataclass(frozen=True)
class VocabInfo:
    """What a backend needs of the tokenizer to build token masks."""

    tokens: tuple[str, ...]            # as the GGUF file spells them; special tokens as ""
    kind: str                          # "byte_level" | "byte_fallback"
    vocab_size: int                    # logits width (may exceed len(tokens))
    stop_token_ids: tuple[int, ...]


class GrammarMatcher(ABC):
    """One request's position in its grammar."""

    @abstractmethod
    def accept(self, token_id: int) -> bool:
        """Advances on `token_id`; False (state unchanged) if the grammar forbids it."""

    @abstractmethod
    def fill_mask(self, mask: torch.Tensor, row: int) -> None:
        """Writes the allowed next tokens into row `row` of a mask from `allocate_mask`."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undoes the last `num_tokens` accepted tokens."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """The grammar is complete and a stop token was accepted."""

    @abstractmethod
    def fork(self) -> "GrammarMatcher":
        """An independent copy at the same position (n > 1 children, beams)."""

    @abstractmethod
    def jump_forward(self) -> str:
        """The longest string that every continuation from here starts with ("" where the
        grammar leaves a choice): text the model need not choose (jump-forward drafts)."""

    def fill_tree_masks(self, tokens: tuple[int, ...], parents: tuple[int, ...], mask: torch.Tensor) -> None:
        """Row 0 of `mask`: the allowed tokens here; row i + 1: those after the path root -> node i
        of a draft tree (`parents` first, as in `DraftTree`). A node the grammar forbids, one below
        it, and one below a completed grammar get their parent's row: the verifier never takes such
        a node (its parent's row masks it out) or stops there. The position is unchanged after.

            tokens   a   b   c        parents  -1  0  -1      (c forbidden here)
            rows     0: here   1: after a   2: after a,b   3: = row 0
        """
        self.fill_mask(mask, 0)
        kids: dict[int, list[int]] = {}
        for i, p in enumerate(parents):
            kids.setdefault(p, []).append(i)
        filled = [False] * len(tokens)

        def walk(node: int) -> None:
            for c in kids.get(node, ()):
                if self.is_terminated() or not self.accept(tokens[c]):
                    continue
                if not self.is_terminated():
                    self.fill_mask(mask, c + 1)
                    filled[c] = True
                    walk(c)
                self.rollback(1)

        walk(-1)
        for i, p in enumerate(parents):   # parents come first: their rows are final
            if not filled[i]:
                mask[i + 1] = mask[p + 1]


class GrammarBackend(ABC):
    name: str = ""

    def __init__(self, vocab: VocabInfo):
        self.vocab = vocab

    @abstractmethod
    def compile(self, spec: StructuredOutputsParams) -> Any:
        """A compiled grammar for `spec`; raises ValueError with the compiler's message."""

    @abstractmethod
    def matcher(self, compiled: Any) -> GrammarMatcher:
        """A fresh matcher at the start of `compiled`."""

    @abstractmethod
    def allocate_mask(self, rows: int) -> torch.Tensor:
        """A mask for `rows` rows, every token allowed."""

    def fill_masks(self, matchers: list[GrammarMatcher], mask: torch.Tensor, rows: list[int]) -> None:
        """Writes matchers[j]'s allowed next tokens into row rows[j] of `mask`, for every j (a
        backend with a batch call overrides this one-call-per-row loop)."""
        for m, row in zip(matchers, rows):
            m.fill_mask(mask, row)

    @abstractmethod
    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> list[bool]:
        """Sets the logits of disallowed tokens to -inf, in place; rows correspond. Returns
        whether each row's mask admits at least one token."""


BACKENDS: dict[str, Callable[[VocabInfo], GrammarBackend]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return deco
