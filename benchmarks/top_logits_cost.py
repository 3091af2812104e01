"""What computing the output layer's top logits again in float32 costs a decode step.

One engine, rounds alternating between the default (loom.model.layers.linear.TOP_LOGITS_CAP
logits per row refined) and none refined, so a shared machine's drift falls on both alike.
Reports per batch the best round's tok/s of each and their ratio (benchmarks/step_profile.py's
run: N requests of 128-token prompts, greedy past EOS, decode steps only).

Usage (repository root): PYTHONPATH=. python benchmarks/top_logits_cost.py [--model gemma3-270m]
"""

from __future__ import annotations

import argparse
from collections import defaultdict

from step_profile import run

from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.model.layers import linear


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--batches", default="1,8,32")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=128)
    args = ap.parse_args()
    engine = Engine(EngineConfig.create(args.model))
    cap = linear.TOP_LOGITS_CAP
    run(engine, 4, 4, args.prompt_len, defaultdict(float))   # warm-up: first calls, page faults
    best: dict = defaultdict(dict)
    for _ in range(args.rounds):
        for b in (int(x) for x in args.batches.split(",")):
            for name, c in (("off", 0), ("on", cap)):
                linear.TOP_LOGITS_CAP = c
                r = run(engine, b, args.new_tokens, args.prompt_len, defaultdict(float))
                if not best[b].get(name) or r["tok_s"] > best[b][name]["tok_s"]:
                    best[b][name] = r
    print(f"{args.model}: top {cap} logits within {linear.TOP_LOGITS_MARGIN} nats refined, best of {args.rounds} rounds")
    print("| batch | off tok/s | on tok/s | on / off |")
    print("|---:|---:|---:|---:|")
    for b, rs in best.items():
        print(f"| {b} | {rs['off']['tok_s']:.0f} | {rs['on']['tok_s']:.0f} | {rs['on']['tok_s'] / rs['off']['tok_s']:.3f} |")


if __name__ == "__main__":
    main()
