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

    @abstractmethod
    def apply_mask(self, logits: torch.Tensor, mask: torch.Tensor) -> None:
        """Sets the logits of disallowed tokens to -inf, in place; rows correspond."""


BACKENDS: dict[str, Callable[[VocabInfo], GrammarBackend]] = {}


def register(name: str):
    def deco(cls):
        cls.name = name
        BACKENDS[name] = cls
        return cls
    return deco
