"""Where one round of `loom bench --server`'s load goes, in the engine alone: N requests of the
server benchmark's prompts (Spec-Bench first turns, round-robin over the categories, cut to
1,000 characters, raw text as the completions endpoint sends them), all added at once, 64
greedy tokens each past EOS. Reports output tok/s, the prefill steps' and the decode steps'
time, and per phase the time in each loom kernel and outside them (Python, torch).

    .venv/bin/python benchmarks/round_profile.py [--model gemma3-270m] [--requests 32]
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict
from pathlib import Path

from draft_row_cost import Timed   # the kernel module with each call's time added to a dict by name

from loom import kernels
from loom.bench.load import LoadSettings
from loom.bench.prompts import SPEC_BENCH_PATH, load_spec_bench


def prompts(tok, n: int, path: Path) -> list[list[int]]:
    """The server benchmark's first n prompts, cut as it cuts them, as token ids."""
    texts = load_spec_bench(path)
    return [tok.encode(texts[i % len(texts)][:LoadSettings.prompt_chars]) for i in range(n)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="gemma3-270m")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--prompts", type=Path, default=SPEC_BENCH_PATH)
    args = ap.parse_args()
    totals: dict[str, dict[str, float]] = defaultdict(lambda: defaultdict(float))
    module = kernels.load()
    if module is None:
        raise SystemExit(f"loom kernels unavailable: {kernels.unavailable_reason()}")
    timed = kernels._module = Timed(module, totals["prefill"])   # before the model binds the module
    from loom import SamplingParams
    from loom.config import EngineConfig
    from loom.engine.engine import Engine

    engine = Engine(EngineConfig.create(args.model, threads=args.threads, enable_prefix_caching=False))
    engine.runner.model.stack = None   # the layers' calls one by one, each timed (not in one decode_layers)
    batch = prompts(engine.tokenizer, args.requests, args.prompts)
    params = SamplingParams(temperature=0, max_tokens=64, ignore_eos=True)
    print(f"{args.model}, kernels {kernels.variant()}, {args.requests} requests, "
          f"{sum(map(len, batch))} prompt tokens")
    for rep in range(args.repeats):
        totals.clear()
        wall = {"prefill": 0.0, "decode": 0.0}
        steps = {"prefill": 0, "decode": 0}
        for p in batch:
            engine.add_request({"prompt_token_ids": p}, params)
        out, t0 = 0, time.perf_counter()
        while engine.has_unfinished_requests():
            sched = engine.scheduler
            phase = ("prefill" if sched.waiting or any(r.num_computed_tokens < len(r.all_token_ids) - 1
                                                         for r in sched.running) else "decode")
            timed.totals = totals[phase]
            t = time.perf_counter()
            outs = engine.step()
            wall[phase] += time.perf_counter() - t
            steps[phase] += 1
            out += sum(len(o.outputs[0].delta_token_ids) for o in outs)
        total = time.perf_counter() - t0
        print(f"repeat {rep + 1}: {out / total:.0f} output tok/s in {total:.2f} s")
        for phase in ("prefill", "decode"):
            k = totals[phase]
            split = ", ".join(f"{name} {v * 1e3:.1f}" for name, v in sorted(k.items(), key=lambda x: -x[1]))
            print(f"  {phase}: {steps[phase]} steps, {wall[phase] * 1e3:.0f} ms; kernels (ms): {split}; "
                  f"outside kernels {(wall[phase] - sum(k.values())) * 1e3:.0f} ms")


if __name__ == "__main__":
    main()
