"""Predicted outputs, single stream: decode speed with a request's `prediction` against plain
decoding and against `auto` speculation without one, on Spec-Bench first turns.

The prediction is the request's own greedy answer, whole (the bound: an edit that changes
nothing) or with its middle third replaced by another answer's text (an edit: the drafts
leave the prediction there and must find it again). Each prompt runs alone, greedy, in turns
of the four set-ups per repetition; decode time is first token to last token (the
prediction cannot change the prefill). Outputs must be identical in all four.

    .venv/bin/python benchmarks/prediction_bench.py [--model smollm2-135m] [--per-category 2]
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict

from loom.bench.prompts import SPEC_BENCH_PATH
from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.sampling_params import SamplingParams

SETUPS = ("plain", "auto", "auto + prediction (whole answer)", "auto + prediction (middle third rewritten)")


def spec_bench(per_category: int) -> list[tuple[str, str]]:
    seen: dict[str, int] = defaultdict(int)
    out = []
    for line in SPEC_BENCH_PATH.read_text().splitlines():
        q = json.loads(line)
        if seen[q["category"]] < per_category:
            seen[q["category"]] += 1
            out.append((q["category"], q["turns"][0]))
    return out


def run(engine: Engine, prompt: list[int], params: SamplingParams):
    rid = engine.add_request({"prompt_token_ids": prompt}, params)
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished and o.request_id == rid:
                return o


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    plain = Engine(EngineConfig.create(args.model, threads=args.threads))
    tok = plain.tokenizer
    spec = Engine(EngineConfig.create(args.model, threads=args.threads, speculative_config={"method": "auto"}),
                  model=plain.model, tokenizer=tok)
    chat = tok.chat_template is not None
    items = spec_bench(args.per_category)
    prompts = [tok.encode_chat([{"role": "user", "content": t}]) if chat else tok.encode(t) for _, t in items]
    greedy = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    answers = [run(plain, p, greedy).outputs[0].token_ids for p in prompts]
    predictions = []
    for i, a in enumerate(answers):
        other = answers[(i + 1) % len(answers)]
        third = len(a) // 3
        predictions.append((tok.decode(a), tok.decode(a[:third]) + tok.decode(other[third:2 * third])
                            + tok.decode(a[2 * third:])))
    times: dict[str, list[list[float]]] = {s: [[] for _ in prompts] for s in SETUPS}
    drafted: dict[str, list[int]] = {s: [0, 0] for s in SETUPS}
    for _ in range(args.repeats):
        for i, p in enumerate(prompts):
            for setup in SETUPS:
                engine = plain if setup == "plain" else spec
                params = greedy
                if "whole" in setup:
                    params = greedy.clone(prediction=predictions[i][0])
                elif "rewritten" in setup:
                    params = greedy.clone(prediction=predictions[i][1])
                out = run(engine, p, params)
                assert out.outputs[0].token_ids == answers[i], (setup, items[i][0])
                m = out.metrics
                times[setup][i].append((m.last_token_time - m.first_token_time) / (len(answers[i]) - 1))
                drafted[setup][0] += m.num_draft_tokens
                drafted[setup][1] += m.num_accepted_draft_tokens
    base = [min(t) for t in times["plain"]]
    print(f"{args.model}, {len(prompts)} Spec-Bench first turns ({args.per_category} per category), greedy, "
          f"{args.max_tokens} tokens, {args.threads} threads, single stream; fastest of {args.repeats} per prompt")
    print("| set-up | decode tok/s (mean over prompts) | speedup over plain: geomean | min | max | "
          "accepted / drafted tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for setup in SETUPS:
        best = [min(t) for t in times[setup]]
        ratios = [b / s for b, s in zip(base, best)]
        d, a = drafted[setup]
        print(f"| {setup} | {statistics.mean(1 / s for s in best):.1f} | {statistics.geometric_mean(ratios):.2f}x | "
              f"{min(ratios):.2f}x | {max(ratios):.2f}x | {a:,} / {d:,} |")


if __name__ == "__main__":
    main()
