"""Predicted outputs, single stream: decode speed with a request's `prediction` against plain
decoding and against `auto` speculation without one, on Spec-Bench first turns.

The prediction is the request's own greedy answer, whole (the bound: an edit that changes
nothing) or with its middle third replaced by another answer's text (an edit: the drafts
leave the prediction there and must find it again). Each prompt runs alone, greedy, in turns
of the four set-ups per repetition; decode time is first token to last token (the
prediction cannot change the prefill). Outputs must be identical in all four.

With --concurrency N the prompts run N at a time instead (all of a group added at once), and
the figure is the group's output tokens over its wall time, prefill included.

    .venv/bin/python benchmarks/prediction_bench.py [--model smollm2-135m] [--per-category 2] [--concurrency 8]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
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
    return run_group(engine, [prompt], [params])[0]


def run_group(engine: Engine, prompts: list[list[int]], params: list[SamplingParams]) -> list:
    ids = [engine.add_request({"prompt_token_ids": p}, sp) for p, sp in zip(prompts, params)]
    done = {}
    while engine.has_unfinished_requests():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    return [done[i] for i in ids]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--per-category", type=int, default=2)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--concurrency", type=int, default=1)
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
    if args.concurrency > 1:
        return concurrent(args, plain, spec, prompts, answers, predictions, greedy)
    times: dict[str, list[list[float]]] = {s: [[] for _ in prompts] for s in SETUPS}
    drafted: dict[str, list[int]] = {s: [0, 0] for s in SETUPS}
    for _ in range(args.repeats):
        for i, p in enumerate(prompts):
            for setup in SETUPS:
                out = run(plain if setup == "plain" else spec, p, with_prediction(greedy, setup, predictions[i]))
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


def with_prediction(params: SamplingParams, setup: str, predictions: tuple[str, str]) -> SamplingParams:
    if "whole" in setup:
        return params.clone(prediction=predictions[0])
    if "rewritten" in setup:
        return params.clone(prediction=predictions[1])
    return params


def concurrent(args, plain: Engine, spec: Engine, prompts, answers, predictions, greedy) -> None:
    """Groups of args.concurrency prompts at once; per set-up, each group's fastest wall time."""
    n = args.concurrency
    groups = [list(range(g, g + n)) for g in range(0, len(prompts) - n + 1, n)]
    walls: dict[str, list[float]] = {s: [float("inf")] * len(groups) for s in SETUPS}
    drafted: dict[str, list[int]] = {s: [0, 0] for s in SETUPS}
    for _ in range(args.repeats):
        for g, group in enumerate(groups):
            for setup in SETUPS:
                t0 = time.perf_counter()
                outs = run_group(plain if setup == "plain" else spec, [prompts[i] for i in group],
                                 [with_prediction(greedy, setup, predictions[i]) for i in group])
                walls[setup][g] = min(walls[setup][g], time.perf_counter() - t0)
                for i, out in zip(group, outs):
                    assert out.outputs[0].token_ids == answers[i], setup
                    drafted[setup][0] += out.metrics.num_draft_tokens
                    drafted[setup][1] += out.metrics.num_accepted_draft_tokens
    tokens = [sum(len(answers[i]) for i in group) for group in groups]
    print(f"{args.model}, {len(groups)} groups of {n} Spec-Bench first turns at once, greedy, {args.max_tokens} "
          f"tokens, {args.threads} threads; output tok/s of a group, prefill included, fastest of {args.repeats}")
    print("| set-up | output tok/s (mean over groups) | over plain: geomean | min | max | accepted / drafted tokens |")
    print("|---|---:|---:|---:|---:|---:|")
    for setup in SETUPS:
        ratios = [b / w for b, w in zip(walls["plain"], walls[setup])]
        d, a = drafted[setup]
        rate = statistics.mean(t / w for t, w in zip(tokens, walls[setup]))
        print(f"| {setup} | {rate:.1f} | {statistics.geometric_mean(ratios):.2f}x | {min(ratios):.2f}x | "
              f"{max(ratios):.2f}x | {a:,} / {d:,} |")


if __name__ == "__main__":
    main()
