"""Engine logprobs (per token: {id: Logprob}) in the two OpenAI layouts.

* completions (``logprobs: k``): parallel lists ``tokens``, ``token_logprobs``,
  ``top_logprobs`` (the k most probable tokens, plus the chosen one when it is not among
  them, as vLLM does) and ``text_offset`` (each token's character offset in the returned text);
* chat (``logprobs: true, top_logprobs: k``): ``content`` is one entry per token with its
  text, logprob, UTF-8 bytes and exactly the k most probable alternatives.

JSON has no infinities: a logprob of -inf (or NaN) is reported as -9999.0.

With `as_ids` (vLLM's return_tokens_as_token_ids) each token, chosen or alternative, is named
"token_id:<id>" instead of its text, so that a client gets the exact ids (a token that is not
valid UTF-8 alone has no text of its own); text offsets and bytes stay those of the text.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from loom.outputs import Logprob
from loom.server.protocol import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob

FLOOR_LOGPROB = -9999.0


def finite(logprob: float) -> float:
    return logprob if math.isfinite(logprob) else FLOOR_LOGPROB


def _text(lp: Logprob) -> str:
    return lp.decoded_token if lp.decoded_token is not None else ""


def token_name(token_id: int, lp: Logprob, as_ids: bool) -> str:
    return f"token_id:{token_id}" if as_ids else _text(lp)


def _top(entry: dict[int, Logprob], k: int) -> list[tuple[int, Logprob]]:
    """The k most probable (id, entry), best first (entries without a rank are not among the top)."""
    ranked = sorted(((t, lp) for t, lp in entry.items() if lp.rank is not None), key=lambda p: p[1].rank)
    return ranked[:k]


def completion_logprobs(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], k: int,
                        offset: int = 0, as_ids: bool = False) -> CompletionLogprobs:
    """The completions layout for `token_ids`; offsets start at `offset` (the length of any
    text returned before these tokens: an echoed prompt, or earlier stream chunks)."""
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []
    text_offset: list[int] = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        text = _text(chosen) if chosen is not None else ""
        name = f"token_id:{token_id}" if as_ids else text
        tokens.append(name)
        token_logprobs.append(finite(chosen.logprob) if chosen is not None else None)
        top = {token_name(t, lp, as_ids): finite(lp.logprob) for t, lp in _top(entry, k)}
        if chosen is not None:
            top.setdefault(name, finite(chosen.logprob))
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(text)
    return CompletionLogprobs(tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs,
                              text_offset=text_offset)


def text_length(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int]) -> int:
    """The characters `token_ids` span in the completions layout's offsets (a token without
    an entry spans none, as there)."""
    total = 0
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        if chosen is not None:
            total += len(_text(chosen))
    return total


def chat_logprobs(entries: Sequence[dict[int, Logprob]], token_ids: Sequence[int], k: int,
                  as_ids: bool = False) -> ChatLogprobs:
    """The chat layout for `token_ids` with `k` alternatives per token."""
    content = []
    for token_id, entry in zip(token_ids, entries):
        chosen = entry.get(token_id)
        if chosen is None:
            continue
        top = [TopLogprob(token=token_name(t, lp, as_ids), logprob=finite(lp.logprob),
                          bytes=list(_text(lp).encode("utf-8"))) for t, lp in _top(entry, k)]
        content.append(ChatTokenLogprob(token=token_name(token_id, chosen, as_ids), logprob=finite(chosen.logprob),
                                        bytes=list(_text(chosen).encode("utf-8")), top_logprobs=top))
    return ChatLogprobs(content=content)
