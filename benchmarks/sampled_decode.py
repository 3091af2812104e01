"""Decode tok/s of N sampled requests (128-token prompts, 64 new tokens past EOS) with the
sampler on torch's ops and on the kernels' sample_rows, in alternating rounds of one engine;
best of 2 rounds each, per sampling setting.

Usage (repository root): PYTHONPATH=. python benchmarks/sampled_decode.py --model gemma3-270m --batch 32
"""

from __future__ import annotations

import argparse
import time

from loom import SamplingParams
from loom.config import EngineConfig
from loom.engine.engine import Engine

SETTINGS = {"greedy": dict(temperature=0), "temperature 0.8": dict(temperature=0.8),
            "temperature 0.8, top_p 0.95": dict(temperature=0.8, top_p=0.95),
            "temperature 1, top_k 64, top_p 0.95": dict(temperature=1.0, top_k=64, top_p=0.95)}


def decode_rate(engine: Engine, batch: int, params: SamplingParams) -> float:
    for i in range(batch):
        engine.add_request(list(range(100 + i, 228 + i)), params)
    while any(r.num_computed_tokens < len(r.all_token_ids) - 1 for r in engine.scheduler.running) \
            or engine.scheduler.waiting:
        engine.step()
    t0, tokens = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        tokens += sum(len(o.outputs[0].delta_token_ids) for o in engine.step())
    return tokens / (time.perf_counter() - t0)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    engine = Engine(EngineConfig.create(args.model, threads=args.threads))
    module = engine.runner.sampler.kernels
    if module is None:
        raise SystemExit("the engine's sampler runs without loom's kernels")
    print(f"{args.model}, {args.batch} requests; decode tok/s, best of {args.rounds} rounds")
    print("| sampling | torch | kernels | kernels / torch |\n|---|---:|---:|---:|")
    for name, kw in SETTINGS.items():
        params = SamplingParams(max_tokens=64, ignore_eos=True, **kw)
        best = {"torch": 0.0, "kernels": 0.0}
        for _ in range(args.rounds):
            for which in best:
                engine.runner.sampler.kernels = module if which == "kernels" else None
                best[which] = max(best[which], decode_rate(engine, args.batch, params))
        print(f"| {name} | {best['torch']:.1f} | {best['kernels']:.1f} | {best['kernels'] / best['torch']:.2f}x |",
              flush=True)


if __name__ == "__main__":
    main()
