"""Aggregate decode throughput of many long sequences at once, per KV cache type: N concurrent
requests of CONTEXT prompt tokens each (distinct slices of ../shared/data/text/shakespeare.txt),
TOKENS greedy tokens each (ignore_eos), one engine per KV type in this one process.

Round 0 computes every prompt (its prefill rate is reported); the prompts then stay in each
engine's prefix cache, so later rounds start decoding at once from the same 2k-token contexts.
Rounds go engine after engine in turn, so a shared machine's load falls on every KV type alike;
the median round per type is reported. Decode throughput = tokens generated after every
request has its first token / the time that took (all N sequences decoding in every step).

Usage (from the repository root):
    python benchmarks/kv_throughput.py [--model smollm2-135m] [--requests 64] [--context 2048]
        [--tokens 64] [--rounds 3] [--kv float16,int8,int4] [--threads 2]
"""

from __future__ import annotations

import argparse
import platform
import statistics
import time
from pathlib import Path

from loom import kernels
from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.sampling_params import SamplingParams

TEXT = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "text" / "shakespeare.txt"


def prompts_of(tokenizer, n: int, context: int) -> list[list[int]]:
    """n distinct prompts of `context` tokens: consecutive slices of the text, wrapping around."""
    ids = tokenizer.encode(TEXT.read_text())
    step = max(1, (len(ids) - context) // n)
    return [ids[(i * step) % (len(ids) - context):][:context] for i in range(n)]


class Run:
    """One engine with one KV cache type, sized for every sequence at its full length."""

    def __init__(self, args, kv: str):
        room = args.context + args.tokens + 16
        self.engine = Engine(EngineConfig.create(
            args.model, threads=args.threads, kv_cache_dtype=kv, block_size=16,
            num_blocks=2 * args.requests * room // 16 + 64, max_model_len=room,
            max_num_seqs=args.requests, max_num_batched_tokens=max(512, args.requests)))
        self.kv = kv
        self.params = SamplingParams(max_tokens=args.tokens, temperature=0.0, ignore_eos=True)

    def round(self, prompts: list[list[int]]) -> dict[str, float]:
        """All prompts at once to the end: prefill seconds, decode tokens and seconds."""
        ids = {self.engine.add_request({"prompt_token_ids": p}, self.params) for p in prompts}
        started, done, tokens = set(), set(), {}
        t0 = time.perf_counter()
        t_first = None
        decode_tokens_at_first = 0
        while len(done) < len(ids):
            for o in self.engine.step():
                n = sum(len(c.token_ids) for c in o.outputs)
                tokens[o.request_id] = max(tokens.get(o.request_id, 0), n)
                if n:
                    started.add(o.request_id)
                if o.finished:
                    done.add(o.request_id)
            if t_first is None and len(started) == len(ids):
                t_first = time.perf_counter()
                decode_tokens_at_first = sum(tokens.values())
        t_end = time.perf_counter()
        return {"prefill_s": t_first - t0, "decode_tokens": sum(tokens.values()) - decode_tokens_at_first,
                "decode_s": t_end - t_first}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3, help="timed decode rounds after the first")
    ap.add_argument("--kv", default="float16,int8,int4")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    runs = [Run(args, kv) for kv in args.kv.split(",")]
    prompts = prompts_of(runs[0].engine.tokenizer, args.requests, args.context)
    print(f"# {args.model}, {args.requests} requests x {args.context} prompt tokens, {args.tokens} tokens each, "
          f"{args.threads} threads, kernels {kernels.variant()}, {platform.processor() or platform.machine()}")
    first = {r.kv: r.round(prompts) for r in runs}
    for kv, f in first.items():
        print(f"# round 0 {kv}: prefill {args.requests * args.context / f['prefill_s']:.0f} tok/s "
              f"({f['prefill_s']:.1f} s), decode {f['decode_tokens'] / f['decode_s']:.1f} tok/s")
    rates = {r.kv: [] for r in runs}
    for k in range(args.rounds):
        for r in runs:
            res = r.round(prompts)
            rates[r.kv].append(res["decode_tokens"] / res["decode_s"])
            print(f"# round {k + 1} {r.kv}: decode {rates[r.kv][-1]:.1f} tok/s "
                  f"(first tokens after {res['prefill_s']:.1f} s: prefix-cache hits)", flush=True)
    base = statistics.median(rates[runs[0].kv])
    print(f"\n| KV cache | decode tok/s (median of {args.rounds}) | rounds | vs {runs[0].kv} |")
    print("|---|---:|---|---:|")
    for kv, rs in rates.items():
        med = statistics.median(rs)
        print(f"| {kv} | {med:.1f} | {' / '.join(f'{x:.0f}' for x in rs)} | {med / base:.2f}x |")


if __name__ == "__main__":
    main()
