"""Perplexity of StreamingLLM past the context window, by position.

One long stretch of a text (default: 2x the model's context) is scored with `loom eval`'s
eviction scorer (loom/model/score_evicted.py: the engine's cut, chunks of 16 tokens), so every
token sees the sink block plus at most `budget` recent entries, with keys at their true
positions. If the true positions hurt past the trained context, the mean negative
log-likelihood of the buckets past it rises.

Run from the repository root:
    .venv/bin/python benchmarks/streaming_past_context.py --model smollm2-135m --budget 1024
"""

from __future__ import annotations

import argparse
import math
import time

import torch

from loom.eval.sources import LoomSource
from loom.eval.windows import Window
from loom.eviction_params import KVEvictionParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--file", default="../shared/data/text/shakespeare.txt")
    ap.add_argument("--budget", type=int, default=1024)
    ap.add_argument("--tokens", type=int, default=None, help="tokens scored (default: 2x the model's context)")
    ap.add_argument("--bucket", type=int, default=2048)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args()

    src = LoomSource(args.model, threads=args.threads,
                     kv_eviction=KVEvictionParams("streaming", budget=args.budget))
    ctx = src.model.cfg.context_length
    n = args.tokens or 2 * ctx
    tok = src.tokenizer
    ids = tok.encode(open(args.file, encoding="utf-8").read(), add_special_tokens=False)
    if len(ids) < n:
        raise SystemExit(f"{args.file} has {len(ids)} tokens, fewer than {n}")
    toks = ([tok.bos_token_id] if tok.add_bos else []) + ids[:n - (1 if tok.add_bos else 0)]
    t0 = time.perf_counter()
    nll = []
    at = 0
    for lp in src.logprobs(Window(tuple(toks), 0)):                     # [r, V]
        target = torch.tensor(toks[at + 1:at + 1 + lp.shape[0]])
        nll.append(-lp.gather(1, target[:, None])[:, 0])
        at += lp.shape[0]
    nll = torch.cat(nll)
    print(f"{args.model}: streaming budget {args.budget}, {n} tokens (context {ctx}), "
          f"{time.perf_counter() - t0:.0f} s")
    print("| positions | mean NLL | perplexity |\n|---|---|---|")
    for a in range(0, nll.numel(), args.bucket):
        b = min(nll.numel(), a + args.bucket)
        m = nll[a:b].mean().item()
        print(f"| {a + 1}-{b} | {m:.3f} | {math.exp(m):.2f} |")


if __name__ == "__main__":
    main()
