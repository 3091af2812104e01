"""Engine logprobs (per token: {id: Logprob}) in the two OpenAI layouts.

* completions (``logprobs: k``): parallel lists ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (the k most probable tokens, plus the chosen one when it is not among
  them, as vLLM does) and ``text_offset`` (each token's character offset in the returned text);
* chat (``logprobs: true, top_logprobs: k``): ``content`` is one entry per token with its
  text, logprob, UTF-8 bytes and exactly the k most probable alternatives.

JSON has no infinities: a logprob of -inf (or NaN) is reported as -9999.0.

A token that is part of a UTF-8 character (its text alone is U+FFFD) is named as OpenAI names
it, ``bytes:\\xe6\\x97``, and its ``bytes`` are its own (`Spelling`): a client joins the
bytes into the text, and the alternatives of one position no longer share a name. With `as_ids`
(vLLM's return_tokens_as_token_ids) each token is named "token_id:<id>" instead. Text offsets
count characters of the returned text: a token's offset is the number of characters completed
before it (`TextCursor`), so a token that ends a character begun earlier points at it.
"""

from __future__ import annotations

import codecs
import math
from collections.abc import Sequence

from loom.outputs import Logprob
from loom.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


class Spelling:
    """Tokens' names and bytes from the tokenizer (cached per id)."""

    def __init__(self, tokenizer, skip_special_tokens: bool = True, cache: dict[int, bytes] | None = None):
        self._tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self._special = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self._bytes: dict[int, bytes] = {} if cache is None else cache

    def bytes_of(self, token_id: int) -> bytes:
        out = self._bytes.get(token_id)
        if out is None:
            out = self._bytes[token_id] = self._tokenizer.token_bytes(token_id)
        return out

    def name(self, token_id: int, as_ids: bool = False) -> str:
        if as_ids:
            return f"token_id:{token_id}"
        raw = self.bytes_of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def in_text(self, token_id: int) -> bytes:
        """What the token adds to the returned text (nothing for a skipped special token)."""
        return b"" if token_id in self._special else self.bytes_of(token_id)

    def skipping(self, skip_special_tokens: bool) -> "Spelling":
        """This spelling for a text that skips special tokens, or keeps them (the cache shared)."""
        if skip_special_tokens == self.skip_special_tokens:
            return self
        return Spelling(self._tokenizer, skip_special_tokens, self._bytes)


class TextCursor:
    """Character offsets in a text as its tokens' bytes arrive, from `offset` on."""

    def __init__(self, offset: int = 0):
        self.offset = offset
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")

    def advance(self, data: bytes) -> int:
        """The offset of a token of these bytes: the characters completed before it."""
        at = self.offset
        self.offset += len(self._decoder.decode(data))
        return at

FLOOR_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def token_name(token_id: int, lp: Logprob, as_ids: bool, spelling: Spelling | None = None) -> str:
    if spelling is not None:
        return spelling.name(token_id, as_ids)
    return f"token_id:{token_id}" if as_ids else _text(lp)


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most probable (id, entry), best first (entries without a rank are not among the top)."""
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda p: p[1].rank)
    return ranked[:k]


def completion_logprobs(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], k: int,
                        spelling: Spelling, cursor: TextCursor, as_ids: bool = False) -> CompletionLogprobs:
    """The completions layout for `token_ids`; offsets from `cursor` (at the end of any text
    returned before these tokens: an echoed prompt, or earlier stream chunks), which moves on."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        name = spelling.name(token_id, as_ids)
        tokens.append(name)
        token_logprobs.append(finite(chosen.logprob) if chosen is not None else None)
        top = {spelling.name(t, as_ids): finite(lp.logprob) for t, lp in _top(entry, k)}
        if chosen is not None:
            top[name] = finite(chosen.logprob)
        top_logprobs.append(top)
        text_offset.append(cursor.advance(spelling.in_text(token_id)))
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=text_offset)


def chat_logprobs(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], k: int, spelling: Spelling,
                  as_ids: bool = False) -> ChatLogprobs:
    """The chat layout for `token_ids` with `k` alternatives per token."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        if chosen is None:
            continue
        top = [TopLogprob(token=spelling.name(t, as_ids), logprob=finite(lp.logprob),
                          bytes=list(spelling.bytes_of(t))) for t, lp in _top(entry, k)]
        content.append(ChatTokenLogprob(token=spelling.name(token_id, as_ids), logprob=finite(chosen.logprob),
                                        bytes=list(spelling.bytes_of(token_id)), top_logprobs=top))
    return ChatLogprobs(content=content)
