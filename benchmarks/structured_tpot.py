"""TPOT overhead of constrained decoding: the same requests constrained and unconstrained, in
interleaved rounds of one engine.

Schemas from ../shared/data/json_schema (the first `--schemas` of each set that compile) are
decoded once constrained (greedy, `--max-tokens` at most: a warm-up that also fills the prefix
cache) and ranked by output length, longest first. Then, per concurrency:

    round k:   unconstrained batch, constrained batch     (k even)
               constrained batch, unconstrained batch     (k odd)

The unconstrained batch is the same prompts, each given its constrained output's length with
`ignore_eos`, so both variants decode the same number of tokens per request and the same batch
at every step; only the grammar work differs. At concurrency 1 a round runs the longest
requests one after another until it holds `--round-tokens` output tokens; at concurrency c > 1
it is the c longest requests at once (repeated until `--round-tokens` if they hold fewer).

Decode time of a variant in a round = sum over its requests of (last token time - first token
time) / sum of (tokens - 1): the time between tokens, weighted by tokens, prefill excluded.
Each round gives one paired ratio constrained / unconstrained; the table gives their median,
min and max over `--rounds` rounds, and the median over pairs of consecutive rounds (one of each
order) of the geometric mean of their two ratios, which cancels a slowdown of whichever variant
runs second (printed too: the median of second / first over rounds). Use an even `--rounds`. Greedy constrained outputs must repeat round after round
(checked: each concurrency first runs its batches once constrained as the reference; a round's
output unlike it is counted and printed, as the two variants would then decode different work).

Prints a Markdown table and the load average (os.getloadavg) before and after each concurrency.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
from pathlib import Path

from structured_bench import SETS, load, prompt_text

from loom import LLM, SamplingParams
from loom.errors import InvalidRequestError
from loom.sampling_params import StructuredOutputsParams


def compiling_schemas(llm: LLM, per_set: int) -> list[dict]:
    """The first `per_set` schemas of each set that compile, interleaved across the sets."""
    chosen: list[list[dict]] = []
    for name in SETS:
        ok = []
        for schema in load(name):
            if len(ok) == per_set:
                break
            try:
                llm.engine.structured.compile(StructuredOutputsParams(json=schema))
                ok.append(schema)
            except InvalidRequestError:
                continue
        chosen.append(ok)
    return [s for group in zip(*chosen) for s in group]


def constrained(schema: dict, max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, temperature=0, structured_outputs={"json": schema})


def warm_up(llm: LLM, schemas: list[dict], max_tokens: int) -> list[tuple[str, dict, list[int]]]:
    """(prompt, schema, constrained greedy token ids) per schema, longest output first."""
    prompts = [prompt_text(llm, s) for s in schemas]
    outs = llm.generate(prompts, [constrained(s, max_tokens) for s in schemas], use_tqdm=False)
    found = [(p, s, list(o.outputs[0].token_ids)) for p, s, o in zip(prompts, schemas, outs)]
    return sorted(found, key=lambda r: -len(r[2]))


def round_batches(ranked: list, concurrency: int, round_tokens: int) -> list[list]:
    """The generate calls of one round: batches of `concurrency` requests (cycling through the
    ranked ones, longest first) until the round holds `round_tokens` output tokens."""
    batches, tokens, i = [], 0, 0
    while tokens < round_tokens:
        batch = [ranked[(i + j) % len(ranked)] for j in range(concurrency)]
        i += concurrency
        batches.append(batch)
        tokens += sum(len(r[2]) for r in batch)
    return batches


def run_batch(llm: LLM, batch: list, grammar: bool, max_tokens: int) -> list:
    """One generate call of a round, constrained or unconstrained (each request given its
    constrained output's length, `ignore_eos`)."""
    if grammar:
        params = [constrained(s, max_tokens) for _, s, _ in batch]
    else:
        params = [SamplingParams(max_tokens=len(ids), temperature=0, ignore_eos=True) for _, _, ids in batch]
    return llm.generate([p for p, _, _ in batch], params, use_tqdm=False)


def reference(llm: LLM, batches: list[list], max_tokens: int) -> list[list]:
    """The round's batches with each request's constrained output as this concurrency decodes
    it (a batch's numerics may differ from a single request's, and so may a greedy token)."""
    return [[(p, s, list(o.outputs[0].token_ids)) for (p, s, _), o in
             zip(batch, run_batch(llm, batch, True, max_tokens))] for batch in batches]


def decode_time(llm: LLM, batches: list[list], grammar: bool, max_tokens: int) -> tuple[float, int, int]:
    """(seconds between tokens, tokens - 1, outputs unlike the reference), summed over the
    round's calls, one variant."""
    seconds, gaps, changed = 0.0, 0, 0
    for batch in batches:
        for (_, _, ids), o in zip(batch, run_batch(llm, batch, grammar, max_tokens)):
            got = list(o.outputs[0].token_ids)
            changed += got != ids if grammar else len(got) != len(ids)
            if len(got) > 1:
                seconds += o.metrics.last_token_time - o.metrics.first_token_time
                gaps += len(got) - 1
    return seconds, gaps, changed


def rounds(llm: LLM, batches: list[list], n: int, max_tokens: int) -> list[dict]:
    """`n` rounds, the order of the two variants alternating; per round the ms per token of each."""
    found = []
    for k in range(n):
        order = (False, True) if k % 2 == 0 else (True, False)
        ms = {}
        for grammar in order:
            seconds, gaps, changed = decode_time(llm, batches, grammar, max_tokens)
            label = "constrained" if grammar else "free"
            ms[label], ms[f"{label}_tokens"], ms[f"{label}_changed"] = 1e3 * seconds / gaps, gaps, changed
        ms["ratio"] = ms["constrained"] / ms["free"]
        found.append(ms)
        print(f"  round {k}: {'unconstrained first' if k % 2 == 0 else 'constrained first'}, "
              f"{ms['free']:.3f} vs {ms['constrained']:.3f} ms/token ({100 * (ms['ratio'] - 1):+.1f}%), "
              f"{gaps} tokens; outputs unlike the reference: {ms['free_changed']} / {ms['constrained_changed']}",
              flush=True)
    return found


def balanced(runs: list[dict]) -> list[float]:
    """Per pair of consecutive rounds (one of each order), the geometric mean of their two ratios:
    a slowdown of whichever variant runs second in a round cancels out of it."""
    return [(a["ratio"] * b["ratio"]) ** 0.5 for a, b in zip(runs[::2], runs[1::2])]


def second_slower(runs: list[dict]) -> float:
    """Median over rounds of (the variant run second) / (the one run first): the order effect."""
    return statistics.median(r["ratio"] if k % 2 == 0 else 1 / r["ratio"] for k, r in enumerate(runs))


def row(concurrency: int, requests: int, runs: list[dict], load_before, load_after) -> str:
    ratios = sorted(100 * (r["ratio"] - 1) for r in runs)
    pairs = balanced(runs)
    free = statistics.median(r["free"] for r in runs)
    cons = statistics.median(r["constrained"] for r in runs)
    return (f"| {concurrency} | {requests} | {runs[0]['free_tokens']} | {len(runs)} | {free:.2f} | {cons:.2f} | "
            f"**{statistics.median(ratios):+.1f}%** | {ratios[0]:+.1f}% .. {ratios[-1]:+.1f}% | "
            f"{100 * (statistics.median(pairs) - 1) if pairs else float('nan'):+.1f}% | "
            f"{100 * (second_slower(runs) - 1):+.1f}% | "
            f"{sum(r['free_changed'] + r['constrained_changed'] for r in runs)} | "
            f"{load_before[0]:.2f} -> {load_after[0]:.2f} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--schemas", type=int, default=11, help="schemas per set that compile")
    ap.add_argument("--concurrency", default="1,32", help="comma-separated")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--round-tokens", type=int, default=300, help="output tokens per round, at least")
    ap.add_argument("--max-tokens", type=int, default=256, help="per request")
    ap.add_argument("--json", help="write every round's figures here")
    args = ap.parse_args()
    levels = [int(c) for c in args.concurrency.split(",")]
    llm = LLM(args.model, max_num_seqs=max(levels + [8]), num_blocks=4096)
    ranked = warm_up(llm, compiling_schemas(llm, args.schemas), args.max_tokens)
    print(f"{len(ranked)} schemas; constrained output lengths {[len(r[2]) for r in ranked]}", flush=True)
    lines = ["| concurrent | requests per round | tokens per round | rounds | unconstrained ms/token "
             "| constrained ms/token | overhead (median of paired ratios) | min .. max "
             "| overhead (median over round pairs) | second run of a round slower by | outputs changed "
             "| load average (1 min) |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|"]
    raw = {}
    for c in levels:
        batches = reference(llm, round_batches(ranked, c, args.round_tokens), args.max_tokens)
        before = os.getloadavg()
        print(f"concurrency {c}: {len(batches)} call(s) of {c} per round; load {before[0]:.2f}", flush=True)
        raw[c] = rounds(llm, batches, args.rounds, args.max_tokens)
        lines.append(row(c, sum(len(b) for b in batches), raw[c], before, os.getloadavg()))
    print("\n".join(lines), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(raw, indent=1))


if __name__ == "__main__":
    main()
