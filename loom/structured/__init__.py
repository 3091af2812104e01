"""Structured output: grammar-constrained decoding behind a small backend registry.

A request's `SamplingParams.structured_outputs` is compiled once, when the request is added
(`StructuredOutputs.compile`: a bad schema, regex or grammar is an `InvalidRequestError`
naming the field and the compiler's message; compiled grammars are cached by their text).
The runner keeps one `GrammarMatcher` per constrained request; each sampling step it fills a
token bitmask for just those rows, masks their logits, samples, and advances each matcher on
the token taken. Constrained and unconstrained requests share one batch.

Backends (one file each, `register`ed by name): `xgrammar` (the default; see
docs/architecture.md for why).
"""

from loom.structured.base import BACKENDS, GrammarBackend, GrammarMatcher, VocabInfo, register
from loom.structured.manager import StructuredOutputs
from loom.structured import xgrammar_backend  # noqa: F401  (registers "xgrammar")

__all__ = ["BACKENDS", "GrammarBackend", "GrammarMatcher", "StructuredOutputs", "VocabInfo", "register"]
