"""Per-request text output: incremental detokenization, stop strings, logprob layout.

Stop strings are never split across stream chunks: text that could still be the start
of a stop string is held back until the next tokens decide it.

    emitted | held back (a prefix of some stop string) | <- new delta from detokenizer

As in vLLM, a stop string only ends the output at a match that ends after the text of the
first `min_tokens` tokens, and the token that ended the output (EOS or a stop_token_ids id)
adds no text unless include_stop_str_in_output: its id stays in token_ids, but a client
streaming deltas never sees "<|im_end|>" or the stop id's "\n".
"""

from __future__ import annotations

from collections.abc import Sequence

from loom.contracts import TokenLogprobs
from loom.engine.request import Request, RequestStatus
from loom.loader.tokenizer import IncrementalDetokenizer, Tokenizer
from loom.outputs import CompletionOutput, Logprob, RequestOutput


def append_prompt_logprobs(into: list[dict[int, Logprob] | None], prompt: Sequence[int], entries: list[TokenLogprobs],
                           tokenizer: Tokenizer, detokenize: bool = True) -> None:
    """Appends to `into` (vLLM's layout: None first, then one dict per prompt token) the
    logprobs of the next prompt tokens, in order, the actual token always present (its text
    None without `detokenize`)."""
    name = tokenizer.decode if detokenize else (lambda ids: None)
    for e in entries:
        tok = prompt[len(into)]
        d = {tid: Logprob(lp, rank, name([tid])) for rank, (tid, lp) in enumerate(e.top, start=1)}
        if tok not in d:
            d = {tok: Logprob(e.logprob, e.rank, name([tok])), **d}
        into.append(d)


