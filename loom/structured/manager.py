"""Compiles and caches constraints; builds matchers and batch masks for the runner."""

from __future__ import annotations

from collections import OrderedDict

import torch

from loom.errors import InvalidRequestError
from loom.sampling_params import StructuredOutputsParams
from loom.structured.base import BACKENDS, GrammarBackend, GrammarMatcher, VocabInfo

# Compiled grammars kept (least recently used dropped first).
CACHE_SIZE = 128


class StructuredOutputs:
    def __init__(self, tokenizer, vocab_size: int, backend: str = "xgrammar"):
        if backend not in BACKENDS:
            raise InvalidRequestError(f"unknown structured output backend {backend!r} "
                                      f"(known: {', '.join(sorted(BACKENDS))})")
        self._tokenizer, self._vocab_size, self._backend_name = tokenizer, vocab_size, backend
        self._backend: GrammarBackend | None = None
        self._cache: OrderedDict[tuple[str, str], object] = OrderedDict()
        self._mask: torch.Tensor | None = None    # [rows, V / 32] int32, reused by mask_rows / mask_tree
        self._views: dict[int, torch.Tensor] = {}   # its first rows, by count (slicing costs more than a lookup)

    @property
    def backend(self) -> GrammarBackend:
        """Built on first use: the tokenizer tables cost time a server without constrained
        requests need not pay at start-up."""
        if self._backend is None:
            tok = self._tokenizer
            special = set(tok.special_token_ids)
            tokens = tuple("" if i in special else t for i, t in enumerate(tok.raw_tokens))
            vocab = VocabInfo(tokens, tok.vocab_kind, self._vocab_size, tuple(sorted(tok.stop_token_ids)))
            self._backend = BACKENDS[self._backend_name](vocab)
        return self._backend

    def compile(self, spec: StructuredOutputsParams):
        """The compiled grammar of `spec` (cached); InvalidRequestError naming the field if it
        does not compile."""
        key = spec.key()
        compiled = self._cache.get(key)
        if compiled is None:
            try:
                compiled = self.backend.compile(spec)
            except ValueError as e:
                raise InvalidRequestError(f"{spec.field_name} does not compile: {e}") from None
            self._cache[key] = compiled
            if len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return compiled

    def matcher(self, spec: StructuredOutputsParams) -> GrammarMatcher:
        return self.backend.matcher(self.compile(spec))

    def mask_rows(self, logits: torch.Tensor, matchers: list[GrammarMatcher | None]) -> list[int]:
        """Masks row i of `logits` [R, V] by matchers[i] (None: unconstrained), in place. Returns
        the rows whose grammar admits no token at all.

        One bitmask [R, V / 32] int32, kept between steps, holds every row: the constrained ones
        filled by the backend in one call, the others all ones (the kernel skips a word of ones),
        so a mixed batch is masked in place without copying its rows out and back. Which rows
        admit nothing comes from the backend's mask step (loom's kernel notes it while it reads
        each row's words), with no second pass over the bitmask."""
        rows = [i for i, m in enumerate(matchers) if m is not None]
        if not rows:
            return []
        mask = self._bitmask(logits.shape[0])
        self.backend.fill_masks([matchers[i] for i in rows], mask, rows)
        if len(rows) < len(matchers):
            mask.numpy()[[i for i, m in enumerate(matchers) if m is None]] = -1     # every token allowed
        admits = self.backend.apply_mask(logits, mask)                  # free rows: always
        return [i for i in rows if not admits[i]]

    def _bitmask(self, rows: int) -> torch.Tensor:
        """The first `rows` rows of the reused bitmask (grown on demand); its callers overwrite
        every row they use before reading it."""
        have = 0 if self._mask is None else self._mask.shape[0]
        if have < rows:
            self._mask = self.backend.allocate_mask(max(rows, 2 * have))
            self._views = {}
        view = self._views.get(rows)
        if view is None:
            view = self._views[rows] = self._mask[:rows]
        return view

    def mask_tree(self, logits: torch.Tensor, matcher: GrammarMatcher, tokens: tuple[int, ...],
                  parents: tuple[int, ...]) -> list[bool]:
        """Masks a draft tree's verification rows `logits` [1 + nodes, V] in place: row 0 by the
        grammar here, row i + 1 by the grammar after the path to node i. Returns which rows admit
        no token at all; those are left unmasked (a verifier needs a distribution there)."""
        mask = self._bitmask(len(tokens) + 1)     # fill_tree_masks writes every row
        matcher.fill_tree_masks(tokens, parents, mask)
        words = mask.numpy()
        stuck = ~words.any(axis=1)
        if stuck.any():
            words[stuck] = -1     # every bit set: every token allowed
        self.backend.apply_mask(logits, mask)
        return stuck.tolist()
