"""Decode steps with a model's layers in one kernel call (loom/model/layers/stack.py) and without,
in one process: the same engine alternates between the two (model.stack set or None) run by run.

For each batch size B: B greedy requests of --tokens new tokens after a short prompt; a run's
step time is its median engine step after the first 3; each mode's figure is its fastest run.

Run from the repository root: .venv/bin/python benchmarks/stack_ab.py [MODEL] [--threads N]
    [--seqs 1,4,8] [--rounds 6] [--tokens 100]
"""

from __future__ import annotations

import argparse
import statistics
import time

from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.sampling_params import SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", nargs="?", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seqs", default="1,4,8")
    ap.add_argument("--rounds", type=int, default=6)
    ap.add_argument("--tokens", type=int, default=100)
    args = ap.parse_args()
    engine = Engine(EngineConfig.create(args.model, threads=args.threads))
    model = engine.runner.model
    stack = model.stack
    if stack is None:
        raise SystemExit("this model does not run on loom's kernels here: no stack to compare")
    ids = engine.tokenizer.encode("The history of the city begins")
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    print(f"{args.model}, {args.threads} threads; ms per decode step (fastest run's median step)")
    print("| sequences | Python loop | one call | × |")
    print("|---:|---:|---:|---:|")
    for n in (int(s) for s in args.seqs.split(",")):
        best = {True: float("inf"), False: float("inf")}
        for r in range(args.rounds):
            for use in ((True, False) if r % 2 == 0 else (False, True)):
                model.stack = stack if use else None
                for _ in range(n):
                    engine.add_request(ids, params)
                steps = []
                while engine.has_unfinished_requests():
                    t0 = time.perf_counter()
                    engine.step()
                    steps.append(time.perf_counter() - t0)
                best[use] = min(best[use], statistics.median(steps[3:]))
        model.stack = stack
        print(f"| {n} | {best[False] * 1e3:.2f} | {best[True] * 1e3:.2f} | {best[False] / best[True]:.3f} |")


if __name__ == "__main__":
    main()
