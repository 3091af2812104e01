"""llama.cpp through llama-cpp-python, on the quantized GGUF as llama.cpp runs it.

The model is loaded with `Llama(...)`; each run then gets its own context from the low-level API
(`n_seq_max` = the run's request count, `n_ctx` = room for every sequence) and is driven the way
llama.cpp's ``llama-batched-bench`` does: the prompts go in as one batch (split into `n_batch`
chunks), then every step decodes one token per sequence with `llama_decode`, and the next token
is the argmax of the logits. Context creation is outside the timed region.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, Sequence

import llama_cpp
import numpy as np

from loom.bench.peers.base import Peer, RunTiming, now, request_timing

N_BATCH = 512


class LlamaCppPeer(Peer):
    def load(self) -> None:
        self.llm = llama_cpp.Llama(model_path=str(self.model_path), n_threads=self.threads,
                                   n_threads_batch=self.threads, n_ctx=self.capacity.max_seq_len,
                                   n_batch=N_BATCH, verbose=False)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(self.llm.model)))
        self.info.update(version=getattr(llama_cpp, "__version__", "unknown"), n_batch=N_BATCH,
                         weights="as stored in the GGUF (quantized)")
        self.notes.append(f"quantized weights as stored; n_batch {N_BATCH}; concurrency = llama_decode with one "
                          f"token per sequence per step (as llama-batched-bench), greedy argmax")

    @contextmanager
    def _context(self, n_seqs: int, seq_len: int) -> Iterator[llama_cpp.llama_context_p]:
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = n_seqs * seq_len
        params.n_batch = N_BATCH
        params.n_ubatch = N_BATCH
        params.n_seq_max = n_seqs
        params.n_threads = self.threads
        params.n_threads_batch = self.threads
        ctx = llama_cpp.llama_init_from_model(self.llm.model, params)
        if not ctx:
            raise RuntimeError(f"llama.cpp could not create a context for {n_seqs} sequences of {seq_len} tokens")
        try:
            yield ctx
        finally:
            llama_cpp.llama_free(ctx)

    def _decode(self, ctx, batch, entries: list[tuple[int, int, int, bool]]) -> None:
        """Decode `entries` of (token, position, sequence, wants logits) as one batch."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i] = token
            batch.pos[i] = pos
            batch.n_seq_id[i] = 1
            batch.seq_id[i][0] = seq
            batch.logits[i] = int(logits)
        batch.n_tokens = len(entries)
        rc = llama_cpp.llama_decode(ctx, batch)
        if rc != 0:
            raise RuntimeError(f"llama_decode failed with status {rc}")

    def _argmax(self, ctx, index: int) -> int:
        row = llama_cpp.llama_get_logits_ith(ctx, index)
        return int(np.ctypeslib.as_array(row, shape=(self.n_vocab,)).argmax())

    def _argmax_all(self, ctx, rows: int) -> list[int]:
        logits = np.ctypeslib.as_array(llama_cpp.llama_get_logits(ctx), shape=(rows, self.n_vocab))
        return [int(t) for t in logits.argmax(axis=1)]

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int) -> RunTiming:
        n = len(prompts)
        seq_len = max(len(p) for p in prompts) + max_tokens + 1
        with self._context(n, seq_len) as ctx:
            batch = llama_cpp.llama_batch_init(max(N_BATCH, n), 0, 1)
            try:
                return self._run(ctx, batch, [list(p) for p in prompts], max_tokens)
            finally:
                llama_cpp.llama_batch_free(batch)

    def _run(self, ctx, batch, prompts: list[list[int]], max_tokens: int) -> RunTiming:
        n = len(prompts)
        flat = [(tok, pos, seq, pos == len(p) - 1) for seq, p in enumerate(prompts) for pos, tok in enumerate(p)]
        start = now()
        next_token = [0] * n
        first = [0.0] * n
        for lo in range(0, len(flat), N_BATCH):
            chunk = flat[lo:lo + N_BATCH]
            self._decode(ctx, batch, chunk)
            done = [(i, seq) for i, (_, _, seq, last) in enumerate(chunk) if last]
            for i, seq in done:
                next_token[seq] = self._argmax(ctx, i)
            stamp = now()
            for _, seq in done:
                first[seq] = stamp
        stamps = []
        for step in range(1, max_tokens):
            self._decode(ctx, batch, [(next_token[s], len(prompts[s]) + step - 1, s, True) for s in range(n)])
            next_token = self._argmax_all(ctx, n)
            stamps.append(now())
        end = now()
        last = [end if max_tokens > 1 else first[s] for s in range(n)]
        return RunTiming(end - start, [request_timing(start, first[s], last[s], max_tokens, [first[s], *stamps])
                                       for s in range(n)])

    def close(self) -> None:
        self.llm.close()
