"""What prompt logprobs (lm-eval's loglikelihood requests, `echo` with `logprobs`) add to a prefill:
R distinct 512-token prompts with prompt_logprobs=1, max_tokens=1, the runner's per-slice
logprobs on torch's log-softmax and on the kernels' logprob_rows in alternating rounds. Reports
ms per prompt: the whole request, the output layer (compute_logits) and the rest of the
prompt-logprobs step, fastest of the rounds.

Usage (repository root): PYTHONPATH=. python benchmarks/prompt_logprobs_cost.py --model gemma3-270m
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

from step_profile import wrap

from loom import SamplingParams
from loom.config import EngineConfig
from loom.engine.engine import Engine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    engine = Engine(EngineConfig.create(args.model, threads=args.threads))
    module = engine.runner.sampler.kernels
    if module is None:
        raise SystemExit("the engine runs without loom's kernels")
    totals: dict[str, float] = defaultdict(float)
    wrap(engine.runner.model, "compute_logits", totals, "compute_logits")
    wrap(engine.runner, "_prompt_logprobs", totals, "_prompt_logprobs")
    best: dict[str, tuple[float, float, float]] = {}
    prompt = 0
    for _ in range(args.rounds):
        for which in ("torch", "kernels"):
            engine.runner.sampler.kernels = module if which == "kernels" else None
            prompt += 1   # a new prompt each time: no prefix-cache hit
            engine.add_request(list(range(1000 + 600 * prompt, 1512 + 600 * prompt)),
                               SamplingParams(max_tokens=1, prompt_logprobs=1))
            totals.clear()
            t = time.perf_counter()
            while engine.has_unfinished_requests():
                engine.step()
            row = (time.perf_counter() - t, totals["compute_logits"], totals["_prompt_logprobs"] - totals["compute_logits"])
            best[which] = min(best.get(which, row), row)
    print(f"{args.model}: one 512-token prompt with prompt_logprobs=1, ms (fastest of {args.rounds})")
    print("| logprobs on | request | output layer | rest of prompt logprobs |\n|---|---:|---:|---:|")
    for which, (total, head, rest) in best.items():
        print(f"| {which} | {total * 1e3:.0f} | {head * 1e3:.0f} | {rest * 1e3:.0f} |")


if __name__ == "__main__":
    main()
