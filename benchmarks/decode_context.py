"""Single-stream decode speed at long context: loom with float16, int8 and int4 KV caches beside
llama.cpp (f16 KV), all in this one process, timed in interleaved rounds so that a shared machine's
load falls on every engine alike; the median round per engine is reported.

One sequence per engine grows through the contexts: its prompt (Spec-Bench text) is extended to
each context in turn (loom: a new request whose prompt-cache hit covers the earlier prompt;
llama.cpp: more tokens evaluated into the same context), then ROUNDS x TOKENS greedy decode steps
are timed. Usage (from the repository root):
    python benchmarks/decode_context.py [MODEL] [CONTEXTS] [TOKENS] [ROUNDS]
    LOOM_KERNELS=avx2 python benchmarks/decode_context.py smollm2-135m 256,2048,6000
"""

from __future__ import annotations

import statistics
import sys
import time

import llama_cpp
import numpy as np
import torch

from loom import kernels
from loom.bench.prompts import SPEC_BENCH_PATH, load_spec_bench
from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.loader.registry import resolve_model
from loom.sampling_params import SamplingParams

MODEL = sys.argv[1] if len(sys.argv) > 1 else "smollm2-135m"
CONTEXTS = [int(x) for x in (sys.argv[2] if len(sys.argv) > 2 else "256,2048,6000").split(",")]
TOKENS = int(sys.argv[3]) if len(sys.argv) > 3 else 16
ROUNDS = int(sys.argv[4]) if len(sys.argv) > 4 else 3
THREADS = 2
KV_DTYPES = ("float16", "int8", "int4")


class LoomStream:
    def __init__(self, kv: str, model=None, tokenizer=None):
        room = max(CONTEXTS) + ROUNDS * TOKENS * len(CONTEXTS) + 64
        self.engine = Engine(EngineConfig.create(MODEL, threads=THREADS, kv_cache_dtype=kv, block_size=16,
                                                 num_blocks=2 * room // 16 + 8, max_model_len=room + 16),
                             model=model, tokenizer=tokenizer)
        self.label = f"loom {kv} KV"
        self.rid = None

    def extend(self, prompt: list[int]) -> None:
        """Finish the running request, start one whose prompt is `prompt`, run its prefill."""
        if self.rid is not None:
            self.engine.abort(self.rid)
        self.rid = self.engine.add_request({"prompt_token_ids": prompt},
                                           SamplingParams(max_tokens=10**6, temperature=0.0, ignore_eos=True))
        while not any(o.outputs[0].token_ids for o in self.engine.step() if o.request_id == self.rid):
            pass

    def decode(self, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.engine.step()
        return (time.perf_counter() - t) / n


class LlamaStream:
    def __init__(self):
        room = max(CONTEXTS) + ROUNDS * TOKENS * len(CONTEXTS) + 64
        self.llm = llama_cpp.Llama(model_path=str(resolve_model(MODEL)), n_ctx=room, n_batch=512, n_threads=THREADS,
                                   n_threads_batch=THREADS, verbose=False)
        self.label = f"llama.cpp {llama_cpp.__version__} (f16 KV)"
        self.last = None

    def extend(self, prompt: list[int]) -> None:
        self.llm.eval(prompt[self.llm.n_tokens:] if self.llm.n_tokens <= len(prompt) else prompt[-1:])
        self.last = self._argmax()

    def _argmax(self) -> int:
        """The greedy next token from the last evaluated position's logits (llama.cpp keeps
        `scores` rows only up to n_batch without logits_all, so they are read from the context)."""
        row = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return int(np.argmax(np.ctypeslib.as_array(row, shape=(self.llm.n_vocab(),))))

    def decode(self, n: int) -> float:
        t = time.perf_counter()
        for _ in range(n):
            self.llm.eval([self.last])
            self.last = self._argmax()
        return (time.perf_counter() - t) / n


def main() -> None:
    torch.set_num_threads(THREADS)
    first = LoomStream(KV_DTYPES[0])
    streams = [first] + [LoomStream(kv, first.engine.model, first.engine.tokenizer) for kv in KV_DTYPES[1:]]
    streams.append(LlamaStream())
    tok = first.engine.tokenizer
    body = [t for text in load_spec_bench(SPEC_BENCH_PATH) for t in tok.encode(text, add_special_tokens=False)]
    text = list(tok.encode(""))
    while len(text) < max(CONTEXTS):
        text += body[:max(CONTEXTS) - len(text)]
    print(f"{MODEL}, loom kernels {kernels.variant()}, {THREADS} threads, {TOKENS} tokens x {ROUNDS} rounds, "
          f"median round (tok/s)")
    print("| context | " + " | ".join(s.label for s in streams) + " | loom int8 / llama.cpp | loom int4 / llama.cpp |")
    print("|---" * (len(streams) + 3) + "|")
    for ctx in CONTEXTS:
        for s in streams:
            s.extend(text[:ctx])
        times: dict[str, list[float]] = {s.label: [] for s in streams}
        for _ in range(ROUNDS):
            for s in streams:
                times[s.label].append(s.decode(TOKENS))
        rate = [1.0 / statistics.median(times[s.label]) for s in streams]
        print(f"| {ctx} | " + " | ".join(f"{r:.1f}" for r in rate) +
              f" | {rate[1] / rate[-1]:.2f}x | {rate[2] / rate[-1]:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
