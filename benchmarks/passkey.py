"""Passkey retrieval under KV eviction: a 5-digit number hidden in filler text at several depths.

The prompt is synthetic (generated here, seeded): repeated filler sentences, the passkey line
at a fraction `depth` of the way in, and the question at the end; the model answers greedily
and a trial counts as found when the passkey's digits are in the first 12 generated tokens.
Each configuration (full KV, StreamingLLM, SnapKV at each budget, for each KV cache type of
`--kv-cache-dtypes`) runs the same prompts; the KV types are engines sharing one copy of the model. The prefix cache is on, as a server runs: full KV computes the prompt first; SnapKV,
whose prefill is full attention too, takes it from the cache except its observation window,
which it computes for the queries; StreamingLLM takes at most its budget from the cache and
computes the rest chunk by chunk over its cut context (docs/kv_eviction.md).

Run from the repository root:
    .venv/bin/python benchmarks/passkey.py --model smollm2-135m --lengths 4096 8000 --budgets 512 1024 \
        --kv-cache-dtypes float16 int8
"""

from __future__ import annotations

import argparse
import json
import random
import time

from loom.config import EngineConfig
from loom.engine.engine import Engine
from loom.sampling_params import SamplingParams

FILLER = ("The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. ")
QUESTION = "\nWhat is the pass key? The pass key is"


def prompt_ids(tok, length: int, depth: float, key: int) -> list[int]:
    """About `length` tokens: filler, the key line at `depth`, filler, the question."""
    head = tok.encode("There is an important piece of information hidden inside a lot of irrelevant text. "
                      "Find it and memorize it. I will quiz you about it.\n")
    line = tok.encode(f" The pass key is {key}. Remember it. {key} is the pass key. ", add_special_tokens=False)
    ask = tok.encode(QUESTION, add_special_tokens=False)
    filler = tok.encode(FILLER, add_special_tokens=False)
    room = length - len(head) - len(line) - len(ask)
    body = (filler * (room // len(filler) + 1))[:room]
    cut = int(round(depth * room / len(filler))) * len(filler)
    return head + body[:cut] + line + body[cut:] + ask


def run(engine: Engine, ids: list[int], eviction: dict | None) -> str:
    params = SamplingParams(temperature=0, max_tokens=12, kv_eviction=eviction)
    rid = engine.add_request(ids, params)
    text = ""
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.request_id == rid and out.finished:
                text = out.outputs[0].text
    return text


def engines_for(args) -> dict[str, Engine]:
    """One engine per KV cache type, all on the first one's model and tokenizer."""
    engines: dict[str, Engine] = {}
    for kv in args.kv_cache_dtypes:
        first = next(iter(engines.values()), None)
        config = EngineConfig.create(args.model, threads=args.threads, max_model_len=max(args.lengths) + 64,
                                     kv_cache_dtype=kv)
        engines[kv] = Engine(config, model=first and first.model, tokenizer=first and first.tokenizer)
    return engines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 8000])
    ap.add_argument("--depths", type=float, nargs="+", default=[0.1, 0.5, 0.9])
    ap.add_argument("--budgets", type=int, nargs="+", default=[512, 1024])
    ap.add_argument("--policies", nargs="+", default=["full", "streaming", "snapkv"])
    ap.add_argument("--trials", type=int, default=1, help="keys per (length, depth)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-cache-dtypes", nargs="+", default=["float16"], help="KV cache types to run each policy with")
    ap.add_argument("--json", default=None, help="write the per-trial results here")
    args = ap.parse_args()

    engines = engines_for(args)
    tok = next(iter(engines.values())).tokenizer
    configs = []
    for kv, engine in engines.items():
        tag = f", {kv} KV" if len(engines) > 1 else ""
        configs += [(f"full KV{tag}", engine, None)] if "full" in args.policies else []
        for policy in ("streaming", "snapkv"):
            if policy in args.policies:
                configs += [(f"{policy} {b}{tag}", engine, {"policy": policy, "budget": b}) for b in args.budgets]
    rng = random.Random(args.seed)
    trials = [(n, d, rng.randint(10000, 99999)) for n in args.lengths for d in args.depths for _ in range(args.trials)]
    rows = []
    for n, depth, key in trials:
        ids = prompt_ids(tok, n, depth, key)
        for name, engine, eviction in configs:
            t0 = time.perf_counter()
            text = run(engine, ids, eviction)
            found = str(key) in text.replace(" ", "")
            rows.append({"length": len(ids), "target": n, "depth": depth, "key": key, "config": name,
                         "found": found, "answer": text.strip(), "seconds": round(time.perf_counter() - t0, 2)})
            print(f"{n:>6} depth {depth:.2f} {name:<16} {'found' if found else 'missed':<7} "
                  f"{text.strip()[:40]!r} ({rows[-1]['seconds']} s)", flush=True)
    print(f"\n| configuration | " + " | ".join(f"{n} tokens" for n in args.lengths) + " |")
    print("|---|" + "---|" * len(args.lengths))
    for name, _, _ in configs:
        cells = []
        for n in args.lengths:
            hits = [r["found"] for r in rows if r["config"] == name and r["target"] == n]
            cells.append(f"{sum(hits)}/{len(hits)}")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"model": args.model, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
