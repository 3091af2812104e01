"""The sampler alone on random logits: ms per call for R rows of a V-token vocabulary, torch's ops
against the kernels' sample_rows (loom_kernels_sample.h), per sampling setting; then the
penalties (apply_penalties) on rows with 300 prompt and 100 output tokens; then greedy rows that
ask for logprobs=5 (log-softmax and top-k). Fastest of 5.

Usage (repository root): PYTHONPATH=. python benchmarks/sample_rate.py [--threads 2] [--rows 1,8,32]
    [--vocab 49152,262144]
"""

from __future__ import annotations

import argparse
import random
import time

import torch

from loom import kernels
from loom.sample.sampler import Sampler, SamplingBatch, apply_penalties
from loom.sampling_params import SamplingParams

SETTINGS = {"temperature 0.8": dict(temperature=0.8), "logprobs 5 (greedy)": dict(temperature=0, logprobs=5), "top_k 40": dict(temperature=0.8, top_k=40),
            "top_p 0.95": dict(temperature=0.8, top_p=0.95),
            "top_k 40 + top_p 0.95": dict(temperature=0.8, top_k=40, top_p=0.95),
            "min_p 0.05": dict(temperature=0.8, min_p=0.05)}


def best_ms(sampler: Sampler, logits: torch.Tensor, batch: SamplingBatch) -> float:
    best = float("inf")
    for _ in range(5):
        x = logits.clone()
        t = time.perf_counter()
        sampler(x, batch)
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,32")
    ap.add_argument("--vocab", default="49152,262144")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    module = kernels.load()
    if module is None:
        raise SystemExit(f"loom kernels unavailable: {kernels.unavailable_reason()}")
    plain, native = Sampler(0), Sampler(0, kernels=module)
    g = torch.Generator().manual_seed(0)
    print(f"kernels {kernels.variant()}, {args.threads} thread(s); ms per call, torch / kernels (fastest of 5)")
    print("| vocab | rows | " + " | ".join(SETTINGS) + " |")
    print("|---|---:|" + "---:|" * len(SETTINGS))
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(rows, vocab, generator=g) * 3
            cells = []
            for kw in SETTINGS.values():
                batch = SamplingBatch.build([SamplingParams(**kw)] * rows)
                a, b = best_ms(plain, logits, batch), best_ms(native, logits, batch)
                cells.append(f"{a:.2f} / {b:.2f} ({a / b:.0f}x)")
            print(f"| {vocab} | {rows} | " + " | ".join(cells) + " |", flush=True)
    penalties(args, g)


def penalties(args, g: torch.Generator) -> None:
    rng = random.Random(0)
    print("\napply_penalties, ms per call (fastest of 5)\n| vocab | rows | presence 0.5 + frequency 0.3 | repetition 1.1 |")
    print("|---|---:|---:|---:|")
    for vocab in (int(v) for v in args.vocab.split(",")):
        for rows in (int(r) for r in args.rows.split(",")):
            logits = torch.randn(rows, vocab, generator=g)
            prompt = [[rng.randrange(vocab) for _ in range(300)] for _ in range(rows)]
            output = [[rng.randrange(vocab) for _ in range(100)] for _ in range(rows)]
            cells = []
            for presence, frequency, repetition in ((0.5, 0.3, 1.0), (0.0, 0.0, 1.1)):
                best = float("inf")
                for _ in range(5):
                    x = logits.clone()
                    t = time.perf_counter()
                    apply_penalties(x, prompt, output, torch.full((rows,), presence), torch.full((rows,), frequency),
                                    torch.full((rows,), repetition))
                    best = min(best, time.perf_counter() - t)
                cells.append(f"{best * 1e3:.2f}")
            print(f"| {vocab} | {rows} | " + " | ".join(cells) + " |", flush=True)


if __name__ == "__main__":
    main()