class OutputState:
    def __init__(self, req: Request, tokenizer: Tokenizer, index: int = 0):
        self.req, self.tokenizer, self.index = req, tokenizer, index
        self.detok = IncrementalDetokenizer(tokenizer, req.prompt_token_ids,
                                            skip_special_tokens=req.params.skip_special_tokens)
        self.stops = req.params.stop
        # prompt logprobs (vLLM's layout): None for the first prompt token, then one dict per token
        self.prompt_logprobs: list[dict[int, Logprob] | None] | None = (
            [None] if req.params.prompt_logprobs is not None else None)
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.text = ""        # emitted so far
        self.pending = ""     # decoded but held back
        self.num_tokens_seen = 0
        self.num_tokens_emitted = 0
        self.stopped_by_string = False
        # where (in text + pending) a stop string may end at the earliest: after the text of
        # the first min_tokens tokens
        self.stop_from = 0

    def process(self) -> RequestOutput:
        """Consumes the request's new tokens; returns its output with the deltas since the last call.
        Sets `stopped_by_string` when a stop string ended it (the caller finishes the request)."""
        req = self.req
        new_ids = req.output_token_ids[self.num_tokens_seen:]
        text_ids = new_ids[:-1] if new_ids and self._ended_by_stop_token() else new_ids
        if not req.params.detokenize:
            text_ids = []   # token ids only
        if self.stops and not self.stopped_by_string:
            self._add_until_stop(new_ids, len(text_ids))
        else:
            self.pending += self.detok.add(text_ids)
        self.num_tokens_seen = len(req.output_token_ids)
        if req.status.finished:
            self.pending += self.detok.flush()
        hold = 0 if (req.status.finished or self.stopped_by_string) else self._partial_stop_len()
        delta = self.pending[:len(self.pending) - hold]
        self.pending = self.pending[len(self.pending) - hold:]
        self.text += delta
        delta_ids = req.output_token_ids[self.num_tokens_emitted:]
        self.num_tokens_emitted = len(req.output_token_ids)
        return self._output(delta, delta_ids)

    def _ended_by_stop_token(self) -> bool:
        """Whether the request's last token is the EOS or stop id that ended it and its text is
        left out (vLLM v1: the stop token's text is kept only with include_stop_str_in_output)."""
        req = self.req
        return (req.status is RequestStatus.FINISHED_STOPPED and not isinstance(req.stop_reason, str)
                and not req.params.include_stop_str_in_output)

    def _add_until_stop(self, new_ids: list[int], num_text: int) -> None:
        """Adds tokens one at a time, the text of the first `num_text` only (the rest: the stop
        token that ended the request); a stop string drops the tokens after the one that
        completed it (a speculative step may have appended several at once)."""
        min_tokens = self.req.params.min_tokens
        for i, tok in enumerate(new_ids):
            if i < num_text:
                self.pending += self.detok.add([tok])
            if self.num_tokens_seen + i + 1 <= min_tokens:
                self.stop_from = len(self.text) + len(self.pending)
                continue
            self._check_stops()
            if self.stopped_by_string:
                extra = len(new_ids) - i - 1
                if extra:
                    del self.req.output_token_ids[-extra:]
                    del self.req.all_token_ids[-extra:]
                return

    def _check_stops(self) -> None:
        # Emitted text never holds the start of a stop string (it is held back), so a
        # match can only begin inside `pending`; one that ends within the first min_tokens
        # tokens' text does not count.
        start = self.stop_from - len(self.text)
        hits = [(i, s) for s in self.stops if (i := self.pending.find(s, max(0, start - len(s) + 1))) >= 0]
        if not hits:
            return
        i, s = min(hits)
        cut = i + (len(s) if self.req.params.include_stop_str_in_output else 0)
        self.pending = self.pending[:cut]
        self.stopped_by_string = True
        self.req.stop_reason = s
        self.req.status = RequestStatus.FINISHED_STOPPED

    def _partial_stop_len(self) -> int:
        """Longest tail of text+pending that is a proper prefix of a stop string (bounded by pending)."""
        if not self.stops:
            return 0
        for n in range(min(self.max_stop - 1, len(self.pending)), 0, -1):
            if any(s.startswith(self.pending[-n:]) for s in self.stops):
                return n
        return 0

    def _output(self, delta: str, delta_ids: list[int]) -> RequestOutput:
        req = self.req
        finished = req.status.finished
        completion = CompletionOutput(
            index=self.index,
            text=self.text,
            token_ids=list(req.output_token_ids),
            cumulative_logprob=req.cumulative_logprob if req.logprobs is not None else None,
            logprobs=req.logprobs,
            finish_reason=req.status.value if finished else None,
            stop_reason=req.stop_reason,
            delta_text=delta,
            delta_token_ids=delta_ids,
        )
        req.metrics.num_cached_tokens = req.num_cached_tokens
        return RequestOutput(req.request_id, req.prompt, list(req.prompt_token_ids), [completion],
                             finished, req.metrics, req.num_cached_tokens,
                             prompt_logprobs=None if self.prompt_logprobs is None else list(self.prompt_logprobs))

    def add_prompt_logprobs(self, entries: list[TokenLogprobs]) -> None:
        """Appends the logprobs of the next prompt tokens (in order), the actual token always present."""
        append_prompt_logprobs(self.prompt_logprobs, self.req.prompt_token_ids, entries, self.tokenizer,
                               self.req.params.detokenize)

    def add_logprobs(self, entries: list[TokenLogprobs], token_ids: list[int]) -> None:
        """Appends vLLM-layout logprobs: per token {id: Logprob}, the sampled token always present."""
        if self.req.logprobs is None:
            return
        name = self.tokenizer.decode if self.req.params.detokenize else (lambda ids: None)
        for e, tok in zip(entries, token_ids):
            d: dict[int, Logprob] = {}
            for rank, (tid, lp) in enumerate(e.top, start=1):
                d[tid] = Logprob(lp, rank, name([tid]))
            if tok not in d:
                d = {tok: Logprob(e.logprob, e.rank, name([tok])), **d}
            self.req.logprobs.append(d)
